"""`kvferry chaos`: 1P1D + proxy under faults of every kind plus kill -9 and SIGSTOP of P at random moments;
then a verdict on stuck requests, leaked blocks, output mismatches and, under `fail`, whether exactly the
predicted requests failed with the predicted cause (the fault function is pure in the transfer_id).
Requests in flight while P was killed or frozen may fail either way: they count as "hit by P chaos"."""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import random
import signal
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from kvferry.connector.faults import FAULT_NAMES, FaultSpec
from kvferry.harness.client import RequestResult, run_workload
from kvferry.harness.progress import show_progress
from kvferry.harness.sampler import blocks_held, wait_drained
from kvferry.harness.system import PDSystem, PDSystemConfig
from kvferry.harness.trial import against_reference, trial, workload

ABORT_TIMEOUT_S = 2.0  # P's "not ready" answer; D's receive timeout is this + 5 s
FREEZE_S = 2.5  # longer than D's heartbeat timeout


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=int, default=200, help="number of requests")
    parser.add_argument("--model", default="tiny", help="tiny, smollm2, or a GGUF file / HF directory (P, D and reference)")
    parser.add_argument("--fault-rate", type=float, default=0.2, help="share of transfers that get a fault")
    parser.add_argument("--policy", choices=["fail", "recompute"], default="recompute", help="D's kv_load_failure_policy")
    parser.add_argument("--seed", type=int, default=0, help="workload, fault and tiny-model seed")
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight")
    parser.add_argument("--max-prompt", type=int, default=600, help="longest prompt in tokens")
    parser.add_argument("--chaos-every", type=float, default=12.0, help="mean seconds between P kills/freezes")
    parser.add_argument("--no-process-chaos", action="store_true", help="only injected faults, no kill/stop")
    parser.add_argument("--json", dest="json_path", default=None, help="write the report as JSON")
    parser.add_argument("--no-live", action="store_true", help="no live view (plain progress lines)")
    from kvferry.harness import netchaos

    netchaos.add_arguments(parser)


def fault_spec(rate: float, seed: int) -> FaultSpec:
    """Every fault kind with the same probability, together firing for about `rate` of the transfers."""
    per_kind = 1.0 - (1.0 - rate) ** (1.0 / len(FAULT_NAMES)) if rate > 0 else 0.0
    return FaultSpec({name: round(per_kind, 6) for name in FAULT_NAMES}, seed)


@dataclass
class ChaosEvent:
    kind: str  # "kill" | "stop"
    start: float  # seconds since t0
    end: float = 0.0  # P usable again


@dataclass
class Verdict:
    outcomes: Counter[str] = field(default_factory=Counter)
    failed_by_cause: Counter[str] = field(default_factory=Counter)
    unexpected: list[str] = field(default_factory=list)
    mismatched: list[int] = field(default_factory=list)  # ok answers unlike the reference
    unverified: list[int] = field(default_factory=list)  # ok answers with no reference
    hit_by_chaos: int = 0


class _PChaos(threading.Thread):
    """Kills or freezes P at random moments until stopped, restarting it after a kill."""

    def __init__(self, system: PDSystem, mean_gap: float, seed: int, t0: float) -> None:
        super().__init__(name="kvferry-chaos", daemon=True)
        self.system, self.mean_gap, self.rng, self.t0 = system, mean_gap, random.Random(seed), t0
        self.events: list[ChaosEvent] = []
        self.halt = threading.Event()
        self.error: str | None = None

    def run(self) -> None:
        try:
            while not self.halt.wait(self.rng.uniform(0.5, 1.5) * self.mean_gap):
                self._one(self.rng.choice(["kill", "stop"]))
        except Exception as exc:  # reported in the verdict; the run itself goes on
            self.error = repr(exc)

    def _one(self, kind: str) -> None:
        p = self.system.prefill
        event = ChaosEvent(kind, time.monotonic() - self.t0)
        self.events.append(event)
        if kind == "kill":
            p.signal(signal.SIGKILL)
            self.system.restart("prefill")
        else:
            p.signal(signal.SIGSTOP)
            time.sleep(FREEZE_S)
            p.signal(signal.SIGCONT)
        event.end = time.monotonic() - self.t0


def _hit(result: RequestResult, events: list[ChaosEvent]) -> bool:
    sent, done = result.sent_at, result.finished_at
    return sent is not None and done is not None and any(sent <= e.end + 0.5 and e.start <= done
                                                         for e in events)


def judge(results: list[RequestResult], references: dict[int, str], spec: FaultSpec, policy: str,
          events: list[ChaosEvent]) -> Verdict:
    v = Verdict()
    v.mismatched, v.unverified = against_reference(results, references)
    for r in results:
        v.outcomes[r.outcome] += 1
        if r.outcome == "failed" and r.error_code:
            v.failed_by_cause[r.error_code] += 1
        hit = _hit(r, events)
        v.hit_by_chaos += hit
        if r.outcome == "stuck" or hit:
            continue  # stuck is counted on its own; chaos-hit requests may fail either way
        expected = spec.expected_cause(r.transfer_id) if (r.transfer_id and policy == "fail") else None
        if expected is None and r.outcome != "ok":
            v.unexpected.append(f"#{r.index} {r.outcome} {r.error_code}: {r.error_message}")
        elif expected is not None and (r.outcome != "failed" or r.error_code != expected):
            v.unexpected.append(f"#{r.index} predicted {expected}, got {r.outcome} {r.error_code}")
    return v


