"""Prefill side (worker role): hold finished prefills' blocks per transfer_id and serve D's pulls.

One ZMQ ROUTER and one TransferEngine per TP rank, each served by its own thread. A pull may arrive
before the prefill is done: it is parked and served when the KV is ready, or answered err_reqs
"Timeout waiting for P side ready" after the abort timeout. Writes run on a small thread pool so a
slow peer never stalls the control plane; replies go back through the rank thread (ZMQ sockets are
not thread-safe).
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import zmq

from kvferry.connector.faults import FaultSpec
from kvferry.connector.layout import KVLayout, d_ranks_for, overlap, write_ops
from kvferry.connector.messages import (
    Heartbeat,
    HeartbeatAck,
    Inbound,
    MessageError,
    PullRequest,
    PullResponse,
    Release,
    Status,
    decode_inbound,
    encode,
)
from kvferry.connector.metrics import Metrics
from kvferry.connector.transfers import NOT_READY_MSG, Transfer, TransferTable
from kvferry.transfer.base import TransferEngine, TransferError, TransferErrorCause, WriteOp

log = logging.getLogger(__name__)

SCRATCH_REGION = "scratch"  # source of the bytes the `corrupt` fault writes


class Producer:
    def __init__(
        self,
        layout: KVLayout,
        engines: list[TransferEngine],
        host: str,
        abort_timeout_s: float,
        faults: FaultSpec,
        metrics: Metrics,
    ) -> None:
        self.layout = layout
        self.tp_size = len(engines)
        self.engines = engines
        self.abort_timeout_s = abort_timeout_s
        self.faults = faults
        self.metrics = metrics
        self._scratch = np.frombuffer(b"\xa5" * 64, dtype=np.uint8).copy()
        for engine in engines:
            for name, buffer in layout.regions().items():
                engine.register(name, buffer)
            engine.register(SCRATCH_REGION, self._scratch)
        self.table = TransferTable(abort_timeout_s, metrics, self._pairs)
        self._stop = threading.Event()
        self._ctx = zmq.Context()
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kv-send")
        self._ranks = [_RankLoop(self, rank, host) for rank in range(self.tp_size)]
        self.control_addrs = [r.address for r in self._ranks]
        for r in self._ranks:
            r.start()

    # ---- engine thread ----------------------------------------------------------------------------
    def add_ready(self, transfer_id: str, request_id: str, block_ids: list[int], num_tokens: int) -> None:
        self.table.add_ready(transfer_id, request_id, block_ids, num_tokens, time.monotonic())
        self._wake_all()

    def add_dead(self, transfer_id: str) -> None:
        """The P request ended without KV: answer any pull for it with ERROR."""
        self.table.add_dead(transfer_id, time.monotonic())
        self._wake_all()

    def drain_finished(self) -> set[str]:
        return self.table.drain_finished()

    def close(self) -> None:
        self._stop.set()
        self._wake_all()
        for r in self._ranks:
            r.join()
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._ctx.destroy(linger=0)

    def _wake_all(self) -> None:
        for r in self._ranks:
            r.wake()

    def _pairs(self, d_tp: int) -> set[tuple[int, int]]:
        """(P rank, D rank) pairs that share heads: a transfer is done when each was served."""
        heads = self.layout.num_kv_heads
        return {(p, d) for p in range(self.tp_size) for d in d_ranks_for(heads, self.tp_size, p, d_tp)}

    # ---- pull handling (rank threads) -------------------------------------------------------------
    def plan_write(
        self, t: Transfer, pull: PullRequest, p_rank: int, num_blocks: int | None = None
    ) -> tuple[list[WriteOp], list[int]]:
        """Ops for the first `num_blocks` blocks (default all), and the checksums of all of them."""
        assert t.block_ids is not None
        heads = overlap(self.layout.num_kv_heads, self.tp_size, p_rank, pull.d_tp_size, pull.d_tp_rank)
        assert heads is not None
        src = t.block_ids[: len(pull.block_ids)]
        n = len(src) if num_blocks is None else num_blocks
        ops = write_ops(self.layout, src[:n], pull.block_ids[:n], heads, pull.d_num_blocks)
        checksums = [self.layout.checksum(b, heads) for b in src] if pull.want_checksums else []
        return ops, checksums


class _RankLoop(threading.Thread):
    """One P rank's control loop: ROUTER socket, parked pulls, replies from finished writes."""

    def __init__(self, producer: Producer, rank: int, host: str) -> None:
        super().__init__(name=f"kv-producer-rank{rank}", daemon=True)
        self.p = producer
        self.rank = rank
        self.engine = producer.engines[rank]
        self.sock = producer._ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, 1 << 21)
        port = self.sock.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._outbox: deque[tuple[bytes, PullResponse | HeartbeatAck]] = deque()
        self._parked: list[tuple[bytes, PullRequest, float]] = []

    def wake(self) -> None:
        # A full buffer means it is already awake; an error means it is shutting down.
        with contextlib.suppress(BlockingIOError, OSError):
            self._wake_w.send(b"\0")

    def reply(self, identity: bytes, message: PullResponse | HeartbeatAck) -> None:
        self._outbox.append((identity, message))
        self.wake()

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self._wake_r.fileno(), zmq.POLLIN)  # pyzmq reports plain sockets by fd
        try:
            while not self.p._stop.is_set():
                events = dict(poller.poll(50))
                if self._wake_r.fileno() in events:
                    with contextlib.suppress(BlockingIOError):
                        while self._wake_r.recv(4096):
                            pass
                if self.sock in events:
                    self._drain_socket()
                self._retry_parked()
                while self._outbox:
                    identity, message = self._outbox.popleft()
                    self.sock.send_multipart([identity, encode(message)], zmq.NOBLOCK)
                if self.rank == 0:
                    self.p.table.expire(time.monotonic())
        except zmq.ZMQError as exc:
            if not self.p._stop.is_set():
                log.exception("producer rank %d loop died: %s", self.rank, exc)
        finally:
            self.sock.close(0)
            self._wake_r.close()
            self._wake_w.close()

    def _drain_socket(self) -> None:
        while True:
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._on_message(frames)

    def _on_message(self, frames: list[bytes]) -> None:
        if len(frames) != 2:
            if frames:
                self.reply(frames[0], PullResponse(Status.ERROR, err_msg="expected exactly one frame"))
            return
        identity, data = frames
        try:
            message = decode_inbound(data)
        except MessageError as exc:
            self.reply(identity, PullResponse(Status.ERROR, err_msg=f"malformed message: {exc}"))
            return
        try:
            self._dispatch(identity, message)
        except Exception as exc:  # a bad message must cost one ERROR reply, never the rank's loop
            log.exception("producer rank %d failed on a message", self.rank)
            self.reply(identity, PullResponse(Status.ERROR, err_msg=f"P internal error: {exc!r}"))

    def _dispatch(self, identity: bytes, message: Inbound) -> None:
        if isinstance(message, Heartbeat):
            self.reply(identity, self._heartbeat(message))
        elif isinstance(message, Release):
            self._release(message)
        else:
            self._on_pull(identity, message, time.monotonic())

    def _heartbeat(self, hb: Heartbeat) -> HeartbeatAck:
        return HeartbeatAck(self.p.table.renew(hb.transfer_ids, hb.lease_s, time.monotonic()))

    def _release(self, release: Release) -> None:
        self.p.table.release(release.transfer_ids, time.monotonic())

    def _invalid(self, pull: PullRequest) -> str | None:
        spec = self.p.layout
        if pull.d_tp_size < 1 or spec.num_kv_heads % pull.d_tp_size:
            return f"D tp_size {pull.d_tp_size} does not divide {spec.num_kv_heads} KV heads"
        if not 0 <= pull.d_tp_rank < pull.d_tp_size:
            return f"D tp_rank {pull.d_tp_rank} out of range"
        if overlap(spec.num_kv_heads, self.p.tp_size, self.rank, pull.d_tp_size, pull.d_tp_rank) is None:
            return f"D rank {pull.d_tp_rank} shares no KV heads with P rank {self.rank}"
        if pull.block_ids and len(pull.block_ids) != -(-pull.num_tokens // spec.block_size):
            return f"{len(pull.block_ids)} block ids for {pull.num_tokens} tokens"
        if len(set(pull.block_ids)) != len(pull.block_ids):
            return "duplicate block ids"
        if any(not 0 <= b < pull.d_num_blocks for b in pull.block_ids):
            return f"block id out of range [0, {pull.d_num_blocks})"
        return None

    def _on_pull(self, identity: bytes, pull: PullRequest, arrived: float) -> None:
        error = self._invalid(pull)
        if error is not None:
            self.reply(identity, self._response(pull, Status.ERROR, err_msg=error))
            return
        fault = self.p.faults.fault_for(pull.transfer_id)
        if fault == "error_reply":
            self.reply(identity, self._response(pull, Status.ERROR, err_msg="injected error reply", injected=True))
            return
        if fault == "err_reqs":
            msg = "injected: P lists the request as failed"
            self.reply(identity, self._response(pull, Status.FINISH, err_reqs=[pull.d_request_id], err_msg=msg, injected=True))
            return
        table = self.p.table
        with table.lock:
            t = table.get_or_placeholder(pull.transfer_id, arrived)
            if t is None:
                self.reply(identity, self._response(pull, Status.ERROR, err_msg="too many pending transfers"))
                return
            if not pull.block_ids:  # release-only pull: D will never read these blocks
                if t.ready or t.dead:
                    table.finish(t)
                else:
                    t.abandoned = True  # freed the moment the prefill finishes
                self.reply(identity, self._response(pull, Status.FINISH))
                return
            # From the first pull on, D's lease (renewed by its heartbeats) decides how long we hold.
            t.expires = max(t.expires, arrived + (pull.lease_s or self.p.abort_timeout_s))
            if fault == "drop_reply":
                return  # the injected fault: this pull is never answered
            if t.dead:
                msg = t.dead
                table.finish(t)
                self.reply(identity, self._response(pull, Status.ERROR, err_msg=msg))
                return
            if not t.ready or fault == "p_not_ready":
                self._parked.append((identity, pull, arrived + self.p.abort_timeout_s))
                return
            if len(t.block_ids or ()) < len(pull.block_ids):
                table.finish(t)
                self.reply(identity, self._response(pull, Status.ERROR, err_msg="P num blocks less than D"))
                return
            # The injected `transport` fault breaks the data plane after half of the blocks.
            upto = len(pull.block_ids) // 2 if fault == "transport" else None
            ops, checksums = self.p.plan_write(t, pull, self.rank, upto)
            t.inflight += 1
        self.reply(identity, self._response(pull, Status.CONTINUE))
        self.p._pool.submit(self._serve, identity, pull, ops, checksums, fault)

    def _retry_parked(self) -> None:
        if not self._parked:
            return
        now = time.monotonic()
        still: list[tuple[bytes, PullRequest, float]] = []
        parked, self._parked = self._parked, []
        for identity, pull, deadline in parked:
            with self.p.table.lock:
                t = self.p.table.get(pull.transfer_id)
                injected = self.p.faults.fault_for(pull.transfer_id) == "p_not_ready"
                ready_now = t is not None and (t.ready or t.dead) and not injected
            if ready_now:
                self._on_pull(identity, pull, now)
            elif now >= deadline:
                self.reply(identity, self._response(pull, Status.FINISH, err_reqs=[pull.d_request_id], err_msg=NOT_READY_MSG))
                with self.p.table.lock:
                    if t is not None and t.ready:
                        self.p.table.finish(t, expired=True)
                    else:
                        self.p.table.abandon(pull.transfer_id, now)
            else:
                still.append((identity, pull, deadline))
        self._parked.extend(still)

    def _serve(self, identity: bytes, pull: PullRequest, ops: list[WriteOp], checksums: list[int], fault: str | None) -> None:
        """Runs on the send pool: the data-plane write, then the reply."""
        started = time.monotonic()
        deadline = started + self.p.abort_timeout_s
        try:
            if self.p.faults.slow_ms:
                time.sleep(self.p.faults.slow_ms / 1000)
            if fault == "transport":
                self.engine.write(pull.d_transfer_addr, pull.grant_token, ops, deadline)
                raise TransferError(TransferErrorCause.RESET, "injected: data plane broke after part of the blocks")
            self.engine.write(pull.d_transfer_addr, pull.grant_token, ops, deadline)
            if fault == "corrupt":
                mid = ops[len(ops) // 2]
                flip = WriteOp(SCRATCH_REGION, 0, mid.dst_region, mid.dst_offset + mid.length // 2, 8)
                self.engine.write(pull.d_transfer_addr, pull.grant_token, [flip], deadline)
        except TransferError as exc:
            self._done(pull, failed=True)
            self.reply(identity, self._response(pull, Status.ERROR, err_msg=f"transport: {exc}", checksums=checksums,
                                                injected=fault == "transport"))
            return
        except Exception as exc:  # never let a send thread die silently
            log.exception("serving pull %s failed", pull.transfer_id)
            self._done(pull, failed=True)
            self.reply(identity, self._response(pull, Status.ERROR, err_msg=f"P internal error: {exc!r}"))
            return
        nbytes = sum(op.length for op in ops)
        self.p.metrics.kv_transfers.inc()
        self.p.metrics.kv_transfer_bytes.inc(nbytes)
        self.p.metrics.kv_transfer_seconds.observe(time.monotonic() - started)
        self._done(pull, failed=False)
        self.reply(identity, self._response(pull, Status.FINISH, ok_reqs=[pull.d_request_id], checksums=checksums,
                                            bytes_written=nbytes))

    def _done(self, pull: PullRequest, failed: bool) -> None:
        self.p.table.write_done(pull.transfer_id, self.rank, pull.d_tp_rank, pull.d_tp_size, failed)

    @staticmethod
    def _response(pull: PullRequest, status: Status, **kw: object) -> PullResponse:
        return PullResponse(status, pull.d_request_id, pull.transfer_id, **kw)  # type: ignore[arg-type]
