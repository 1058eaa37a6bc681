"""Start kvferry processes for tests and always stop them by pid."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from kvferry.harness.processes import ManagedProcess, free_port, wait_all_healthy

__all__ = ["Proc", "free_port", "pd_system", "running", "serve", "wait_until"]


def can_schedule_realtime() -> bool:
    """Whether this machine lets a process of ours run a thread SCHED_RR (CAP_SYS_NICE, real-time time in
    its cgroup): root in a container may lack it."""
    code = "import os; os.sched_setscheduler(0, os.SCHED_RR, os.sched_param(1))"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60).returncode == 0


def wait_until(predicate, timeout: float, what: str, interval: float = 0.02):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if result:
            return result
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


class Proc(ManagedProcess):
    """A `python -m kvferry ...` child of a test (stopped by pid, see `running`)."""

    def __init__(self, args: Sequence[str], url: str, env: dict[str, str] | None = None) -> None:
        super().__init__(str(args[0]), args, url, env)

    def wait_healthy(self, timeout: float = 30.0) -> None:
        wait_all_healthy([self], timeout)


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
              env: dict[str, str] | None = None, proxy_args: tuple[str, ...] = (),
              timeout: float = 30.0) -> Iterator[tuple[Proc, Proc, Proc]]:
    """proxy + P + D on free loopback ports, all stopped by pid on exit."""
    common = ("--num-blocks", "1024", "--seed", "0")
    p = serve(None, "--role", "prefill", "--tp", str(p_tp), "--bootstrap-port", str(free_port()), *common, *p_args,
              env=env)
    d = serve(None, "--role", "decode", "--tp", str(d_tp), *common, *d_args, env=env)
    port = free_port()
    proxy = Proc(["proxy", "--prefill", p.url, "--decode", d.url, "--port", str(port), *proxy_args],
                 f"http://127.0.0.1:{port}")
    with running(p, d, proxy, timeout=timeout):
        yield p, d, proxy
