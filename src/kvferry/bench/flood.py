"""`kvferry bench flood`: legitimate P/D requests while a stranger without the secret floods P's control
port or D's data port, against the same requests with no flood.

Phases run Q F F Q so a drift of the box's load hits quiet and flooded alike. A request is ok when its
stream ends with [DONE] and its text is the fault-free one; the goal: >= 99 % ok and TTFT p99 at most
2x the quiet p99. A second table says where the time goes (with --json PATH, in PATH.costs.json)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvferry.bench.report import report
from kvferry.harness.client import RequestResult, WorkItem, new_results, percentile, run_workload
from kvferry.harness.metrics_text import parse_samples
from kvferry.harness.processes import Supervised
from kvferry.harness.sampler import Periodic
from kvferry.harness.system import PDSystem, PDSystemConfig

GOAL_OK = 0.99
GOAL_RATIO = 2.0
PROMPT_TOKENS = 96
MAX_TOKENS = 8
READY_S = 60.0  # the stranger's flood in place (1,000 connections on a loaded box take seconds)
SETTLE_S = 20.0  # the flooded process back to its descriptors before the next phase
HALF_OPEN = "127.0.0.1=64,127.0.0.2=64,127.0.0.3=64,127.0.0.4=64,127.0.0.5=64"


@dataclass(frozen=True)
class Flood:
    name: str
    mode: str  # harness/stranger.py's mode
    args: tuple[str, ...]  # its --conns / --sources

    @property
    def on_data_port(self) -> bool:
        return self.mode == "halfopen"


FLOODS = (
    Flood("P control: 1,000 idle TCP connections", "idle", ("--conns", "1000")),
    Flood("P control: 8 DEALERs, 10,000-frame junk", "junk", ("--conns", "8")),
    Flood("P control: 48 half-sent 1 MiB frames", "bigframe", ("--conns", "48")),
    Flood("P control: 32 DEALERs reconnecting /10 ms", "reconnect", ("--conns", "32")),
    Flood("D data: 64 + 4x64 half-open handshakes", "halfopen", ("--sources", HALF_OPEN)),
)


@dataclass
class Phase:
    """The legitimate requests of one kind of phase (quiet or flooded), all rounds together."""

    total: int = 0
    ok: int = 0
    ttft_s: list[float] = field(default_factory=list)
    latency_s: list[float] = field(default_factory=list)
    first_failure: str = ""

    def add(self, result: RequestResult, expected: str) -> None:
        self.total += 1
        good = result.outcome == "ok" and result.text == expected
        if good and result.ttft is not None and result.latency is not None:
            self.ok += 1
            self.ttft_s.append(result.ttft)
            self.latency_s.append(result.latency)
        elif not self.first_failure:
            self.first_failure = f"{result.outcome}: {result.error_message or 'wrong text'}"[:160]


def ratio(flooded: float | None, quiet: float | None) -> float | None:
    return None if flooded is None or quiet is None or quiet <= 0 else flooded / quiet


def _ms(seconds: float | None) -> int | None:
    return None if seconds is None else round(seconds * 1000)


def flood_row(flood: Flood, quiet: Phase, flooded: Phase, fds: tuple[int, int], drops: int) -> dict[str, Any]:
    p99, quiet_p99 = percentile(flooded.ttft_s, 99), percentile(quiet.ttft_s, 99)
    r = ratio(p99, quiet_p99)
    met = flooded.total > 0 and flooded.ok >= GOAL_OK * flooded.total and r is not None and r <= GOAL_RATIO
    return {"flood": flood.name, "ok": f"{flooded.ok}/{flooded.total}",
            "ttft_p50_ms": _ms(percentile(flooded.ttft_s, 50)), "ttft_p99_ms": _ms(p99),
            "quiet_ttft_p50_ms": _ms(percentile(quiet.ttft_s, 50)), "quiet_ttft_p99_ms": _ms(quiet_p99),
            "p99_ratio": None if r is None else round(r, 2),
            "latency_p99_ms": _ms(percentile(flooded.latency_s, 99)),
            "quiet_latency_p99_ms": _ms(percentile(quiet.latency_s, 99)), "fds": f"{fds[0]} -> {fds[1]}",
            "drops": drops, "goal": "met" if met else "missed",
            "first_failure": flooded.first_failure or quiet.first_failure}


# Where a request's time goes, from the instances' own histograms: (column, instance, metric).
STAGES = (("P_prefill_ms", "prefill", "kvferry_time_to_first_token_seconds"),
          ("D_pull_ms", "decode", "kvferry_kv_transfer_seconds"),
          ("D_ttft_ms", "decode", "kvferry_time_to_first_token_seconds"),
          ("D_hb_rtt_ms", "decode", "kvferry_heartbeat_rtt_seconds"))
CPU_OF = ("P", "D", "proxy", "stranger", "client")  # client: this process (requests, fd sampler)


@dataclass
class Usage:
    """What the phases of one kind cost: histogram (sum, count) deltas per stage; per process, seconds on a
    CPU and seconds runnable but waiting for one (`_sched_s`)."""

    requests: int = 0
    client_ttft_s: float = 0.0
    stages: dict[str, list[float]] = field(default_factory=lambda: {c: [0.0, 0.0] for c, _, _ in STAGES})
    sched_s: dict[str, float] = field(default_factory=dict)

    def add(self, before: dict[str, float], after: dict[str, float]) -> None:
        for column, _, _ in STAGES:
            self.stages[column][0] += after[f"{column}:sum"] - before[f"{column}:sum"]
            self.stages[column][1] += after[f"{column}:count"] - before[f"{column}:count"]
        for key, value in after.items():
            if key.startswith(("cpu:", "wait:", "box:")):
                self.sched_s[key] = self.sched_s.get(key, 0.0) + value - before.get(key, value)


def cost_row(flood: Flood, phase: str, usage: Usage) -> dict[str, Any]:
    """Means per stage, and per process CPU and run-queue wait, in ms per request, over a kind of phase."""
    n = max(usage.requests, 1)
    row: dict[str, Any] = {"flood": flood.name, "phase": phase, "client_ttft_ms": round(1000 * usage.client_ttft_s / n)}
    for column, (total, count) in usage.stages.items():
        row[column] = round(1000 * total / count, 1) if count else None
    for name in CPU_OF:
        for kind in ("cpu", "wait"):
            seconds = usage.sched_s.get(f"{kind}:{name}")
            row[f"{name}_{kind}_ms"] = None if seconds is None else round(1000 * seconds / n, 1)
    busy, total = usage.sched_s.get("box:busy", 0.0), usage.sched_s.get("box:total", 0.0)
    ours = sum(v for k, v in usage.sched_s.items() if k.startswith("cpu:"))
    row["others_cpu_ms"] = round(1000 * (busy - ours) / n, 1)  # other jobs on the box, and the kernel's
    row["irq_cpu_ms"] = round(1000 * usage.sched_s.get("box:irq", 0.0) / n, 1)
    row["box_idle_%"] = round(100 * (1 - busy / total)) if total else None
    return row


def _sched_s(pid: int) -> tuple[float, float]:
    """(on a CPU, waiting in a run queue) in seconds; the kernel keeps the wait per live thread only."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    wait = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{task}/schedstat") as f:
            wait += int(f.read().split()[1])
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"), wait / 1e9


