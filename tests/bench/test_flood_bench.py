"""`kvferry bench flood`'s pure parts: the ratio to the quiet run, the table's rows, the phases' bookkeeping,
and the stranger's --sources. (The bench itself runs real processes for minutes: it is run by hand.)"""

from __future__ import annotations

import argparse

import pytest

from kvferry.bench.flood import FLOODS, STAGES, Phase, Usage, cost_row, flood_row, ratio, workload
from kvferry.harness.client import RequestResult
from kvferry.harness.stranger import parse_sources


def _result(ttft: float, latency: float, text: str = "abc", outcome: str = "ok") -> RequestResult:
    return RequestResult(0, 96, 8, outcome=outcome, sent_at=1.0, first_token_at=1.0 + ttft,
                         finished_at=1.0 + latency, text=text, error_message=None if outcome == "ok" else "boom")


def _phase(ttfts: list[float]) -> Phase:
    phase = Phase()
    for t in ttfts:
        phase.add(_result(t, 2 * t), "abc")
    return phase


def test_ratio() -> None:
    assert ratio(0.3, 0.1) == pytest.approx(3.0)
    assert ratio(None, 0.1) is None and ratio(0.3, None) is None and ratio(0.3, 0.0) is None


def test_phase_counts_only_the_fault_free_text_as_ok() -> None:
    phase = Phase()
    phase.add(_result(0.05, 0.1), "abc")
    phase.add(_result(0.05, 0.1, text="abd"), "abc")  # answered, but not the fault-free text
    phase.add(_result(0.05, 0.1, outcome="error"), "abc")
    assert (phase.ok, phase.total) == (1, 3)
    assert phase.ttft_s == [pytest.approx(0.05)] and phase.latency_s == [pytest.approx(0.1)]
    assert phase.first_failure == "ok: wrong text"


def test_row_compares_the_flood_p99_with_the_quiet_p99_next_to_it() -> None:
    quiet = _phase([0.010 * (i + 1) for i in range(100)])  # p99 99.01 ms
    flooded = _phase([0.020 * (i + 1) for i in range(100)])  # p99 198.02 ms: exactly 2x
    row = flood_row(FLOODS[0], quiet, flooded, (28, 262), 11200)
    assert row == {
        "flood": FLOODS[0].name, "ok": "100/100", "ttft_p50_ms": 1010, "ttft_p99_ms": 1980,
        "quiet_ttft_p50_ms": 505, "quiet_ttft_p99_ms": 990, "p99_ratio": 2.0, "latency_p99_ms": 3960,
        "quiet_latency_p99_ms": 1980, "fds": "28 -> 262", "drops": 11200, "goal": "met", "first_failure": "",
    }
    slower = _phase([0.021 * (i + 1) for i in range(100)])
    assert flood_row(FLOODS[0], quiet, slower, (28, 30), 0)["goal"] == "missed"  # 2.1x


def test_one_failure_in_a_hundred_meets_the_goal_two_miss_it() -> None:
    quiet = _phase([0.01] * 100)
    for failures, goal in ((1, "met"), (2, "missed")):
        flooded = _phase([0.01] * (100 - failures))
        for _ in range(failures):
            flooded.add(_result(0.01, 0.02, outcome="error"), "abc")
        row = flood_row(FLOODS[-1], quiet, flooded, (22, 97), 5)
        assert (row["ok"], row["goal"], row["first_failure"]) == (f"{100 - failures}/100", goal, "error: boom")


def test_a_flood_with_no_answer_misses() -> None:
    row = flood_row(FLOODS[1], _phase([0.01] * 4), _phase([]), (27, 27), 0)
    assert (row["ttft_p99_ms"], row["p99_ratio"], row["goal"]) == (None, None, "missed")


def test_cost_row_per_request() -> None:
    usage = Usage(requests=4, client_ttft_s=0.2)
    before = {f"{c}:{part}": 0.0 for c, _, _ in STAGES for part in ("sum", "count")} | {
        "cpu:P": 1.0, "wait:P": 0.5, "box:busy": 10.0, "box:total": 40.0}
    after = dict(before) | {"P_prefill_ms:sum": 0.08, "P_prefill_ms:count": 4.0, "cpu:P": 1.1, "wait:P": 0.9,
                            "box:busy": 10.3, "box:total": 40.6}
    usage.add(before, after)
    row = cost_row(FLOODS[0], "flood", usage)
    assert row["client_ttft_ms"] == 50 and row["P_prefill_ms"] == 20.0 and row["D_pull_ms"] is None
    assert row["P_cpu_ms"] == 25.0 and row["P_wait_ms"] == 100.0 and row["stranger_cpu_ms"] is None
    # The box was busy 0.3 of 0.6 CPU-seconds; P's 0.1 of it is ours, the rest is someone else's.
    assert row["box_idle_%"] == 50 and row["others_cpu_ms"] == 50.0


def test_workload_is_deterministic_and_distinct() -> None:
    items = workload(10)
    assert items == workload(10) and len({tuple(i.prompt) for i in items}) == 10
    assert all(len(i.prompt) == 96 and min(i.prompt) >= 1 and max(i.prompt) <= 251 for i in items)


def test_sources() -> None:
    assert parse_sources("127.0.0.1=64,127.0.0.2=3") == {"127.0.0.1": 64, "127.0.0.2": 3}
    with pytest.raises(argparse.ArgumentTypeError, match="IP=N"):
        parse_sources("127.0.0.1:64")
