"""P's transfers by transfer_id: blocks held for D, placeholders for early pulls, the blocks a running
prefill completed so far (progressive push), leases, writes in flight, and a bounded memory of transfers
that already ended.

The table is the one owner of a transfer's lifecycle. Every path that ends a transfer (served,
failed write, released, expired, dead prefill) only *dooms* it; `_settle` is the one function that
frees, and only once no write reads its blocks. So blocks are freed exactly once and never under an
in-flight write; a write is a handle, so a late or repeated completion cannot drive a count negative.
A partial write (progressive push: blocks of a prefill still running) is a `Write` like any other, so a
request that ends without KV while one is in flight lends its blocks here until it returns.
Shared by the engine thread (working / progress / ready / dead) and the rank threads under one lock; freed
transfers reach the engine as `finished_sending`."""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

from kvferry.connector.auth import remember
from kvferry.connector.messages import FirstToken, PullRequest, PullResponse
from kvferry.connector.metrics import Metrics
from kvferry.connector.prefill.records import Kind, Transfer, Verdict, Write, mismatch

__all__ = ["NOT_READY_MSG", "Kind", "Transfer", "TransferTable", "Verdict", "Write"]

log = logging.getLogger(__name__)

NOT_READY_MSG = "Timeout waiting for P side ready."
MAX_PLACEHOLDERS = 100_000  # transfers we track before their prefill is done (pull-before-ready)
MAX_RECENT = 20_000  # ended transfer ids remembered, so a late pull gets `expired` at once
# Final answers of writes remembered, so a pull D sends again after its connection dropped (the answer
# went with it) gets the same one; an evicted one gets `expired` (a failure, never a silent loss).
MAX_ANSWERS = 4096
AnswerKey = tuple[str, int, int, str]  # (transfer_id, P rank, D rank, D's grant token)


