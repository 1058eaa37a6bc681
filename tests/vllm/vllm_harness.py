"""Small helpers that run real vLLM (0.33) Schedulers with kvferry's connector in one process.

vLLM's own test helpers are not in its wheel, so these are written here. Each `Instance` is one vLLM
engine without a model: a real `Scheduler` (whose scheduler-side connector vLLM builds itself through
`kv_connector_module_path`), a worker-side `KVFerryConnector` on CPU KV tensors allocated by vLLM's own
`allocate_kv_cache`, and a fake forward pass that writes each scheduled token's KV as a pure function of
the token prefix (so recomputation reproduces the same bytes) and samples a deterministic token.
`step()` drives the connector exactly as vLLM's model runner does (handle_preemptions, bind metadata, start_load_kv,
wait_for_save, get_transfer_results, get_block_ids_with_load_errors, build_connector_worker_meta).

With `tp_size` N the instance has N workers, each with its own connector and KV tensors holding its
slice of the KV heads (as vLLM's tensor parallel workers do); their step outputs are merged by vLLM's own
`KVOutputAggregator`, and their bootstrap entries reach the scheduler's connector as vLLM's engine core
hands them over (`set_xfer_handshake_metadata_pp_aware`).
"""

from __future__ import annotations

import itertools
import json
import pickle
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutput
from vllm.v1.kv_cache_interface import AttentionSpec, FullAttentionSpec, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.worker.utils import allocate_kv_cache

from kvferry.integrations.vllm import KVFerryConnector
from kvferry.integrations.vllm import worker as vllm_worker
from vllm import SamplingParams

# The shape of facebook/opt-125m (its config.json, minus what only a tokenizer or weights need).
OPT_125M_CONFIG = {
    "architectures": ["OPTForCausalLM"],
    "model_type": "opt",
    "activation_function": "relu",
    "do_layer_norm_before": True,
    "hidden_size": 768,
    "ffn_dim": 3072,
    "num_attention_heads": 12,
    "num_hidden_layers": 12,
    "max_position_embeddings": 2048,
    "vocab_size": 50272,
    "word_embed_proj_dim": 768,
    "bos_token_id": 2,
    "eos_token_id": 2,
    "pad_token_id": 1,
    "torch_dtype": "float16",
    "use_cache": True,
}
NUM_LAYERS, NUM_KV_HEADS, HEAD_SIZE = 12, 12, 64
BLOCK_SIZE = 16
LAYER_NAMES = [f"model.decoder.layers.{i}.self_attn.attn" for i in range(NUM_LAYERS)]
_ids = itertools.count()


def write_model_dir(path: Path) -> str:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(OPT_125M_CONFIG))
    return str(path)


def vllm_config(model_dir: str, kv_role: str, extra: dict[str, Any], policy: str = "fail",
                num_blocks: int = 64, layout: str = "LBNHC", tp_size: int = 1) -> VllmConfig:
    model = ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype="float16", seed=0, max_model_len=1024)
    sched = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=1024,
                            enable_chunked_prefill=True, is_encoder_decoder=False, async_scheduling=False)
    cache = CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True, num_gpu_blocks_override=num_blocks)
    cache.kv_cache_layout = layout  # resolved by the engine core in a real server
    kv = KVTransferConfig(kv_connector="KVFerryConnector", kv_connector_module_path="kvferry.integrations.vllm",
                          kv_role=kv_role, kv_load_failure_policy=policy, kv_connector_extra_config=extra)
    config = VllmConfig(model_config=model, scheduler_config=sched, cache_config=cache, kv_transfer_config=kv,
                        device_config=DeviceConfig("cpu"))
    config.cache_config.num_gpu_blocks = num_blocks
    config.parallel_config.tensor_parallel_size = tp_size  # after validation: no process groups here
    return config


def _digest(tokens: list[int]) -> int:
    return zlib.crc32(b"".join(t.to_bytes(4, "little") for t in tokens))


def kv_of(prefix: list[int]) -> torch.Tensor:
    """The fake model's KV of the last token of `prefix`: [layers, heads, 2 * head_size], fp16."""
    g = torch.Generator().manual_seed(_digest(prefix))
    return torch.randn(NUM_LAYERS, NUM_KV_HEADS, 2 * HEAD_SIZE, generator=g).to(torch.float16)


def token_after(prefix: list[int]) -> int:
    return 3 + _digest(prefix) % 50000  # never EOS (2)


