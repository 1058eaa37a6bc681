"""Start kvferry processes for tests and always stop them by pid."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until(predicate, timeout: float, what: str, interval: float = 0.02):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if result:
            return result
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=1.0).status_code == 200
    except httpx.HTTPError:
        return False


class Proc:
    def __init__(self, args: Sequence[str], url: str, env: dict[str, str] | None = None) -> None:
        self.args = list(args)
        self.url = url
        self.log_path = f"/tmp/kvferry-test-{os.getpid()}-{time.monotonic_ns()}.log"
        self.log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "kvferry", *self.args],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
        )

    @property
    def pid(self) -> int:
        return self.popen.pid

    def wait_healthy(self, timeout: float = 30.0) -> None:
        def ready() -> bool:
            if self.popen.poll() is not None:
                raise RuntimeError(f"process exited with {self.popen.returncode}:\n{self.output()}")
            return _healthy(self.url)

        wait_until(ready, timeout, f"{self.url}/health")

    def output(self) -> str:
        self.log.flush()
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")[-5000:]

    def stop(self) -> None:
        if self.popen.poll() is None:
            try:
                os.kill(self.pid, signal.SIGCONT)
                os.kill(self.pid, signal.SIGTERM)
                self.popen.wait(timeout=10)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
        if self.popen.poll() is None:
            os.kill(self.pid, signal.SIGKILL)
            self.popen.wait(timeout=10)
        self.log.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.log_path)


@contextmanager
def running(*procs: Proc, timeout: float = 30.0) -> Iterator[None]:
    try:
        for proc in procs:
            proc.wait_healthy(timeout)
        yield
    finally:
        for proc in procs:
            proc.stop()


def serve(port: int | None = None, *extra: str, env: dict[str, str] | None = None) -> Proc:
    port = port or free_port()
    return Proc(["serve", "--host", "127.0.0.1", "--port", str(port), *extra], f"http://127.0.0.1:{port}", env)


@contextmanager
def pd_system(p_tp: int = 1, d_tp: int = 1, p_args: tuple[str, ...] = (), d_args: tuple[str, ...] = (),
              env: dict[str, str] | None = None, proxy_args: tuple[str, ...] = ()) -> Iterator[tuple[Proc, Proc, Proc]]:
    """proxy + P + D on free loopback ports, all stopped by pid on exit."""
    common = ("--num-blocks", "1024", "--seed", "0")
    p = serve(None, "--role", "prefill", "--tp", str(p_tp), "--bootstrap-port", str(free_port()), *common, *p_args,
              env=env)
    d = serve(None, "--role", "decode", "--tp", str(d_tp), *common, *d_args, env=env)
    port = free_port()
    proxy = Proc(["proxy", "--prefill", p.url, "--decode", d.url, "--port", str(port), *proxy_args],
                 f"http://127.0.0.1:{port}")
    with running(p, d, proxy):
        yield p, d, proxy
