"""Prometheus metrics of one instance (names are a contract: docs/design.md).

Each instance owns its registry, so several engines in one process (tests) never collide.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.kv_load_failures = Counter(
            "kvferry_kv_load_failures", "Failed KV loads on the decode side, by cause", ["cause"], registry=r
        )
        self.kv_transfers = Counter("kvferry_kv_transfers", "Completed KV transfers", registry=r)
        self.kv_transfer_bytes = Counter("kvferry_kv_transfer_bytes", "KV bytes transferred", registry=r)
        self.kv_transfer_seconds = Histogram(
            "kvferry_kv_transfer_seconds", "Duration of one KV transfer", buckets=_TRANSFER_BUCKETS, registry=r
        )
        self.requests_waiting_for_remote_kv = Gauge(
            "kvferry_requests_waiting_for_remote_kv", "Requests in WAITING_FOR_REMOTE_KVS", registry=r
        )
        self.requests_finished = Counter(
            "kvferry_requests_finished", "Finished requests by finish reason", ["reason"], registry=r
        )
        self.kv_blocks_free = Gauge("kvferry_kv_blocks_free", "Free KV blocks", registry=r)
        self.kv_blocks_total = Gauge("kvferry_kv_blocks_total", "All KV blocks", registry=r)
        self.recomputed_tokens = Counter(
            "kvferry_recomputed_tokens", "Prompt tokens recomputed locally after a failed KV load", registry=r
        )
        self.kv_leases_expired = Counter(
            "kvferry_kv_leases_expired", "Transfers whose blocks P freed because nobody pulled them", registry=r
        )
        self.producer_errors = Counter(
            "kvferry_producer_errors", "Unexpected errors P's rank loops survived (each cost one message)",
            registry=r,
        )
        self.unknown_connector_ids = Counter(
            "kvferry_unknown_connector_ids", "Finished ids from the connector that the scheduler did not hold",
            registry=r,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
