"""`kvferry soak --minutes N`: P, D and the proxy under steady load, faults and restarts, sampled for fds,
threads, RSS, blocks held and transfer tables. A series fails when its least-squares slope per process
lifetime is both above its limit per hour and above its noise floor: a single high reading proves nothing."""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import signal
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np
from rich.console import Console
from rich.table import Table

from kvferry.harness.chaos import fault_spec
from kvferry.harness.client import make_workload, new_results, run_workload
from kvferry.harness.system import PDSystem, PDSystemConfig

# Growth per hour above which a series "grows without bound" (well above the noise of a healthy run) ...
LIMITS_PER_HOUR = {"fds": 60.0, "threads": 60.0, "rss_mb": 400.0, "blocks_held": 400.0, "table": 400.0}
# ... when the fitted growth over the span is also above this floor (load swings, allocator arenas).
NOISE_FLOOR = {"fds": 6.0, "threads": 4.0, "rss_mb": 48.0, "blocks_held": 128.0, "table": 32.0}
WARMUP_S = 40.0  # of each lifetime, dropped before fitting (imports, caches, pools warming up)
MIN_SPAN_S = 40.0  # a shorter fitted span is not judged


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--minutes", type=float, default=3.0, help="how long to run")
    parser.add_argument("--interval", type=float, default=3.0, help="seconds between samples")
    parser.add_argument("--event-every", type=float, default=30.0,
                        help="seconds between events (restart P, freeze P, restart D, in turn)")
    parser.add_argument("--fault-rate", type=float, default=0.1, help="share of transfers with an injected fault")
    parser.add_argument("--seed", type=int, default=0, help="workload, fault and weights seed")
    parser.add_argument("--plot", default=None, help="write a PNG of every series")
    parser.add_argument("--json", dest="json_path", default=None, help="write the report and samples as JSON")


def _proc_stats(pid: int) -> dict[str, float] | None:
    try:
        fds = len(os.listdir(f"/proc/{pid}/fd"))
        with open(f"/proc/{pid}/status") as f:
            status = dict(line.split(":", 1) for line in f if ":" in line)
        return {"fds": fds, "threads": int(status["Threads"]), "rss_mb": int(status["VmRSS"].split()[0]) / 1024}
    except (OSError, KeyError):  # gone, or a zombie (no VmRSS) between a kill and its restart
        return None


LABELS = {"P": "prefill", "D": "decode", "proxy": "proxy"}


@dataclass
class _Soak:
    system: PDSystem
    # series[(process, metric)] = [(t, value, lifetime)]
    series: dict[tuple[str, str], list[tuple[float, float, int]]] = field(default_factory=dict)
    # A process's lifetime ends where a sample first sees another pid under its name.
    lifetimes: dict[str, int] = field(default_factory=lambda: {"P": 0, "D": 0, "proxy": 0})
    pids: dict[str, int] = field(default_factory=dict)
    events: list[tuple[float, str]] = field(default_factory=list)

    def restart(self, name: str, t: float) -> None:
        self.system.procs[LABELS[name]].signal(signal.SIGKILL)
        self.events.append((t, f"kill -9 {name}"))
        self.system.restart(LABELS[name])

    def freeze(self, name: str, t: float) -> None:
        proc = self.system.procs[LABELS[name]]
        self.events.append((t, f"SIGSTOP {name} 2.5 s"))
        proc.signal(signal.SIGSTOP)
        time.sleep(2.5)
        proc.signal(signal.SIGCONT)

    def sample(self, t: float) -> None:
        for name, role in LABELS.items():
            proc = self.system.procs[role]
            if self.pids.setdefault(name, proc.pid) != proc.pid:
                self.pids[name] = proc.pid
                self.lifetimes[name] += 1
            stats = _proc_stats(proc.pid) or {}
            if name in ("P", "D"):
                try:
                    state = httpx.get(f"{proc.url}/debug/state", timeout=2).json()
                    if not state.get("stale"):
                        stats["blocks_held"] = state["blocks_total"] - state["blocks_free"]
                        stats["table"] = state["pending_sends"] if name == "P" else state["pending_pulls"]
                except (httpx.HTTPError, ValueError, KeyError):
                    pass
            for metric, value in stats.items():
                self.series.setdefault((name, metric), []).append((t, float(value), self.lifetimes[name]))


