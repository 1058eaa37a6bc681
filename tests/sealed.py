"""A ZMQ socket wrapper for tests that speak to P (or act as P) by hand: it seals what it sends and opens
what it receives with kvferry's control-message envelope (connector/auth.py), so a test works on the
messages themselves."""

from __future__ import annotations

from typing import Any

import zmq

from kvferry.connector.auth import (
    ID_BYTES,
    TO_DECODE,
    TO_PREFILL,
    Opener,
    Sealer,
    curve_client,
    curve_server_keys,
    prefill_receiver,
)


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
        # As D: sealed for the P rank `connect` names (for nobody before), replies for our own session.
        # As P: sealed for the D session last heard from, opened as the rank `bind` names.
        self.as_decode = as_decode
        self.sealer = Sealer(secret, TO_PREFILL if as_decode else TO_DECODE, bytes(ID_BYTES))
        self.opener = Opener(secret, TO_DECODE if as_decode else TO_PREFILL,
                             self.sealer.session if as_decode else bytes(ID_BYTES))
        self.peer = bytes(ID_BYTES)

    def send(self, data: bytes) -> None:
        self.raw.send(self.sealer.seal(data, None if self.as_decode else self.peer))

    def send_multipart(self, frames: list[bytes]) -> None:
        self.raw.send_multipart([self.sealer.seal(f, None if self.as_decode else self.peer) for f in frames])

    def recv(self) -> bytes:
        self.peer, payload = self.opener.unseal(self.raw.recv())
        return payload

    def poll(self, timeout: int) -> int:
        return int(self.raw.poll(timeout))

    def close(self, linger: int = 0) -> None:
        self.raw.close(linger)

    def connect(self, addr: str, boot: str) -> None:
        """`boot`: the P rank's boot id (hex: its bootstrap entry, `Producer.boot_ids`)."""
        self.sealer.receiver = prefill_receiver(addr, bytes.fromhex(boot))
        self.raw.connect(addr)

    def bind(self, addr: str, boot: str) -> None:
        self.opener.receiver = prefill_receiver(addr, bytes.fromhex(boot))
        self.raw.bind(addr)
