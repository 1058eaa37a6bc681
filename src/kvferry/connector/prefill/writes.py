"""What the rank loops of one producer share (`RankShared`), and one P rank's data-plane writes: run on
the D peer's send thread, each plans its ops, checksums the blocks, writes, then answers the pull
through the rank loop (which owns the ZMQ socket). A partial write (progressive push) answers only
when it fails; its checksums go back to the loop, and the pull's final write answers with all of them."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq

from kvferry.connector.digest import block_key
from kvferry.connector.faults import FaultSpec
from kvferry.connector.layout import KVLayout, overlap, write_ops
from kvferry.connector.messages import FirstToken, HeartbeatAck, PullRequest, PullResponse, Status
from kvferry.connector.metrics import Metrics
from kvferry.connector.prefill.guard import RealTimeWhileCalm
from kvferry.connector.prefill.senders import PeerSenders
from kvferry.connector.prefill.transfers import TransferTable, Write
from kvferry.transfer.base import TransferEngine, TransferError, TransferErrorCause, WriteOp

log = logging.getLogger(__name__)

SCRATCH_REGION = "scratch"  # source of the bytes the `corrupt` fault writes

Reply = Callable[[bytes, PullResponse | HeartbeatAck], None]


@dataclass
class RankShared:
    """What the rank loops of one producer share: the producer builds it and hands it to each loop and
    writer (none of them sees the producer). Not frozen: a live producer's faults may be swapped."""

    ctx: zmq.Context[zmq.Socket[bytes]]
    stop: threading.Event
    in_step: threading.Event  # set while the engine is inside a step
    secret: bytes | None  # seals every control message (connector/auth.py); None: loopback only
    layout: KVLayout
    engines: dict[int, TransferEngine]  # P rank → engine, the ranks served here (the first sweeps leases)
    table: TransferTable
    senders: PeerSenders
    faults: FaultSpec
    metrics: Metrics
    abort_timeout_s: float
    tp_size: int  # P's tensor parallel size (this process may serve only some of its ranks)
    realtime: RealTimeWhileCalm  # the context's I/O threads, lowered while strangers press


@dataclass
class Pushed:
    """What partial writes delivered to one pull: how many of its entries (in order), their checksums, bytes."""

    sent: int = 0
    checksums: list[int] = field(default_factory=list)
    nbytes: int = 0


def response(pull: PullRequest, status: Status, **kw: object) -> PullResponse:
    return PullResponse(status, pull.d_request_id, pull.transfer_id, **kw)  # type: ignore[arg-type]


