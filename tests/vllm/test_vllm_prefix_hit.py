"""D pulls past its own prefix-cache hit: a multi-turn conversation, where each turn's prompt is the
previous prompt, its answer and a new message. D's prefix cache holds the earlier turns' whole blocks,
so vLLM 0.33's scheduler asks the connector with `num_computed_tokens` > 0; D answers with the prompt's
tokens past the hit, pulls only those blocks from P (the pull's `first_block`), and never computes a
prompt token itself. Real `Scheduler`s and kvferry's real data and control planes, as in
test_vllm_connector.py.

Runs in the optional environment (`bash .ci/vllm-env.sh`); skips where vLLM is not installed.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
from test_vllm_connector import HAVE_VLLM

if not HAVE_VLLM:  # the harness imports vLLM: skip before importing it
    pytest.skip("vLLM is not installed (see .ci/vllm-env.sh)", allow_module_level=True)

import torch
from test_vllm_connector import PD, decode_to_end, make_pd, model_dir
from test_vllm_hma import NULL, HybridPD, group_of
from vllm.platforms import current_platform
from vllm.v1.engine import FinishReason
from vllm_harness import BLOCK_SIZE, HEAD_SIZE, LAYER_NAMES, NUM_KV_HEADS, kv_of, token_after

from kvferry.connector.faults import FaultSpec
from kvferry.connector.messages import PullRequest

__all__ = ["make_pd", "model_dir"]  # fixtures

TURN1 = [(11 * i + 5) % 50000 + 3 for i in range(3 * BLOCK_SIZE + 5)]  # 53 tokens
ANSWER = 8  # D's answer to turn 1: it computes the KV of 60 tokens, so 3 whole blocks are cached
HIT = 3 * BLOCK_SIZE
LAYER_BLOCK = NUM_KV_HEADS * BLOCK_SIZE * 2 * HEAD_SIZE * 2  # one layer's block: heads x tokens x (K, V) x fp16


def reference(prompt: list[int], n: int) -> list[int]:
    """The colocated output: the fake model's tokens after the prompt."""
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(token_after(tokens))
    return tokens[len(prompt):]


def next_turn(message_tokens: int) -> list[int]:
    """Turn 2's prompt: turn 1's prompt, D's answer to it (the colocated one), and a new message."""
    return TURN1 + reference(TURN1, ANSWER) + [(13 * i + 7) % 50000 + 3 for i in range(message_tokens)]


def spy_pulls(pd: PD) -> list[PullRequest]:
    """Every pull P's ranks are asked for, as it reached them."""
    pulls: list[PullRequest] = []
    for worker in pd.p.workers:
        table = worker.pd["prefill"].producer.table
        begin_pull = table.begin_pull

        def spy(pull: PullRequest, *args: Any, begin_pull: Any = begin_pull, **kw: Any) -> Any:
            pulls.append(pull)
            return begin_pull(pull, *args, **kw)

        table.begin_pull = spy
    return pulls


def tokens_in(prompt: list[int], pos: int) -> int:
    """How many of the prompt's tokens block `pos` holds."""
    return min(BLOCK_SIZE, len(prompt) - pos * BLOCK_SIZE)


def same_kv(a: list[torch.Tensor], b: list[torch.Tensor], n: int) -> bool:
    """Two blocks' KV (per layer: [heads, tokens, content]) agree on their first `n` tokens."""
    return all(torch.equal(x[:, :n], y[:, :n]) for x, y in zip(a, b, strict=True))


def bytes_received(pd: PD) -> int:
    return sum(e.stats["bytes_received"] for w in pd.d.workers for e in w.pd["decode"].transfer_engines)


