"""`kvferry demo`: a P/D system on loopback runs a workload while faults are injected, then reports.

Exit code 0 only if no request was stuck, no KV block leaked, every successful output matched the
colocated reference and every failure was a clean HTTP 500 with a cause; 2 for bad options, 130 when
interrupted. Transfer figures come from P's histogram: D's also counts the wait for P's prefill."""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import httpx
from rich.console import Console
from rich.text import Text

from kvferry.connector.config import PDConfig
from kvferry.connector.faults import FaultSpec
from kvferry.engine.engine import EngineConfig
from kvferry.harness.client import run_workload
from kvferry.harness.demo_view import plain_line, render
from kvferry.harness.plot import write_plot
from kvferry.harness.processes import default_blas_threads
from kvferry.harness.progress import show_progress
from kvferry.harness.report import DemoRun, build_report, print_report
from kvferry.harness.sampler import SystemSampler, is_drained
from kvferry.harness.system import PDSystemConfig, Role
from kvferry.harness.trial import trial, workload

DEFAULT_FAULTS = "transport=0.06,corrupt=0.04,error_reply=0.04,seed=7"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2",
                   help="smollm2 (default: SmolLM2-135M-Instruct answers chat questions), tiny (random weights, "
                        "byte prompts of 1 to --max-prompt tokens), or a GGUF file / HF directory")
    p.add_argument("--requests", type=int, default=None, help="number of requests (default 6 for a real model, 50 for tiny)")
    p.add_argument("--concurrency", type=int, default=4, help="requests in flight (default 4)")
    p.add_argument("--faults", default=DEFAULT_FAULTS,
                   help=f"fault spec passed to P and D ('' for none; default {DEFAULT_FAULTS})")
    p.add_argument("--policy", choices=["fail", "recompute"], default="recompute",
                   help="kv_load_failure_policy of D (default recompute)")
    p.add_argument("--seed", type=int, default=0, help="model weights and workload seed")
    p.add_argument("--max-prompt", type=int, default=2000, help="longest prompt in tokens (default 2000)")
    p.add_argument("--max-tokens", type=int, nargs=2, default=None, metavar=("MIN", "MAX"),
                   help="output length range (default 16 32 for a real model, which stops at EOS; 8 32 for tiny)")
    p.add_argument("--num-blocks", type=int, default=EngineConfig.num_blocks, help="KV blocks per instance")
    p.add_argument("--p-tp", type=int, default=1, help="tensor-parallel ranks of P")
    p.add_argument("--d-tp", type=int, default=1, help="tensor-parallel ranks of D")
    p.add_argument("--abort-timeout", type=float, default=None,
                   help=f"P's --abort-timeout (s; default {PDConfig.abort_timeout_s:g} real model, 10 tiny)")
    p.add_argument("--kv-load-deadline", type=float, default=None,
                   help=f"D's --kv-load-deadline (s; default {PDConfig.kv_load_deadline_s:g} real, 20 tiny)")
    p.add_argument("--request-timeout", type=float, default=None,
                   help="a request with no complete answer by then counts as stuck (s; default 300 real model, 90 tiny)")
    p.add_argument("--reference-timeout", type=float, default=120.0,
                   help="how long to wait, after the run, for the colocated reference (s)")
    p.add_argument("--blas-threads", type=int, default=default_blas_threads(),
                   help="BLAS threads of every numpy process (default: $OPENBLAS_NUM_THREADS or 1)")
    p.add_argument("--json", dest="json_path", default=None, metavar="PATH", help="write the report as JSON")
    p.add_argument("--plot", dest="plot_path", default=None, metavar="PATH", help="write a PNG (matplotlib)")
    p.add_argument("--no-live", action="store_true", help="no live view (plain progress lines)")
    p.add_argument("--keep-logs", action="store_true", help="keep the instances' log files")


async def _drive(run: DemoRun, console: Console, live: bool) -> None:
    stop_sampling = asyncio.Event()
    async with httpx.AsyncClient(timeout=httpx.Timeout(10.0)) as client:
        for side in ("p", "d"):  # the baseline of every metric delta
            if not await run.sampler.poll(client, side):
                raise RuntimeError(f"{side.upper()} did not answer /metrics")
    sampling = asyncio.create_task(run.sampler.run(stop_sampling))
    try:
        await show_progress(console, live, lambda: render(run, console.width), lambda: plain_line(run),
                            _phases(run, stop_sampling, sampling))
    finally:
        stop_sampling.set()
        await asyncio.gather(sampling, return_exceptions=True)


