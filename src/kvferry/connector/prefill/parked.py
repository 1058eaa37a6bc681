"""One P rank's parked pulls: those that came before their KV was ready.

A parked pull waits while P has the request queued or prefilling (otherwise up to P's abort timeout),
then is served, or answered why it cannot be, once its transfer settles (ready, dead, ended). With
progressive push it does not wait idle: after each engine step the blocks the prefill completed go to
D at once, one partial write at a time per pull (so they land in order and their checksums line up);
the final write after the prefill sends the rest, and its answer carries every block's checksum. A
partial write that fails answers the pull ERROR at once. Only the rank loop's thread touches a parked
pull; a send thread hands a partial write's outcome back through `part_done`."""

from __future__ import annotations

import collections
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvferry.connector.messages import PullRequest, Status
from kvferry.connector.prefill.records import Kind, Write
from kvferry.connector.prefill.transfers import NOT_READY_MSG
from kvferry.connector.prefill.writes import Pushed, RankShared, RankWriter, Reply, response

Guard = Callable[[str, Callable[[], None], Callable[[Exception], None]], None]


@dataclass(eq=False)
class Parked:
    """A pull that came before its KV was ready."""

    identity: bytes
    pull: PullRequest
    deadline: float  # answered "not ready" after this, unless P is still working on the request
    positions: list[int]  # the entries of the transfer's blocks D's block ids stand for, in order
    pushed: Pushed = field(default_factory=Pushed)  # what partial writes delivered
    part: Write | None = None  # the partial write in flight


class ParkedPulls:
    def __init__(self, shared: RankShared, rank: int, writer: RankWriter, reply: Reply, guard: Guard,
                 serve: Callable[[bytes, PullRequest, float, Pushed], None], wake: Callable[[], None]) -> None:
        """`serve`: the rank loop's answer to a pull whose transfer settled (`pushed`: what it has had)."""
        self.shared = shared
        self.rank = rank
        self.writer = writer
        self.reply = reply
        self.guard = guard
        self.serve = serve
        self.wake = wake
        self._parked: list[Parked] = []
        self._parts_done: collections.deque[tuple[Parked, Pushed | None]] = collections.deque()

    def __len__(self) -> int:
        return len(self._parked)

    def park(self, identity: bytes, pull: PullRequest, now: float, positions: list[int], pushed: Pushed) -> None:
        """Park a pull (again, keeping what it has had: `pushed`)."""
        self._parked.append(Parked(identity, pull, now + self.shared.abort_timeout_s, positions, pushed))

    def find(self, pull: PullRequest) -> Parked | None:
        """The parked record of this same pull (D sends it again when its connection dropped)."""
        return next((p for p in self._parked if _same_pull(p.pull, pull)), None)

    def part_done(self, item: Parked, pushed: Pushed | None) -> None:
        """A send thread: the partial write of `item` returned (None: it failed and answered the pull)."""
        self._parts_done.append((item, pushed))
        self.wake()

    def retry(self) -> None:
        """Each turn of the rank loop: every parked pull is looked at, each under its own guard."""
        while self._parts_done:
            item, pushed = self._parts_done.popleft()
            item.part = None
            if pushed is None:
                if item in self._parked:
                    self._parked.remove(item)  # answered by its failed write
            else:
                item.pushed = pushed
        if not self._parked:
            return
        now = time.monotonic()
        parked, self._parked = self._parked, []
        for item in parked:

            def answer(exc: Exception, item: Parked = item) -> None:
                self.reply(item.identity, response(item.pull, Status.ERROR, err_msg=f"P internal error: {exc!r}",
                                                   checksums=item.pushed.checksums))

            self.guard("parked pull", functools.partial(self._retry, item, now), answer)

    def _retry(self, item: Parked, now: float) -> None:
        if item.part is not None:  # its partial write answers or hands back first
            self._parked.append(item)
            return
        pull = item.pull
        state = self.shared.table.parked_state(pull.transfer_id)
        fault = self.shared.faults.fault_for(pull.transfer_id)
        if fault == "p_not_ready":
            state = "waiting"  # the injected fault: P never gets ready
        if state == "settled":
            self.serve(item.identity, pull, now, item.pushed)  # served, or answered why it cannot be
        elif state == "working" or self.shared.in_step.is_set():
            # P is on it, or its engine is inside a step and may not have taken the request in yet:
            # the abort timeout counts only while P could know. D's own deadline bounds the wait.
            item.deadline = now + self.shared.abort_timeout_s
            if state == "working" and not self._push(item, fault):
                return  # answered
            self._parked.append(item)
        elif now >= item.deadline:
            self.reply(item.identity, response(pull, Status.FINISH, err_reqs=[pull.d_request_id],
                                               err_msg=NOT_READY_MSG, checksums=item.pushed.checksums))
            self.shared.table.give_up(pull.transfer_id)
        else:
            self._parked.append(item)

    def _push(self, item: Parked, fault: str | None) -> bool:
        """The blocks the prefill completed since the last part, to D now. False: the pull was answered."""
        v = self.shared.table.begin_part(item.pull, self.rank, item.positions, item.pushed.sent)
        if v.kind in (Kind.MISMATCH, Kind.REFUSED):
            cause = "prompt_mismatch" if v.kind == Kind.MISMATCH else ""
            self.reply(item.identity, response(item.pull, Status.ERROR, cause=cause, err_msg=v.why))
            return False
        if v.kind != Kind.PART:
            return True
        assert v.write is not None
        item.part = v.write
        self.shared.metrics.progressive_writes.inc()
        job = functools.partial(self.writer.serve_part, self.reply, item.identity, item.pull, v.write, v.blocks,
                                fault, item.pushed, functools.partial(self.part_done, item))
        try:
            self.shared.senders.submit(f"{self.rank}/{item.pull.d_transfer_addr}", job)
        except Exception:
            self.shared.table.write_done(v.write, failed=True)
            item.part = None
            raise
        return True


def _same_pull(a: PullRequest, b: PullRequest) -> bool:
    return (a.transfer_id, a.d_request_id, a.d_tp_rank, a.grant_token) == (
        b.transfer_id, b.d_request_id, b.d_tp_rank, b.grant_token)
