"""Fuzzed handshakes and frame headers: the receiver answers with an error or closes, within its
deadlines, and keeps no thread, descriptor or connection behind; honest writes still work after."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transfer_helpers import parse, pattern, raw_session, read_hello, wait_for

from kvferry.transfer.base import ByteRange, WriteOp, covered
from kvferry.transfer.tcp import wire
from kvferry.transfer.tcp.engine import TcpTransferEngine
from kvferry.transfer.tcp.limits import Limits

SIZE = 1 << 20
FAST = Limits(handshake_timeout=0.3, idle_timeout=0.3, frame_timeout=0.2, max_ttl=0.2, ttl_grace=0.05)
U32 = st.one_of(
    st.sampled_from([0, 1, 2, 18, 0xFFFF, 1 << 16, (1 << 16) + 1, 0xFFFFFFFF]), st.integers(0, 2**32 - 1)
)


@pytest.fixture(scope="module")
def target() -> Iterator[tuple[TcpTransferEngine, str, list[BaseException]]]:
    errors: list[BaseException] = []
    hook = threading.excepthook
    threading.excepthook = lambda args: errors.append(args.exc_value or RuntimeError("thread died"))
    b = TcpTransferEngine(limits=FAST)
    b.register("dst", np.zeros(SIZE, np.uint8))
    try:
        yield b, b.open_grant([ByteRange("dst", 0, SIZE // 2)]), errors
    finally:
        b.close()
        threading.excepthook = hook


FIELDS = [
    "magic",
    "version",
    "token",
    "n_ops",
    "meta_len",
    "payload_len",
    "ttl",
    "meta",
    "ops",
    "names",
    "cut",
]


@st.composite
def frames(draw: st.DrawFn, token: str) -> bytes:
    """A well-formed write message (ops inside or outside the grant, part of its payload) with up to
    two fields fuzzed; the fuzzed ones take boundary or arbitrary values."""
    bad = draw(st.sets(st.sampled_from(FIELDS), max_size=2))
    k = draw(st.integers(0, 4))
    wide = "ops" in bad  # else inside the region (and mostly inside the grant, its first half)
    offs = draw(st.lists(st.integers(0, 2**64 - 1 if wide else SIZE - 4096), min_size=k, max_size=k))
    lens = draw(st.lists(st.integers(0, 2**64 - 1 if wide else 4096), min_size=k, max_size=k))
    names = (
        draw(st.sampled_from([["dst", "ghost"], ["x" * 300], [], ["dst"] * 2])) if "names" in bad else ["dst"]
    )
    regions = draw(st.lists(st.integers(0, 3 if wide else max(0, len(names) - 1)), min_size=k, max_size=k))
    meta = wire.encode_meta(names, regions, offs, lens) if "meta" not in bad else draw(st.binary(max_size=64))
    payload = sum(lens) % 2**64

    def field(name: str, good: int, fuzz: st.SearchStrategy[int]) -> int:
        return draw(fuzz) if name in bad else good

    head = wire.MSG.pack(
        wire.MSG_MAGIC if "magic" not in bad else draw(st.binary(min_size=4, max_size=4)),
        field("version", wire.VERSION, st.integers(0, 255)),
        bytes.fromhex(token) if "token" not in bad else draw(st.binary(min_size=16, max_size=16)),
        field("n_ops", k, U32),
        field("meta_len", len(meta), U32),
        field("payload_len", payload, st.integers(0, 8192) | st.integers(0, 2**64 - 1)),
        field("ttl", 10_000, U32),
    )
    frame = head + meta + os.urandom(draw(st.integers(0, min(payload, 8192))))
    return frame[: draw(st.integers(0, len(frame)))] if "cut" in bad else frame


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _conn_threads() -> int:
    return sum(t.name == "kvferry-tcp-conn" for t in threading.enumerate())


def _until_closed(sock: socket.socket, within: float) -> bytes:
    got = b""
    sock.settimeout(within)
    t0 = time.monotonic()
    try:
        while chunk := sock.recv(65536):
            got += chunk
    except ConnectionResetError:
        pass
    assert time.monotonic() - t0 < within
    return got


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), handshake=st.integers(0, 3).map(lambda k: k == 0), half_close=st.booleans())
def test_fuzzed_frames_get_an_error_or_a_close_and_leak_nothing(
    target: tuple[TcpTransferEngine, str, list[BaseException]],
    data: st.DataObject,
    handshake: bool,
    half_close: bool,
) -> None:
    b, token, errors = target
    fds = _fds()
    if handshake:  # fuzz the AUTH the server reads
        sock = socket.create_connection(parse(b.address), timeout=5)
        read_hello(sock)
        fields = data.draw(
            st.tuples(
                st.sampled_from([wire.AUTH_MAGIC, b"KVFX"]),
                st.integers(0, 255),
                st.integers(0, 255),
                st.integers(0, 0xFFFF),
                st.binary(min_size=48, max_size=48),
            )
        )
        magic, version, flags, alen, rest = fields
        frame = wire.AUTH.pack(magic, version, flags, alen, rest[:16], rest[16:]) + data.draw(
            st.binary(max_size=64)
        )
    else:
        sock, _ = raw_session(b.address)
        frame = data.draw(frames(token))
    with contextlib.suppress(OSError):  # the server may have refused and reset already
        sock.sendall(frame)
        if half_close:
            sock.shutdown(socket.SHUT_WR)
    got = _until_closed(sock, 3.0)  # the server ends every connection that misbehaves or idles
    sock.close()
    if got and not handshake:  # whatever it said is well-formed replies
        while got:
            magic, status, _, n = wire.REPLY.unpack_from(got)
            assert magic == wire.REPLY_MAGIC and status in set(wire.Status)
            got = got[wire.REPLY.size + n :]
    wait_for(
        lambda: b.connections == 0 and _conn_threads() == 0, timeout=3, what="the connection's thread gone"
    )
    assert _fds() <= fds
    assert not errors, errors


def test_honest_writes_after_the_fuzz(target: tuple[TcpTransferEngine, str, list[BaseException]]) -> None:
    b, token, errors = target
    with TcpTransferEngine() as a:
        a.register("src", pattern(SIZE, 9))
        a.write(b.address, token, [WriteOp("src", 0, "dst", 0, 4096)], time.monotonic() + 5)
    assert covered(b.written(token), ByteRange("dst", 0, 4096))  # fuzzed writes may have merged into it
    assert not errors
