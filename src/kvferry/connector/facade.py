"""`PDConnector`: kvferry's P/D `KVConnector`, a thin facade per role, as vLLM's `nixl/connector.py`:
it builds only its role's half, the scheduler half (`scheduler.py`) or the worker half (`worker.py`), and
every method forwards to it. A call meant for the other role is a wiring bug and raises `WrongRole`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kvferry.connector.base import (
    ConnectorMetadata,
    ConnectorRole,
    KVConnector,
    RequestLike,
    SchedulerOutputLike,
)
from kvferry.connector.bootstrap import BootstrapServer
from kvferry.connector.config import PDConfig
from kvferry.connector.decode.consumer import Consumer
from kvferry.connector.layout import KVCacheSpec, KVLayout
from kvferry.connector.loads import LoadReport
from kvferry.connector.metrics import Metrics
from kvferry.connector.prefill.producer import Producer
from kvferry.connector.scheduler import PDScheduler
from kvferry.connector.worker import PDWorker
from kvferry.transfer.base import TransferEngine


class WrongRole(RuntimeError):
    """A scheduler-role method called on the worker's connector, or the other way round."""


class PDConnector(KVConnector):
    def __init__(self, role: ConnectorRole, config: PDConfig, metrics: Metrics | None = None) -> None:
        super().__init__(role)
        self.config = config
        self.metrics = metrics or Metrics()
        self._scheduler = PDScheduler(config, self.metrics) if role == ConnectorRole.SCHEDULER else None
        self._worker = PDWorker(config, self.metrics) if role == ConnectorRole.WORKER else None

    @property
    def scheduler(self) -> PDScheduler:
        if self._scheduler is None:
            raise WrongRole(f"the {self.role.value} connector has no scheduler half")
        return self._scheduler

    @property
    def worker(self) -> PDWorker:
        if self._worker is None:
            raise WrongRole(f"the {self.role.value} connector has no worker half")
        return self._worker

    @property
    def is_decode(self) -> bool:
        return self.config.role == "decode"

    # ---- scheduler role -------------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: RequestLike, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: RequestLike, block_ids: Sequence[int], num_external_tokens: int) -> None:
        self.scheduler.update_state_after_alloc(request, block_ids, num_external_tokens)

    def claim(self, request_id: str, kv_transfer_params: dict[str, Any] | None) -> None:
        self.scheduler.claim(request_id, kv_transfer_params)

    def unclaim(self, request_id: str, kv_transfer_params: dict[str, Any] | None) -> None:
        self.scheduler.unclaim(request_id, kv_transfer_params)

    def transfers_ended(self, request_ids: set[str]) -> None:
        self.scheduler.transfers_ended(request_ids)

    def on_request_added(self, request: RequestLike) -> None:
        self.scheduler.on_request_added(request)

    def pushes_progressively(self, request: RequestLike) -> bool:
        return self.scheduler.pushes_progressively(request)

    def prefill_progress(self, request: RequestLike, block_ids: Sequence[int], num_computed_tokens: int) -> None:
        self.scheduler.prefill_progress(request, block_ids, num_computed_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutputLike) -> ConnectorMetadata:
        return self.scheduler.build_connector_meta(scheduler_output)

    def request_finished(self, request: RequestLike, block_ids: Sequence[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.request_finished(request, block_ids)

    @property
    def _claims(self) -> dict[str, str]:
        """P's live transfer ids (tests check that none is left claimed)."""
        return self.scheduler.claims

    # ---- worker role ----------------------------------------------------------------------------------
    def register_kv_cache(self, spec: KVCacheSpec, kv_cache: np.ndarray) -> None:
        self.worker.register_kv_cache(spec, kv_cache)

    def register_kv_layout(self, layout: KVLayout) -> None:
        """Any memory layout (vLLM's per-layer tensors, say) that can name a block's byte runs."""
        self.worker.register_kv_layout(layout)

    def start_load_kv(self, metadata: ConnectorMetadata) -> None:
        self.worker.start_load_kv(metadata)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        return self.worker.get_finished(finished_req_ids)

    def take_load_reports(self) -> list[LoadReport]:
        return self.worker.take_load_reports()

    def quarantine_loads(self) -> bool:
        return self.worker.quarantine_loads()

    def set_waker(self, wake: Callable[[], None]) -> bool:
        return self.worker.set_waker(wake)

    def stats(self) -> dict[str, Any]:
        return self.worker.stats()

    def close(self) -> None:
        if self._worker is not None:  # the scheduler half holds no thread, socket or memory
            self._worker.close()

    @property
    def producer(self) -> Producer | None:
        return self.worker.producer

    @property
    def consumer(self) -> Consumer | None:
        return self.worker.consumer

    @property
    def bootstrap_server(self) -> BootstrapServer | None:
        return self.worker.bootstrap_server

    @property
    def transfer_engines(self) -> list[TransferEngine]:
        return self.worker.transfer_engines
