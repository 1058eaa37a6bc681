"""P's transfer lifecycle under every interleaving (issue 13.3): prefill working/ready/dead, pulls
early and late, release-only pulls, writes per D rank that start, finish or fail (also late and
twice), releases, heartbeats, lease expiry, a second P request under a live transfer_id, pulls for
another prompt. Progressive push too: the prefill reports the blocks it completed, a parked pull (also
one past D's prefix hit) gets them in partial writes that finish or fail, a request that ends without
KV lends its blocks while a partial write reads them. Blocks are freed exactly once, never under a
write in flight (partial ones included), a pull only ever reads the blocks of the request that owns its
transfer_id (and a partial write only blocks the prefill completed, in order), every parked pull is
answered exactly once, counts never go negative, and nothing is immortal once the engine and the
writes are done."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvferry.connector.messages import PullRequest
from kvferry.connector.metrics import Metrics
from kvferry.connector.prefill.transfers import Kind, TransferTable, Write

BLOCKS = {1: [4, 5, 6], 2: [7, 8, 9]}
TOKENS = 12  # three blocks of four
DIGEST = "prompt-digest"
D_TP = 2  # two D ranks read the same P blocks (the TP-mismatch case)
ABORT_S, LEASE_S = 30.0, 2.0
# A parked pull's answers: an ERROR or FINISH now (a verdict, or its failed partial write); a final write.
ANSWERING = {Kind.ENDED, Kind.FULL, Kind.DEAD, Kind.SHORT, Kind.REFUSED, Kind.MISMATCH, Kind.RELEASED}


def pull(tid: str, d_rank: int, release_only: bool = False, digest: str = DIGEST, first: int = 0) -> PullRequest:
    ids = [] if release_only else list(range(3 - first))
    return PullRequest(tid, f"d-{tid}", f"d{d_rank}:1", "grant", ids, 8, D_TP, d_rank, TOKENS,
                       lease_s=LEASE_S, prompt_digest=digest, first_block=first)


class Parked:
    """The rank loop's record of a parked pull: what partial writes delivered, the one in flight."""

    def __init__(self, request: PullRequest) -> None:
        self.pull = request
        self.positions = list(range(request.first_block, 3))
        self.sent = 0
        self.part: tuple[Write, list[int]] | None = None


def rid(tid: str, who: int) -> str:
    return f"p{who}-{tid}"


