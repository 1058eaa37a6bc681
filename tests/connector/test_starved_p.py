"""Liveness that no GIL starvation fools (issue 32.6), against a real P process: while P's interpreter
is held for several times D's heartbeat timeout (no Python thread of P runs; the process lives), D waits
and the pull ends well; a SIGSTOP'd P (on an idle history) is still declared dead within 2.5 s, by
libzmq's ZMTP heartbeat."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from kvferry.connector.decode.consumer import Consumer
from kvferry.connector.decode.pulls import ConsumerConfig, PullSpec
from kvferry.connector.layout import KVCacheSpec, PagedKVLayout
from kvferry.connector.metrics import Metrics
from kvferry.harness.processes import HARNESS_SECRET
from kvferry.transfer.tcp.engine import TcpTransferEngine
from procs import free_port, wait_until

SPEC = KVCacheSpec(num_blocks=32, num_layers=2, num_kv_heads=4, block_size=4, head_dim=8)
D_BLOCKS = [5, 9, 2, 17]
INTERVAL, TIMEOUT = 0.1, 0.5  # D pings every 0.1 s; a stopped P is dead after 0.5 s without an answer
STARVED_S = 2.5  # 5x the timeout, and above the default 1.5 s


class StarvedP:
    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("starved_p.py")),
                                      HARNESS_SECRET, str(free_port())],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        self.bootstrap = self.proc.stdout.readline().split()[1]

    def ask(self, line: str) -> str:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def do(self, line: str) -> None:
        assert self.ask(line) == "ok"


@contextmanager
def p_and_d(timeout_s: float = TIMEOUT) -> Iterator[tuple[StarvedP, Consumer, dict[str, tuple[str, str]], set[str]]]:
    p = StarvedP()
    engine = TcpTransferEngine(secret=HARNESS_SECRET.encode())
    config = ConsumerConfig(heartbeat_interval_s=INTERVAL, heartbeat_timeout_s=timeout_s, recv_timeout_s=30,
                            kv_load_deadline_s=60, secret=HARNESS_SECRET.encode())
    consumer = Consumer(PagedKVLayout(SPEC, np.zeros(SPEC.shape, dtype=np.float32)), [engine], config, Metrics())
    try:
        yield p, consumer, {}, set()
    finally:
        consumer.close()
        engine.close()
        os.kill(p.proc.pid, signal.SIGCONT)
        p.proc.kill()
        p.proc.wait(10)


def ended(consumer: Consumer, causes: dict[str, tuple[str, str]], finished: set[str], rid: str) -> bool:
    f, _, c = consumer.drain()
    finished.update(f)
    causes.update(c)
    return rid in finished


def test_p_whose_python_is_starved_is_not_dead_and_a_stopped_one_is() -> None:
    with p_and_d() as (p, consumer, causes, finished):
        p.do("working xfer-a p-a")  # P has the request queued: D's pull waits for it, heartbeating
        consumer.start_pulls([PullSpec("a", "xfer-a", D_BLOCKS, "starved-p", p.bootstrap, 16)])
        wait_until(lambda: consumer.pending_pulls == 1 and consumer._dealers, 10, "D pulling from P")
        time.sleep(3 * INTERVAL)  # a few heartbeats answered: D has P's round trips
        started = time.monotonic()
        p.do(f"starve {STARVED_S}")
        assert time.monotonic() - started >= STARVED_S
        p.do("ready xfer-a p-a")
        wait_until(lambda: ended(consumer, causes, finished, "a"), 20, "the pull to end")
        assert causes == {}, f"D gave up on a P that was only starved: {causes}"

    # Stopped, not starved: libzmq's heartbeat goes unanswered and the connection drops. On an idle
    # history (a fresh D): after slow acks D would wait out what they allow (test_redial.py).
    with p_and_d() as (p, consumer, causes, finished):
        p.do("working xfer-b p-b")
        consumer.start_pulls([PullSpec("b", "xfer-b", D_BLOCKS, "starved-p", p.bootstrap, 16)])
        wait_until(lambda: any(d.connected and d.waiters for d in list(consumer._dealers.values())), 10,
                   "D pulling from P")
        time.sleep(3 * INTERVAL)
        os.kill(p.proc.pid, signal.SIGSTOP)
        stopped = time.monotonic()
        wait_until(lambda: ended(consumer, causes, finished, "b"), 10, "D to notice the stopped P")
        detected = time.monotonic() - stopped
        assert causes["b"][0] == "peer_dead", causes
        assert detected <= 2.5, f"a stopped P was seen after {detected:.2f}s"
        print(f"starved {STARVED_S}s: served; stopped: peer_dead after {detected:.2f}s ({causes['b'][1]})")


def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_a_proven_p_whose_bootstrap_server_is_starved_is_pulled_from_by_its_last_answer() -> None:
    """D's connection to P is gone (closed while P was stopped), so its next request asks P's bootstrap
    server again, and P's Python is starved past the lookup's 2 s: P answered before, so D pulls from its
    last answer and judges P by its ranks (alive: its I/O thread completes the handshake). Before, the
    request failed `bootstrap: no answer in time` (`kvferry bench vllm --hogs 6`, alone phase)."""
    with p_and_d() as (p, consumer, causes, finished):
        p.do("working xfer-a p-a")
        p.do("ready xfer-a p-a")
        consumer.start_pulls([PullSpec("a", "xfer-a", D_BLOCKS, "starved-p", p.bootstrap, 16)])
        wait_until(lambda: ended(consumer, causes, finished, "a"), 20, "the first pull to end")
        assert causes == {}, causes
        p.do("working xfer-b p-b")
        p.do("ready xfer-b p-b")
        assert p.proc.stdin is not None and p.proc.stdout is not None
        os.kill(p.proc.pid, signal.SIGSTOP)
        try:
            wait_until(lambda: not consumer._dealers, 10, "D to close its DEALER to the stopped P")
            p.proc.stdin.write(f"starve {2 * STARVED_S}\n")  # read first thing once P runs again
            p.proc.stdin.flush()
            spun = cpu_s(p.proc.pid)
        finally:
            os.kill(p.proc.pid, signal.SIGCONT)
        wait_until(lambda: cpu_s(p.proc.pid) - spun > 0.2, 10, "P's interpreter to be held")
        consumer.start_pulls([PullSpec("b", "xfer-b", D_BLOCKS, "starved-p", p.bootstrap, 16)])
        wait_until(lambda: ended(consumer, causes, finished, "b"), 30, "the second pull to end")
        assert causes == {}, f"D gave up on a P whose bootstrap server was only slow: {causes}"
        assert p.proc.stdout.readline().strip() == "ok"  # the starve ended
