"""What D knows of a pull's progress: which blocks landed complete and correct (grants closed, byte
coverage, P's checksums), and where a stalled pull stands (for the deadline's message)."""

from __future__ import annotations

from kvferry.connector.decode.dealer import Dealer
from kvferry.connector.decode.pulls import PullMeta, PullTask
from kvferry.connector.layout import KVLayout
from kvferry.transfer.base import TransferEngine, covered

Dealers = dict[tuple[int, str], Dealer]  # (D rank, P control address) → its DEALER


class Landed:
    """Judges the bytes P wrote into D's blocks."""

    def __init__(self, layout: KVLayout, engines: list[TransferEngine]) -> None:
        self.layout = layout
        self.engines = engines

    def invalid_indices(self, pull: PullMeta) -> list[int]:
        """Blocks not completely and correctly written by every P rank they need (all, if unknown)."""
        if not pull.tasks or not all(self.engines[t.d_rank].tracks_progress for t in pull.tasks):
            return list(range(len(pull.block_ids)))
        for task in pull.tasks:
            self.close_grant(task)
        return self.bad_blocks(pull, pull.tasks)

    def bad_blocks(self, pull: PullMeta, tasks: list[PullTask]) -> list[int]:
        bad = []
        for i in range(len(pull.block_ids)):
            for task in tasks:
                if not self.covered(pull, task, i) or (
                    task.checksums and not self._checksum_ok(pull, task, i)
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
            task.written = self.engines[task.d_rank].close_grant(task.grant)
            task.grant = None


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
            stages.append(f"P rank {t.p_rank}: still prefilling")
        else:
            stages.append(f"P rank {t.p_rank}: pull not answered, P last heard {now - dealer.last_seen:.1f}s ago")
    return "; ".join(stages)


def p_working_since(pull: PullMeta, dealers: Dealers) -> float | None:
    """When a P rank last said it is still working on this pull's transfer (None: never)."""
    seen = [
        d.working_seen[pull.spec.transfer_id]
        for t in pull.tasks
        if (d := dealers.get((t.d_rank, t.control_addr))) is not None
        and pull.spec.transfer_id in d.working_seen
    ]
    return max(seen, default=None)
