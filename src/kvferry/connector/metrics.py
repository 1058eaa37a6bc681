"""Prometheus metrics of one instance (names are a contract: docs/design.md).

Each instance owns its registry, so several engines in one process (tests) never collide."""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

# No `<name>_created` series beside every counter and histogram (vLLM's /metrics has none either).
disable_created_metrics()  # type: ignore[no-untyped-call]

# Request-latency and length buckets (seconds / tokens), the ranges vLLM uses.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000)
_TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.kv_load_failures = Counter("kvferry_kv_load_failures",
                                        "Failed KV loads on the decode side, by cause", ["cause"], registry=r)
        self.kv_transfers = Counter("kvferry_kv_transfers", "Completed KV transfers", registry=r)
        self.kv_transfer_bytes = Counter("kvferry_kv_transfer_bytes", "KV bytes transferred", registry=r)
        self.kv_transfer_seconds = Histogram("kvferry_kv_transfer_seconds", "Duration of one KV transfer",
                                             buckets=_TRANSFER_BUCKETS, registry=r)
        self.heartbeat_rtt_seconds = Histogram(
            "kvferry_heartbeat_rtt_seconds", "D: from a heartbeat to P's ack (P's liveness under load)",
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0), registry=r)
        self.requests_waiting_for_remote_kv = Gauge("kvferry_requests_waiting_for_remote_kv",
                                                    "Requests in WAITING_FOR_REMOTE_KVS", registry=r)
        self.requests_finished = Counter("kvferry_requests_finished", "Finished requests by finish reason",
                                         ["reason"], registry=r)
        self.kv_blocks_free = Gauge("kvferry_kv_blocks_free", "Free KV blocks", registry=r)
        self.kv_blocks_total = Gauge("kvferry_kv_blocks_total", "All KV blocks", registry=r)
        self.recomputed_tokens = Counter(
            "kvferry_recomputed_tokens", "Prompt tokens recomputed locally after a failed KV load", registry=r
        )
        self.progressive_writes = Counter(
            "kvferry_progressive_writes",
            "P: partial writes of a prompt's KV started while its prefill still ran", registry=r)
        self.kv_leases_expired = Counter(
            "kvferry_kv_leases_expired", "Transfers whose blocks P freed because nobody pulled them", registry=r
        )
        self.producer_errors = Counter("kvferry_producer_errors",
                                       "Unexpected errors P's rank loops survived (each cost one message)",
                                       registry=r)
        self.duplicate_transfer_ids = Counter("kvferry_duplicate_transfer_ids",
                                              "P requests refused because their transfer_id was in use",
                                              registry=r)
        self.control_auth_failures = Counter(
            "kvferry_control_auth_failures",
            "Control messages dropped: not sealed with this deployment's secret, replayed or malformed",
            ["side"], registry=r)
        self.control_realtime = Gauge(
            "kvferry_control_realtime",
            "1 while P's libzmq I/O threads run real-time (0: refused, or lowered while strangers press)",
            registry=r)
        self.control_dropped = Counter(
            "kvferry_control_dropped",
            "What P's control port refused from strangers, by reason (handshake, auth, receiver, version, frames, "
            "connection cap, bad message)", ["reason"], registry=r,
        )
        self.unknown_connector_ids = Counter(
            "kvferry_unknown_connector_ids",
            "Finished ids from the connector that the scheduler did not hold", registry=r)

        self.time_to_first_token = Histogram("kvferry_time_to_first_token_seconds",
                                             "From arrival to the first output token", buckets=_TTFT_BUCKETS,
                                             registry=r)
        self.inter_token_latency = Histogram(
            "kvferry_inter_token_latency_seconds", "Between consecutive output tokens", buckets=_ITL_BUCKETS, registry=r
        )
        self.e2e_request_latency = Histogram("kvferry_e2e_request_latency_seconds",
                                             "From arrival to the last token of a finished request",
                                             buckets=_E2E_BUCKETS, registry=r)
        self.request_prompt_tokens = Histogram(
            "kvferry_request_prompt_tokens", "Prompt length of finished requests", buckets=_TOKEN_BUCKETS, registry=r
        )
        self.request_generation_tokens = Histogram("kvferry_request_generation_tokens",
                                                   "Output length of finished requests",
                                                   buckets=_TOKEN_BUCKETS, registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
