"""Start, watch and stop child processes: a P/D system of `python -m kvferry serve|proxy` on loopback
ports, and (through `Supervised`) the benches' vLLM servers and the tests' routers.

Every child is stopped (SIGTERM, a bounded wait, then SIGKILL), also when the caller fails: by its own
pid, or by its process group when it was started in one (servers that start processes of their own).
"""

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
from dataclasses import dataclass
from typing import IO

import httpx

LOOPBACK = "127.0.0.1"
BLAS_ENV_VARS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")


# Ports handed to children are picked below Linux's ephemeral range (32768-60999 by default): a port the
# kernel gives to some bind(0) or outgoing connection meanwhile can then never collide with them.
# A port is also never handed out twice by one process: a child that has not bound its port yet leaves it
# free, and the next pick (say D's port right after P's) could be the same one (seen in CI: D failed to
# bind, and P answered D's health checks and requests).
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


# The deployment secret of every system this harness starts (unless the caller's environment has one):
# demos, chaos, soaks, benches and tests run with authenticated control and data planes, as a
# production deployment would.
HARNESS_SECRET = os.environ.get("KVFERRY_SECRET") or secrets.token_hex(16)


class Supervised:
    """One child process, its output in a temporary log file: stopped with a bounded wait, killed after it.

    `own_group`: the child leads a new session, and signals go to its whole process group (a server that
    starts processes of their own, which would outlive a signal to the leader alone); else to its pid.
    """

    # What terminate() sends (after SIGCONT).
    stop_signal = signal.SIGTERM

    def __init__(self, name: str, argv: Sequence[str], env: Mapping[str, str] | None = None, *,
                 own_group: bool = False, log_prefix: str = "kvferry-") -> None:
        self.name = name
        self.own_group = own_group
        self._log: IO[bytes] = tempfile.NamedTemporaryFile(  # noqa: SIM115 (closed in stop())
            prefix=f"{log_prefix}{name}-", suffix=".log", delete=False
        )
        self.log_path = self._log.name
        self.popen = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=None if env is None else dict(env),
            start_new_session=own_group,
        )

    @property
    def pid(self) -> int:
        return self.popen.pid

    def exited(self) -> int | None:
        return self.popen.poll()

    def signal(self, sig: signal.Signals) -> None:
        """`sig` to the child (its whole group when it leads one); nothing if it is gone."""
        with contextlib.suppress(ProcessLookupError):
            if self.own_group:
                os.killpg(self.pid, sig)
            else:
                os.kill(self.pid, sig)

    def output_tail(self, chars: int = 4000) -> str:
        with contextlib.suppress(OSError):
            self._log.flush()
            with open(self.log_path, "rb") as f:
                return f.read().decode(errors="replace")[-chars:]
        return ""

    def terminate(self) -> None:
        """Ask the process to exit (`stop_signal`; SIGCONT first in case it was stopped). A group is signalled
        even after its leader exited: what the leader started may still run."""
        if self.own_group or self.popen.poll() is None:
            self.signal(signal.SIGCONT)
            self.signal(self.stop_signal)

    def stop(self, timeout: float = 10.0, keep_log: bool = False) -> None:
        """Terminate, wait up to `timeout` s, then SIGKILL (and a group's leftovers); close, and unless
        `keep_log` remove, the log."""
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
    """One `python -m kvferry ...` child; output goes to a temporary log file, stop() is by pid."""

    # `kvferry serve` drains on SIGTERM (it exits once what it holds is served, up to its abort timeout);
    # the harness stops its children now, as Ctrl-C does. A test of the drain sends SIGTERM itself.
    stop_signal = signal.SIGINT

    def __init__(
        self, name: str, args: Sequence[str], url: str, env: dict[str, str] | None = None, prefix: Sequence[str] = ()
    ) -> None:
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
                raise RuntimeError(
                    f"{proc.name} exited with {code} before it was healthy:\n{proc.output_tail()}"
                )
            if proc.healthy():
                pending.remove(proc)
        if not pending:
            return
        if time.monotonic() > deadline:
            names = ", ".join(p.name for p in pending)
            raise TimeoutError(f"{names} not healthy after {timeout:.0f}s:\n{pending[0].output_tail()}")
        time.sleep(0.05)


@dataclass
class PDSystemConfig:
    seed: int = 0
    policy: str = "recompute"
    faults: str = ""
    num_blocks: int = 2048
    block_size: int = 16
    p_tp: int = 1
    d_tp: int = 1
    abort_timeout: float = 10.0
    kv_load_deadline: float = 20.0
    blas_threads: int = 1
    log_level: str = "warning"
    serve_args: tuple[str, ...] = ()  # more flags for both instances
    proxy_args: tuple[str, ...] = ()  # more flags for the proxy (e.g. --retries)


def _flags(**options: object) -> list[str]:
    """`--name value` pairs; underscores in a name become dashes."""
    out: list[str] = []
    for name, value in options.items():
        out += [f"--{name.replace('_', '-')}", str(value)]
    return out


class PDSystem:
    """One prefill instance, one decode instance and the proxy, on free loopback ports.

    Use as a context manager (or call stop() in a finally): every process it started is stopped by pid,
    also when the body raises or the user presses Ctrl-C.
    """

    def __init__(self, config: PDSystemConfig) -> None:
        self.config = config
        self.procs: list[ManagedProcess] = []
        self.prefill: ManagedProcess | None = None
        self.decode: ManagedProcess | None = None
        self.proxy: ManagedProcess | None = None

    def start(self, timeout: float = 60.0) -> None:
        """Start P, D and the proxy (all at once) and wait until every one answers /health."""
        c = self.config
        env = blas_env(c.blas_threads)
        common = _flags(
            host=LOOPBACK,
            seed=c.seed,
            num_blocks=c.num_blocks,
            block_size=c.block_size,
            kv_load_failure_policy=c.policy,
            abort_timeout=c.abort_timeout,
            kv_load_deadline=c.kv_load_deadline,
            log_level=c.log_level,
        )
        if c.faults:
            common += _flags(faults=c.faults)
        common += c.serve_args
        p_port, d_port, proxy_port = free_port(), free_port(), free_port()
        p_args = _flags(role="prefill", port=p_port, tp=c.p_tp, bootstrap_port=free_port())
        self.prefill = self._spawn("prefill", ["serve", *p_args, *common], p_port, env)
        d_args = _flags(role="decode", port=d_port, tp=c.d_tp)
        self.decode = self._spawn("decode", ["serve", *d_args, *common], d_port, env)
        proxy_args = _flags(
            host=LOOPBACK,
            port=proxy_port,
            prefill=self.prefill.url,
            decode=self.decode.url,
            log_level=c.log_level,
        )
        self.proxy = self._spawn("proxy", ["proxy", *proxy_args, *c.proxy_args], proxy_port, env)
        wait_all_healthy(self.procs, timeout)

    def _spawn(self, name: str, args: list[str], port: int, env: dict[str, str]) -> ManagedProcess:
        proc = ManagedProcess(name, args, f"http://{LOOPBACK}:{port}", env)
        self.procs.append(proc)
        return proc

    def dead(self) -> list[str]:
        """Names (and exit codes) of processes that exited on their own."""
        return [f"{p.name} (exit {code})" for p in self.procs if (code := p.exited()) is not None]

    def stop(self, keep_logs: bool = False) -> None:
        for proc in reversed(self.procs):  # all at once, then wait for each
            with contextlib.suppress(Exception):
                proc.terminate()
        for proc in reversed(self.procs):
            with contextlib.suppress(Exception):
                proc.stop(keep_log=keep_logs)

    def __enter__(self) -> PDSystem:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
