"""One DEALER socket from a D rank to a P rank: routes replies to waiting pulls and watches P's liveness.

A dead P is noticed three ways; a live one is never failed for being slow:
- libzmq's own ZMTP heartbeat: D's I/O thread pings every `--heartbeat-interval`, P's answers without
  its interpreter, so a stopped or hung *process* loses the connection after `--heartbeat-timeout`,
  while a P whose Python is starved of the GIL or the CPU keeps it;
- an established connection that closes is judged by what libzmq's re-dial (every `RECONNECT_MS`)
  meets, counted from the drop: refused (the port is closed: the process is gone, a kill -9 is seen in
  ~10 ms) → dead at once; a completed ZMTP handshake (P's I/O thread answers: alive, not stopped) → the
  pulls go on; neither within the bound P's recent delays allow (ack round trips, and outages it came
  back from, kept per P process across DEALERs: `liveness.DelayEstimator`,
  floor `--heartbeat-timeout`) → dead: a SIGSTOP'd P is dead a ZMTP timeout plus that bound after it
  stopped. How long P's Python was silent before the drop does not count: a starved D (its own I/O
  thread late to read P's pongs) drops connections to live peers too. Across the re-dial nothing is
  lost: the DEALER's routing id is fixed (P's ROUTER hands it over to the new connection), and D sends
  every pull it still waits on again; P answers a repeated pull idempotently (the write in flight:
  CONTINUE; done: its remembered answer). A *new* P process at the same address cannot open what we
  sealed for the old one and says so (a `NotMe` reply, sealed for our session): dead at once. A
  connection that closes inside its handshake proves nothing (libzmq dials again; a P that never
  completes one is dead by the ceiling). A *first* dial refused is a gone P rank too (P's bootstrap
  server still names a rank whose process died: ranks bind before they register): dead at once;
- silence of P's Python: while libzmq says P's process answers, silence is slowness, not death; the
  pulls wait until each request's own deadline (`kv_load_deadline_s`, failing as `deadline` with the
  stage named) unless P itself answers that it cannot serve. Without the ZMTP heartbeat (a ceiling at
  or below the timeout: fixed thresholds) silence is all we know: a heartbeat left unanswered past what
  P's recent ack round trips allow is `peer_dead`. Silence counts from the oldest heartbeat P has not
  answered, never from P's last answer: when D's own loop lags and sends nothing, P is not silent.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from typing import Any

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from kvferry.connector.auth import (
    TO_DECODE,
    TO_PREFILL,
    AuthError,
    Opener,
    Sealer,
    curve_client,
    remember,
)
from kvferry.connector.bootstrap import BootstrapError
from kvferry.connector.decode.liveness import DelayEstimator
from kvferry.connector.decode.pulls import ConsumerConfig
from kvferry.connector.loads import LoadCause
from kvferry.connector.messages import (
    Heartbeat,
    HeartbeatAck,
    MessageError,
    NotMe,
    PullResponse,
    Status,
    decode_response,
    encode,
)

log = logging.getLogger(__name__)

WaiterKey = tuple[str, str]  # (transfer_id, d_request_id)
# Heartbeats awaiting an ack: a verdict comes long before this many at any sane interval and ceiling.
MAX_PINGS = 4096
# Called with the request ids waiting on a P that failed them, the cause (`peer_dead`, or `deadline`
# for a live P that does not progress) and the reason.
OnDead = Callable[[list[str], LoadCause, str], None]
# How a `deadline` for a live P that does not progress begins its reason (after "P at ADDR").
ALIVE_BUT_SILENT = "alive (its connection answers libzmq's pings) but its control loop silent"
# libzmq dials a closed connection again after this (plus up to as much jitter), backing off to the
# max while the dial fails: a refused re-dial (the process is gone) is seen within ~0.03 s.
RECONNECT_MS, RECONNECT_MAX_MS = 10, 1000
_EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED


def routing_id() -> bytes:
    """A DEALER's fixed ZMQ routing id: 16 random bytes, the first not 0 (libzmq's own ids)."""
    return bytes([1 + os.urandom(1)[0] % 255]) + os.urandom(15)


class Dealer:
    def __init__(self, ctx: zmq.asyncio.Context, addr: str, receiver: bytes, on_dead: OnDead, watch_connection: bool,
                 on_rtt: Callable[[float], None] | None = None, secret: bytes | None = None,
                 on_forged: Callable[[], None] | None = None, silence: DelayEstimator | None = None,
                 ping_s: float = 0.0) -> None:
        """`receiver`: the P process we seal for (`RankInfo.receiver`: the address and the rank's boot id);
        `ping_s`: libzmq's heartbeat interval on a watched connection (its timeout: the silence floor,
        `--heartbeat-timeout`); 0: no ZMTP heartbeat."""
        self.addr = addr
        self.receiver = receiver
        # How long an unanswered heartbeat may stay so, learnt from P's ack round trips.
        floor = ConsumerConfig.heartbeat_timeout_s
        self.silence = silence if silence is not None else DelayEstimator(floor, floor)
        self.on_dead = on_dead
        self.on_rtt = on_rtt
        self.on_forged = on_forged
        # Sealed for this P rank of this P process alone; P's replies must name this socket's own
        # session.
        self._sealer = Sealer(secret, TO_PREFILL, receiver)
        self._opener = Opener(secret, TO_DECODE, self._sealer.session)
        # Send times of heartbeats not yet acked: P answers them in order on this one connection.
        self._pings: deque[float] = deque(maxlen=MAX_PINGS)
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, 1 << 21)
        # Fixed, so P's ROUTER (ROUTER_HANDOVER) routes its replies to our re-dialled connection.
        self.sock.setsockopt(zmq.ROUTING_ID, routing_id())
        self.sock.setsockopt(zmq.RECONNECT_IVL, RECONNECT_MS)
        self.sock.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_MAX_MS)
        curve_client(self.sock, secret)
        # Process liveness is libzmq's, so our Python silence may wait for the ceiling (adaptive only).
        zmtp = watch_connection and ping_s > 0
        self.zmtp = zmtp and self.silence.adaptive
        if zmtp:
            ping_ms, timeout_ms = max(1, int(ping_s * 1000)), max(1, int(self.silence.floor * 1000))
            self.sock.setsockopt(zmq.HEARTBEAT_IVL, ping_ms)
            self.sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, timeout_ms)
            self.sock.setsockopt(zmq.HANDSHAKE_IVL, max(timeout_ms, 1000))  # a P stopped mid-connect
        self.waiters: dict[WaiterKey, asyncio.Future[PullResponse]] = {}
        self._sent: dict[WaiterKey, bytes] = {}  # each waiter's pull, sent again after a re-dial
        # When P started writing each pull (its CONTINUE): transfer time excludes waiting for prefill.
        self.writing_since: dict[WaiterKey, float] = {}
        # The checksums P sent with each partial write (progressive push), in the pull's block order: the
        # blocks they cover count if P dies before its answer.
        self.part_checksums: dict[WaiterKey, list[int]] = {}
        # When P last said it still has a transfer queued, prefilling or writing (its HeartbeatAck.working).
        self.working_seen: dict[str, float] = {}
        self.parked_seen: dict[str, float] = {}  # transfers P said it has not taken in yet (their pulls park)
        loop = asyncio.get_running_loop()
        self.last_seen = loop.time()
        self.last_used = loop.time()  # when a message last went out (idle dealers get closed)
        self.waiting_since: float | None = None
        self.connected = False  # an established connection to P (known only when the connection is watched)
        # When an established connection closed, until P answers after libzmq's re-dial (None: unbroken).
        self.dropped: float | None = None
        self.slow_since = 0.0  # when P's process answered but its Python stayed silent past the bound (0: not)
        self._ever_connected = False  # a first dial refused is a gone P rank, as a refused re-dial is
        self._at_least = 0.0  # the least bound our own loop's lag allows (from the last heartbeat tick)
        # P judged dead after its connection closed (the re-dial refused, or nothing by the bound): this
        # DEALER takes no new pull (`Dealers.for_pull`) and its cached bootstrap answer is asked again.
        self.lost = False
        self._tasks = [loop.create_task(self._read())]
        self._monitor: zmq.asyncio.Socket | None = None
        if watch_connection:
            self._monitor = self.sock.get_monitor_socket(_EVENTS)
            self._tasks.append(loop.create_task(self._watch(self._monitor)))
        self.sock.connect(addr)

    def send(self, key: WaiterKey, future: asyncio.Future[PullResponse], data: bytes) -> None:
        if not self.waiters:
            self.waiting_since = asyncio.get_running_loop().time()
        self.waiters[key] = future
        self._sent[key] = data
        self.send_raw(data)

    def send_raw(self, data: bytes) -> None:
        self.last_used = asyncio.get_running_loop().time()
        try:
            self.sock.send(self._sealer.seal(data), zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.warning("control message to %s dropped: %s", self.addr, exc)

    def forget(self, key: WaiterKey) -> float | None:
        """Stop waiting for `key`; returns when P started writing it, if it did."""
        self.waiters.pop(key, None)
        self._sent.pop(key, None)
        self.working_seen.pop(key[0], None)
        self.parked_seen.pop(key[0], None)
        self.part_checksums.pop(key, None)
        return self.writing_since.pop(key, None)

    def silent_for(self, now: float) -> float:
        """How long P has left a heartbeat unanswered (0: none outstanding). Anything P sent since, and
        the start of the current wait, restart the clock."""
        if not self._pings:
            return 0.0
        return now - max(self._pings[0], self.last_seen, self.waiting_since or self.last_seen)

    def heartbeat(self, now: float, lease_s: float, at_least: float = 0.0) -> None:
        """Ping P for the pulls waiting on it; declare it dead once it stays silent past its threshold
        (never below `at_least`: what our own loop's lag says the box allows)."""
        self._at_least = at_least
        if self.dropped is not None:
            self._judge(now)
        if not self.waiters:
            return
        if self.dropped is not None and not self.connected:
            return  # the bound above judges; heartbeats resume on the re-dialled connection
        limit = max(self.silence.ceiling if self.zmtp else self.silence.threshold(), at_least)
        if self.silent_for(now) > limit and int(self.sock.get(zmq.EVENTS)) & zmq.POLLIN:
            self.last_seen = now  # P did answer; our reader is just behind (a busy D)
        silent = self.silent_for(now)
        if silent > limit:
            if not (self.zmtp and self.connected):
                self._dead(f"P at {self.addr} silent for {silent:.1f}s (heartbeat timeout {limit:.1f}s)")
                return
            # libzmq says P's process answers (its pings, or a re-dial it completed): slow, not dead.
            # Only each request's own deadline, or P's own answer, ends the pulls waiting here.
            if not self.slow_since:
                self.slow_since = now
                log.warning("P at %s %s for %.1fs: waiting on it until each request's own deadline",
                            self.addr, ALIVE_BUT_SILENT, silent)
        elif self.slow_since:
            self.slow_since = 0.0
        self.send_raw(encode(Heartbeat(sorted({tid for tid, _ in self.waiters}), lease_s)))
        self._pings.append(now)

    def _judge(self, now: float) -> None:
        """After the connection dropped and until libzmq's re-dial completes a handshake: P is dead once
        the re-dial has not reached its process for longer than its recent round trips allow, counted
        from the drop. How long P's Python was silent before the drop says nothing about its process
        (a starved D drops live connections too); a completed handshake says it lives."""
        if self.lost or self.dropped is None or self.connected:
            return
        limit = max(self.silence.threshold(), self._at_least)
        if now - self.dropped > limit:
            self._lose(f"P at {self.addr} unreachable for {now - self.dropped:.1f}s after its connection dropped "
                       f"(re-dial bound {limit:.1f}s)")

    def _lose(self, reason: str) -> None:
        self.lost = True
        self._dead(reason)

    def resend(self, keys: Iterable[WaiterKey] | None = None) -> None:
        """Send pulls we still wait on again (all of them after a re-dial: P's replies sent while the
        connection was down are gone); P answers a repeat idempotently."""
        for key in list(self.waiters if keys is None else keys):
            if key in self._sent:
                self.send_raw(self._sent[key])

    def _dead(self, reason: str, cause: LoadCause = LoadCause.PEER_DEAD) -> None:
        self._pings.clear()
        request_ids = [rid for _, rid in self.waiters]
        if request_ids:  # before the tables below empty: the failure names each pull's stage from them
            self.on_dead(request_ids, cause, reason)
        self.waiters.clear()
        self._sent.clear()
        self.writing_since.clear()
        self.working_seen.clear()
        self.parked_seen.clear()
        self.part_checksums.clear()

    async def _read(self) -> None:
        while True:
            sealed = await self.sock.recv()
            try:
                message = decode_response(self._opener.open(sealed))
            except (AuthError, MessageError) as exc:
                # Not P's (or not sealed with our secret): it proves nothing about P's liveness either.
                log.warning("reply from %s dropped: %s", self.addr, exc)
                if self.on_forged is not None and isinstance(exc, AuthError):
                    self.on_forged()
                continue
            if isinstance(message, NotMe):
                if message.receiver == self.receiver and not self.lost:
                    self._lose(f"P at {self.addr} restarted: a new process answers at its address")
                continue
            self.last_seen = asyncio.get_running_loop().time()
            if self.connected and self.dropped is not None and not self.lost:
                self.dropped = None  # P answered on the re-dialled connection: the same process, alive
            if isinstance(message, HeartbeatAck):
                if self._pings:
                    rtt = self.last_seen - self._pings.popleft()
                    self.silence.observe(rtt)
                    if self.on_rtt is not None:
                        self.on_rtt(rtt)
                for tid in message.working:
                    self.working_seen[tid] = self.last_seen
                for tid in message.unknown:
                    self.parked_seen[tid] = self.last_seen
                continue
            key = (message.transfer_id, message.d_request_id)
            if message.status == Status.CONTINUE:
                if key in self.waiters:
                    self.writing_since.setdefault(key, self.last_seen)
                    if message.checksums:
                        self.part_checksums[key] = list(message.checksums)
                continue
            future = self.waiters.pop(key, None)
            self._sent.pop(key, None)
            if future is not None and not future.done():
                future.set_result(message)

    async def _watch(self, monitor: Any) -> None:
        while True:
            event = parse_monitor_message(await monitor.recv_multipart())
            now = asyncio.get_running_loop().time()
            if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.connected, self._ever_connected = True, True
                self._pings.clear()  # their acks went with the old connection (or the old process)
                if self.dropped is not None and not self.lost:
                    # How long the process was out of reach is a delay it showed, as an ack's round trip
                    # is: the next drop is judged by it (a starved P's outages come in bursts that grow).
                    self.silence.observe(now - self.dropped)
                    log.info("connection to P at %s re-established after %.1fs; its pulls are sent again",
                             self.addr, now - self.dropped)
                    self.resend()
            elif event["event"] == zmq.EVENT_DISCONNECTED and self.connected:
                self.connected = False
                if not self.lost:
                    self.dropped = now if self.dropped is None else self.dropped
                    log.info("connection to P at %s closed; dialing again", self.addr)
                    self._judge(now)
            elif event["event"] == zmq.EVENT_DISCONNECTED:
                # Closed inside its handshake (P's or our limit ran out): proves nothing about P, and
                # the silence clock keeps running across the attempts.
                log.info("handshake with P at %s did not complete in time; dialing again", self.addr)
            elif event["event"] == zmq.EVENT_CLOSED and not self.connected and (
                    self.dropped is not None or not self._ever_connected):
                # A dial that failed outright (refused: nothing listens at P's port any more), after a
                # dropped connection or as the first one (P's bootstrap server named a rank whose process
                # is gone: ranks bind before they register); not a wait for the receive timeout.
                self._lose(f"connection to P at {self.addr} closed and the re-dial refused: P is gone"
                           if self.dropped is not None else f"dial to P at {self.addr} refused: P's rank is gone")

    def retire(self, reason: str) -> None:
        """Fail what waits on this DEALER (`reason`) and close it."""
        self._dead(reason)
        self.close()

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        if self._monitor is not None:
            self.sock.disable_monitor()
            self._monitor.close(0)
        self.sock.close(0)


class Dealers(dict[tuple[int, str], Dealer]):
    """D's DEALERs: one per (D rank, P rank's control address), each sealed for one P process (its
    receiver: the address and the boot id of P's bootstrap answer). A P restarted at the same address
    (a fixed control port) is another receiver: the first pull for it retires the old DEALER (its
    waiters fail as `peer_dead`), and an answer naming a retired process is never used again."""

    def __init__(self, make: Callable[[str, bytes], Dealer]) -> None:
        super().__init__()
        self._make = make
        self._retired: OrderedDict[bytes, bool] = OrderedDict()  # receivers (address and boot id), an LRU
        # Each P process's delays (ack round trips, outages it came back from), an LRU: they outlive any
        # one DEALER to it (closed when idle, replaced when lost), so the next one judges it by them.
        self._delays: OrderedDict[bytes, DelayEstimator] = OrderedDict()

    def retired(self, receiver: bytes) -> bool:
        return receiver in self._retired

    def live(self) -> set[tuple[str, bytes]]:
        """The P processes we hold an unbroken connection to: a cached answer naming them still holds."""
        return {(d.addr, d.receiver) for d in self.values() if d.connected and d.dropped is None and not d.lost}

    def for_pull(self, d_rank: int, addr: str, receiver: bytes) -> Dealer:
        dealer = self.get((d_rank, addr))
        if dealer is not None and dealer.receiver == receiver and not dealer.lost:
            return dealer
        if self.retired(receiver):
            raise BootstrapError(f"P at {addr} restarted after its bootstrap answer")
        self[(d_rank, addr)] = self._new(addr, receiver)
        if dealer is not None:  # after the new one is in: a failing pull's Release must not use the old
            restarted = dealer.receiver != receiver
            if restarted:
                remember(self._retired, dealer.receiver, True)
            dealer.retire(f"P at {addr} " + ("restarted (a new boot id)" if restarted else "lost its connection"))
        return self[(d_rank, addr)]

    def for_release(self, d_rank: int, addr: str, receiver: bytes) -> Dealer | None:
        """The DEALER to tell that P process to release (a lost one too: it may be the same P); None
        when a later P holds its address (that one refuses what we would seal)."""
        dealer = self.get((d_rank, addr))
        if dealer is None and not self.retired(receiver):
            dealer = self[(d_rank, addr)] = self._new(addr, receiver)
        return dealer if dealer is not None and dealer.receiver == receiver else None

    def _new(self, addr: str, receiver: bytes) -> Dealer:
        dealer = self._make(addr, receiver)
        dealer.silence = self._delays.get(receiver, dealer.silence)
        remember(self._delays, receiver, dealer.silence)
        return dealer

    def sweep(self, now: float, liveness: bool, idle_s: float) -> None:
        """Close DEALERs no pull waits on: at once when their P is gone (a second's grace for a Release
        still in flight), after `idle_s` otherwise."""
        for key, dealer in list(self.items()):
            idle_for = now - dealer.last_used
            gone = liveness and (not dealer.connected or dealer.lost) and idle_for > 1.0
            if not dealer.waiters and (gone or idle_for > idle_s):
                del self[key]
                dealer.close()
