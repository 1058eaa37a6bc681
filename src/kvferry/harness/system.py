"""One P/D system: prefill and decode `kvferry serve` instances, the proxy and optionally a colocated
instance, each on a free port. The harness and the benches start kvferry instances here only. As a
context manager it stops every process by pid, also on errors and Ctrl-C."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from kvferry.harness.processes import LOOPBACK, ManagedProcess, blas_env, free_port, wait_all_healthy


@dataclass(frozen=True)
class Role:
    count: int = 1
    args: tuple[str, ...] = ()  # `kvferry serve` flags of this role only (--tp, --faults, ...)
    env: Mapping[str, str] = field(default_factory=dict)
    host: str = LOOPBACK  # the address it binds, and where the proxy and the caller reach it
    prefix: tuple[str, ...] = ()  # e.g. `ip netns exec NS`: a prefix that execs, so the pid stays ours


@dataclass(frozen=True)
class PDSystemConfig:
    """The flags every instance shares (None: `kvferry serve`'s default), each role's own, the proxy's."""

    seed: int = 0
    policy: str | None = None  # --kv-load-failure-policy
    faults: str = ""
    num_blocks: int | None = None
    block_size: int | None = None
    abort_timeout: float | None = None
    kv_load_deadline: float | None = None
    log_level: str = "warning"
    serve_args: tuple[str, ...] = ()  # more flags for every instance
    blas_threads: int = 1
    env: Mapping[str, str] = field(default_factory=dict)  # every process's, e.g. another build's PYTHONPATH
    prefix: tuple[str, ...] = ()  # every process's, e.g. `nice -n 10`
    prefill: Role = field(default_factory=Role)
    decode: Role = field(default_factory=Role)
    colocated: bool = False  # also one `--role both` instance with the shared flags
    proxy: bool = True
    proxy_args: tuple[str, ...] = ()  # e.g. --retries
    health_timeout: float = 60.0  # how long a (re)started process may take to answer /health


def _flags(**options: object) -> list[str]:
    """`--name-with-dashes value` for each option that is not None."""
    return [arg for name, value in options.items() if value is not None
            for arg in (f"--{name.replace('_', '-')}", str(value))]


class PDSystem:
    """The processes of one config, by name: `prefill` and `decode` (`prefill0`, `prefill1`, ... when a
    role has several), `colocated`, `proxy`."""

    def __init__(self, config: PDSystemConfig) -> None:
        self.config = config
        self.procs: dict[str, ManagedProcess] = {}
        self._roles: dict[str, str] = {}
        self._starts: dict[str, Callable[[], ManagedProcess]] = {}

    @property
    def prefill(self) -> ManagedProcess:
        return self.procs[self.names("prefill")[0]]

    @property
    def decode(self) -> ManagedProcess:
        return self.procs[self.names("decode")[0]]

    @property
    def colocated(self) -> ManagedProcess:
        return self.procs["colocated"]

    @property
    def proxy(self) -> ManagedProcess:
        return self.procs["proxy"]

    def names(self, role: str) -> list[str]:  # in start order
        return [name for name, r in self._roles.items() if r == role]

    def start(self) -> None:
        """Start every process at once and wait until each one answers /health."""
        c = self.config
        for role, spec in (("prefill", c.prefill), ("decode", c.decode)):
            for i in range(spec.count):
                self._instance(role if spec.count == 1 else f"{role}{i}", role, spec)
        if c.colocated:
            self._instance("colocated", "both", Role())
        if c.proxy:
            port = free_port()
            backends = [flag for role in ("prefill", "decode") for name in self.names(role)
                        for flag in (f"--{role}", self.procs[name].url)]
            args = ["proxy", *_flags(host=LOOPBACK, port=port), *backends, *_flags(log_level=c.log_level), *c.proxy_args]
            self._spawn("proxy", "proxy", args, LOOPBACK, port, Role())
        wait_all_healthy(list(self.procs.values()), c.health_timeout)

    def _instance(self, name: str, role: str, spec: Role) -> None:
        c = self.config
        port = free_port()
        flags = _flags(role=role, host=spec.host, port=port, seed=c.seed, num_blocks=c.num_blocks,
                       block_size=c.block_size, kv_load_failure_policy=c.policy, abort_timeout=c.abort_timeout,
                       kv_load_deadline=c.kv_load_deadline, log_level=c.log_level,
                       bootstrap_port=free_port() if role == "prefill" else None, faults=c.faults or None)
        self._spawn(name, role, ["serve", *flags, *c.serve_args, *spec.args], spec.host, port, spec)

    def _spawn(self, name: str, role: str, args: list[str], host: str, port: int, spec: Role) -> None:
        c = self.config
        env = {**blas_env(c.blas_threads), **c.env, **spec.env}
        start = functools.partial(ManagedProcess, name, args, f"http://{host}:{port}", env, [*c.prefix, *spec.prefix])
        self._roles[name], self._starts[name] = role, start
        self.procs[name] = start()

    def restart(self, name: str) -> ManagedProcess:
        """A fresh process in place of `name` (stopped first if it still runs), at the same address with
        the same flags; returns it once it answers /health."""
        self.procs[name].stop()
        self.procs[name] = fresh = self._starts[name]()
        wait_all_healthy([fresh], self.config.health_timeout)
        return fresh

    def dead(self) -> list[str]:
        """Processes that exited on their own, with their exit codes."""
        return [f"{p.name} (exit {code})" for p in self.procs.values() if (code := p.exited()) is not None]

    def stop(self, keep_logs: bool = False) -> None:
        procs = list(reversed(self.procs.values()))
        for proc in procs:  # all at once, then wait for each
            with contextlib.suppress(Exception):
                proc.terminate()
        for proc in procs:
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