async def _phases(run: DemoRun, stop_sampling: asyncio.Event, sampling: asyncio.Task[None]) -> None:
    """Workload, then drain (are all blocks back?), then the reference."""
    a = run.args
    run.phase = "running"
    begin = time.monotonic()
    await run_workload(run.system.proxy.url, run.items, run.results, run.started, a.concurrency, a.request_timeout)
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
    await sampling
    run.drain_end = run.sampler.now()

    run.phase = "checking outputs"
    deadline = time.monotonic() + a.reference_timeout
    while not run.ref.done() and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
    run.phase = "done"


def _print_answers(console: Console, run: DemoRun, limit: int = 4) -> None:
    shown = 0
    for item, result in zip(run.items, run.results, strict=True):
        if not item.question or result.outcome != "ok" or shown >= limit:
            continue
        shown += 1
        same = run.ref.results.get(item.index) == result.text
        mark = Text("= colocated" if same else "≠ colocated", "green" if same else "red")
        question = item.question if len(item.question) < 90 else "…" + item.question[-80:]
        console.print(Text.assemble(("Q ", "bold"), question))
        console.print(Text.assemble(("A ", "bold"), result.text.strip(), "  ", mark))


def run(args: argparse.Namespace) -> int:
    console = Console()
    try:
        FaultSpec.parse(args.faults)
    except ValueError as exc:
        console.print(f"kvferry demo: --faults: {exc}", style="red")
        return 2
    real = args.model != "tiny"
    if args.requests is None:
        args.requests = 6 if real else 50
    if args.max_tokens is None:
        args.max_tokens = (16, 32) if real else (8, 32)
    # A real model's prefill takes seconds on a loaded box: P must not give up on a pull that soon.
    for name, real_default, tiny_default in (("abort_timeout", PDConfig.abort_timeout_s, 10.0),
                                             ("kv_load_deadline", PDConfig.kv_load_deadline_s, 20.0),
                                             ("request_timeout", 300.0, 90.0)):
        if getattr(args, name) is None:
            setattr(args, name, real_default if real else tiny_default)
    if args.requests < 1 or args.concurrency < 1 or args.max_prompt < 1:
        console.print("kvferry demo: --requests, --concurrency and --max-prompt must be >= 1", style="red")
        return 2
    if not 1 <= args.max_tokens[0] <= args.max_tokens[1]:
        console.print("kvferry demo: --max-tokens MIN MAX needs 1 <= MIN <= MAX", style="red")
        return 2
    try:
        items = workload(args.model, args.requests, args.seed, tuple(args.max_tokens), max_prompt=args.max_prompt)
    except ValueError as exc:  # ModelLoadError too
        console.print(f"kvferry demo: --model: {exc}", style="red")
        return 2
    config = PDSystemConfig(seed=args.seed, policy=args.policy, faults=args.faults,
                            num_blocks=args.num_blocks, prefill=Role(args=("--tp", str(args.p_tp))),
                            decode=Role(args=("--tp", str(args.d_tp))), abort_timeout=args.abort_timeout,
                            kv_load_deadline=args.kv_load_deadline, blas_threads=args.blas_threads,
                            serve_args=("--model", args.model))
    live = not args.no_live and console.is_terminal
    started = time.monotonic()
    with trial(config, items, args.model, console, args.keep_logs) as t:
        try:
            system = t.system
            with console.status("starting prefill, decode and proxy on loopback ..."):
                system.start()
            console.print(f"P {system.prefill.url}   D {system.decode.url}   proxy {system.proxy.url}   "
                          f"{len(items)} requests, {args.concurrency} in flight", highlight=False)
            sampler = SystemSampler({"p": system.prefill.url, "d": system.decode.url}, time.monotonic())
            demo = DemoRun(args, system, items, t.results, sampler, t.ref, started=sampler.t0)
            asyncio.run(_drive(demo, console, live))
            report = build_report(demo)
            report["runtime_s"] = round(time.monotonic() - started, 2)
        except KeyboardInterrupt:
            console.print("kvferry demo: interrupted; stopping every process it started", style="yellow")
            return 130
        except (RuntimeError, TimeoutError) as exc:
            console.print(f"kvferry demo: {exc}", style="red")
            return 1
    print_report(console, report)
    _print_answers(console, demo)
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(report, f, indent=2)
        console.print(f"report written to {args.json_path}", style="dim")
    if args.plot_path:
        try:
            write_plot(report, args.plot_path)
            console.print(f"plot written to {args.plot_path}", style="dim")
        except ImportError:
            console.print("kvferry demo: --plot needs matplotlib (pip install 'kvferry[plot]'); no plot written",
                          style="yellow")
    return 0 if report["ok"] else 1

