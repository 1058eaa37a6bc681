"""Every branch of the decode-side failure spine, against a hand-driven fake P (a real ZMQ ROUTER and a
real TCP data plane) and a real bootstrap server. Each test ends with the request out of
WAITING_FOR_REMOTE_KVS (reported in finished_recving) and exactly the right invalid blocks."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import zmq

from kvferry.connector.auth import TO_DECODE, TO_PREFILL, Opener, Sealer
from kvferry.connector.bootstrap import FAIL_AFTER_S, REFUSED, BootstrapServer, Registration
from kvferry.connector.decode.consumer import Consumer
from kvferry.connector.decode.pulls import ConsumerConfig, PullMeta, PullSpec
from kvferry.connector.layout import KVCacheSpec, PagedKVLayout, overlap, write_ops
from kvferry.connector.loads import LoadCause
from kvferry.connector.messages import PullRequest, PullResponse, Status, decode_inbound, encode
from kvferry.connector.metrics import Metrics
from kvferry.transfer.tcp.engine import TcpTransferEngine
from procs import free_port

SPEC = KVCacheSpec(num_blocks=32, num_layers=2, num_kv_heads=4, block_size=4, head_dim=8)
ENGINE_ID = "fake-p"


class FakePRank:
    """A P rank driven by the test: receives pulls, writes blocks, answers what the test says."""

    def __init__(self, ctx: zmq.Context[Any], rank: int, p_tp: int, kv: np.ndarray) -> None:
        self.rank, self.p_tp = rank, p_tp
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.addr = f"tcp://127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"
        self.layout = PagedKVLayout(SPEC, kv)
        self.sealer, self.opener = Sealer(None, TO_DECODE), Opener(None, TO_PREFILL)
        self.engine = TcpTransferEngine()
        for name, buf in self.layout.regions().items():
            self.engine.register(name, buf)

    def recv(self, timeout: float = 10.0) -> tuple[bytes, Any]:
        assert self.sock.poll(int(timeout * 1000)), "no message from D"
        identity, data = self.sock.recv_multipart()
        return identity, decode_inbound(self.opener.open(data))

    def recv_pull(self) -> tuple[bytes, PullRequest]:
        identity, msg = self.recv()
        assert isinstance(msg, PullRequest), msg
        return identity, msg

    def heads(self, pull: PullRequest) -> tuple[int, int]:
        heads = overlap(SPEC.num_kv_heads, self.p_tp, self.rank, pull.d_tp_size, pull.d_tp_rank)
        assert heads is not None
        return heads

    def write(self, pull: PullRequest, src_blocks: list[int], upto: int | None = None) -> list[int]:
        """Write blocks [0, upto) of the pull; returns the checksums of all its blocks."""
        heads = self.heads(pull)
        n = len(pull.block_ids) if upto is None else upto
        ops = write_ops(self.layout, src_blocks[:n], pull.block_ids[:n], heads)
        if ops:
            self.engine.write(pull.d_transfer_addr, pull.grant_token, ops, time.monotonic() + 5)
        return [self.layout.checksum(b, heads) for b in src_blocks[: len(pull.block_ids)]]

    def reply(self, identity: bytes, pull: PullRequest, status: Status, **kw: Any) -> None:
        resp = PullResponse(status, pull.d_request_id, pull.transfer_id, **kw)
        self.sock.send_multipart([identity, self.sealer.seal(encode(resp))])

    def close(self) -> None:
        self.sock.close(0)
        self.engine.close()


@dataclass
class Rig:
    consumer: Consumer
    ranks: list[FakePRank]
    bootstrap_addr: str
    d_kv: np.ndarray
    p_kv: np.ndarray
    metrics: Metrics
    finished: set[str] = field(default_factory=set)
    invalid: set[int] = field(default_factory=set)
    causes: dict[str, tuple[str, str]] = field(default_factory=dict)

    def pull(self, request_id: str, block_ids: list[int], transfer_id: str | None = None, engine_id: str = ENGINE_ID,
             bootstrap_addr: str | None = None) -> PullSpec:
        spec = PullSpec(request_id, transfer_id or f"xfer-{request_id}", block_ids, engine_id,
                        bootstrap_addr or self.bootstrap_addr, len(block_ids) * SPEC.block_size)
        self.consumer.start_pulls([spec])
        return spec

    def drain(self) -> None:
        finished, invalid, causes = self.consumer.drain()
        assert finished.isdisjoint(self.finished), "a request was reported twice"
        self.finished |= finished
        self.invalid |= invalid
        self.causes.update(causes)

    def wait_finished(self, request_id: str, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while request_id not in self.finished:
            assert time.monotonic() < deadline, f"{request_id} never left WAITING_FOR_REMOTE_KVS"
            time.sleep(0.005)
            self.drain()

    def failures(self, cause: str) -> float:
        return self.metrics.kv_load_failures.labels(cause=cause)._value.get()

    def on_loop(self, fn: Callable[[], Any]) -> Any:
        async def call() -> Any:
            return fn()

        return asyncio.run_coroutine_threadsafe(call(), self.consumer.loop).result(timeout=10)


@contextmanager
def make_rig(p_tp: int = 1, d_tp: int = 1, **config: Any) -> Iterator[Rig]:
    ctx: zmq.Context[Any] = zmq.Context()
    rng = np.random.default_rng(0)
    p_kv = rng.standard_normal(SPEC.shape, dtype=np.float32)
    d_kv = np.zeros(SPEC.shape, dtype=np.float32)
    ranks = [FakePRank(ctx, r, p_tp, p_kv) for r in range(p_tp)]
    server = BootstrapServer("127.0.0.1", free_port())
    for r in ranks:
        server.register(Registration(ENGINE_ID, p_tp, r.rank, r.addr, "00" * 16))  # no secret: no receiver checked
    server.start()
    metrics = Metrics()
    engines = [TcpTransferEngine() for _ in range(d_tp)]
    defaults: dict[str, Any] = {"recv_timeout_s": 5.0, "kv_load_deadline_s": 10.0}
    consumer = Consumer(PagedKVLayout(SPEC, d_kv), engines, ConsumerConfig(d_tp, **{**defaults, **config}), metrics)
    try:
        yield Rig(consumer, ranks, f"127.0.0.1:{server.port}", d_kv, p_kv, metrics)
    finally:
        consumer.close()
        for e in engines:
            e.close()
        for r in ranks:
            r.close()
        server.stop()
        ctx.term()


@pytest.fixture()
def rig() -> Iterator[Rig]:
    with make_rig() as r:
        yield r


D_BLOCKS = [5, 9, 2, 17]
P_BLOCKS = [1, 2, 3, 4]


def test_success_writes_exact_bytes_and_reports_only_finished(rig: Rig) -> None:
    rig.pull("r", D_BLOCKS)
    p = rig.ranks[0]
    identity, pull = p.recv_pull()
    assert pull.block_ids == D_BLOCKS and pull.d_tp_size == 1
    sums = p.write(pull, P_BLOCKS)
    p.reply(identity, pull, Status.FINISH, ok_reqs=["r"], checksums=sums)
    rig.wait_finished("r")
    assert rig.invalid == set() and rig.causes == {}
    np.testing.assert_array_equal(rig.d_kv[D_BLOCKS], rig.p_kv[P_BLOCKS])
    assert rig.consumer.pending_pulls == 0


def test_error_reply_fails_every_block(rig: Rig) -> None:
    rig.pull("r", D_BLOCKS)
    identity, pull = rig.ranks[0].recv_pull()
    rig.ranks[0].reply(identity, pull, Status.ERROR, err_msg="P num blocks less than D")
    rig.wait_finished("r")
    assert rig.invalid == set(D_BLOCKS)
    assert rig.causes["r"][0] == "error_reply" and "P num blocks less than D" in rig.causes["r"][1]
    assert rig.failures("error_reply") == 1


def test_err_reqs_fails_the_request(rig: Rig) -> None:
    rig.pull("r", D_BLOCKS)
    identity, pull = rig.ranks[0].recv_pull()
    rig.ranks[0].reply(identity, pull, Status.FINISH, err_reqs=["r"], err_msg="Timeout waiting for P side ready.")
    rig.wait_finished("r")
    assert rig.invalid == set(D_BLOCKS) and rig.causes["r"][0] == "err_reqs"


def test_transport_break_invalidates_only_unwritten_blocks(rig: Rig) -> None:
    rig.pull("r", D_BLOCKS)
    p = rig.ranks[0]
    identity, pull = p.recv_pull()
    sums = p.write(pull, P_BLOCKS, upto=2)
    p.reply(identity, pull, Status.ERROR, err_msg="transport: reset after 2 blocks", checksums=sums)
    rig.wait_finished("r")
    assert rig.causes["r"][0] == "transport"
    assert rig.invalid == set(D_BLOCKS[2:])
    np.testing.assert_array_equal(rig.d_kv[D_BLOCKS[:2]], rig.p_kv[P_BLOCKS[:2]])


def test_corrupted_block_fails_checksum_and_only_that_block(rig: Rig) -> None:
    rig.pull("r", D_BLOCKS)
    p = rig.ranks[0]
    identity, pull = p.recv_pull()
    sums = p.write(pull, P_BLOCKS)
    sums[1] ^= 1  # what P claims differs from what landed
    p.reply(identity, pull, Status.FINISH, ok_reqs=["r"], checksums=sums)
    rig.wait_finished("r")
    assert rig.causes["r"][0] == "checksum" and rig.invalid == {D_BLOCKS[1]}


def test_bytes_without_p_checksums_count_for_nothing() -> None:
    """P wrote every block and died (or never answered) before its checksums came: the bytes are
    unverified, so no block counts as loaded. Before, a block whose bytes all landed counted, and D
    decoded from a block P's own engine had written wrong (#30's lifecycle machine: the `corrupt` fault,
    then P killed before its answer, and both D ranks sampled with wrong KV, no load failure)."""
    with make_rig(recv_timeout_s=0.3, heartbeat_timeout_s=0) as rig:
        rig.pull("r", D_BLOCKS)
        p = rig.ranks[0]
        _, pull = p.recv_pull()
        p.write(pull, P_BLOCKS)
        p.write(pull, [P_BLOCKS[0]] * len(P_BLOCKS))  # wrong bytes over every block, by P's own engine
        rig.wait_finished("r")  # and P never answers
        assert rig.causes["r"][0] == "recv_timeout" and rig.invalid == set(D_BLOCKS)


def test_without_checksums_asked_the_landed_bytes_count() -> None:
    """`checksums: false` is the operator's choice: coverage alone judges the blocks then."""
    with make_rig(recv_timeout_s=0.3, heartbeat_timeout_s=0, checksums=False) as rig:
        rig.pull("r", D_BLOCKS)
        p = rig.ranks[0]
        _, pull = p.recv_pull()
        assert not pull.want_checksums
        p.write(pull, P_BLOCKS, upto=2)
        rig.wait_finished("r")
        assert rig.causes["r"][0] == "recv_timeout" and rig.invalid == set(D_BLOCKS[2:])


