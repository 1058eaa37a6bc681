"""kvferry's libzmq contexts name their I/O threads and schedule them real-time (SCHED_RR), nothing else;
without the right to (no CAP_SYS_NICE) a context still works and one warning says so; P lowers its
threads while strangers press and lifts them again once they have been quiet."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import pytest
import zmq
import zmq.asyncio

from kvferry.connector.metrics import Metrics
from kvferry.connector.prefill.guard import RealTimeWhileCalm
from kvferry.connector.zmq_context import RT_PRIORITY, ZMQ_THREAD_PREFIX, liveness_context
from procs import can_schedule_realtime

LINUX = os.path.isdir("/proc/self/task")
REALTIME = LINUX and can_schedule_realtime()


def _threads() -> dict[str, tuple[int, int]]:
    """Each thread (`tid name`) → its scheduling policy and real-time priority."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/comm") as f:
            out[f"{tid} {f.read().strip()}"] = (os.sched_getscheduler(int(tid)), os.sched_getparam(int(tid)).sched_priority)
    return out


@pytest.mark.skipif(not LINUX, reason="Linux thread names and priorities")
@pytest.mark.parametrize("kind", [zmq.Context, zmq.asyncio.Context])
def test_the_io_thread_is_named_and_lifted_and_nothing_else(kind: type[zmq.Context]) -> None:  # type: ignore[type-arg]
    before = _threads()
    ctx, _ = liveness_context(kind)
    try:
        new = {k: v for k, v in _threads().items() if k not in before}
        io = {k: v for k, v in new.items() if k.split()[1].startswith(f"{ZMQ_THREAD_PREFIX}/ZMQbg/IO/")}
        assert len(io) == 1, new
        if REALTIME:
            assert set(io.values()) == {(os.SCHED_RR, RT_PRIORITY)}, new
        others = {k: v for k, v in _threads().items() if k not in io}
        assert set(others.values()) == {(os.SCHED_OTHER, 0)}, others
        sock = ctx.socket(zmq.PAIR)  # the context serves sockets as any other
        sock.close(0)
    finally:
        ctx.destroy(linger=0)


CHILD = """
import logging, os, zmq
logging.basicConfig(level=logging.WARNING, format="%(message)s")
from kvferry.connector.zmq_context import liveness_context
(a, _), (b, _) = liveness_context(zmq.Context), liveness_context(zmq.Context)
s = a.socket(zmq.PAIR); s.bind("inproc://x"); r = a.socket(zmq.PAIR); r.connect("inproc://x")
s.send(b"ok"); print(r.recv().decode())
"""


@pytest.mark.skipif(not LINUX or os.geteuid() != 0 or shutil.which("setpriv") is None,
                    reason="drops CAP_SYS_NICE with setpriv (root)")
def test_without_cap_sys_nice_it_works_and_warns_once() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run(["setpriv", "--inh-caps=-sys_nice", "--bounding-set=-sys_nice", sys.executable, "-c", CHILD],
                         capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
    assert out.stderr.count("CAP_SYS_NICE") == 1, out.stderr


def _policy(tid: int) -> int:
    return os.sched_getscheduler(tid)


@pytest.mark.skipif(not LINUX or not REALTIME, reason="real-time scheduling needs CAP_SYS_NICE")
def test_strangers_lower_ps_io_threads_until_they_have_been_quiet() -> None:
    ctx, threads = liveness_context(zmq.Context, lift=False)
    metrics = Metrics()
    try:
        realtime = RealTimeWhileCalm(threads, metrics, calm_s=0.3)
        assert threads.tids and {_policy(t) for t in threads.tids} == {os.SCHED_RR}
        assert metrics.control_realtime._value.get() == 1
        realtime.pressed("a test")
        assert {_policy(t) for t in threads.tids} == {os.SCHED_OTHER}
        assert metrics.control_realtime._value.get() == 0
        deadline = time.monotonic() + 0.25
        while time.monotonic() < deadline:  # still pressed: stays lowered
            realtime.pressed("a test")
            realtime.tick()
            assert {_policy(t) for t in threads.tids} == {os.SCHED_OTHER}
        deadline = time.monotonic() + 10
        while {_policy(t) for t in threads.tids} != {os.SCHED_RR}:
            assert time.monotonic() < deadline, "never lifted again after the strangers went quiet"
            realtime.tick()
            time.sleep(0.01)
        assert metrics.control_realtime._value.get() == 1
    finally:
        ctx.destroy(linger=0)
