"""`kvferry demo`: a P/D system on loopback runs a workload while faults are injected, then reports.

It starts one prefill instance (P), one decode instance (D) and the proxy on free loopback ports, sends
`--requests` streaming completions of mixed prompt lengths (1 to 2,000 byte tokens, 4 in flight), shows a
live view, and ends with a report (and optionally --json / --plot). The colocated reference
(`TinyLlama.generate_greedy`) is computed in a side process at nice 10 while the system runs, with the
same BLAS thread count as P and D. Exit code 0 only if no request was stuck, no KV block leaked on P or
D, every successful output matched the reference and every failure was a clean HTTP 500 with a cause
(which only `--policy fail` may produce); 2 for bad options, 130 when interrupted.

Where the figures come from:
- requests ok / failed / stuck: the client (stuck = no complete answer within `--request-timeout`);
- recomputed: deltas over the run of D's `kvferry_kv_load_failures_total` (under `recompute` every
  failed load is recomputed on D) and `kvferry_recomputed_tokens_total` (streams carry no per-request
  figure);
- TTFT: time to the response headers (an instance answers only once the first token exists);
- transfer time, bytes, GB/s: P's `kvferry_kv_transfer_seconds` / `_bytes_total` (the data-plane write;
  D's histogram also counts the wait for P's prefill, since the proxy sends to P and D at once);
  transfer share of TTFT = sum of P's transfer seconds / sum of TTFT of the successful requests;
- leaked blocks: after the run, /debug/state is polled until blocks_free == blocks_total, no transfer
  is pending and no request is held on both sides (deadline: `--abort-timeout` + 10 s, so leases that
  P frees by timeout are waited for); what is still held at the deadline is the leak.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import httpx
from rich.console import Console, Group
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from kvferry.connector.faults import FaultSpec
from kvferry.demo_plot import write_plot
from kvferry.reference import ReferenceWorker
from kvferry.workload import (
    PDSystem,
    PDSystemConfig,
    RequestResult,
    SystemSampler,
    WorkItem,
    default_blas_threads,
    is_drained,
    make_workload,
    new_results,
    percentile,
    run_workload,
)

DEFAULT_FAULTS = "transport=0.06,corrupt=0.04,error_reply=0.04,seed=7"
_FAILURES = "kvferry_kv_load_failures_total"
_BYTES = "kvferry_kv_transfer_bytes_total"
_SECONDS = "kvferry_kv_transfer_seconds_sum"
_TRANSFERS = "kvferry_kv_transfers_total"
_RECOMPUTED = "kvferry_recomputed_tokens_total"
_EXPIRED = "kvferry_kv_leases_expired_total"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=int, default=50, help="number of requests (default 50)")
    parser.add_argument("--concurrency", type=int, default=4, help="requests in flight (default 4)")
    parser.add_argument(
        "--faults",
        default=DEFAULT_FAULTS,
        help=f"fault spec passed to P and D ('' for none; default {DEFAULT_FAULTS})",
    )
    parser.add_argument(
        "--policy",
        choices=["fail", "recompute"],
        default="recompute",
        help="kv_load_failure_policy of D (default recompute)",
    )
    parser.add_argument("--seed", type=int, default=0, help="model weights and workload seed")
    parser.add_argument(
        "--max-prompt", type=int, default=2000, help="longest prompt in tokens (default 2000)"
    )
    parser.add_argument(
        "--max-tokens",
        type=int,
        nargs=2,
        default=(8, 32),
        metavar=("MIN", "MAX"),
        help="output length range (default 8 32)",
    )
    parser.add_argument("--num-blocks", type=int, default=2048, help="KV blocks per instance")
    parser.add_argument("--p-tp", type=int, default=1, help="tensor-parallel ranks of P")
    parser.add_argument("--d-tp", type=int, default=1, help="tensor-parallel ranks of D")
    parser.add_argument("--abort-timeout", type=float, default=10.0, help="P's --abort-timeout (s)")
    parser.add_argument("--kv-load-deadline", type=float, default=20.0, help="D's --kv-load-deadline (s)")
    parser.add_argument(
        "--request-timeout",
        type=float,
        default=90.0,
        help="a request with no complete answer by then counts as stuck (s)",
    )
    parser.add_argument(
        "--reference-timeout",
        type=float,
        default=120.0,
        help="how long to wait, after the run, for the colocated reference (s)",
    )
    parser.add_argument(
        "--blas-threads",
        type=int,
        default=default_blas_threads(),
        help="BLAS threads of every numpy process (default: $OPENBLAS_NUM_THREADS or 1)",
    )
    parser.add_argument(
        "--json", dest="json_path", default=None, metavar="PATH", help="write the report as JSON"
    )
    parser.add_argument(
        "--plot", dest="plot_path", default=None, metavar="PATH", help="write a PNG (matplotlib)"
    )
    parser.add_argument("--no-live", action="store_true", help="no live view (plain progress lines)")
    parser.add_argument("--keep-logs", action="store_true", help="keep the instances' log files")


@dataclass
class _Run:
    """Everything the live view and the report read."""

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
        series = self.sampler.metrics["d"]
        if not series:
            return {}
        before = series[0][1].by_label(_FAILURES, "cause")
        out = {c: int(v - before.get(c, 0.0)) for c, v in series[-1][1].by_label(_FAILURES, "cause").items()}
        return {c: n for c, n in sorted(out.items()) if n}

    def recent_gbps(self, window: float = 1.0) -> float:
        series = self.sampler.metrics["p"]
        if len(series) < 2:
            return 0.0
        t1, last = series[-1]
        t0, first = next(((t, m) for t, m in series if t >= t1 - window), series[-2])
        if t0 >= t1:
            t0, first = series[-2]
        return (last.value(_BYTES) - first.value(_BYTES)) / (t1 - t0) / 1e9 if t1 > t0 else 0.0

    def state(self, side: str) -> dict[str, Any] | None:
        latest = self.sampler.latest_state(side)
        return None if latest is None else latest[1]


# ---- live view --------------------------------------------------------------------------------------------
def _status_counts(state: dict[str, Any] | None) -> dict[str, str]:
    if state is None:
        return {"waiting": "-", "remote": "-", "running": "-"}
    by = state.get("requests_by_status") or {}
    return {
        "waiting": str(int(by.get("WAITING", 0)) + int(by.get("PREEMPTED", 0))),
        "remote": str(int(by.get("WAITING_FOR_REMOTE_KVS", 0))),
        "running": str(int(by.get("RUNNING", 0))),
    }


def _held(state: dict[str, Any] | None) -> str:
    return (
        "-" if state is None else f"{state['blocks_total'] - state['blocks_free']} / {state['blocks_total']}"
    )


def _field(state: dict[str, Any] | None, key: str) -> str:
    return "-" if state is None else str(state.get(key, "-"))


def _render(run: _Run, width: int = 120) -> Group:
    a = run.args
    outcomes = Counter(r.outcome for r in run.results)
    done = sum(outcomes[k] for k in ("ok", "failed", "stuck", "error"))
    p_state, d_state = run.state("p"), run.state("d")
    p, d = _status_counts(p_state), _status_counts(d_state)

    header = Text.assemble(
        ("kvferry demo", "bold cyan"),
        "  prefill + decode + proxy on loopback   ",
        (run.phase, "bold"),
        f"  {time.monotonic() - run.started:5.1f}s",
    )
    setup = Text.assemble(
        ("policy ", "dim"), (a.policy, "yellow"), ("   faults ", "dim"), (a.faults or "none", "magenta")
    )
    bar = Table.grid(padding=(0, 1))
    bar.add_row(
        ProgressBar(total=len(run.results), completed=done, width=48), f"{done}/{len(run.results)} answered"
    )

    requests = Table(title="requests", title_style="bold", header_style="dim")
    requests.add_column("state", no_wrap=True)
    for col in ("client", "P", "D"):
        requests.add_column(col, justify="right", no_wrap=True)
    requests.add_row("queued", str(outcomes["pending"]), "", "")
    requests.add_row("waiting", "", p["waiting"], d["waiting"])
    requests.add_row("wait remote KV", "", "", d["remote"])
    requests.add_row("running", str(outcomes["running"]), p["running"], d["running"])
    requests.add_row(Text("ok", "green"), str(outcomes["ok"]), "", "")
    requests.add_row(Text("failed (500)", "red"), str(outcomes["failed"]), "", "")
    requests.add_row(Text("stuck / error", "red"), f"{outcomes['stuck']} / {outcomes['error']}", "", "")

    transfer = Table(title="KV transfer", title_style="bold", show_header=False)
    transfer.add_column("what", no_wrap=True)
    transfer.add_column("value", justify="right", no_wrap=True)
    transfer.add_row("transfers", f"{run.delta('p', _TRANSFERS):.0f}")
    transfer.add_row("moved", f"{run.delta('p', _BYTES) / 1e6:.1f} MB")
    transfer.add_row("now (1 s)", f"{run.recent_gbps():.3f} GB/s")
    transfer.add_row("recomputed", f"{run.delta('d', _RECOMPUTED):.0f} tok")
    causes = run.failures_by_cause()
    transfer.add_row(Text("load failures", "red" if causes else ""), str(sum(causes.values())))
    for cause, n in causes.items():
        transfer.add_row(Text(f"  {cause}", "red"), str(n))

    blocks = Table(title="KV blocks", title_style="bold", header_style="dim")
    blocks.add_column("", no_wrap=True)
    blocks.add_column("P", justify="right", no_wrap=True)
    blocks.add_column("D", justify="right", no_wrap=True)
    blocks.add_row("held", _held(p_state), _held(d_state))
    blocks.add_row("leases", _field(p_state, "pending_sends"), "")
    blocks.add_row("pulls", "", _field(d_state, "pending_pulls"))

    tables = Table.grid(padding=(0, 2))
    if width >= 112:
        tables.add_row(requests, transfer, blocks)
    else:
        tables.add_row(requests, transfer)
        tables.add_row(blocks, "")
    lines: list[Any] = [header, setup, bar, tables]
    if run.phase == "checking outputs":
        lines.append(Text(f"colocated reference outputs: {len(run.ref.results)}/{run.ref.expected}", "dim"))
    return Group(*lines)


def _plain_line(run: _Run) -> str:
    o = Counter(r.outcome for r in run.results)
    p_state, d_state = run.state("p"), run.state("d")
    return (
        f"[{time.monotonic() - run.started:5.1f}s] {run.phase}: ok {o['ok']}  failed {o['failed']}  "
        f"in flight {o['running']}  queued {o['pending']}  stuck {o['stuck']}  error {o['error']}  "
        f"transfers {run.delta('p', _TRANSFERS):.0f}  load failures {sum(run.failures_by_cause().values())}  "
        f"blocks held P {_held(p_state)} D {_held(d_state)}"
    )


async def _drive(run: _Run, console: Console, live: bool) -> None:
    """Workload, then drain (are all blocks back?), then the reference. The sampler runs until the drain
    ends; the view until the end."""
    from rich.live import Live

    a = run.args
    stop, stop_sampling = asyncio.Event(), asyncio.Event()

    async def show() -> None:
        live_view = Live(_render(run, console.width), console=console, auto_refresh=False) if live else None
        last_line = time.monotonic()
        if live_view is not None:
            live_view.start()
        try:
            while not stop.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), 0.25)
                if live_view is not None:
                    live_view.update(_render(run, console.width), refresh=True)
                elif time.monotonic() - last_line >= 5.0 or stop.is_set():
                    last_line = time.monotonic()
                    console.print(_plain_line(run), highlight=False)
        finally:
            if live_view is not None:
                live_view.stop()

    assert run.system.proxy is not None
    async with httpx.AsyncClient(timeout=httpx.Timeout(10.0)) as client:
        for side in ("p", "d"):  # the baseline of every metric delta
            if not await run.sampler.poll_metrics(client, side):
                raise RuntimeError(f"{side.upper()} did not answer /metrics")
    background = [asyncio.create_task(run.sampler.run(stop_sampling)), asyncio.create_task(show())]
    try:
        run.phase = "running"
        begin = time.monotonic()
        await run_workload(
            run.system.proxy.url, run.items, run.results, run.started, a.concurrency, a.request_timeout
        )
        run.workload_s = time.monotonic() - begin

        run.phase = "draining"  # every block must come back on both sides
        end = run.workload_end = run.sampler.now()
        begin = time.monotonic()
        while time.monotonic() < begin + a.abort_timeout + 10.0:
            latest = [run.sampler.latest_state(side) for side in ("p", "d")]
            if all(x is not None and x[0] > end and is_drained(x[1]) for x in latest):
                break
            await asyncio.sleep(0.1)
        run.drain_s = time.monotonic() - begin
        stop_sampling.set()
        await background[0]
        run.drain_end = run.sampler.now()

        run.phase = "checking outputs"
        deadline = time.monotonic() + a.reference_timeout
        while not run.ref.done() and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        run.phase = "done"
    finally:
        stop_sampling.set()
        stop.set()
        await asyncio.gather(*background, return_exceptions=True)


# ---- report -----------------------------------------------------------------------------------------------
def _ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1000.0, 2)


def _leak(state: dict[str, Any] | None) -> int | None:
    return None if state is None else int(state["blocks_total"]) - int(state["blocks_free"])


def _timeline(run: _Run) -> dict[str, list[dict[str, Any]]]:
    """The sampled series, for --json and the plot (t = seconds since the workload started)."""
    sampler = run.sampler
    return {
        "p_metrics": [
            {
                "t": round(t, 3),
                "bytes": m.value(_BYTES),
                "transfers": m.value(_TRANSFERS),
                "expired": m.value(_EXPIRED),
            }
            for t, m in sampler.metrics["p"]
        ],
        "d_metrics": [
            {"t": round(t, 3), "failures": m.by_label(_FAILURES, "cause"), "recomputed": m.value(_RECOMPUTED)}
            for t, m in sampler.metrics["d"]
        ],
        "p_state": [
            {"t": round(t, 3), "blocks_held": _leak(st), "pending_sends": st.get("pending_sends")}
            for t, st in sampler.states["p"]
        ],
        "d_state": [{"t": round(t, 3), "blocks_held": _leak(st)} for t, st in sampler.states["d"]],
    }


def _final_state(run: _Run, side: str) -> dict[str, Any] | None:
    """The instance's last /debug/state, if it was taken after the workload ended."""
    latest = run.sampler.latest_state(side)
    return latest[1] if latest is not None and latest[0] > run.workload_end else None


