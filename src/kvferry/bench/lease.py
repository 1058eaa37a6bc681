"""`kvferry bench lease`: how long P holds a prefill's blocks after the D pulling them dies or hangs (D's
lease runs out, P cancels the writes), then false `peer_dead`s and expired leases while CPU hogs starve
two live P/D systems, adaptive liveness beside fixed thresholds."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

import httpx

from kvferry.bench.failover import _state, _wait, pair, pull
from kvferry.bench.report import report
from kvferry.harness.client import percentile
from kvferry.harness.sampler import parse_metrics
from kvferry.harness.system import PDSystem, PDSystemConfig

ABORT_TIMEOUT_S = 30.0


def p_blocks_free(p_url: str) -> bool:
    state = _state(p_url)
    return bool(state) and state.get("blocks_free") == state.get("blocks_total")


def one(system: PDSystem, rng: random.Random, sig: signal.Signals) -> float:
    """Seconds from `sig` to D until P's pool is whole again; D is then restarted at its address."""
    pull(system)  # D is killed or frozen under this request: its answer is not what we time
    assert not p_blocks_free(system.prefill.url)
    # At any phase of D's heartbeats (every 0.25 s): the worst case is a fault just after one.
    time.sleep(rng.uniform(0.0, 0.5))
    assert not p_blocks_free(system.prefill.url)
    signalled = time.monotonic()
    system.decode.signal(sig)
    _wait(lambda: p_blocks_free(system.prefill.url), ABORT_TIMEOUT_S, "P freeing the blocks")
    elapsed = time.monotonic() - signalled
    system.restart("decode")  # SIGCONT first when D is frozen
    return elapsed


# ---- oversubscribed: slow is not dead -----------------------------------------------------------------
HOGS_PER_CORE = 3
VARIANTS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("adaptive (default)", ()), ("fixed (--heartbeat-ceiling 0)", ("--heartbeat-ceiling", "0")))
LOADED_FAULTS = "slow=500"  # P sits 0.5 s on every write, so D's heartbeats and P's lease matter
IN_FLIGHT = 4  # requests at a time per system: both engines busy, not just the hogs
PROMPT_TOKENS = (200, 1500)
# Stutter, the bursts a starved process lives through: P or D (of every system) frozen, then run 0.3-1 s.
STALL_S = (0.15, 0.45, 2.5)  # frozen for base + Exp(mean) s, at most `most`
RUN_S = (0.3, 1.0)


def _start_hogs(hogs: list[subprocess.Popen[bytes]]) -> None:
    """HOGS_PER_CORE spinning processes per usable core, appended to `hogs` as each starts."""
    for _ in range(HOGS_PER_CORE * len(os.sched_getaffinity(0))):
        hogs.append(subprocess.Popen([sys.executable, "-c", "while True: pass"], stdin=subprocess.DEVNULL))


def _stop_hogs(hogs: list[subprocess.Popen[bytes]]) -> None:
    for hog in hogs:  # by pid, each one we started
        hog.kill()
    for hog in hogs:
        hog.wait(timeout=10)
    hogs.clear()


def _stutter(systems: list[PDSystem], stop: threading.Event, stalls: list[float]) -> None:
    rng = random.Random(2)
    while not stop.is_set():
        role = rng.choice(("prefill", "decode"))
        pids = [getattr(s, role).pid for s in systems]
        base, mean, most = STALL_S
        stalls.append(min(most, base + rng.expovariate(1 / mean)))
        try:
            for pid in pids:
                os.kill(pid, signal.SIGSTOP)
            stop.wait(stalls[-1])
        finally:
            for pid in pids:
                os.kill(pid, signal.SIGCONT)
        stop.wait(rng.uniform(*RUN_S))