def test_receive_timeout() -> None:
    """With liveness off (heartbeat timeout 0, as in vLLM's own connectors) nothing says P lives: its
    silence past `recv_timeout_s` fails the pull. With liveness on, a live P is asked again instead
    (`test_adaptive_liveness.py`)."""
    with make_rig(recv_timeout_s=0.3, heartbeat_timeout_s=0) as rig:
        rig.pull("r", D_BLOCKS)
        rig.ranks[0].recv_pull()  # and never answer
        rig.wait_finished("r")
        assert rig.causes["r"][0] == "recv_timeout" and rig.invalid == set(D_BLOCKS)


def test_deadline_bounds_the_whole_load() -> None:
    with make_rig(recv_timeout_s=30.0, kv_load_deadline_s=0.3) as rig:
        rig.pull("r", D_BLOCKS)
        identity, pull = rig.ranks[0].recv_pull()
        rig.ranks[0].reply(identity, pull, Status.CONTINUE)  # alive, but never finishes
        rig.wait_finished("r")
        assert rig.causes["r"][0] == "deadline" and rig.invalid == set(D_BLOCKS)
        assert "P rank 0: writing for" in rig.causes["r"][1]  # the message names where it stalled


def test_deadline_names_a_pull_p_never_answered() -> None:
    with make_rig(recv_timeout_s=30.0, kv_load_deadline_s=0.3) as rig:
        rig.pull("r", D_BLOCKS)
        rig.ranks[0].recv_pull()  # received, never answered
        rig.wait_finished("r")
        assert rig.causes["r"][0] == "deadline"
        assert "P rank 0: pull not answered" in rig.causes["r"][1]


