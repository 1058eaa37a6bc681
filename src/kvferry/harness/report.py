"""`kvferry demo`: the state its live view and report share, and the report (a dict for --json, a table)."""

from __future__ import annotations

import argparse
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from kvferry.harness.client import RequestResult, WorkItem, percentile
from kvferry.harness.reference import ReferenceWorker
from kvferry.harness.sampler import SystemSampler, blocks_held
from kvferry.harness.system import PDSystem
from kvferry.harness.trial import against_reference

FAILURES = "kvferry_kv_load_failures_total"
BYTES = "kvferry_kv_transfer_bytes_total"
SECONDS = "kvferry_kv_transfer_seconds_sum"
TRANSFERS = "kvferry_kv_transfers_total"
RECOMPUTED = "kvferry_recomputed_tokens_total"
EXPIRED = "kvferry_kv_leases_expired_total"


@dataclass
class DemoRun:
    args: argparse.Namespace
    system: PDSystem
    items: list[WorkItem]
    results: list[RequestResult]
    sampler: SystemSampler
    ref: ReferenceWorker
    started: float = field(default_factory=time.monotonic)
    phase: str = "starting"
    workload_s: float = 0.0
    drain_s: float = 0.0
    workload_end: float = float("inf")  # sampler time at which the workload ended
    drain_end: float = float("inf")  # ... and at which the drain check ended

    def delta(self, side: str, name: str) -> float:
        """How much a counter of instance `side` ("p" or "d") grew since the baseline."""
        series = self.sampler.metrics[side]
        return series[-1][1].value(name) - series[0][1].value(name) if series else 0.0

    def failures_by_cause(self) -> dict[str, int]:
        if not (series := self.sampler.metrics["d"]):
            return {}
        before = series[0][1].by_label(FAILURES, "cause")
        out = {c: int(v - before.get(c, 0.0)) for c, v in series[-1][1].by_label(FAILURES, "cause").items()}
        return {c: n for c, n in sorted(out.items()) if n}

    def recent_gbps(self, window: float = 1.0) -> float:
        series = self.sampler.metrics["p"]
        if len(series) < 2:
            return 0.0
        t1, last = series[-1]
        t0, first = next(((t, m) for t, m in series if t >= t1 - window), series[-2])
        if t0 >= t1:
            t0, first = series[-2]
        return (last.value(BYTES) - first.value(BYTES)) / (t1 - t0) / 1e9 if t1 > t0 else 0.0

    def state(self, side: str) -> dict[str, Any] | None:
        latest = self.sampler.latest_state(side)
        return None if latest is None else latest[1]


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1000.0, 2)


def _leak(state: dict[str, Any] | None) -> int | None:
    return None if state is None else blocks_held(state)


def _timeline(run: DemoRun) -> dict[str, list[dict[str, Any]]]:
    """The sampled series, for --json and the plot (t = seconds since the workload started)."""
    sampler = run.sampler
    return {"p_metrics": [{"t": round(t, 3), "bytes": m.value(BYTES), "transfers": m.value(TRANSFERS),
                       "expired": m.value(EXPIRED)} for t, m in sampler.metrics["p"]],
            "d_metrics": [{"t": round(t, 3), "failures": m.by_label(FAILURES, "cause"),
                           "recomputed": m.value(RECOMPUTED)} for t, m in sampler.metrics["d"]],
            "p_state": [{"t": round(t, 3), "blocks_held": _leak(st), "pending_sends": st.get("pending_sends")}
                        for t, st in sampler.states["p"]],
            "d_state": [{"t": round(t, 3), "blocks_held": _leak(st)} for t, st in sampler.states["d"]]}


def _final_state(run: DemoRun, side: str) -> dict[str, Any] | None:
    """The instance's last /debug/state, if it was taken after the workload ended."""
    latest = run.sampler.latest_state(side)
    return latest[1] if latest is not None and latest[0] > run.workload_end else None