def _snapshot(system: PDSystem, pids: dict[str, int]) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, pid in pids.items():
        out[f"cpu:{name}"], out[f"wait:{name}"] = _sched_s(pid)
    with open("/proc/stat") as f:  # every CPU of the box: user nice system idle iowait irq softirq steal
        ticks = [int(t) for t in f.readline().split()[1:9]]
    clock = os.sysconf("SC_CLK_TCK")
    out["box:total"], out["box:busy"] = sum(ticks) / clock, (sum(ticks) - ticks[3] - ticks[4]) / clock
    out["box:irq"] = (ticks[5] + ticks[6]) / clock  # the kernel's network work lands here, charged to no process
    pages = {}
    for proc in (system.prefill, system.decode):
        pages[proc.name] = {(n, tuple(sorted(labels.items()))): v
                            for n, labels, v in parse_samples(httpx.get(f"{proc.url}/metrics", timeout=10).text)}
    for column, instance, metric in STAGES:
        for part in ("sum", "count"):
            out[f"{column}:{part}"] = sum(v for (n, _), v in pages[instance].items() if n == f"{metric}_{part}")
    return out


def workload(n: int) -> list[WorkItem]:
    return [WorkItem(i, [(7 * i + 13 * k) % 251 + 1 for k in range(PROMPT_TOKENS)], MAX_TOKENS) for i in range(n)]


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@contextmanager
def stranger(flood: Flood, target: str, counts: list[int]) -> Iterator[int]:
    """The flood, once in place; on exit stopped, and the connections D closed on it appended to `counts`."""
    proc = Supervised(f"stranger-{flood.mode}", [sys.executable, "-m", "kvferry.harness.stranger", flood.mode,
                                                  target, *flood.args, "--seconds", "900"])
    try:
        deadline = time.monotonic() + READY_S
        while "ready" not in proc.output_tail():
            if proc.exited() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the {flood.mode} stranger is not flooding:\n{proc.output_tail()}")
            time.sleep(0.05)
        yield proc.pid
        proc.terminate()
        proc.popen.wait(10)
        last = proc.output_tail().split()
        counts.append(int(last[last.index("dropped") + 1]))
    finally:
        proc.stop()


