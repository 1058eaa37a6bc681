"""The NIXL engine: byte-exact transfers, grants enforced by the receiver, the fence, forged tokens and
notifications, dead and frozen peers, aborts, leaks. Skips when nixl is not installed."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transfer_helpers import pattern, wait_for

from kvferry.harness.peer import PeerProcess
from kvferry.transfer.base import ByteRange, TransferError, TransferErrorCause, WriteOp
from kvferry.transfer.nixl import api as nixl_api
from kvferry.transfer.nixl import wire as nw
from kvferry.transfer.secret import WeakSecret

if not nixl_api.available():
    pytest.skip(f"nixl not installed: {nixl_api.IMPORT_ERROR}", allow_module_level=True)

from kvferry.transfer.nixl.engine import CHUNK_BYTES, NixlTransferEngine  # noqa: E402

MiB = 1 << 20
E = TransferErrorCause
SECRET = b"fc901245b3275ca72bfabc02c64f95e9"  # a fixed random secret (128 bits)
GUESS = b"f8ccd7ea7c7dc295b25d3b5b5210a509"  # a stranger's guess
ENV_SECRET = "bml4bC10ZXN0cy1mcm9tLWVudi0xMjgtYml0cw"
Make = Callable[..., NixlTransferEngine]


@pytest.fixture
def engines() -> Iterator[Make]:
    made: list[NixlTransferEngine] = []

    def make(**kw: object) -> NixlTransferEngine:
        e = NixlTransferEngine(**kw)  # type: ignore[arg-type]
        made.append(e)
        return e

    yield make
    for e in made:
        e.close()


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[NixlTransferEngine, NixlTransferEngine, np.ndarray, np.ndarray]]:
    a, b = NixlTransferEngine(secret=SECRET), NixlTransferEngine(secret=SECRET)
    src, dst = pattern(16 * MiB, 1), np.zeros(16 * MiB, np.uint8)
    a.register("src", src)
    b.register("dst", dst)
    yield a, b, src, dst
    a.close()
    b.close()


def _fails(cause: TransferErrorCause, fn: Callable[[], object]) -> TransferError:
    with pytest.raises(TransferError) as info:
        fn()
    assert info.value.cause is cause, info.value
    return info.value


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(bs=st.sampled_from([1, 7, 2048, 16384 + 3, 65536]), n=st.integers(1, 64), seed=st.integers(0, 99))
def test_random_layouts_are_byte_exact_and_written_is_exact(
    pair: tuple[NixlTransferEngine, NixlTransferEngine, np.ndarray, np.ndarray], bs: int, n: int, seed: int
) -> None:
    a, b, src, dst = pair
    rng = np.random.default_rng(seed)
    si, di = rng.permutation(256)[:n], rng.permutation(256)[:n]
    dst[:] = 0
    token = b.open_grant([ByteRange("dst", 0, 256 * bs)])
    ops = [WriteOp("src", int(s) * bs, "dst", int(d) * bs, bs) for s, d in zip(si, di, strict=True)]
    a.write(b.address, token, ops, time.monotonic() + 30)
    for s, d in zip(si, di, strict=True):
        assert np.array_equal(dst[d * bs : (d + 1) * bs], src[s * bs : (s + 1) * bs])
    landed = {(r.offset, r.end) for r in b.close_grant(token)}
    want = sorted((int(d) * bs, (int(d) + 1) * bs) for d in di)
    merged: list[tuple[int, int]] = []
    for s, e in want:
        if merged and merged[-1][1] == s:
            merged[-1] = (merged[-1][0], e)
        else:
            merged.append((s, e))
    assert landed == set(merged)


def test_a_refused_chunk_fails_the_write_counts_only_what_landed_and_nothing_outside_lands(engines: Make) -> None:
    a, b = engines(), engines()
    src, dst = pattern(16 * MiB, 2), np.zeros(16 * MiB, np.uint8)
    a.register("src", src)
    b.register("dst", dst)
    token = b.open_grant([ByteRange("dst", 0, 8 * MiB)])
    ops = [WriteOp("src", 0, "dst", 0, CHUNK_BYTES), WriteOp("src", 0, "dst", 12 * MiB, 1)]  # 2nd outside
    _fails(E.REJECTED, lambda: a.write(b.address, token, ops, time.monotonic() + 10))
    # D posts the reads of a write's chunks together: the refusal of chunk 2 can reach P while chunk 1's read
    # is still in flight, and P's CANCEL then voids it. So chunk 1 counts iff its read finished first; either
    # way what D counts is exactly what landed (close_grant is the fence), and nothing outside the grant lands.
    landed = b.close_grant(token)
    assert landed in ([], [ByteRange("dst", 0, CHUNK_BYTES)]), landed
    assert not dst[12 * MiB :].any() and b.stats["rejected_writes"] == 1
    if landed:
        assert np.array_equal(dst[:CHUNK_BYTES], src[:CHUNK_BYTES])


def test_write_after_close_is_refused_and_lands_nothing(engines: Make) -> None:
    """close_grant is a fence on the bytes, not only on the counting: D does the reads."""
    a, b = engines(), engines()
    src, dst = pattern(MiB, 3), np.zeros(MiB, np.uint8)
    a.register("src", src)
    b.register("dst", dst)
    token = b.open_grant([ByteRange("dst", 0, MiB)])
    a.write(b.address, token, [WriteOp("src", 0, "dst", 0, 4096)], time.monotonic() + 10)
    assert b.close_grant(token) == [ByteRange("dst", 0, 4096)]
    _fails(E.REJECTED, lambda: a.write(b.address, token, [WriteOp("src", 0, "dst", 8192, 4096)], time.monotonic() + 10))
    assert not dst[4096:].any()
    _fails(E.INVALID, lambda: b.written(token))


def test_close_grant_fences_a_stream_of_writes(engines: Make) -> None:
    a, b = engines(), engines()
    src, dst = pattern(4 * MiB, 4), np.zeros(4 * MiB, np.uint8)
    a.register("src", src)
    b.register("dst", dst)
    token = b.open_grant([ByteRange("dst", 0, 4 * MiB)])
    outcomes: list[str] = []
    stop = threading.Event()

    def writer() -> None:
        k = 0
        while not stop.is_set():
            off = (k % 64) * 65536
            try:
                a.write(b.address, token, [WriteOp("src", off, "dst", off, 65536)], time.monotonic() + 10)
                outcomes.append("ok")
            except TransferError as e:
                outcomes.append(e.cause.value)
            k += 1

    t = threading.Thread(target=writer)
    t.start()
    try:
        wait_for(lambda: outcomes.count("ok") >= 3, 30, "writes landing")
        final = b.close_grant(token)
        snapshot = dst.copy()
        n = len(outcomes)
        wait_for(lambda: outcomes[n:].count("rejected") >= 3, 30, "writes refused after close")
    finally:
        stop.set()
        t.join(30)
    assert np.array_equal(dst, snapshot), "bytes landed after close_grant returned"
    for r in final:
        assert np.array_equal(dst[r.offset : r.end], src[r.offset : r.end])


def test_bad_requests_are_invalid_locally(engines: Make) -> None:
    a, b = engines(), engines()
    a.register("src", np.zeros(4096, np.uint8))
    b.register("dst", np.zeros(4096, np.uint8))
    token = b.open_grant([ByteRange("dst", 0, 4096)])
    deadline = time.monotonic() + 5
    _fails(E.INVALID, lambda: a.write(b.address, token, [WriteOp("nope", 0, "dst", 0, 1)], deadline))
    _fails(E.INVALID, lambda: a.write(b.address, token, [WriteOp("src", 4000, "dst", 0, 100)], deadline))
    _fails(E.INVALID, lambda: a.write(b.address, token, [WriteOp("src", 0, "other", 0, 1)], deadline))
    _fails(E.INVALID, lambda: b.open_grant([ByteRange("dst", 0, 4097)]))
    _fails(E.INVALID, lambda: b.open_grant([ByteRange("ghost", 0, 1)]))
    _fails(E.REJECTED, lambda: a.write(b.address, "nx1.AAAA", [WriteOp("src", 0, "dst", 0, 1)], deadline))
    _fails(E.REJECTED, lambda: a.write(a.address, token, [WriteOp("src", 0, "dst", 0, 1)], deadline))  # misdirected


def test_forged_token_and_forged_notifications_are_refused(engines: Make) -> None:
    d = engines(secret=SECRET)
    mem = np.zeros(MiB, np.uint8)
    d.register("dst", mem)
    token = d.open_grant([ByteRange("dst", 0, MiB)])
    stranger = engines(secret=GUESS)
    stranger.register("src", pattern(MiB, 5))
    op = [WriteOp("src", 0, "dst", 0, 4096)]
    _fails(E.REJECTED, lambda: stranger.write(d.address, token, op, time.monotonic() + 5))  # token tag
    # A stranger that somehow holds a valid token but not the notification keys: D drops its requests.
    real = nw.Keys.from_secret(SECRET)
    assert real is not None
    stranger._keys = nw.Keys(real.token, b"x" * 32, b"y" * 32)
    _fails(E.TIMEOUT, lambda: stranger.write(d.address, token, op, time.monotonic() + 1.0))
    wait_for(lambda: d.stats["bad_notes"] >= 1, 10, "D to drop the forged request")
    assert not mem.any() and d.written(token) == []


def test_peer_with_the_secret_from_env(engines: Make, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVFERRY_SECRET", ENV_SECRET)
    a, b = engines(), engines()
    src, dst = pattern(65536, 6), np.zeros(65536, np.uint8)
    a.register("src", src)
    b.register("dst", dst)
    token = b.open_grant([ByteRange("dst", 0, 65536)])
    assert nw.decode_token(token, nw.Keys.from_secret(ENV_SECRET.encode())).address == b.address
    a.write(b.address, token, [WriteOp("src", 0, "dst", 0, 65536)], time.monotonic() + 10)
    assert np.array_equal(src, dst)


def test_weak_secret_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine takes the secret rules of transfer/secret.py (it read KVFERRY_SECRET itself before)."""
    with pytest.raises(WeakSecret):
        NixlTransferEngine(secret=b"deployment")
    monkeypatch.setenv("KVFERRY_SECRET", "from-env")
    with pytest.raises(WeakSecret):
        NixlTransferEngine()
    with pytest.raises(WeakSecret):
        nw.Keys.from_secret(b"guess")


