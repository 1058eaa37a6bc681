"""What KVFerryConnector's halves send each other through vLLM (pickled, across processes)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from kvferry.connector.bootstrap import Registration
from kvferry.connector.metadata import PDMetadata


@dataclass
class KVFerryHandshake(KVConnectorHandshakeMetadata):  # type: ignore[misc]
    """Worker → engine core, once after the KV cache is registered: the bootstrap entries of the P ranks
    this worker serves (the scheduler half serves P's bootstrap for the whole engine)."""

    registrations: list[Registration] = field(default_factory=list)


@dataclass
class KVFerryConnectorMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """Scheduler → worker, once per step: kvferry's `PDMetadata` per role."""

    by_role: dict[str, PDMetadata] = field(default_factory=dict)
    # P: (transfer id, request id) of requests vLLM preempted mid-prefill while pushing progressively
    preempted: list[tuple[str, str]] = field(default_factory=list)


@dataclass
class KVFerryWorkerMetadata(KVConnectorWorkerMetadata):  # type: ignore[misc]
    """Worker → scheduler, once per step: why loads failed, and per request how many ranks quarantined
    or released its blocks."""

    causes: dict[str, tuple[str, str]] = field(default_factory=dict)
    quarantined: dict[str, int] = field(default_factory=dict)
    released: dict[str, int] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        causes = dict(self.causes)
        quarantined, released = Counter(self.quarantined), Counter(self.released)
        if isinstance(other, KVFerryWorkerMetadata):
            causes.update(other.causes)
            quarantined.update(other.quarantined)  # the ranks' counts add up
            released.update(other.released)
        return KVFerryWorkerMetadata(causes, dict(quarantined), dict(released))
