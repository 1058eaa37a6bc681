"""MLA models (DeepSeek-V2/V3 family) through KVFerryConnector (#30 item 3): vLLM keeps ONE latent KV per
token (kv_lora_rank + rope dim = 576), `[blocks, 1, tokens, 576]` per layer, the same on every tensor
parallel rank. P rank 0 alone sends it, whole, to every D rank; P's other ranks hold no transfer, send
nothing, and D never asks or waits for them.

The model config is a tiny DeepSeek-V2 written locally (vLLM's `ModelConfig` reads it: `use_mla`); the KV
cache spec is built with the arguments vLLM's `MLAAttention.get_kv_cache_spec` uses, customized by its CPU
MLA backend, and allocated by vLLM's own `allocate_kv_cache`.
"""

from __future__ import annotations

import functools
import json
import zlib
from pathlib import Path
from typing import Any

import pytest
from test_vllm_connector import HAVE_VLLM

from kvferry.connector.layout import d_ranks_for, p_ranks_for, write_ops

pytestmark = pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed (see .ci/vllm-env.sh)")

LATENT = 512 + 64  # kv_lora_rank + qk_rope_head_dim: the one head size vLLM's CPU MLA kernel has
DEEPSEEK_V2_TINY = {
    "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "hidden_size": 256,
    "intermediate_size": 512, "moe_intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 4, "kv_lora_rank": 512, "q_lora_rank": None, "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 64, "v_head_dim": 64, "n_routed_experts": 4, "num_experts_per_tok": 2,
    "n_shared_experts": 1, "first_k_dense_replace": 2, "vocab_size": 50272, "max_position_embeddings": 2048,
    "rope_theta": 10000.0, "rms_norm_eps": 1e-6, "torch_dtype": "float16", "bos_token_id": 2, "eos_token_id": 2,
}