def _dropped_total(url: str) -> int:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return round(sum(v for name, _, v in parse_samples(text) if name == "kvferry_control_dropped_total"))


def _send(url: str, items: Sequence[WorkItem]) -> list[RequestResult]:
    results = new_results(items)
    asyncio.run(run_workload(url, items, results, time.monotonic(), concurrency=1, timeout=60))
    return results


def _settle(pid: int, base: int) -> None:
    """Until the flooded process is back near its descriptors: the next phase is quiet."""
    deadline = time.monotonic() + SETTLE_S
    while _fds(pid) > base + 8:
        if time.monotonic() > deadline:
            raise RuntimeError(f"pid {pid} still holds {_fds(pid)} descriptors ({base} before the flood)")
        time.sleep(0.05)


def measure(system: PDSystem, flood: Flood, items: Sequence[WorkItem],
            expected: Sequence[str]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Quiet and flooded phases, Q F F Q, over the two halves of `items`: the row, and the cost rows."""
    victim = system.decode if flood.on_data_port else system.prefill
    connector = httpx.get(f"{victim.url}/debug/state", timeout=10).json()["connector"]
    target = connector["transfer_addrs" if flood.on_data_port else "control_addrs"][0]
    phases = {False: Phase(), True: Phase()}
    usage = {False: Usage(), True: Usage()}
    pids = {"P": system.prefill.pid, "D": system.decode.pid, "proxy": system.proxy.pid, "client": os.getpid()}
    base = peak = _fds(victim.pid)
    counts: list[int] = []
    drops0 = _dropped_total(system.prefill.url)
    half = len(items) // 2
    for chunk, flooding in ((0, False), (0, True), (1, True), (1, False)):
        part = range(chunk * half, (chunk + 1) * half)
        with contextlib.ExitStack() as stack:
            if flooding:
                pids["stranger"] = stack.enter_context(stranger(flood, target, counts))
                fds = Periodic(lambda: _fds(victim.pid), 0.05, "fd-peak")
                stack.callback(fds.stop, 5, True)
            before = _snapshot(system, pids)
            results = _send(system.proxy.url, [items[i] for i in part])
            usage[flooding].add(before, _snapshot(system, pids))
            pids.pop("stranger", None)
        if flooding:
            peak = max(peak, *map(int, fds.samples))
            _settle(victim.pid, base)
        for i, result in zip(part, results, strict=True):
            phases[flooding].add(result, expected[i])
        ttfts = [r.ttft for r in results if r.ttft is not None]
        usage[flooding].requests += len(ttfts)
        usage[flooding].client_ttft_s += sum(ttfts)
    drops = sum(counts) if flood.on_data_port else _dropped_total(system.prefill.url) - drops0
    row = flood_row(flood, phases[False], phases[True], (base, peak), drops)
    return row, [cost_row(flood, "quiet", usage[False]), cost_row(flood, "flood", usage[True])]


def run(json_path: str | None = None, quick: bool = False, requests: int | None = None) -> list[dict[str, Any]]:
    n = requests or (20 if quick else 100)
    items = workload(n + n % 2)
    load0 = os.getloadavg()[0]
    rows = []
    with PDSystem(PDSystemConfig(policy="recompute", abort_timeout=10.0, kv_load_deadline=20.0)) as system:
        warm = _send(system.proxy.url, items)  # the fault-free texts, and every prompt seen once
        bad = [r for r in warm if r.outcome != "ok"]
        if bad:
            raise RuntimeError(f"{len(bad)} quiet requests failed before any flood: {bad[0].error_message}")
        expected = [r.text for r in warm]
        costs: list[dict[str, Any]] = []
        for flood in FLOODS:
            row, cost = measure(system, flood, items, expected)
            rows.append(row)
            costs += cost
    report("Where the time goes, per request: means per stage from P's and D's histograms; per process, CPU "
           "time and time runnable but waiting for a CPU (schedstat)", costs, json_path and json_path + ".costs.json")
    report(f"Legitimate requests under a stranger's flood: {len(items)} quiet + {len(items)} flooded streamed "
           f"requests per flood, one at a time, through proxy + P + D with the secret (load {load0:.1f} -> "
           f"{os.getloadavg()[0]:.1f}; goal >= 99 % ok, TTFT p99 <= {GOAL_RATIO:g}x quiet)", rows, json_path)
    return rows
