"""One P rank's control loop: its ZMQ ROUTER, parked pulls, replies from finished writes.

Nothing one peer sends can end this loop: every item (a message, a parked pull, a reply, the lease
sweep) runs under its own guard; an unexpected exception costs that item an ERROR reply (naming its
transfer and request when they can be read), a log line and a count of `kvferry_producer_errors_total`.
Heartbeats are answered here and nothing here waits on the engine thread, the data plane or a
checksum: writes and their checksums run on the per-peer send threads. Pulls that come before their
KV is ready wait in `parked.py` (which also pushes a running prefill's blocks early). What strangers
can make the socket spend is bounded in `guard.py`; one turn reads messages for at most
`TURN_BUDGET_S`, then answers what it owes (heartbeat acks first in line), so no flood holds a reply
back.
"""

from __future__ import annotations

import contextlib
import functools
import ipaddress
import logging
import socket
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable

import msgspec
import zmq

from kvferry.connector.auth import (
    TO_DECODE,
    TO_PREFILL,
    AuthError,
    Opener,
    Sealer,
    WrongReceiver,
    boot_id,
    prefill_receiver,
    remember,
)
from kvferry.connector.layout import overlap
from kvferry.connector.messages import (
    FirstToken,
    Heartbeat,
    HeartbeatAck,
    Inbound,
    MessageError,
    NotMe,
    Outbound,
    PullRequest,
    PullResponse,
    Release,
    Status,
    decode_inbound,
    encode,
    salvage_ids,
)
from kvferry.connector.prefill.guard import Connections, DropLog, configure_router
from kvferry.connector.prefill.parked import ParkedPulls
from kvferry.connector.prefill.records import Kind, Write
from kvferry.connector.prefill.writes import Pushed, RankShared, RankWriter
from kvferry.connector.prefill.writes import response as _response
from kvferry.transfer.addr import canonical_addr, join_addr

log = logging.getLogger(__name__)

POLL_S = 0.05  # the longest one turn waits for a message
TURN_BUDGET_S = 0.02  # the most one turn spends reading messages before it sends what it owes