def build_report(run: _Run) -> dict[str, Any]:
    a = run.args
    results = run.results
    outcomes = Counter(r.outcome for r in results)
    ok = [r for r in results if r.outcome == "ok"]
    failed = [r for r in results if r.outcome == "failed"]
    mismatched = [r.index for r in ok if r.index in run.ref.results and run.ref.results[r.index] != r.text]
    unverified = [r.index for r in ok if r.index not in run.ref.results]
    causes_d = run.failures_by_cause()
    ttfts = [t for r in ok if (t := r.ttft) is not None]
    latencies = [t for r in ok if (t := r.latency) is not None]
    p_seconds, p_bytes = run.delta("p", _SECONDS), run.delta("p", _BYTES)
    p_state, d_state = _final_state(run, "p"), _final_state(run, "d")
    leaked = {"prefill": _leak(p_state), "decode": _leak(d_state)}

    problems: list[str] = []
    if outcomes["stuck"]:
        problems.append(
            f"{outcomes['stuck']} request(s) stuck: no complete answer within {a.request_timeout:.0f}s"
        )
    if outcomes["error"]:
        first = next(r for r in results if r.outcome == "error")
        problems.append(
            f"{outcomes['error']} request(s) ended with an unexpected error, e.g. "
            f"HTTP {first.http_status}: {first.error_message}"
        )
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
            problems.append(
                f"{side} still has transfers pending: pulls {state.get('pending_pulls')}, "
                f"sends {state.get('pending_sends')}"
            )
        if state.get("requests_by_status"):
            problems.append(f"{side} still holds requests: {state['requests_by_status']}")
    if mismatched:
        problems.append(
            f"{len(mismatched)} output(s) differ from the colocated reference (requests {mismatched})"
        )
    if unverified:
        problems.append(
            f"{len(unverified)} output(s) not checked: the reference did not finish"
            + (f" ({run.ref.error})" if run.ref.error else "")
        )
    if dead := run.system.dead():
        problems.append(f"process(es) died: {', '.join(dead)}")

    return {
        "ok": not problems,
        "problems": problems,
        "config": {
            "requests": a.requests,
            "concurrency": a.concurrency,
            "faults": a.faults,
            "policy": a.policy,
            "seed": a.seed,
            "max_prompt": a.max_prompt,
            "max_tokens": list(a.max_tokens),
            "p_tp": a.p_tp,
            "d_tp": a.d_tp,
            "blas_threads": a.blas_threads,
            "abort_timeout_s": a.abort_timeout,
            "kv_load_deadline_s": a.kv_load_deadline,
            "request_timeout_s": a.request_timeout,
        },
        "runtime_s": round(time.monotonic() - run.started, 2),
        "workload_s": round(run.workload_s, 2),
        "drain_s": round(run.drain_s, 2),
        "workload_end_t": round(run.workload_end, 3),
        "drain_end_t": round(run.drain_end, 3),
        "requests": {
            "total": len(results),
            "ok": len(ok),
            "failed": len(failed),
            "recomputed": sum(causes_d.values()) if a.policy == "recompute" else 0,
            "stuck": outcomes["stuck"],
            "error": outcomes["error"],
            "mismatched": len(mismatched),
            "unverified": len(unverified),
            "checked": len(ok) - len(unverified),
        },
        "failed_by_cause": dict(sorted(Counter(r.error_code or "none" for r in failed).items())),
        "kv_load_failures_by_cause": causes_d,
        "recomputed_tokens": int(run.delta("d", _RECOMPUTED)),
        "p_leases_expired": int(run.delta("p", _EXPIRED)),
        "leaked_blocks": leaked,
        "final_state": {"prefill": p_state, "decode": d_state},
        "ttft_ms": {
            "p50": _ms(percentile(ttfts, 50)),
            "p99": _ms(percentile(ttfts, 99)),
            "mean": _ms(sum(ttfts) / len(ttfts) if ttfts else None),
        },
        "latency_ms": {"p50": _ms(percentile(latencies, 50)), "p99": _ms(percentile(latencies, 99))},
        "transfer": {
            "count": int(run.delta("p", _TRANSFERS)),
            "bytes": int(p_bytes),
            "seconds": round(p_seconds, 4),
            "gbps": round(p_bytes / p_seconds / 1e9, 4) if p_seconds > 0 else None,
            "share_of_ttft": round(p_seconds / sum(ttfts), 4) if ttfts else None,
            "d_pull_seconds": round(run.delta("d", _SECONDS), 4),
        },
        "per_request": [r.as_dict() | {"matched": _matched(run, r)} for r in results],
        "timeline": _timeline(run),
    }