def test_bootstrap_outside_the_allow_list_is_never_asked(rig: Rig) -> None:
    """vLLM's requests reach the consumer without the HTTP edge's 400: it refuses them itself."""
    rig.pull("r", D_BLOCKS, bootstrap_addr="192.0.2.7:8998")
    rig.wait_finished("r", timeout=FAIL_AFTER_S + 2)
    assert rig.causes["r"] == ("bootstrap", REFUSED)  # the answer of every failed target: no port oracle
    assert rig.invalid == set(D_BLOCKS)


def test_bootstrap_unknown_engine(rig: Rig) -> None:
    rig.pull("r", D_BLOCKS, engine_id="no-such-engine")
    rig.wait_finished("r")
    assert rig.causes["r"] == ("bootstrap", REFUSED)  # a server that never answered validly: no details
    rig.pull("ok", D_BLOCKS)  # once it did, its failures come at once and with their reason
    identity, pull = rig.ranks[0].recv_pull()
    rig.ranks[0].reply(identity, pull, Status.FINISH, ok_reqs=["ok"], checksums=rig.ranks[0].write(pull, P_BLOCKS))
    rig.wait_finished("ok")
    started = time.monotonic()
    rig.pull("r2", D_BLOCKS, engine_id="no-such-engine")
    rig.wait_finished("r2")
    assert rig.causes["r2"][0] == "bootstrap" and "unknown engine" in rig.causes["r2"][1]
    assert time.monotonic() - started < FAIL_AFTER_S
    assert rig.invalid == set(D_BLOCKS)


