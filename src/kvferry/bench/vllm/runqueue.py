"""How long libzmq's I/O threads in P's and D's processes wait for a CPU (`kvferry bench vllm --hogs`).

Only those threads take part in re-dialling a dropped connection, so when a live P is called dead the
question is whether they were runnable but left waiting (starvation) or not runnable at all (steal
time). `/proc/<pid>/task/<tid>/schedstat` and `/proc/stat` hold both, sampled every SAMPLE_S."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from pathlib import Path
from typing import Any

from kvferry.bench.vllm.servers import group_pids
from kvferry.connector.zmq_context import ZMQ_THREAD_PREFIX

SAMPLE_S = 0.25
OWNERS = ("kvferry", "other")
STARVED_SHARE = 0.5  # a sample in which the thread waited at least this share of the time counts as starved
_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def _io_threads(pgid: int) -> dict[str, tuple[str, Path]]:
    """libzmq's I/O threads of every process in group `pgid`, by `pid/tid`: whose (kvferry's carry
    `ZMQ_THREAD_PREFIX`) and where to read them."""
    found: dict[str, tuple[str, Path]] = {}
    ours = f"{ZMQ_THREAD_PREFIX}/"
    for pid in group_pids(pgid):
        with contextlib.suppress(OSError):
            for task in Path(f"/proc/{pid}/task").iterdir():
                name = (task / "comm").read_text()
                if "ZMQbg/IO" in name:
                    found[f"{pid}/{task.name}"] = ("kvferry" if name.startswith(ours) else "other", task)
    return found


def _steal_s() -> float:
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()
    return int(fields[8]) * _TICK_S if len(fields) > 8 else 0.0


class RunQueueWatch:
    """Samples the I/O threads of `groups` (name → pgid) until `stop`, kvferry's and the host's apart: the
    longest stretch waiting at least STARVED_SHARE of the time (a busy thread sharing its CPU), and the
    longest single wait per time slice (a thread that wakes for a packet and waits seconds for a CPU)."""

    def __init__(self, groups: dict[str, int]) -> None:
        self.groups = groups
        self._stop = threading.Event()
        self._worst: dict[tuple[str, str], dict[str, float]] = {
            (name, owner): {"longest starved s": 0.0, "max wait share": 0.0, "longest wait s": 0.0}
            for name in groups for owner in OWNERS}
        self._cpus: dict[str, str] = {}
        self._steal0 = _steal_s()
        self._thread = threading.Thread(target=self._run, name="kvferry-runqueue", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        last: dict[str, tuple[float, int, int]] = {}  # pid/tid → (sampled at, wait ns, time slices)
        starved_since: dict[str, float] = {}
        while not self._stop.wait(SAMPLE_S):
            for name, pgid in self.groups.items():
                for key, (owner, task) in _io_threads(pgid).items():
                    worst = self._worst[name, owner]
                    with contextlib.suppress(OSError, ValueError, IndexError):
                        fields = (task / "schedstat").read_text().split()
                        wait_ns, slices = int(fields[1]), int(fields[2])
                        now = time.monotonic()
                        if key not in self._cpus:
                            status = (task / "status").read_text()
                            self._cpus[key] = status.split("Cpus_allowed_list:", 1)[1].split()[0]
                        if key in last:
                            then, before, slices_before = last[key]
                            waited = (wait_ns - before) / 1e9
                            share = waited / max(now - then, 1e-3)
                            worst["max wait share"] = max(worst["max wait share"], min(share, 1.0))
                            worst["longest wait s"] = max(worst["longest wait s"], waited / max(slices - slices_before, 1))
                            if share >= STARVED_SHARE:
                                since = starved_since.setdefault(key, then)
                                worst["longest starved s"] = max(worst["longest starved s"], now - since)
                            else:
                                starved_since.pop(key, None)
                        last[key] = (now, wait_ns, slices)

    def stop(self) -> dict[str, Any]:
        """What each group's I/O threads went through since the start, and the host's steal time."""
        self._stop.set()
        self._thread.join(timeout=5)
        row: dict[str, Any] = {}
        for (name, owner), worst in self._worst.items():
            for figure, value in worst.items():
                row[f"{name} {owner} zmq I/O {figure}"] = round(value, 2)
        row["zmq I/O cpus"] = " ".join(sorted(set(self._cpus.values()))) or "-"
        row["steal s"] = round(_steal_s() - self._steal0, 2)
        return row
