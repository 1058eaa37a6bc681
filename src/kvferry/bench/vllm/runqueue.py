"""How long libzmq's I/O threads in P's and D's processes wait for a CPU (`kvferry bench vllm --hogs`).

D calls a P dead when a dropped connection is not re-dialled in time, and only libzmq's I/O threads (no
Python) take part in a re-dial. So when a live P is called dead, the question is whether those threads were
runnable and left waiting by the kernel's scheduler (CPU starvation), or not runnable at all (blocked, or
the whole VM held by its host: steal time). Linux counts both per thread: `/proc/<pid>/task/<tid>/schedstat`
holds the nanoseconds a thread ran and the nanoseconds it waited on a run queue; `/proc/stat` the CPU
time the host took (steal). Sampling them every SAMPLE_S names the starvation's size and kind.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from pathlib import Path
from typing import Any

SAMPLE_S = 0.25
STARVED_SHARE = 0.5  # a sample in which the thread waited at least this share of the time counts as starved
_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def _io_threads(pgid: int) -> dict[str, Path]:
    """libzmq's I/O threads (named `ZMQbg/IO/<n>`) of every process in group `pgid`, by `pid/tid`."""
    found: dict[str, Path] = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError, ValueError):
            if int((proc / "stat").read_text().rsplit(")", 1)[1].split()[2]) != pgid:
                continue
            for task in (proc / "task").iterdir():
                if (task / "comm").read_text().startswith("ZMQbg/IO"):
                    found[f"{proc.name}/{task.name}"] = task
    return found


def _steal_s() -> float:
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()
    return int(fields[8]) * _TICK_S if len(fields) > 8 else 0.0


class RunQueueWatch:
    """Samples the I/O threads of the process groups `groups` (name → pgid) until `stop`."""

    def __init__(self, groups: dict[str, int]) -> None:
        self.groups = groups
        self._stop = threading.Event()
        self._worst: dict[str, dict[str, float]] = {
            name: {"longest starved s": 0.0, "max wait share": 0.0} for name in groups}
        self._cpus: dict[str, str] = {}
        self._steal0 = _steal_s()
        self._thread = threading.Thread(target=self._run, name="kvferry-runqueue", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        last: dict[str, tuple[float, int]] = {}  # pid/tid → (sampled at, wait ns)
        starved_since: dict[str, float] = {}
        while not self._stop.wait(SAMPLE_S):
            for name, pgid in self.groups.items():
                worst = self._worst[name]
                for key, task in _io_threads(pgid).items():
                    with contextlib.suppress(OSError, ValueError, IndexError):
                        wait_ns = int((task / "schedstat").read_text().split()[1])
                        now = time.monotonic()
                        if key not in self._cpus:
                            status = (task / "status").read_text()
                            self._cpus[key] = status.split("Cpus_allowed_list:", 1)[1].split()[0]
                        if key in last:
                            then, before = last[key]
                            share = (wait_ns - before) / 1e9 / max(now - then, 1e-3)
                            worst["max wait share"] = max(worst["max wait share"], min(share, 1.0))
                            if share >= STARVED_SHARE:
                                since = starved_since.setdefault(key, then)
                                worst["longest starved s"] = max(worst["longest starved s"], now - since)
                            else:
                                starved_since.pop(key, None)
                        last[key] = (now, wait_ns)

    def stop(self) -> dict[str, Any]:
        """What each group's I/O threads went through, and the host's steal time, since the start."""
        self._stop.set()
        self._thread.join(timeout=5)
        row: dict[str, Any] = {}
        for name, worst in self._worst.items():
            row[f"{name} zmq I/O longest starved s"] = round(worst["longest starved s"], 2)
            row[f"{name} zmq I/O max wait share"] = round(worst["max wait share"], 2)
        row["zmq I/O cpus"] = " ".join(sorted(set(self._cpus.values()))) or "-"
        row["steal s"] = round(_steal_s() - self._steal0, 2)
        return row
