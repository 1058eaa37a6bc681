"""A hypothesis state machine over the scheduler: local and remote requests, KV landing at random steps,
load failures under both policies (also with blocks a read may still write: quarantined for some steps),
aborts at any time, delayed frees, P requests pushed while they are computed (lent: never preempted), and
preemption, on pools down to the smallest that holds one request. Every step: integrity, no stall; at the end: every request finished
(within a bound) with the status its plan implies, and the pool full again.

The machine drives the scheduler and `ScriptedConnector` the way `Engine.step` does, without the model:
scheduling does not depend on the computed values, and skipping the forward makes a step ~1000x cheaper,
so hypothesis explores far more interleavings in the same time.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvferry.connector.fake import LoadPlan, ScriptedConnector
from kvferry.engine.block_pool import BlockPool
from kvferry.engine.request import Request, RequestStatus, SamplingParams
from kvferry.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput, WorkerResult

TOKEN = 7  # what the fake model samples (ignore_eos: only max_tokens stops a request)
MAX_LOAD_STEPS = 6
# The load reports lost blocks, a cause, or both; "quarantined": a cause, with blocks a read may still write.
FAILURES = ("blocks", "blocks_no_cause", "cause", "quarantined")
OUTCOMES = ("ok", *FAILURES, "never")  # "never": the load lands only after an abort
CAUSE = ("transport", "data plane broke")


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


@dataclass
class Planned:
    request: Request
    outcome: str = "local"  # or one of OUTCOMES (a remote request)
    invalid: tuple[int, ...] = ()  # block indices the load reports as not written
    aborted: bool = False


class SchedulerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.scheduler: Scheduler | None = None
        self.connector = ScriptedConnector()
        self.planned: dict[str, Planned] = {}
        self.idle_steps = 0  # consecutive steps that computed nothing while nothing was in flight

    # ---- setup ------------------------------------------------------------------------------------
    @initialize(
        num_blocks=st.integers(1, 8),
        block_size=st.sampled_from([2, 4, 16]),
        policy=st.sampled_from(["fail", "recompute"]),
        budget=st.sampled_from([1, 5, 16, 64, 4096]),
        chunk=st.sampled_from([0, 16, 256]),
        max_seqs=st.sampled_from([1, 2, 64]),
    )
    def setup(self, num_blocks: int, block_size: int, policy: str, budget: int, chunk: int, max_seqs: int) -> None:
        config = SchedulerConfig(block_size, budget, max_seqs, policy, chunk)
        self.scheduler = Scheduler(config, BlockPool(num_blocks), self.connector)

    @property
    def s(self) -> Scheduler:
        assert self.scheduler is not None
        return self.scheduler

    def _fit(self, prompt_len: int, max_tokens: int) -> tuple[int, int]:
        """Shrink a drawn request until it fits the pool on its own, as the HTTP API demands."""
        capacity = self.s.pool.num_total * self.s.config.block_size
        max_tokens = min(max_tokens, capacity - 1)
        return min(prompt_len, capacity - max_tokens), max_tokens

    def _add(self, planned: Planned) -> None:
        self.planned[planned.request.request_id] = planned
        self.s.add_request(planned.request)

    # ---- rules ------------------------------------------------------------------------------------
    @precondition(lambda self: self.scheduler is not None)
    @rule(prompt_len=st.integers(1, 70), max_tokens=st.integers(1, 20), send_after=st.none() | st.integers(1, 4),
          progressive=st.booleans())
    def add_local(self, prompt_len: int, max_tokens: int, send_after: int | None, progressive: bool) -> None:
        prompt_len, max_tokens = self._fit(prompt_len, max_tokens)
        rid = f"local-{len(self.planned)}"
        if send_after is not None:  # a P-style request: blocks stay lent to the connector after it ends
            self.connector.plan_send(rid, send_after)
            if progressive:  # ... and from admission on, while P computes it
                self.connector.plan_progressive(rid)
        self._add(Planned(Request(rid, [1] * prompt_len, SamplingParams(max_tokens, ignore_eos=True))))

    @precondition(lambda self: self.scheduler is not None)
    @rule(
        prompt_len=st.integers(1, 70),
        max_tokens=st.integers(1, 20),
        after=st.integers(1, MAX_LOAD_STEPS),
        outcome=st.sampled_from(OUTCOMES),
        held=st.integers(1, 4),
        data=st.data(),
    )
    def add_remote(self, prompt_len: int, max_tokens: int, after: int, outcome: str, held: int,
                   data: st.DataObject) -> None:
        prompt_len, max_tokens = self._fit(prompt_len, max_tokens)
        rid = f"remote-{len(self.planned)}"
        invalid: tuple[int, ...] = ()
        if outcome in ("blocks", "blocks_no_cause"):
            n = blocks_for(prompt_len, self.s.config.block_size)
            invalid = tuple(sorted(data.draw(st.sets(st.integers(0, n - 1), min_size=1), label="invalid")))
        cause = CAUSE if outcome in ("blocks", "cause", "quarantined") else None
        # A read that may still write: the blocks stay out of the pool `held` steps after the report (for
        # "never", after the abort's).
        quarantine = held if outcome == "quarantined" or (outcome == "never" and held > 2) else None
        self.connector.plan_load(rid, LoadPlan(None, after, invalid, cause, never_finish=outcome == "never",
                                               quarantine_steps=quarantine))
        self.add_remote_request(rid, prompt_len, max_tokens, outcome, invalid)

    def add_remote_request(self, rid: str, prompt_len: int, max_tokens: int, outcome: str = "ok",
                           invalid: tuple[int, ...] = ()) -> None:
        request = Request(rid, [2] * prompt_len, SamplingParams(max_tokens, ignore_eos=True))
        self._add(Planned(request, outcome, invalid))

    @precondition(lambda self: self.scheduler is not None and self.scheduler.requests)
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.s.requests)), label="abort")
        if self.s.abort_request(rid) is not None:
            self.planned[rid].aborted = True

    @precondition(lambda self: self.scheduler is not None)
    @rule()
    def abort_unknown_or_finished(self) -> None:
        assert self.s.abort_request("never-added") is None
        for rid in [r for r in self.planned if r not in self.s.requests][:1]:
            assert self.s.abort_request(rid) is None

    @precondition(lambda self: self.scheduler is not None)
    @rule(n=st.integers(1, 8))
    def steps(self, n: int) -> None:
        for _ in range(n):
            self.step()

    @precondition(lambda self: self.scheduler is not None)
    @rule()
    def drain(self) -> None:
        """Stop adding work, then every request must end within a bound and the pool be full again."""
        for rid, planned in self.planned.items():  # a load that never lands ends by an abort (D's deadline)
            if planned.outcome == "never" and rid in self.s.requests and self.s.abort_request(rid) is not None:
                planned.aborted = True
        live = [p.request for p in self.planned.values() if not p.request.is_finished]
        # Each live request needs at most prompt + max_tokens computing steps (fewer with batching); the
        # factor leaves room for recomputes after preemption (measured: under half of the bound over 4,000
        # examples); a deadlock or a livelock never ends.
        bound = 10 + MAX_LOAD_STEPS + 4 * sum(r.num_prompt_tokens + r.sampling_params.max_tokens for r in live)
        for _ in range(bound):
            if not (self.s.has_unfinished or self.s.remote or self.s.sending or self.s.quarantine):
                break
            self.step()
        self.check_all_finished()

    # ---- one engine step without the model -------------------------------------------------------
    def step(self) -> SchedulerOutput:
        s, c = self.s, self.connector
        out = s.schedule()
        # Loads (also those started just now), sends and quarantined reads will end.
        in_flight = bool(s.remote or s.sending or s.quarantine)
        c.start_load_kv(c.build_connector_meta(out))
        for chunk in out.chunks:
            rid = chunk.request.request_id
            assert rid not in s.remote, f"{rid} computes while its KV may still be landing"
            assert chunk.start_pos == chunk.request.num_computed_tokens and chunk.num_tokens > 0
            end = chunk.start_pos + chunk.num_tokens
            assert end <= chunk.request.num_tokens
            assert len(s.block_tables[rid]) >= blocks_for(end, s.config.block_size), f"{rid} writes past its blocks"
        assert len({ch.request.request_id for ch in out.chunks}) == len(out.chunks) <= s.config.max_num_seqs
        assert sum(ch.num_tokens for ch in out.chunks) <= s.config.max_num_batched_tokens
        sampled = {ch.request.request_id: TOKEN for ch in out.chunks if ch.start_pos + ch.num_tokens == ch.request.num_tokens}
        sending, recving = c.get_finished(out.finished_req_ids)
        worker = WorkerResult(sending, recving, c.take_load_reports())
        for request in s.update(out, sampled, worker):
            if not request.is_finished and len(request.output_token_ids) >= request.sampling_params.max_tokens:
                s.finish(request, RequestStatus.FINISHED_LENGTH_CAPPED)
        s.check_integrity()
        # Progress: with nothing in flight (no load landing, no send to be released), a step that computes
        # nothing is a self-preemption's; two in a row mean nothing will ever run again.
        if not out.chunks and not in_flight and s.has_unfinished:
            self.idle_steps += 1
            assert self.idle_steps <= 1, f"stalled: {self.describe()}"
        else:
            self.idle_steps = 0
        assert self.s.num_unknown_ids == 0
        for request in s.running:  # lent: every block it can need from admission on, never preempted
            if request.kv_lent:
                need = request.num_prompt_tokens + request.sampling_params.max_tokens - 1
                assert len(s.block_tables[request.request_id]) >= blocks_for(need, s.config.block_size)
                assert request.num_recomputed_tokens == 0 and request.request_id in c.progressive
        return out

    # ---- checks -----------------------------------------------------------------------------------
    @invariant()
    def blocks_have_one_owner(self) -> None:
        if self.scheduler is None:
            return
        s = self.scheduler
        s.check_integrity()
        owned = [b for t in (*s.block_tables.values(), *s.sending.values(), *s.quarantine.values()) for b in t]
        assert len(owned) == len(set(owned)), f"a block has two owners: {self.describe()}"
        assert all(s.pool.refcount(b) == 1 for b in owned)

    def check_all_finished(self) -> None:
        s = self.s
        assert not (s.has_unfinished or s.remote or s.sending or s.quarantine), f"not idle after the bound: {self.describe()}"
        assert s.pool.num_free == s.pool.num_total, self.describe()
        assert not (s.requests or s.ready or s.block_tables), self.describe()
        # request_finished exactly once per request: the connector frees (or releases) each one once.
        assert Counter(self.connector.finished_calls) == Counter(self.planned.keys()), self.describe()
        for rid, p in self.planned.items():
            r = p.request
            if p.aborted:
                assert r.status == RequestStatus.FINISHED_ABORTED, rid
            elif p.outcome in FAILURES and s.config.kv_load_failure_policy == "fail":
                assert r.status == RequestStatus.FINISHED_ERROR, rid
                assert r.error_code == (CAUSE[0] if p.outcome != "blocks_no_cause" else "kv_load_failed")
            else:
                assert r.status == RequestStatus.FINISHED_LENGTH_CAPPED, (rid, r.status)
                assert r.output_token_ids == [TOKEN] * r.sampling_params.max_tokens, rid
                first_invalid = min(p.invalid) if p.invalid else 0
                lost = r.num_prompt_tokens - first_invalid * s.config.block_size if p.outcome in FAILURES else 0
                assert r.num_recomputed_tokens == lost, rid
            self.check_progress(p)

    def check_progress(self, p: Planned) -> None:
        """What P's connector heard of a pushed request: whole steps of its prompt, growing, in the blocks
        it held from admission to the end (never preempted, never moved)."""
        reports = self.connector.progress.get(p.request.request_id, [])
        if p.request.request_id not in self.connector.progressive:
            assert not reports
            return
        computed = [n for n, _ in reports]
        assert computed == sorted(set(computed)) and all(0 < n < p.request.num_prompt_tokens for n in computed)
        assert len({tuple(blocks) for _, blocks in reports}) <= 1, "a pushed request's blocks moved"

    def describe(self) -> str:
        s = self.s
        live = ", ".join(f"{r.request_id}:{r.status.name}@{r.num_computed_tokens}/{r.num_tokens}"
                         f"+{len(s.block_tables.get(r.request_id, []))}b" for r in s._all_live())
        return (f"step {s.step_count}, free {s.pool.num_free}/{s.pool.num_total}, sending {sorted(s.sending)}, "
                f"quarantine {sorted(s.quarantine)}, live [{live}]")

    def teardown(self) -> None:
        if self.scheduler is not None:
            self.drain()


TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = settings(max_examples=300, stateful_step_count=30, deadline=None)


@pytest.mark.parametrize("second_lands_after", range(1, MAX_LOAD_STEPS + 1))
def test_issue_18_three_remote_requests_on_four_blocks(second_lands_after: int) -> None:
    """Issue 18 at the scheduler: D with 4 blocks of 16, three pulled 31-token prompts with max_tokens 12
    (3 blocks each by the end). The first outgrows the pool while the second holds its 2 blocks (the
    landing step decides whether the second is still loading, loaded, or already running then); all
    three must finish. On the old scheduler, landing after 2 or 3 steps deadlocked."""
    machine = SchedulerMachine()
    machine.setup(num_blocks=4, block_size=16, policy="fail", budget=4096, chunk=256, max_seqs=64)
    for i, after in enumerate((1, second_lands_after, 1)):
        machine.connector.plan_load(f"r{i}", LoadPlan(None, after_steps=after))
        machine.add_remote_request(f"r{i}", 31, 12)
    machine.drain()


def test_a_pushed_request_is_never_the_preemption_victim() -> None:
    """P pushes B while it computes (every block it can need, lent from admission); A, ahead of it in the
    running queue, outgrows the full pool mid-way through B's prefill: A preempts itself, B keeps its
    blocks (a write may be reading them), and both finish."""
    machine = SchedulerMachine()
    machine.setup(num_blocks=4, block_size=4, policy="fail", budget=4, chunk=0, max_seqs=2)
    machine.add_local(prompt_len=3, max_tokens=6, send_after=None, progressive=False)
    machine.add_local(prompt_len=8, max_tokens=5, send_after=1, progressive=True)
    machine.drain()
    pushed = machine.planned["local-1"].request
    assert [n for n, _ in machine.connector.progress["local-1"]] == [1, 4]  # then the prompt's end
    assert pushed.num_preemptions == 0 and machine.planned["local-0"].request.num_preemptions > 0
