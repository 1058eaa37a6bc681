"""The built-in data plane: plain TCP, zero-copy gather on send, scatter into registered memory on receive.

Sender (`write`): ops are coalesced, split into messages and sent with `sendmsg` over memoryviews of
the registered source memory; the call returns once the receiver acknowledged every message.
Receiver: a listener thread plus one thread per connection; bytes land only inside an open grant
(see `tcp_server` for how `close_grant` fences writers). With a shared secret (argument or env
KVFERRY_SECRET) both ends prove knowledge of it (HMAC challenge-response) before any write.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from typing import Any

from kvferry.transfer import tcp_plan
from kvferry.transfer.base import ByteRange, TransferEngine, TransferError, TransferErrorCause, WriteOp
from kvferry.transfer.grants import GrantTable
from kvferry.transfer.regions import RegionTable
from kvferry.transfer.tcp_client import TcpClient
from kvferry.transfer.tcp_server import TcpServer


class TcpTransferEngine(TransferEngine):
    def __init__(self, host: str = "127.0.0.1", port: int = 0, secret: str | bytes | None = None) -> None:
        if secret is None:
            secret = os.environ.get("KVFERRY_SECRET") or None
        key = secret.encode() if isinstance(secret, str) else secret
        self._regions = RegionTable()
        self._grants = GrantTable(self._regions)
        self._server = TcpServer(host, port, key, self._regions, self._grants)
        self._counters = self._server.stats
        self._client = TcpClient(key, self._counters)
        self._closed = False
        self._close_lock = threading.Lock()

    @property
    def address(self) -> str:
        host = f"[{self._server.host}]" if ":" in self._server.host else self._server.host
        return f"{host}:{self._server.port}"

    @property
    def stats(self) -> dict[str, int]:
        """Counters: rejected_writes, refused_handshakes, protocol_errors, bytes_received, ..."""
        return self._counters.snapshot()

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
        messages = tcp_plan.plan(self._regions, token, ops, deadline)
        if messages:
            self._client.write(peer, messages, deadline)

    def abort_writes(self, peer: str) -> None:
        self._client.abort(peer)

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
