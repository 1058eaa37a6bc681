"""Scheduler + engine against the scripted fake connector: the remote-KV contract, failure policies,
aborts, unknown ids, delayed free and preemption. Every test ends with the block pool full."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from kvferry.connector.fake import LoadPlan, ScriptedConnector
from kvferry.connector.loads import LoadReport
from kvferry.connector.messages import FirstToken
from kvferry.engine.engine import Engine, EngineConfig, RequestOutput
from kvferry.engine.model import ModelConfig, TinyLlama
from kvferry.engine.request import Request, RequestStatus, SamplingParams

BS = 16
MODEL = ModelConfig(seed=3)


@pytest.fixture(scope="module")
def model() -> TinyLlama:
    return TinyLlama(MODEL)


def make_engine(policy: str = "fail", num_blocks: int = 256) -> tuple[Engine, ScriptedConnector]:
    connector = ScriptedConnector()
    config = EngineConfig(num_blocks=num_blocks, block_size=BS, kv_load_failure_policy=policy, model=MODEL)
    return Engine(config, connector), connector


def prompt(n: int, salt: int = 0) -> list[int]:
    return [(i * 7 + salt * 13 + 5) % 256 for i in range(n)]


class Collector:
    def __init__(self) -> None:
        self.outputs: dict[str, list[RequestOutput]] = {}

    def sink(self, request_id: str) -> Callable[[RequestOutput], None]:
        self.outputs[request_id] = []
        return self.outputs[request_id].append

    def tokens(self, request_id: str) -> list[int]:
        return [t for out in self.outputs[request_id] for t in out.new_token_ids]

    def final(self, request_id: str) -> RequestOutput:
        last = self.outputs[request_id][-1]
        assert last.finished
        return last


def submit(engine: Engine, col: Collector, rid: str, ids: list[int], max_tokens: int = 8, **kw: object) -> Request:
    request = Request(rid, ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True), **kw)  # type: ignore[arg-type]
    engine.submit(request, col.sink(rid))
    return request


def reference_kv(model: TinyLlama, ids: list[int]) -> np.ndarray:
    """The prompt's KV as P would have computed it, blocks 0..n-1 of a scratch cache."""
    n = -(-len(ids) // BS)
    cache = model.allocate_kv_cache(model.kv_cache_spec(n, BS))
    model.forward(cache, BS, ids, 0, list(range(n)))
    return cache


def fill_from(engine: Engine, ref: np.ndarray, poison: set[int] = frozenset()) -> Callable[[list[int]], None]:  # type: ignore[assignment]
    """A load that writes the reference KV, and NaN into the blocks (by index) that 'failed'."""

    def fill(block_ids: list[int]) -> None:
        for i, block_id in enumerate(block_ids[: ref.shape[0]]):
            engine.kv_cache[block_id] = np.nan if i in poison else ref[i]

    return fill


def assert_pool_full(engine: Engine) -> None:
    engine.scheduler.check_integrity()
    assert engine.pool.num_free == engine.pool.num_total
    assert not engine.scheduler.requests and not engine.scheduler.sending


def reference_tokens(model: TinyLlama, ids: list[int], n: int = 8) -> list[int]:
    return model.generate_greedy(ids, n, stop_at_eos=False)


def test_colocated_requests_match_reference(model: TinyLlama) -> None:
    engine, _ = make_engine()
    col = Collector()
    prompts = {f"r{i}": prompt(n, i) for i, n in enumerate([1, 15, 16, 17, 40, 100])}
    for rid, ids in prompts.items():
        submit(engine, col, rid, ids)
    engine.run_until_idle()
    for rid, ids in prompts.items():
        assert col.tokens(rid) == reference_tokens(model, ids)
        assert col.final(rid).finish_reason == "length"
    assert_pool_full(engine)


def test_remote_load_enters_and_leaves_waiting_for_remote_kvs(model: TinyLlama) -> None:
    engine, connector = make_engine()
    col = Collector()
    ids = prompt(50)
    connector.plan_load("r", LoadPlan(None, after_steps=3, fill=fill_from(engine, reference_kv(model, ids))))
    request = submit(engine, col, "r", ids)
    engine._drain_commands()
    engine.step()
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert engine.pool.num_free == engine.pool.num_total - 4
    engine.step()
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    engine.run_until_idle()
    assert col.tokens("r") == reference_tokens(model, ids)
    assert request.num_recomputed_tokens == 0
    assert_pool_full(engine)


def test_first_token_from_p_is_emitted_without_computing_the_last_prompt_position(model: TinyLlama) -> None:
    """The load lands with the token P sampled: D emits it in that very step and decodes from it. (A
    token other than the reference one proves it is P's that D emits.)"""
    engine, connector = make_engine()
    col = Collector()
    ids = prompt(50)
    expected = reference_tokens(model, ids)
    p_token = (expected[0] + 1) % 256
    fill = fill_from(engine, reference_kv(model, ids))
    connector.plan_load("r", LoadPlan(None, after_steps=2, fill=fill, first_token=FirstToken(p_token, 0.0)))
    request = submit(engine, col, "r", ids)
    engine._drain_commands()
    engine.step()
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    out = engine.step()
    assert out.chunks == []  # nothing computed ...
    assert col.tokens("r") == [p_token]  # ... and the first token is out
    assert (request.status, request.num_computed_tokens) == (RequestStatus.RUNNING, len(ids))
    engine.run_until_idle()
    tokens = col.tokens("r")
    assert tokens[0] == p_token and len(tokens) == 8
    assert request.num_recomputed_tokens == 0
    assert_pool_full(engine)


@pytest.mark.parametrize(
    ("first_token", "policy", "invalid"),
    [
        (FirstToken(7, 0.7, 1), "fail", ()),  # P sampled otherwise than D's request does
        (FirstToken(10**6, 0.0), "fail", ()),  # not in the vocabulary
        (FirstToken(7, 0.0), "recompute", (2,)),  # a block did not land: D recomputes from it
    ],
)
def test_first_token_from_p_is_ignored_unless_it_is_this_requests_own(
    model: TinyLlama, first_token: FirstToken, policy: str, invalid: tuple[int, ...]
) -> None:
    engine, connector = make_engine(policy)
    col = Collector()
    ids = prompt(64)
    fill = fill_from(engine, reference_kv(model, ids), poison=set(invalid))
    connector.plan_load("r", LoadPlan(None, 2, invalid_block_indices=invalid, fill=fill, first_token=first_token))
    submit(engine, col, "r", ids)
    engine.run_until_idle()
    assert col.tokens("r") == reference_tokens(model, ids)
    assert_pool_full(engine)


def test_fail_policy_gives_finished_error_with_cause(model: TinyLlama) -> None:
    engine, connector = make_engine("fail")
    col = Collector()
    ids = prompt(64)
    cause = ("transport", "data plane broke after 2 of 4 blocks")
    connector.plan_load("r", LoadPlan(None, 2, invalid_block_indices=(2, 3), cause=cause))
    request = submit(engine, col, "r", ids)
    engine.run_until_idle()
    final = col.final("r")
    assert request.status == RequestStatus.FINISHED_ERROR
    assert (final.finish_reason, final.error_code, final.error_message) == ("error", *cause)
    assert final.new_token_ids == []
    assert_pool_full(engine)


@pytest.mark.parametrize("first_invalid", [0, 1, 3, 4])
def test_recompute_cuts_to_first_invalid_block_and_output_is_bit_identical(model: TinyLlama, first_invalid: int) -> None:
    engine, connector = make_engine("recompute")
    col = Collector()
    ids = prompt(75)  # 5 blocks, the last one partial
    lost = set(range(first_invalid, 5))
    fill = fill_from(engine, reference_kv(model, ids), poison=lost)
    connector.plan_load("r", LoadPlan(None, 1, tuple(sorted(lost)), ("transport", "broke"), fill))
    request = submit(engine, col, "r", ids)
    engine.run_until_idle()
    assert col.tokens("r") == reference_tokens(model, ids)
    assert request.num_recomputed_tokens == len(ids) - first_invalid * BS
    assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert_pool_full(engine)


def test_failure_without_block_detail_recomputes_whole_request(model: TinyLlama) -> None:
    engine, connector = make_engine("recompute")
    col = Collector()
    ids = prompt(40)
    fill = fill_from(engine, reference_kv(model, ids), poison={0, 1, 2})
    connector.plan_load("r", LoadPlan(None, 1, (), ("recv_timeout", "no reply"), fill))
    request = submit(engine, col, "r", ids)
    engine.run_until_idle()
    assert col.tokens("r") == reference_tokens(model, ids)
    assert request.num_recomputed_tokens == len(ids)
    assert_pool_full(engine)


def test_abort_while_waiting_frees_blocks_only_after_worker_reports() -> None:
    engine, connector = make_engine()
    col = Collector()
    connector.plan_load("r", LoadPlan(None, never_finish=True))
    request = submit(engine, col, "r", prompt(40))
    engine._drain_commands()
    engine.step()
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    engine.abort("r")
    engine._drain_commands()
    assert col.final("r").finish_reason == "abort"
    assert engine.pool.num_free == engine.pool.num_total - 3  # the worker may still write into them
    assert "r" in engine.scheduler.remote
    engine.run_until_idle()  # the scheduler tells the worker, which reports the request back
    assert "r" in connector.finished_calls
    assert_pool_full(engine)


def step_until(engine: Engine, done: Callable[[], bool], max_steps: int = 50) -> None:
    engine._drain_commands()
    for _ in range(max_steps):
        if done():
            return
        engine.step()
    raise AssertionError(f"not done after {max_steps} steps")


def quarantined_blocks(engine: Engine) -> int:
    return sum(len(b) for b in engine.scheduler.quarantine.values())


def test_a_quarantined_failure_fails_at_once_and_its_blocks_wait_for_the_release() -> None:
    engine, connector = make_engine("fail")
    col = Collector()
    connector.plan_load("r", LoadPlan(None, 1, (0, 1, 2), ("peer_dead", "P stopped"), quarantine_steps=5))
    request = submit(engine, col, "r", prompt(40))
    step_until(engine, lambda: request.is_finished)
    assert (col.final("r").finish_reason, col.final("r").error_code) == ("error", "peer_dead")
    for _ in range(4):  # a read may still write the blocks: in no request's hands, out of the pool
        assert quarantined_blocks(engine) == 3 and engine.pool.num_free == engine.pool.num_total - 3
        engine.scheduler.check_integrity()
        engine.step()
    engine.run_until_idle()
    assert quarantined_blocks(engine) == 0
    assert_pool_full(engine)


def test_recompute_of_a_quarantined_load_uses_other_blocks(model: TinyLlama) -> None:
    engine, connector = make_engine("recompute")
    col = Collector()
    ids = prompt(40)
    poisoned = fill_from(engine, reference_kv(model, ids), poison={0, 1, 2})
    # The read that outlived the failure lands (NaN) in the old blocks while the request decodes.
    connector.plan_load("r", LoadPlan(None, 1, (0, 1, 2), ("peer_dead", "P stopped"), poisoned,
                                      quarantine_steps=3, late_fill=poisoned))
    request = submit(engine, col, "r", ids)
    step_until(engine, lambda: "r" in engine.scheduler.quarantine)
    old = set(engine.scheduler.quarantine["r"])
    engine.step()
    assert not old & set(engine.scheduler.block_tables["r"])
    engine.run_until_idle()
    assert col.tokens("r") == reference_tokens(model, ids)
    assert request.num_recomputed_tokens == len(ids)
    assert_pool_full(engine)


def test_an_abort_reported_quarantined_keeps_its_blocks_until_the_release() -> None:
    engine, connector = make_engine()
    col = Collector()
    connector.plan_load("r", LoadPlan(None, never_finish=True, quarantine_steps=4))
    submit(engine, col, "r", prompt(40))
    step_until(engine, lambda: "r" in engine.scheduler.remote)
    engine.abort("r")
    step_until(engine, lambda: "r" not in engine.scheduler.remote)
    assert col.final("r").finish_reason == "abort"
    assert quarantined_blocks(engine) == 3 and engine.pool.num_free == engine.pool.num_total - 3
    engine.run_until_idle()
    assert_pool_full(engine)


def test_unknown_ids_from_the_connector_are_ignored_and_counted(model: TinyLlama) -> None:
    engine, connector = make_engine()
    col = Collector()
    connector.inject(1, finished_recving={"ghost-1"}, finished_sending={"ghost-2"},
                     loads={"ghost-3": LoadReport("ghost-3", (7,))})
    ids = prompt(20)
    submit(engine, col, "r", ids)
    engine.run_until_idle()
    assert engine.scheduler.num_unknown_ids == 3
    assert col.tokens("r") == reference_tokens(model, ids)
    assert_pool_full(engine)


def test_delay_free_keeps_blocks_until_finished_sending() -> None:
    engine, connector = make_engine()
    col = Collector()
    connector.plan_send("r", after_steps=5)
    submit(engine, col, "r", prompt(33), max_tokens=1)
    engine._drain_commands()
    engine.step()
    final = col.final("r")
    assert final.kv_transfer_params == {"do_remote_prefill": True, "transfer_id": "xfer-r"}
    for _ in range(4):
        assert engine.pool.num_free == engine.pool.num_total - 3
        assert "r" in engine.scheduler.sending
        engine.step()
    engine.run_until_idle()
    assert_pool_full(engine)


def test_preemption_under_block_pressure_keeps_outputs_identical(model: TinyLlama) -> None:
    engine, _ = make_engine(num_blocks=12)
    col = Collector()
    prompts = {f"r{i}": prompt(40, i) for i in range(4)}
    requests = [submit(engine, col, rid, ids, max_tokens=30) for rid, ids in prompts.items()]
    engine.run_until_idle()
    assert sum(r.num_preemptions for r in requests) > 0
    for rid, ids in prompts.items():
        assert col.tokens(rid) == reference_tokens(model, ids, 30)
    assert_pool_full(engine)


def test_abort_waiting_and_running_requests_frees_everything() -> None:
    engine, _ = make_engine()
    col = Collector()
    submit(engine, col, "a", prompt(30), max_tokens=100)
    submit(engine, col, "b", prompt(30, 1), max_tokens=100)
    engine._drain_commands()
    engine.step()
    engine.abort("a")
    engine.abort("b")
    engine.abort("never-existed")
    engine.run_until_idle()
    assert col.final("a").finish_reason == "abort" and col.final("b").finish_reason == "abort"
    assert_pool_full(engine)


def test_parked_requests_are_not_scanned_per_step() -> None:
    """1,000 parked loads: a step touches only what changed (the scheduler never iterates them)."""
    engine, connector = make_engine(num_blocks=1100)
    col = Collector()
    for i in range(1000):
        connector.plan_load(f"p{i}", LoadPlan(None, never_finish=True))
        submit(engine, col, f"p{i}", [1, 2, 3], max_tokens=1)
    engine._drain_commands()
    engine.step()
    assert len(engine.scheduler.remote) == 1000
    for i in range(1000):
        engine.abort(f"p{i}")
    engine.run_until_idle()
    assert_pool_full(engine)
