"""`kvferry bench load_faults`: faults under load in the shape of NVIDIA Dynamo's published table (kill -9
of a P, of a D, each back after 5 s), plus a rolling restart, on proxy + 2 P + 2 D.

An answer is ok only when its stream ends with [DONE] and its text is the fault-free one. `recovery_s`:
from the fault until the first request sent after it is answered ok."""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

from kvferry.bench.report import report
from kvferry.harness.client import CompletionStream, percentile
from kvferry.harness.system import PDSystem, PDSystemConfig, Role

PROMPTS = [f"load fault {i}: " + "kv " * (10 + 7 * i) for i in range(8)]
MAX_TOKENS = 24
RESTART_AFTER_S = 5.0


@dataclass
class Result:
    sent_at: float
    ok: bool
    latency_s: float
    why: str = ""


def _system() -> PDSystem:
    return PDSystem(PDSystemConfig(num_blocks=1024, serve_args=("--heartbeat-timeout", "3.0"), prefill=Role(count=2),
                                   decode=Role(count=2), proxy_args=("--health-interval", "0.5"),
                                   health_timeout=90.0))


def _one(http: httpx.Client, url: str, prompt: str) -> tuple[bool, str, str]:
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
    stream = CompletionStream(time.monotonic)
    try:
        with http.stream("POST", f"{url}/v1/completions", json=body) as r:
            if r.status_code != 200:
                return False, "", f"HTTP {r.status_code}: {r.read()[:200]!r}"
            stream.read(r.iter_lines())
    except httpx.HTTPError as exc:
        return False, "", repr(exc)
    if stream.error_event is not None:
        return False, "", str(stream.error_event["error"])[:200]
    return stream.done, stream.text, "" if stream.done else "no [DONE]"


def _run_row(name: str, clients: int, per_client: int, fault: Callable[[PDSystem], None]) -> dict[str, Any]:
    with _system() as system:
        url = system.proxy.url
        with httpx.Client(timeout=120) as http:
            reference = {p: _one(http, url, p)[1] for p in PROMPTS}
        results: list[Result] = []
        lock = threading.Lock()

        def client(k: int) -> None:
            with httpx.Client(timeout=120) as http:
                for j in range(per_client):
                    prompt = PROMPTS[(k + j) % len(PROMPTS)]
                    sent = time.monotonic()
                    ok, text, why = _one(http, url, prompt)
                    ok = ok and text == reference[prompt]
                    with lock:
                        results.append(Result(sent, ok, time.monotonic() - sent, why or ("" if ok else "wrong text")))

        threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
        for t in threads:
            t.start()
        total = clients * per_client
        while len(results) < total // 5:  # the fault lands once a fifth of the requests are answered
            time.sleep(0.01)
        fault_at = time.monotonic()
        fault(system)
        for t in threads:
            t.join()
    after = sorted((r for r in results if r.sent_at >= fault_at and r.ok), key=lambda r: r.sent_at + r.latency_s)
    recovery = after[0].sent_at + after[0].latency_s - fault_at if after else None
    latencies = [r.latency_s for r in results]
    failures = [r.why for r in results if not r.ok]
    return {"fault": name, "ok": sum(r.ok for r in results), "total": len(results),
            "recovery_s": None if recovery is None else round(recovery, 3),
            "p50_s": round(percentile(latencies, 50) or 0.0, 3), "worst_s": round(max(latencies), 3),
            "first_failure": failures[0] if failures else ""}


def _kill_and_restart(name: str) -> Callable[[PDSystem], None]:
    def fault(system: PDSystem) -> None:
        system.procs[name].signal(signal.SIGKILL)
        system.procs[name].popen.wait(10)
        time.sleep(RESTART_AFTER_S)
        system.restart(name)

    return fault


def _rolling(system: PDSystem) -> None:
    for name in [*system.names("prefill"), *system.names("decode")]:
        proc = system.procs[name]
        proc.signal(signal.SIGTERM)  # drains: what it holds is served, then exit 0
        code = proc.popen.wait(60)
        if code != 0:
            raise RuntimeError(f"{proc.name} exited {code} after SIGTERM: {proc.output_tail()}")
        system.restart(name)


def _serving_d(system: PDSystem) -> str | None:
    for name in system.names("decode"):
        try:
            state = httpx.get(f"{system.procs[name].url}/debug/state", timeout=5).json()
        except httpx.HTTPError:
            continue
        if state.get("requests_by_status", {}).get("RUNNING"):
            return name
    return None


def _migration_row(kills: int) -> dict[str, Any]:
    """`kills` long streams, each with its D killed mid-stream; ok = the whole text is the fault-free one."""
    ok, resumed_s = 0, []
    with _system() as system:
        url = system.proxy.url
        for k in range(kills):
            sampling = {"temperature": 0} if k % 2 == 0 else {"temperature": 0.8, "seed": k}
            body = {"prompt": PROMPTS[k % len(PROMPTS)], "max_tokens": 1500, "ignore_eos": True, **sampling}
            expected = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]
            texts, done, killed_at, victim = [], False, 0.0, None
            with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=120) as r:
                for line in r.iter_lines():
                    if line == "data: [DONE]":
                        done = True
                    elif line.startswith("data: "):
                        event = json.loads(line[6:])
                        texts.append(event["choices"][0]["text"] if "choices" in event else "<error>")
                        if victim is None and len(texts) >= 20 and (victim := _serving_d(system)) is not None:
                            system.procs[victim].signal(signal.SIGKILL)
                            killed_at = time.monotonic()
            ok += done and victim is not None and "".join(texts) == expected
            if victim is not None:
                resumed_s.append(time.monotonic() - killed_at)
                system.procs[victim].popen.wait(10)
                system.restart(victim)
    return {"fault": f"D kill -9 mid-stream (1,500 tokens), {kills} times", "ok": ok, "total": kills,
            "recovery_s": None, "p50_s": round(percentile(resumed_s, 50) or 0.0, 3),
            "worst_s": round(max(resumed_s, default=0.0), 3), "first_failure": ""}


def run(json_path: str | None = None, quick: bool = False) -> list[dict[str, Any]]:
    clients, per_client = (4, 25) if quick else (8, 100)
    rows = [
        _run_row("P kill -9, back after 5 s", clients, per_client, _kill_and_restart("prefill0")),
        _run_row("D kill -9, back after 5 s", clients, per_client, _kill_and_restart("decode0")),
        _run_row("rolling restart (SIGTERM, all 4)", clients, per_client, _rolling),
    ]
    if not quick:  # p50_s / worst_s: from the kill to the stream's end
        rows.append(_migration_row(10))
    report(f"Faults under load: {clients} clients x {per_client} streamed requests, proxy + 2 P + 2 D "
           "(Dynamo: P killed 798/800 ok, recovery 42.3 s; its only D killed 200/800)", rows, json_path)
    return rows