class Instance:
    def __init__(self, name: str, model_dir: str, kv_role: str, extra: dict[str, Any], policy: str = "fail",
                 num_blocks: int = 64, layout: str = "LBNHC", tp_size: int = 1) -> None:
        self.name, self.tp_size = name, tp_size
        self.config = vllm_config(model_dir, kv_role, extra, policy, num_blocks, layout, tp_size)
        self.kv_cache_config = get_kv_cache_config_from_groups(
            self.config, self.kv_cache_groups(tp_size), available_memory=1 << 40
        )
        assert self.kv_cache_config.num_blocks == num_blocks
        self.scheduler = Scheduler(self.config, self.kv_cache_config, StructuredOutputManager(self.config),
                                   block_size=BLOCK_SIZE, log_stats=True)
        connector = self.scheduler.get_kv_connector()
        assert isinstance(connector, KVFerryConnector)
        self.connector: KVFerryConnector = connector
        self.workers: list[KVFerryConnector] = []
        self.worker_caches: list[dict[str, torch.Tensor]] = []
        real_rank = vllm_worker.worker_tp_rank
        try:
            for rank in range(tp_size):
                # One process holds every worker here: each learns its rank as vLLM's process group tells it.
                vllm_worker.worker_tp_rank = lambda size, rank=rank: rank  # type: ignore[misc]
                caches = allocate_kv_cache(self.kv_cache_config, torch.device("cpu"),
                                           self.config.cache_config.get_resolved_kv_cache_layout())
                worker = KVFerryConnector(self.config, KVConnectorRole.WORKER, self.kv_cache_config)
                worker.register_kv_caches(caches)
                self.workers.append(worker)
                self.worker_caches.append(caches)
        finally:
            vllm_worker.worker_tp_rank = real_rank
        self.worker, self.kv_caches = self.workers[0], self.worker_caches[0]
        # vLLM's engine core: every worker's handshake metadata, keyed (pp rank, tp rank), to the scheduler.
        handshakes = {(0, r): m for r, w in enumerate(self.workers) if (m := w.get_handshake_metadata()) is not None}
        if handshakes:
            self.connector.set_xfer_handshake_metadata_pp_aware(pickle.loads(pickle.dumps(handshakes)))
        self.aggregator = KVOutputAggregator(expected_finished_count=tp_size)
        # Prefix-cache hashes, as vLLM's engine core sets them up.
        hash_fn = get_hash_fn_by_name(self.config.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self.block_hasher = get_request_block_hasher(BLOCK_SIZE, hash_fn)
        self.outputs: dict[str, list[EngineCoreOutput]] = {}
        # What the scheduler was told, for the tests' invariants.
        self.sent: list[str] = []
        self.received: list[str] = []
        self.invalid: list[int] = []
        self.alloc_calls: list[tuple[str, int]] = []
        update_state_after_alloc = self.connector.update_state_after_alloc

        def spy(request: Request, blocks: Any, num_external_tokens: int) -> None:
            self.alloc_calls.append((request.request_id, num_external_tokens))
            update_state_after_alloc(request, blocks, num_external_tokens)

        self.connector.update_state_after_alloc = spy  # type: ignore[method-assign]

    def kv_cache_spec(self, tp_size: int) -> AttentionSpec:
        """Each worker holds NUM_KV_HEADS / tp_size heads (vLLM's per-rank KV cache spec)."""
        return FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=NUM_KV_HEADS // tp_size, head_size=HEAD_SIZE,
                                 dtype=torch.float16)

    def kv_cache_groups(self, tp_size: int) -> list[KVCacheGroupSpec]:
        """One group of every layer (a hybrid model's test gives several)."""
        return [KVCacheGroupSpec(list(LAYER_NAMES), self.kv_cache_spec(tp_size))]

    @property
    def bootstrap_addr(self) -> str:
        return f"{self.connector.settings.host}:{self.connector.settings.bootstrap_port}"

    @property
    def engine_id(self) -> str:
        return self.connector.settings.engine_id

    # ---- requests -------------------------------------------------------------------------------------
    def add(self, prompt: list[int], max_tokens: int, kv_transfer_params: dict[str, Any] | None,
            request_id: str | None = None) -> Request:
        request_id = request_id or f"{self.name}-{next(_ids)}"
        params = SamplingParams(max_tokens=max_tokens, extra_args={"kv_transfer_params": kv_transfer_params}
                                if kv_transfer_params is not None else None)
        request = Request(request_id, list(prompt), params, None, block_hasher=self.block_hasher)
        self.scheduler.add_request(request)
        return request

    def abort(self, request_id: str) -> None:
        self.scheduler.finish_requests(request_id, RequestStatus.FINISHED_ABORTED)

    def finished(self, request_id: str) -> EngineCoreOutput | None:
        return next((o for o in self.outputs.get(request_id, []) if o.finish_reason is not None), None)

    def tokens(self, request_id: str) -> list[int]:
        return [t for o in self.outputs.get(request_id, []) for t in o.new_token_ids]

    def block_ids(self, request_id: str) -> list[int]:
        return list(self.scheduler.kv_cache_manager.get_block_ids(request_id)[0])

    def block_bytes(self, block_id: int) -> list[torch.Tensor]:
        """Block `block_id` of every layer, as [heads, tokens, content] copies (all workers' heads)."""
        return [torch.cat([caches[name][block_id] for caches in self.worker_caches]) for name in LAYER_NAMES]

    # ---- one engine step ------------------------------------------------------------------------------
    def step(self) -> None:
        so = self.scheduler.schedule()
        outputs: list[ModelRunnerOutput | None] = []
        for rank, worker in enumerate(self.workers):
            # Crosses a process boundary in a real server: it must survive pickling.
            meta = pickle.loads(pickle.dumps(so.kv_connector_metadata))
            worker.handle_preemptions(meta)  # vLLM's model runner: before the forward that reuses their blocks
            worker.bind_connector_metadata(meta)
            worker.start_load_kv(None)
            self._forward(so.num_scheduled_tokens, rank)
            worker.wait_for_save()
            results = worker.get_transfer_results(so.finished_req_ids)
            rank_out = KVConnectorOutput(
                finished_sending=results.finished_sending,
                finished_recving=results.finished_recving,
                failed_recving=results.failed_recving,
                invalid_block_ids=worker.get_block_ids_with_load_errors(),
                kv_connector_worker_meta=pickle.loads(pickle.dumps(worker.build_connector_worker_meta())),
            )
            worker.clear_connector_metadata()
            outputs.append(ModelRunnerOutput(req_ids=[], req_id_to_index={}, kv_connector_output=rank_out))
        merged = self.aggregator.aggregate(outputs)
        assert merged is not None and merged.kv_connector_output is not None
        kv_out = merged.kv_connector_output
        self.sent += sorted(kv_out.finished_sending or ())
        self.received += sorted(kv_out.finished_recving or ())
        self.invalid += sorted(kv_out.invalid_block_ids)
        req_ids = list(so.num_scheduled_tokens)
        sampled = []
        for req_id in req_ids:
            request = self.scheduler.requests[req_id]
            done_prefill = request.num_computed_tokens >= request.num_tokens
            sampled.append([token_after(request.all_token_ids)] if done_prefill else [])
        output = ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                   sampled_token_ids=sampled, kv_connector_output=kv_out)
        for outs in self.scheduler.update_from_output(so, output).values():
            for o in outs.outputs:
                self.outputs.setdefault(o.request_id, []).append(o)

    def _forward(self, num_scheduled: dict[str, int], rank: int = 0) -> None:
        """Write the KV of every scheduled token (a pure function of its prefix) into its slot: worker
        `rank`'s slice of the heads."""
        per = NUM_KV_HEADS // self.tp_size
        caches = self.worker_caches[rank]
        for req_id, n in num_scheduled.items():
            request = self.scheduler.requests[req_id]
            tokens = request.all_token_ids
            blocks = self.block_ids(req_id)
            end = request.num_computed_tokens  # already advanced by schedule()
            for pos in range(end - n, end):
                kv = kv_of(list(tokens[: pos + 1]))
                block, slot = blocks[pos // BLOCK_SIZE], pos % BLOCK_SIZE
                for layer, name in enumerate(LAYER_NAMES):
                    caches[name][block, :, slot, :] = kv[layer, rank * per:(rank + 1) * per]

    def run_until(self, done: Callable[[], bool], timeout: float = 20.0, what: str = "condition") -> None:
        deadline = time.monotonic() + timeout
        while not done():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name}: timed out after {timeout}s waiting for {what}")
            self.step()
            time.sleep(0.002)

    # ---- invariants -----------------------------------------------------------------------------------
    def assert_empty(self) -> None:
        s = self.scheduler
        assert not s.requests, f"{self.name}: requests left {list(s.requests)}"
        assert not s.waiting and not s.kv_holding_waiting and not s.running
        assert not s.finished_recving_kv_req_ids and not s.failed_recving_kv_req_ids
        pool = s.kv_cache_manager.block_pool
        assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1, f"{self.name}: blocks leaked"
        assert all(block.ref_cnt == 0 for block in pool.blocks), f"{self.name}: blocks still referenced"
        for worker in self.workers:
            stats = worker.stats()
            assert all(v["pending_pulls"] == 0 and v["pending_sends"] == 0 for v in stats.values()), stats

    def close(self) -> None:
        for worker in self.workers:
            worker.shutdown(timeout_s=2.0)
        self.connector.shutdown()
