"""Receive side of the TCP engine: listener, handshake, grant checks, scatter into registered memory.

Sockets stay in blocking mode; every wait is a `poll` with a timeout and every read is MSG_DONTWAIT,
so payload bytes are only ever copied by a short non-blocking call made while holding the grant's
lock, right after checking that the grant is still open (this is what makes `close_grant` a fence).

A rejected message is answered at once and its payload is then read and discarded (drained), so the
connection stays usable; malformed frames close the connection.
"""

from __future__ import annotations

import bisect
import contextlib
import hmac
import itertools
import os
import select
import socket
import threading
import time

import numpy as np

from kvferry.transfer import wire
from kvferry.transfer.grants import Grant, GrantTable, Progress
from kvferry.transfer.regions import Region, RegionTable
from kvferry.transfer.stats import Counters

HANDSHAKE_TIMEOUT = 5.0
FRAME_TIMEOUT = 10.0  # once a header started arriving, the rest of it must follow within this
TTL_GRACE = 1.0  # slack past the sender's own deadline before a stalled message is dropped
MAX_TTL = 3600.0  # bounds how long any one message (or a hostile drain) may hold a thread
_POLL_IN = select.POLLIN | select.POLLERR | select.POLLHUP
_POLL_OUT = select.POLLOUT | select.POLLERR | select.POLLHUP


class _Eof(Exception):
    pass


class _Stall(Exception):
    pass


