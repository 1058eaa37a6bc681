"""Key schedule of the authenticated TCP data plane (when a shared secret is set).

HKDF over the secret (salt: both nonces; info: the "tcp" label + the transcript's hash) derives both
handshake proofs and one AES-256-GCM key per direction. The transcript holds both nonces, both flag
bytes, the address the client dialed and the one the server advertises, so a proof is worth nothing on
another connection, listener or dialed address: a relay of P's handshake to a real listener fails."""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass, field

from kvferry.transfer.secret import derive_key
from kvferry.transfer.tcp import mac, wire


@dataclass(frozen=True, slots=True)
class Session:
    client_proof: bytes = field(repr=False)
    server_proof: bytes = field(repr=False)
    c2s_key: bytes = field(repr=False)  # AES-256-GCM of write messages
    s2c_key: bytes = field(repr=False)  # ... of replies


def transcript(sflags: int, cflags: int, snonce: bytes, cnonce: bytes, dialed: str, server: str) -> bytes:
    d, s = dialed.encode(), server.encode()
    return b"".join(
        [
            struct.pack("<BBB", wire.VERSION, sflags, cflags),
            snonce,
            cnonce,
            struct.pack("<H", len(d)),
            d,
            struct.pack("<H", len(s)),
            s,
        ]
    )


def derive(secret: bytes, snonce: bytes, cnonce: bytes, record: bytes) -> Session:
    th = hashlib.sha256(record).digest()
    okm = derive_key(secret, "tcp", salt=snonce + cnonce, context=b" " + th, length=128)
    # client proof, server proof, client-to-server key, server-to-client key
    return Session(okm[:32], okm[32:64], okm[64:96], okm[96:])


@dataclass(slots=True)
class Tags:
    """One connection's sealing state: outgoing and incoming AES-GCM and their sequence numbers (nonces)."""

    send: mac.Aead
    recv: mac.Aead
    sent: int = 0  # sequence number of the next frame this side sends
    received: int = 0  # ... and of the next one it receives

    @classmethod
    def for_client(cls, s: Session) -> Tags:
        return cls(mac.Aead(s.c2s_key), mac.Aead(s.s2c_key))

    @classmethod
    def for_server(cls, s: Session) -> Tags:
        return cls(mac.Aead(s.s2c_key), mac.Aead(s.c2s_key))

    def seal_frame(self, head: bytes, payload: bytes) -> bytes:
        """A whole message: header + meta in clear (authenticated), the payload encrypted, the tag."""
        out = head + self.send.seal(self.sent, payload, head)
        self.sent += 1
        return out
