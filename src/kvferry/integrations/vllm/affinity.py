"""Where KVFerryConnector's threads run. vLLM's CPU worker pins itself to its OpenMP cores for compute,
and threads inherit the creating thread's affinity: started there, kvferry's sender, receiver and ZMQ
threads would starve behind the model. They start under the engine's own CPUs instead (or KVFERRY_CPUS)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator


def engine_cpus() -> set[int]:
    """The engine core's (our parent's) CPU affinity, else every CPU."""
    with contextlib.suppress(OSError):
        return os.sched_getaffinity(os.getppid())
    return set(range(os.cpu_count() or 1))


@contextlib.contextmanager
def connector_affinity(cpus: set[int] | None = None) -> Iterator[set[int]]:
    """Run the block with the calling thread on `cpus` (default: `engine_cpus()`; env `KVFERRY_CPUS`, e.g.
    "2-3,6", overrides), so every thread it starts inherits them; restored after."""
    env = os.environ.get("KVFERRY_CPUS", "")
    wanted = _parse_cpus(env) if env else (cpus or engine_cpus())
    saved = os.sched_getaffinity(0)
    os.sched_setaffinity(0, wanted)  # pid 0: the calling thread only
    try:
        yield wanted
    finally:
        os.sched_setaffinity(0, saved)


def _parse_cpus(spec: str) -> set[int]:
    out: set[int] = set()
    for part in spec.split(","):
        lo, _, hi = part.strip().partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    if not out:
        raise ValueError(f"KVFERRY_CPUS={spec!r} names no CPU")
    return out


def cpu_list(cpus: set[int]) -> str:
    return ",".join(str(c) for c in sorted(cpus))

