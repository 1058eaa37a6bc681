"""Hybrid KV cache groups (#30 item 2): KVFerryConnector is `SupportsHMA`, so vLLM 0.33 keeps its hybrid
allocator on, and a model with a full-attention group and a sliding-window group moves each group's blocks
into D's blocks of that group. vLLM's real `Scheduler` and `KVCacheManager` with two groups; vLLM turns the
hybrid allocator off on CPU platforms, so only that platform check is patched.

The fake model (vllm_harness) gives even layers full attention and odd layers a sliding window of
`WINDOW` tokens. Layers of both groups share one KV cache allocation (vLLM aliases the groups' tensors),
and a block id belongs to one group at a time.

Runs in the optional environment (`bash .ci/vllm-env.sh`); skips where vLLM is not installed.
"""

from __future__ import annotations

import functools
from typing import Any

import msgspec
import pytest
from test_vllm_connector import HAVE_VLLM

if not HAVE_VLLM:  # the classes below derive from the vLLM harness: skip before defining them
    pytest.skip("vLLM is not installed (see .ci/vllm-env.sh)", allow_module_level=True)

if HAVE_VLLM:
    import torch
    from test_vllm_connector import PD, PROMPT, decode_to_end, make_pd, model_dir
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole, SupportsHMA
    from vllm.platforms import current_platform
    from vllm.v1.engine import FinishReason
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MambaSpec,
        SlidingWindowSpec,
    )
    from vllm.v1.request import RequestStatus
    from vllm_harness import (
        BLOCK_SIZE,
        HEAD_SIZE,
        LAYER_NAMES,
        NUM_KV_HEADS,
        Instance,
        kv_of,
        token_after,
        vllm_config,
    )

    from kvferry.integrations.vllm import KVFerryConnector

    __all__ = ["make_pd", "model_dir"]  # fixtures