def _worst_fit(points: list[tuple[float, float, int]]) -> tuple[float, float] | None:
    """(slope per hour, growth over the span) of the steepest lifetime after its warm-up, or None."""
    fits = []
    for life in sorted({p[2] for p in points}):
        seg = [(t, v) for t, v, lt in points if lt == life]
        seg = [(t, v) for t, v in seg if t - seg[0][0] >= WARMUP_S]
        if len(seg) >= 8 and seg[-1][0] - seg[0][0] >= MIN_SPAN_S:
            t, v = np.array(seg).T
            slope = float(np.polyfit(t, v, 1)[0])
            fits.append((slope * 3600, slope * float(t[-1] - t[0])))
    return max(fits) if fits else None


def run(args: argparse.Namespace) -> int:
    console = Console(width=140)
    faults = fault_spec(args.fault_rate, args.seed).to_spec()
    soak = _Soak(PDSystem(PDSystemConfig(
        seed=args.seed, policy="recompute", faults=faults, num_blocks=1024, abort_timeout=3.0, health_timeout=90.0,
        proxy_args=("--retries", "6", "--retry-unreachable", "8"))))
    duration = args.minutes * 60
    halt = threading.Event()
    results_all: list[Any] = []
    try:
        soak.system.start()
        t0 = time.monotonic()

        def load() -> None:
            batch = 0
            while not halt.is_set():
                items = make_workload(16, args.seed + batch, max_prompt=800, max_tokens=(4, 8), long_share=0.1)
                results = new_results(items)
                asyncio.run(run_workload(soak.system.proxy.url, items, results, t0, concurrency=2, timeout=90))
                results_all.extend(results)
                batch += 1

        def chaos() -> None:
            cycle = itertools.cycle(["restart P", "freeze P", "restart D"])
            while not halt.wait(args.event_every):
                what, name = next(cycle).split()
                (soak.restart if what == "restart" else soak.freeze)(name, time.monotonic() - t0)

        threads = [threading.Thread(target=load, daemon=True), threading.Thread(target=chaos, daemon=True)]
        for th in threads:
            th.start()
        while (t := time.monotonic() - t0) < duration:
            soak.sample(t)
            time.sleep(args.interval)
        halt.set()
        for th in threads:
            th.join(timeout=120)
    finally:
        halt.set()
        soak.system.stop()
    rows = []
    for (name, metric), points in sorted(soak.series.items()):
        fit = _worst_fit(points)
        limit = LIMITS_PER_HOUR[metric]
        rows.append({"process": name, "series": metric, "samples": len(points), "last": points[-1][1],
                     "slope_per_hour": None if fit is None else round(fit[0], 1), "limit_per_hour": limit,
                     "growth_over_span": None if fit is None else round(fit[1], 1), "judged": fit is not None,
                     "bounded": fit is None or fit[0] <= limit or fit[1] <= NOISE_FLOOR[metric]})
    outcomes = dict(Counter(r.outcome for r in results_all))
    ok = all(r["bounded"] for r in rows) and outcomes.get("stuck", 0) == 0
    table = Table(title=f"kvferry soak: {args.minutes:g} min, {len(soak.events)} restarts/freezes, requests {outcomes}")
    for col in ("process", "series", "samples", "last", "slope / hour", "limit / hour", "growth in span",
                "floor", "bounded"):
        table.add_column(col)
    for r in rows:
        table.add_row(str(r["process"]), str(r["series"]), str(r["samples"]), f"{r['last']:.1f}",
                      str(r["slope_per_hour"]), f"{r['limit_per_hour']:g}", str(r["growth_over_span"]),
                      f"{NOISE_FLOOR[str(r['series'])]:g}",
                      ("yes" if r["judged"] else "(too short)") if r["bounded"] else "[red]NO[/red]")
    console.print(table)
    console.print(f"verdict: {'PASS' if ok else 'FAIL'}")
    report = {"minutes": args.minutes, "events": soak.events, "outcomes": outcomes, "series": rows,
              "verdict": "PASS" if ok else "FAIL",
              "samples": {f"{k[0]}.{k[1]}": v for k, v in soak.series.items()}}
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(report, f)
    if args.plot:
        _plot(soak, args.plot)
    return 0 if ok else 1


def _plot(soak: _Soak, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = ["fds", "threads", "rss_mb", "blocks_held", "table"]
    fig, axes = plt.subplots(1, len(metrics), figsize=(4 * len(metrics), 3.2))
    for ax, metric in zip(axes, metrics, strict=True):
        for name in ("P", "D", "proxy"):
            points = soak.series.get((name, metric))
            if points:
                ax.plot([p[0] / 60 for p in points], [p[1] for p in points], label=name, lw=1)
        for t, _ in soak.events:
            ax.axvline(t / 60, color="grey", lw=0.4, alpha=0.5)
        ax.set_title(metric)
        ax.set_xlabel("minutes")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=70)
    plt.close(fig)
