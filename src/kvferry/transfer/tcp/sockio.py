"""Receive-side socket primitives: every wait is a `poll` with a deadline, every read MSG_DONTWAIT.

Nothing is allocated for a frame before its bytes arrive: `recv_grow` grows with what came, and
`drain` reads into one reusable scratch buffer."""

from __future__ import annotations

import select
import socket
import time

from kvferry.transfer.tcp import wire

_POLL_IN = select.POLLIN | select.POLLERR | select.POLLHUP
_POLL_OUT = select.POLLOUT | select.POLLERR | select.POLLHUP
_SCRATCH = 1 << 18


class Eof(Exception):
    pass


class Stall(Exception):
    pass


class SockIO:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._poll_in = select.poll()
        self._poll_in.register(sock, _POLL_IN)
        self._scratch: memoryview | None = None  # for draining rejected payloads, made on first use

    def wait(self, deadline: float) -> None:
        if not self._poll_in.poll(max(0, int((deadline - time.monotonic()) * 1000) + 1)):
            raise Stall()

    def recv_exact(self, n: int, deadline: float, eof_ok: bool = False) -> bytes:
        """`n` bytes (a small, fixed-size frame part); Eof only when `eof_ok` and nothing came."""
        buf = bytearray(n)
        self.recv_into(memoryview(buf), deadline, eof_ok)
        return bytes(buf)

    def recv_into(self, buf: memoryview, deadline: float, eof_ok: bool = False) -> None:
        """Fill `buf`; a peer that closes first sent a truncated frame (Eof if `eof_ok` and nothing came)."""
        got, n = 0, buf.nbytes
        while got < n:
            self.wait(deadline)
            try:
                k = self.sock.recv_into(buf[got:], n - got, socket.MSG_DONTWAIT)
            except BlockingIOError:
                continue
            if k == 0:
                raise Eof() if (got == 0 and eof_ok) else wire.ProtocolError("truncated frame")
            got += k

    def recv_grow(self, n: int, deadline: float) -> bytes:
        """`n` bytes, the buffer growing with what arrived: a claimed length costs nothing by itself."""
        parts: list[bytes] = []
        got = 0
        while got < n:
            self.wait(deadline)
            try:
                chunk = self.sock.recv(min(n - got, 1 << 16), socket.MSG_DONTWAIT)
            except BlockingIOError:
                continue
            if not chunk:
                raise wire.ProtocolError("truncated frame")
            parts.append(chunk)
            got += len(chunk)
        return b"".join(parts)

    def send_all(self, data: bytes, deadline: float) -> None:
        mv = memoryview(data)
        poll_out = select.poll()
        poll_out.register(self.sock, _POLL_OUT)
        while mv:
            try:
                mv = mv[self.sock.send(mv, socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL) :]
            except BlockingIOError:
                if not poll_out.poll(max(0, int((deadline - time.monotonic()) * 1000))):
                    raise Stall() from None

    def drain(self, n: int, deadline: float) -> None:
        if self._scratch is None:
            self._scratch = memoryview(bytearray(_SCRATCH))
        while n > 0:
            self.wait(deadline)
            try:
                k = self.sock.recv_into(self._scratch, min(n, _SCRATCH), socket.MSG_DONTWAIT)
            except BlockingIOError:
                continue
            if k == 0:
                raise Eof()
            n -= k