def _drive(system: PDSystem, prompts: list[list[int]], out: dict[str, Any]) -> None:
    """The requests through the proxy, IN_FLIGHT at a time; HTTP outcomes by status and error code."""
    url = f"{system.proxy.url}/v1/completions"
    codes: dict[str, int] = {}
    todo = list(prompts)
    lock = threading.Lock()
    started = time.monotonic()

    def worker(client: httpx.Client) -> None:
        while True:
            with lock:
                if not todo:
                    return
                ids = todo.pop()
            body = {"prompt": ids, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
            try:
                r = client.post(url, json=body)
                code = "ok" if r.status_code == 200 else str(r.json().get("error", {}).get("code", r.status_code))
            except (httpx.HTTPError, ValueError) as exc:
                code = type(exc).__name__
            with lock:
                codes[code] = codes.get(code, 0) + 1

    with httpx.Client(timeout=600) as client:
        threads = [threading.Thread(target=worker, args=(client,)) for _ in range(IN_FLIGHT)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    out["codes"], out["seconds"] = codes, time.monotonic() - started


def oversubscribed(n: int, stutter: bool = False, nice: int = 0,
                   variants: Sequence[tuple[str, Sequence[str]]] = VARIANTS,
                   env: dict[str, dict[str, str]] | None = None) -> list[dict[str, Any]]:
    """`n` requests through each variant's P/D system at once among CPU hogs (with `stutter`, P or D frozen
    in bursts): nothing is killed, so every `peer_dead` is false and every expired lease needless."""
    rng = random.Random(1)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(*PROMPT_TOKENS))] for _ in range(n)]
    systems: list[PDSystem] = []
    hogs: list[subprocess.Popen[bytes]] = []
    stop, stalls = threading.Event(), list[float]()
    stutterer = threading.Thread(target=_stutter, args=(systems, stop, stalls))
    try:
        for name, flags in variants:
            # `nice`: a pod with a small CPU share on a busy node; `env`: another build (PYTHONPATH).
            config = PDSystemConfig(policy="fail", faults=LOADED_FAULTS, num_blocks=1024, abort_timeout=30.0,
                                    kv_load_deadline=120.0, serve_args=tuple(flags), env=(env or {}).get(name, {}),
                                    prefix=("nice", "-n", str(nice)) if nice else (), health_timeout=120.0)
            systems.append(PDSystem(config))
            systems[-1].start()
        _start_hogs(hogs)
        load = f"{len(hogs)} hogs" + (f", servers at nice {nice}" if nice else "")
        if stutter:
            stutterer.start()
        results: list[dict[str, Any]] = [{} for _ in systems]
        drivers = [threading.Thread(target=_drive, args=(s, prompts, out))
                   for s, out in zip(systems, results, strict=True)]
        for t in drivers:
            t.start()
        for t in drivers:
            t.join()
        stop.set()
        if stutter:
            stutterer.join()
            load += f", {len(stalls)} freezes of P or D (max {max(stalls, default=0):.1f} s)"
        _stop_hogs(hogs)
        return [_row(name, load, s, out) for (name, _), s, out in zip(variants, systems, results, strict=True)]
    finally:
        stop.set()
        if stutterer.is_alive():
            stutterer.join()
        _stop_hogs(hogs)
        for s in systems:
            s.stop()


def _row(name: str, load: str, system: PDSystem, out: dict[str, Any]) -> dict[str, Any]:
    d = parse_metrics(httpx.get(f"{system.decode.url}/metrics", timeout=30).text)
    p = parse_metrics(httpx.get(f"{system.prefill.url}/metrics", timeout=30).text)
    codes: dict[str, int] = out.get("codes", {})
    rtt = "kvferry_heartbeat_rtt_seconds_bucket"
    acks = d.value("kvferry_heartbeat_rtt_seconds_count")
    other = ", ".join(f"{k} {v}" for k, v in sorted(codes.items()) if k not in ("ok", "peer_dead")) or "0"
    return {"load": load, "liveness": name, "requests": sum(codes.values()), "ok": codes.get("ok", 0),
            "false peer_dead": int(d.value("kvferry_kv_load_failures_total", cause="peer_dead")),
            "leases expired": int(p.value("kvferry_kv_leases_expired_total")), "other failures": other,
            "acks > 0.5 s": int(acks - d.value(rtt, le="0.5")),
            "acks > 1 s": int(acks - d.value(rtt, le="1.0")),
            "seconds": out.get("seconds")}


def run(json_path: str | None = None, quick: bool = False) -> list[dict[str, Any]]:
    reps = 2 if quick else 5
    rows: list[dict[str, Any]] = []
    rng = random.Random(0)
    with pair(ABORT_TIMEOUT_S) as system:
        for name, sig in (("kill -9", signal.SIGKILL), ("SIGSTOP", signal.SIGSTOP)):
            times = [one(system, rng, sig) for _ in range(reps)]
            rows.append({"D fault": name, "reps": reps, "p50_s": percentile(times, 50),
                         "max_s": max(times), "abort_timeout_s": ABORT_TIMEOUT_S})
    report("kvferry bench lease: D dies or hangs mid-pull → P's blocks free", rows)
    n = 12 if quick else 40
    loaded = oversubscribed(n) + oversubscribed(n, stutter=True)
    report("kvferry bench lease: starved but alive → no peer_dead, no expired lease", loaded)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(rows + loaded, f, indent=2)
    return rows + loaded