class TransferTable:
    def __init__(self, abort_timeout_s: float, metrics: Metrics,
                 pairs: Callable[[int], set[tuple[int, int]]]) -> None:
        self.abort_timeout_s = abort_timeout_s
        self.metrics = metrics
        self._pairs = pairs  # D tp size → the (P rank, D rank) pairs a transfer must serve
        self.lock = threading.Lock()
        self._written = threading.Condition(self.lock)  # notified whenever a write returns
        self._transfers: dict[str, Transfer] = {}
        self._recent: OrderedDict[str, str] = OrderedDict()  # ended transfer id → why
        self._answers: OrderedDict[AnswerKey, PullResponse] = OrderedDict()  # an LRU of MAX_ANSWERS
        self._finished: set[str] = set()
        # Called (under the lock) whenever a request joins `_finished`: the engine thread wakes for it.
        self.waker: Callable[[], None] = _nothing

    def __len__(self) -> int:
        return len(self._transfers)

    def ids(self) -> list[str]:
        with self.lock:
            return list(self._transfers)

    # ---- the one place that frees -----------------------------------------------------------------
    def doom(self, t: Transfer, why: str) -> None:
        """Under the lock: `t` ends (the first reason wins); freed now or when its last write returns."""
        if t.doomed is None:
            t.doomed = why
        self._settle(t)

    def _settle(self, t: Transfer) -> None:
        if t.writes or self._transfers.get(t.transfer_id) is not t:
            return
        if t.request_id is not None and (t.doomed is not None or t.dead is not None):
            self._finished.add(t.request_id)  # a dead request's blocks lent for a partial write, too
            self.waker()
            t.request_id = None
        if t.doomed is None:
            return
        del self._transfers[t.transfer_id]
        self._remember(t.transfer_id, t.doomed)
        if t.doomed == "expired" and t.ready:
            self.metrics.kv_leases_expired.inc()
            log.warning("transfer %s expired: its blocks were never (fully) pulled", t.transfer_id)

    def _remember(self, transfer_id: str, why: str) -> None:
        self._recent[transfer_id] = why
        self._recent.move_to_end(transfer_id)
        while len(self._recent) > MAX_RECENT:
            self._recent.popitem(last=False)

    def ended(self, transfer_id: str) -> str | None:
        """Under the lock: why a transfer we no longer hold ended (None: not ended recently)."""
        return self._recent.get(transfer_id)

    # ---- engine thread ----------------------------------------------------------------------------
    def _claimed_by_other(self, t: Transfer | None, request_id: str) -> bool:
        """Under the lock: a second P request under a live transfer_id never takes the first one's
        place (its KV would reach the first one's D, and the first one's blocks would leak)."""
        if t is None or t.owner in (None, request_id):
            return False
        self.metrics.duplicate_transfer_ids.inc()
        log.warning("transfer_id %s is in use by request %s: request %s refused", t.transfer_id, t.owner, request_id)
        return True

    def _entry(self, transfer_id: str, request_id: str, expires: float) -> Transfer | None:
        """The transfer `request_id` may update (made if new), or None: it ended recently, or another
        request owns its id. Under the lock."""
        if transfer_id in self._recent:
            return None
        t = self._transfers.get(transfer_id)
        if self._claimed_by_other(t, request_id):
            return None
        if t is None:
            t = self._transfers[transfer_id] = Transfer(transfer_id, expires)
        return t

    def add_working(self, transfer_id: str, request_id: str) -> None:
        """P queued the request: its pulls wait however long the prefill takes."""
        with self.lock:
            t = self._entry(transfer_id, request_id, math.inf)
            if t is None:
                return
            t.owner = request_id
            if not t.ready and t.dead is None:
                t.working = True

    def add_progress(self, transfer_id: str, request_id: str, block_ids: list[int], num_tokens: int,
                     prompt_digest: str) -> None:
        """The running prefill completed the prompt blocks `block_ids` (all so far, in order). The prompt
        they belong to comes with them, so a pull is checked against it before any byte is written."""
        with self.lock:
            t = self._entry(transfer_id, request_id, math.inf)
            if t is None or t.ready or t.dead is not None:
                return
            t.owner, t.num_tokens, t.prompt_digest, t.working = request_id, num_tokens, prompt_digest, True
            if len(block_ids) > len(t.progress):
                t.progress = list(block_ids)

    def rewind(self, transfer_id: str, request_id: str, timeout_s: float) -> list[Write]:
        """The running prefill lost its blocks (the engine preempted it and frees them): no part starts
        from them any more, and this returns once no write reads them. After `timeout_s` the transfer is
        doomed and the writes still in flight are returned, to be cancelled."""
        deadline = time.monotonic() + timeout_s
        with self.lock:
            t = self._transfers.get(transfer_id)
            if t is None or t.owner != request_id or t.ready:
                return []
            t.progress = []
            while t.writes:
                left = deadline - time.monotonic()
                if left <= 0:
                    self.doom(t, "preempted")
                    return list(t.writes)
                self._written.wait(left)
            return []

    def add_ready(self, transfer_id: str, request_id: str, block_ids: list[int], num_tokens: int, now: float,
                  prompt_digest: str = "", first_token: FirstToken | None = None) -> None:
        with self.lock:
            t = self._transfers.get(transfer_id)
            # D gave up (released, expired) before the prefill ended, or another request owns the id.
            if (t is None and transfer_id in self._recent) or self._claimed_by_other(t, request_id):
                self._finished.add(request_id)
                self.waker()
                return
            if t is None:
                t = self._transfers[transfer_id] = Transfer(transfer_id, 0.0)
            t.request_id, t.owner, t.block_ids, t.num_tokens, t.working = request_id, request_id, block_ids, num_tokens, False
            t.prompt_digest, t.first_token = prompt_digest, first_token
            # Before any pull P's own abort timeout bounds the hold; after one, D's lease does.
            t.expires = now + self.abort_timeout_s if not t.leased or t.expires == math.inf else t.expires

    def add_unserved(self, request_id: str) -> None:
        """A finished prefill this rank sends to nobody (another rank holds the one copy): done now."""
        with self.lock:
            self._finished.add(request_id)
            self.waker()

    def add_dead(self, transfer_id: str, request_id: str, now: float, lent: bool = False) -> None:
        """The P request ended without KV; `lent`: its blocks come here (a partial write may read them),
        freed once no write does."""
        with self.lock:
            t = self._entry(transfer_id, request_id, 0.0)
            if t is None:
                if lent:
                    self._finished.add(request_id)
                    self.waker()
                return
            t.dead, t.working = "prefill request ended without KV (aborted or failed)", False
            t.expires = now + self.abort_timeout_s if not t.leased or t.expires == math.inf else t.expires
            if lent:
                t.request_id = request_id
                self._settle(t)

    def drain_finished(self) -> set[str]:
        with self.lock:
            finished, self._finished = self._finished, set()
        return finished

    def pending_sends(self) -> int:
        with self.lock:
            return sum(1 for t in self._transfers.values() if t.ready)

    def writes_in_flight(self) -> int:
        with self.lock:
            return sum(len(t.writes) for t in self._transfers.values())

    # ---- rank threads -----------------------------------------------------------------------------
    def get(self, transfer_id: str) -> Transfer | None:
        return self._transfers.get(transfer_id)

    def get_or_placeholder(self, transfer_id: str, now: float) -> Transfer | None:
        """Under the lock. A pull may come before the prefill ends: track it (None: too many)."""
        t = self._transfers.get(transfer_id)
        if t is None:
            if len(self._transfers) >= MAX_PLACEHOLDERS:
                return None
            t = self._transfers[transfer_id] = Transfer(transfer_id, now + self.abort_timeout_s)
        return t

    def _lease_s(self, lease_s: float) -> float:
        """D asks for its lease; P never grants more than its own abort timeout (nor NaN, nor < 0)."""
        return lease_s if 0 < lease_s <= self.abort_timeout_s else self.abort_timeout_s

    def lease(self, t: Transfer, now: float, lease_s: float) -> None:
        """Under the lock: a pull came; from now on D's lease, renewed by its heartbeats, decides."""
        lease_s = self._lease_s(lease_s)
        t.expires = now + lease_s if not t.leased else max(t.expires, now + lease_s)
        if t.expires == math.inf:
            t.expires = now + lease_s
        t.leased = True

    def begin_pull(self, pull: PullRequest, p_rank: int, now: float, positions: Sequence[int] | None = None,
                   park: bool = False, drop: bool = False, sent: int = 0) -> Verdict:
        """What to do with a pull (`park`: wait even if ready; `drop`: never answer — injected faults).
        `positions`: the entries of the transfer's blocks that D's block ids stand for, in order (default:
        the first ones); `sent`: how many of them partial writes already delivered. A WRITE verdict holds a
        `Write` for the rest: the blocks stay until its `write_done`."""
        with self.lock:
            answer = self._answers.get((pull.transfer_id, p_rank, pull.d_tp_rank, pull.grant_token))
            if answer is not None and answer.d_request_id == pull.d_request_id:
                return Verdict(Kind.ANSWERED, answer=answer)  # D asks again: its answer went with a connection
            t = self._transfers.get(pull.transfer_id)
            if t is None and pull.transfer_id in self._recent:
                return Verdict(Kind.ENDED, self._recent[pull.transfer_id])
            if t is not None and t.doomed is not None:
                return Verdict(Kind.ENDED, t.doomed)
            t = self.get_or_placeholder(pull.transfer_id, now)
            if t is None:
                return Verdict(Kind.FULL, "too many pending transfers")
            if not pull.block_ids:  # release-only pull: D will never read these blocks
                self.doom(t, "released")
                return Verdict(Kind.RELEASED)
            refused = self._refused(t, pull, p_rank)
            if refused is not None:
                if refused.kind == Kind.WRITING:
                    self.lease(t, now, pull.lease_s)
                return refused
            self.lease(t, now, pull.lease_s)
            if drop:
                return Verdict(Kind.DROP)
            if t.dead is not None:
                self.doom(t, "dead")
                return Verdict(Kind.DEAD, t.dead)
            other = mismatch(t, pull)
            if other is not None:
                return other
            if t.block_ids is None or park:
                return Verdict(Kind.PARK)
            wanted = range(len(pull.block_ids)) if positions is None else positions
            if len(wanted) != len(pull.block_ids) or any(not 0 <= i < len(t.block_ids) for i in wanted):
                self.doom(t, "failed")
                return Verdict(Kind.SHORT, "P num blocks less than D")
            w = self._write(t, pull, p_rank)
            return Verdict(Kind.WRITE, write=w, blocks=[t.block_ids[i] for i in wanted[sent:]], first_token=t.first_token)

    def begin_part(self, pull: PullRequest, p_rank: int, positions: Sequence[int], sent: int) -> Verdict:
        """A parked pull while the prefill runs: PART writes the entries `positions[sent:]` that the
        prefill completed since (`blocks`: P's ids of them, in order); WAIT: none yet (or the transfer no
        longer runs: `begin_pull` then says what to do); MISMATCH and REFUSED answer the pull."""
        with self.lock:
            t = self._transfers.get(pull.transfer_id)
            if t is None or t.doomed is not None or t.ready or t.dead is not None or not t.working:
                return Verdict(Kind.WAIT)
            refused = self._refused(t, pull, p_rank)
            if refused is not None and refused.kind == Kind.REFUSED:
                return refused
            other = mismatch(t, pull)
            if other is not None:
                return other
            new = [i for i in positions[sent:] if i < len(t.progress)]
            if not new or refused is not None:
                return Verdict(Kind.WAIT)  # nothing new yet, or this pull's last part is still in flight
            w = self._write(t, pull, p_rank)
            t.pushing[(p_rank, pull.d_tp_rank)] = pull.grant_token
            return Verdict(Kind.PART, write=w, blocks=[t.progress[i] for i in new])

    def _refused(self, t: Transfer, pull: PullRequest, p_rank: int) -> Verdict | None:
        """Under the lock: REFUSED (another pull serves this transfer and D rank), WRITING (this same
        pull's write is in flight) or None."""
        if t.d_tp is not None and t.d_tp != pull.d_tp_size:
            return Verdict(Kind.REFUSED, f"transfer is pulled with D tp_size {t.d_tp}, not {pull.d_tp_size}")
        pair = (p_rank, pull.d_tp_rank)
        live = [w for w in t.writes if (w.p_rank, w.d_rank) == pair]
        if live and pull.grant_token and all(w.token == pull.grant_token for w in live):
            return Verdict(Kind.WRITING)  # the same pull again: its write goes on, and answers it
        if live or pair in t.served or t.pushing.get(pair, pull.grant_token) != pull.grant_token:
            return Verdict(Kind.REFUSED, "another pull for this transfer and D rank is live or done")
        return None

    def _write(self, t: Transfer, pull: PullRequest, p_rank: int) -> Write:
        t.d_tp = pull.d_tp_size
        w = Write(t.transfer_id, p_rank, pull.d_tp_rank, pull.d_tp_size, pull.d_transfer_addr, pull.grant_token)
        t.writes.add(w)
        return w

    def give_up(self, transfer_id: str) -> None:
        """A parked pull waited its whole abort timeout and P is not working on the request."""
        with self.lock:
            t = self._transfers.get(transfer_id)
            if t is not None:
                self.doom(t, "expired")

    def parked_state(self, transfer_id: str) -> str:
        """For a parked pull: "settled" (answer it again now), "working" (P is on it) or "waiting"."""
        with self.lock:
            t = self._transfers.get(transfer_id)
            if t is None or t.doomed is not None or t.ready or t.dead is not None:
                return "settled"
            return "working" if t.working else "waiting"

    def write_done(self, w: Write, failed: bool, answer: PullResponse | None = None, partial: bool = False) -> None:
        """The write returned; `answer` (what P tells D) is remembered for the same pull sent again. A
        `partial` one serves nothing yet: the pull's final write does."""
        with self.lock:
            t = self._transfers.get(w.transfer_id)
            if t is None or w not in t.writes:
                return  # a completion we already counted
            if answer is not None:
                remember(self._answers, (w.transfer_id, w.p_rank, w.d_rank, w.token), answer, MAX_ANSWERS)
            t.writes.discard(w)
            self._written.notify_all()
            if failed:
                self.doom(t, "failed")  # D fails the request; nobody will pull this transfer again
                return
            if partial:
                self._settle(t)
                return
            t.served.add((w.p_rank, w.d_rank))
            if self._pairs(w.d_tp) <= t.served:
                self.doom(t, "served")
            self._settle(t)

    def write_wanted(self, w: Write) -> bool:
        """Whether a queued write should still start (its transfer was not doomed meanwhile)."""
        with self.lock:
            t = self._transfers.get(w.transfer_id)
            return t is not None and w in t.writes and t.doomed is None

    def renew(self, transfer_ids: Iterable[str], lease_s: float, now: float) -> tuple[list[str], list[str]]:
        """D's heartbeat: extend the leases it names. Returns (ids we do not hold, ids P is still
        working on: queued, prefilling or writing, so D waits for its answer)."""
        unknown, working = [], []
        with self.lock:
            for tid in transfer_ids:
                t = self._transfers.get(tid)
                if t is None or t.doomed is not None:
                    unknown.append(tid)
                    continue
                if t.working or t.writes:
                    working.append(tid)
                if t.expires != math.inf:
                    t.expires = max(t.expires, now + self._lease_s(lease_s))
        return unknown, working

    def release(self, transfer_ids: Iterable[str], now: float) -> None:
        with self.lock:
            for tid in transfer_ids:
                t = self._transfers.get(tid)
                if t is not None:
                    self.doom(t, "released")
                elif tid not in self._recent:
                    self._remember(tid, "released")  # freed the moment its prefill ends

    def expire(self, now: float) -> list[Write]:
        """Doom transfers whose lease ran out; returns their writes still in flight, to be cancelled."""
        cancel: list[Write] = []
        with self.lock:
            for t in [t for t in self._transfers.values() if t.expires <= now and not t.working]:
                self.doom(t, "expired")
                cancel.extend(t.writes)  # every sweep until they return: a write may start late
        return cancel


def _nothing() -> None:
    pass
