"""The built-in data plane: plain TCP, zero-copy gather on send (`client`), scatter into registered memory
on receive (`server`, `conn`), bytes landing only inside an open grant. What a stranger can make it spend
is capped (`limits`); with a shared secret both ends authenticate and every message is sealed (`auth`)."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from kvferry.transfer import secret as secret_rules
from kvferry.transfer.addr import join_addr
from kvferry.transfer.base import ByteRange, TransferEngine, TransferError, TransferErrorCause, WriteOp
from kvferry.transfer.grants import GrantTable
from kvferry.transfer.regions import RegionTable
from kvferry.transfer.tcp import plan as tcp_plan
from kvferry.transfer.tcp.client import TcpClient
from kvferry.transfer.tcp.limits import Limits
from kvferry.transfer.tcp.server import TcpServer


class TcpTransferEngine(TransferEngine):
    def __init__(self, host: str = "127.0.0.1", port: int = 0, secret: str | bytes | None = None, *,
                 advertise: str | None = None, limits: Limits | None = None) -> None:
        """`advertise`: the `host:port` peers dial when not the bound one (port 0: the bound port)."""
        # Env KVFERRY_SECRET when not given; a weak one is refused (WeakSecret) before anything listens.
        key = secret_rules.from_env() if secret is None else (secret_rules.check_secret(secret) if secret else None)
        self._auth = key is not None
        self._regions = RegionTable()
        self._grants = GrantTable(self._regions)
        self._server = TcpServer(host, port, key, self._regions, self._grants, limits, advertise)
        self._counters = self._server.stats
        self._client = TcpClient(key, self._counters, limits)
        self._closed = False
        self._close_lock = threading.Lock()

    @property
    def address(self) -> str:
        return self._server.advertised

    @property
    def bound_address(self) -> str:
        """Where the listener is bound (differs from `address` when `advertise` was given)."""
        return join_addr(self._server.host, self._server.port)

    @property
    def stats(self) -> dict[str, int]:
        """Counters (`stats.COUNTERS`): rejected_writes, refused_connections, bad_tags, ..."""
        return self._counters.snapshot()

    @property
    def connections(self) -> int:
        """Data-plane connections the receiver holds now."""
        return self._server.connections

    def register(self, name: str, buffer: Any) -> None:
        self._check_open()
        self._regions.add(name, buffer)

    def unregister(self, name: str) -> None:
        self._regions.remove(name)  # marks it dead; receivers re-check before every chunk
        self._grants.fence(name)

    def open_grant(self, ranges: Sequence[ByteRange]) -> str:
        self._check_open()
        return self._grants.open(ranges)

    def written(self, token: str) -> list[ByteRange]:
        return self._grants.written(token)

    def close_grant(self, token: str) -> list[ByteRange]:
        return self._grants.close(token)

    def write(self, peer: str, token: str, ops: Sequence[WriteOp], deadline: float) -> None:
        self._check_open()
        messages = tcp_plan.plan(self._regions, token, ops, deadline, self._auth)
        if messages:
            self._client.write(peer, messages, deadline, token)

    def abort_writes(self, peer: str, token: str | None = None) -> None:
        self._client.abort(peer, token)

    def close(self) -> None:
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        self._client.close()
        self._server.close()
        self._grants.close_all()

    def _check_open(self) -> None:
        if self._closed:
            raise TransferError(TransferErrorCause.CLOSED, "engine closed")
