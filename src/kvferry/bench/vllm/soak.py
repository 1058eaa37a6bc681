"""`kvferry bench vllm --soak MINUTES`: does a P ever stop answering while its /health answers? Real `vllm
serve` P/D with KVFerryConnector and fault injection on, behind `kvferry proxy` (no retries), in a closed
loop. Half the requests ask reference prompts checked against a colocated `vllm serve`; the rest ask new
prompts so P's prefix cache does not answer every prefill. A watchdog (soak_watch.py) records stalls."""

from __future__ import annotations

import json
import os
import re
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from kvferry.bench.report import report
from kvferry.bench.vllm.client import answer_text, complete, prompt
from kvferry.bench.vllm.servers import (
    colocated_answers,
    export_model,
    kvferry_kv,
    kvferry_proxy,
    vllm_exe,
    vllm_server,
)
from kvferry.bench.vllm.soak_watch import STALL_S, Watchdog, metrics_of, write_sitecustomize
from kvferry.harness.client import percentile
from kvferry.harness.processes import free_port
from kvferry.harness.sampler import Periodic

SOAK_CONCURRENCY = 16
REFERENCE_PROMPTS = 24
WORDS, MAX_TOKENS = 120, 16
ANSWER_TIMEOUT_S = 900.0  # longer than the stall looked for (300 s), so the client sees it end
LOAD_EVERY_S = 10.0
DEFAULT_FAULTS = "transport=0.03,error_reply=0.03,drop_reply=0.03,p_not_ready=0.03,seed=39"
# D's log: one line per request vLLM fails for its KV load (the consumer's own line can come twice for one)
_FAILED = re.compile(r'kvferry_kv_load_failed \{.*"cause": "(\w+)"')
_ERROR = re.compile(r'"(?:message|detail|error)":\s*"([^"]{0,80})')


def _error_kind(r: httpx.Response) -> str:
    """The client's outcome for a non-200 answer: the code and the start of the error's message."""
    m = _ERROR.search(r.text)
    words = re.sub(r"cmpl-\S+|[0-9a-f]{8,}|\d+(\.\d+)?", "N", m[1]) if m else r.text[:40]
    return f"HTTP {r.status_code}: {words}"


