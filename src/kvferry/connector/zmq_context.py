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
real-time threads do (`sched_rt_runtime_us`); what a stranger can make them do is bounded before any of
it (`prefill/guard.py`). Where real-time scheduling is refused (no
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


def liveness_context(kind: type[C], lift: bool = True) -> C:
    """A context of `kind` whose I/O threads are named and, with `lift`, lifted now (libzmq starts them
    with the first socket, so one is opened and closed here, and each names itself first thing). P's
    contexts are not lifted: its ROUTER accepts strangers, and at SCHED_RR its I/O thread accepts a burst
    of their connections faster than the rank loop evicts the unproven ones (`prefill/guard.py`)."""
    ctx = kind()
    ctx.set(zmq.THREAD_NAME_PREFIX, ZMQ_THREAD_PREFIX)
    if not lift:
        return ctx
    before = _threads()
    zmq.Socket(ctx, zmq.PAIR).close(0)
    lifted: set[int] = set()
    deadline = time.monotonic() + _NAMED_WITHIN_S
    while len(lifted) < ctx.get(zmq.IO_THREADS) and time.monotonic() < deadline:
        for tid in _threads() - before - lifted:
            if _name(tid).startswith(f"{ZMQ_THREAD_PREFIX}/ZMQbg/IO/"):
                _lift(tid)
                lifted.add(tid)
        time.sleep(0.001)
    return ctx


def _lift(tid: int) -> None:
    """SCHED_RR for thread `tid`; where that is refused nice `IO_NICE`, else nothing (one warning)."""
    global _warned
    try:  # a thread id: that thread alone
        os.sched_setscheduler(tid, os.SCHED_RR, os.sched_param(RT_PRIORITY))
        return
    except PermissionError as exc:
        refused = exc
    except OSError:  # the thread is gone (its context closed meanwhile)
        return
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


def _threads() -> set[int]:
    with contextlib.suppress(OSError):
        return {int(t) for t in os.listdir("/proc/self/task")}
    return set()  # not Linux: nothing to lift


def _name(tid: int) -> str:
    with contextlib.suppress(OSError), open(f"/proc/self/task/{tid}/comm") as f:
        return f.read()
    return ""
