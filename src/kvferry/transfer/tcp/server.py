"""Receive side of the TCP engine: the listener, and the caps on what connections may hold.

A connection over `Limits.max_connections` in total or `Limits.max_connections_per_ip` from its peer's
IP is closed at once, before any thread or buffer is spent on it (`refused_connections`). Each admitted
connection gets a thread running `conn.Conn.serve` (handshake, then messages); the server hands each
conn a frozen `ConnContext` (not itself) and forgets the conn when its `serve` returns.
"""

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
from kvferry.transfer.tcp.limits import Limits


class TcpServer:
    def __init__(
        self,
        host: str,
        port: int,
        secret: bytes | None,
        regions: RegionTable,
        grants: GrantTable,
        limits: Limits | None = None,
        advertise: str | None = None,
    ) -> None:
        self.secret = secret
        self.regions = regions
        self.grants = grants
        self.limits = limits or Limits()
        self.stats = Counters()
        self._lock = threading.Lock()
        self._conns: set[Conn] = set()
        self._per_ip: dict[str, int] = {}
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
        self._ctx = ConnContext(secret, self.advertised, regions, grants, self.limits, self.stats)
        self._thread = threading.Thread(target=self._accept_loop, name="kvferry-tcp-listen", daemon=True)
        self._thread.start()

    def _accept_loop(self) -> None:
        lim = self.limits
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
                full = len(self._conns) >= lim.max_connections
                if full or self._per_ip.get(ip, 0) >= lim.max_connections_per_ip:
                    conn = None
                else:
                    conn = Conn(self._ctx, sock, ip)
                    self._conns.add(conn)
                    self._per_ip[ip] = self._per_ip.get(ip, 0) + 1
            if conn is None:
                self.stats.add("refused_connections")
                sock.close()
                continue
            self.stats.add("connections_accepted")
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                threading.Thread(target=self._serve, args=(conn,), name="kvferry-tcp-conn", daemon=True).start()
            except (OSError, RuntimeError):  # reset already, or no thread to be had: drop this one
                self.forget(conn)

    def _serve(self, conn: Conn) -> None:
        try:
            conn.serve()
        finally:
            self.forget(conn)

    def forget(self, conn: Conn) -> None:
        with self._lock:
            if conn in self._conns:
                self._conns.discard(conn)
                left = self._per_ip[conn.ip] - 1
                if left:
                    self._per_ip[conn.ip] = left
                else:
                    del self._per_ip[conn.ip]
        conn.sock.close()

    @property
    def connections(self) -> int:
        with self._lock:
            return len(self._conns)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            conns = list(self._conns)
        for s in [self._listener] + [c.sock for c in conns]:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)  # wakes accept()/poll() in the serving threads
        self._thread.join(timeout=5)
        self._listener.close()
