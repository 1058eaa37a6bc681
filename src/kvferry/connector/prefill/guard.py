"""What a stranger can make P's control port spend, bounded.

- **Who gets in.** With `KVFERRY_SECRET` the ROUTER is a CurveZMQ server whose key comes from the
  secret (`auth.curve_server_keys`): a peer that does not hold it fails libzmq's handshake, in libzmq's
  I/O thread, before any frame of it reaches Python (and what does pass is encrypted on the wire).
- **How long a connection may idle.** libzmq closes one that has not finished its handshake after
  `HANDSHAKE_S`, and one that answers no ZMTP PING for `ZMTP_TIMEOUT_S` (no GIL involved). A D starved
  that long dials again with its fixed routing id and takes it over (`ROUTER_HANDOVER`).
- **How many.** libzmq has no connection cap on a ROUTER, so `Connections` counts them from the
  socket's monitor (accepted / disconnected carry the fd) and closes the oldest *unproven* one (no
  message came through it yet: with the secret, only a peer past CurveZMQ's handshake sends one) beyond
  `UNPROVEN_MAX`; proven peers are never evicted.
- **How big.** `MAX_FRAME_BYTES` (1 MiB + the envelope) per frame, `RCVHWM` queued messages per peer.
- **What it takes from liveness.** P's libzmq I/O threads run real-time (`zmq_context`), but only while
  no stranger presses (`RealTimeWhileCalm`): a real-time thread would accept a flood's connections
  faster than the rank loops, at normal priority, evict them.
- **How loud.** `DropLog`: one warning per reason per `LOG_EVERY_S`, every drop counted in
  `kvferry_control_dropped_total{reason}`."""

from __future__ import annotations

import contextlib
import logging
import os
import resource
import socket
import threading
import time
from collections import OrderedDict
from typing import Any

import zmq
from zmq.utils.monitor import parse_monitor_message

from kvferry.connector.auth import curve_server_keys
from kvferry.connector.messages import MAX_FRAME_BYTES
from kvferry.connector.metrics import Metrics
from kvferry.connector.zmq_context import IoThreads

log = logging.getLogger(__name__)

UNPROVEN_MAX = 64  # connections per rank that have not (yet) proven the secret
HANDSHAKE_S = 2.0  # a connection still in ZMTP's handshake after this is closed by libzmq
ZMTP_PING_S, ZMTP_TIMEOUT_S = 1.0, 3.0  # libzmq pings each peer; one silent this long is dropped
RCVHWM = 256  # messages queued per peer before libzmq stops reading its TCP connection
LOG_EVERY_S = 10.0
PRESS_UNPROVEN = 16  # more unproven connections than D ranks open at once: strangers press
CALM_S = 5.0  # P's I/O threads are real-time again this long after the last stranger pressed
EVENTS_PER_TURN = 64  # monitor events one rank-loop turn applies (16-60 µs each on a loaded 2-core box)
_EVENTS = (zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
           | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
_FAILED = {int(zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL), int(zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL),
           int(zmq.EVENT_HANDSHAKE_FAILED_AUTH)}  # a stranger (or a timeout) in CurveZMQ's handshake


def configure_router(sock: zmq.Socket[Any], secret: bytes | None) -> None:
    """Every bound above that libzmq enforces itself; set before bind."""
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
    sock.setsockopt(zmq.RCVHWM, RCVHWM)
    sock.setsockopt(zmq.HANDSHAKE_IVL, int(HANDSHAKE_S * 1000))
    sock.setsockopt(zmq.HEARTBEAT_IVL, int(ZMTP_PING_S * 1000))
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(ZMTP_TIMEOUT_S * 1000))
    # A D DEALER that dials again (its connection dropped) keeps its fixed routing id: its new connection
    # takes that id over, so our replies reach it (with the secret only after CurveZMQ's handshake).
    sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
    if secret:
        _, secret_key = curve_server_keys(secret)
        sock.curve_server = True
        sock.curve_secretkey = secret_key


class DropLog:
    """Dropped control messages and connections: every one counted, at most one warning per reason per
    `LOG_EVERY_S` (a flood must not become a log flood)."""

    def __init__(self, metrics: Metrics, rank: int) -> None:
        self.metrics = metrics
        self.rank = rank
        self._last: dict[str, float] = {}
        self._since: dict[str, int] = {}
        self._counters: dict[str, Any] = {}  # reason -> its labelled counter (looked up once: floods call often)

    def drop(self, reason: str, detail: str = "") -> None:
        counter = self._counters.get(reason)
        if counter is None:
            counter = self._counters[reason] = self.metrics.control_dropped.labels(reason=reason)
        counter.inc()
        now = time.monotonic()
        self._since[reason] = self._since.get(reason, 0) + 1
        if now - self._last.get(reason, -LOG_EVERY_S) >= LOG_EVERY_S:
            n = self._since.pop(reason)
            self._last[reason] = now
            log.warning("producer rank %d: control %s: %d dropped in the last %.0fs%s (kvferry_control_dropped_total)",
                        self.rank, reason, n, LOG_EVERY_S, f"; latest: {detail}" if detail else "")


