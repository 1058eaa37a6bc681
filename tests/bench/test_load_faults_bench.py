"""`kvferry bench load_faults --quick` (issue 32.3/32.5): kill -9 of a P, of a D (each back after 5 s) and a
rolling restart of all four instances, under streamed load through the proxy: every request answered with
the fault-free text."""

from __future__ import annotations

import pytest

from kvferry.bench import load_faults


@pytest.mark.timeout(300)
def test_no_request_is_lost_to_a_killed_or_restarted_instance(tmp_path) -> None:  # type: ignore[no-untyped-def]
    rows = load_faults.run(str(tmp_path / "rows.json"), quick=True)
    assert [r["fault"] for r in rows] == ["P kill -9, back after 5 s", "D kill -9, back after 5 s",
                                          "rolling restart (SIGTERM, all 4)"]
    for row in rows:
        assert row["ok"] == row["total"] == 100, row
        assert row["recovery_s"] is not None
