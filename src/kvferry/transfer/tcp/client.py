"""Send side of the TCP engine: per-peer connection pool, handshake, zero-copy gather with sendmsg.

Every socket call's timeout comes from the caller's deadline, and a connection that saw any error is
closed, never pooled. A pooled connection is reused only while idle less than `Limits.client_idle`
(below the server's idle timeout); one found closed before any reply is replaced once and the write
sent again, which is safe because writes are idempotent and the server only closes between messages."""

from __future__ import annotations

import bisect
import contextlib
import hmac
import itertools
import socket
import threading
import time
from dataclasses import dataclass, field

from kvferry.transfer.addr import split_addr
from kvferry.transfer.base import TransferError, TransferErrorCause
from kvferry.transfer.stats import Counters
from kvferry.transfer.tcp import iovec, wire
from kvferry.transfer.tcp.auth import Tags
from kvferry.transfer.tcp.handshake import client_handshake, recv_exact, remaining
from kvferry.transfer.tcp.limits import Limits
from kvferry.transfer.tcp.plan import Message

E = TransferErrorCause
MAX_IDLE_PER_PEER = 8
# A handshake the server cut is dialled again after this, doubling up to the max.
HANDSHAKE_BACKOFF_S, HANDSHAKE_BACKOFF_MAX_S = 0.05, 1.0


@dataclass(eq=False)
class _Link:
    sock: socket.socket
    tags: Tags | None = None  # with a secret: this connection's sealing state
    out: bytearray = field(default_factory=bytearray)  # with a secret: sealed messages, reused
    idle_since: float = field(default_factory=time.monotonic)
    pooled: bool = False  # came from the pool (was idle) for the current write
    aborted: bool = False  # shut down by abort()/close(): its failure is final, never retried
    token: str = ""  # the grant the current write goes to: abort() may cancel just that write


class _Stale(Exception):
    """A pooled connection the server had closed before this write reached it."""


class _CutHandshake(Exception):
    """The server closed a connection inside its handshake (its bound for unproven connections ran out)."""

    def __init__(self, error: TransferError) -> None:
        super().__init__(str(error))
        self.error = error


