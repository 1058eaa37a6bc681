"""Byte-exact transfers with the TCP engine, coalescing, pooling, concurrency."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transfer_helpers import pattern

from kvferry.transfer.base import ByteRange, TransferError, TransferErrorCause, WriteOp, covered
from kvferry.transfer.tcp.engine import TcpTransferEngine

MiB = 1 << 20
Make = Callable[..., TcpTransferEngine]


def _pair(
    engines: Make, size: int = 4 * MiB
) -> tuple[TcpTransferEngine, TcpTransferEngine, np.ndarray, np.ndarray]:
    a, b = engines(), engines()
    src, dst = pattern(size, 1), np.zeros(size, np.uint8)
    a.register("src", src)
    b.register("dst", dst)
    return a, b, src, dst


@st.composite
def layouts(draw: st.DrawFn) -> tuple[int, list[int], list[int], bool]:
    bs = draw(st.sampled_from([1, 7, 512, 2048, 16384 + 3, 65536]))
    n_slots = min(64, (4 * MiB) // bs)
    n = draw(st.integers(1, n_slots))
    src_ids = draw(st.permutations(range(n_slots)))[:n]
    dst_ids = draw(st.permutations(range(n_slots)))[:n]
    if draw(st.booleans()):  # sorted ids make adjacent runs, which the sender coalesces
        src_ids, dst_ids = sorted(src_ids), sorted(dst_ids)
    return bs, src_ids, dst_ids, draw(st.booleans())


@pytest.fixture(scope="module")
def module_pair() -> Iterator[tuple[TcpTransferEngine, TcpTransferEngine]]:
    a, b = TcpTransferEngine(), TcpTransferEngine()
    yield a, b
    a.close()
    b.close()


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(layout=layouts())
def test_random_layouts_are_byte_exact(
    module_pair: tuple[TcpTransferEngine, TcpTransferEngine], layout: tuple[int, list[int], list[int], bool]
) -> None:
    a, b = module_pair
    bs, src_ids, dst_ids, two_regions = layout
    size = 64 * bs
    src, dst, dst2 = pattern(size, bs), np.zeros(size, np.uint8), np.zeros(size, np.uint8)
    a.register("src", src)
    b.register("dst", dst)
    b.register("dst2", dst2)
    try:
        regions = ["dst", "dst2"] if two_regions else ["dst"]
        ops = [
            WriteOp("src", s * bs, regions[k % len(regions)], d * bs, bs)
            for k, (s, d) in enumerate(zip(src_ids, dst_ids, strict=True))
        ]
        token = b.open_grant([ByteRange(r, 0, size) for r in regions])
        a.write(b.address, token, ops, time.monotonic() + 10)
        mems = {"dst": dst, "dst2": dst2}
        for op in ops:
            got = mems[op.dst_region][op.dst_offset : op.dst_offset + bs]
            assert np.array_equal(got, src[op.src_offset : op.src_offset + bs])
            assert covered(b.written(token), ByteRange(op.dst_region, op.dst_offset, bs))
        assert sum(r.length for r in b.close_grant(token)) == len(ops) * bs
        nonzero = sum(int(np.count_nonzero(m)) for m in mems.values())
        assert nonzero <= len(ops) * bs  # nothing outside the ops was written
    finally:
        a.unregister("src")
        b.unregister("dst")
        b.unregister("dst2")


def test_coalesced_run_across_adjacent_grants(engines: Make) -> None:
    a, b, src, dst = _pair(engines)
    token = b.open_grant([ByteRange("dst", 0, 4096), ByteRange("dst", 4096, 4096)])
    ops = [WriteOp("src", 0, "dst", 0, 4096), WriteOp("src", 4096, "dst", 4096, 4096)]
    a.write(b.address, token, ops, time.monotonic() + 5)
    assert np.array_equal(dst[:8192], src[:8192])
    assert b.close_grant(token) == [ByteRange("dst", 0, 8192)]
    assert b.stats["accepted_writes"] == 1


def test_pool_reuses_connections_and_concurrent_writes_use_several(engines: Make) -> None:
    a, b, src, dst = _pair(engines, 8 * MiB)
    token = b.open_grant([ByteRange("dst", 0, 8 * MiB)])
    for _ in range(3):
        a.write(b.address, token, [WriteOp("src", 0, "dst", 0, 1024)], time.monotonic() + 5)
    assert a.stats["connections_opened"] == 1
    errors: list[BaseException] = []

    def worker(k: int) -> None:
        try:
            ops = [
                WriteOp("src", (k * 256 + i) * 4096, "dst", (k * 256 + i) * 4096, 4096) for i in range(256)
            ]
            for _ in range(5):
                a.write(b.address, token, ops[::-1], time.monotonic() + 10)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert np.array_equal(dst[: 4 * MiB], src[: 4 * MiB])
    assert 1 <= a.stats["connections_opened"] <= 5


def test_invalid_local_requests(engines: Make) -> None:
    a, b, _, _ = _pair(engines)
    token = b.open_grant([ByteRange("dst", 0, 4096)])
    cases = [
        ("nope", [WriteOp("src", 0, "dst", 0, 1)]),
        (token, [WriteOp("missing", 0, "dst", 0, 1)]),
        (token, [WriteOp("src", 4 * MiB - 1, "dst", 0, 2)]),
        (token, [WriteOp("src", -1, "dst", 0, 2)]),
    ]
    for tok, ops in cases:
        with pytest.raises(TransferError) as exc:
            a.write(b.address, tok, ops, time.monotonic() + 5)
        assert exc.value.cause is TransferErrorCause.INVALID


def test_unreachable_peer_is_refused_fast(engines: Make) -> None:
    a, b, _, _ = _pair(engines)
    token = b.open_grant([ByteRange("dst", 0, 4096)])
    address = b.address
    b.close()
    t0 = time.monotonic()
    with pytest.raises(TransferError) as exc:
        a.write(address, token, [WriteOp("src", 0, "dst", 0, 1)], time.monotonic() + 5)
    assert exc.value.cause is TransferErrorCause.REFUSED
    assert time.monotonic() - t0 < 1.0


def test_closed_engine(engines: Make) -> None:
    a, b, _, _ = _pair(engines)
    token = b.open_grant([ByteRange("dst", 0, 4096)])
    a.close()
    with pytest.raises(TransferError) as exc:
        a.write(b.address, token, [WriteOp("src", 0, "dst", 0, 1)], time.monotonic() + 5)
    assert exc.value.cause is TransferErrorCause.CLOSED
