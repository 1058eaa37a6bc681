"""`kvferry soak`: a short run under restarts, freezes, faults and load stays bounded; the slope check
itself flags a series that grows."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvferry.harness.soak import LIMITS_PER_HOUR, NOISE_FLOOR, _worst_fit


def _bounded(metric: str, points: list[tuple[float, float, int]]) -> bool:
    fit = _worst_fit(points)
    return fit is None or fit[0] <= LIMITS_PER_HOUR[metric] or fit[1] <= NOISE_FLOOR[metric]


def test_slope_check_flags_growth_and_passes_noise() -> None:
    t = [2.0 * i for i in range(60)]
    leak = [(x, 20 + x / 5, 0) for x in t]  # one fd every 5 s
    noisy = [(x, 20 + (i % 3), 0) for i, x in enumerate(t)]
    sawtooth = [(x, 20 + (x % 60) / 30, int(x // 60)) for x in t]  # warm-up after each restart only
    assert not _bounded("fds", leak)
    assert _bounded("fds", noisy)
    assert _bounded("fds", sawtooth)


@pytest.mark.timeout(330)
def test_short_soak_is_bounded(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    cmd = [sys.executable, "-m", "kvferry", "soak", "--minutes", "2.5", "--event-every", "30", "--interval", "2",
           "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=320)
    report = json.loads(out.read_text())
    assert report["outcomes"].get("stuck", 0) == 0
    assert len(report["events"]) >= 3
    assert any(r["judged"] for r in report["series"] if r["process"] == "proxy")
    assert report["verdict"] == "PASS" and proc.returncode == 0, proc.stdout[-4000:]
