"""`kvferry bench vllm --hogs N`: is a busy P ever called dead? Real `vllm serve` P/D with KVFerryConnector at
vLLM's CPU defaults behind `kvferry proxy` (no retries), alone, then beside N spinning processes. Nothing
is killed, so every `peer_dead` in D's log is false. `KVFERRY_BENCH_CEILING=S` sets D's
`heartbeat_ceiling_s`."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from kvferry.bench.report import report
from kvferry.bench.vllm.client import answer_text, complete, prompt
from kvferry.bench.vllm.runqueue import RunQueueWatch
from kvferry.bench.vllm.servers import (
    ServerGroup,
    colocated_answers,
    export_model,
    kvferry_kv,
    kvferry_proxy,
    vllm_exe,
    vllm_server,
)
from kvferry.connector.decode.dealer import ALIVE_BUT_SILENT
from kvferry.harness.client import percentile
from kvferry.harness.processes import free_port

# vLLM's CPU defaults: drop the lane's one OpenMP thread and in-process worker (bench/vllm/servers.py).
DEFAULTS_ENV = ("OMP_NUM_THREADS", "VLLM_ENABLE_V1_MULTIPROCESSING")
REQUESTS, IN_FLIGHT, WORDS, MAX_TOKENS = 16, 2, 200, 16
ANSWER_TIMEOUT_S = 600.0
_FAILED = re.compile(r"KV load for \S+ failed \((\w+)\)(?:: (.*))?")  # D's log: (cause, reason)
_SECONDS = re.compile(r"(unreachable|silent) for ([\d.]+)s")


def _dead_kinds(reasons: list[str]) -> str:
    """What each false `peer_dead` was: which bound ran out, after how long (the message's own words)."""
    kinds = [f"{m[1]} {m[2]}s" if (m := _SECONDS.search(message)) else message[:60] for message in reasons]
    return ", ".join(sorted(kinds)) or "-"


def _deadline_kinds(reasons: list[str]) -> str:
    """`deadline`s split: P alive but its control loop silent past the ceiling, or D's whole-load deadline."""
    kinds = Counter("P alive, silent" if ALIVE_BUT_SILENT in m else "load deadline" for m in reasons)
    return ", ".join(f"{k} {v}" for k, v in sorted(kinds.items())) or "-"


def _phase(name: str, url: str, model: str, prompts: list[str], refs: list[str], p: ServerGroup,
           d: ServerGroup) -> dict[str, Any]:
    """Every prompt through the proxy, IN_FLIGHT at a time: outcomes, latency, D's failure causes, and how
    long P's and D's libzmq I/O threads waited for a CPU (`runqueue.py`)."""
    log_before = d.log.read_text(errors="replace")
    watch = RunQueueWatch({"P": p.popen.pid, "D": d.popen.pid})

    def ask(i: int) -> tuple[str, float]:
        began = time.monotonic()
        try:
            r = complete(url, model, prompts[i], MAX_TOKENS, ANSWER_TIMEOUT_S)
        except httpx.HTTPError as exc:
            return f"client {type(exc).__name__}", time.monotonic() - began
        if r.status_code != 200:
            return f"HTTP {r.status_code}", time.monotonic() - began
        return ("right" if answer_text(r) == refs[i] else "WRONG TEXT"), time.monotonic() - began

    with ThreadPoolExecutor(IN_FLIGHT) as pool:
        results = list(pool.map(ask, range(len(prompts))))
    starvation = watch.stop()
    log = d.log.read_text(errors="replace")[len(log_before):]
    failures = _FAILED.findall(log)
    causes = Counter(cause for cause, _ in failures)
    reasons = {c: [r for cause, r in failures if cause == c] for c in ("peer_dead", "deadline")}
    outcomes = Counter(outcome for outcome, _ in results)
    seconds = [s for _, s in results]
    return {"load": name, "requests": len(prompts), "right text": outcomes.pop("right", 0),
            "false peer_dead": causes.pop("peer_dead", 0), "which": _dead_kinds(reasons["peer_dead"]),
            "deadlines": _deadline_kinds(reasons["deadline"]),
            "other KV-load failures": ", ".join(f"{k} {v}" for k, v in sorted(causes.items())) or "0",
            "other outcomes": ", ".join(f"{k} {v}" for k, v in sorted(outcomes.items())) or "-",
            "latency p50 s": percentile(seconds, 50), "latency p99 s": percentile(seconds, 99), **starvation}


def _hogs(n: int) -> list[subprocess.Popen[bytes]]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True) for _ in range(n)]


def run(json_path: str | None, hogs: int, quick: bool = False) -> list[dict[str, Any]]:
    vllm = vllm_exe("kvferry bench vllm --hogs")
    n = 8 if quick else REQUESTS
    prompts = [prompt(seed, WORDS) for seed in range(n)]
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kvferry-bench-vllm-hogs-") as tmp:
        model = export_model("smollm2", tmp)
        refs = colocated_answers(vllm_server("colocated", vllm, model, unset=DEFAULTS_ENV), model, prompts,
                                 MAX_TOKENS, ANSWER_TIMEOUT_S)
        p_kv = kvferry_kv("kv_producer", engine_id="bench-hogs-p", bootstrap_port=free_port())
        p = vllm_server("prefill", vllm, model, "--kv-transfer-config", json.dumps(p_kv), unset=DEFAULTS_ENV)
        ceiling = os.environ.get("KVFERRY_BENCH_CEILING")
        extra: dict[str, Any] = {"heartbeat_ceiling_s": float(ceiling)} if ceiling else {}
        d_kv = kvferry_kv("kv_consumer", **extra)
        d = vllm_server("decode", vllm, model, "--kv-transfer-config", json.dumps(d_kv), unset=DEFAULTS_ENV)
        proxy = kvferry_proxy("proxy", p, d)
        spinning: list[subprocess.Popen[bytes]] = []
        try:
            for group in (p, d, proxy):
                group.wait_healthy()
            complete(proxy.url, model, "warm-up " + prompts[0], 2, ANSWER_TIMEOUT_S)
            rows.append(_phase("alone", proxy.url, model, prompts, refs, p, d))
            spinning = _hogs(hogs)
            rows.append(_phase(f"{hogs} CPU hogs beside it", proxy.url, model, prompts, refs, p, d))
        finally:
            for hog in spinning:
                hog.send_signal(signal.SIGKILL)
                hog.wait()
            for group in (proxy, d, p):
                group.stop()
    liveness = f"heartbeat_ceiling_s {ceiling}" if ceiling else "kvferry's default liveness"
    report(f"kvferry bench vllm --hogs {hogs}: real vllm serve P/D at vLLM's CPU defaults, {liveness}, "
           "no retries; nothing killed, so every peer_dead is false", rows, json_path)
    return rows
