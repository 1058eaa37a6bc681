"""Grants: rejected writes are counted and leave memory untouched; close_grant is a fence; progress."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import pytest
from transfer_helpers import message, pattern, raw_connect, read_reply, wait_for

from kvferry.transfer.base import ByteRange, TransferError, TransferErrorCause, WriteOp
from kvferry.transfer.tcp import wire
from kvferry.transfer.tcp.engine import TcpTransferEngine

Make = Callable[..., TcpTransferEngine]
SIZE = 1 << 20
Pair = tuple[TcpTransferEngine, TcpTransferEngine, np.ndarray, np.ndarray]


@pytest.fixture
def pair(engines: Make) -> Pair:
    a, b = engines(), engines()
    src, dst = pattern(SIZE, 3), np.zeros(SIZE, np.uint8)
    a.register("src", src)
    b.register("dst", dst)
    b.register("other", np.zeros(SIZE, np.uint8))
    return a, b, src, dst


def _rejected(a: TcpTransferEngine, b: TcpTransferEngine, token: str, op: WriteOp) -> None:
    before = b.stats["rejected_writes"]
    with pytest.raises(TransferError) as exc:
        a.write(b.address, token, [op], time.monotonic() + 5)
    assert exc.value.cause is TransferErrorCause.REJECTED
    assert b.stats["rejected_writes"] == before + 1


def test_rejections_are_counted_and_leave_memory_untouched(pair: Pair) -> None:
    a, b, src, dst = pair
    token = b.open_grant([ByteRange("dst", 4096, 4096)])
    _rejected(a, b, token, WriteOp("src", 0, "dst", 0, 4096))  # outside the grant
    _rejected(a, b, token, WriteOp("src", 0, "dst", 4096, 4097))  # runs past the grant
    _rejected(a, b, token, WriteOp("src", 0, "other", 4096, 16))  # granted region? no: other
    _rejected(a, b, token, WriteOp("src", 0, "ghost", 0, 16))  # unregistered region
    _rejected(a, b, token, WriteOp("src", 0, "dst", SIZE - 8, 16))  # past the region's end
    _rejected(a, b, "00" * 16, WriteOp("src", 0, "dst", 4096, 16))  # unknown token
    assert not dst.any()
    # The same connection pool still works for a valid write; then close and reject again.
    a.write(b.address, token, [WriteOp("src", 0, "dst", 4096, 4096)], time.monotonic() + 5)
    assert np.array_equal(dst[4096:8192], src[:4096])
    assert b.close_grant(token) == [ByteRange("dst", 4096, 4096)]
    dst[:] = 0
    _rejected(a, b, token, WriteOp("src", 0, "dst", 4096, 4096))  # after close
    assert not dst.any()


def test_unregistered_region_is_rejected(pair: Pair) -> None:
    a, b, _, dst = pair
    token = b.open_grant([ByteRange("other", 0, 4096)])
    b.unregister("other")
    _rejected(a, b, token, WriteOp("src", 0, "other", 0, 4096))
    with pytest.raises(TransferError):
        b.open_grant([ByteRange("other", 0, 1)])


def test_partial_write_then_break_reports_the_exact_prefix(pair: Pair) -> None:
    _, b, src, dst = pair
    token = b.open_grant([ByteRange("dst", 0, SIZE)])
    sock = raw_connect(b.address)
    ops = [("dst", 0, 4096), ("dst", 16384, 4096), ("dst", 65536, 4096)]
    sock.sendall(message(token, ops) + src[: 4096 + 1000].tobytes())
    prefix = [ByteRange("dst", 0, 4096), ByteRange("dst", 16384, 1000)]
    wait_for(lambda: b.written(token) == prefix, what="bytes landing")
    sock.close()  # the sender dies mid-op
    wait_for(lambda: b.stats["incomplete_writes"] == 1, what="the server noticing")
    assert b.written(token) == prefix
    assert b.stats["bytes_received"] == 5096
    assert np.array_equal(dst[:4096], src[:4096])
    assert np.array_equal(dst[16384 : 16384 + 1000], src[4096:5096])
    assert not dst[16384 + 1000 :].any()


def test_close_grant_fences_a_frozen_sender(pair: Pair) -> None:
    a, b, src, dst = pair
    token = b.open_grant([ByteRange("dst", 0, 8192)])
    sock = raw_connect(b.address)
    sock.sendall(message(token, [("dst", 0, 8192)]) + src[:1000].tobytes())
    wait_for(lambda: b.written(token) == [ByteRange("dst", 0, 1000)], what="the first 1000 bytes")
    assert b.close_grant(token) == [ByteRange("dst", 0, 1000)]
    sock.sendall(src[1000:8192].tobytes())  # the sender wakes up and sends the rest
    status, code, _ = read_reply(sock)
    assert (status, code) == (wire.Status.REJECTED, wire.Code.GRANT_CLOSED)
    assert np.array_equal(dst[:1000], src[:1000]) and not dst[1000:].any()
    # The connection was drained and still serves the next message.
    token2 = b.open_grant([ByteRange("dst", 0, 8192)])
    sock.sendall(message(token2, [("dst", 0, 8192)]) + src[:8192].tobytes())
    assert read_reply(sock)[:2] == (wire.Status.OK, wire.Code.OK)
    assert np.array_equal(dst[:8192], src[:8192])
    sock.close()


def test_grant_arguments_are_checked(pair: Pair) -> None:
    _, b, _, _ = pair
    for bad in (ByteRange("ghost", 0, 1), ByteRange("dst", SIZE - 1, 2), ByteRange("dst", -1, 1)):
        with pytest.raises(TransferError) as exc:
            b.open_grant([bad])
        assert exc.value.cause is TransferErrorCause.INVALID
    with pytest.raises(TransferError):
        b.written("00" * 16)
    with pytest.raises(TransferError):
        b.close_grant("00" * 16)
