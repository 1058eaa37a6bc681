"""What KVFerryConnector's halves send each other through vLLM (pickled, across processes): the
scheduler's per-step instructions to the worker, the worker's failure causes back, and once at start
each worker's bootstrap entries (vLLM's KV connector handshake metadata)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from kvferry.connector.bootstrap import Registration
from kvferry.connector.pd import PDMetadata


@dataclass
class KVFerryHandshake(KVConnectorHandshakeMetadata):  # type: ignore[misc]
    """Worker → engine core, once after the KV cache is registered: the bootstrap entries (control
    addresses) of the P ranks this worker serves. vLLM gathers every rank's and hands them to the
    scheduler half, which serves P's bootstrap for the whole engine."""

    registrations: list[Registration] = field(default_factory=list)


@dataclass
class KVFerryConnectorMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """Scheduler → worker, once per step: kvferry's `PDMetadata` per role."""

    by_role: dict[str, PDMetadata] = field(default_factory=dict)


@dataclass
class KVFerryWorkerMetadata(KVConnectorWorkerMetadata):  # type: ignore[misc]
    """Worker → scheduler, once per step: why loads failed (request id → (cause, message))."""

    causes: dict[str, tuple[str, str]] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        causes = dict(self.causes)
        if isinstance(other, KVFerryWorkerMetadata):
            causes.update(other.causes)
        return KVFerryWorkerMetadata(causes)
