"""Smoke test of `kvferry bench e2e`: a tiny plan through the real processes, colocated and P/D."""

from __future__ import annotations

import json
from pathlib import Path

from kvferry.bench import e2e


def test_e2e_bench_tiny_plan(tmp_path: Path) -> None:
    out = tmp_path / "e2e.json"
    rows = e2e.run(str(out), plan=((40, 2), (300, 1)))  # raises if outputs differ or a block leaks
    assert [(r["mode"], r["prompt_tokens"], r["reps"]) for r in rows] == [
        ("colocated", 40, 2),
        ("disaggregated", 40, 2),
        ("colocated", 300, 1),
        ("disaggregated", 300, 1),
    ]
    for row in rows:
        assert row["ttft_p50_ms"] > 0 and row["itl_p50_ms"] > 0
        assert row["ttft_p99_ms"] >= row["ttft_p50_ms"]
    for row in rows[1::2]:
        assert 0 < row["transfer_ms"] < row["ttft_p50_ms"]
        assert 0 < row["transfer_share_of_ttft"] < 1
        assert row["x_ttft_vs_colocated"] > 0
        assert row["kv_mib"] > 0
    assert json.loads(out.read_text()) == rows