def test_dead_receiver_is_reset_fast_and_frozen_one_times_out(engines: Make) -> None:
    a = engines()
    a.register("src", pattern(MiB, 7))
    op = [WriteOp("src", 0, "dst", 0, 65536)]
    with PeerProcess(MiB, transfer="nixl") as peer:
        token = peer.grant([ByteRange("dst", 0, MiB)])
        a.write(peer.address, token, op, time.monotonic() + 30)
        assert peer.written(token) == [ByteRange("dst", 0, 65536)]
        peer.signal(signal.SIGSTOP)
        t0 = time.monotonic()
        _fails(E.TIMEOUT, lambda: a.write(peer.address, token, op, t0 + 1.0))
        assert 0.95 <= time.monotonic() - t0 < 3.0
        peer.signal(signal.SIGCONT)
        a.write(peer.address, token, op, time.monotonic() + 30)  # recovers
        peer.signal(signal.SIGKILL)
        peer.proc.wait(10)
        t0 = time.monotonic()
        _fails(E.RESET, lambda: a.write(peer.address, token, op, t0 + 30))
        assert time.monotonic() - t0 < 2.0


def test_abort_writes_fails_only_the_named_write_now(engines: Make) -> None:
    a = engines()
    a.register("src", pattern(MiB, 8))
    with PeerProcess(MiB, transfer="nixl") as peer:
        token = peer.grant([ByteRange("dst", 0, MiB)])
        a.write(peer.address, token, [WriteOp("src", 0, "dst", 0, 4096)], time.monotonic() + 30)
        peer.signal(signal.SIGSTOP)
        errors: list[TransferError] = []

        def write() -> None:
            try:
                a.write(peer.address, token, [WriteOp("src", 0, "dst", 0, 4096)], time.monotonic() + 60)
            except TransferError as e:
                errors.append(e)

        t = threading.Thread(target=write)
        t.start()
        wait_for(lambda: len(a._writes) == 1, 10, "the write in flight")
        a.abort_writes(peer.address, "nx1.other-grant")
        assert t.is_alive()
        t0 = time.monotonic()
        a.abort_writes(peer.address, token)
        t.join(10)
        assert not t.is_alive() and time.monotonic() - t0 < 1.0
        assert errors and errors[0].cause is E.RESET
        peer.signal(signal.SIGCONT)