def _matched(run: _Run, r: RequestResult) -> bool | None:
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
        row(
            "failed (HTTP 500) by cause",
            ", ".join(f"{c} {n}" for c, n in report["failed_by_cause"].items()),
            all(c != "none" for c in report["failed_by_cause"]),
        )
    causes = report["kv_load_failures_by_cause"]
    row("KV load failures (D) by cause", ", ".join(f"{c} {n}" for c, n in causes.items()) or "none")
    row("recomputed", f"{q['recomputed']} requests, {report['recomputed_tokens']} prompt tokens")
    row("P leases expired (freed by timeout)", str(report["p_leases_expired"]))
    row("stuck", str(q["stuck"]), q["stuck"] == 0)
    leaked = report["leaked_blocks"]
    leak_ok = leaked["prefill"] == 0 and leaked["decode"] == 0
    row("leaked blocks", f"P {leaked['prefill']}, D {leaked['decode']}", leak_ok)
    row(
        "output mismatches vs colocated",
        f"{q['mismatched']} of {q['checked']} checked"
        + (f" ({q['unverified']} unchecked)" if q["unverified"] else ""),
        q["mismatched"] == 0 and q["unverified"] == 0,
    )
    ttft = report["ttft_ms"]
    row("TTFT p50 / p99", f"{_fmt_ms(ttft['p50'])} / {_fmt_ms(ttft['p99'])}")
    share = t["share_of_ttft"]
    row(
        "transfer share of TTFT",
        "-" if share is None else f"{share * 100:.1f} %  ({t['seconds']:.2f} s of transfer)",
    )
    gbps = t["gbps"]
    row(
        "KV transferred",
        f"{t['count']} transfers, {t['bytes'] / 1e6:.1f} MB, "
        + ("-" if gbps is None else f"{gbps:.3f} GB/s"),
    )
    row(
        "wall time",
        f"{report['runtime_s']:.1f} s (workload {report['workload_s']:.1f} s, "
        f"drain {report['drain_s']:.1f} s)",
    )
    row("verdict", "PASS" if report["ok"] else "FAIL", report["ok"])
    console.print(table)
    for problem in report["problems"]:
        console.print(Text(f"  - {problem}", "red"))


