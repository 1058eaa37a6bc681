"""kvferry's libzmq contexts, whose I/O threads carry P/D liveness.

Only libzmq's I/O threads take part in what tells D that P's process lives (the ZMTP pings, a re-dial's
handshake: no Python), so on a node whose CPUs are oversubscribed a live P whose I/O thread waits
seconds for a CPU looks exactly like a stopped one. So the threads are named apart from the host's own
libzmq threads (`75/ZMQbg/IO/<n>`: a gauge or `top -H` tells them from vLLM's) and scheduled ahead of
the CPU-bound ones: SCHED_RR at the lowest real-time priority. A higher nice value is not enough: the
kernel shares a CPU between sessions (autogroups) and cgroups first, so a thread whose own group has
used its share waits for the group however high its nice (docs/vllm-results.md, *Six CPU hogs*). The
threads sleep but for control messages (KV bytes move on the data plane's own threads), so the priority
takes next to nothing from the model, and the kernel keeps 5 % of every CPU for other threads whatever
real-time threads do (`sched_rt_runtime_us`). P's threads also accept strangers' connections, so P
lowers them to normal priority while strangers press on its port (`prefill/guard.py`,
`RealTimeWhileCalm`). Where real-time scheduling is refused (no
CAP_SYS_NICE, or a cgroup without real-time time) the threads get nice `IO_NICE` instead, or keep the
process's priority, and one warning says what that costs.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from typing import Any, TypeVar

import zmq

log = logging.getLogger(__name__)

ZMQ_THREAD_PREFIX = 75
RT_PRIORITY = 1  # the lowest SCHED_RR priority: ahead of every normal thread, behind any real-time one
IO_NICE = -10  # about 9x a default thread's share of a contended CPU (CFS weights 9548 : 1024)
_NAMED_WITHIN_S = 1.0  # how long a new I/O thread may take to name itself
_warned = False

C = TypeVar("C", bound=zmq.Context[Any])


class IoThreads:
    """One context's libzmq I/O threads: `lift` schedules them real-time, `lower` hands them back to the
    process's own policy and nice value (lowering needs no privilege; lifting again does). Whoever lifts
    and lowers them from several threads serializes the calls (`RealTimeWhileCalm`)."""

    def __init__(self, tids: list[int]) -> None:
        self.tids = tids
        self.realtime = False  # every one of them SCHED_RR

    def lift(self) -> None:
        self.realtime = all([_lift(tid) for tid in self.tids]) and bool(self.tids)

    def lower(self) -> None:
        nice = os.getpriority(os.PRIO_PROCESS, os.getpid())  # the main thread's: the process's own
        for tid in self.tids:
            with contextlib.suppress(OSError):  # gone with its context
                os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
                os.setpriority(os.PRIO_PROCESS, tid, nice)
        self.realtime = False


def liveness_context(kind: type[C], lift: bool = True) -> tuple[C, IoThreads]:
    """A context of `kind` whose I/O threads are named and, with `lift`, lifted now (libzmq starts them
    with the first socket, so one is opened and closed here, and each names itself first thing)."""
    ctx = kind()
    ctx.set(zmq.THREAD_NAME_PREFIX, ZMQ_THREAD_PREFIX)
    before = _threads()
    zmq.Socket(ctx, zmq.PAIR).close(0)
    found: list[int] = []
    deadline = time.monotonic() + _NAMED_WITHIN_S
    while len(found) < ctx.get(zmq.IO_THREADS) and time.monotonic() < deadline:
        found += [tid for tid in _threads() - before - set(found)
                  if _name(tid).startswith(f"{ZMQ_THREAD_PREFIX}/ZMQbg/IO/")]
        time.sleep(0.001)
    threads = IoThreads(found)
    if lift:
        threads.lift()
    return ctx, threads


def _lift(tid: int) -> bool:
    """SCHED_RR for thread `tid` (True); where that is refused nice `IO_NICE`, else nothing (one warning)."""
    global _warned
    try:  # a thread id: that thread alone
        os.sched_setscheduler(tid, os.SCHED_RR, os.sched_param(RT_PRIORITY))
        return True
    except PermissionError as exc:
        refused = exc
    except OSError:  # the thread is gone (its context closed meanwhile)
        return False
    try:
        os.setpriority(os.PRIO_PROCESS, tid, IO_NICE)
        instead = f"nice {IO_NICE} instead"
    except OSError:
        instead = "they keep the process's priority"
    if not _warned:
        _warned = True
        log.warning("kvferry's libzmq I/O threads are not scheduled real-time (%s; it needs CAP_SYS_NICE and, "
                    "in a cgroup with real-time group scheduling, real-time time): %s; on a node with more "
                    "runnable threads than CPUs a live peer may be called dead", refused, instead)
    return False


def _threads() -> set[int]:
    with contextlib.suppress(OSError):
        return {int(t) for t in os.listdir("/proc/self/task")}
    return set()  # not Linux: nothing to lift


def _name(tid: int) -> str:
    with contextlib.suppress(OSError), open(f"/proc/self/task/{tid}/comm") as f:
        return f.read()
    return ""
