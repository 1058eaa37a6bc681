"""P's lease sweep cancels the write of one expired transfer, not every write to that D (issue 18.8):
cutting by peer also cut a healthy transfer's write that happened to go to the same D."""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest

from kvferry.transfer.base import TransferError, WriteOp
from kvferry.transfer.tcp.engine import TcpTransferEngine


def test_abort_by_grant_cancels_only_that_write() -> None:
    hung = socket.create_server(("127.0.0.1", 0))  # accepts, never answers: every write waits in it
    peer = f"127.0.0.1:{hung.getsockname()[1]}"
    engine = TcpTransferEngine(secret=b"")
    engine.register("src", np.zeros(4096, dtype=np.uint8))
    errors: dict[str, BaseException] = {}

    def write(token: str) -> None:
        try:
            engine.write(peer, token, [WriteOp("src", 0, "kv", 0, 4096)], time.monotonic() + 30)
        except TransferError as exc:
            errors[token] = exc

    tokens = ["a" * 32, "b" * 32]
    threads = {t: threading.Thread(target=write, args=(t,), daemon=True) for t in tokens}
    try:
        for thread in threads.values():
            thread.start()
        deadline = time.monotonic() + 10
        while len(engine._client._busy) < 2:  # both connected, both waiting in the handshake
            assert time.monotonic() < deadline, "the writes never reached the peer"
            time.sleep(0.01)
        engine.abort_writes(peer, tokens[0])
        threads[tokens[0]].join(10)
        assert tokens[0] in errors, "the expired transfer's write was not cancelled"
        assert threads[tokens[1]].is_alive() and tokens[1] not in errors, "a healthy write to the same D was cut"
        engine.abort_writes(peer)  # None: every write to that peer (shutdown)
        threads[tokens[1]].join(10)
        assert tokens[1] in errors
    finally:
        engine.close()
        hung.close()


@pytest.mark.parametrize("token", [None, "c" * 32])
def test_abort_with_nothing_in_flight_is_harmless(token: str | None) -> None:
    engine = TcpTransferEngine(secret=b"")
    try:
        engine.abort_writes("127.0.0.1:9", token)
    finally:
        engine.close()
