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
_NAMED_WITHIN_S = 1.0  # libzmq names a thread first thing in it
_warned = False

C = TypeVar("C", bound=zmq.Context[Any])


def liveness_context(kind: type[C]) -> C:
    """A context of `kind` whose I/O thread is named and lifted now (libzmq starts it with the first
    socket, so one is opened and closed here)."""
    ctx = kind()
    ctx.set(zmq.THREAD_NAME_PREFIX, ZMQ_THREAD_PREFIX)
    before = _threads()
    zmq.Socket(ctx, zmq.PAIR).close(0)
    lift_io_threads(_threads() - before)
    return ctx


def lift_io_threads(tids: set[int]) -> dict[int, str]:
    """Schedule kvferry's libzmq I/O threads among `tids` ahead of CPU-bound threads; returns how each
    was lifted (`rr`, `nice` or `none`)."""
    return {tid: _lift(tid) for tid in tids if _is_io_thread(tid)}


def _lift(tid: int) -> str:
    global _warned
    try:  # a thread id: that thread alone
        os.sched_setscheduler(tid, os.SCHED_RR, os.sched_param(RT_PRIORITY))
        return "rr"
    except PermissionError as exc:
        refused = exc
    except OSError:  # the thread is gone (its context closed meanwhile)
        return "none"
    try:
        os.setpriority(os.PRIO_PROCESS, tid, IO_NICE)
        lifted = "nice"
    except PermissionError:
        lifted = "none"
    except OSError:
        return "none"
    if not _warned:
        _warned = True
        log.warning("kvferry's libzmq I/O threads are not scheduled real-time (%s; it needs CAP_SYS_NICE and, "
                    "in a cgroup with real-time group scheduling, real-time time): %s; on a node with more "
                    "runnable threads than CPUs a live peer may be called dead", refused,
                    f"nice {IO_NICE} instead" if lifted == "nice" else "they keep the process's priority")
    return lifted


def _threads() -> set[int]:
    with contextlib.suppress(OSError):
        return {int(t) for t in os.listdir("/proc/self/task")}
    return set()  # not Linux: nothing to lift


def _is_io_thread(tid: int) -> bool:
    deadline = time.monotonic() + _NAMED_WITHIN_S
    while True:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read()
        except OSError:
            return False
        if name.startswith(f"{ZMQ_THREAD_PREFIX}/"):
            return "/IO/" in name
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