def _drive(url: str, model: str, refs: list[str], refs_prompts: list[str], minutes: float,
           dog: Watchdog) -> list[tuple[str, float]]:
    """SOAK_CONCURRENCY clients in a closed loop until `minutes` are over: (outcome, seconds) each."""
    ends = time.monotonic() + minutes * 60
    counter = iter(range(10**9))
    lock = threading.Lock()
    results: list[tuple[str, float]] = []

    def client() -> None:
        while time.monotonic() < ends:
            with lock:
                n = next(counter)
            checked = n % 2 == 0
            text = refs_prompts[(n // 2) % len(refs)] if checked else prompt(10_000 + n, WORDS)
            dog.begin(n, text)
            began = time.monotonic()
            try:
                r = complete(url, model, text, MAX_TOKENS, ANSWER_TIMEOUT_S)
                if r.status_code != 200:
                    outcome = _error_kind(r)
                elif not checked:
                    outcome = "ok (unchecked)" if answer_text(r) else "EMPTY TEXT"
                else:
                    outcome = "ok, same text" if answer_text(r) == refs[(n // 2) % len(refs)] else "DIFFERENT TEXT"
            except httpx.HTTPError as exc:
                outcome = f"client {type(exc).__name__}"
            seconds = time.monotonic() - began
            dog.end(n, outcome, seconds)
            with lock:
                results.append((outcome, seconds))

    with ThreadPoolExecutor(SOAK_CONCURRENCY) as pool:
        for future in [pool.submit(client) for _ in range(SOAK_CONCURRENCY)]:
            future.result()
    return results


def summary_row(minutes: float, faults: str, results: list[tuple[str, float]], d_causes: Counter[str],
                stalls: int, load: str) -> dict[str, Any]:
    outcomes = Counter(outcome for outcome, _ in results)
    ok = sum(v for k, v in outcomes.items() if k.startswith("ok"))
    seconds = [s for _, s in results]
    failed = {k: v for k, v in outcomes.items() if not k.startswith("ok")}
    return {"minutes": minutes, "concurrency": SOAK_CONCURRENCY, "faults": faults, "requests": len(results),
            "ok": ok, "same text (checked)": f"{outcomes['ok, same text']} of "
                                             f"{outcomes['ok, same text'] + outcomes['DIFFERENT TEXT']}",
            "failed by outcome": "; ".join(f"{k} {v}" for k, v in sorted(failed.items())) or "0",
            "D's KV-load failures by cause": ", ".join(f"{k} {v}" for k, v in sorted(d_causes.items())) or "0",
            "p50 s": percentile(seconds, 50), "p99 s": percentile(seconds, 99),
            "max s": max(seconds, default=None), f"stalls > {STALL_S:.0f} s": stalls,
            "> 300 s": sum(s > 300 for s in seconds), "load avg min/mean/max": load}


def run(json_path: str | None, minutes: float, quick: bool = False) -> list[dict[str, Any]]:
    vllm = vllm_exe("kvferry bench vllm --soak")
    faults = os.environ.get("KVFERRY_BENCH_FAULTS", DEFAULT_FAULTS)
    n_refs = 4 if quick else REFERENCE_PROMPTS
    refs_prompts = [prompt(seed, WORDS) for seed in range(n_refs)]
    evidence = Path(tempfile.mkdtemp(prefix="kvferry-bench-vllm-soak-evidence-"))
    with tempfile.TemporaryDirectory(prefix="kvferry-bench-vllm-soak-") as tmp:
        site = write_sitecustomize(Path(tmp) / "site")
        env = {"PYTHONPATH": os.pathsep.join(filter(None, (str(site), os.environ.get("PYTHONPATH"))))}
        model = export_model("smollm2", tmp)
        colocated = vllm_server("colocated", vllm, model, env=env)
        refs = colocated_answers(colocated, model, refs_prompts, MAX_TOKENS, ANSWER_TIMEOUT_S)
        p_kv = kvferry_kv("kv_producer", faults=faults, engine_id="bench-soak-p", bootstrap_port=free_port())
        p = vllm_server("prefill", vllm, model, "--kv-transfer-config", json.dumps(p_kv), env=env)
        d = vllm_server("decode", vllm, model, "--kv-transfer-config",
                        json.dumps(kvferry_kv("kv_consumer", faults=faults)), env=env)
        proxy = kvferry_proxy("proxy", p, d)
        dog = Watchdog(p, d, proxy, model, evidence)
        try:
            for group in (p, d, proxy):
                group.wait_healthy()
            complete(proxy.url, model, "warm-up " + refs_prompts[0], 2, ANSWER_TIMEOUT_S)
            d_log_start = d.log.stat().st_size
            load = Periodic(lambda: os.getloadavg()[0], LOAD_EVERY_S, "soak-load")
            dog.start()
            try:
                results = _drive(proxy.url, model, refs, refs_prompts, minutes, dog)
            finally:
                dog.stop()
                s = load.stop()
                load_text = f"{min(s):.1f} / {sum(s) / len(s):.1f} / {max(s):.1f}"
            d_causes = Counter(_FAILED.findall(d.log.read_text(errors="replace")[d_log_start:]))
            after = {s.name: metrics_of(s) for s in (p, d)}
            dead = [f"{s.name} exited {s.popen.returncode}" for s in (p, d, proxy) if not s.alive()]
        finally:
            for group in (proxy, d, p):
                group.stop()
    rows = [summary_row(minutes, faults, results, d_causes, len(dog.stalls), load_text)]
    rows += [{"minutes": f"stall #{s.number}", "requests": f"seen at {s.seen_after_s:.0f}s",
              "ok": s.outcome, "max s": s.latency_s, "failed by outcome": s.summary, "faults": s.evidence}
             for s in dog.outcomes()]
    report(f"kvferry bench vllm --soak {minutes:g}: real vllm serve P/D (KVFerryConnector, faults on), kvferry proxy "
           f"without retries, {SOAK_CONCURRENCY} clients; load average of the whole box (other work included)",
           rows, json_path)
    lingering = {name: {k: v for k, v in m.items() if k.startswith(("vllm:num_requests", "vllm:kv_cache"))}
                 for name, m in after.items()}
    print(f"after the load: {lingering}; exited: {dead or 'none'}; "
          f"past {STALL_S:.0f}s with a server unhealthy: {dog.unhealthy or 'none'}; evidence dir: {evidence}")
    return rows
