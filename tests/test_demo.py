"""`kvferry demo` end to end (small workloads), and the workload helpers it is built on."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import pytest

from kvferry.harness import demo
from kvferry.harness.client import make_workload, percentile
from kvferry.harness.sampler import is_drained, parse_metrics


def _children() -> set[int]:
    pids: set[int] = set()
    for task in Path(f"/proc/{os.getpid()}/task").iterdir():
        children = (task / "children").read_text().split()
        pids.update(int(pid) for pid in children)
    return pids


def _run_demo(tmp_path: Path, *extra: str) -> tuple[int, dict[str, Any]]:
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    report_path = tmp_path / "report.json"
    args = parser.parse_args(
        ["--model", "tiny", "--requests", "8", "--max-prompt", "200", "--max-tokens", "4", "8", "--abort-timeout", "5",
         "--no-live", "--json", str(report_path), *extra]
    )  # fmt: skip
    before = _children()
    code = demo.run(args)
    assert _children() <= before, "the demo left a child process running"
    return code, json.loads(report_path.read_text())


def _assert_clean(report: dict[str, Any]) -> None:
    requests = report["requests"]
    assert requests["total"] == 8
    assert requests["stuck"] == 0 and requests["error"] == 0, report["problems"]
    assert requests["mismatched"] == 0 and requests["unverified"] == 0, report["problems"]
    assert requests["checked"] == requests["ok"]
    assert report["leaked_blocks"] == {"prefill": 0, "decode": 0}
    for side in ("prefill", "decode"):
        assert is_drained(report["final_state"][side]), report["final_state"][side]
    assert report["ok"] is True and report["problems"] == []
    assert len(report["per_request"]) == 8


def test_demo_recompute_with_default_faults(tmp_path: Path) -> None:
    code, report = _run_demo(tmp_path)
    assert code == 0, report["problems"]
    _assert_clean(report)
    assert report["config"]["faults"] == demo.DEFAULT_FAULTS
    assert report["requests"]["ok"] == 8 and report["requests"]["failed"] == 0
    # Every failed load was recomputed on D.
    assert report["requests"]["recomputed"] == sum(report["kv_load_failures_by_cause"].values())
    assert report["ttft_ms"]["p50"] is not None and report["ttft_ms"]["p99"] >= report["ttft_ms"]["p50"]
    assert report["transfer"]["count"] >= 1 and report["transfer"]["bytes"] > 0


def test_demo_fail_policy_answers_500_with_a_cause(tmp_path: Path) -> None:
    # Faults on about half of the transfers, so some requests fail (the checks hold either way).
    faults = "transport=0.25,corrupt=0.2,error_reply=0.2,seed=3"
    code, report = _run_demo(tmp_path, "--policy", "fail", "--faults", faults)
    assert code == 0, report["problems"]
    _assert_clean(report)
    requests = report["requests"]
    assert requests["ok"] + requests["failed"] == 8
    assert requests["recomputed"] == 0 and report["recomputed_tokens"] == 0
    failed = [r for r in report["per_request"] if r["outcome"] == "failed"]
    assert all(
        r["http_status"] == 500 and r["error_type"] == "kv_load_failed" and r["error_code"] for r in failed
    )
    assert sum(report["failed_by_cause"].values()) == len(failed)
    causes = {
        "error_reply",
        "err_reqs",
        "transport",
        "recv_timeout",
        "bootstrap",
        "peer_dead",
        "deadline",
        "checksum",
    }
    assert set(report["failed_by_cause"]) <= causes


def test_bad_fault_spec_is_a_usage_error() -> None:
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    assert demo.run(parser.parse_args(["--faults", "nonsense=1", "--no-live"])) == 2


def test_workload_is_deterministic_and_mixed() -> None:
    a, b = make_workload(50, seed=3), make_workload(50, seed=3)
    assert a == b and a != make_workload(50, seed=4)
    lengths = sorted(len(item.prompt) for item in a)
    assert lengths[0] == 1 and lengths[-1] == 2000 and {15, 16, 17} <= set(lengths)
    assert all(0 <= t < 256 for item in a for t in item.prompt)
    assert all(8 <= item.max_tokens <= 32 for item in a)
    assert all(len(item.prompt) <= 100 for item in make_workload(10, seed=0, max_prompt=100))


def test_parse_metrics_and_percentile() -> None:
    text = (
        "# HELP x\n"
        'kvferry_kv_load_failures_total{cause="transport"} 3.0\n'
        'kvferry_kv_load_failures_total{cause="checksum"} 1.0\n'
        "kvferry_kv_transfer_bytes_total 1.5e+06\n"
    )
    snap = parse_metrics(text)
    assert snap.value("kvferry_kv_load_failures_total") == 4.0
    assert snap.value("kvferry_kv_load_failures_total", cause="checksum") == 1.0
    assert snap.by_label("kvferry_kv_load_failures_total", "cause") == {"transport": 3.0, "checksum": 1.0}
    assert snap.value("kvferry_kv_transfer_bytes_total") == 1.5e6 and snap.value("missing") == 0.0
    assert percentile([], 50) is None
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == pytest.approx(2.5)
    assert percentile([5.0], 99) == 5.0
