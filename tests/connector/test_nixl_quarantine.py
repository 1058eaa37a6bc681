"""Issue 31 item 10 (a)+(b) through D's consumer, on real NIXL engines over UCX's tcp: P1 is frozen
while D has its read posted, then fails the pull. Before, `close_grant` waited up to 30 s on the consumer
loop: a healthy P2's pull, started meanwhile, stalled that long too; and when the wait gave up, the read
landed later into blocks D had handed back. Now the close returns at once, P2's pull succeeds promptly,
and P1's blocks are not handed back while the read may still land: a host that quarantines
(`Outbox.quarantine`) gets the failure at once and the blocks' release once the read ended; any other
host gets the request (with its blocks) only after the read ended."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import zmq

from kvferry.connector.auth import TO_DECODE, TO_PREFILL, Opener, Sealer
from kvferry.connector.bootstrap import BootstrapServer, Registration
from kvferry.connector.decode.consumer import Consumer
from kvferry.connector.decode.pulls import ConsumerConfig, PullSpec, Report
from kvferry.connector.layout import KVCacheSpec, PagedKVLayout, write_ops
from kvferry.connector.messages import PullRequest, PullResponse, Status, decode_inbound, encode
from kvferry.connector.metrics import Metrics
from kvferry.harness.peer import PeerProcess
from kvferry.transfer.nixl import api as nixl_api
from procs import free_port

if not nixl_api.available():
    pytest.skip("nixl is not installed", allow_module_level=True)

from kvferry.transfer.nixl.engine import NixlTransferEngine  # noqa: E402

SPEC = KVCacheSpec(num_blocks=24, num_layers=8, num_kv_heads=4, block_size=64, head_dim=128)  # 2 MiB blocks
P1_BLOCKS, P2_BLOCKS = list(range(16)), [16, 17, 18, 19]  # D's blocks for each pull (P1's: one 32 MiB read)
HEADS = (0, SPEC.num_kv_heads)


class Router:
    """A P rank's control socket, driven by the test."""

    def __init__(self, ctx: zmq.Context[Any]) -> None:
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.addr = f"tcp://127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"
        self.sealer, self.opener = Sealer(None, TO_DECODE), Opener(None, TO_PREFILL)

    def recv_pull(self) -> tuple[bytes, PullRequest]:
        while True:
            assert self.sock.poll(10_000), "no pull from D"
            identity, data = self.sock.recv_multipart()
            msg = decode_inbound(self.opener.open(data))
            if isinstance(msg, PullRequest):
                return identity, msg

    def reply(self, identity: bytes, pull: PullRequest, status: Status, **kw: Any) -> None:
        resp = PullResponse(status, pull.d_request_id, pull.transfer_id, **kw)
        self.sock.send_multipart([identity, self.sealer.seal(encode(resp))])