class _Conn:
    """One accepted connection; `serve` runs on its own thread."""

    def __init__(self, server: TcpServer, sock: socket.socket) -> None:
        self.server = server
        self.sock = sock
        self._poll_in = select.poll()
        self._poll_in.register(sock, _POLL_IN)
        self._scratch: memoryview | None = None  # for draining rejected payloads, made on first use

    # -- low level ------------------------------------------------------------------------------
    def _wait(self, deadline: float | None) -> None:
        timeout = None if deadline is None else max(0, int((deadline - time.monotonic()) * 1000) + 1)
        if not self._poll_in.poll(timeout):
            raise _Stall()

    def recv_exact(self, n: int, deadline: float | None) -> bytes:
        buf = bytearray(n)
        mv = memoryview(buf)
        got = 0
        while got < n:
            self._wait(deadline)
            try:
                k = self.sock.recv_into(mv[got:], n - got, socket.MSG_DONTWAIT)
            except BlockingIOError:
                continue
            if k == 0:
                raise _Eof() if got == 0 else wire.ProtocolError("truncated frame")
            got += k
            if deadline is None:  # the first byte came; the rest of the frame must not dawdle
                deadline = time.monotonic() + FRAME_TIMEOUT
        return bytes(buf)

    def send_all(self, data: bytes, deadline: float) -> None:
        mv = memoryview(data)
        poll_out = select.poll()
        poll_out.register(self.sock, _POLL_OUT)
        while mv:
            try:
                mv = mv[self.sock.send(mv, socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL) :]
            except BlockingIOError:
                if not poll_out.poll(max(0, int((deadline - time.monotonic()) * 1000))):
                    raise _Stall() from None

    def drain(self, n: int, deadline: float) -> None:
        if self._scratch is None:
            self._scratch = memoryview(bytearray(1 << 18))
        while n > 0:
            self._wait(deadline)
            try:
                k = self.sock.recv_into(self._scratch, min(n, len(self._scratch)), socket.MSG_DONTWAIT)
            except BlockingIOError:
                continue
            if k == 0:
                raise _Eof()
            n -= k

    def reply(self, status: wire.Status, code: wire.Code, reason: str = "") -> None:
        self.send_all(wire.encode_reply(status, code, reason), time.monotonic() + HANDSHAKE_TIMEOUT)

    # -- protocol -------------------------------------------------------------------------------
    def handshake(self) -> bool:
        secret = self.server.secret
        deadline = time.monotonic() + HANDSHAKE_TIMEOUT
        nonce = os.urandom(16)
        flags = wire.FLAG_AUTH if secret else 0
        self.send_all(wire.HELLO.pack(wire.HELLO_MAGIC, wire.VERSION, flags, nonce), deadline)
        magic, version, cflags, cnonce, mac = wire.AUTH.unpack(self.recv_exact(wire.AUTH.size, deadline))
        if magic != wire.AUTH_MAGIC or version != wire.VERSION:
            raise wire.ProtocolError("bad handshake")
        ok = not secret or (
            bool(cflags & wire.FLAG_AUTH) and hmac.compare_digest(mac, wire.client_mac(secret, nonce, cnonce))
        )
        smac = wire.server_mac(secret, nonce, cnonce) if (ok and secret) else bytes(32)
        if not ok:  # counted before answering, so a refused client already sees the count
            self.server.stats.add("refused_handshakes")
        self.send_all(wire.AUTH_RESULT.pack(wire.RESULT_MAGIC, 0 if ok else 1, smac), deadline)
        return ok

    def serve(self) -> None:
        try:
            if not self.handshake():
                return
            while self.serve_message():
                pass
        except wire.ProtocolError as e:
            self.server.stats.add("protocol_errors")
            with contextlib.suppress(OSError, _Stall):
                self.reply(wire.Status.PROTOCOL, wire.Code.MALFORMED, str(e))
        except (_Eof, _Stall, OSError):
            pass
        finally:
            self.server.forget(self)

    def serve_message(self) -> bool:
        """Handle one write message; False when the peer closed cleanly between messages."""
        try:
            head = self.recv_exact(wire.MSG.size, None)
        except _Eof:
            return False
        magic, version, token, n_ops, meta_len, payload_len, ttl_ms = wire.MSG.unpack(head)
        if magic != wire.MSG_MAGIC or version != wire.VERSION:
            raise wire.ProtocolError("bad message magic or version")
        if n_ops > wire.MAX_OPS or meta_len > wire.MAX_META:
            raise wire.ProtocolError("message too large")
        stop_at = time.monotonic() + min(ttl_ms / 1000, MAX_TTL) + TTL_GRACE
        try:
            meta = self.recv_exact(meta_len, stop_at)
        except _Eof:
            raise wire.ProtocolError("truncated frame") from None
        names, ops = wire.decode_meta(meta, n_ops)
        lengths = ops["length"]
        if n_ops and int(lengths.max()) > wire.MAX_OP_BYTES:
            raise wire.ProtocolError("op too large")
        if int(lengths.sum()) != payload_len:  # cannot overflow: at most 2**20 ops of 2**40 bytes
            raise wire.ProtocolError("payload length does not match the ops")
        grant = self.server.grants.get(token.hex())
        verdict = self.check(grant, names, ops)
        if isinstance(verdict, tuple) or grant is None:
            code, reason = verdict if isinstance(verdict, tuple) else (wire.Code.UNKNOWN_GRANT, "")
            self.server.stats.add("rejected_writes")
            self.reply(wire.Status.REJECTED, code, reason)
            self.drain(payload_len, stop_at)
            return True
        self.scatter(grant, verdict, names, ops, stop_at)
        return True

    def check(
        self, grant: Grant | None, names: list[str], ops: np.ndarray
    ) -> tuple[wire.Code, str] | list[Region]:
        """The destination regions (in table order) when every op is allowed, else why not."""
        if grant is None or not grant.open:
            return wire.Code.UNKNOWN_GRANT, "unknown or closed grant"
        regions = []
        for idx, name in enumerate(names):
            region = self.server.regions.get(name)
            if region is None or not region.alive:
                return wire.Code.UNKNOWN_REGION, f"region {name!r} is not registered"
            regions.append(region)
            mine = ops[ops["region"] == idx] if len(names) > 1 else ops
            off, ln = mine["offset"], mine["length"]
            size = np.uint64(region.size)
            if bool(((off > size) | (ln > size - np.minimum(off, size))).any()):
                return wire.Code.OUT_OF_REGION, f"op outside region {name!r}"
            if grant.outside(name, off, ln):
                return wire.Code.OUTSIDE_GRANT, f"op outside the grant on {name!r}"
        return regions

    def scatter(
        self, grant: Grant, regions: list[Region], names: list[str], ops: np.ndarray, stop_at: float
    ) -> None:
        ridx = ops["region"].tolist()
        offs = ops["offset"].tolist()
        lens = ops["length"].tolist()
        mvs = [r.view for r in regions]
        base = [mvs[r][o : o + n] for r, o, n in zip(ridx, offs, lens, strict=True)]
        views = list(base)  # views[i] is re-sliced when op i landed partially
        ends = list(itertools.accumulate(lens))  # payload position where each op ends
        n_ops = len(views)
        progress = Progress(names, ridx, offs, lens)
        pos = 0  # payload bytes landed
        i = progress.done = bisect.bisect_right(ends, 0)  # first incomplete op (skips empty ones)
        with grant.lock:
            grant.track(progress)
        sock = self.sock
        fenced = False
        try:
            while i < n_ops:
                self._wait(stop_at)
                with grant.lock:
                    if not grant.open or not all(r.alive for r in regions):
                        fenced = True
                        break
                    try:
                        n = sock.recvmsg_into(views[i : i + wire.IOV_BATCH], 0, socket.MSG_DONTWAIT)[0]
                    except BlockingIOError:
                        continue
                    if n == 0:
                        raise _Eof()
                    pos += n
                    i = bisect.bisect_right(ends, pos, i)
                    partial = pos - (ends[i - 1] if i else 0)
                    if partial:
                        views[i] = base[i][partial:]
                    progress.done, progress.partial = i, partial
        except (_Eof, _Stall, OSError):
            self.server.stats.add("incomplete_writes")
            raise
        finally:
            with grant.lock:
                progress.finished = True
            self.server.stats.add("bytes_received", pos)
        if fenced:
            self.server.stats.add("rejected_writes")
            self.reply(wire.Status.REJECTED, wire.Code.GRANT_CLOSED, "grant closed mid-write")
            self.drain(ends[-1] - pos, stop_at)
            return
        self.server.stats.add("accepted_writes")
        self.reply(wire.Status.OK, wire.Code.OK)


class TcpServer:
    def __init__(
        self, host: str, port: int, secret: bytes | None, regions: RegionTable, grants: GrantTable
    ) -> None:
        self.secret = secret
        self.regions = regions
        self.grants = grants
        self.stats = Counters()
        self._lock = threading.Lock()
        self._conns: set[_Conn] = set()
        self._closed = False
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((host, port))
        self._listener.listen(128)
        self.host, self.port = host, self._listener.getsockname()[1]
        self._thread = threading.Thread(target=self._accept_loop, name="kvferry-tcp-listen", daemon=True)
        self._thread.start()

    def _accept_loop(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                if self._closed:
                    return  # listener shut down by close()
                time.sleep(0.05)  # e.g. out of file descriptors: back off, keep serving
                continue
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = _Conn(self, sock)
            with self._lock:
                if self._closed:
                    sock.close()
                    return
                self._conns.add(conn)
            self.stats.add("connections_accepted")
            threading.Thread(target=conn.serve, name="kvferry-tcp-conn", daemon=True).start()

    def forget(self, conn: _Conn) -> None:
        with self._lock:
            self._conns.discard(conn)
        conn.sock.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            conns = list(self._conns)
        for s in [self._listener] + [c.sock for c in conns]:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)  # wakes accept()/poll() in the serving threads
        self._thread.join(timeout=5)
        self._listener.close()
