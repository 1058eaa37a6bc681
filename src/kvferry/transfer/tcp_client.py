"""Send side of the TCP engine: per-peer connection pool, handshake, zero-copy gather with sendmsg.

Every socket call gets a timeout computed from the caller's deadline. A connection that saw any error
is closed, never returned to the pool, so the next write to that peer starts from a fresh connection.
"""

from __future__ import annotations

import bisect
import contextlib
import hmac
import itertools
import os
import socket
import threading
import time

from kvferry.transfer import wire
from kvferry.transfer.base import TransferError, TransferErrorCause
from kvferry.transfer.stats import Counters
from kvferry.transfer.tcp_plan import Message

E = TransferErrorCause
MAX_IDLE_PER_PEER = 8


def _remaining(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TransferError(E.TIMEOUT, "deadline passed")
    return left


class TcpClient:
    def __init__(self, secret: bytes | None, stats: Counters) -> None:
        self._secret = secret
        self._stats = stats
        self._lock = threading.Lock()
        self._idle: dict[str, list[socket.socket]] = {}
        self._busy: dict[socket.socket, str] = {}  # socket → peer, from connect until release
        self._closed = False

    # -- pool -----------------------------------------------------------------------------------
    def _acquire(self, peer: str, deadline: float) -> socket.socket:
        while True:
            with self._lock:
                if self._closed:
                    raise TransferError(E.CLOSED, "engine closed")
                idle = self._idle.get(peer)
                sock = idle.pop() if idle else None
                if sock is not None:
                    self._busy[sock] = peer
            if sock is None:
                break
            if _healthy(sock):
                return sock
            self._discard(sock)
        sock = self._connect(peer, deadline)
        with self._lock:
            if self._closed:
                sock.close()
                raise TransferError(E.CLOSED, "engine closed")
            self._busy[sock] = peer
        return sock

    def _release(self, peer: str, sock: socket.socket) -> None:
        with self._lock:
            self._busy.pop(sock, None)
            idle = self._idle.setdefault(peer, [])
            if not self._closed and len(idle) < MAX_IDLE_PER_PEER:
                idle.append(sock)
                return
        sock.close()

    def _discard(self, sock: socket.socket) -> None:
        with self._lock:
            self._busy.pop(sock, None)
        sock.close()

    def abort(self, peer: str) -> None:
        """Make every write to `peer` in flight (handshake included) fail now."""
        with self._lock:
            busy = [s for s, p in self._busy.items() if p == peer]
            idle = self._idle.pop(peer, [])
        for s in idle:
            s.close()
        for s in busy:  # shut down, not closed: the writing thread still owns the descriptor
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle = [s for socks in self._idle.values() for s in socks]
            busy = list(self._busy)
            self._idle.clear()
        for s in idle:
            s.close()
        for s in busy:  # shut down, not closed: the writing thread still owns the descriptor
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    # -- connection -----------------------------------------------------------------------------
    def _connect(self, peer: str, deadline: float) -> socket.socket:
        host, _, port = peer.rpartition(":")
        try:
            addr = (host.strip("[]"), int(port))
        except ValueError as e:
            raise TransferError(E.INVALID, f"bad peer address {peer!r}") from e
        try:
            sock = socket.create_connection(addr, timeout=_remaining(deadline))
        except TimeoutError as e:
            raise TransferError(E.TIMEOUT, f"connect to {peer} timed out") from e
        except OSError as e:
            raise TransferError(E.REFUSED, f"connect to {peer}: {e}") from e
        with self._lock:
            self._busy[sock] = peer  # from here on `abort(peer)` reaches it
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._handshake(sock, peer, deadline)
        except TimeoutError as e:  # e.g. a frozen peer: the kernel accepted, the process never answers
            self._discard(sock)
            raise TransferError(E.TIMEOUT, f"handshake with {peer} timed out") from e
        except (EOFError, OSError) as e:
            self._discard(sock)
            raise TransferError(E.REFUSED, f"handshake with {peer} failed: {e or 'closed'}") from e
        except BaseException:
            self._discard(sock)
            raise
        self._stats.add("connections_opened")
        return sock

    def _handshake(self, sock: socket.socket, peer: str, deadline: float) -> None:
        magic, version, flags, snonce = wire.HELLO.unpack(_recv_exact(sock, wire.HELLO.size, deadline))
        if magic != wire.HELLO_MAGIC or version != wire.VERSION:
            raise TransferError(E.PROTOCOL, f"{peer} is not a kvferry endpoint")
        cnonce = os.urandom(16)
        mac = wire.client_mac(self._secret, snonce, cnonce) if self._secret else bytes(32)
        cflags = wire.FLAG_AUTH if self._secret else 0
        _send_all(sock, wire.AUTH.pack(wire.AUTH_MAGIC, wire.VERSION, cflags, cnonce, mac), deadline)
        magic, status, smac = wire.AUTH_RESULT.unpack(_recv_exact(sock, wire.AUTH_RESULT.size, deadline))
        if magic != wire.RESULT_MAGIC:
            raise TransferError(E.PROTOCOL, f"{peer} sent a bad handshake reply")
        if status != 0:
            raise TransferError(E.REFUSED, f"{peer} refused the handshake (wrong or missing secret)")
        if self._secret and not (
            flags & wire.FLAG_AUTH
            and hmac.compare_digest(smac, wire.server_mac(self._secret, snonce, cnonce))
        ):
            raise TransferError(E.REFUSED, f"{peer} could not prove it knows the secret")

    # -- write ----------------------------------------------------------------------------------
    def write(self, peer: str, messages: list[Message], deadline: float) -> None:
        sock = self._acquire(peer, deadline)
        ok = False
        try:
            for msg in messages:
                self._send_message(sock, msg, deadline)
            for _ in messages:
                self._read_reply(sock, peer, deadline)
            ok = True
        except TimeoutError as e:
            raise TransferError(E.TIMEOUT, f"write to {peer} passed its deadline") from e
        except (EOFError, OSError) as e:
            if self._closed:
                raise TransferError(E.CLOSED, "engine closed") from e
            raise TransferError(E.RESET, f"connection to {peer} broke: {e or 'closed by peer'}") from e
        finally:
            if ok:
                self._release(peer, sock)
            else:
                self._discard(sock)
            self._stats.add("writes_ok" if ok else "writes_failed")

    def _send_message(self, sock: socket.socket, msg: Message, deadline: float) -> None:
        base: list[memoryview] = [memoryview(msg.head), *msg.views]
        bufs = list(base)  # bufs[i] is re-sliced after a partial send
        ends = list(itertools.accumulate(len(b) for b in base))
        i = pos = 0
        while i < len(bufs):
            sock.settimeout(_remaining(deadline))
            sent = sock.sendmsg(bufs[i : i + wire.IOV_BATCH])
            self._stats.add("bytes_sent", sent)
            pos += sent
            i = bisect.bisect_right(ends, pos, i)  # O(log n) per call, not O(buffers)
            partial = pos - (ends[i - 1] if i else 0)
            if partial:
                bufs[i] = base[i][partial:]

    def _read_reply(self, sock: socket.socket, peer: str, deadline: float) -> None:
        magic, status, code, n = wire.REPLY.unpack(_recv_exact(sock, wire.REPLY.size, deadline))
        if magic != wire.REPLY_MAGIC:
            raise TransferError(E.PROTOCOL, f"{peer} sent a malformed reply")
        reason = _recv_exact(sock, n, deadline).decode(errors="replace") if n else ""
        if status != wire.Status.OK:
            cause = E.REJECTED if status == wire.Status.REJECTED else E.PROTOCOL
            raise TransferError(cause, f"{peer}: {reason or f'code {code}'}")


def _recv_exact(sock: socket.socket, n: int, deadline: float) -> bytes:
    buf = bytearray(n)
    mv = memoryview(buf)
    got = 0
    while got < n:
        sock.settimeout(_remaining(deadline))
        k = sock.recv_into(mv[got:])
        if k == 0:
            raise EOFError("connection closed")
        got += k
    return bytes(buf)


def _send_all(sock: socket.socket, data: bytes, deadline: float) -> None:
    sock.settimeout(_remaining(deadline))
    sock.sendall(data)


def _healthy(sock: socket.socket) -> bool:
    """An idle pooled connection must have nothing to read; EOF or bytes mean it is stale."""
    try:
        sock.settimeout(0)
        sock.recv(1, socket.MSG_PEEK)
        return False
    except BlockingIOError:
        return True
    except OSError:
        return False
