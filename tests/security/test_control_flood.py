"""Strangers without KVFERRY_SECRET flood P's ZMQ control port (issue 31.3-6), real P, D and proxy with
the secret set, the flood from a process of its own (`kvferry.harness.stranger`): legitimate requests
through the proxy keep succeeding (>= 99 %, the same text), and what the flood costs P stays bounded:
descriptors (1,000 idle connections used to take P to its fd limit), memory (48 half-sent 16 MiB frames pinned
+770 MiB), log lines (one warning per dropped message), the rank loop (junk of 10,000 frames a message
kept it draining until D called P dead). P's libzmq I/O threads run real-time while the port is calm and
at normal priority while strangers press (at SCHED_RR they accepted an idle flood faster than the rank
loop evicted it: 676 descriptors)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest

from kvferry.connector.prefill.guard import CALM_S, UNPROVEN_MAX
from kvferry.connector.zmq_context import ZMQ_THREAD_PREFIX
from procs import Proc, can_schedule_realtime, pd_system

FLOOD_S = 8.0
CONNS = {"idle": 1000, "junk": 8, "bigframe": 48, "reconnect": 32}


@pytest.fixture(scope="module")
def system() -> Iterator[tuple[Proc, Proc, Proc]]:
    with pd_system() as procs:
        yield procs


def metric(url: str, name: str, label: str = "") -> float:
    text = httpx.get(f"{url}/metrics", timeout=5).text
    return sum(float(m.group(1)) for m in re.finditer(rf"^{name}{{?[^}}\n]*{label}[^}}\n]*}}? (\S+)$", text, re.M))


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def log_lines(proc: Proc) -> int:
    with open(proc.log_path, "rb") as f:
        return f.read().count(b"\n")


def io_policies(pid: int) -> set[int]:
    """The scheduling policies of kvferry's libzmq I/O threads in process `pid`."""
    out = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                if f.read().startswith(f"{ZMQ_THREAD_PREFIX}/ZMQbg/IO/"):
                    out.add(os.sched_getscheduler(int(tid)))
        except OSError:
            pass  # the thread ended meanwhile
    return out


def complete(proxy: Proc, i: int) -> str | None:
    body = {"prompt": f"request {i % 4} under a flood, " * 4, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{proxy.url}/v1/completions", json=body, timeout=30)
    return str(r.json()["choices"][0]["text"]) if r.status_code == 200 else None


@pytest.mark.parametrize("mode", list(CONNS))
def test_legitimate_requests_survive_a_flood_of_strangers(system: tuple[Proc, Proc, Proc], mode: str) -> None:
    p, _, proxy = system
    expected = [complete(proxy, i) for i in range(4)]  # the quiet answers
    assert None not in expected
    realtime = can_schedule_realtime()
    if realtime:  # lifted once the previous flood has been quiet CALM_S
        deadline = time.monotonic() + CALM_S + 15
        while io_policies(p.pid) != {os.SCHED_RR}:
            assert time.monotonic() < deadline, f"P's I/O threads not real-time while calm: {io_policies(p.pid)}"
            time.sleep(0.1)
    control = httpx.get(f"{p.url}/debug/state", timeout=5).json()["connector"]["control_addrs"][0]
    fds0, rss0, log0 = fds(p.pid), rss_mib(p.pid), log_lines(p)
    drops0 = metric(p.url, "kvferry_control_dropped_total")
    attacker = subprocess.Popen([sys.executable, "-m", "kvferry.harness.stranger", mode, control,
                                 "--conns", str(CONNS[mode]), "--seconds", str(FLOOD_S)])
    ok = total = 0
    peak_fds, peak_rss = fds0, rss0
    lowered = False
    try:
        started = time.monotonic()
        while attacker.poll() is None and time.monotonic() - started < FLOOD_S + 30:
            ok += complete(proxy, total) == expected[total % 4]
            total += 1
            peak_fds, peak_rss = max(peak_fds, fds(p.pid)), max(peak_rss, rss_mib(p.pid))
            lowered = lowered or io_policies(p.pid) == {os.SCHED_OTHER}
    finally:
        attacker.kill()
        attacker.wait(10)
    drops = metric(p.url, "kvferry_control_dropped_total") - drops0
    print(f"{mode} x{CONNS[mode]}: {ok}/{total} ok; P fds {fds0} -> peak {peak_fds}, RSS {rss0:.0f} -> peak "
          f"{peak_rss:.0f} MiB, {log_lines(p) - log0} log lines, {drops:.0f} drops counted")
    assert total >= 5 and ok >= 0.99 * total, f"{ok}/{total} legitimate requests succeeded during the flood"
    # The cap is UNPROVEN_MAX; what libzmq accepts in a burst before the rank loop evicts comes on top
    # (peaks of 160-230 measured against 1,000 held open): bounded, far from the stranger's share.
    assert peak_fds - fds0 <= 8 * UNPROVEN_MAX, f"P's descriptors grew {fds0} -> {peak_fds}"
    assert peak_rss - rss0 <= 128, f"P's memory grew {rss0:.0f} -> {peak_rss:.0f} MiB"
    assert log_lines(p) - log0 <= 20, "P's log grew with the flood"
    assert lowered or not realtime, "P's I/O threads stayed real-time while strangers flooded"
    if mode != "junk":  # junk DEALERs queue their messages until a handshake that never succeeds
        assert drops > 0, "P counted nothing it refused"
