"""Tensor parallel P and D (#30): each vLLM worker is one kvferry rank with its own data plane and control
socket; D rank r pulls exactly its heads from the P ranks that hold them; vLLM's own `KVOutputAggregator`
merges the ranks' results, so a request is loaded only when every rank has it, and one rank's failure
fails (or recomputes) the whole request. Several workers per instance in one process (vllm_harness), each
with KV tensors allocated by vLLM's `allocate_kv_cache` for its share of the heads.

Runs in the optional environment (`bash .ci/vllm-env.sh`); skips where vLLM is not installed.
"""

from __future__ import annotations

from typing import Any

import pytest
from test_vllm_connector import HAVE_VLLM

from kvferry.integrations.vllm.settings import KVFerrySettings

pytestmark = pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed (see .ci/vllm-env.sh)")

if HAVE_VLLM:
    import torch
    from test_vllm_connector import (
        PD,
        PROMPT,
        assert_blocks_equal,
        decode_to_end,
        make_pd,
        model_dir,
        p_prompt_bytes,
    )
    from vllm.v1.engine import FinishReason
    from vllm.v1.request import RequestStatus
    from vllm_harness import BLOCK_SIZE, LAYER_NAMES, NUM_KV_HEADS, Instance, kv_of, token_after

    __all__ = ["make_pd", "model_dir"]  # fixtures


def heads_of(pd_instance: Any, rank: int, block: int) -> list[Any]:
    """Worker `rank`'s KV of one block, per layer ([its heads, tokens, content])."""
    return [pd_instance.worker_caches[rank][name][block].clone() for name in LAYER_NAMES]


