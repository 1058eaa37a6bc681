"""Authenticated encryption of the TCP data plane with a secret: AES-256-GCM from pyca `cryptography`.

A write message's payload is encrypted, its header and meta are associated data; a reply is associated
data only. The key belongs to one connection and direction and the nonce is that direction's sequence
number, so a nonce never repeats under a key and a message never verifies elsewhere. `decrypt_into`
checks the tag in the same call, so the receiver never uses a byte whose tag failed. A known-answer test
runs at import: with a secret there is no unencrypted fallback."""

from __future__ import annotations

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from kvferry.transfer.tcp import wire

Buffer = bytes | bytearray | memoryview
# GCM spec (McGrew & Viega) test case 14: AES-256, zero key, zero IV, one zero block.
_KAT = (bytes.fromhex("cea7403d4d606b6e074ec5d3baf39d18"), bytes.fromhex("d0d1c8a799996bf0265b98b5d48ab919"))


def _nonce(seq: int) -> bytes:
    return seq.to_bytes(12, "little")


class Aead:
    """AES-256-GCM under one key; the caller supplies each message's sequence number (its nonce)."""

    def __init__(self, key: bytes) -> None:
        self._aead = AESGCM(key)

    def seal_into(self, seq: int, data: Buffer, aad: bytes, out: memoryview) -> None:
        """Ciphertext of `data`, then its tag, into `out` (exactly `len(data) + TAG_BYTES` bytes)."""
        self._aead.encrypt_into(_nonce(seq), data, aad, out)

    def open_into(self, seq: int, sealed: memoryview, aad: bytes, out: memoryview) -> bool:
        """Verify ciphertext + tag and decrypt into `out`; False (and `out` is garbage) when it fails."""
        try:
            self._aead.decrypt_into(_nonce(seq), sealed, aad, out)
        except InvalidTag:
            return False
        return True

    def seal(self, seq: int, data: bytes, aad: bytes) -> bytes:
        """Ciphertext + tag as new bytes (small messages, tests)."""
        return self._aead.encrypt(_nonce(seq), data, aad)

    def tag(self, seq: int, aad: bytes) -> bytes:
        """A tag over `aad` alone (GMAC): replies, which carry no KV."""
        return self._aead.encrypt(_nonce(seq), b"", aad)


def _self_test() -> None:
    sealed = Aead(bytes(32)).seal(0, bytes(16), b"")
    if sealed != _KAT[0] + _KAT[1]:
        raise RuntimeError("pyca cryptography's AES-256-GCM fails its known-answer test: broken install")
    out = bytearray(16)
    if Aead(bytes(32)).open_into(1, memoryview(sealed), b"", memoryview(out)):
        raise RuntimeError("pyca cryptography's AES-256-GCM accepts a wrong nonce: broken install")


_self_test()
assert wire.TAG_BYTES == 16  # AES-GCM's full tag
