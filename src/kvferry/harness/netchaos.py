"""`kvferry chaos --network`: P in its own network namespace, loss, a partition and a bandwidth cap on the
veth pair under load. A scenario passes when nothing is stuck, no block leaks, every failure is typed and
every request after healing succeeds."""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time
from collections import Counter
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

from kvferry.harness.client import make_workload, new_results, run_workload
from kvferry.harness.network import VethLink, unavailable_reason
from kvferry.harness.sampler import blocks_held, parse_metrics, wait_drained
from kvferry.harness.system import PDSystem, PDSystemConfig, Role

SCENARIOS = ("loss", "partition", "cap")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--network", action="store_true",
                        help="network faults instead: loss, a partition, a bandwidth cap between P and D (root)")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS), help="network: which, comma-separated")
    parser.add_argument("--net-requests", type=int, default=60, help="network: requests per scenario")
    parser.add_argument("--loss", type=float, default=0.07, help="network: share of packets dropped each way")
    parser.add_argument("--partition-s", type=float, default=10.0, help="network: partition length (s)")
    parser.add_argument("--cap-mb", type=float, default=10.0, help="network: bandwidth cap (MB/s)")


def _system(link: VethLink, seed: int) -> PDSystem:
    """P inside the namespace, D on the host end of the pair (pulls from P's address only)."""
    return PDSystem(PDSystemConfig(
        seed=seed, num_blocks=2048, proxy_args=("--retries", "2", "--retry-unreachable", "6"), health_timeout=90.0,
        prefill=Role(args=("--abort-timeout", "5"), host=link.inner_ip, prefix=tuple(link.prefix)),
        decode=Role(args=("--prefill-allow", link.inner_ip, "--kv-load-deadline", "30"), host=link.outer_ip)))


def _kv_bytes(url: str) -> float:
    try:
        return parse_metrics(httpx.get(f"{url}/metrics", timeout=5).text).value("kvferry_kv_transfer_bytes_total")
    except (httpx.HTTPError, KeyError, ValueError):
        return 0.0


def _scenario(name: str, link: VethLink, system: PDSystem, args: argparse.Namespace, index: int) -> dict[str, Any]:
    items = make_workload(args.net_requests, args.seed + index, max_prompt=1500, max_tokens=(4, 8), long_share=0.2)
    results = new_results(items)
    halt = threading.Event()

    def faults() -> None:
        if name == "loss":
            link.loss(args.loss)
        elif name == "cap":
            link.cap(int(args.cap_mb * 1e6))
        elif name == "partition":  # in the middle of transfers: a few requests through, more in flight
            while not halt.is_set() and sum(r.outcome != "pending" for r in results) < min(8, len(results)):
                halt.wait(0.1)
            link.partition()
            halt.wait(args.partition_s)
            link.heal()

    bytes_before = _kv_bytes(system.decode.url)
    t0 = time.monotonic()
    fault_thread = threading.Thread(target=faults, name=f"net-{name}", daemon=True)
    fault_thread.start()
    try:
        asyncio.run(run_workload(system.proxy.url, items, results, t0, concurrency=4, timeout=90.0))
    finally:
        halt.set()
        fault_thread.join(timeout=args.partition_s + 30)
        link.heal()
    wall = time.monotonic() - t0
    kv_mb_s = (_kv_bytes(system.decode.url) - bytes_before) / wall / 1e6
    states = wait_drained([system.prefill.url, system.decode.url], 40)
    leaked = [None if s is None else blocks_held(s) for s in states]
    after_items = make_workload(10, args.seed + 100 + index, max_prompt=600, max_tokens=(4, 8))
    after = new_results(after_items)
    asyncio.run(run_workload(system.proxy.url, after_items, after, time.monotonic(), concurrency=2, timeout=60.0))
    outcomes = Counter(r.outcome for r in results)
    failed = [r for r in results if r.outcome in ("failed", "error")]
    untyped = [f"#{r.index} {r.http_status} {r.error_message}" for r in failed if not r.error_type]
    fault = {"loss": f"{args.loss:.0%} each way", "partition": f"{args.partition_s:.0f} s, then healed",
             "cap": f"{args.cap_mb:g} MB/s"}[name]
    typed = Counter(f"{r.error_type}:{r.error_code}" for r in failed if r.error_type)
    return {"scenario": name, "fault": fault, "requests": len(results), "ok": outcomes.get("ok", 0),
            "failed_typed": dict(typed), "untyped": untyped[:10], "stuck": outcomes.get("stuck", 0),
            "leaked_blocks": {"P": leaked[0], "D": leaked[1]},
            "after_heal_ok": f"{sum(r.outcome == 'ok' for r in after)}/{len(after)}",
            "kv_mb_per_s": round(kv_mb_s, 2), "wall_s": round(wall, 1),
            "pass": outcomes.get("stuck", 0) == 0 and not untyped and leaked == [0, 0]
            and all(r.outcome == "ok" for r in after)}


def run(args: argparse.Namespace) -> int:
    console = Console(width=160)
    reason = unavailable_reason()
    if reason is not None:
        console.print(f"kvferry chaos --network: cannot run here: {reason}")
        return 2
    names = [n.strip() for n in args.scenarios.split(",") if n.strip()]
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        console.print(f"kvferry chaos --network: unknown scenarios {unknown}; choose from {list(SCENARIOS)}")
        return 2
    link = VethLink.create()
    rows: list[dict[str, Any]] = []
    try:
        with _system(link, args.seed) as system:
            for index, name in enumerate(names):
                rows.append(_scenario(name, link, system, args, index))
                console.print(f"{name}: {'PASS' if rows[-1]['pass'] else 'FAIL'} {json.dumps(rows[-1])}")
    finally:
        link.close()
    ok = all(r["pass"] for r in rows)
    table = Table(title="kvferry chaos --network")
    for col in ("scenario", "fault", "requests", "ok", "failed (typed)", "untyped", "stuck", "leaked P/D",
                "after heal", "KV MB/s", "verdict"):
        table.add_column(col)
    for r in rows:
        table.add_row(r["scenario"], r["fault"], str(r["requests"]), str(r["ok"]),
                      ", ".join(f"{k} {v}" for k, v in r["failed_typed"].items()) or "-", str(len(r["untyped"])),
                      str(r["stuck"]), f"{r['leaked_blocks']['P']}/{r['leaked_blocks']['D']}", r["after_heal_ok"],
                      str(r["kv_mb_per_s"]), "PASS" if r["pass"] else "FAIL")
    console.print(table)
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump({"scenarios": rows, "verdict": "PASS" if ok else "FAIL"}, f, indent=2)
    return 0 if ok else 1
