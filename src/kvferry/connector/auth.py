"""Authenticated control messages: every ZMQ message between D and P is sealed with a key derived from
`KVFERRY_SECRET`, so a stranger who reaches P's ROUTER (or answers in P's place) can neither forge,
alter nor replay one.

Envelope: magic, direction, sender session (random per socket), sequence number, MAC, then the
msgpack payload. The MAC (HMAC-SHA256, truncated to 16 bytes) covers everything before it and the
payload. A receiver keeps the highest sequence number seen per sender session (a DEALER ↔ ROUTER
connection delivers in order), so a replayed message is refused; sessions are remembered in a bounded
LRU. Without a secret messages carry a zero MAC and are not checked: the loopback-only default.

With a secret the ZMQ connection itself is CurveZMQ too (`curve_server_keys`: P's key pair comes from
the secret), so a stranger is turned away by libzmq's handshake before any frame reaches Python, and a
tap reads nothing of the control plane (ids, tokens, digests, first tokens).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import struct
import threading
from collections import OrderedDict

import numpy as np
import xxhash
import zmq
from zmq.utils import z85

from kvferry.transfer import secret as secret_rules

MAGIC = b"KVC1"
TO_PREFILL = 1  # D → P: pulls, heartbeats, releases
TO_DECODE = 2  # P → D: replies, acks
HEAD = struct.Struct("<4sB3x16sQ")  # magic, direction, session, seq: what the MAC covers with the payload
MAC_BYTES = 16
HEADER_BYTES = HEAD.size + MAC_BYTES
MAX_SESSIONS = 65_536  # sender sessions a receiver remembers (one per D rank socket, or P rank)


class AuthError(ValueError):
    """A control message that is not sealed with our secret (or is replayed, or malformed)."""


def is_loopback(host: str) -> bool:
    """Reachable only from this machine: where kvferry may listen without a secret."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"


def deployment_secret() -> bytes | None:
    """The one secret a deployment configures (env KVFERRY_SECRET); None: no authentication.
    `secret_rules.WeakSecret` (a ValueError) when it has fewer than 128 bits."""
    return secret_rules.from_env()


def derive(secret: bytes, purpose: str) -> bytes:
    """A key per purpose (HKDF, one label each: `secret_rules.LABELS`), so a MAC from one protocol is
    never valid in another."""
    return secret_rules.derive_key(secret, purpose)


def curve_server_keys(secret: bytes) -> tuple[bytes, bytes]:
    """P's CurveZMQ key pair (z85 public, secret), derived from the deployment secret: only a peer that
    holds the secret knows P's public key, so only it completes the handshake (issue 31.2-4)."""
    secret_key = z85.encode(secret_rules.derive_key(secret, "control", context=b"curve25519 server key"))
    return zmq.curve_public(secret_key), secret_key


def curve_client(sock: zmq.Socket, secret: bytes | None) -> None:  # type: ignore[type-arg]
    """Make `sock` a CurveZMQ client of a P rank (a fresh key pair of its own); before connect."""
    if secret:
        public, secret_key = zmq.curve_keypair()
        sock.curve_serverkey = curve_server_keys(secret)[0]
        sock.curve_publickey = public
        sock.curve_secretkey = secret_key


class Sealer:
    """Seals the messages one socket sends (one session, increasing sequence numbers)."""

    def __init__(self, secret: bytes | None, direction: int) -> None:
        self._key = derive(secret, "control") if secret else None
        self._direction = direction
        self._session = os.urandom(16)
        self._seq = 0
        self._lock = threading.Lock()  # P's rank loop and send threads share one socket's sealer

    def seal(self, payload: bytes) -> bytes:
        with self._lock:
            self._seq += 1
            seq = self._seq
        head = HEAD.pack(MAGIC, self._direction, self._session, seq)
        mac = _mac(self._key, head, payload) if self._key else bytes(MAC_BYTES)
        return head + mac + payload


class Opener:
    """Checks sealed messages for one receiving socket; returns the payload or raises AuthError."""

    def __init__(self, secret: bytes | None, direction: int) -> None:
        self._key = derive(secret, "control") if secret else None
        self._direction = direction
        self._seen: OrderedDict[bytes, int] = OrderedDict()  # session → highest sequence number

    @property
    def authenticated(self) -> bool:
        return self._key is not None

    def open(self, data: bytes) -> bytes:
        if len(data) < HEADER_BYTES:
            raise AuthError("message shorter than its envelope")
        magic, direction, session, seq = HEAD.unpack_from(data)
        if magic != MAGIC or direction != self._direction:
            raise AuthError("not a kvferry control message for this side")
        payload = data[HEADER_BYTES:]
        if self._key is None:
            return payload
        if not hmac.compare_digest(data[HEAD.size : HEADER_BYTES], _mac(self._key, data[: HEAD.size], payload)):
            raise AuthError("bad MAC (wrong or missing KVFERRY_SECRET)")
        if seq <= self._seen.get(session, 0):
            raise AuthError("replayed message")
        self._seen[session] = seq
        self._seen.move_to_end(session)
        while len(self._seen) > MAX_SESSIONS:
            self._seen.popitem(last=False)
        return payload


def _mac(key: bytes, head: bytes, payload: bytes) -> bytes:
    return hmac.new(key, head + payload, hashlib.sha256).digest()[:MAC_BYTES]


def prompt_digest(token_ids: list[int], block_size: int, secret: bytes | None) -> str:
    """A digest of the prompt's token ids, chained block by block, so the digest after block b names the
    whole prefix up to b. Keyed with the secret when there is one (an observer of the control plane
    cannot test guesses of a short prompt). P compares D's with its own before writing any byte."""
    key = derive(secret, "prompt") if secret else b""
    raw = np.asarray(token_ids, dtype="<u4").tobytes()
    step = block_size * 4
    digest = b""
    for start in range(0, len(raw), step):
        block = raw[start : start + step]
        if key:
            digest = hmac.new(key, digest + block, hashlib.sha256).digest()[:16]
        else:
            digest = xxhash.xxh3_128_digest(digest + block)
    return digest.hex()
