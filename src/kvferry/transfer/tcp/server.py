"""Receive side of the TCP engine: the listener, and the budgets connections are held in (`limits`). A
connection moves to the proven budget before the server answers OK, so a peer told OK holds its slot."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

from kvferry.transfer.addr import advertised_addr
from kvferry.transfer.grants import GrantTable
from kvferry.transfer.regions import RegionTable
from kvferry.transfer.stats import Counters
from kvferry.transfer.tcp.conn import Conn, ConnContext
from kvferry.transfer.tcp.limits import Limits, bucket


class TcpServer:
    def __init__(self, host: str, port: int, secret: bytes | None, regions: RegionTable, grants: GrantTable,
                 limits: Limits | None = None, advertise: str | None = None) -> None:
        self.secret = secret
        self.regions = regions
        self.grants = grants
        self.limits = limits or Limits()
        self.stats = Counters()
        self._lock = threading.Lock()
        self._conns: set[Conn] = set()  # every live connection, pending, proven or evicted
        self._pending: dict[Conn, str] = {}  # → its bucket, oldest first (dicts keep insertion order)
        self._per_bucket: dict[str, int] = {}  # pending connections per bucket
        self._proven: set[Conn] = set()
        self._closed = False
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((host, port))
        self._listener.listen(128)
        self.host, self.port = host, self._listener.getsockname()[1]
        # The address peers dial; with a secret a handshake naming another one is refused.
        self.advertised = advertised_addr(advertise, host, self.port)
        if not self.advertised:
            raise ValueError(f"bad advertised address {advertise!r}")
        self._ctx = ConnContext(secret, self.advertised, regions, grants, self.limits, self.stats, self._admit)
        self._thread = threading.Thread(target=self._accept_loop, name="kvferry-tcp-listen", daemon=True)
        self._thread.start()

    def _accept_loop(self) -> None:
        while True:
            try:
                sock, addr = self._listener.accept()
            except OSError:
                if self._closed:
                    return  # listener shut down by close()
                time.sleep(0.05)  # e.g. out of file descriptors: back off, keep serving
                continue
            ip = str(addr[0])
            with self._lock:
                if self._closed:
                    sock.close()
                    return
                conn = Conn(self._ctx, sock, ip)
                victim = self._make_room(bucket(ip))
                self._conns.add(conn)
                self._add_pending(conn, bucket(ip))
            if victim is not None:
                self.stats.add("evicted_handshakes")
                with contextlib.suppress(OSError):
                    victim.sock.shutdown(socket.SHUT_RDWR)  # wakes its thread, which then exits
            self.stats.add("connections_accepted")
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                threading.Thread(target=self._serve, args=(conn,), name="kvferry-tcp-conn", daemon=True).start()
            except (OSError, RuntimeError):  # reset already, or no thread to be had: drop this one
                self.forget(conn)

    def _make_room(self, new: str) -> Conn | None:
        """The pending connection a newcomer from bucket `new` evicts when the budget is full (lock held)."""
        lim = self.limits
        if self._per_bucket.get(new, 0) >= lim.max_pending_per_bucket:
            take = new
        elif len(self._pending) >= lim.max_pending:
            take = max(self._per_bucket, key=lambda b: self._per_bucket[b])
        else:
            return None
        victim = next(c for c, b in self._pending.items() if b == take)
        self._drop_pending(victim)
        return victim

    def _add_pending(self, conn: Conn, b: str) -> None:
        self._pending[conn] = b
        self._per_bucket[b] = self._per_bucket.get(b, 0) + 1

    def _drop_pending(self, conn: Conn) -> bool:
        b = self._pending.pop(conn, None)
        if b is None:
            return False
        left = self._per_bucket[b] - 1
        if left:
            self._per_bucket[b] = left
        else:
            del self._per_bucket[b]
        return True

    def _admit(self, conn: Conn) -> bool:
        """Move `conn` to the proven budget; False if it was evicted or that budget is full."""
        with self._lock:
            if not self._drop_pending(conn):
                return False  # evicted while it finished
            if len(self._proven) < self.limits.max_connections:
                self._proven.add(conn)
                return True
        self.stats.add("refused_connections")
        return False

    def _serve(self, conn: Conn) -> None:
        try:
            conn.serve()
        finally:
            self.forget(conn)

    def forget(self, conn: Conn) -> None:
        with self._lock:
            self._conns.discard(conn)
            self._drop_pending(conn)
            self._proven.discard(conn)
        conn.sock.close()

    @property
    def connections(self) -> int:
        with self._lock:
            return len(self._conns)

    @property
    def budgets(self) -> tuple[int, int]:
        """(pending, proven) connections now."""
        with self._lock:
            return len(self._pending), len(self._proven)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            conns = list(self._conns)
        for s in [self._listener] + [c.sock for c in conns]:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)  # wakes accept()/poll() in the serving threads
        self._thread.join(timeout=5)
        self._listener.close()
