"""Start, watch and stop child processes: kvferry's own (`ManagedProcess`) and, through `Supervised`, the
benches' vLLM servers and the tests' routers. Every child is stopped (SIGTERM, a bounded wait, SIGKILL)
by pid, or by process group for servers that start processes of their own."""

from __future__ import annotations

import contextlib
import os
import random
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from typing import IO

import httpx

LOOPBACK = "127.0.0.1"
BLAS_ENV_VARS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")


# Below Linux's ephemeral range, so no bind(0) or outgoing connection takes a port meanwhile; never handed out
# twice, since a child that has not bound its port yet leaves it free for the next pick.
_PORT_RANGE = (20000, 32000)
_port_rng = random.Random()
_handed_out: set[int] = set()


def free_port() -> int:
    """A loopback port that is free now and not handed out before, for a process about to be started with it."""
    if len(_handed_out) > (_PORT_RANGE[1] - _PORT_RANGE[0]) // 2:
        _handed_out.clear()  # a long session: the oldest children are long gone
    for _ in range(200):
        port = _port_rng.randrange(*_PORT_RANGE)
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind((LOOPBACK, port))
            except OSError:
                continue
            _handed_out.add(port)
            return port
    with socket.socket() as s:  # the range is crowded: let the kernel choose
        s.bind((LOOPBACK, 0))
        return int(s.getsockname()[1])


def blas_env(threads: int) -> dict[str, str]:
    """The environment that pins every BLAS library to `threads` threads."""
    return {name: str(threads) for name in BLAS_ENV_VARS}


def default_blas_threads() -> int:
    """OPENBLAS_NUM_THREADS if the user set it, else 1 (several numpy processes share few cores)."""
    try:
        return max(1, int(os.environ.get("OPENBLAS_NUM_THREADS", "1")))
    except ValueError:
        return 1


# Every system the harness starts authenticates its control and data planes, as a deployment would.
HARNESS_SECRET = os.environ.get("KVFERRY_SECRET") or secrets.token_hex(16)


class Supervised:
    """One child process, its output in a temporary log file. `own_group`: the child leads a new session and
    signals go to its whole group (its own children would outlive a signal to the leader alone)."""

    stop_signal = signal.SIGTERM

    def __init__(self, name: str, argv: Sequence[str], env: Mapping[str, str] | None = None, *,
                 own_group: bool = False, log_prefix: str = "kvferry-") -> None:
        self.name = name
        self.own_group = own_group
        self._log: IO[bytes] = tempfile.NamedTemporaryFile(  # noqa: SIM115 (closed in stop())
            prefix=f"{log_prefix}{name}-", suffix=".log", delete=False)
        self.log_path = self._log.name
        self.popen = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=self._log,
                                      stderr=subprocess.STDOUT, env=None if env is None else dict(env),
                                      start_new_session=own_group)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def exited(self) -> int | None:
        return self.popen.poll()

    def signal(self, sig: signal.Signals) -> None:
        """`sig` to the child (its whole group when it leads one); nothing if it is gone."""
        with contextlib.suppress(ProcessLookupError):
            (os.killpg if self.own_group else os.kill)(self.pid, sig)

    def output_tail(self, chars: int = 4000) -> str:
        with contextlib.suppress(OSError):
            self._log.flush()
            with open(self.log_path, "rb") as f:
                return f.read().decode(errors="replace")[-chars:]
        return ""

    def terminate(self) -> None:
        """`stop_signal`, after a SIGCONT in case it was stopped; a group even after its leader exited."""
        if self.own_group or self.popen.poll() is None:
            self.signal(signal.SIGCONT)
            self.signal(self.stop_signal)

    def stop(self, timeout: float = 10.0, keep_log: bool = False) -> None:
        """Terminate, wait up to `timeout` s, then SIGKILL (and a group's leftovers); remove the log."""
        if self.own_group or self.popen.poll() is None:
            self.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.popen.wait(timeout=timeout)
        if self.popen.poll() is None:
            self.signal(signal.SIGKILL)
            self.popen.wait(timeout=10)
        if self.own_group:
            self.signal(signal.SIGKILL)  # what the leader left behind
        self._log.close()
        if not keep_log:
            with contextlib.suppress(OSError):
                os.unlink(self.log_path)


class ManagedProcess(Supervised):
    """One `python -m kvferry ...` child."""

    # `kvferry serve` drains on SIGTERM; the harness stops its children at once, as Ctrl-C does.
    stop_signal = signal.SIGINT

    def __init__(self, name: str, args: Sequence[str], url: str, env: dict[str, str] | None = None,
                 prefix: Sequence[str] = ()) -> None:
        self.args = list(args)
        self.prefix = list(prefix)  # e.g. `ip netns exec NS` (which keeps the pid)
        self.url = url
        super().__init__(name, [*self.prefix, sys.executable, "-m", "kvferry", *self.args],
                         {**os.environ, "KVFERRY_SECRET": HARNESS_SECRET, **(env or {})})

    def healthy(self) -> bool:
        """/health answers 200, from this very process (not some other server on the same port)."""
        try:
            response = httpx.get(f"{self.url}/health", timeout=1.0)
            if response.status_code != 200:
                return False
            body = response.json()
        except (httpx.HTTPError, ValueError):
            return False
        return not isinstance(body, dict) or body.get("pid", self.pid) == self.pid


def wait_all_healthy(procs: Sequence[ManagedProcess], timeout: float) -> None:
    """Wait until every process answers /health; raise with the process's log if one exits or times out."""
    deadline = time.monotonic() + timeout
    pending = list(procs)
    while pending:
        for proc in list(pending):
            code = proc.exited()
            if code is not None:
                raise RuntimeError(f"{proc.name} exited with {code} before it was healthy:\n"
                                   f"{proc.output_tail()}")
            if proc.healthy():
                pending.remove(proc)
        if not pending:
            return
        if time.monotonic() > deadline:
            names = ", ".join(p.name for p in pending)
            raise TimeoutError(f"{names} not healthy after {timeout:.0f}s:\n{pending[0].output_tail()}")
        time.sleep(0.05)
