"""Hostile input: malformed, truncated, oversized and wrong-typed control messages, unknown transfers,
out-of-range and duplicate block ids. The producer answers errors and keeps serving; nothing leaks;
nothing is written outside a grant."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import msgspec
import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvferry.connector.bootstrap import BootstrapServer, Registration
from kvferry.connector.faults import FaultSpec
from kvferry.connector.layout import KVCacheSpec, PagedKVLayout
from kvferry.connector.messages import (
    MAX_FRAME_BYTES,
    MAX_MESSAGE_BYTES,
    PullRequest,
    Release,
    Status,
    decode_response,
    encode,
)
from kvferry.connector.metrics import Metrics
from kvferry.connector.prefill.producer import Producer
from kvferry.transfer.base import ByteRange
from kvferry.transfer.tcp.engine import TcpTransferEngine
from procs import free_port
from sealed import Sealed

SPEC = KVCacheSpec(num_blocks=16, num_layers=2, num_kv_heads=4, block_size=4, head_dim=8)


class Rig:
    def __init__(self, abort_timeout_s: float = 0.3, secret: bytes | None = None) -> None:
        rng = np.random.default_rng(1)
        self.p_kv = rng.standard_normal(SPEC.shape, dtype=np.float32)
        self.p_engine = TcpTransferEngine(secret=secret or b"")
        self.producer = Producer(PagedKVLayout(SPEC, self.p_kv), [self.p_engine], "127.0.0.1", abort_timeout_s, FaultSpec(),
                                 Metrics(), secret)
        self.d_kv = np.zeros(SPEC.shape, dtype=np.float32)
        self.d_engine = TcpTransferEngine(secret=secret or b"")
        self.d_engine.register("kv", self.d_kv)
        self.ctx: zmq.Context[Any] = zmq.Context()
        raw = self.ctx.socket(zmq.DEALER)
        raw.setsockopt(zmq.LINGER, 0)
        self.sock = Sealed(raw, secret)
        self.sock.connect(self.producer.control_addrs[0], self.producer.boot_ids[0])

    def ask(self, data: bytes | list[bytes], timeout: float = 5.0) -> Any:
        if isinstance(data, list):
            self.sock.send_multipart(data)
        else:
            self.sock.send(data)
        deadline = time.monotonic() + timeout
        while True:
            assert self.sock.poll(int(max(0.0, deadline - time.monotonic()) * 1000)), "no answer from P"
            message = decode_response(self.sock.recv())
            if getattr(message, "status", None) != Status.CONTINUE:
                return message

    def pull(self, transfer_id: str, block_ids: list[int], num_tokens: int | None = None, **kw: Any) -> bytes:
        grant = self.d_engine.open_grant([ByteRange("kv", b * SPEC.block_bytes, SPEC.block_bytes) for b in block_ids if 0 <= b < 16])
        fields: dict[str, Any] = {
            "transfer_id": transfer_id,
            "d_request_id": f"d-{transfer_id}",
            "d_transfer_addr": self.d_engine.address,
            "grant_token": grant,
            "block_ids": block_ids,
            "d_num_blocks": SPEC.num_blocks,
            "d_tp_size": 1,
            "d_tp_rank": 0,
            "num_tokens": len(block_ids) * SPEC.block_size if num_tokens is None else num_tokens,
        }
        fields.update(kw)
        return encode(PullRequest(**fields))

    def check_still_serving(self, n: int = 0) -> None:
        """A valid transfer still works end to end after whatever came before."""
        tid = f"good-{n}-{time.monotonic_ns()}"
        self.producer.add_ready(tid, f"p-{tid}", [3, 4], 2 * SPEC.block_size)
        reply = self.ask(self.pull(tid, [7, 1]))
        assert reply.status == Status.FINISH and reply.ok_reqs == [f"d-{tid}"], reply
        np.testing.assert_array_equal(self.d_kv[[7, 1]], self.p_kv[[3, 4]])
        self.wait_no_transfers()

    def wait_no_transfers(self, timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        while len(self.producer.table):
            assert time.monotonic() < deadline, f"transfers leaked: {self.producer.table.ids()}"
            time.sleep(0.01)

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()
        self.producer.close()
        self.p_engine.close()
        self.d_engine.close()


@pytest.fixture(scope="module")
def rig() -> Iterator[Rig]:
    r = Rig()
    try:
        yield r
    finally:
        r.close()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(max_size=300))
def test_random_bytes_get_an_error_reply(rig: Rig, data: bytes) -> None:
    try:
        msgspec.msgpack.decode(data, type=PullRequest | Release)
        return  # hypothesis found a valid message; nothing to check
    except (msgspec.DecodeError, msgspec.ValidationError):
        pass
    reply = rig.ask(data)
    assert reply.status == Status.ERROR and reply.err_msg.startswith("malformed message")


@pytest.mark.parametrize(
    "payload",
    [
        msgspec.msgpack.encode({"type": "pull", "transfer_id": 5}),
        msgspec.msgpack.encode({"type": "nope"}),
        msgspec.msgpack.encode([1, 2, 3]),
        msgspec.msgpack.encode({"type": "pull", "transfer_id": "x", "d_request_id": "y", "d_transfer_addr": "a",
                                "grant_token": "t", "block_ids": ["1"], "d_num_blocks": 4, "d_tp_size": 1,
                                "d_tp_rank": 0, "num_tokens": 4}),
        b"",
    ],
)
def test_wrong_typed_and_truncated_messages(rig: Rig, payload: bytes) -> None:
    reply = rig.ask(payload)
    assert reply.status == Status.ERROR
    rig.check_still_serving()


def test_truncated_valid_message_and_extra_frames(rig: Rig) -> None:
    valid = rig.pull("t-trunc", [1])
    assert rig.ask(valid[: len(valid) // 2]).status == Status.ERROR
    assert rig.ask([b"a", b"b"]).status == Status.ERROR
    rig.check_still_serving()


def test_oversized_message_gets_its_own_error_and_the_connection_survives(rig: Rig) -> None:
    """A message over MAX_MESSAGE_BYTES (issue 13.6) but within ZMQ's frame limit (the message limit and
    the envelope: issue 31.5) costs that message an ERROR naming it, nothing else."""
    big = "x" * (MAX_MESSAGE_BYTES + 100)
    reply = rig.ask(encode(Release([big])))
    assert reply.status == Status.ERROR and "exceeds" in reply.err_msg
    reply = rig.ask(rig.pull("t-over", [1], d_transfer_addr="h" * MAX_MESSAGE_BYTES))
    assert reply.status == Status.ERROR and "exceeds" in reply.err_msg
    assert (reply.transfer_id, reply.d_request_id) == ("t-over", "d-t-over"), "the ERROR names its pull"
    rig.check_still_serving()  # same DEALER, no reconnect needed


def test_frame_over_the_zmq_limit_drops_only_that_connection(rig: Rig) -> None:
    rig.sock.send(b"\x00" * (MAX_FRAME_BYTES + 1))  # over ZMQ's MAXMSGSIZE: P drops that connection
    deadline = time.monotonic() + 10
    while True:
        try:
            rig.check_still_serving()
            return
        except AssertionError:
            assert time.monotonic() < deadline
            time.sleep(0.1)  # the DEALER reconnects by itself


@pytest.mark.parametrize(
    ("block_ids", "extra", "needle"),
    [
        ([1, 99], {}, "out of range"),
        ([-1], {}, "out of range"),
        ([2, 2], {}, "duplicate"),
        ([1, 2], {"num_tokens": 40}, "block ids for"),
        ([1], {"num_tokens": 1 << 60}, "more blocks than P's pool"),
        # Past D's prefix-cache hit: a first block inside the prompt, and as many ids as blocks after it.
        ([1], {"num_tokens": 8, "first_block": -1}, "first_block -1 out of range [0, 2)"),
        ([1], {"num_tokens": 8, "first_block": 2}, "first_block 2 out of range [0, 2)"),
        ([1], {"num_tokens": 8, "first_block": 1 << 62}, "out of range"),
        ([], {"num_tokens": 8, "first_block": 5}, "out of range"),
        ([1, 2], {"num_tokens": 8, "first_block": 1}, "2 block ids for 8 tokens from block 1"),
        ([1], {"d_tp_size": 3}, "does not divide"),
        ([1], {"d_tp_rank": 5}, "out of range"),
    ],
)
def test_bad_block_ids_and_layouts_get_error_and_nothing_written(rig: Rig, block_ids: list[int], extra: dict[str, Any], needle: str) -> None:
    tid = f"bad-{block_ids}-{extra}"
    rig.producer.add_ready(tid, f"p-{tid}", [5, 6], 2 * SPEC.block_size)
    before = rig.d_kv.copy()
    reply = rig.ask(rig.pull(tid, block_ids, **extra))
    assert reply.status == Status.ERROR and needle in reply.err_msg, reply
    np.testing.assert_array_equal(rig.d_kv, before)
    rig.sock.send(encode(Release([tid])))  # what D does after a failed pull
    rig.wait_no_transfers()
    assert f"p-{tid}" in rig.producer.drain_finished()


def test_pull_past_ds_prefix_hit_writes_only_the_blocks_after_it(rig: Rig) -> None:
    """D holds the prompt's first block already: it names one block, and P writes its second block
    there, with the checksum of that block alone, and nothing else."""
    rig.producer.add_ready("past-hit", "p-past-hit", [5, 6], 2 * SPEC.block_size)
    before = rig.d_kv.copy()
    reply = rig.ask(rig.pull("past-hit", [9], num_tokens=2 * SPEC.block_size, first_block=1))
    assert reply.status == Status.FINISH and reply.ok_reqs == ["d-past-hit"], reply
    assert reply.bytes_written == SPEC.block_bytes and len(reply.checksums) == 1
    np.testing.assert_array_equal(rig.d_kv[9], rig.p_kv[6])
    untouched = [b for b in range(SPEC.num_blocks) if b != 9]
    np.testing.assert_array_equal(rig.d_kv[untouched], before[untouched])
    rig.wait_no_transfers()
    rig.check_still_serving()


def test_unknown_transfer_is_answered_not_ready_after_abort_timeout(rig: Rig) -> None:
    reply = rig.ask(rig.pull("never-prefilled", [1]))
    assert reply.status == Status.FINISH and reply.err_reqs == ["d-never-prefilled"]
    assert "Timeout waiting for P side ready" in reply.err_msg
    rig.wait_no_transfers()


def test_never_pulled_transfer_expires_and_is_counted(rig: Rig) -> None:
    before = rig.producer.metrics.kv_leases_expired._value.get()
    rig.producer.add_ready("orphan", "p-orphan", [1, 2], 8)
    rig.wait_no_transfers()
    assert "p-orphan" in rig.producer.drain_finished()
    assert rig.producer.metrics.kv_leases_expired._value.get() == before + 1


def test_write_outside_grant_is_rejected_by_d() -> None:
    """A P that writes blocks D never granted gets an error; D's memory is untouched."""
    r = Rig()
    try:
        r.producer.add_ready("sneaky", "p-sneaky", [1, 2], 8)
        grant = r.d_engine.open_grant([ByteRange("kv", 0, SPEC.block_bytes)])  # only block 0
        pull = PullRequest("sneaky", "d-sneaky", r.d_engine.address, grant, [0, 9], SPEC.num_blocks, 1, 0, 8)
        before = r.d_kv.copy()
        reply = r.ask(encode(pull))
        assert reply.status == Status.ERROR and reply.err_msg.startswith("transport")
        np.testing.assert_array_equal(r.d_kv[1:], before[1:])
        assert r.d_engine.stats["rejected_writes"] >= 1
        r.wait_no_transfers()
    finally:
        r.close()


