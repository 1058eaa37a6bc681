"""A closed consumer gives back every fd it opened: its event loop's epoll and self-pipe included (each
open/close of a D connector leaked three fds until the garbage collector found its loop; found by tests/serving/test_drain_machine.py)."""

from __future__ import annotations

import os

import numpy as np

from kvferry.connector.decode.consumer import Consumer
from kvferry.connector.decode.pulls import ConsumerConfig
from kvferry.connector.layout import KVCacheSpec, PagedKVLayout
from kvferry.connector.metrics import Metrics
from kvferry.transfer.tcp.engine import TcpTransferEngine

SPEC = KVCacheSpec(num_blocks=4, num_layers=1, num_kv_heads=1, block_size=4, head_dim=4)


def _open_and_close() -> Consumer:
    """A closed consumer that is still referenced (an engine that keeps its connector)."""
    engine = TcpTransferEngine()
    try:
        layout = PagedKVLayout(SPEC, np.zeros(SPEC.shape, dtype=np.float32))
        consumer = Consumer(layout, [engine], ConsumerConfig(), Metrics())
        consumer.close()
        return consumer
    finally:
        engine.close()


def test_open_and_close_leaves_no_fd() -> None:
    kept = [_open_and_close()]  # the first one loads what stays loaded
    before = len(os.listdir("/proc/self/fd"))
    kept += [_open_and_close() for _ in range(5)]
    assert len(os.listdir("/proc/self/fd")) == before