class RealTimeWhileCalm:
    """P's libzmq I/O threads, real-time while no stranger presses on the control port. At SCHED_RR an
    I/O thread accepts a flood's connections faster than the rank loops, at normal priority, evict the
    unproven ones (docs/security.md), and works every refused handshake ahead of everything else on its
    CPU. So the first sign of strangers (an eviction, a refused handshake, more than `PRESS_UNPROVEN`
    connections still unproven) lowers the threads to normal priority, where accepting and evicting share
    the CPU as any threads do, and `calm_s` without one lifts them again. While strangers flood, a live P on an oversubscribed node may again be called dead; a
    stranger never gets a real-time thread's time beyond the burst before the first sign."""

    def __init__(self, threads: IoThreads, metrics: Metrics, calm_s: float = CALM_S) -> None:
        self._threads = threads
        self._gauge = metrics.control_realtime
        self._calm_s = calm_s
        self._pressed_at: float | None = None
        self._lock = threading.Lock()
        threads.lift()
        self._gauge.set(int(threads.realtime))

    def pressed(self, why: str) -> None:
        with self._lock:
            if self._pressed_at is None:  # lifted until now
                self._threads.lower()
                self._gauge.set(0)
                log.warning("strangers on P's control port (%s): its libzmq I/O threads run at normal priority "
                            "until %.0fs pass without one", why, self._calm_s)
            self._pressed_at = time.monotonic()

    def tick(self) -> None:
        """Each rank-loop turn: lift the threads again once the strangers have been quiet `calm_s`."""
        if self._pressed_at is None or time.monotonic() - self._pressed_at < self._calm_s:
            return
        with self._lock:
            if self._pressed_at is not None and time.monotonic() - self._pressed_at >= self._calm_s:
                self._pressed_at = None
                self._threads.lift()
                self._gauge.set(int(self._threads.realtime))
                log.info("P's control port is calm again: its libzmq I/O threads are real-time")


class Connections:
    """P's accepted control connections by fd; the oldest unproven one goes beyond `cap`."""

    def __init__(self, sock: zmq.Socket[Any], port: int, drops: DropLog, realtime: RealTimeWhileCalm,
                 cap: int = UNPROVEN_MAX) -> None:
        self.port = port
        self.cap = cap
        self.drops = drops
        self.realtime = realtime
        self.monitor: zmq.Socket[Any] = sock.get_monitor_socket(_EVENTS)
        self._sock = sock
        self._unproven: OrderedDict[int, float] = OrderedDict()  # fd -> accepted at, oldest first
        self._proven: set[int] = set()

    def __len__(self) -> int:
        return len(self._unproven) + len(self._proven)

    def on_events(self, budget: int = EVENTS_PER_TURN) -> None:
        """Apply up to `budget` pending monitor events (in order), then evict down to the cap. A flood's
        backlog of events is worked off a slice per turn, between which the rank loop reads D's messages
        and sends its replies (under an idle-connection flood a whole backlog takes up to a second)."""
        for _ in range(budget):
            try:
                event = parse_monitor_message(self.monitor.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                break
            kind, value = int(event["event"]), int(event["value"])
            if kind == zmq.EVENT_ACCEPTED:
                self._proven.discard(value)  # the fd was reused: a new connection
                self._unproven[value] = time.monotonic()
            elif kind == zmq.EVENT_DISCONNECTED:
                self._unproven.pop(value, None)
                self._proven.discard(value)
            elif kind in _FAILED:
                self.drops.metrics.control_auth_failures.labels(side="prefill").inc()  # no secret, no entry
                self.drops.drop("handshake", f"libzmq event {kind}, errno {value}")
                self.realtime.pressed("a refused handshake")
        if len(self._unproven) > PRESS_UNPROVEN:
            self.realtime.pressed(f"{len(self._unproven)} connections unproven")
        while len(self._unproven) > self.cap:
            fd, _ = self._unproven.popitem(last=False)
            self.evict(fd, "connection cap")

    def prove(self, fd: int) -> None:
        if fd >= 0 and self._unproven.pop(fd, None) is not None:
            self._proven.add(fd)

    def evict(self, fd: int, reason: str) -> None:
        """Close one connection under libzmq's feet: shut its socket down (libzmq sees the end of the
        stream and cleans up). Only if the fd still is a TCP socket on our port: never another file."""
        self._unproven.pop(fd, None)
        self._proven.discard(fd)
        self.drops.drop(reason)
        with contextlib.suppress(OSError):
            s = socket.socket(fileno=os.dup(fd))
            try:
                if s.type == socket.SOCK_STREAM and s.getsockname()[1] == self.port:
                    s.shutdown(socket.SHUT_RDWR)
            finally:
                s.close()

    def close(self) -> None:
        with contextlib.suppress(zmq.ZMQError):
            self._sock.disable_monitor()
        self.monitor.close(0)


_budget_stated = False


def state_fd_budget(tp_size: int) -> None:
    """Once per process: raise the soft fd limit to the hard one (as Go's runtime does; a ROUTER flooded
    before eviction catches up must not starve the HTTP and data-plane listeners) and say what kvferry's
    control plane may hold of it."""
    global _budget_stated
    if _budget_stated:
        return
    _budget_stated = True
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = 1 << 20 if hard == resource.RLIM_INFINITY else hard
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    now_soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    log.info("fd budget: soft RLIMIT_NOFILE %d (was %d, hard %d); P's control plane holds at most %d unproven "
             "connections (%d per rank, closed after %.0fs without a handshake) plus one per proven D socket",
             now_soft, soft, hard, tp_size * UNPROVEN_MAX, UNPROVEN_MAX, HANDSHAKE_S)