WINDOW = 40  # tokens; PROMPT's 83 tokens skip (83 - 40 + 1) // 16 = 2 of their 6 blocks in the window group
NULL = 0  # vLLM's null block: a sliding-window group's skipped blocks point at it
FULL, SLIDING = 0, 1
N_BLOCKS = -(-len(PROMPT) // BLOCK_SIZE)
SKIPPED = (len(PROMPT) - WINDOW + 1) // BLOCK_SIZE


def group_of(layer: int) -> int:
    return FULL if layer % 2 == 0 else SLIDING


class HybridInstance(Instance):
    """A vLLM instance of a model with a full-attention and a sliding-window KV cache group."""

    def kv_cache_groups(self, tp_size: int) -> list[KVCacheGroupSpec]:
        heads = NUM_KV_HEADS // tp_size
        full = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=heads, head_size=HEAD_SIZE, dtype=torch.float16)
        sliding = SlidingWindowSpec(block_size=BLOCK_SIZE, num_kv_heads=heads, head_size=HEAD_SIZE,
                                    dtype=torch.float16, sliding_window=WINDOW)
        return [KVCacheGroupSpec(LAYER_NAMES[0::2], full), KVCacheGroupSpec(LAYER_NAMES[1::2], sliding)]

    def group_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return tuple(list(ids) for ids in self.scheduler.kv_cache_manager.get_block_ids(request_id))

    def layer_block(self, layer: int, block: int) -> torch.Tensor:
        """One layer's KV of one block, all workers' heads."""
        return torch.cat([caches[LAYER_NAMES[layer]][block] for caches in self.worker_caches]).clone()

    def _forward(self, num_scheduled: dict[str, int], rank: int = 0) -> None:
        """As the harness's, each layer into its own group's block (never into the null block)."""
        per = NUM_KV_HEADS // self.tp_size
        caches = self.worker_caches[rank]
        for req_id, n in num_scheduled.items():
            request = self.scheduler.requests[req_id]
            groups = self.group_block_ids(req_id)
            end = request.num_computed_tokens
            for pos in range(end - n, end):
                kv = kv_of(list(request.all_token_ids[: pos + 1]))
                for layer, name in enumerate(LAYER_NAMES):
                    block = groups[min(group_of(layer), len(groups) - 1)][pos // BLOCK_SIZE]
                    if block != NULL:
                        caches[name][block, :, pos % BLOCK_SIZE, :] = kv[layer, rank * per:(rank + 1) * per]


class HybridPD(PD):
    instance = HybridInstance


@pytest.fixture
def make_hybrid(make_pd: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    # The one patch: vLLM keeps the hybrid allocator off on CPU platforms whatever the connector.
    monkeypatch.setattr(type(current_platform), "support_hybrid_kv_cache", classmethod(lambda cls: True))
    return functools.partial(make_pd, HybridPD)


def expected_kv(prompt: list[int], layer: int, position: int) -> torch.Tensor:
    """The fake model's KV of `layer` in the prompt's block at `position` ([heads, tokens, content])."""
    n = min(BLOCK_SIZE, len(prompt) - position * BLOCK_SIZE)
    return torch.stack([kv_of(prompt[: position * BLOCK_SIZE + i + 1])[layer] for i in range(n)], dim=1)


def moved_positions(group: int) -> range:
    return range(N_BLOCKS) if group == FULL else range(SKIPPED, N_BLOCKS)


def assert_prompt_kv(pd: PD, d_req: str, p_bytes: dict[tuple[int, int], torch.Tensor] | None = None) -> None:
    """D's blocks hold the prompt's KV, each layer in its group's block: P's bytes exactly (`p_bytes`,
    after a pull: the sliding-window group's blocks before the window are then vLLM's null block), and
    the fake model's KV."""
    d_groups = pd.d.group_block_ids(d_req)
    if p_bytes is not None:
        assert d_groups[SLIDING][:SKIPPED] == [NULL] * SKIPPED
    for layer in range(len(LAYER_NAMES)):
        g = group_of(layer)
        for pos in moved_positions(g):
            got = pd.d.layer_block(layer, d_groups[g][pos])
            n = min(BLOCK_SIZE, len(PROMPT) - pos * BLOCK_SIZE)
            if p_bytes is not None:
                assert torch.equal(got[:, :n], p_bytes[layer, pos][:, :n]), f"layer {layer} block {pos}: not P's bytes"
            assert torch.equal(got[:, :n], expected_kv(PROMPT, layer, pos)), f"layer {layer} block {pos}"


def prefill_bytes(pd: PD, p_req: str) -> dict[tuple[int, int], torch.Tensor]:
    """P's KV of the blocks D needs, per (layer, position): read before D pulls."""
    groups = pd.p.group_block_ids(p_req)
    return {(layer, pos): pd.p.layer_block(layer, groups[group_of(layer)][pos])
            for layer in range(len(LAYER_NAMES)) for pos in moved_positions(group_of(layer))}


def bytes_received(pd: PD) -> int:
    return sum(e.stats["bytes_received"] for w in pd.d.workers for e in w.pd["decode"].transfer_engines)


@pytest.mark.parametrize(("p_tp", "d_tp", "layout", "staging"), [
    (1, 1, "LBNHC", "auto"),
    (2, 1, "LBNHC", "auto"),
    (1, 2, "BLHNC", "auto"),  # block-outermost: every layer of both groups in one region
    (1, 1, "LBNHC", "always"),  # through host mirrors (a GPU's KV cache): staged per group
])
def test_two_groups_move_each_groups_blocks(make_hybrid: Any, p_tp: int, d_tp: int, layout: str, staging: str) -> None:
    pd: PD = make_hybrid(p_tp=p_tp, d_tp=d_tp, layout=layout, staging=staging)
    for instance in (pd.p, pd.d):
        assert isinstance(instance.connector, SupportsHMA)
        assert instance.config.scheduler_config.disable_hybrid_kv_cache_manager is False
        assert len(instance.scheduler.kv_cache_manager.kv_cache_config.kv_cache_groups) == 2
    p_req, params = pd.prefill(PROMPT)
    p_bytes = prefill_bytes(pd, p_req)
    d_req = pd.d.add(PROMPT, 5, params)
    pd.d.step()
    assert d_req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    pd.both_until(lambda: d_req.request_id in pd.d.scheduler.finished_recving_kv_req_ids, what="KV arrival")
    assert_prompt_kv(pd, d_req.request_id, p_bytes)
    # Only the window's blocks of the sliding-window group crossed the wire: 6 + 4 blocks of 6 layers.
    layer_block = NUM_KV_HEADS * BLOCK_SIZE * 2 * HEAD_SIZE * 2  # heads x tokens x (K, V) x fp16
    assert bytes_received(pd) == (N_BLOCKS + N_BLOCKS - SKIPPED) * len(LAYER_NAMES) // 2 * layer_block
    out = decode_to_end(pd, d_req.request_id)
    assert out.finish_reason == FinishReason.LENGTH
    assert pd.d.tokens(d_req.request_id)[0] == token_after(PROMPT)
    assert pd.d.received == [d_req.request_id] and pd.p.sent == [p_req] and not pd.d.invalid
    pd.assert_empty()


@pytest.mark.parametrize("faults", ["error_reply=1,seed=0", "transport=1,seed=0"])
@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_failed_load_on_two_groups_is_reported_per_request(make_hybrid: Any, policy: str, faults: str) -> None:
    """vLLM 0.33 refuses block-level load errors on a multi-group layout (its scheduler raises): the
    failure comes as the request in `failed_recving`. `fail` ends it with an error; `recompute` computes
    the whole prompt again (vLLM resets the request to 0 computed tokens), with a clean run's KV and tokens."""
    pd: PD = make_hybrid(policy=policy, faults=faults, abort_timeout_s=1.5)
    _, params = pd.prefill(PROMPT)
    d_req = pd.d.add(PROMPT, 3, params)
    out = decode_to_end(pd, d_req.request_id)
    assert pd.d.connector.failure_causes[d_req.request_id][0] == pd.faults.expected_cause(params["transfer_id"])
    assert pd.d.received == [d_req.request_id] and not pd.d.invalid  # request-level, never block ids
    if policy == "fail":
        assert out.finish_reason == FinishReason.ERROR and pd.d.tokens(d_req.request_id) == []
    else:
        assert out.finish_reason == FinishReason.LENGTH
        tokens = pd.d.tokens(d_req.request_id)
        assert tokens[0] == token_after(PROMPT) and len(tokens) == 3
    pd.assert_empty()


class SlidingInstance(HybridInstance):
    """Every layer with a sliding window: one KV cache group (Mistral-style)."""

    def kv_cache_groups(self, tp_size: int) -> list[KVCacheGroupSpec]:
        sliding = super().kv_cache_groups(tp_size)[SLIDING].kv_cache_spec
        return [KVCacheGroupSpec(list(LAYER_NAMES), sliding)]


class SlidingPD(PD):
    instance = SlidingInstance


def test_one_sliding_window_group_reports_failures_per_request(model_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """One group, but with a window: recomputing from an invalid block would need window tokens D never
    received (null blocks), so the failure is per request and the whole prompt is recomputed."""
    monkeypatch.setattr(type(current_platform), "support_hybrid_kv_cache", classmethod(lambda cls: True))
    pd = SlidingPD(model_dir, policy="recompute", faults="transport=1,seed=0", abort_timeout_s=1.5)
    try:
        _, params = pd.prefill(PROMPT)
        d_req = pd.d.add(PROMPT, 3, params)
        out = decode_to_end(pd, d_req.request_id)
        assert pd.d.received == [d_req.request_id] and not pd.d.invalid
        assert out.finish_reason == FinishReason.LENGTH and pd.d.tokens(d_req.request_id)[0] == token_after(PROMPT)
        pd.assert_empty()
    finally:
        pd.close()


def test_recompute_on_two_groups_rebuilds_every_block(make_hybrid: Any) -> None:
    pd: PD = make_hybrid(policy="recompute", faults="transport=1,seed=0", abort_timeout_s=1.5)
    _, params = pd.prefill(PROMPT)
    d_req = pd.d.add(PROMPT, 3, params)
    pd.both_until(lambda: d_req.request_id in pd.d.received, what="the failed load to be reported")
    pd.both_until(lambda: d_req.num_computed_tokens >= len(PROMPT), what="local recompute")
    assert_prompt_kv(pd, d_req.request_id)
    decode_to_end(pd, d_req.request_id)
    pd.assert_empty()


def test_mamba_state_group_is_refused_at_start(model_dir: str) -> None:
    config = vllm_config(model_dir, "kv_consumer", {})
    full = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=NUM_KV_HEADS, head_size=HEAD_SIZE,
                             dtype=torch.float16)
    mamba = MambaSpec(block_size=BLOCK_SIZE, shapes=((4, 64), (8, 16, 16)), dtypes=(torch.float16, torch.float16))
    kv_cache_config = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(LAYER_NAMES[:6], full), KVCacheGroupSpec(["model.layers.6.mixer"], mamba)])
    with pytest.raises(ValueError, match=r"MambaSpec.*model\.layers\.6\.mixer.*not supported"):
        KVFerryConnector(config, KVConnectorRole.SCHEDULER, kv_cache_config)


def test_layout_names_each_groups_layers_at_its_block_ids(make_hybrid: Any) -> None:
    """Virtual block g * pool + b is block b of group g's layers only; a peer with other groups is refused."""
    pd: PD = make_hybrid()
    layout = pd.d.worker.layout
    pool = pd.d.kv_cache_config.num_blocks
    assert layout.num_blocks == 2 * pool and layout.blocks_for(len(PROMPT)) == N_BLOCKS + N_BLOCKS - SKIPPED
    for g in (FULL, SLIDING):
        regions = {r.region for r in layout.block_runs(g * pool + 5, (0, NUM_KV_HEADS))}
        assert regions == set(LAYER_NAMES[g::2])  # LBNHC: a region per layer
    one_group = msgspec.structs.replace(layout.describe(), groups=1, segment_groups=[])
    assert "KV cache group" in (layout.peer_mismatch(one_group) or "")
    assert layout.peer_mismatch(layout.describe()) is None
