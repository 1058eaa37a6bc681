"""Smoke test of `kvferry bench progressive`: a tiny plan on loopback through the real processes."""

from __future__ import annotations

import json
from pathlib import Path

from kvferry.bench import progressive


def test_progressive_bench_tiny_plan(tmp_path: Path) -> None:
    out = tmp_path / "progressive.json"
    # Raises if an output differs between the three set-ups or a block is left held anywhere.
    rows = progressive.run(str(out), model="tiny", plan=((256, 1), (1024, 1)), shaped=False)
    assert [(r["link"], r["prompt_tokens"]) for r in rows] == [("loopback", 256), ("loopback", 1024)]
    short, long = rows
    assert short["parts"] == 0  # one step computes it: pushed once, after its prefill
    assert long["parts"] >= 1  # four steps: its first blocks went while P still computed
    for row in rows:
        assert row["ttft_colocated_ms"] > 0 and row["ttft_progressive_ms"] > 0 and row["ttft_after_prefill_ms"] > 0
        assert row["transfer_ms"] > 0 and row["kv_mib"] > 0
    assert json.loads(out.read_text()) == rows
