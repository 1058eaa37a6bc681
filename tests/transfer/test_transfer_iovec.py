"""The iovec-table path (`transfer.iovec`: sendmsg/recvmsg by address, no Python object per op) and the
memoryview path it replaces where libc is not usable: both land bytes exactly, count progress exactly
when a connection breaks mid-op, and stop at a closed grant."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest
from transfer_helpers import message, pattern, raw_connect, read_reply, wait_for

from kvferry.transfer.base import ByteRange, WriteOp
from kvferry.transfer.regions import RegionTable
from kvferry.transfer.tcp import iovec, wire
from kvferry.transfer.tcp import plan as tcp_plan
from kvferry.transfer.tcp.engine import TcpTransferEngine

Make = Callable[..., TcpTransferEngine]
SIZE = 1 << 20


@pytest.fixture(params=["iovec", "views"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    if request.param == "iovec" and not iovec.AVAILABLE:
        pytest.skip("no libc sendmsg/recvmsg here")
    if request.param == "views":
        monkeypatch.setattr(iovec, "AVAILABLE", False)
    yield request.param


def _pair(engines: Make) -> tuple[TcpTransferEngine, TcpTransferEngine, np.ndarray, np.ndarray]:
    a, b = engines(), engines()
    src, dst = pattern(SIZE, 5), np.zeros(SIZE, np.uint8)
    a.register("src", src)
    b.register("dst", dst)
    return a, b, src, dst


def test_advance_repoints_a_partly_done_row() -> None:
    iov = iovec.table(np.array([1000, 2000, 3000], np.uint64), np.array([10, 20, 30], np.uint64))
    ends = [10, 30, 60]
    assert iovec.advance(iov, ends, 0, 4) == 0 and iov[0].tolist() == [1004, 6]
    assert iovec.advance(iov, ends, 0, 7) == 0 and iov[0].tolist() == [1007, 3]  # again, same row
    assert iovec.advance(iov, ends, 0, 35) == 2 and iov[2].tolist() == [3005, 25]
    assert iov[1].tolist() == [2000, 20]  # a row that went through whole is left alone
    assert iovec.advance(iov, ends, 2, 60) == 3


def test_many_tiny_scattered_ops_are_byte_exact(engines: Make, path: str) -> None:
    """More ops than one call's iovecs (IOV_MAX), none adjacent, odd sizes."""
    a, b, src, dst = _pair(engines)
    rng = np.random.default_rng(7)
    slots = rng.permutation(SIZE // 64)[:5000]
    ops = [
        WriteOp("src", int(s) * 64 + 1, "dst", int(d) * 64 + 3, 7)
        for s, d in zip(slots, slots[::-1], strict=True)
    ]
    token = b.open_grant([ByteRange("dst", 0, SIZE)])
    a.write(b.address, token, ops, time.monotonic() + 10)
    for op in ops:
        assert np.array_equal(dst[op.dst_offset : op.dst_offset + 7], src[op.src_offset : op.src_offset + 7])
    assert int(np.count_nonzero(dst)) <= 7 * len(ops)
    assert sum(r.length for r in b.close_grant(token)) == 7 * len(ops)


def test_bytes_arriving_in_odd_pieces_land_exactly(engines: Make, path: str) -> None:
    """A sender that trickles the payload in pieces that split ops anywhere: exact bytes, exact progress."""
    _, b, src, dst = _pair(engines)
    token = b.open_grant([ByteRange("dst", 0, SIZE)])
    lens = [1, 5000, 3, 70000, 2048, 2048, 9]
    offs = [k * 100_000 + 11 for k in range(len(lens))]
    payload = src[: sum(lens)].tobytes()
    sock = raw_connect(b.address)
    sock.sendall(message(token, [("dst", o, n) for o, n in zip(offs, lens, strict=True)]))
    cuts = [0, 1, 2, 4000, 5004, 5005, 30000, 75004, 75010, 78000, len(payload)]
    for x, y in zip(cuts, cuts[1:], strict=False):
        sock.sendall(payload[x:y])
        pos, want, done = y, [], 0  # the exact prefix of ops that `y` payload bytes cover
        for o, n in zip(offs, lens, strict=True):
            if pos > done:
                want.append(ByteRange("dst", o, min(n, pos - done)))
            done += n
        if y < len(payload):
            wait_for(lambda w=want: b.written(token) == w, what=f"{y} bytes landing")  # type: ignore[misc]
    assert read_reply(sock)[:2] == (wire.Status.OK, wire.Code.OK)
    sock.close()
    pos = 0
    for o, n in zip(offs, lens, strict=True):
        assert dst[o : o + n].tobytes() == payload[pos : pos + n]
        pos += n
    assert int(np.count_nonzero(dst)) <= len(payload)


def test_break_mid_op_counts_the_exact_prefix(engines: Make, path: str) -> None:
    _, b, src, dst = _pair(engines)
    token = b.open_grant([ByteRange("dst", 0, SIZE)])
    ops = [("dst", 8192 * k, 2048) for k in range(40)]
    sock = raw_connect(b.address)
    sock.sendall(message(token, ops) + src[: 2048 * 17 + 100].tobytes())
    want = [ByteRange("dst", 8192 * k, 2048) for k in range(17)] + [ByteRange("dst", 8192 * 17, 100)]
    wait_for(lambda: b.written(token) == want, what="17 ops and 100 bytes")
    sock.close()
    wait_for(lambda: b.stats["incomplete_writes"] == 1, what="the server noticing")
    assert b.close_grant(token) == want
    assert np.array_equal(dst[8192 * 17 : 8192 * 17 + 100], src[2048 * 17 : 2048 * 17 + 100])
    assert not dst[8192 * 17 + 100 :].any()


def test_closed_grant_stops_the_rest(engines: Make, path: str) -> None:
    _, b, src, dst = _pair(engines)
    token = b.open_grant([ByteRange("dst", 0, SIZE)])
    ops = [("dst", 4096 * k, 1024) for k in range(8)]
    sock = raw_connect(b.address)
    sock.sendall(message(token, ops) + src[:3000].tobytes())
    wait_for(lambda: sum(r.length for r in b.written(token)) == 3000, what="3000 bytes")
    landed = b.close_grant(token)
    sock.sendall(src[3000 : 8 * 1024].tobytes())
    assert read_reply(sock)[:2] == (wire.Status.REJECTED, wire.Code.GRANT_CLOSED)
    sock.close()
    assert sum(r.length for r in landed) == 3000
    assert not dst[4096 * 2 + 3000 - 2048 :].any()  # nothing after the fence


def test_plan_builds_an_iovec_table_without_views(monkeypatch: pytest.MonkeyPatch) -> None:
    if not iovec.AVAILABLE:
        pytest.skip("no libc sendmsg/recvmsg here")
    regions = RegionTable()
    src = pattern(1 << 16, 1)
    region = regions.add("src", src)
    ops = [WriteOp("src", 4096 * k, "dst", 8192 * k, 100) for k in range(5)]
    (msg,) = tcp_plan.plan(regions, "ab" * 16, ops, time.monotonic() + 5)
    assert msg.views == [] and msg.iov is not None
    assert msg.iov[0].tolist() == [iovec.address(msg.head), len(msg.head)]
    assert msg.iov[1:].tolist() == [[region.addr + 4096 * k, 100] for k in range(5)]
    (auth,) = tcp_plan.plan(regions, "ab" * 16, ops, time.monotonic() + 5, auth=True)
    assert auth.iov is None and not auth.views and auth.rows is not None  # with a secret: one numpy gather
    assert auth.rows[1].tolist() == [4096 * k for k in range(5)] and auth.rows[0].shape[1] == 100


def test_send_all_goes_through_a_full_socket_buffer() -> None:
    """Partial sends (a small socket buffer, a slow reader) re-point rows; every byte arrives in order."""
    if not iovec.AVAILABLE:
        pytest.skip("no libc sendmsg/recvmsg here")
    a, b = socket.socketpair()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    src = pattern(1 << 20, 2)
    base = int(src.ctypes.data)
    offs = np.arange(0, 1 << 20, 1 << 14, dtype=np.uint64)
    iov = iovec.table(base + offs, np.full(len(offs), 5000, np.uint64))
    got = bytearray()

    def read() -> None:
        while len(got) < 5000 * len(offs):
            got.extend(b.recv(3333))
            time.sleep(0.0005)

    t = threading.Thread(target=read)
    t.start()
    calls: list[int] = []
    iovec.Io(a).send_all(iov, time.monotonic() + 10, calls.append)
    t.join(10)
    assert len(calls) > 1 and sum(calls) == 5000 * len(offs)
    assert bytes(got) == b"".join(src[int(o) : int(o) + 5000].tobytes() for o in offs)
    a.close()
    b.close()


def test_send_all_stops_at_the_deadline_when_nobody_reads() -> None:
    if not iovec.AVAILABLE:
        pytest.skip("no libc sendmsg/recvmsg here")
    a, b = socket.socketpair()
    src = pattern(1 << 22, 3)
    iov = iovec.table(np.array([src.ctypes.data], np.uint64), np.array([src.size], np.uint64))
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        iovec.Io(a).send_all(iov, t0 + 0.3, lambda n: None)
    assert 0.25 < time.monotonic() - t0 < 3
    a.close()
    b.close()