def test_bootstrap_has_no_registration_route_and_rejects_bad_queries() -> None:
    server = BootstrapServer("127.0.0.1", free_port())
    server.start()
    try:
        base = f"http://127.0.0.1:{server.port}"
        ok = {"engine_id": "e", "tp_size": 1, "tp_rank": 0, "control_addr": "tcp://127.0.0.1:1", "boot": "00" * 16}
        # Ranks register in-process: a stranger cannot point D at its own control address.
        assert httpx.post(f"{base}/register", json=ok).status_code in (404, 405)
        assert httpx.get(f"{base}/query").json() == {}  # no engine has registered yet
        assert httpx.get(f"{base}/query", params={"engine_id": "nobody"}).status_code == 404
        with pytest.raises(ValueError):
            server.register(Registration("e", 1, 4, "tcp://x:1", "00" * 16))
        with pytest.raises(ValueError, match="boot"):  # a boot id is 16 bytes of lowercase hex
            server.register(Registration("e", 1, 0, "tcp://x:1", "00" * 15))
        server.register(Registration(**ok))  # type: ignore[arg-type]
        assert httpx.get(f"{base}/query", params={"engine_id": "e"}).json()["tp_size"] == 1
        # Without engine_id (vllm-router's Mooncake mode, sglang's D): engines by data-parallel rank.
        assert httpx.get(f"{base}/query").json()["0"]["engine_id"] == "e"
    finally:
        server.stop()