class RankWriter:
    """The writes of P rank `rank`: what its loop hands to the send threads."""

    def __init__(self, shared: RankShared, rank: int) -> None:
        self.shared = shared
        self.rank = rank
        self.engine = shared.engines[rank]

    def plan_write(self, block_ids: list[int], pull: PullRequest, num_blocks: int | None = None,
                   first: int = 0) -> tuple[list[WriteOp], list[int]]:
        """Ops for the pull's entries [first, first + len(block_ids)) from P's `block_ids` (of them, the
        first `num_blocks`, default all), and the checksums of all of them."""
        layout = self.shared.layout
        heads = overlap(layout.num_kv_heads, self.shared.tp_size, self.rank, pull.d_tp_size, pull.d_tp_rank,
                        layout.replicated)
        assert heads is not None
        src = block_ids[: len(pull.block_ids) - first]
        n = len(src) if num_blocks is None else num_blocks
        self.shared.layout.stage_out(src)
        dst = pull.block_ids[first : first + n]
        ops = write_ops(self.shared.layout, src[:n], dst, heads, pull.d_num_blocks, pull.d_layout)
        # Keyed by the secret where there is one: a stranger cannot forge the checksums.
        key = block_key(self.shared.secret, pull.transfer_id, pull.grant_token)
        checksums = ([self.shared.layout.checksum(b, heads, key, first + i) for i, b in enumerate(src)]
                     if pull.want_checksums else [])
        return ops, checksums

    def serve(self, reply: Reply, identity: bytes, pull: PullRequest, w: Write, blocks: list[int],
              fault: str | None, first_token: FirstToken | None = None, pushed: Pushed | None = None) -> None:
        """Runs on the peer's send thread: checksums, the data-plane write, then the reply. `pushed`: what
        partial writes delivered before (`blocks` are the rest); the answer carries their checksums too."""
        pushed = pushed or Pushed()
        if not self.shared.table.write_wanted(w):
            self._done(reply, identity, w, response(pull, Status.ERROR, cause="expired", checksums=pushed.checksums,
                                                    err_msg="lease lost before the write started"))
            return
        started = time.monotonic()
        checksums: list[int] = []
        try:
            checksums, nbytes = self._write(pull, w, blocks, pushed.sent, fault, checksums)
        except TransferError as exc:
            self._done(reply, identity, w, response(pull, Status.ERROR, err_msg=f"transport: {exc}",
                                                    checksums=pushed.checksums + checksums, cause="transport",
                                                    injected=fault == "transport"))
            return
        except Exception as exc:  # never let a send thread die silently
            self._done(reply, identity, w, self._internal(pull, exc, pushed.checksums))
            return
        self.shared.metrics.kv_transfers.inc()
        self.shared.metrics.kv_transfer_seconds.observe(time.monotonic() - started)
        self._done(reply, identity, w, response(pull, Status.FINISH, ok_reqs=[pull.d_request_id],
                                                checksums=pushed.checksums + checksums,
                                                bytes_written=pushed.nbytes + nbytes, first_token=first_token))

    def serve_part(self, reply: Reply, identity: bytes, pull: PullRequest, w: Write, blocks: list[int],
                   fault: str | None, pushed: Pushed, done: Callable[[Pushed | None], None]) -> None:
        """Runs on the peer's send thread: a partial write of the pull's entries from `pushed.sent` on.
        `done` gets what the pull has received after it, or None when this write answered the pull (it
        failed: ERROR at once, with the checksums of every block written so far). A write its transfer no
        longer wants writes nothing: the loop then answers why the transfer ended."""
        if not self.shared.table.write_wanted(w):
            self.shared.table.write_done(w, failed=False, partial=True)
            done(pushed)
            return
        checksums: list[int] = []
        try:
            checksums, nbytes = self._write(pull, w, blocks, pushed.sent, fault, checksums)
        except Exception as exc:
            answer = (response(pull, Status.ERROR, err_msg=f"transport: {exc}", checksums=pushed.checksums + checksums,
                               cause="transport", injected=fault == "transport")
                      if isinstance(exc, TransferError) else self._internal(pull, exc, pushed.checksums))
            self._done(reply, identity, w, answer)
            done(None)
            return
        self.shared.table.write_done(w, failed=False, partial=True)
        now = Pushed(pushed.sent + len(blocks), pushed.checksums + checksums, pushed.nbytes + nbytes)
        # D keeps these blocks if this P dies before its final answer (queued before `done` wakes the loop).
        reply(identity, response(pull, Status.CONTINUE, checksums=now.checksums, bytes_written=now.nbytes))
        done(now)

    def _write(self, pull: PullRequest, w: Write, blocks: list[int], first: int, fault: str | None,
               checksums: list[int]) -> tuple[list[int], int]:
        """The data-plane write of the pull's entries [first, first + len(blocks)) (the injected faults
        included); fills `checksums` before it writes, so a failure still reports them. Returns them and
        the bytes written."""
        deadline = time.monotonic() + self.shared.abort_timeout_s
        # The injected `transport` fault breaks the data plane after half of the blocks.
        upto = len(blocks) // 2 if fault == "transport" else None
        ops, sums = self.plan_write(blocks, pull, upto, first)
        checksums.extend(sums)
        if self.shared.faults.slow_ms:
            self._slow(w, self.shared.faults.slow_ms / 1000)
        self.engine.write(pull.d_transfer_addr, pull.grant_token, ops, deadline)
        nbytes = sum(op.length for op in ops)
        self.shared.metrics.kv_transfer_bytes.inc(nbytes)
        if fault == "transport":
            raise TransferError(TransferErrorCause.RESET, "injected: data plane broke after part of the blocks")
        if fault == "corrupt":
            mid = ops[len(ops) // 2]
            flip = WriteOp(SCRATCH_REGION, 0, mid.dst_region, mid.dst_offset + mid.length // 2, 8)
            self.engine.write(pull.d_transfer_addr, pull.grant_token, [flip], deadline)
        return checksums, nbytes

    def _internal(self, pull: PullRequest, exc: Exception, checksums: list[int]) -> PullResponse:
        log.exception("serving pull %s failed", pull.transfer_id)
        self.shared.metrics.producer_errors.inc()
        return response(pull, Status.ERROR, err_msg=f"P internal error: {exc!r}", checksums=checksums)

    def _done(self, reply: Reply, identity: bytes, w: Write, answer: PullResponse) -> None:
        """The write returned: the table remembers its answer (for the same pull sent again after D's
        connection dropped, when this reply may be lost), then D is told."""
        self.shared.table.write_done(w, failed=answer.status != Status.FINISH, answer=answer)
        reply(identity, answer)

    def _slow(self, w: Write, seconds: float) -> None:
        """The injected `slow` fault: a write that takes `seconds`, cancelled like a real one when
        D's lease runs out."""
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            if not self.shared.table.write_wanted(w):
                raise TransferError(TransferErrorCause.RESET, "write cancelled: D's lease ran out")
            time.sleep(min(left, 0.02))