def test_close_fails_a_write_in_flight_and_leaks_nothing() -> None:
    warm = NixlTransferEngine()  # UCX's process-wide threads start with the first agent
    warm.close()
    threads, fds, tasks = threading.active_count(), len(os.listdir("/proc/self/fd")), len(os.listdir("/proc/self/task"))
    with PeerProcess(MiB, transfer="nixl") as peer:
        token = peer.grant([ByteRange("dst", 0, MiB)])
        for _ in range(3):
            _close_under_a_write(peer, token)
    wait_for(lambda: threading.active_count() == threads, 10, "python threads back")
    wait_for(lambda: len(os.listdir("/proc/self/task")) <= tasks, 10, "native threads back")
    wait_for(lambda: len(os.listdir("/proc/self/fd")) <= fds, 10, "fds back")


def _close_under_a_write(peer: PeerProcess, token: str) -> None:
    a = NixlTransferEngine()
    a.register("src", pattern(65536, 9))
    op = [WriteOp("src", 0, "dst", 0, 65536)]
    a.write(peer.address, token, op, time.monotonic() + 30)
    peer.signal(signal.SIGSTOP)
    errors: list[TransferError] = []

    def write() -> None:
        try:
            a.write(peer.address, token, op, time.monotonic() + 60)
        except TransferError as e:
            errors.append(e)

    t = threading.Thread(target=write)
    t.start()
    try:
        wait_for(lambda: bool(a._writes), 10, "a write in flight")
        a.close()
        t.join(10)
    finally:
        peer.signal(signal.SIGCONT)
    assert not t.is_alive() and errors and errors[0].cause is E.CLOSED, errors
    _fails(E.CLOSED, lambda: a.register("x", np.zeros(1, np.uint8)))
    _fails(E.CLOSED, lambda: a.write(peer.address, token, op, time.monotonic() + 1))


def test_cuda_tensors_register_as_vram_and_move() -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    a, b = NixlTransferEngine(), NixlTransferEngine()
    try:
        src = torch.arange(1 << 20, dtype=torch.uint8, device="cuda")
        dst = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda")
        a.register("src", src)
        b.register("dst", dst)
        token = b.open_grant([ByteRange("dst", 0, 1 << 20)])
        a.write(b.address, token, [WriteOp("src", 4096, "dst", 0, 65536)], time.monotonic() + 30)
        torch.cuda.synchronize()
        assert torch.equal(dst[:65536], src[4096 : 4096 + 65536])
        assert b.close_grant(token) == [ByteRange("dst", 0, 65536)]
    finally:
        a.close()
        b.close()