def machine(TIDS: list[str], WHO: list[int], chaos: bool = True) -> type[RuleBasedStateMachine]:  # noqa: N803
    """The machine over these transfer ids (`TIDS`) and P requests (`WHO`: more than one, a retried request
    under a live transfer_id). Without `chaos` D never releases, never sends another prompt and never
    lets a lease lapse, so transfers live long enough for progress and partial writes to interleave."""
    lapses = [0.1, 1.0, 2.5, 31.0] if chaos else [0.1, 0.5]
    maybe = st.booleans() if chaos else st.just(False)

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
            self.progress: dict[str, int] = {}  # P request → prompt blocks it reported complete
            self.lent: set[str] = set()  # P requests that ended without KV and lent their blocks to the table
            self.parked: dict[tuple[str, int], Parked] = {}  # (tid, D rank) → the parked pull
            self.answered: list[tuple[str, int]] = []  # parked pulls answered, in order

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
                self.table.add_ready(tid, rid(tid, who), BLOCKS[who], TOKENS, self.now, DIGEST)

        @rule(tid=st.sampled_from(TIDS), who=st.sampled_from(WHO))
        def prefill_dead(self, tid: str, who: int) -> None:
            if rid(tid, who) not in self.engine_done:
                self.owner.setdefault(tid, who)
                self.engine_done.add(rid(tid, who))
                lent = rid(tid, who) in self.progress  # the connector lends what progress may have exposed
                if lent:
                    self.lent.add(rid(tid, who))
                self.table.add_dead(tid, rid(tid, who), self.now, lent)

        @rule(tid=st.sampled_from(TIDS), who=st.sampled_from(WHO), blocks=st.integers(1, 2), loop_turn=st.booleans())
        def prefill_progress(self, tid: str, who: int, blocks: int, loop_turn: bool) -> None:
            """The prefill completed `blocks` of the prompt's three (the last one comes with ready); the rank
            loop may take its turn right away (it is woken for it) or later."""
            if rid(tid, who) not in self.engine_done and blocks > self.progress.get(rid(tid, who), 0):
                self.owner.setdefault(tid, who)
                self.progress[rid(tid, who)] = blocks
                self.table.add_progress(tid, rid(tid, who), BLOCKS[who][:blocks], TOKENS, DIGEST)
                for i in range(len(self.parked) if loop_turn else 0):
                    if any(p.part is None for p in self.parked.values()):
                        self.push_part(i)

        # ---- D --------------------------------------------------------------------------------------
        @rule(tid=st.sampled_from(TIDS), d_rank=st.integers(0, D_TP - 1), release_only=maybe,
              other_prompt=maybe, first=st.integers(0, 1))
        def pull(self, tid: str, d_rank: int, release_only: bool, other_prompt: bool, first: int) -> None:
            """D's pull arrives: new, or again once answered (while it is parked the rank loop only takes its
            new connection)."""
            key = (tid, d_rank)
            if key in self.parked:
                return
            request = pull(tid, d_rank, release_only, "another" if other_prompt else DIGEST, first)
            v = self.table.begin_pull(request, 0, self.now, list(range(request.first_block, 3)))
            self._verdict(key, request, v.kind, v.write, v.blocks, None)

        def _verdict(self, key: tuple[str, int], request: PullRequest, kind: Kind, write: Write | None,
                     blocks: list[int], parked: Parked | None) -> None:
            tid = key[0]
            if kind == Kind.PARK:
                self.parked.setdefault(key, Parked(request))
                return
            if kind == Kind.WRITE:
                assert request.prompt_digest == DIGEST, "KV of one prompt written for another"
                sent = parked.sent if parked is not None else 0
                want = [BLOCKS[self.owner[tid]][i] for i in range(request.first_block, 3)][sent:]
                assert write is not None and blocks == want, "a write read other blocks than the rest of its pull's"
                assert not any(w.transfer_id == tid and w.d_rank == key[1] for w in self.inflight), "two live pullers"
                self.inflight.append(write)
            if parked is not None and (kind == Kind.WRITE or kind in ANSWERING):
                self._answer(key)

        def _answer(self, key: tuple[str, int]) -> None:
            parked = self.parked.pop(key)
            assert parked.part is None, "a parked pull answered while its partial write is in flight"
            self.answered.append(key)

        @precondition(lambda self: any(p.part is None for p in self.parked.values()))
        @rule(i=st.integers(0, 10))
        def push_part(self, i: int) -> None:
            """The rank loop pushes what the prefill completed since the last part, or serves a settled one."""
            key = sorted(k for k, p in self.parked.items() if p.part is None)[i % sum(
                1 for p in self.parked.values() if p.part is None)]
            parked = self.parked[key]
            v = self.table.begin_part(parked.pull, 0, parked.positions, parked.sent)
            if v.kind == Kind.PART:
                assert v.write is not None and parked.pull.prompt_digest == DIGEST, "pushed another prompt's KV"
                owner = self.owner[key[0]]
                want = [BLOCKS[owner][i] for i in parked.positions[parked.sent:]][: len(v.blocks)]
                assert v.blocks and v.blocks == want, "a part skipped, repeated or reordered blocks"
                assert len(v.blocks) + parked.sent <= self.progress.get(rid(key[0], owner), 0) - parked.pull.first_block, (
                    "a part read a block the prefill had not completed")
                parked.part = (v.write, v.blocks)
                self.inflight.append(v.write)
            elif v.kind in (Kind.MISMATCH, Kind.REFUSED):
                self._answer(key)
            elif self.table.parked_state(key[0]) == "settled":
                v = self.table.begin_pull(parked.pull, 0, self.now, parked.positions, sent=parked.sent)
                self._verdict(key, parked.pull, v.kind, v.write, v.blocks, parked)

        @precondition(lambda self: any(p.part is not None for p in self.parked.values()))
        @rule(i=st.integers(0, 10), failed=st.booleans())
        def part_done(self, i: int, failed: bool) -> None:
            """A partial write returns: delivered (the loop learns it), or failed (it answered the pull ERROR)."""
            keys = sorted(k for k, p in self.parked.items() if p.part is not None)
            key = keys[i % len(keys)]
            parked = self.parked[key]
            assert parked.part is not None
            w, blocks = parked.part
            self.inflight.remove(w)
            self.completed.append(w)
            self.table.write_done(w, failed, partial=True)
            parked.part = None
            if failed:
                self._answer(key)
            else:
                parked.sent += len(blocks)

        @rule(tid=st.sampled_from(TIDS))
        def parked_gives_up(self, tid: str) -> None:
            """A parked pull's abort timeout ran out while P was not working on it: answered "not ready"."""
            if self.table.parked_state(tid) == "waiting":
                for key in [k for k, p in self.parked.items() if k[0] == tid and p.part is None]:
                    self._answer(key)
                self.table.give_up(tid)

        @precondition(lambda self: bool(self._finals()))
        @rule(i=st.integers(0, 10), failed=st.booleans())
        def write_done(self, i: int, failed: bool) -> None:
            finals = self._finals()
            w = finals[i % len(finals)]
            self.inflight.remove(w)
            self.completed.append(w)
            self.table.write_done(w, failed)

        def _finals(self) -> list[Write]:
            parts = {id(p.part[0]) for p in self.parked.values() if p.part is not None}
            return [w for w in self.inflight if id(w) not in parts]

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

        @rule(dt=st.sampled_from(lapses))
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
                assert rid in self.ready or rid in self.lent, f"{rid} freed before its prefill was ready"
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
            """Nothing immortal: once the engine ended every request and every write returned, the rank loop's
            turns answer every parked pull exactly once, and time alone empties the table and hands every
            lent request's blocks back exactly once."""
            for tid in TIDS:
                for who in WHO:
                    self.prefill_ready(tid, who)  # a no-op for those already ended
            for _ in range(4):  # a pull parked before its prefill ended: its final write, then its answer
                while any(p.part is not None for p in self.parked.values()):
                    self.part_done(0, False)
                while self.parked:
                    self.push_part(0)
                while self.inflight:
                    self.write_done(0, False)
            assert not self.parked, f"parked pulls never answered: {list(self.parked)}"
            self.now += ABORT_S + LEASE_S + 1
            self.table.expire(self.now)
            self.freed_once_never_under_a_write()
            assert len(self.table) == 0, f"immortal transfers: {self.table.ids()}"
            assert set(self.freed) == self.ready | self.lent, (self.freed, self.ready, self.lent)

    return Lifecycle


TestLifecycle = machine(["t0", "t1", "t2"], [1, 2]).TestCase
TestLifecycle.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)
# Fewer transfers that live longer: pulls before the prefill ends meet its progress, partial writes and
# their failures far more often.
TestProgressivePush = machine(["t0", "t1"], [1], chaos=False).TestCase
TestProgressivePush.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)