class RankLoop(threading.Thread):
    def __init__(self, shared: RankShared, rank: int, host: str, port: int, advertise_host: str) -> None:
        super().__init__(name=f"kv-producer-rank{rank}", daemon=True)
        self.shared = shared
        self.rank = rank
        self.writer = RankWriter(shared, rank)
        self.sock = shared.ctx.socket(zmq.ROUTER)
        configure_router(self.sock, shared.secret)
        if port:
            self.sock.bind(f"tcp://{join_addr(host, port)}")
        else:
            port = self.sock.bind_to_random_port(f"tcp://[{host}]" if ":" in host else f"tcp://{host}")
        self.bound = f"tcp://{join_addr(host, port)}"
        self.address = f"tcp://{join_addr(advertise_host, port)}"  # what the bootstrap server hands to D
        self.drops = DropLog(shared.metrics, rank)
        self.conns = Connections(self.sock, port, self.drops, shared.realtime)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._outbox: deque[tuple[bytes, Outbound]] = deque()
        # D seals for the address it dialled, which is the one we advertise, and for this process's boot
        # id (both from our bootstrap answer): what D sealed for an earlier P at this address is refused.
        # We answer the D session we heard from on each connection (ROUTER identity → session), so no
        # reply fits another socket.
        self.boot = boot_id()
        self._sealer = Sealer(shared.secret, TO_DECODE)
        self._opener = Opener(shared.secret, TO_PREFILL, prefill_receiver(self.address, self.boot))
        self._sessions: OrderedDict[bytes, bytes] = OrderedDict()
        self.parked = ParkedPulls(shared, rank, self.writer, self.reply, self._guard, self._on_pull, self.wake)
        self._last_turn = time.monotonic()

    def wake(self) -> None:
        # A full buffer means it is already awake; an error means it is shutting down.
        with contextlib.suppress(BlockingIOError, OSError):
            self._wake_w.send(b"\0")

    def reply(self, identity: bytes, message: Outbound) -> None:
        self._outbox.append((identity, message))
        self.wake()

    # ---- the loop ---------------------------------------------------------------------------------
    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self._wake_r.fileno(), zmq.POLLIN)  # pyzmq reports plain sockets by fd
        poller.register(self.conns.monitor, zmq.POLLIN)
        try:
            while not self.shared.stop.is_set():
                self._guard("poll", lambda: self._turn(poller))
        finally:
            self.conns.close()
            self.sock.close(0)
            self._wake_r.close()
            self._wake_w.close()

    def _turn(self, poller: zmq.Poller) -> None:
        events = dict(poller.poll(int(POLL_S * 1000)))
        # The lease sweep judges by this instant, taken before we read the socket, so every heartbeat
        # that reached us by then renews first; and if this turn came late (P itself starved or
        # frozen: ZMQ's I/O thread may not have handed over what D sent meanwhile), as of before the
        # overrun. Time P could not listen never counts as D's silence.
        polled = time.monotonic()
        overrun = max(0.0, polled - self._last_turn - 2 * POLL_S)
        self._last_turn = polled
        if self._wake_r.fileno() in events:
            with contextlib.suppress(BlockingIOError):
                while self._wake_r.recv(4096):
                    pass
        if self.conns.monitor in events:
            self.conns.on_events()
        self.shared.realtime.tick()
        self._flush()
        if self.sock in events:
            self._drain_socket()
        self.parked.retry()
        self._flush()
        if self.rank == min(self.shared.engines):  # one loop sweeps
            self._guard("lease sweep", lambda: self._cancel(self.shared.table.expire(polled - overrun)))

    def _cancel(self, writes: list[Write]) -> None:
        """Writes whose lease ran out: make them fail now (their D stopped heartbeating)."""
        # Each write by its grant: a healthy transfer's write to the same D must go on (and one that
        # starts after this sweep is never cut by it).
        for w in writes:
            log.debug("lease lost: cancelling the write of P rank %d to %s for %s", w.p_rank, w.peer, w.transfer_id)
            self.shared.engines[w.p_rank].abort_writes(w.peer, w.token)

    def _guard(self, what: str, fn: Callable[[], None], on_error: Callable[[Exception], None] | None = None) -> None:
        try:
            fn()
        except Exception as exc:
            if self.shared.stop.is_set():
                return
            log.exception("producer rank %d: %s failed (the loop goes on)", self.rank, what)
            self.shared.metrics.producer_errors.inc()
            if on_error is not None:
                with contextlib.suppress(Exception):
                    on_error(exc)

    def _flush(self) -> None:
        while self._outbox:
            identity, message = self._outbox.popleft()
            self._guard("reply", functools.partial(self._send, identity, message))

    def _send(self, identity: bytes, message: Outbound) -> None:
        # With the secret an unknown session (evicted from the LRU) raises: logged and counted by _guard.
        sealed = self._sealer.seal(encode(message), self._sessions.get(identity))
        self.sock.send_multipart([identity, sealed], zmq.NOBLOCK)

    def _drain_socket(self) -> None:
        """Messages until none is left or the turn's budget is spent (then poll again: replies, parked
        pulls and the lease sweep get their turn); heartbeat acks go out as they are made."""
        ends = time.monotonic() + TURN_BUDGET_S
        while time.monotonic() < ends:
            try:
                head = self.sock.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._guard("message", functools.partial(self._read_message, head))
            if self._outbox:
                self._flush()

    def _read_message(self, head: zmq.Frame) -> None:
        """Frame by frame, so a message of many frames is counted, not turned into a list first: ours
        are exactly [identity, sealed]."""
        identity = head.bytes
        # With the secret a message got here through CurveZMQ's handshake under the secret's key: its
        # connection is proven (without one: it speaks ZMTP on loopback), never evicted by the cap.
        self.conns.prove(int(head.get(zmq.SRCFD)))
        body = self.sock.recv(zmq.NOBLOCK) if self.sock.rcvmore else None
        extra = 0
        while self.sock.rcvmore:  # libzmq delivers a message whole: the rest is here, just unread
            self.sock.recv(zmq.NOBLOCK, copy=False)
            extra += 1
        if body is None or extra:
            self._refuse(identity, body, "frames", f"{1 + (body is not None) + extra} frames, not 2")
            return
        self._on_message(identity, body)

    def _refuse(self, identity: bytes, body: bytes | None, reason: str, why: str) -> None:
        """A message we will not act on. Without a secret the loopback peer is told what was wrong; with
        one it gets no answer (it would tell which ids exist), a count and a rate-limited warning."""
        if not self._opener.authenticated:
            tid, rid = salvage_ids(body) if body is not None else ("", "")
            self.reply(identity, PullResponse(Status.ERROR, rid, tid, err_msg=f"malformed message: {why}"))
            return
        self.shared.metrics.control_auth_failures.labels(side="prefill").inc()
        self.drops.drop(reason, why)

    # ---- messages ---------------------------------------------------------------------------------
    def _on_message(self, identity: bytes, sealed: bytes) -> None:
        try:
            session, data = self._opener.unseal(sealed)
        except WrongReceiver as exc:
            self._refuse(identity, sealed, exc.reason, str(exc))
            if exc.session:  # a holder of the secret sealed it for another process (an earlier one here)
                remember(self._sessions, identity, exc.session)
                self.reply(identity, NotMe(exc.receiver))
            return
        except AuthError as exc:
            self._refuse(identity, sealed, exc.reason, str(exc))
            return
        remember(self._sessions, identity, session)
        try:
            message = decode_inbound(data)
        except MessageError as exc:
            tid, rid = salvage_ids(data)
            self.reply(identity, PullResponse(Status.ERROR, rid, tid, err_msg=f"malformed message: {exc}"))
            return

        def answer(exc: Exception) -> None:
            if isinstance(message, PullRequest):
                self.reply(identity, _response(message, Status.ERROR, err_msg=f"P internal error: {exc!r}"))

        self._guard("message", lambda: self._dispatch(identity, message), answer)

    def _dispatch(self, identity: bytes, message: Inbound) -> None:
        if isinstance(message, Heartbeat):
            unknown, working = self.shared.table.renew(message.transfer_ids, message.lease_s, time.monotonic())
            self.reply(identity, HeartbeatAck(unknown, working))
        elif isinstance(message, Release):
            self.shared.table.release(message.transfer_ids, time.monotonic())
        else:
            self._on_pull(identity, message, time.monotonic())

    def _invalid(self, pull: PullRequest) -> str | None:
        spec = self.shared.layout
        if pull.d_tp_size < 1 or (spec.num_kv_heads % pull.d_tp_size and not spec.replicated):
            return f"D tp_size {pull.d_tp_size} does not divide {spec.num_kv_heads} KV heads"
        if not 0 <= pull.d_tp_rank < pull.d_tp_size:
            return f"D tp_rank {pull.d_tp_rank} out of range"
        if overlap(spec.num_kv_heads, self.shared.tp_size, self.rank, pull.d_tp_size, pull.d_tp_rank,
                   spec.replicated) is None:
            return f"D rank {pull.d_tp_rank} shares no KV heads with P rank {self.rank}"
        prompt_blocks = max(0, -(-pull.num_tokens // spec.block_size))
        if pull.first_block and not 0 <= pull.first_block < prompt_blocks:
            return f"first_block {pull.first_block} out of range [0, {prompt_blocks}) for {pull.num_tokens} tokens"
        if pull.block_ids:
            if spec.blocks_for(pull.num_tokens) > spec.num_blocks:  # never P's prompt; and bounds the list below
                return f"{pull.num_tokens} tokens take more blocks than P's pool of {spec.num_blocks}"
            if len(pull.block_ids) != len(spec.pull_positions(pull.num_tokens, pull.first_block)):
                return f"{len(pull.block_ids)} block ids for {pull.num_tokens} tokens from block {pull.first_block}"
        if len(set(pull.block_ids)) != len(pull.block_ids):
            return "duplicate block ids"
        if any(not 0 <= b < pull.d_num_blocks for b in pull.block_ids):
            return f"block id out of range [0, {pull.d_num_blocks})"
        if pull.d_layout is not None:
            if pull.d_layout.num_blocks != pull.d_num_blocks:
                return f"D describes {pull.d_layout.num_blocks} blocks but claims {pull.d_num_blocks}"
            return spec.peer_mismatch(pull.d_layout)
        return None

    def _on_pull(self, identity: bytes, pull: PullRequest, now: float, pushed: Pushed | None = None) -> None:
        """A pull from D, or a parked one whose transfer settled (`pushed`: what partial writes gave it;
        every ERROR answer carries their checksums, so D keeps the blocks that arrived)."""
        addr = _normal_addr(pull.d_transfer_addr)
        if addr is None:
            self.reply(identity, _response(pull, Status.ERROR, err_msg=f"bad d_transfer_addr {pull.d_transfer_addr[:100]!r}"))
            return
        error = self._invalid(pull)
        if error is not None:
            self.reply(identity, _response(pull, Status.ERROR, err_msg=error))
            return
        # One spelling per peer ("018610" and "18610" are one D): one send thread, one connection pool.
        pull = msgspec.structs.replace(pull, d_transfer_addr=addr)
        fault = self.shared.faults.fault_for(pull.transfer_id)
        if fault == "error_reply":
            self.reply(identity, _response(pull, Status.ERROR, err_msg="injected error reply", injected=True))
            return
        if fault == "err_reqs":
            msg = "injected: P lists the request as failed"
            self.reply(identity, _response(pull, Status.FINISH, err_reqs=[pull.d_request_id], err_msg=msg, injected=True))
            return
        # The entries of the transfer's blocks D's ids stand for (past D's prefix-cache hit).
        positions = self.shared.layout.pull_positions(pull.num_tokens, pull.first_block) if pull.block_ids else []
        if pushed is None and (item := self.parked.find(pull)) is not None:
            # The same pull again (D's connection dropped): its answer goes to this connection.
            item.identity, item.deadline = identity, now + self.shared.abort_timeout_s
            self.shared.table.renew([pull.transfer_id], pull.lease_s, now)
            return
        pushed = pushed or Pushed()
        v = self.shared.table.begin_pull(pull, self.rank, now, positions, park=fault == "p_not_ready",
                                         drop=fault == "drop_reply", sent=pushed.sent)
        sums = pushed.checksums
        if v.kind == Kind.ENDED:  # a late pull: P already let this transfer go; say so now, not at a timeout
            if pull.block_ids:
                self.reply(identity, _response(pull, Status.ERROR, cause="expired", checksums=sums,
                                               err_msg=f"transfer already ended on P ({v.why})"))
            else:
                self.reply(identity, _response(pull, Status.FINISH))
        elif v.kind in (Kind.FULL, Kind.DEAD, Kind.SHORT, Kind.REFUSED):
            self.reply(identity, _response(pull, Status.ERROR, err_msg=v.why, checksums=sums))
        elif v.kind == Kind.MISMATCH:
            self.reply(identity, _response(pull, Status.ERROR, cause="prompt_mismatch", err_msg=v.why))
        elif v.kind == Kind.RELEASED:
            self.reply(identity, _response(pull, Status.FINISH))
        elif v.kind == Kind.ANSWERED:  # D sent it again: the answer may have gone with a dropped connection
            assert v.answer is not None
            self.reply(identity, v.answer)
        elif v.kind == Kind.WRITING:  # the same pull again: its write is in flight, and will answer it
            self.reply(identity, _response(pull, Status.CONTINUE))
        elif v.kind == Kind.PARK:
            self.parked.park(identity, pull, now, positions, pushed)
        elif v.kind == Kind.WRITE:
            assert v.write is not None
            self.reply(identity, _response(pull, Status.CONTINUE))
            self._submit(identity, pull, v.write, v.blocks, fault, v.first_token, pushed)
        # DROP: the injected fault, this pull is never answered

    def _submit(self, identity: bytes, pull: PullRequest, w: Write, blocks: list[int], fault: str | None,
                first_token: FirstToken | None, pushed: Pushed) -> None:
        job = functools.partial(self.writer.serve, self.reply, identity, pull, w, blocks, fault, first_token, pushed)
        try:
            self.shared.senders.submit(f"{self.rank}/{pull.d_transfer_addr}", job)
        except Exception:
            self.shared.table.write_done(w, failed=True)
            raise


def _normal_addr(addr: str) -> str | None:
    """`host:port` in the data plane's one spelling (`wire.canonical_addr`), or None for what is not a
    plain address (a host of digits and dots that is no IP, e.g. `127.000.000.001`, would resolve to one
    anyway: another spelling of a peer)."""
    canon = canonical_addr(addr)
    host, _, port = canon.rpartition(":")
    bare = host.strip("[]")
    if not canon or not 0 < int(port) < 65536 or len(bare) > 253:
        return None
    if host.startswith("["):
        return canon  # canonical_addr only brackets what parsed as an IPv6 address
    try:
        ipaddress.ip_address(bare)
        return canon
    except ValueError:
        named = any(c.isalpha() for c in bare) and not bare.lower().startswith("0x")
        return canon if named and all(c.isalnum() or c in "-." for c in bare) else None

