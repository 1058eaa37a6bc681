"""P's first sampled token travels with its KV (in every rank's FINISH), so D need not compute the last
prompt position again; and both workers wake their engine thread for what they report, instead of the
engine polling them (issue 22.3)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from kvferry.connector.bootstrap import BootstrapServer, Registration
from kvferry.connector.decode.consumer import Consumer
from kvferry.connector.decode.pulls import ConsumerConfig, PullSpec
from kvferry.connector.faults import FaultSpec
from kvferry.connector.layout import KVCacheSpec, PagedKVLayout
from kvferry.connector.messages import FirstToken
from kvferry.connector.metrics import Metrics
from kvferry.connector.prefill.producer import Producer
from kvferry.transfer.tcp.engine import TcpTransferEngine
from procs import free_port

SPEC = KVCacheSpec(num_blocks=8, num_layers=2, num_kv_heads=2, block_size=4, head_dim=8)


@pytest.mark.parametrize("p_tp", [1, 2])
@pytest.mark.parametrize("first_token", [FirstToken(42, 0.0), FirstToken(7, 0.8, 3), None])
def test_d_gets_ps_first_token_with_the_kv_and_both_sides_wake_their_engine(
    p_tp: int, first_token: FirstToken | None
) -> None:
    server = BootstrapServer("127.0.0.1", free_port())
    server.start()
    d_kv = np.zeros(SPEC.shape, dtype=np.float32)
    d_engine = TcpTransferEngine()
    consumer = Consumer(PagedKVLayout(SPEC, d_kv), [d_engine],
                        ConsumerConfig(recv_timeout_s=10.0, kv_load_deadline_s=10.0), Metrics())
    d_woken, p_woken = threading.Event(), threading.Event()
    consumer.outbox.waker = d_woken.set
    p_kv = np.full(SPEC.shape, 3.0, dtype=np.float32)
    p_engines = [TcpTransferEngine() for _ in range(p_tp)]
    producer = Producer(PagedKVLayout(SPEC, p_kv), p_engines, "127.0.0.1", 10.0, FaultSpec(), Metrics())
    producer.table.waker = p_woken.set
    try:
        for rank, (addr, boot) in enumerate(zip(producer.control_addrs, producer.boot_ids, strict=True)):
            server.register(Registration("p", p_tp, rank, addr, boot))
        producer.add_ready("x", "p", [1, 2], 2 * SPEC.block_size, "", first_token)
        consumer.start_pulls([PullSpec("d", "x", [3, 4], "p", f"127.0.0.1:{server.port}", 2 * SPEC.block_size)])
        assert d_woken.wait(10), "D's worker never woke its engine"
        r = consumer.outbox.drain_report()
        assert (r.finished, r.invalid, r.causes) == ({"d"}, set(), {})
        tokens = {rid: load.first_token for rid, load in r.loads.items() if load.first_token is not None}
        assert tokens == ({} if first_token is None else {"d": first_token})
        assert (d_kv[[3, 4]] == 3.0).all()
        # P's transfer is served: its blocks are the engine's to free, and the engine is woken for it.
        assert p_woken.wait(10), "P's worker never woke its engine"
        assert producer.drain_finished() == {"p"}
    finally:
        producer.close()
        for engine in p_engines:
            engine.close()
        consumer.close()
        d_engine.close()
        server.stop()
