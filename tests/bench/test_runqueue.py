"""`bench/vllm/runqueue.py` measures what it says: a thread named like libzmq's I/O thread that shares one
CPU with two spinning processes waits on the run queue about two thirds of the time, and one that sleeps
does not; a thread named by kvferry's contexts (`ZMQ_THREAD_PREFIX`) counts apart from the host's."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from kvferry.bench.vllm.runqueue import SAMPLE_S, RunQueueWatch
from kvferry.connector.zmq_context import ZMQ_THREAD_PREFIX

# A process (its own group) whose thread renames itself (argv[3]), then spins or sleeps, on one CPU.
CHILD = """
import ctypes, os, sys, threading, time
os.sched_setaffinity(0, {int(sys.argv[2])})
def named():
    ctypes.CDLL(None).prctl(15, sys.argv[3].encode(), 0, 0, 0)
    while sys.argv[1] == "spin":
        pass
    time.sleep(600)
threading.Thread(target=named, daemon=True).start()
time.sleep(600)
"""
CPU = min(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 0  # one this process may use
SPIN = "import os, sys; os.sched_setaffinity(0, {int(sys.argv[1])})\nwhile True: pass"


def _watch(mode: str, hogs: int, seconds: float = 3.0, name: str = "ZMQbg/IO/9") -> dict[str, float]:
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, mode, str(CPU), name], start_new_session=True)]
    procs += [subprocess.Popen([sys.executable, "-c", SPIN, str(CPU)], start_new_session=True) for _ in range(hogs)]
    try:
        time.sleep(0.5)  # the child has named its thread (the watch finds threads at each sample)
        watch = RunQueueWatch({"P": procs[0].pid})
        time.sleep(seconds)
        return watch.stop()
    finally:
        for p in procs:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


@pytest.mark.skipif(not os.path.exists("/proc/self/schedstat") or not hasattr(os, "sched_setaffinity"),
                    reason="needs Linux's per-thread schedstat")
def test_a_thread_sharing_a_cpu_with_two_spinners_is_starved_and_a_sleeping_one_is_not() -> None:
    starved = _watch("spin", hogs=2)
    assert starved["zmq I/O cpus"] == str(CPU)
    assert starved["P other zmq I/O max wait share"] >= 0.5, starved
    assert starved["P other zmq I/O longest starved s"] >= 2.0 - 2 * SAMPLE_S, starved
    assert starved["P other zmq I/O longest wait s"] > 0.0, starved  # it waits for each of its slices
    assert starved["P kvferry zmq I/O max wait share"] == 0.0, starved  # no thread of kvferry's there
    idle = _watch("sleep", hogs=0, seconds=1.0)
    assert idle["P other zmq I/O longest starved s"] == 0.0, idle
    assert idle["steal s"] >= 0.0


@pytest.mark.skipif(not os.path.exists("/proc/self/schedstat") or not hasattr(os, "sched_setaffinity"),
                    reason="needs Linux's per-thread schedstat")
def test_kvferrys_named_io_thread_counts_as_its_own() -> None:
    ours = _watch("spin", hogs=1, seconds=2.0, name=f"{ZMQ_THREAD_PREFIX}/ZMQbg/IO/0")
    assert ours["P kvferry zmq I/O max wait share"] >= 0.3, ours
    assert ours["P other zmq I/O max wait share"] == 0.0, ours