def test_oversized_pull_is_failed_on_d_and_never_sent(rig: Rig) -> None:
    """A pull over the control-message limit costs that request alone (issue 13.6)."""
    rig.pull("big", D_BLOCKS, transfer_id="x" * (2 << 20))
    rig.wait_finished("big")
    assert rig.causes["big"][0] == "error_reply" and "exceeds" in rig.causes["big"][1]
    assert not rig.ranks[0].sock.poll(200), "the oversized pull must not reach P"
    rig.pull("r", D_BLOCKS)  # the next pull to the same P is unaffected
    identity, pull = rig.ranks[0].recv_pull()
    rig.ranks[0].reply(identity, pull, Status.FINISH, ok_reqs=["r"], checksums=rig.ranks[0].write(pull, P_BLOCKS))
    rig.wait_finished("r")
    assert "r" not in rig.causes


def test_bootstrap_unreachable(rig: Rig) -> None:
    rig.pull("r", D_BLOCKS, bootstrap_addr=f"127.0.0.1:{free_port()}")
    rig.wait_finished("r")
    assert rig.causes["r"] == ("bootstrap", REFUSED)


def test_exception_in_the_receiver_still_releases_the_request(rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*args: object) -> None:
        raise RuntimeError("receiver bug")

    monkeypatch.setattr(rig.consumer, "_send_pulls", boom)
    rig.pull("r", D_BLOCKS)
    rig.wait_finished("r")
    assert rig.causes["r"][0] == "transport" and "receiver bug" in rig.causes["r"][1]
    assert rig.invalid == set(D_BLOCKS)


def test_same_request_failed_twice_is_counted_and_reported_once(rig: Rig) -> None:
    rig.pull("r", D_BLOCKS)
    rig.ranks[0].recv_pull()
    pull: PullMeta = rig.on_loop(lambda: rig.consumer._pulls["r"])
    rig.on_loop(lambda: rig.consumer._handle_failed_recv([pull], LoadCause.PEER_DEAD, "gone"))
    rig.on_loop(lambda: rig.consumer._handle_failed_recv([pull, pull], LoadCause.TRANSPORT, "again"))
    rig.wait_finished("r")
    time.sleep(0.05)
    rig.drain()  # a second report would trip the assertion in drain()
    assert rig.causes == {"r": ("peer_dead", "gone")}
    assert rig.failures("peer_dead") == 1 and rig.failures("transport") == 0


def test_release_only_pull_failure_reports_nothing(rig: Rig) -> None:
    """A release-only pull loads no KV: its failure is neither reported to the scheduler nor counted as a
    KV-load failure (the request it releases was counted once already, if it failed)."""
    rig.pull("r", [], engine_id="no-such-engine")
    deadline = time.monotonic() + 5
    while rig.consumer.pending_pulls:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    rig.drain()
    assert rig.finished == set() and rig.invalid == set() and rig.causes == {}
    assert rig.failures("bootstrap") == 0


