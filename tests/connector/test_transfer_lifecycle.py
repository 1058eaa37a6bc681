"""P's transfer lifecycle under every interleaving (issue 13.3): prefill working/ready/dead, pulls
early and late, release-only pulls, writes per D rank that start, finish or fail (also late and
twice), releases, heartbeats, lease expiry, a second P request under a live transfer_id, pulls for
another prompt. Blocks are freed exactly once, never under a write in flight, a pull only ever reads
the blocks of the request that owns its transfer_id, counts never go negative, and nothing is
immortal once the engine and the writes are done."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvferry.connector.messages import PullRequest
from kvferry.connector.metrics import Metrics
from kvferry.connector.prefill.transfers import TransferTable, Write

TIDS = ["t0", "t1", "t2"]
WHO = [1, 2]  # two P requests may come under one transfer_id (a retried request): only one owns it
BLOCKS = {1: [4, 5], 2: [6, 7]}
DIGEST = "prompt-digest"
D_TP = 2  # two D ranks read the same P blocks (the TP-mismatch case)
ABORT_S, LEASE_S = 30.0, 2.0


def pull(tid: str, d_rank: int, release_only: bool = False, digest: str = DIGEST) -> PullRequest:
    return PullRequest(tid, f"d-{tid}", f"d{d_rank}:1", "grant", [] if release_only else [0, 1], 8, D_TP, d_rank, 8,
                       lease_s=LEASE_S, prompt_digest=digest)


def rid(tid: str, who: int) -> str:
    return f"p{who}-{tid}"


class Lifecycle(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.table = TransferTable(ABORT_S, Metrics(), lambda d_tp: {(0, d) for d in range(d_tp)})
        self.engine_done: set[str] = set()  # P requests that ended (ready or dead)
        self.ready: set[str] = set()  # P requests whose blocks were handed to the table
        self.owner: dict[str, int] = {}  # tid → the P request that claimed it first
        self.inflight: list[Write] = []
        self.completed: list[Write] = []
        self.freed: dict[str, int] = {}  # request id → times handed back

    # ---- the engine -------------------------------------------------------------------------------
    @rule(tid=st.sampled_from(TIDS), who=st.sampled_from(WHO))
    def working(self, tid: str, who: int) -> None:
        if rid(tid, who) not in self.engine_done:
            self.owner.setdefault(tid, who)
            self.table.add_working(tid, rid(tid, who))

    @rule(tid=st.sampled_from(TIDS), who=st.sampled_from(WHO))
    def prefill_ready(self, tid: str, who: int) -> None:
        if rid(tid, who) not in self.engine_done:
            self.owner.setdefault(tid, who)
            self.engine_done.add(rid(tid, who))
            self.ready.add(rid(tid, who))
            self.table.add_ready(tid, rid(tid, who), BLOCKS[who], 8, self.now, DIGEST)

    @rule(tid=st.sampled_from(TIDS), who=st.sampled_from(WHO))
    def prefill_dead(self, tid: str, who: int) -> None:
        if rid(tid, who) not in self.engine_done:
            self.owner.setdefault(tid, who)
            self.engine_done.add(rid(tid, who))
            self.table.add_dead(tid, rid(tid, who), self.now)

    # ---- D --------------------------------------------------------------------------------------
    @rule(tid=st.sampled_from(TIDS), d_rank=st.integers(0, D_TP - 1), release_only=st.booleans(),
          other_prompt=st.booleans())
    def pull(self, tid: str, d_rank: int, release_only: bool, other_prompt: bool) -> None:
        v = self.table.begin_pull(pull(tid, d_rank, release_only, "another" if other_prompt else DIGEST), 0, self.now)
        if v.kind == "write":
            assert not other_prompt, "KV of one prompt written for another"
            assert v.write is not None and v.blocks == BLOCKS[self.owner[tid]], "a pull read a duplicate's blocks"
            assert not any(w.transfer_id == tid and w.d_rank == d_rank for w in self.inflight), "two live pullers"
            self.inflight.append(v.write)

    @rule(tid=st.sampled_from(TIDS))
    def parked_gives_up(self, tid: str) -> None:
        if self.table.parked_state(tid) == "waiting":
            self.table.give_up(tid)

    @precondition(lambda self: bool(self.inflight))
    @rule(i=st.integers(0, 10), failed=st.booleans())
    def write_done(self, i: int, failed: bool) -> None:
        w = self.inflight.pop(i % len(self.inflight))
        self.completed.append(w)
        self.table.write_done(w, failed)

    @precondition(lambda self: bool(self.completed))
    @rule(i=st.integers(0, 10), failed=st.booleans())
    def late_duplicate_write_done(self, i: int, failed: bool) -> None:
        self.table.write_done(self.completed[i % len(self.completed)], failed)

    @rule(tid=st.sampled_from(TIDS))
    def release(self, tid: str) -> None:
        self.table.release([tid], self.now)

    @rule(tid=st.sampled_from(TIDS))
    def heartbeat(self, tid: str) -> None:
        self.table.renew([tid], LEASE_S, self.now)

    @rule(dt=st.sampled_from([0.1, 1.0, 2.5, 31.0]))
    def tick_and_expire(self, dt: float) -> None:
        self.now += dt
        cancelled = self.table.expire(self.now)
        assert all(w in self.inflight for w in cancelled), "only writes in flight are cancelled"

    # ---- the one place invariants are checked ---------------------------------------------------
    @invariant()
    def freed_once_never_under_a_write(self) -> None:
        for rid in self.table.drain_finished():
            self.freed[rid] = self.freed.get(rid, 0) + 1
            assert self.freed[rid] == 1, f"{rid} freed twice"
            tid = rid.split("-", 1)[1]
            assert rid in self.ready, f"{rid} freed before its prefill was ready"
            if self.owner.get(tid) == int(rid[1]):  # a duplicate's blocks are never lent: free at once
                assert not any(w.transfer_id == tid for w in self.inflight), f"{rid} freed under a write in flight"
        assert self.table.writes_in_flight() == sum(1 for w in self.inflight if self._held(w))
        for tid in self.table.ids():
            t = self.table.get(tid)
            assert t is not None and len(t.writes) >= 0

    def _held(self, w: Write) -> bool:
        t = self.table.get(w.transfer_id)
        return t is not None and w in t.writes

    def teardown(self) -> None:
        """Nothing immortal: once the engine ended every request and every write returned, time
        alone empties the table and hands every ready request's blocks back exactly once."""
        for tid in TIDS:
            for who in WHO:
                self.prefill_ready(tid, who)  # a no-op for those already ended
        while self.inflight:
            self.write_done(0, False)
        self.now += ABORT_S + LEASE_S + 1
        self.table.expire(self.now)
        self.freed_once_never_under_a_write()
        assert len(self.table) == 0, f"immortal transfers: {self.table.ids()}"
        assert set(self.freed) == self.ready, (self.freed, self.ready)


TestLifecycle = Lifecycle.TestCase
TestLifecycle.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)
