"""What the rank loops of one producer share (`RankShared`), and one P rank's data-plane writes: run on
the D peer's send thread, each plans its ops, checksums the blocks, writes, then answers the pull
through the rank loop (which owns the ZMQ socket)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import zmq

from kvferry.connector.digest import block_key
from kvferry.connector.faults import FaultSpec
from kvferry.connector.layout import KVLayout, overlap, write_ops
from kvferry.connector.messages import FirstToken, HeartbeatAck, PullRequest, PullResponse, Status
from kvferry.connector.metrics import Metrics
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


def response(pull: PullRequest, status: Status, **kw: object) -> PullResponse:
    return PullResponse(status, pull.d_request_id, pull.transfer_id, **kw)  # type: ignore[arg-type]


class RankWriter:
    """The writes of P rank `rank`: what its loop hands to the send threads."""

    def __init__(self, shared: RankShared, rank: int) -> None:
        self.shared = shared
        self.rank = rank
        self.engine = shared.engines[rank]

    def plan_write(
        self, block_ids: list[int], pull: PullRequest, num_blocks: int | None = None
    ) -> tuple[list[WriteOp], list[int]]:
        """Ops for the first `num_blocks` blocks (default all), and the checksums of all of them."""
        layout = self.shared.layout
        heads = overlap(layout.num_kv_heads, self.shared.tp_size, self.rank, pull.d_tp_size, pull.d_tp_rank,
                        layout.replicated)
        assert heads is not None
        src = block_ids[: len(pull.block_ids)]
        n = len(src) if num_blocks is None else num_blocks
        self.shared.layout.stage_out(src)
        ops = write_ops(self.shared.layout, src[:n], pull.block_ids[:n], heads, pull.d_num_blocks, pull.d_layout)
        key = block_key(self.shared.secret, pull.transfer_id, pull.grant_token)  # keyed with a secret
        checksums = [self.shared.layout.checksum(b, heads, key, i) for i, b in enumerate(src)] if pull.want_checksums else []
        return ops, checksums

    def serve(self, reply: Reply, identity: bytes, pull: PullRequest, w: Write, blocks: list[int],
              fault: str | None, first_token: FirstToken | None = None) -> None:
        """Runs on the peer's send thread: checksums, the data-plane write, then the reply."""
        if not self.shared.table.write_wanted(w):
            self._done(reply, identity, w, response(pull, Status.ERROR, cause="expired",
                                                    err_msg="lease lost before the write started"))
            return
        started = time.monotonic()
        deadline = started + self.shared.abort_timeout_s
        checksums: list[int] = []
        try:
            # The injected `transport` fault breaks the data plane after half of the blocks.
            upto = len(pull.block_ids) // 2 if fault == "transport" else None
            ops, checksums = self.plan_write(blocks, pull, upto)
            if self.shared.faults.slow_ms:
                self._slow(w, self.shared.faults.slow_ms / 1000)
            self.engine.write(pull.d_transfer_addr, pull.grant_token, ops, deadline)
            if fault == "transport":
                raise TransferError(TransferErrorCause.RESET, "injected: data plane broke after part of the blocks")
            if fault == "corrupt":
                mid = ops[len(ops) // 2]
                flip = WriteOp(SCRATCH_REGION, 0, mid.dst_region, mid.dst_offset + mid.length // 2, 8)
                self.engine.write(pull.d_transfer_addr, pull.grant_token, [flip], deadline)
        except TransferError as exc:
            self._done(reply, identity, w, response(pull, Status.ERROR, err_msg=f"transport: {exc}", checksums=checksums,
                                                    cause="transport", injected=fault == "transport"))
            return
        except Exception as exc:  # never let a send thread die silently
            log.exception("serving pull %s failed", pull.transfer_id)
            self.shared.metrics.producer_errors.inc()
            self._done(reply, identity, w, response(pull, Status.ERROR, err_msg=f"P internal error: {exc!r}"))
            return
        nbytes = sum(op.length for op in ops)
        self.shared.metrics.kv_transfers.inc()
        self.shared.metrics.kv_transfer_bytes.inc(nbytes)
        self.shared.metrics.kv_transfer_seconds.observe(time.monotonic() - started)
        self._done(reply, identity, w, response(pull, Status.FINISH, ok_reqs=[pull.d_request_id], checksums=checksums,
                                                bytes_written=nbytes, first_token=first_token))

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
