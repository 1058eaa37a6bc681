"""P restarted again and again at the same address (same engine_id and bootstrap server, new ZMQ
ports): D asks the bootstrap server again instead of pulling from a dead port, so the very next
request works (issue 12.2), and D closes the DEALERs no live pull uses, so its sockets and fds stay
bounded by the live P ranks (issue 13.7). With a fixed control port and the secret each P is a new
receiver at the same address (its boot id, issue 31): D asks again too, and seals for the new one."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from kvferry.connector.bootstrap import BootstrapClient, BootstrapServer, Registration
from kvferry.connector.decode.consumer import Consumer
from kvferry.connector.decode.pulls import ConsumerConfig, PullSpec
from kvferry.connector.faults import FaultSpec
from kvferry.connector.layout import KVCacheSpec, PagedKVLayout
from kvferry.connector.metrics import Metrics
from kvferry.connector.prefill.producer import Producer
from kvferry.harness.processes import HARNESS_SECRET
from kvferry.transfer.tcp.engine import TcpTransferEngine
from procs import free_port, wait_until

SPEC = KVCacheSpec(num_blocks=8, num_layers=2, num_kv_heads=2, block_size=4, head_dim=8)
RESTARTS = 25


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("fixed", [False, True], ids=["new-ports", "fixed-control-port-secret"])
def test_p_restarted_at_the_same_address_serves_the_next_request_and_d_sockets_stay_bounded(fixed: bool) -> None:
    secret, control_port = (HARNESS_SECRET.encode(), free_port()) if fixed else (None, 0)
    server = BootstrapServer("127.0.0.1", free_port(), secret=secret)
    server.start()
    d_kv = np.zeros(SPEC.shape, dtype=np.float32)
    d_engine = TcpTransferEngine(secret=secret or b"")
    metrics = Metrics()
    config = ConsumerConfig(recv_timeout_s=10.0, kv_load_deadline_s=10.0, dealer_idle_s=1.0, secret=secret)
    consumer = Consumer(PagedKVLayout(SPEC, d_kv), [d_engine], config, metrics, BootstrapClient(secret=secret))
    finished: set[str] = set()
    causes: dict[str, tuple[str, str]] = {}
    fds_after_first = 0
    try:
        for i in range(RESTARTS):
            p_kv = np.full(SPEC.shape, float(i + 1), dtype=np.float32)
            p_engine = TcpTransferEngine(secret=secret or b"")
            producer = Producer(PagedKVLayout(SPEC, p_kv), [p_engine], "127.0.0.1", 10.0, FaultSpec(), Metrics(), secret,
                                control_port=control_port)
            try:
                server.register(Registration("p", 1, 0, producer.control_addrs[0], producer.boot_ids[0]))
                if fixed and i:  # libzmq dialled the old P's address again: the cached answer looks live
                    wait_until(lambda: any(d.connected for d in list(consumer._dealers.values())), 10,
                               "D's DEALER to reconnect to the new P")
                producer.add_ready(f"x{i}", f"p{i}", [1, 2], 2 * SPEC.block_size)
                consumer.start_pulls([PullSpec(f"d{i}", f"x{i}", [3, 4], "p", f"127.0.0.1:{server.port}",
                                               2 * SPEC.block_size)])
                deadline = time.monotonic() + 10
                while f"d{i}" not in finished:
                    assert time.monotonic() < deadline, f"pull {i} never finished"
                    done, _, new_causes = consumer.drain()
                    finished |= done
                    causes.update(new_causes)
                    time.sleep(0.005)
                assert f"d{i}" not in causes, f"request after restart {i} failed: {causes[f'd{i}']}"
                assert (d_kv[[3, 4]] == i + 1).all()
            finally:
                producer.close()
                p_engine.close()
            if fixed:  # a P restarts in seconds, D sees its connection close in milliseconds: keep that order
                # (a loaded CI box once let the next P bind first; D then trusted its cached answer for the
                # old process, sealed the pull for it, and the new P rightly dropped it: `peer_dead`).
                wait_until(lambda: all(not d.connected or d.dropped is not None or d.lost
                                       for d in list(consumer._dealers.values())), 10,
                           "D to see the old P's connection close")
            if i == 0:
                fds_after_first = open_fds()
        # Every DEALER to a P that is gone is closed; none stays for a dead port.
        deadline = time.monotonic() + 5
        while len(consumer._dealers) > 0:
            assert time.monotonic() < deadline, f"{len(consumer._dealers)} DEALERs kept for dead P ranks"
            time.sleep(0.05)
        # ZMQ's I/O thread closes a closed socket's fds a little later (CI once saw 61 fds, then 36).
        while open_fds() > fds_after_first + 4:
            assert time.monotonic() < deadline + 5, (fds_after_first, open_fds())
            time.sleep(0.05)
    finally:
        consumer.close()
        d_engine.close()
        server.stop()
