"""Shared helpers for the transfer tests: condition waits and a raw-protocol client."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable

import numpy as np

from kvferry.transfer.tcp import wire
from kvferry.transfer.tcp.auth import Tags
from kvferry.transfer.tcp.handshake import client_handshake


def wait_for(cond: Callable[[], object], timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


def parse(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host, int(port)


def recv_exact(sock: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            raise EOFError
        out += chunk
    return out


def raw_session(
    address: str, secret: bytes | None = None, source: str = ""
) -> tuple[socket.socket, Tags | None]:
    """A connection that passed the handshake (from `source` IP if given), and its tagging state."""
    sock = socket.create_connection(
        parse(address), timeout=10, source_address=(source, 0) if source else None
    )
    tags = client_handshake(sock, address, secret, time.monotonic() + 10)
    sock.settimeout(10)
    return sock, tags


def raw_connect(address: str, secret: bytes | None = None, handshake: bool = True) -> socket.socket:
    if handshake:
        return raw_session(address, secret)[0]
    return socket.create_connection(parse(address), timeout=10)


def read_hello(sock: socket.socket) -> bytes:
    """The server's HELLO and its address, as raw bytes."""
    head = recv_exact(sock, wire.HELLO.size)
    return head + recv_exact(sock, wire.HELLO.unpack(head)[3])


def message(token: str, ops: list[tuple[str, int, int]], ttl_ms: int = 10_000) -> bytes:
    """Header + meta for ops (region, offset, length); the payload is sent separately."""
    names = list(dict.fromkeys(r for r, _, _ in ops))
    meta = wire.encode_meta(
        names, [names.index(r) for r, _, _ in ops], [o for _, o, _ in ops], [n for _, _, n in ops]
    )
    payload = sum(n for _, _, n in ops)
    head = wire.MSG.pack(
        wire.MSG_MAGIC, wire.VERSION, bytes.fromhex(token), len(ops), len(meta), payload, ttl_ms
    )
    return head + meta


def read_reply(sock: socket.socket) -> tuple[int, int, str]:
    _, status, code, n = wire.REPLY.unpack(recv_exact(sock, wire.REPLY.size))
    return status, code, recv_exact(sock, n).decode()


def closed_by_peer(sock: socket.socket) -> bool:
    """True once the server closed this connection (reads EOF, after any reply bytes)."""
    sock.settimeout(10)
    try:
        while sock.recv(65536):
            pass
    except ConnectionResetError:
        pass
    return True


def pattern(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, np.uint8)
