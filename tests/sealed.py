"""A ZMQ socket wrapper for tests that speak to P (or act as P) by hand: it seals what it sends and opens
what it receives with kvferry's control-message envelope (connector/auth.py), so a test works on the
messages themselves."""

from __future__ import annotations

from typing import Any

import zmq

from kvferry.connector.auth import TO_DECODE, TO_PREFILL, Opener, Sealer, curve_client, curve_server_keys


class Sealed:
    """`as_decode=True`: a hand-driven D (sends to P); False: a hand-driven P rank (answers D)."""

    def __init__(self, sock: zmq.Socket[Any], secret: bytes | None = None, as_decode: bool = True) -> None:
        self.raw = sock
        # With the secret the connection is CurveZMQ, as P's and D's are (set before connect / bind).
        if secret and as_decode:
            curve_client(sock, secret)
        elif secret:
            sock.curve_server = True
            sock.curve_secretkey = curve_server_keys(secret)[1]
        self.sealer = Sealer(secret, TO_PREFILL if as_decode else TO_DECODE)
        self.opener = Opener(secret, TO_DECODE if as_decode else TO_PREFILL)

    def send(self, data: bytes) -> None:
        self.raw.send(self.sealer.seal(data))

    def send_multipart(self, frames: list[bytes]) -> None:
        self.raw.send_multipart([self.sealer.seal(f) for f in frames])

    def recv(self) -> bytes:
        return self.opener.open(self.raw.recv())

    def poll(self, timeout: int) -> int:
        return int(self.raw.poll(timeout))

    def close(self, linger: int = 0) -> None:
        self.raw.close(linger)

    def connect(self, addr: str) -> None:
        self.raw.connect(addr)