# ---- entry point ------------------------------------------------------------------------------------------
_Handler = Callable[[int, FrameType | None], Any] | int | None


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def _on_signals(handler: _Handler) -> dict[int, _Handler]:
    """Install `handler` for SIGINT and SIGTERM (main thread only); return the previous handlers."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}


def _restore_signals(previous: dict[int, _Handler]) -> None:
    for sig, handler in previous.items():
        signal.signal(sig, handler)


def run(args: argparse.Namespace) -> int:
    console = Console()
    try:
        FaultSpec.parse(args.faults)
    except ValueError as exc:
        console.print(f"kvferry demo: --faults: {exc}", style="red")
        return 2
    if args.requests < 1 or args.concurrency < 1 or args.max_prompt < 1:
        console.print("kvferry demo: --requests, --concurrency and --max-prompt must be >= 1", style="red")
        return 2
    if not 1 <= args.max_tokens[0] <= args.max_tokens[1]:
        console.print("kvferry demo: --max-tokens MIN MAX needs 1 <= MIN <= MAX", style="red")
        return 2
    items = make_workload(args.requests, args.seed, args.max_prompt, tuple(args.max_tokens))
    config = PDSystemConfig(
        seed=args.seed,
        policy=args.policy,
        faults=args.faults,
        num_blocks=args.num_blocks,
        p_tp=args.p_tp,
        d_tp=args.d_tp,
        abort_timeout=args.abort_timeout,
        kv_load_deadline=args.kv_load_deadline,
        blas_threads=args.blas_threads,
    )
    system = PDSystem(config)
    live = not args.no_live and console.is_terminal
    started = time.monotonic()
    handlers = _on_signals(_interrupt)  # SIGTERM too, so that `finally` runs and stops every process
    ref: ReferenceWorker | None = None
    try:
        ref = ReferenceWorker(args.seed, args.blas_threads)
        ref.submit(items)
        with console.status("starting prefill, decode and proxy on loopback ..."):
            system.start()
        assert system.prefill is not None and system.decode is not None and system.proxy is not None
        console.print(
            f"P {system.prefill.url}   D {system.decode.url}   proxy {system.proxy.url}   "
            f"{len(items)} requests, {args.concurrency} in flight",
            highlight=False,
        )
        sampler = SystemSampler({"p": system.prefill.url, "d": system.decode.url}, time.monotonic())
        demo = _Run(args, system, items, new_results(items), sampler, ref, started=sampler.t0)
        asyncio.run(_drive(demo, console, live))
        report = build_report(demo)
        report["runtime_s"] = round(time.monotonic() - started, 2)
    except KeyboardInterrupt:
        console.print("kvferry demo: interrupted; stopping every process it started", style="yellow")
        return 130
    except (RuntimeError, TimeoutError) as exc:
        console.print(f"kvferry demo: {exc}", style="red")
        return 1
    finally:
        _on_signals(signal.SIG_IGN)  # a second Ctrl-C must not cut the clean-up short
        try:
            system.stop(keep_logs=args.keep_logs)
            if ref is not None:
                ref.stop()
        finally:
            _restore_signals(handlers)
        if args.keep_logs:
            for proc in system.procs:
                console.print(f"log of {proc.name}: {proc.log_path}", style="dim")
    print_report(console, report)
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(report, f, indent=2)
        console.print(f"report written to {args.json_path}", style="dim")
    if args.plot_path:
        try:
            write_plot(report, args.plot_path)
            console.print(f"plot written to {args.plot_path}", style="dim")
        except ImportError:
            console.print(
                "kvferry demo: --plot needs matplotlib (pip install 'kvferry[plot]'); no plot written",
                style="yellow",
            )
    return 0 if report["ok"] else 1


def main(argv: list[str] | None = None) -> int:
    """`python -m kvferry.demo` until the CLI wires `kvferry demo`."""
    parser = argparse.ArgumentParser(prog="kvferry demo", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
