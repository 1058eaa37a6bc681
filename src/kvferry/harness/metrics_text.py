"""A /metrics page (Prometheus text format) as samples, read by prometheus_client's own parser."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.parser import text_string_to_metric_families


def parse_samples(text: str) -> Iterator[tuple[str, dict[str, str], float]]:
    """Every sample of the page as (name, labels, value); a name keeps its suffix (`_total`, `_bucket`, ...)."""
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            yield sample.name, sample.labels, float(sample.value)  # "2" comes back an int
