"""A real P (producer, TCP engine, bootstrap server) in its own process, driven by lines on stdin, whose
interpreter the test can starve: `starve S` holds the GIL for S seconds, so no Python thread of P (its
rank loops included) runs, while the process, and libzmq's I/O thread in it, stay alive.

    python starved_p.py SECRET PORT      prints "ready BOOTSTRAP_ADDR", then per line "ok":
    working TID RID | ready TID RID | starve SECONDS | held (answers "ok N": the transfers P holds)
"""

from __future__ import annotations

import sys
import time

import numpy as np

from kvferry.connector.bootstrap import BootstrapServer, Registration
from kvferry.connector.faults import FaultSpec
from kvferry.connector.layout import KVCacheSpec, PagedKVLayout
from kvferry.connector.metrics import Metrics
from kvferry.connector.prefill.producer import Producer
from kvferry.transfer.tcp.engine import TcpTransferEngine

SPEC = KVCacheSpec(num_blocks=32, num_layers=2, num_kv_heads=4, block_size=4, head_dim=8)
ENGINE_ID = "starved-p"
P_BLOCKS = [1, 2, 3, 4]


def starve(seconds: float) -> None:
    """Hold the GIL: no other thread may take it before the switch interval, longer than the spin."""
    sys.setswitchinterval(seconds + 5)
    try:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            pass
    finally:
        sys.setswitchinterval(0.005)


def main() -> None:
    secret = sys.argv[1].encode()
    kv = np.random.default_rng(0).standard_normal(SPEC.shape, dtype=np.float32)
    engine = TcpTransferEngine(secret=secret)
    producer = Producer(PagedKVLayout(SPEC, kv), [engine], "127.0.0.1", 30.0, FaultSpec(), Metrics(), secret)
    server = BootstrapServer("127.0.0.1", int(sys.argv[2]), secret=secret)
    server.register(Registration(ENGINE_ID, 1, 0, producer.control_addrs[0], producer.boot_ids[0]))
    server.start()
    print(f"ready 127.0.0.1:{server.port}", flush=True)
    for line in sys.stdin:
        cmd, *args = line.split()
        if cmd == "working":
            producer.add_working(args[0], args[1])
        elif cmd == "ready":
            producer.add_ready(args[0], args[1], P_BLOCKS, len(P_BLOCKS) * SPEC.block_size)
        elif cmd == "starve":
            starve(float(args[0]))
        elif cmd == "held":
            print(f"ok {len(producer.table)}", flush=True)
            continue
        print("ok", flush=True)
    producer.close()
    engine.close()
    server.stop()


if __name__ == "__main__":
    main()
