"""Confidentiality of the TCP data plane (#31 item 2): with a secret, a passive tap on the path between
P and D sees no KV byte (AES-GCM), tampering with the ciphertext still fails the grant, and a sealed
message altered or cut anywhere (hypothesis) lands nothing."""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from relay import Relay, Tamper
from transfer_helpers import closed_by_peer, message, raw_session, wait_for

from kvferry.transfer.base import ByteRange, TransferError, TransferErrorCause, WriteOp
from kvferry.transfer.tcp.engine import TcpTransferEngine
from kvferry.transfer.tcp.limits import Limits

MiB = 1 << 20
SECRET = b"04ab07360f9609fe58c1de6e2412ba34"  # a fixed random secret (128 bits)
PROMPT = b"The launch code for tomorrow is 7 4 1 9; tell no one. "  # stands in for a prompt's KV bytes
Make = Callable[..., TcpTransferEngine]


@pytest.fixture
def tap() -> Iterator[Callable[[Tamper], Relay]]:
    made: list[Relay] = []

    def make(tamper: Tamper) -> Relay:
        made.append(Relay("", tamper))
        return made[-1]

    yield make
    for r in made:
        r.close()


def _kv(n: int) -> np.ndarray:
    reps = n // len(PROMPT) + 1
    return np.frombuffer((PROMPT * reps)[:n], np.uint8).copy()


def _through(engines: Make, relay: Relay) -> tuple[TcpTransferEngine, TcpTransferEngine, np.ndarray, np.ndarray]:
    a, b = engines(secret=SECRET), engines(secret=SECRET, advertise=relay.address)
    relay.target = b.bound_address  # P reaches D through the tap
    src, dst = _kv(MiB), np.zeros(MiB, np.uint8)
    a.register("src", src)
    b.register("dst", dst)
    return a, b, src, dst


@pytest.mark.parametrize("block", [2048, 16384, 256 << 10])
def test_a_tap_reads_no_kv_byte(engines: Make, tap: Callable[[Tamper], Relay], block: int) -> None:
    relay = tap(Tamper())
    a, b, src, dst = _through(engines, relay)
    token = b.open_grant([ByteRange("dst", 0, MiB)])
    ops = [WriteOp("src", o, "dst", MiB - block - o, block) for o in range(0, MiB // 2, block)]
    a.write(relay.address, token, ops, time.monotonic() + 10)
    for op in ops:  # D got the plaintext
        assert np.array_equal(dst[op.dst_offset : op.dst_offset + block], src[op.src_offset : op.src_offset + block])
    seen = bytes(relay.seen)
    assert len(seen) > MiB // 2  # the tap saw every message
    for probe in (PROMPT[:16], PROMPT[20:36], b"launch code"):
        assert probe not in seen, f"{probe!r} readable on the wire"


def test_tampered_ciphertext_fails_the_grant(engines: Make, tap: Callable[[Tamper], Relay]) -> None:
    relay = tap(Tamper(flip_c2s=4096))  # a byte inside the first message's ciphertext
    a, b, src, dst = _through(engines, relay)
    token = b.open_grant([ByteRange("dst", 0, MiB)])
    with pytest.raises(TransferError) as exc:
        a.write(relay.address, token, [WriteOp("src", 0, "dst", 0, 65536)], time.monotonic() + 5)
    assert exc.value.cause is TransferErrorCause.PROTOCOL and "authentication" in str(exc.value)
    assert b.stats["bad_tags"] == 1
    assert not dst.any()  # verified before use: nothing of the tampered message reached D's memory
    with pytest.raises(TransferError) as exc:  # the grant is poisoned: its transfer fails
        a.write(relay.address, token, [WriteOp("src", 0, "dst", 0, 65536)], time.monotonic() + 5)
    assert exc.value.cause is TransferErrorCause.REJECTED
    assert b.close_grant(token) == []


def test_mixed_lengths_and_regions_arrive_whole(engines: Make) -> None:
    """Ops of differing lengths and source regions: copied op by op on both sides (not one numpy call)."""
    a, b = engines(secret=SECRET), engines(secret=SECRET)
    src, src2, dst = _kv(MiB), _kv(MiB)[::-1].copy(), np.zeros(MiB, np.uint8)
    a.register("src", src)
    a.register("src2", src2)
    b.register("dst", dst)
    token = b.open_grant([ByteRange("dst", 0, MiB)])
    ops, pos = [], 0
    for k, n in enumerate([1000, 3000, 7, 65536, 2048, 2048, 300_000]):
        ops.append(WriteOp("src2" if k % 2 else "src", 4096 * k, "dst", pos, n))
        pos += n + 13
    a.write(b.address, token, ops, time.monotonic() + 10)
    for op in ops:
        mem = src2 if op.src_region == "src2" else src
        assert np.array_equal(dst[op.dst_offset : op.dst_offset + op.length], mem[op.src_offset : op.src_offset + op.length])
    assert sum(r.length for r in b.close_grant(token)) == sum(op.length for op in ops)


@pytest.fixture(scope="module")
def sealed_target() -> Iterator[tuple[TcpTransferEngine, np.ndarray]]:
    b = TcpTransferEngine(secret=SECRET, limits=Limits(frame_timeout=0.5, max_ttl=0.5, ttl_grace=0.1))
    dst = np.zeros(MiB, np.uint8)
    b.register("dst", dst)
    try:
        yield b, dst
    finally:
        b.close()


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(where=st.integers(0, 2**20), bit=st.integers(0, 7), cut=st.booleans())
def test_a_sealed_message_altered_anywhere_lands_nothing(
    sealed_target: tuple[TcpTransferEngine, np.ndarray], where: int, bit: int, cut: bool
) -> None:
    """One bit flipped anywhere in header, meta, ciphertext or tag, or the message cut there: D's
    memory stays as it was and nothing is reported written."""
    b, dst = sealed_target
    token = b.open_grant([ByteRange("dst", 0, MiB)])
    sock, tags = raw_session(b.address, SECRET)
    assert tags is not None
    frame = bytearray(tags.seal_frame(message(token, [("dst", 4096, 3000), ("dst", 65536, 5000)]), _kv(8000).tobytes()))
    where %= len(frame)
    if cut:
        del frame[where:]
    else:
        frame[where] ^= 1 << bit
    with contextlib.suppress(OSError):  # D may close first (a bad magic is refused at once)
        sock.sendall(frame)
        sock.shutdown(socket.SHUT_WR)  # a receiver still waiting for bytes sees the end
    assert closed_by_peer(sock)
    sock.close()
    wait_for(lambda: b.connections == 0, what="the connection to end")
    assert not dst.any()
    assert b.close_grant(token) == []
