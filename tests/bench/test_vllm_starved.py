"""`kvferry bench vllm --hogs`: the cause and reason it counts are the ones D's consumer logs for a failed KV
load."""

from __future__ import annotations

import logging

import pytest

from kvferry.bench.vllm.starved import _FAILED
from kvferry.connector.decode import consumer


def test_counts_the_cause_of_the_consumers_own_log_line(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        consumer.log.warning("KV load for %s failed (%s): %s", "cmpl-1-0", "peer_dead", "P silent for 5.5s")
        consumer.log.warning("KV load for %s failed (%s): %s", "cmpl-2-0", "expired", "lease lost")
    assert _FAILED.findall(caplog.text) == [("peer_dead", "P silent for 5.5s"), ("expired", "lease lost")]