def build_report(run: DemoRun) -> dict[str, Any]:
    a = run.args
    results = run.results
    outcomes = Counter(r.outcome for r in results)
    ok = [r for r in results if r.outcome == "ok"]
    failed = [r for r in results if r.outcome == "failed"]
    mismatched, unverified = against_reference(results, run.ref.results)
    causes_d = run.failures_by_cause()
    ttfts = [t for r in ok if (t := r.ttft) is not None]
    latencies = [t for r in ok if (t := r.latency) is not None]
    p_seconds, p_bytes = run.delta("p", SECONDS), run.delta("p", BYTES)
    p_state, d_state = _final_state(run, "p"), _final_state(run, "d")
    leaked = {"prefill": _leak(p_state), "decode": _leak(d_state)}

    problems: list[str] = []
    if outcomes["stuck"]:
        problems.append(f"{outcomes['stuck']} request(s) stuck: no complete answer within {a.request_timeout:.0f}s")
    if outcomes["error"]:
        first = next(r for r in results if r.outcome == "error")
        problems.append(f"{outcomes['error']} request(s) ended with an unexpected error, e.g. "
                        f"HTTP {first.http_status}: {first.error_message}")
    if failed and a.policy == "recompute":
        problems.append(f"{len(failed)} HTTP 500 under --policy recompute (a failed load must be recomputed)")
    if no_cause := [r.index for r in failed if not r.error_code]:
        problems.append(f"{len(no_cause)} HTTP 500 without a cause code (requests {no_cause})")
    for side, state in (("prefill", p_state), ("decode", d_state)):
        if state is None:
            problems.append(f"{side} did not answer /debug/state after the run")
            continue
        if leaked[side]:
            problems.append(f"{leaked[side]} KV block(s) leaked on {side}")
        if state.get("pending_pulls") or state.get("pending_sends"):
            problems.append(f"{side} still has transfers pending: pulls {state.get('pending_pulls')}, "
                            f"sends {state.get('pending_sends')}")
        if state.get("requests_by_status"):
            problems.append(f"{side} still holds requests: {state['requests_by_status']}")
    if mismatched:
        problems.append(f"{len(mismatched)} output(s) differ from the colocated reference (requests {mismatched})")
    if unverified:
        problems.append(f"{len(unverified)} output(s) not checked: the reference did not finish"
                        + (f" ({run.ref.error})" if run.ref.error else ""))
    if dead := run.system.dead():
        problems.append(f"process(es) died: {', '.join(dead)}")

    return {
        "ok": not problems,
        "problems": problems,
        "config": {"requests": a.requests, "concurrency": a.concurrency, "faults": a.faults,
                   "policy": a.policy, "seed": a.seed, "max_prompt": a.max_prompt,
                   "max_tokens": list(a.max_tokens), "p_tp": a.p_tp, "d_tp": a.d_tp,
                   "blas_threads": a.blas_threads, "abort_timeout_s": a.abort_timeout,
                   "kv_load_deadline_s": a.kv_load_deadline, "request_timeout_s": a.request_timeout},
        "runtime_s": round(time.monotonic() - run.started, 2), "workload_s": round(run.workload_s, 2),
        "drain_s": round(run.drain_s, 2), "workload_end_t": round(run.workload_end, 3),
        "drain_end_t": round(run.drain_end, 3),
        "requests": {"total": len(results), "ok": len(ok), "failed": len(failed),
                     "recomputed": sum(causes_d.values()) if a.policy == "recompute" else 0,
                     "stuck": outcomes["stuck"], "error": outcomes["error"], "mismatched": len(mismatched),
                     "unverified": len(unverified), "checked": len(ok) - len(unverified)},
        "failed_by_cause": dict(sorted(Counter(r.error_code or "none" for r in failed).items())),
        "kv_load_failures_by_cause": causes_d,
        "recomputed_tokens": int(run.delta("d", RECOMPUTED)),
        "p_leases_expired": int(run.delta("p", EXPIRED)),
        "leaked_blocks": leaked,
        "final_state": {"prefill": p_state, "decode": d_state},
        "ttft_ms": {"p50": _ms(percentile(ttfts, 50)), "p99": _ms(percentile(ttfts, 99)),
                    "mean": _ms(sum(ttfts) / len(ttfts) if ttfts else None)},
        "latency_ms": {"p50": _ms(percentile(latencies, 50)), "p99": _ms(percentile(latencies, 99))},
        "transfer": {"count": int(run.delta("p", TRANSFERS)), "bytes": int(p_bytes),
                     "seconds": round(p_seconds, 4),
                     "gbps": round(p_bytes / p_seconds / 1e9, 4) if p_seconds > 0 else None,
                     "share_of_ttft": round(p_seconds / sum(ttfts), 4) if ttfts else None,
                     "d_pull_seconds": round(run.delta("d", SECONDS), 4)},
        "per_request": [r.as_dict() | {"matched": _matched(run, r)} for r in results],
        "timeline": _timeline(run),
    }


