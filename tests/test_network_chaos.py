"""`kvferry chaos --network`: packet loss, a 10 s partition in the middle of transfers, a 10 MB/s cap
between P (in its own network namespace) and D; nothing stuck, nothing leaked, every failure typed, and
every request after healing succeeds. Needs root, ip, iptables and tc; skips with the reason otherwise."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvferry.harness.network import unavailable_reason

REASON = unavailable_reason()


@pytest.mark.skipif(REASON is not None, reason=REASON or "")
@pytest.mark.timeout(300)
def test_network_chaos_loss_partition_cap(tmp_path: Path) -> None:
    out = tmp_path / "net.json"
    cmd = [sys.executable, "-m", "kvferry", "chaos", "--network", "--net-requests", "20", "--loss", "0.07",
           "--partition-s", "10", "--cap-mb", "10", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=280)
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    rows = {r["scenario"]: r for r in report["scenarios"]}
    assert set(rows) == {"loss", "partition", "cap"}
    for row in rows.values():
        assert row["stuck"] == 0 and not row["untyped"], row
        assert row["leaked_blocks"] == {"P": 0, "D": 0}, row
        assert row["after_heal_ok"] == "10/10", row
    assert proc.returncode == 0 and report["verdict"] == "PASS", proc.stdout[-3000:]


def test_link_faults_apply_and_heal() -> None:
    if REASON is not None:
        pytest.skip(REASON)
    from kvferry.harness.network import VethLink

    link = VethLink.create(tag=4093)
    try:
        link.partition()
        rules = subprocess.run([*link.prefix, "iptables", "-S"], capture_output=True, text=True).stdout
        assert "-j DROP" in rules
        link.loss(0.05)
        link.cap(10_000_000)
        link.heal()
        rules = subprocess.run([*link.prefix, "iptables", "-S"], capture_output=True, text=True).stdout
        assert "DROP" not in rules
    finally:
        link.close()
    assert subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.find(link.ns) < 0