def test_release_only_pull_success_reports_nothing(rig: Rig) -> None:
    rig.pull("r", [])
    identity, pull = rig.ranks[0].recv_pull()
    assert pull.block_ids == []
    rig.ranks[0].reply(identity, pull, Status.FINISH, ok_reqs=["r"])
    deadline = time.monotonic() + 5
    while rig.consumer.pending_pulls:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    rig.drain()
    assert rig.finished == set()


@pytest.mark.parametrize("ok_first", [True, False])
def test_ok_from_one_p_rank_after_another_failed_never_completes(ok_first: bool) -> None:
    with make_rig(p_tp=2, d_tp=1) as rig:
        rig.pull("r", D_BLOCKS)
        (id0, pull0), (id1, pull1) = rig.ranks[0].recv_pull(), rig.ranks[1].recv_pull()
        meta: PullMeta = rig.on_loop(lambda: rig.consumer._pulls["r"])
        assert meta.pull_tasks_count == 2
        sums1 = rig.ranks[1].write(pull1, P_BLOCKS)
        if ok_first:
            rig.ranks[1].reply(id1, pull1, Status.FINISH, ok_reqs=["r"], checksums=sums1)
            deadline = time.monotonic() + 5
            while rig.on_loop(lambda: meta.pull_tasks_count) != 1:
                assert time.monotonic() < deadline
                time.sleep(0.005)
            rig.ranks[0].reply(id0, pull0, Status.ERROR, err_msg="rank 0 failed")
        else:
            rig.ranks[0].reply(id0, pull0, Status.ERROR, err_msg="rank 0 failed")
            rig.wait_finished("r")
            rig.ranks[1].reply(id1, pull1, Status.FINISH, ok_reqs=["r"], checksums=sums1)
        rig.wait_finished("r")
        time.sleep(0.05)
        rig.drain()
        assert rig.causes["r"][0] == "error_reply"
        assert rig.invalid == set(D_BLOCKS)  # rank 0's heads never arrived in any block
        assert meta.failed and meta.pull_tasks_count >= 0


def test_tp_mismatch_two_p_ranks_fill_one_d_rank() -> None:
    with make_rig(p_tp=2, d_tp=1) as rig:
        rig.pull("r", D_BLOCKS)
        for p in rig.ranks:
            identity, pull = p.recv_pull()
            sums = p.write(pull, P_BLOCKS)
            p.reply(identity, pull, Status.FINISH, ok_reqs=["r"], checksums=sums)
        rig.wait_finished("r")
        assert rig.invalid == set()
        np.testing.assert_array_equal(rig.d_kv[D_BLOCKS], rig.p_kv[P_BLOCKS])


def test_abort_while_pulling_reports_finished_and_releases_p(rig: Rig) -> None:
    rig.pull("r", D_BLOCKS)
    rig.ranks[0].recv_pull()
    rig.consumer.abort(["r"])
    rig.wait_finished("r")
    _, release = rig.ranks[0].recv()
    assert release.transfer_ids == ["xfer-r"]
    assert rig.causes == {}


def test_outbox_stays_bounded_through_10000_failures(rig: Rig) -> None:
    """10,000 failed pulls, drained as the engine would every step: nothing accumulates."""

    def fail_batch(start: int, n: int) -> None:
        for i in range(start, start + n):
            spec = PullSpec(f"r{i}", f"x{i}", [i % SPEC.num_blocks], ENGINE_ID, rig.bootstrap_addr, 4)
            meta = PullMeta(spec, time.monotonic(), time.monotonic() + 60)
            rig.consumer._pulls[spec.request_id] = meta
            rig.consumer._handle_failed_recv([meta], LoadCause.TRANSPORT, "boom")

    total = 0
    for start in range(0, 10_000, 500):
        rig.on_loop(lambda start=start: fail_batch(start, 500))
        finished, invalid, causes = rig.consumer.drain()
        assert len(finished) == len(causes) == 500 and len(invalid) <= SPEC.num_blocks
        total += len(finished)
    assert total == 10_000
    assert rig.consumer.drain() == (set(), set(), {})
    assert rig.consumer.pending_pulls == 0
    assert rig.failures("transport") == 10_000