@pytest.fixture
def rig(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    monkeypatch.setenv("UCX_TLS", "tcp")  # a read needs the sender's progress (cma would end it at once)
    ctx: zmq.Context[Any] = zmq.Context()
    routers = {"p1": Router(ctx), "p2": Router(ctx)}
    server = BootstrapServer("127.0.0.1", free_port())
    for name, r in routers.items():
        server.register(Registration(name, 1, 0, r.addr, "00" * 16))  # no secret: no receiver checked
    server.start()
    d_kv = np.zeros(SPEC.shape, np.float32)
    d_engine, p2_engine = NixlTransferEngine(), NixlTransferEngine()
    p_kv = np.random.default_rng(0).standard_normal(SPEC.shape, dtype=np.float32)
    p2_layout = PagedKVLayout(SPEC, p_kv)
    p2_engine.register("kv", p_kv)
    config = ConsumerConfig(1, recv_timeout_s=30, kv_load_deadline_s=60, heartbeat_timeout_s=0)
    consumer = Consumer(PagedKVLayout(SPEC, d_kv), [d_engine], config, Metrics())
    p1 = PeerProcess(len(P1_BLOCKS) * SPEC.block_bytes, region="kv", env=dict(os.environ), transfer="nixl")
    try:
        yield {"consumer": consumer, "routers": routers, "d_engine": d_engine, "d_kv": d_kv, "p1": p1,
               "p2": (p2_engine, p2_layout), "bootstrap": f"127.0.0.1:{server.port}"}
    finally:
        p1.stop()
        consumer.close()
        for e in (d_engine, p2_engine):
            e.close()
        for r in routers.values():
            r.sock.close(0)
        server.stop()
        ctx.term()


def freeze_inside_the_read(d_engine: NixlTransferEngine, p1: PeerProcess) -> None:
    """SIGSTOP P1 while D's read is posted: inside its posting call (where NIXL may stream it to its end
    while P1 keeps sending) or after it."""
    deadline = time.monotonic() + 10
    while not d_engine.stats["reads_in_flight"]:
        assert time.monotonic() < deadline, "D never posted P1's read"
        time.sleep(0.0005)
    p1.signal(signal.SIGSTOP)
    time.sleep(0.05)
    assert d_engine._recv._reads, "the read ended before the freeze (rerun)"


def test_a_frozen_p_costs_neither_the_loop_nor_the_blocks(rig: dict[str, Any]) -> None:
    consumer, routers, d_engine, p1 = rig["consumer"], rig["routers"], rig["d_engine"], rig["p1"]
    finished: set[str] = set()
    invalid: set[int] = set()
    causes: dict[str, tuple[str, str]] = {}

    def drain() -> None:
        done, bad, why = consumer.drain()
        finished.update(done)
        invalid.update(bad)
        causes.update(why)

    def spec(rid: str, engine: str, blocks: list[int]) -> PullSpec:
        return PullSpec(rid, f"x-{rid}", blocks, engine, rig["bootstrap"], len(blocks) * SPEC.block_size)

    p1.call("fill", value=7)
    consumer.start_pulls([spec("r1", "p1", P1_BLOCKS)])
    identity1, pull1 = routers["p1"].recv_pull()
    (op,) = write_ops(PagedKVLayout(SPEC, rig["d_kv"]), list(range(16)), pull1.block_ids, HEADS)  # P1's 0..15
    p1.send("write", peer=pull1.d_transfer_addr, token=pull1.grant_token,
            ops=[[op.src_offset, op.dst_region, op.dst_offset, op.length]], timeout=60)
    freeze_inside_the_read(d_engine, p1)
    routers["p1"].reply(identity1, pull1, Status.ERROR, err_msg="transport: write failed", cause="transport")
    # Meanwhile a healthy P2 serves another request through the same loop.
    t0 = time.monotonic()
    consumer.start_pulls([spec("r2", "p2", P2_BLOCKS)])
    identity2, pull2 = routers["p2"].recv_pull()
    p2_engine, p2_layout = rig["p2"]
    src = [0, 1, 2, 3]
    p2_engine.write(pull2.d_transfer_addr, pull2.grant_token, write_ops(p2_layout, src, pull2.block_ids, HEADS),
                    time.monotonic() + 10)
    routers["p2"].reply(identity2, pull2, Status.FINISH, ok_reqs=["r2"],
                        checksums=[p2_layout.checksum(b, HEADS) for b in src])
    while "r2" not in finished:
        assert time.monotonic() - t0 < 5, "P2's pull waited on P1's fence"
        time.sleep(0.005)
        drain()
    p2_s = time.monotonic() - t0
    assert "r2" not in causes
    # P1's request is held (its blocks stay allocated) while its read is still posted.
    time.sleep(1.0)
    drain()
    assert "r1" not in finished and d_engine.draining(pull1.grant_token)
    p1.signal(signal.SIGCONT)
    t0 = time.monotonic()
    while "r1" not in finished:
        assert time.monotonic() - t0 < 30, "P1's request never reported after its read ended"
        time.sleep(0.005)
        drain()
    assert causes["r1"][0] == "transport" and not d_engine.draining(pull1.grant_token)
    assert set(P1_BLOCKS) <= invalid and not invalid & set(P2_BLOCKS)
    print(f"\nhealthy P2's pull {p2_s * 1e3:.0f} ms while P1 froze mid-read; P1's request held until its read "
          f"ended, reported {(time.monotonic() - t0) * 1e3:.0f} ms after SIGCONT")


def test_a_host_that_quarantines_gets_the_failure_at_once_and_the_blocks_later(rig: dict[str, Any]) -> None:
    consumer, routers, d_engine, p1 = rig["consumer"], rig["routers"], rig["d_engine"], rig["p1"]
    consumer.outbox.quarantine = True  # what `PDWorker.quarantine_loads` does for a host that quarantines
    seen = Report()

    def drain() -> None:
        r = consumer.outbox.drain_report()
        seen.finished |= r.finished
        seen.loads.update(r.loads)
        seen.released |= r.released

    p1.call("fill", value=7)
    consumer.start_pulls([PullSpec("r1", "x-r1", P1_BLOCKS, "p1", rig["bootstrap"], len(P1_BLOCKS) * SPEC.block_size)])
    identity1, pull1 = routers["p1"].recv_pull()
    (op,) = write_ops(PagedKVLayout(SPEC, rig["d_kv"]), list(range(16)), pull1.block_ids, HEADS)
    p1.send("write", peer=pull1.d_transfer_addr, token=pull1.grant_token,
            ops=[[op.src_offset, op.dst_region, op.dst_offset, op.length]], timeout=60)
    freeze_inside_the_read(d_engine, p1)
    t0 = time.monotonic()
    routers["p1"].reply(identity1, pull1, Status.ERROR, err_msg="transport: write failed", cause="transport")
    while "r1" not in seen.finished:
        assert time.monotonic() - t0 < 5, "the failure waited for the read"
        time.sleep(0.005)
        drain()
    reported_s = time.monotonic() - t0
    assert {r for r, load in seen.loads.items() if load.quarantined} == {"r1"}
    assert seen.causes["r1"][0] == "transport" and set(P1_BLOCKS) <= seen.invalid
    # Released only once the read ended: not while P1 is stopped.
    drain()
    assert not seen.released and d_engine.draining(pull1.grant_token)
    p1.signal(signal.SIGCONT)
    t0 = time.monotonic()
    while "r1" not in seen.released:
        assert time.monotonic() - t0 < 30, "the quarantined blocks were never released after the read ended"
        time.sleep(0.005)
        drain()
    assert not d_engine.draining(pull1.grant_token) and seen.finished == {"r1"}
    print(f"\nfailure reported {reported_s * 1e3:.0f} ms after P's error reply, blocks released "
          f"{(time.monotonic() - t0) * 1e3:.0f} ms after SIGCONT")