def first_turn(pd: PD, transfer_id: str) -> list[int]:
    """Turn 1 through P and D: D's prefix cache then holds its blocks. Returns D's block ids of them."""
    _, params = pd.prefill(TURN1, transfer_id)
    req = pd.d.add(TURN1, ANSWER, params)
    pd.d.step()
    blocks = pd.d.block_ids(req.request_id)[: HIT // BLOCK_SIZE]
    out = decode_to_end(pd, req.request_id)
    assert out.finish_reason == FinishReason.LENGTH and pd.d.tokens(req.request_id) == reference(TURN1, ANSWER)
    return blocks


def clean_and_faulty_ids(spec: FaultSpec) -> tuple[str, str]:
    """A transfer id no fault fires for, and one the spec's fault fires for."""
    ids = [f"xfer-hit-{n}" for n in range(200)]
    return (next(t for t in ids if spec.fault_for(t) is None), next(t for t in ids if spec.fault_for(t) is not None))


@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 1), (1, 2)])
def test_second_turn_pulls_only_the_blocks_past_ds_hit(make_pd: Any, p_tp: int, d_tp: int) -> None:
    pd: PD = make_pd(p_tp=p_tp, d_tp=d_tp)
    pulls = spy_pulls(pd)
    d_hit_blocks = first_turn(pd, "xfer-turn1")
    prompt = next_turn(30)  # 91 tokens: 6 blocks, of which D holds 3
    n_blocks = -(-len(prompt) // BLOCK_SIZE)
    p_req, params = pd.prefill(prompt, "xfer-turn2")
    p_blocks = pd.p.block_ids(p_req)[:n_blocks]
    p_bytes = [pd.p.block_bytes(b) for b in p_blocks]
    pulls.clear()
    received = bytes_received(pd)

    req = pd.d.add(prompt, 5, params)
    pd.d.step()
    rid = req.request_id
    assert pd.d.alloc_calls[-1] == (rid, len(prompt) - HIT)  # external tokens: the prompt past the hit
    d_blocks = pd.d.block_ids(rid)[:n_blocks]
    assert d_blocks[:3] == d_hit_blocks  # D's own cached blocks, not pulled into
    pd.both_until(lambda: rid in pd.d.received, what="KV arrival")
    # Each D rank's pull names D's blocks past the hit, from prompt block 3, for the whole prompt. A rank
    # may ask P again (a pull parked before P's KV was ready, or sent again after a re-dial): P answers
    # a repeat without a second write, which the byte count below holds to.
    assert sorted({pull.d_tp_rank for pull in pulls}) == list(range(d_tp)), pulls
    for pull in pulls:
        assert (pull.block_ids, pull.first_block, pull.num_tokens) == (d_blocks[3:], 3, len(prompt))
    assert bytes_received(pd) - received == 3 * len(LAYER_NAMES) * LAYER_BLOCK  # 3 blocks crossed, no more
    for pos in range(n_blocks):  # P's KV past the hit, D's own before it: the fake model's either way
        got, n = pd.d.block_bytes(d_blocks[pos]), tokens_in(prompt, pos)
        assert pos < 3 or same_kv(got, p_bytes[pos], n), f"block {pos}: not P's bytes"
        for layer, g in enumerate(got):
            want = torch.stack([kv_of(prompt[: pos * BLOCK_SIZE + i + 1])[layer] for i in range(n)], dim=1)
            assert torch.equal(g[:, :n], want), f"block {pos} layer {layer}"

    out = decode_to_end(pd, rid)
    assert out.finish_reason == FinishReason.LENGTH and pd.d.tokens(rid) == reference(prompt, 5)
    stats = pd.d.outputs[rid][0].prefill_stats  # what vLLM's prompt_tokens_by_source counts
    assert stats is not None
    # local_compute, local_cache_hit, external_kv_transfer
    assert (stats.num_computed_tokens, stats.num_local_cached_tokens, stats.num_external_cached_tokens) == (
        0, HIT, len(prompt) - HIT)
    assert not pd.d.invalid and rid not in pd.d.connector.failure_causes and p_req in pd.p.sent
    pd.assert_empty()


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_failed_pull_past_the_hit(make_pd: Any, policy: str) -> None:
    """The data plane breaks after half of the pulled blocks. `fail`: the request ends with the
    transport cause. `recompute`: vLLM keeps D's hit and the block that landed, and recomputes exactly
    the missing blocks after them (their indexes are the request's whole block table's)."""
    spec = FaultSpec.parse("transport=0.5,seed=0")
    clean, faulty = clean_and_faulty_ids(spec)
    pd: PD = make_pd(policy=policy, faults=spec.to_spec(), abort_timeout_s=1.5)
    d_hit_blocks = first_turn(pd, clean)
    prompt = next_turn(30)
    n_blocks = -(-len(prompt) // BLOCK_SIZE)
    p_req, params = pd.prefill(prompt, faulty)
    p_bytes = [pd.p.block_bytes(b) for b in pd.p.block_ids(p_req)[:n_blocks]]
    req = pd.d.add(prompt, 5, params)
    pd.d.step()
    rid = req.request_id
    d_blocks = pd.d.block_ids(rid)[:n_blocks]
    assert d_blocks[:3] == d_hit_blocks
    pd.both_until(lambda: rid in pd.d.received, what="the failed load to be reported")
    assert pd.d.connector.failure_causes[rid][0] == "transport"
    # Pulled: blocks 3, 4, 5; the first landed, the two after it did not. D's hit is never invalid.
    assert sorted(pd.d.invalid) == sorted(d_blocks[4:])
    if policy == "fail":
        out = decode_to_end(pd, rid)
        assert out.finish_reason == FinishReason.ERROR and pd.d.tokens(rid) == []
    else:
        assert req.num_computed_tokens == 4 * BLOCK_SIZE  # cut at the first invalid block: 4 of the table
        assert same_kv(pd.d.block_bytes(d_blocks[3]), p_bytes[3], BLOCK_SIZE)  # the block that landed
        pd.both_until(lambda: req.num_computed_tokens >= len(prompt), what="local recompute")
        for pos in range(3, n_blocks):  # the recomputed blocks hold the KV P sent for them
            assert same_kv(pd.d.block_bytes(d_blocks[pos]), p_bytes[pos], tokens_in(prompt, pos)), f"block {pos}"
        out = decode_to_end(pd, rid)
        assert out.finish_reason == FinishReason.LENGTH and pd.d.tokens(rid) == reference(prompt, 5)
    assert p_req in pd.p.sent
    pd.assert_empty()


@pytest.fixture
def make_hybrid(make_pd: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    # vLLM keeps the hybrid allocator off on CPU platforms whatever the connector (as test_vllm_hma.py).
    monkeypatch.setattr(type(current_platform), "support_hybrid_kv_cache", classmethod(lambda cls: True))
    return functools.partial(make_pd, HybridPD)


# A window of 40 tokens: turn 2's window starts after D's hit (a long message: the sliding-window group
# pulls only its window, the full-attention group everything past the hit), or before it (a short one:
# both groups pull from the hit).
@pytest.mark.parametrize(("message", "sliding_from"), [(60, 5), (5, 3)], ids=["window-after-hit", "window-before-hit"])
def test_two_groups_pull_past_the_hit(make_hybrid: Any, message: int, sliding_from: int) -> None:
    pd: PD = make_hybrid()
    pulls = spy_pulls(pd)
    first_turn(pd, "xfer-turn1")
    prompt = next_turn(message)
    n_blocks = -(-len(prompt) // BLOCK_SIZE)
    p_req, params = pd.prefill(prompt, "xfer-turn2")
    p_groups = pd.p.group_block_ids(p_req)
    p_bytes = {(layer, pos): pd.p.layer_block(layer, p_groups[group_of(layer)][pos])
               for layer in range(len(LAYER_NAMES)) for pos in range(3, n_blocks)}
    pulls.clear()
    received = bytes_received(pd)
    req = pd.d.add(prompt, 4, params)
    rid = req.request_id
    pd.both_until(lambda: rid in pd.d.received, what="KV arrival")
    d_groups = pd.d.group_block_ids(rid)
    pool = pd.d.kv_cache_config.num_blocks
    (pull,) = pulls
    moved = {0: range(3, n_blocks), 1: range(sliding_from, n_blocks)}
    assert pull.first_block == 3
    assert pull.block_ids == [g * pool + d_groups[g][pos] for g in (0, 1) for pos in moved[g]]
    layers_per_group = len(LAYER_NAMES) // 2
    assert bytes_received(pd) - received == sum(map(len, moved.values())) * layers_per_group * LAYER_BLOCK
    for layer in range(len(LAYER_NAMES)):
        g = group_of(layer)
        for pos in moved[g]:
            assert d_groups[g][pos] != NULL
            got, n = pd.d.layer_block(layer, d_groups[g][pos]), tokens_in(prompt, pos)
            assert torch.equal(got[:, :n], p_bytes[layer, pos][:, :n]), f"layer {layer} block {pos}: not P's bytes"
    out = decode_to_end(pd, rid)
    assert out.finish_reason == FinishReason.LENGTH and pd.d.tokens(rid) == reference(prompt, 4)
    stats = pd.d.outputs[rid][0].prefill_stats
    assert stats is not None
    assert (stats.num_computed_tokens, stats.num_local_cached_tokens, stats.num_external_cached_tokens) == (
        0, HIT, len(prompt) - HIT)
    assert not pd.d.connector.failure_causes and p_req in pd.p.sent
    pd.assert_empty()
