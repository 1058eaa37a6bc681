"""KVFerryConnector's worker half, in the model runner's process: it hands kvferry the KV cache's layout,
starts each step's sends and pulls, and reports each finished id once per direction and only ids vLLM
still holds (anything else trips vLLM's asserts). Under tensor parallelism every worker is one kvferry
rank; vLLM finishes a request only when every rank reported it, so one rank's failed load fails the
request on all. With several KV cache groups a failed load is reported per request (`failed_recving`)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

from kvferry.connector.facade import PDConnector
from kvferry.integrations.vllm.affinity import connector_affinity, cpu_list
from kvferry.integrations.vllm.groups import KVGroups
from kvferry.integrations.vllm.layout import VllmKVLayout
from kvferry.integrations.vllm.metadata import (
    KVFerryConnectorMetadata,
    KVFerryHandshake,
    KVFerryWorkerMetadata,
)
from kvferry.integrations.vllm.progress import ProgressGate
from kvferry.integrations.vllm.quarantine import WorkerQuarantine
from kvferry.integrations.vllm.settings import DECODE, PREFILL, KVFerrySettings

if TYPE_CHECKING:
    import torch

log = logging.getLogger("kvferry.integrations.vllm.worker")


def worker_tp_rank(tp_size: int) -> int:
    """This worker's rank in its tensor parallel group (vLLM's process groups are up by now)."""
    if tp_size == 1:
        return 0
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return int(get_tensor_model_parallel_rank())


class KVFerryWorker:
    """The worker half: vLLM's worker-side calls on the `PDConnector` of each role this instance runs."""

    def __init__(self, pd: dict[str, PDConnector], settings: KVFerrySettings, block_size: int,
                 tp_rank: int = 0, tp_size: int = 1, mla: bool = False) -> None:
        self.pd, self.settings, self.block_size = pd, settings, block_size
        self.tp_rank, self.tp_size, self.mla = tp_rank, tp_size, mla
        self.layout: VllmKVLayout | None = None
        self.connector_cpus: set[int] = set()
        # ids the scheduler may be told about (each once)
        self._expect_send: set[str] = set()
        self._expect_recv: set[str] = set()
        self._causes: dict[str, tuple[str, str]] = {}  # for the scheduler half (worker metadata)
        self._invalid: set[int] = set()  # the last drain's lost blocks (`get_block_ids_with_load_errors`)
        self._lost: set[str] = set()  # the last drain's requests that lost blocks (failures per request)
        # D: failed loads whose blocks a posted read may still write (quarantine.py)
        self.quarantine = WorkerQuarantine(pd.get(DECODE))
        self._device: Any = None  # the KV cache's device
        # P: a step's progressive push waits for its forward (progress.py)
        self.gate = ProgressGate(pd[PREFILL], lambda: self._device) if PREFILL in pd else None

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor], num_blocks: int,
                           groups: KVGroups | None = None) -> None:
        self._device = getattr(next(iter(kv_caches.values()), None), "device", None)
        self.layout = VllmKVLayout(kv_caches, num_blocks, self.block_size, KVFerrySettings.STAGING[self.settings.staging],
                                   self.tp_rank, self.tp_size, replicated=self.mla, groups=groups)
        # Threads inherit this thread's affinity: under vLLM's compute binding they would starve.
        with connector_affinity() as cpus:
            for pd in self.pd.values():
                pd.register_kv_layout(self.layout)
        self.connector_cpus = cpus
        log.info("kvferry connector threads run on CPUs %s", cpu_list(cpus))

    def get_handshake_metadata(self) -> KVFerryHandshake | None:
        """P: this rank's bootstrap entry, for the engine core's bootstrap server (None on a D)."""
        prefill = self.pd.get(PREFILL)
        return None if prefill is None else KVFerryHandshake(prefill.worker.registrations())

    def start_load_kv(self, meta: Any) -> None:
        assert isinstance(meta, KVFerryConnectorMetadata)
        for r, pd_meta in meta.by_role.items():
            if r == PREFILL:
                self._expect_send.update(s.request_id for s in pd_meta.to_send)
                # A request that ended mid-prefill after pushing progressively lends its blocks too.
                self._expect_send.update(d.request_id for d in pd_meta.dead_transfers if d.lent)
                if self.gate is not None:
                    pd_meta = self.gate.hold(pd_meta)
            else:
                self._expect_recv.update(p.request_id for p in pd_meta.to_pull if p.block_ids)
            self.pd[r].start_load_kv(pd_meta)

    def wait_for_save(self) -> None:
        """After the step's forward: the blocks it completed may go to D now."""
        if self.gate is not None:
            self.gate.forward_ended()

    def handle_preemptions(self, meta: Any) -> None:
        """Before the forward that may reuse a preempted request's blocks: no write reads them after."""
        if self.gate is not None and isinstance(meta, KVFerryConnectorMetadata):
            self.gate.preempted(meta.preempted)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending: set[str] = set()
        recving: set[str] = set()
        self._invalid, self._lost = set(), set()
        for role, pd in self.pd.items():
            s, r = pd.get_finished(finished_req_ids)
            loads = pd.take_load_reports()
            if role == DECODE:  # D sends nothing: its "sending" are quarantined blocks whose reads ended
                self.quarantine.drained(s, {load.request_id for load in loads if load.quarantined})
                s = set()
            sending |= s
            recving |= r
            self._causes.update((load.request_id, (load.cause.value, load.detail)) for load in loads if load.cause)
            self._invalid.update(b for load in loads for b in load.block_ids)
            self._lost.update(load.request_id for load in loads if load.block_ids)
        return _once(sending, self._expect_send, "sending"), _once(recving, self._expect_recv, "receiving")

    @property
    def per_request_failures(self) -> bool:
        """Several KV cache groups or a sliding window: failed loads go per request, never as block ids
        (recomputing from an invalid block would need window tokens D never received)."""
        groups = None if self.layout is None else self.layout.groups
        return groups is not None and groups.hybrid

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        done = self.get_finished(finished_req_ids)
        sending, recving = set(done[0] or ()), set(done[1] or ())
        failed = self.quarantine.failed(recving)  # never block ids: vLLM would compute into them
        if self.per_request_failures:  # reported with their requests (one outbox drain)
            failed |= self._lost & recving
        return KVConnectorTransferResults(sending, recving, failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        invalid, self._invalid = self._invalid, set()
        return set() if self.per_request_failures else invalid

    def build_connector_worker_meta(self) -> KVFerryWorkerMetadata | None:
        quarantined, released = self.quarantine.take()
        if not self._causes and not quarantined and not released:
            return None
        causes, self._causes = self._causes, {}
        return KVFerryWorkerMetadata(causes, quarantined, released)


def _once(ids: set[str], expected: set[str], direction: str) -> set[str]:
    """The ids vLLM may be told about, each once; anything else would trip the scheduler's assert."""
    stale = ids - expected
    if stale:
        log.error("kvferry reported finished %s for unknown or already reported request(s) %s: dropped",
                  direction, sorted(stale))
    ok = ids & expected
    expected -= ok
    return ok
