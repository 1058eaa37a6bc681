"""kvferry as a vLLM KV connector (`KVConnectorBase_V1`, written against vLLM 0.33).

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KVFerryConnector",
        "kv_connector_module_path": "kvferry.integrations.vllm", "kv_role": "kv_producer",
        "kv_connector_extra_config": {"bootstrap_port": 8998}}'

Both roles delegate to kvferry's `PDConnector` (`kv_both`: one of each, chosen per request by its
kv_transfer_params); this facade routes each call to `KVFerryScheduler` (engine core) or `KVFerryWorker`."""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorRole,
        KVConnectorTransferResults,
        SupportsHMA,
    )
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "kvferry.integrations.vllm needs vLLM (tested with 0.33): build the optional environment with "
        "`bash .ci/vllm-env.sh`, or `pip install 'kvferry[vllm]'`"
    ) from exc

import kvferry.integrations.vllm.worker as vllm_worker
from kvferry.connector.base import ConnectorRole
from kvferry.connector.facade import PDConnector
from kvferry.integrations.vllm.groups import KVGroups
from kvferry.integrations.vllm.layout import VllmKVLayout
from kvferry.integrations.vllm.metadata import (
    KVFerryConnectorMetadata,
    KVFerryHandshake,
    KVFerryWorkerMetadata,
)
from kvferry.integrations.vllm.metrics import KVFerryPromMetrics, KVFerryStats
from kvferry.integrations.vllm.scheduler import KVFerryScheduler
from kvferry.integrations.vllm.settings import KVFerrySettings, is_mla, kvferry_roles
from kvferry.integrations.vllm.worker import KVFerryWorker

if TYPE_CHECKING:
    import torch

log = logging.getLogger("kvferry.integrations.vllm")  # the integration's logger, its modules' parent


class KVFerryConnector(KVConnectorBase_V1, SupportsHMA):  # type: ignore[misc]
    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        kv_config = self._kv_transfer_config
        roles = kvferry_roles(vllm_config, kv_config.kv_role)
        extra = dict(kv_config.kv_connector_extra_config or {})
        parallel = vllm_config.parallel_config
        tp_size = int(parallel.tensor_parallel_size)
        self.settings = KVFerrySettings.from_extra_config(extra, str(kv_config.engine_id)).for_data_parallel(
            int(parallel.data_parallel_rank), int(parallel.data_parallel_size), tp_size, "engine_id" in extra)
        self.block_size = int(vllm_config.cache_config.block_size)
        self.groups = None if kv_cache_config is None else KVGroups.from_config(kv_cache_config, self.block_size)
        self.num_blocks = 0 if kv_cache_config is None else int(kv_cache_config.num_blocks)
        is_scheduler = role == KVConnectorRole.SCHEDULER
        pd_role = ConnectorRole.SCHEDULER if is_scheduler else ConnectorRole.WORKER
        tp_rank = 0 if is_scheduler else vllm_worker.worker_tp_rank(tp_size)
        self.pd: dict[str, PDConnector] = {
            r: PDConnector(pd_role, self.settings.pd_config(r, self.block_size, tp_size, tp_rank)) for r in roles
        }
        self.connector_scheduler: KVFerryScheduler | None = None
        self.connector_worker: KVFerryWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = KVFerryScheduler(self.pd, self.groups, self.num_blocks)
        else:
            self.connector_worker = KVFerryWorker(self.pd, self.settings, self.block_size, tp_rank, tp_size,
                                                  is_mla(vllm_config))

    def _scheduler(self) -> KVFerryScheduler:
        assert self.connector_scheduler is not None, "a scheduler call on the worker's connector"
        return self.connector_scheduler

    def _worker(self) -> KVFerryWorker:
        assert self.connector_worker is not None, "a worker call on the scheduler's connector"
        return self.connector_worker

    @property
    def failure_causes(self) -> OrderedDict[str, tuple[str, str]]:
        """Scheduler side: the latest loads that failed, request id → (cause, message) (logs, tests)."""
        return self._scheduler().failure_causes

    @property
    def _queued(self) -> OrderedDict[str, None]:
        return self._scheduler().queued

    @property
    def layout(self) -> VllmKVLayout | None:
        """Worker side: vLLM's KV cache as kvferry sees it (None until `register_kv_caches`)."""
        return self._worker().layout

    @property
    def connector_cpus(self) -> set[int]:
        """Worker side: the CPUs kvferry's threads run on."""
        return self._worker().connector_cpus

    # ---- scheduler role ---------------------------------------------------------------------------
    def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        self._scheduler().set_handshake(metadata)

    def on_new_request(self, request: Any) -> None:
        self._scheduler().on_new_request(request)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._scheduler().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVFerryConnectorMetadata:
        return self._scheduler().build_connector_meta(scheduler_output)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler().request_finished(request, block_ids)

    def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler().request_finished_all_groups(request, block_ids)

    def update_connector_output(self, connector_output: Any) -> None:
        self._scheduler().update_connector_output(connector_output)

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        self._scheduler().quarantine.bind(kv_cache_manager)  # quarantine.py

    def get_kv_connector_stats(self) -> KVFerryStats | None:
        """Failures since the last call (scheduler side; the worker's connector has none)."""
        if self.connector_scheduler is None:
            return None
        return self.connector_scheduler.get_kv_connector_stats()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVFerryStats:
        return KVFerryStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: dict[Any, Any], labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KVFerryPromMetrics:
        return KVFerryPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # ---- worker role ------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker().register_kv_caches(kv_caches, int(self._kv_cache_config.num_blocks), self.groups)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self._worker().start_load_kv(self._get_connector_metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are asynchronous, between steps

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return  # P's writes read whole blocks after the step (progress.py); nothing to save per layer

    def wait_for_save(self) -> None:
        self._worker().wait_for_save()

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        self._worker().handle_preemptions(kv_connector_metadata)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self._worker().get_finished(finished_req_ids)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        return self._worker().get_transfer_results(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker().get_block_ids_with_load_errors()

    def build_connector_worker_meta(self) -> KVFerryWorkerMetadata | None:
        return self._worker().build_connector_worker_meta()

    def get_handshake_metadata(self) -> KVFerryHandshake | None:
        return self._worker().get_handshake_metadata()

    # ---- both -------------------------------------------------------------------------------------
    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Close kvferry's endpoints; bounded, so a stuck socket never hangs vLLM's exit."""

        def close_all() -> None:
            if self.connector_scheduler is not None:
                self.connector_scheduler.close()
            for pd in self.pd.values():
                pd.close()

        closer = threading.Thread(target=close_all, name="kvferry-shutdown", daemon=True)
        closer.start()
        closer.join(timeout_s)
        if closer.is_alive():
            log.error("kvferry connector did not shut down within %.0fs; leaving it to process exit", timeout_s)

    def stats(self) -> dict[str, Any]:
        """kvferry counters per role (pending_pulls, pending_sends, addresses)."""
        return {r: pd.stats() for r, pd in self.pd.items()}


__all__ = ["KVFerryConnector", "KVFerryConnectorMetadata", "KVFerrySettings", "KVFerryWorkerMetadata"]