def run(args: argparse.Namespace) -> int:
    if args.network:
        from kvferry.harness import netchaos

        return netchaos.run(args)
    console = Console()
    spec = fault_spec(args.fault_rate, args.seed)
    # The proxy rides out P's restarts (unreachable: backoff up to ~2 s each); KV-load failures are
    # retried only under recompute, so that under fail every prediction is checked.
    retries = "6" if args.policy == "recompute" else "0"
    config = PDSystemConfig(seed=args.seed, policy=args.policy, faults=spec.to_spec(), num_blocks=4096,
                            abort_timeout=ABORT_TIMEOUT_S, kv_load_deadline=30.0,
                            proxy_args=("--retries", retries, "--retry-unreachable", "6"),
                            serve_args=("--model", args.model))
    try:
        items = workload(args.model, args.requests, args.seed, (4, 8), max_prompt=args.max_prompt, long_share=0.1)
    except ValueError as exc:  # ModelLoadError too
        console.print(f"kvferry chaos: --model: {exc}", style="red")
        return 2
    chaos: _PChaos | None = None
    started = time.monotonic()
    with trial(config, items, args.model, console) as t:
        system, results = t.system, t.results
        try:
            system.start()
            console.print(f"kvferry chaos: {args.requests} requests, policy {args.policy}, faults {spec.to_spec()}")
            t0 = time.monotonic()
            if not args.no_process_chaos:
                chaos = _PChaos(system, args.chaos_every, args.seed, t0)
                chaos.start()
            line = functools.partial(_progress, results, chaos, t0)
            live = not args.no_live and console.is_terminal
            asyncio.run(show_progress(console, live, lambda: Text(line()), line,
                                      run_workload(system.proxy.url, items, results, t0, args.concurrency, 120.0)))
            if chaos is not None:
                chaos.halt.set()
                chaos.join(timeout=60)
            states = wait_drained([system.prefill.url, system.decode.url], ABORT_TIMEOUT_S + 15)
            t.ref.wait(600)
        finally:
            if chaos is not None:
                chaos.halt.set()
    events = chaos.events if chaos is not None else []
    verdict = judge(results, t.ref.results, spec, args.policy, events)
    leaked = {side: None if s is None else blocks_held(s) for side, s in zip(("P", "D"), states, strict=True)}
    report: dict[str, Any] = {
        "requests": args.requests, "policy": args.policy, "faults": spec.to_spec(),
        "outcomes": dict(verdict.outcomes), "failed_by_cause": dict(verdict.failed_by_cause),
        "predicted_faults": dict(Counter(spec.fault_for(r.transfer_id) or "none" for r in results if r.transfer_id)),
        "p_chaos_events": [e.__dict__ for e in events], "hit_by_p_chaos": verdict.hit_by_chaos,
        "stuck": verdict.outcomes.get("stuck", 0), "leaked_blocks": leaked,
        "mismatched": len(verdict.mismatched), "unchecked_outputs": len(verdict.unverified),
        "errors": dict(Counter(f"{r.http_status} {r.error_message or ''}"[:120] for r in results if r.outcome == "error")),
        "unexpected": verdict.unexpected[:50], "num_unexpected": len(verdict.unexpected),
        "chaos_error": chaos.error if chaos is not None else None,
        "wall_s": round(time.monotonic() - started, 1)}
    ok = (report["stuck"] == 0 and all(v == 0 for v in leaked.values()) and not verdict.mismatched
          and not verdict.unverified and not verdict.unexpected and report["chaos_error"] is None)
    report["verdict"] = "PASS" if ok else "FAIL"
    _print(console, report)
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(report, f, indent=2)
    return 0 if ok else 1


def _progress(results: list[RequestResult], chaos: _PChaos | None, t0: float) -> str:
    """The live view: requests by outcome and the P kills/freezes so far."""
    outcomes = Counter(r.outcome for r in results)
    done = sum(n for k, n in outcomes.items() if k not in ("pending", "running"))
    events = chaos.events if chaos is not None else []
    last = f", last: {events[-1].kind} at {events[-1].start:.0f}s" if events else ""
    counts = " ".join(f"{k} {n}" for k, n in sorted(outcomes.items()))
    return (f"kvferry chaos: {time.monotonic() - t0:5.0f}s  {done}/{len(results)} done  "
            f"({counts})  P events {len(events)}{last}")


def _print(console: Console, report: dict[str, Any]) -> None:
    table = Table(title="kvferry chaos: report", show_header=False)
    for key in ("requests", "policy", "outcomes", "failed_by_cause", "predicted_faults", "hit_by_p_chaos",
                "stuck", "leaked_blocks", "mismatched", "num_unexpected", "wall_s", "verdict"):
        table.add_row(key, json.dumps(report[key]) if isinstance(report[key], dict) else str(report[key]))
    table.add_row("P kills / freezes", ", ".join(f"{e['kind']}@{e['start']:.1f}s" for e in report["p_chaos_events"]) or "-")
    console.print(table)
    for line in report["unexpected"][:10]:
        console.print(f"[red]unexpected[/red] {line}")
