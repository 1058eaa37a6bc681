"""A CI-sized `kvferry chaos` run under each policy: faults of every kind plus kill -9 and SIGSTOP of P.
Nothing stuck, nothing leaked, outputs identical; under `fail` exactly the predicted requests fail."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from kvferry.harness import chaos


@pytest.mark.timeout(400)
@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_chaos_run_is_clean(policy: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    chaos.add_arguments(parser)
    out = tmp_path / "chaos.json"
    args = parser.parse_args(
        ["--requests", "200", "--policy", policy, "--seed", "3", "--chaos-every", "5", "--json", str(out)]
    )
    assert chaos.run(args) == 0
    # Progress while it runs (plain lines: not a terminal), the last one with every request done.
    progress = [ln for ln in capsys.readouterr().out.splitlines() if " done  (" in ln]
    assert progress and progress[-1].split()[3] == "200/200", progress[-3:]
    report = json.loads(out.read_text())
    assert report["stuck"] == 0 and report["mismatched"] == 0 and report["num_unexpected"] == 0
    assert report["leaked_blocks"] == {"P": 0, "D": 0}
    assert report["p_chaos_events"], "P was never killed or frozen"
    if policy == "recompute":
        assert report["outcomes"] == {"ok": 200}
    else:
        assert report["failed_by_cause"], "the fault rate should fail some requests"