def _matched(run: DemoRun, r: RequestResult) -> bool | None:
    if r.outcome != "ok" or r.index not in run.ref.results:
        return None
    return run.ref.results[r.index] == r.text


def _fmt_ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f} ms" if value >= 10 else f"{value:.1f} ms"


def print_report(console: Console, report: dict[str, Any]) -> None:
    q, t = report["requests"], report["transfer"]
    table = Table(title="kvferry demo: report", title_style="bold cyan", show_header=False)
    table.add_column("what", style="bold")
    table.add_column("value")

    def row(label: str, value: str, good: bool | None = None) -> None:
        style = "" if good is None else "green" if good else "red"
        table.add_row(label, Text(value, style))

    row("requests", f"{q['total']}  (ok {q['ok']}, failed {q['failed']}, error {q['error']})")
    if report["failed_by_cause"]:
        row("failed (HTTP 500) by cause", ", ".join(f"{c} {n}" for c, n in report["failed_by_cause"].items()),
            all(c != "none" for c in report["failed_by_cause"]))
    causes = report["kv_load_failures_by_cause"]
    row("KV load failures (D) by cause", ", ".join(f"{c} {n}" for c, n in causes.items()) or "none")
    row("recomputed", f"{q['recomputed']} requests, {report['recomputed_tokens']} prompt tokens")
    row("P leases expired (freed by timeout)", str(report["p_leases_expired"]))
    row("stuck", str(q["stuck"]), q["stuck"] == 0)
    p_leak, d_leak = report["leaked_blocks"]["prefill"], report["leaked_blocks"]["decode"]
    row("leaked blocks", f"P {p_leak}, D {d_leak}", p_leak == 0 and d_leak == 0)
    unchecked = f" ({q['unverified']} unchecked)" if q["unverified"] else ""
    row("output mismatches vs colocated", f"{q['mismatched']} of {q['checked']} checked{unchecked}",
        q["mismatched"] == 0 and q["unverified"] == 0)
    ttft = report["ttft_ms"]
    row("TTFT p50 / p99", f"{_fmt_ms(ttft['p50'])} / {_fmt_ms(ttft['p99'])}")
    share, gbps = t["share_of_ttft"], t["gbps"]
    row("transfer share of TTFT",
        "-" if share is None else f"{share * 100:.1f} %  ({t['seconds']:.2f} s of transfer)")
    row("KV transferred", f"{t['count']} transfers, {t['bytes'] / 1e6:.1f} MB, "
        + ("-" if gbps is None else f"{gbps:.3f} GB/s"))
    row("wall time", f"{report['runtime_s']:.1f} s (workload {report['workload_s']:.1f} s, "
        f"drain {report['drain_s']:.1f} s)")
    row("verdict", "PASS" if report["ok"] else "FAIL", report["ok"])
    console.print(table)
    for problem in report["problems"]:
        console.print(Text(f"  - {problem}", "red"))