@pytest.mark.parametrize(("p_tp", "d_tp"), [(2, 1), (1, 2), (2, 2), (4, 2)])
def test_tp_p_to_d_moves_each_ranks_heads(make_pd: Any, p_tp: int, d_tp: int) -> None:
    pd: PD = make_pd(p_tp=p_tp, d_tp=d_tp)
    assert [w.layout.num_kv_heads for w in pd.p.workers + pd.d.workers] == [NUM_KV_HEADS] * (p_tp + d_tp)
    # Every P rank has its own control socket and data plane, all behind P's one bootstrap server.
    p_stats = [w.stats()["prefill"] for w in pd.p.workers]
    assert len({s["control_addrs"][0] for s in p_stats}) == p_tp
    assert len({s["transfer_addrs"][0] for s in p_stats}) == p_tp
    p_req, params = pd.prefill(PROMPT)
    expected = p_prompt_bytes(pd, p_req, PROMPT)  # all heads, gathered from P's workers
    d_req = pd.d.add(PROMPT, 5, params)
    pd.d.step()
    assert d_req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    pd.both_until(lambda: d_req.request_id in pd.d.scheduler.finished_recving_kv_req_ids, what="KV arrival")
    assert_blocks_equal(pd, d_req.request_id, expected)
    # D rank r holds exactly heads [r * H / d_tp, (r + 1) * H / d_tp) of the fake model's KV.
    per = NUM_KV_HEADS // d_tp
    for rank in range(d_tp):
        for b, block in enumerate(pd.d.block_ids(d_req.request_id)[: len(expected)]):
            for layer, got in enumerate(heads_of(pd.d, rank, block)):
                assert torch.equal(got, expected[b][layer][rank * per:(rank + 1) * per])
    out = decode_to_end(pd, d_req.request_id)
    assert out.finish_reason == FinishReason.LENGTH
    assert pd.d.tokens(d_req.request_id)[0] == token_after(PROMPT)
    # vLLM's aggregator reported each id once, after every rank had it.
    assert pd.d.received == [d_req.request_id] and pd.p.sent == [p_req] and not pd.d.invalid
    pd.assert_empty()


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_one_p_rank_gone_fails_or_recomputes_the_whole_request(make_pd: Any, policy: str) -> None:
    """P TP 2 -> D TP 2: P's rank 1 worker dies after the prefill. D rank 0 loads its heads from P rank 0,
    D rank 1 cannot: the request is not half loaded. `fail` ends it with an error; `recompute` recomputes
    it (every rank) and the output is what a clean run gives."""
    pd: PD = make_pd(p_tp=2, d_tp=2, policy=policy, abort_timeout_s=2.0)
    _, params = pd.prefill(PROMPT)
    pd.p.step()  # the step that hands the finished prefill's blocks to P's workers
    pd.p.workers[1].shutdown(timeout_s=2.0)  # its control socket and data plane close
    pd.p_alive = False  # vLLM's engine dies with a worker: P steps no more
    d_req = pd.d.add(PROMPT, 3, params)
    out = decode_to_end(pd, d_req.request_id)
    cause = pd.d.connector.failure_causes[d_req.request_id][0]
    assert cause in ("peer_dead", "transport", "recv_timeout"), cause
    # Under `fail` vLLM ends the request at the first rank's invalid blocks and keeps its blocks until
    # every rank reported it (the other rank's pull is aborted); reported to the scheduler once.
    pd.both_until(lambda: d_req.request_id in pd.d.received, what="both D ranks to report")
    assert pd.d.received == [d_req.request_id]
    if policy == "fail":
        assert out.finish_reason == FinishReason.ERROR and not pd.d.tokens(d_req.request_id)
    else:
        assert out.finish_reason == FinishReason.LENGTH
        tokens = pd.d.tokens(d_req.request_id)
        assert tokens[0] == token_after(PROMPT) and len(tokens) == 3
        # Every prompt block ended up with the right KV on both ranks (loaded or recomputed).
        for b, block in enumerate(pd.d.block_ids(d_req.request_id)[: -(-len(PROMPT) // BLOCK_SIZE)]):
            for layer, got in enumerate(pd.d.block_bytes(block)):
                n = min(BLOCK_SIZE, len(PROMPT) - b * BLOCK_SIZE)
                want = torch.stack([kv_of(PROMPT[: b * BLOCK_SIZE + i + 1])[layer] for i in range(n)], dim=1)
                assert torch.equal(got[:, :n], want), f"block {b} layer {layer}"
    assert pd.d.invalid, "the failed rank's blocks reached vLLM's scheduler"
    pd.assert_empty()


def test_heads_that_tp_does_not_divide_are_refused_at_start(model_dir: str) -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size 5 does not divide the model's 12 KV heads"):
        Instance("X", model_dir, "kv_producer", {}, tp_size=5)


def test_pipeline_parallel_is_refused_at_start(model_dir: str) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm_harness import vllm_config

    from kvferry.integrations.vllm import KVFerryConnector

    config = vllm_config(model_dir, "kv_producer", {})
    config.parallel_config.pipeline_parallel_size = 2
    with pytest.raises(ValueError, match="does not support pipeline parallelism"):
        KVFerryConnector(config, KVConnectorRole.SCHEDULER, None)


def test_each_data_parallel_rank_is_its_own_engine() -> None:
    base = KVFerrySettings.from_extra_config({"engine_id": "p", "bootstrap_port": 9000, "data_port": 7000}, "x")
    ranks = [base.for_data_parallel(r, 2, 4, engine_id_given=True) for r in range(2)]
    assert [s.engine_id for s in ranks] == ["p_dp0", "p_dp1"]
    assert [s.bootstrap_port for s in ranks] == [9000, 9001]
    assert [s.data_port for s in ranks] == [7000, 7004]  # past the 4 ranks of DP rank 0
    # vLLM's own engine id already ends in _dp<rank>: not suffixed twice.
    own = KVFerrySettings.from_extra_config({}, "uuid_dp1").for_data_parallel(1, 2, 1, engine_id_given=False)
    assert own.engine_id == "uuid_dp1" and own.bootstrap_port == 8999
    assert base.for_data_parallel(0, 1, 4, engine_id_given=True) is base


def test_bytes_p_wrote_before_dying_unanswered_are_not_loaded(make_pd: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """P TP 1 -> D TP 2, `fail`. P's writes land, with 8 bytes in the middle altered (the `corrupt` fault:
    P's own engine writes them), and P dies before its answer (which would carry the checksums that catch
    them). D must not decode from bytes nothing verified: the request fails, no token sampled. The
    lifecycle machine found this (both D ranks sampled with wrong KV at layer 4, no load failure)."""
    from kvferry.connector.prefill.writes import RankWriter

    answered: list[str] = []
    monkeypatch.setattr(RankWriter, "_done", lambda self, reply, identity, w, answer: answered.append(answer.transfer_id))
    pd: PD = make_pd(d_tp=2, faults="corrupt=1.0")
    _, params = pd.prefill(PROMPT)
    d_req = pd.d.add(PROMPT, 3, params)
    pd.both_until(lambda: len(answered) == 2, what="both D ranks' writes done, unanswered")
    for worker in pd.p.workers:  # P dies before it answers
        worker.shutdown(timeout_s=2.0)
    pd.p_alive = False
    out = decode_to_end(pd, d_req.request_id)
    assert pd.d.connector.failure_causes[d_req.request_id][0] == "peer_dead"
    assert out.finish_reason == FinishReason.ERROR and not pd.d.tokens(d_req.request_id)
    assert pd.d.invalid, "no block of the unanswered pull may count as loaded"
    pd.assert_empty()
