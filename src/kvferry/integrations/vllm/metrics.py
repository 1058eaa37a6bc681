"""kvferry's failure counters inside vLLM's own `/metrics`: the engine core hands
`get_kv_connector_stats()` (deltas since the last call) to the frontend, whose Prometheus logger passes
them to `build_prom_metrics(...).observe()`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from kvferry.connector.faults import CAUSE_OF_FAULT

METRIC = "kvferry:kv_load_failures"
# Every cause kvferry's decode side reports (docs/design.md), so each series exists from the start.
CAUSES = sorted({*CAUSE_OF_FAULT.values(), "bootstrap", "peer_dead", "deadline", "expired", "recv_timeout"})


@dataclass
class KVFerryStats(KVConnectorStats):  # type: ignore[misc]
    """data = {"failures": {cause: count}}: failed KV loads since the last report."""

    def __post_init__(self) -> None:
        self.data.setdefault("failures", {})

    def add(self, cause: str, n: int = 1) -> None:
        failures = self.data["failures"]
        failures[cause] = failures.get(cause, 0) + n

    def reset(self) -> None:
        self.data: dict[str, Any] = {"failures": {}}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for cause, n in (other.data or {}).get("failures", {}).items():
            self.add(cause, int(n))
        return self

    def reduce(self) -> dict[str, int | float]:
        return {f"kv_load_failures_{c}": int(n) for c, n in sorted(self.data["failures"].items())}

    def is_empty(self) -> bool:
        return not any(self.data["failures"].values())


class KVFerryPromMetrics(KVConnectorPromMetrics):  # type: ignore[misc]
    """`kvferry:kv_load_failures_total{engine, model_name, cause}` on vLLM's /metrics."""

    def __init__(self, vllm_config: Any, metric_types: dict[Any, Any], labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        counter = self._counter_cls(name=METRIC,
                                    documentation="KV loads kvferry failed, by cause (docs/design.md)",
                                    labelnames=[*labelnames, "cause"])
        self._by_engine = {
            engine: {cause: counter.labels(*values, cause) for cause in CAUSES}
            for engine, values in per_engine_labelvalues.items()
        }
        self._counter, self._values = counter, per_engine_labelvalues

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        series = self._by_engine.get(engine_idx, {})
        for cause, n in (transfer_stats_data or {}).get("failures", {}).items():
            if cause not in series:
                series[cause] = self._counter.labels(*self._values.get(engine_idx, []), cause)
            series[cause].inc(int(n))