if HAVE_VLLM:
    import torch
    from test_vllm_connector import PD, PROMPT, decode_to_end, make_pd, model_dir
    from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend
    from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups
    from vllm.v1.engine import FinishReason
    from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheGroupSpec, MLAAttentionSpec
    from vllm.v1.request import RequestStatus
    from vllm.v1.worker.utils import allocate_kv_cache
    from vllm_harness import BLOCK_SIZE, LAYER_NAMES, NUM_LAYERS, Instance, token_after, vllm_config

    from kvferry.integrations.vllm.layout import VllmKVLayout

    __all__ = ["make_pd", "model_dir"]  # fixtures

    def mla_spec(block_size: int = BLOCK_SIZE) -> AttentionSpec:
        """What vLLM's MLAAttention layer asks for (one head slot, no TP split), as its CPU backend has it."""
        spec = MLAAttentionSpec(block_size=block_size, num_kv_heads=1, max_tp_shards=1, head_size=LATENT,
                                dtype=torch.float16, cache_dtype_str="auto")
        assert LATENT in CPUMLABackend.get_supported_head_sizes()
        return CPUMLABackend.customize_spec(spec)

    def latent_of(prefix: list[int]) -> torch.Tensor:
        """The fake model's latent KV of the last token of `prefix`: [layers, 1, LATENT], fp16."""
        g = torch.Generator().manual_seed(zlib.crc32(b"mla" + b"".join(t.to_bytes(4, "little") for t in prefix)))
        return torch.randn(NUM_LAYERS, 1, LATENT, generator=g).to(torch.float16)

    class MLAInstance(Instance):
        """A vLLM engine of an MLA model: every worker holds (and writes) the whole latent."""

        def kv_cache_spec(self, tp_size: int) -> AttentionSpec:
            return mla_spec()

        def _forward(self, num_scheduled: dict[str, int], rank: int = 0) -> None:
            caches = self.worker_caches[rank]
            for req_id, n in num_scheduled.items():
                request = self.scheduler.requests[req_id]
                blocks, end = self.block_ids(req_id), request.num_computed_tokens
                for pos in range(end - n, end):
                    kv = latent_of(list(request.all_token_ids[: pos + 1]))
                    for layer, name in enumerate(LAYER_NAMES):
                        caches[name][blocks[pos // BLOCK_SIZE], :, pos % BLOCK_SIZE, :] = kv[layer]

        def block_bytes(self, block_id: int) -> list[torch.Tensor]:
            """Block `block_id` of every layer ([1, tokens, LATENT]): the same on every rank."""
            per_rank = [[caches[name][block_id].clone() for name in LAYER_NAMES] for caches in self.worker_caches]
            for other in per_rank[1:]:
                assert all(torch.equal(a, b) for a, b in zip(per_rank[0], other, strict=True)), "ranks differ"
            return per_rank[0]

    class MLAPD(PD):
        instance = MLAInstance


@pytest.fixture(scope="module")
def mla_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = Path(tmp_path_factory.mktemp("deepseek-v2-tiny"))
    (path / "config.json").write_text(json.dumps(DEEPSEEK_V2_TINY))
    return str(path)


@pytest.fixture
def make_mla(make_pd: Any, mla_dir: str) -> Any:
    return functools.partial(make_pd, MLAPD, mla_dir)


def mla_caches(model_dir: str, layout: str, block_size: int, kernel: int | None) -> tuple[Any, dict[str, Any]]:
    """vLLM's KV cache config and per-layer tensors for the MLA spec (`kernel`: kernel block size)."""
    config = vllm_config(model_dir, "kv_producer", {}, num_blocks=8, layout=layout)
    config.cache_config.block_size = block_size
    kv_config = get_kv_cache_config_from_groups(config, [KVCacheGroupSpec(list(LAYER_NAMES), mla_spec(block_size))],
                                                available_memory=1 << 40)
    resolved = config.cache_config.get_resolved_kv_cache_layout()
    return kv_config, allocate_kv_cache(kv_config, torch.device("cpu"), resolved, None if kernel is None else [kernel])


# ---- the layout -----------------------------------------------------------------------------------------
@pytest.mark.parametrize(("layout", "block_size", "kernel"), [
    ("LBNHC", 16, None), ("BLHNC", 16, None), ("LHBNC", 16, None),
    ("LBNHC", 32, 16),  # a manager block of two kernel blocks (generic MLA backends split them)
])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_mla_layout_is_the_whole_latent_on_every_rank(mla_dir: str, layout: str, block_size: int, kernel: int | None,
                                                      tp: int) -> None:
    kv_config, caches = mla_caches(mla_dir, layout, block_size, kernel)
    first = caches[LAYER_NAMES[0]]
    ratio = block_size // (kernel or block_size)
    assert tuple(first.shape) == (kv_config.num_blocks * ratio, 1, block_size // ratio, LATENT)
    for b in range(first.shape[0]):
        for name in LAYER_NAMES:
            caches[name][b] = b + LAYER_NAMES.index(name) / 64
    layouts = [VllmKVLayout(caches, kv_config.num_blocks, block_size, tp_rank=r, tp_size=tp, replicated=True)
               for r in range(tp)]
    for lay in layouts:
        assert lay.replicated and lay.num_kv_heads == 1
        desc = lay.describe()
        assert desc.replicated and desc.first_head == 0 and desc.num_kv_heads == 1
        assert lay.block_bytes == NUM_LAYERS * block_size * LATENT * 2
        runs = lay.block_runs(3, (0, 1))
        assert sum(r.length for r in runs) == lay.block_bytes
        assert lay.peer_mismatch(layouts[0].describe()) is None
    # The mapping: D rank d pulls from P rank 0 only, all of it; P rank 0 serves every D rank.
    for d_tp in (1, 2, 4):
        assert all(p_ranks_for(1, tp, d_tp, d, replicated=True) == [0] for d in range(d_tp))
        assert d_ranks_for(1, tp, 0, d_tp, replicated=True) == list(range(d_tp))
        assert all(d_ranks_for(1, tp, p, d_tp, replicated=True) == [] for p in range(1, tp))
    # Byte-exact: P's block 2 into D's block 5 carries every layer's latent of that block.
    ops = write_ops(layouts[0], [2], [5], (0, 1), kv_config.num_blocks, layouts[-1].describe())
    assert sum(op.length for op in ops) == layouts[0].block_bytes
    # A peer whose KV is split by heads cannot take a replicated latent (nor the other way round).
    split = VllmKVLayout(caches, kv_config.num_blocks, block_size, tp_rank=0, tp_size=1)
    assert "replicated" in (layouts[0].peer_mismatch(split.describe()) or "")
    assert "replicated" in (split.peer_mismatch(layouts[0].describe()) or "")

# ---- P/D through vLLM's real schedulers ------------------------------------------------------------------
def sent_and_received(pd: Any) -> tuple[list[tuple[int, int]], list[int]]:
    """(writes, bytes) each P rank's data plane sent; bytes each D rank's data plane received."""
    sent = [(e.stats["writes_ok"], e.stats["bytes_sent"]) for w in pd.p.workers
            for e in w.pd["prefill"].worker.transfer_engines]
    received = [e.stats["bytes_received"] for w in pd.d.workers for e in w.pd["decode"].worker.transfer_engines]
    return sent, received


@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 1), (1, 2), (2, 1), (2, 2), (4, 1), (4, 2)])
def test_mla_latent_sent_once_by_p_rank_0_to_every_d_rank(make_mla: Any, p_tp: int, d_tp: int) -> None:
    pd: MLAPD = make_mla(p_tp=p_tp, d_tp=d_tp)
    assert all(w.layout.replicated and w.layout.num_kv_heads == 1 for w in pd.p.workers + pd.d.workers)
    p_req, params = pd.prefill(PROMPT)
    n_blocks = -(-len(PROMPT) // BLOCK_SIZE)
    expected = [pd.p.block_bytes(b) for b in pd.p.block_ids(p_req)[:n_blocks]]  # equal on every P rank
    d_req = pd.d.add(PROMPT, 5, params)
    pd.d.step()
    assert d_req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    pd.both_until(lambda: d_req.request_id in pd.d.scheduler.finished_recving_kv_req_ids, what="KV arrival")
    # Every D rank holds the whole latent of every prompt block, byte for byte.
    for rank, caches in enumerate(pd.d.worker_caches):
        for b, block in enumerate(pd.d.block_ids(d_req.request_id)[:n_blocks]):
            for layer, name in enumerate(LAYER_NAMES):
                assert torch.equal(caches[name][block], expected[b][layer]), f"D rank {rank} block {b} layer {layer}"
    # P rank 0 wrote it once per D rank; P's other ranks wrote nothing.
    block_bytes = pd.d.workers[0].layout.block_bytes
    sent, received = sent_and_received(pd)
    assert received == [n_blocks * block_bytes] * d_tp
    assert sent[0][0] >= d_tp and sent[0][1] >= d_tp * n_blocks * block_bytes
    assert sent[1:] == [(0, 0)] * (p_tp - 1)
    out = decode_to_end(pd, d_req.request_id)
    assert out.finish_reason == FinishReason.LENGTH
    assert pd.d.tokens(d_req.request_id)[0] == token_after(PROMPT)
    # vLLM's aggregator: each id once, after every rank reported it (P's other ranks at once).
    assert pd.d.received == [d_req.request_id] and pd.p.sent == [p_req] and not pd.d.invalid
    pd.assert_empty()


def test_mla_p_rank_other_than_0_gone_is_not_waited_for(make_mla: Any) -> None:
    """P TP 2 -> D TP 2: P rank 1 holds nothing D needs; its worker dying after the prefill changes
    nothing for D (no pull, no heartbeat, no connection to it)."""
    pd: MLAPD = make_mla(p_tp=2, d_tp=2, abort_timeout_s=2.0)
    p_req, params = pd.prefill(PROMPT)
    pd.p.step()  # hands the finished prefill's blocks to P's workers
    pd.p.workers[1].shutdown(timeout_s=2.0)
    d_req = pd.d.add(PROMPT, 3, params)
    out = decode_to_end(pd, d_req.request_id)
    assert out.finish_reason == FinishReason.LENGTH and not pd.d.invalid
    assert pd.d.tokens(d_req.request_id)[0] == token_after(PROMPT)
    assert d_req.request_id not in pd.d.connector.failure_causes
    pd.p_alive = False  # vLLM's P engine is gone with its worker: not asked to drain
    pd.assert_empty()


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_mla_p_rank_0_gone_fails_or_recomputes_on_every_d_rank(make_mla: Any, policy: str) -> None:
    pd: MLAPD = make_mla(p_tp=2, d_tp=2, policy=policy, abort_timeout_s=2.0)
    _, params = pd.prefill(PROMPT)
    pd.p.step()
    pd.p.workers[0].shutdown(timeout_s=2.0)  # the one rank that holds the transfer
    pd.p_alive = False
    d_req = pd.d.add(PROMPT, 3, params)
    out = decode_to_end(pd, d_req.request_id)
    cause = pd.d.connector.failure_causes[d_req.request_id][0]
    assert cause in ("peer_dead", "transport", "recv_timeout"), cause
    pd.both_until(lambda: d_req.request_id in pd.d.received, what="both D ranks to report")
    assert pd.d.received == [d_req.request_id] and pd.d.invalid
    if policy == "fail":
        assert out.finish_reason == FinishReason.ERROR and not pd.d.tokens(d_req.request_id)
    else:
        assert out.finish_reason == FinishReason.LENGTH
        assert pd.d.tokens(d_req.request_id)[0] == token_after(PROMPT)
        # Recomputed: every rank's latent is what the model computes (the same on both ranks).
        for b, block in enumerate(pd.d.block_ids(d_req.request_id)[: -(-len(PROMPT) // BLOCK_SIZE)]):
            n = min(BLOCK_SIZE, len(PROMPT) - b * BLOCK_SIZE)
            want = torch.stack([latent_of(PROMPT[: b * BLOCK_SIZE + i + 1]) for i in range(n)], dim=2)
            for layer, got in enumerate(pd.d.block_bytes(block)):
                assert torch.equal(got[:, :n], want[layer]), f"block {b} layer {layer}"
    pd.assert_empty()
