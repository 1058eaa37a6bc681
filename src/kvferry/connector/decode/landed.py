"""What D knows of a pull's progress: which blocks landed complete and correct (grants closed, byte
coverage, P's checksums), when its blocks may go back to the scheduler (no grant of it draining, or
quarantined), and where a stalled pull stands (for the deadline's message)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging

from kvferry.connector.decode.dealer import Dealers
from kvferry.connector.decode.pulls import Outbox, PullMeta, PullTask
from kvferry.connector.layout import KVLayout
from kvferry.connector.loads import LoadReport
from kvferry.transfer.base import TransferEngine, covered

DRAIN_POLL_S = 0.05  # how often a held pull's grants are asked whether they drained
log = logging.getLogger(__name__)


class Landed:
    """Judges the bytes P wrote into D's blocks, and hands each pull's outcome to the scheduler (the
    outbox). A NIXL grant closed under reads still posted (a frozen P holds them) is *draining*: bytes
    may still land in its blocks, so they must be neither freed nor recomputed in place. A failed pull is
    reported at once all the same, its blocks *quarantined* (the host keeps them out of its pool, owned
    by no request) and released once every grant of it drained, so a frozen P costs the client no more
    than its liveness deadline. A host that cannot quarantine (`Outbox.quarantine` off), and a
    successful pull (its blocks are the request's KV), are held instead: the request keeps waiting for
    remote KV, its blocks allocated, until the grants drained."""

    def __init__(self, outbox: Outbox, layout: KVLayout, engines: dict[int, TransferEngine], checksums: bool,
                 dealers: Dealers) -> None:
        self.layout = layout
        self.dealers = dealers  # where P's partial answers (progressive push) wait for a pull's end
        self.checksums = checksums  # asked for: then a block P sent no checksum for is unverified, not loaded
        self.engines = engines
        self.outbox = outbox
        self.held: dict[str, tuple[PullMeta, LoadReport | None]] = {}
        self.quarantined: dict[str, PullMeta] = {}  # reported; their blocks wait for the grants to drain
        self._timer: asyncio.TimerHandle | None = None

    def invalid_indices(self, pull: PullMeta) -> list[int]:
        """Blocks not completely and correctly written by every P rank they need (all, if unknown)."""
        if not pull.tasks or not all(self.engines[t.d_rank].tracks_progress for t in pull.tasks):
            return list(range(len(pull.block_ids)))
        key = (pull.spec.transfer_id, pull.request_id)
        for task in pull.tasks:
            self.close_grant(task)
            # A P that dies mid-prefill never answers; the checksums it sent after each partial write
            # still vouch for the blocks that write covered (each is checked against what landed).
            dealer = self.dealers.get((task.d_rank, task.control_addr))
            part = dealer.part_checksums.get(key, []) if dealer is not None else []
            if len(part) > len(task.checksums):
                task.checksums = list(part)
        return self.bad_blocks(pull, pull.tasks)

    def bad_blocks(self, pull: PullMeta, tasks: list[PullTask]) -> list[int]:
        bad = []
        for i in range(len(pull.block_ids)):
            for task in tasks:
                if not self.covered(pull, task, i) or (
                    self.checksums and not self._checksum_ok(pull, task, i)
                ):
                    bad.append(i)
                    break
        return bad

    def covered(self, pull: PullMeta, task: PullTask, index: int) -> bool:
        if task.written is None:
            return False
        return all(
            covered(task.written, r) for r in self.layout.block_runs(pull.block_ids[index], task.heads)
        )

    def _checksum_ok(self, pull: PullMeta, task: PullTask, index: int) -> bool:
        if index >= len(task.checksums):
            return False
        return self.layout.checksum(pull.block_ids[index], task.heads, task.digest_key, index) == task.checksums[index]

    def close_grant(self, task: PullTask) -> None:
        if task.grant is not None:
            engine = self.engines[task.d_rank]
            task.written = engine.close_grant(task.grant)
            if engine.draining(task.grant):
                task.fenced = task.grant
            task.grant = None

    def report(self, pull: PullMeta, load: LoadReport | None = None) -> None:
        """The pull's outcome to the scheduler: now, quarantined or held while a grant drains (on the
        consumer's loop)."""
        if pull.failed and self.outbox.quarantine and self._draining(pull):
            log.warning("blocks of %s quarantined: P's reads posted before the close have not ended", pull.request_id)
            self.quarantined[pull.request_id] = pull
            self.outbox.report(pull.request_id, dataclasses.replace(load or LoadReport(pull.request_id), quarantined=True))
        else:
            self.held[pull.request_id] = (pull, load)
            if self._draining(pull):
                log.warning("blocks of %s held back: P's reads posted before the close have not ended", pull.request_id)
        self._flush()

    def _draining(self, pull: PullMeta) -> bool:
        return any(t.fenced and self.engines[t.d_rank].draining(t.fenced) for t in pull.tasks)

    def _flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()  # one timer at most, whoever calls
            self._timer = None
        for request_id, (pull, load) in list(self.held.items()):
            if not self._draining(pull):
                del self.held[request_id]
                self.outbox.report(request_id, load)
        for request_id, pull in list(self.quarantined.items()):
            if not self._draining(pull):
                del self.quarantined[request_id]
                self.outbox.release(request_id)
        if (self.held or self.quarantined) and self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(DRAIN_POLL_S, self._flush)


def stall_stage(pull: PullMeta, dealers: Dealers, now: float) -> str:
    """Where a pull stands, for the deadline's message: a stall names its stage, not just its age."""
    if not pull.tasks:
        return f"P's bootstrap server at {pull.spec.bootstrap_addr} never answered"
    key, stages = (pull.spec.transfer_id, pull.request_id), []
    for t in pull.tasks:
        dealer = dealers.get((t.d_rank, t.control_addr))
        if t.done:
            stages.append(f"P rank {t.p_rank}: done")
        elif dealer is None:
            stages.append(f"P rank {t.p_rank}: no connection")
        elif key in dealer.writing_since:
            stages.append(f"P rank {t.p_rank}: writing for {now - dealer.writing_since[key]:.1f}s")
        elif key[0] in dealer.working_seen:
            stages.append(f"P rank {t.p_rank}: working on it (queued, prefilling or writing)")
        elif key[0] in dealer.parked_seen:
            stages.append(f"P rank {t.p_rank}: has not taken the request in (the pull waits there)")
        else:
            again = f", asked again {pull.asked_again}x" if pull.asked_again else ""
            heard = now - dealer.last_seen
            stages.append(f"P rank {t.p_rank}: pull not answered{again}, P last heard {heard:.1f}s ago")
    return "; ".join(stages)


def p_owes_since(pull: PullMeta, dealers: Dealers) -> float | None:
    """When a P rank last said it still owes this pull its own answer (None: never): it is working on
    the transfer (queued, prefilling or writing), or has not taken it in yet, so the pull waits at P and P
    answers it by its abort timeout, counted on P's clock."""
    tid = pull.spec.transfer_id
    seen = [
        since
        for t in pull.tasks
        if (d := dealers.get((t.d_rank, t.control_addr))) is not None
        for since in (d.working_seen.get(tid), d.parked_seen.get(tid))
        if since is not None
    ]
    return max(seen, default=None)


def ask_again(pull: PullMeta, dealers: Dealers) -> bool:
    """`recv_timeout_s` passed without P's answer, and P's ranks live (liveness has lost none): send the
    pull again and leave its end to the request's deadline, so a live P is never failed by a timeout.
    P answers a repeat idempotently: from its remembered answer, by the write in flight, or afresh if
    the pull itself was lost. False when a rank's connection is gone (D fails the pull then)."""
    key = (pull.spec.transfer_id, pull.request_id)
    pending = [dealers.get((t.d_rank, t.control_addr)) for t in pull.tasks if not t.done]
    live = [d for d in pending if d is not None and key in d.waiters and not d.lost]
    if len(live) < len(pending):
        return False
    pull.asked_again += 1
    log.warning("no answer from P for %s within the receive timeout while P lives: asked again (%d), "
                "the request's deadline bounds the wait", pull.request_id, pull.asked_again)
    for dealer in live:
        dealer.resend([key])
    return True