class TcpClient:
    def __init__(self, secret: bytes | None, stats: Counters, limits: Limits | None = None) -> None:
        self._secret = secret
        self._stats = stats
        self._limits = limits or Limits()
        self._lock = threading.Lock()
        self._idle: dict[str, list[_Link]] = {}
        self._busy: dict[_Link, str] = {}  # link → peer, from connect until release
        self._closed = False

    def _acquire(self, peer: str, deadline: float, token: str) -> _Link:
        while True:
            with self._lock:
                if self._closed:
                    raise TransferError(E.CLOSED, "engine closed")
                idle = self._idle.get(peer)
                link = idle.pop() if idle else None
                if link is not None:
                    link.token = token
                    self._busy[link] = peer
            if link is None:
                break
            if time.monotonic() - link.idle_since > self._limits.client_idle:
                self._stats.add("idle_retired")  # the server may be about to close it
            elif _healthy(link.sock):
                link.pooled = True
                return link
            self._discard(link)
        return self._connect(peer, deadline, token)

    def _release(self, peer: str, link: _Link) -> None:
        link.idle_since, link.pooled = time.monotonic(), False
        with self._lock:
            self._busy.pop(link, None)
            idle = self._idle.setdefault(peer, [])
            if not self._closed and len(idle) < MAX_IDLE_PER_PEER:
                idle.append(link)
                return
        link.sock.close()

    def _discard(self, link: _Link) -> None:
        with self._lock:
            self._busy.pop(link, None)
        link.sock.close()

    def abort(self, peer: str, token: str | None = None) -> None:
        """Make the write to `peer` for `token` (all when None) fail now, handshake included."""
        with self._lock:
            busy = [k for k, p in self._busy.items() if p == peer and token in (None, k.token)]
            idle = self._idle.pop(peer, []) if token is None else []
        _drop(idle, busy)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle = [k for links in self._idle.values() for k in links]
            busy = list(self._busy)
            self._idle.clear()
        _drop(idle, busy)

    def _connect(self, peer: str, deadline: float, token: str = "") -> _Link:
        """A fresh, authenticated connection. A handshake the server cut is retried until `deadline`: a
        live but CPU-starved peer can outlast the server's bound. An explicit refusal is final."""
        backoff = HANDSHAKE_BACKOFF_S
        while True:
            try:
                return self._connect_once(peer, deadline, token)
            except _CutHandshake as cut:
                if self._closed or remaining(deadline) <= backoff:
                    raise cut.error from cut.__cause__
            self._stats.add("handshake_retries")
            time.sleep(backoff)
            backoff = min(2 * backoff, HANDSHAKE_BACKOFF_MAX_S)

    def _connect_once(self, peer: str, deadline: float, token: str) -> _Link:
        host, port = split_addr(peer)
        try:
            addr = (host, int(port))
        except ValueError as e:
            raise TransferError(E.INVALID, f"bad peer address {peer!r}") from e
        try:
            sock = socket.create_connection(addr, timeout=remaining(deadline))
        except TimeoutError as e:
            raise TransferError(E.TIMEOUT, f"connect to {peer} timed out") from e
        except OSError as e:
            raise TransferError(E.REFUSED, f"connect to {peer}: {e}") from e
        link = _Link(sock, token=token)
        with self._lock:
            if self._closed:
                sock.close()
                raise TransferError(E.CLOSED, "engine closed")
            self._busy[link] = peer  # from here on `abort(peer)` reaches it
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            link.tags = client_handshake(sock, peer, self._secret, deadline)
        except TimeoutError as e:  # e.g. a frozen peer: the kernel accepted, the process never answers
            self._discard(link)
            raise TransferError(E.TIMEOUT, f"handshake with {peer} timed out") from e
        except (EOFError, OSError) as e:
            self._discard(link)
            if self._closed:
                raise TransferError(E.CLOSED, "engine closed") from e
            error = TransferError(E.REFUSED, f"handshake with {peer} failed: {e or 'closed'}")
            if link.aborted:  # our own abort of this write: final
                raise error from e
            raise _CutHandshake(error) from e
        except BaseException:
            self._discard(link)
            raise
        self._stats.add("connections_opened")
        return link

    def write(self, peer: str, messages: list[Message], deadline: float, token: str = "") -> None:
        link = self._acquire(peer, deadline, token)
        ok = False
        try:
            try:
                self._write_on(link, peer, messages, deadline)
            except _Stale:
                self._stats.add("stale_retries")
                self._discard(link)
                link = self._connect(peer, deadline, token)
                self._write_on(link, peer, messages, deadline)
            ok = True
        except TimeoutError as e:
            raise TransferError(E.TIMEOUT, f"write to {peer} passed its deadline") from e
        except (EOFError, OSError) as e:
            if self._closed:
                raise TransferError(E.CLOSED, "engine closed") from e
            raise TransferError(E.RESET, f"connection to {peer} broke: {e or 'closed by peer'}") from e
        finally:
            if ok:
                self._release(peer, link)
            else:
                self._discard(link)
            self._stats.add("writes_ok" if ok else "writes_failed")

    def _write_on(self, link: _Link, peer: str, messages: list[Message], deadline: float) -> None:
        replies = 0
        try:
            for msg in messages:
                self._send_message(link, msg, deadline)
            for _ in messages:
                self._read_reply(link, peer, deadline)
                replies += 1
        except (BrokenPipeError, EOFError) as e:
            # The server closed this idle connection before our bytes came: nothing was taken, resend.
            if link.pooled and not replies and not link.aborted and not self._closed:
                raise _Stale() from e
            raise

    def _send_message(self, link: _Link, msg: Message, deadline: float) -> None:
        sock, tags = link.sock, link.tags
        if tags is not None:
            self._send_sealed(link, tags, msg, deadline)
            return
        if msg.iov is not None:  # a copy: the send consumes rows, a retry resends
            iovec.Io(sock).send_all(msg.iov.copy(), deadline, self._count_sent)
            return
        self._send_parts(sock, [memoryview(msg.head), *msg.views], deadline)

    def _send_sealed(self, link: _Link, tags: Tags, msg: Message, deadline: float) -> None:
        """Header + meta in clear (the tag covers them), the payload encrypted, then the tag, sealed in one
        call into the link's reusable buffer."""
        size = msg.payload + wire.TAG_BYTES
        if len(link.out) < size:
            link.out = bytearray(size)
        out = memoryview(link.out)[:size]
        if msg.rows is not None:  # one length, one region: a numpy gather (`gather`)
            data: bytes | memoryview = memoryview(msg.rows[0][msg.rows[1]].reshape(-1))
        else:
            data = msg.views[0] if len(msg.views) == 1 else b"".join(msg.views)
        tags.send.seal_into(tags.sent, data, msg.head, out)
        tags.sent += 1
        self._send_parts(link.sock, [memoryview(msg.head), out], deadline)

    def _send_parts(self, sock: socket.socket, base: list[memoryview], deadline: float) -> None:
        bufs = list(base)  # bufs[i] is re-sliced after a partial send
        ends = list(itertools.accumulate(len(b) for b in base))
        i = pos = 0
        while i < len(bufs):
            sock.settimeout(remaining(deadline))
            sent = sock.sendmsg(bufs[i : i + wire.IOV_BATCH])
            self._stats.add("bytes_sent", sent)
            pos += sent
            i = bisect.bisect_right(ends, pos, i)  # O(log n) per call, not O(buffers)
            partial = pos - (ends[i - 1] if i else 0)
            if partial:
                bufs[i] = base[i][partial:]

    def _count_sent(self, n: int) -> None:
        self._stats.add("bytes_sent", n)

    def _read_reply(self, link: _Link, peer: str, deadline: float) -> None:
        raw = recv_exact(link.sock, wire.REPLY.size, deadline)
        magic, status, code, n = wire.REPLY.unpack(raw)
        if magic != wire.REPLY_MAGIC:
            raise TransferError(E.PROTOCOL, f"{peer} sent a malformed reply")
        raw += recv_exact(link.sock, n, deadline) if n else b""
        reason = raw[wire.REPLY.size :].decode(errors="replace")
        tags = link.tags
        if tags is not None:  # an OK (or any answer) counts only from the server this session proved
            tag = recv_exact(link.sock, wire.TAG_BYTES, deadline)
            good = hmac.compare_digest(tags.recv.tag(tags.received, raw), tag)
            tags.received += 1
            if not good:
                raise TransferError(E.PROTOCOL, f"{peer} sent a reply that failed authentication")
        if status != wire.Status.OK:
            cause = E.REJECTED if status == wire.Status.REJECTED else E.PROTOCOL
            raise TransferError(cause, f"{peer}: {reason or f'code {code}'}")


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


def _drop(idle: list[_Link], busy: list[_Link]) -> None:
    """Close idle links; shut busy ones down (not closed: their writing thread still owns the descriptor)."""
    for k in idle:
        k.sock.close()
    for k in busy:
        k.aborted = True
        with contextlib.suppress(OSError):
            k.sock.shutdown(socket.SHUT_RDWR)
