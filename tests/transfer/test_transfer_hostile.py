"""A stranger on the data-plane port: every limit holds, is counted, and honest writes go on."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator

import numpy as np
import pytest
from transfer_helpers import (
    closed_by_peer,
    message,
    parse,
    pattern,
    raw_session,
    read_hello,
    read_reply,
    wait_for,
)

from kvferry.transfer.base import ByteRange, WriteOp
from kvferry.transfer.tcp import client as tcp_client
from kvferry.transfer.tcp import wire
from kvferry.transfer.tcp.engine import TcpTransferEngine
from kvferry.transfer.tcp.limits import Limits

MiB = 1 << 20
Make = Callable[..., TcpTransferEngine]
FAST = Limits(handshake_timeout=0.4, idle_timeout=0.4, frame_timeout=0.3, max_ttl=0.3, ttl_grace=0.05)


def _pair(engines: Make, limits: Limits = FAST) -> tuple[TcpTransferEngine, TcpTransferEngine, str]:
    a, b = engines(), engines(limits=limits)
    a.register("src", pattern(MiB, 2))
    b.register("dst", np.zeros(MiB, np.uint8))
    return a, b, b.open_grant([ByteRange("dst", 0, MiB)])


def _write(a: TcpTransferEngine, b: TcpTransferEngine, token: str) -> None:
    a.write(b.address, token, [WriteOp("src", 0, "dst", 0, 65536)], time.monotonic() + 5)


def _closed_within(sock: socket.socket, low: float, high: float, t0: float) -> None:
    assert closed_by_peer(sock)
    assert low <= time.monotonic() - t0 < high, time.monotonic() - t0


def test_huge_header_fields_are_refused_without_allocating(engines: Make) -> None:
    _, b, token = _pair(engines)
    raw = bytes.fromhex(token)
    tracemalloc.start()
    try:
        for n_ops, meta_len, expect in [
            (1, 0xFFFFFFFF, "oversized_frames"),  # more meta than one op can need
            (wire.MAX_OPS + 1, 0, "oversized_frames"),
            (wire.MAX_OPS, wire.max_meta(wire.MAX_OPS), "frame_timeouts"),  # legal size, never sent
        ]:
            before = b.stats[expect]
            sock, _ = raw_session(b.address)
            t0 = time.monotonic()
            sock.sendall(
                wire.MSG.pack(wire.MSG_MAGIC, wire.VERSION, raw, n_ops, meta_len, 1 << 40, 0xFFFFFFFF)
            )
            _closed_within(sock, 0.0, 2.0, t0)  # not the hour the ttl asks for
            wait_for(lambda e=expect, n=before: b.stats[e] == n + 1, what=expect)
            sock.close()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 * MiB, peak  # main allocated the claimed ~19 MB at once


def test_payload_stall_is_bounded_by_the_clamped_ttl(engines: Make) -> None:
    _, b, token = _pair(engines)
    sock, _ = raw_session(b.address)
    t0 = time.monotonic()
    sock.sendall(message(token, [("dst", 0, 65536)], ttl_ms=0xFFFFFFFF) + b"x" * 100)
    _closed_within(sock, FAST.max_ttl, 2.0, t0)
    assert b.stats["incomplete_writes"] == 1 and b.stats["frame_timeouts"] == 1


def _trickle(sock: socket.socket, data: bytes, every: float = 0.02) -> threading.Thread:
    def run() -> None:
        for k in range(len(data)):
            try:
                sock.send(data[k : k + 1])
            except OSError:
                return
            time.sleep(every)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_slow_loris_handshake_and_header_are_cut_at_their_deadlines(engines: Make) -> None:
    _, b, token = _pair(engines)
    sock = socket.create_connection(parse(b.address))
    t0 = time.monotonic()
    read_hello(sock)
    _trickle(sock, b"\x00" * 1000)  # a byte every 20 ms: each one arrives well within any per-read timeout
    _closed_within(sock, FAST.handshake_timeout - 0.05, FAST.handshake_timeout + 1.5, t0)
    assert b.stats["handshake_timeouts"] == 1
    sock, _ = raw_session(b.address)
    t0 = time.monotonic()
    _trickle(sock, message(token, [("dst", 0, 16)]))
    _closed_within(sock, FAST.frame_timeout - 0.05, FAST.frame_timeout + 1.5, t0)
    wait_for(lambda: b.stats["frame_timeouts"] == 1, what="the frame timeout counted")


def test_idle_connections_are_closed_and_the_pool_reconnects(
    engines: Make, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b, token = _pair(engines)
    sock, _ = raw_session(b.address)
    t0 = time.monotonic()
    _closed_within(sock, FAST.idle_timeout - 0.05, FAST.idle_timeout + 1.5, t0)
    assert b.stats["idle_closed"] == 1
    _write(a, b, token)  # pools a connection, which the server then closes as idle
    wait_for(lambda: b.stats["idle_closed"] == 2, what="the pooled connection closed")
    _write(a, b, token)  # the pool sees the close and connects afresh
    assert a.stats["connections_opened"] == 2 and a.stats["writes_failed"] == 0
    wait_for(lambda: b.stats["idle_closed"] == 3, what="the second pooled connection closed")
    monkeypatch.setattr(tcp_client, "_healthy", lambda sock: True)  # as if the close raced the check
    _write(a, b, token)
    assert a.stats["stale_retries"] == 1 and a.stats["writes_failed"] == 0


def test_client_retires_idle_connections_before_the_server_would(engines: Make) -> None:
    a = engines(limits=Limits(client_idle=0.0))
    a.register("src", pattern(MiB, 2))
    b = engines()
    b.register("dst", np.zeros(MiB, np.uint8))
    token = b.open_grant([ByteRange("dst", 0, MiB)])
    for _ in range(2):
        a.write(b.address, token, [WriteOp("src", 0, "dst", 0, 4096)], time.monotonic() + 5)
    assert a.stats["idle_retired"] == 1 and a.stats["connections_opened"] == 2


@contextlib.contextmanager
def _strangers(address: str, n: int, source: str) -> Iterator[list[socket.socket]]:
    socks = [socket.create_connection(parse(address), source_address=(source, 0)) for _ in range(n)]
    try:
        yield socks
    finally:
        for s in socks:
            s.close()


def test_pending_connections_are_capped_and_evicted_oldest_first(engines: Make) -> None:
    a, b, token = _pair(engines, Limits(max_pending=6, max_pending_per_bucket=4, max_connections=10))
    with _strangers(b.address, 7, "127.0.0.2") as socks:  # idle, never a byte: the bucket holds 4
        wait_for(lambda: b.stats["evicted_handshakes"] == 3, what="three evicted")
        assert sum(closed_by_peer(s) for s in socks[:3]) == 3  # the oldest ones went
        assert b._server.budgets == (4, 0)
        _write(a, b, token)  # an honest peer in the same bucket evicts one more and moves out
        assert b._server.budgets == (3, 1) and b.stats["evicted_handshakes"] == 4
    wait_for(lambda: b.connections <= 1, what="strangers gone")
    _write(a, b, token)
    assert a.stats["writes_failed"] == 0


def test_unauthenticated_speed_path_is_unchanged(engines: Make) -> None:
    """No secret: no tags on the wire (a raw frame without one is accepted as before)."""
    _, b, token = _pair(engines)
    sock, tags = raw_session(b.address)
    assert tags is None
    sock.sendall(message(token, [("dst", 0, 16)]) + os.urandom(16))
    assert read_reply(sock)[:2] == (wire.Status.OK, wire.Code.OK)


def test_a_peer_whose_handshake_outlasts_the_strangers_bound_is_dialled_again(
        engines: Make, monkeypatch: pytest.MonkeyPatch) -> None:
    """The receiver cuts a handshake after `handshake_timeout`, as it would a stranger's; a sender
    starved of the CPU for longer (a busy vLLM worker's) is a live peer, not a refused one: it dials
    again within its write's deadline and the write lands."""
    secret = bytes(range(32))
    a = engines(secret=secret)
    b = engines(secret=secret, limits=FAST)
    src = pattern(MiB, 2)
    a.register("src", src)
    b.register("dst", dst := np.zeros(MiB, np.uint8))
    token = b.open_grant([ByteRange("dst", 0, MiB)])
    real = tcp_client.client_handshake
    starved = [FAST.handshake_timeout + 0.3]  # the first handshake only

    def slow_handshake(sock: socket.socket, peer: str, key: bytes | None, deadline: float) -> object:
        if starved:
            time.sleep(starved.pop())  # the server cuts this one meanwhile
        return real(sock, peer, key, deadline)

    monkeypatch.setattr(tcp_client, "client_handshake", slow_handshake)
    _write(a, b, token)
    assert np.array_equal(dst[:65536], src[:65536])
    assert a.stats["handshake_retries"] == 1 and b.stats["handshake_timeouts"] == 1


def test_a_refused_handshake_is_not_dialled_again(engines: Make) -> None:
    a = engines(secret=os.urandom(32))  # not b's secret
    b = engines(secret=bytes(range(32)), limits=FAST)
    b.register("dst", np.zeros(MiB, np.uint8))
    a.register("src", pattern(MiB, 2))
    token = b.open_grant([ByteRange("dst", 0, MiB)])
    with pytest.raises(Exception, match="refused the handshake"):
        _write(a, b, token)
    assert a.stats["handshake_retries"] == 0
