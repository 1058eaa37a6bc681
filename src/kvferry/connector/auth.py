"""Authenticated control messages: every ZMQ message between D and P is sealed with a key derived from
`KVFERRY_SECRET`, so a stranger who reaches P's ROUTER (or answers in P's place) can neither forge,
alter nor replay one.

Envelope (`KVC3`): magic, direction, sender session (random per socket), receiver, sequence number,
MAC, then the msgpack payload. The MAC (HMAC-SHA256, truncated to 16 bytes) covers everything before it
and the payload. The receiver names the one socket the message is for: D → P, the P rank's
advertised control address and the boot id that rank drew at start (`prefill_receiver`: what D dialled,
as P's MAC'd bootstrap answer gave both); P → D, the session of the D socket it answers. So a sealed
message delivered anywhere else (another rank, another P holding the secret, a P restarted at the same
address, another D socket) is refused. A receiver keeps the highest sequence
number seen per sender session (a DEALER ↔ ROUTER connection delivers in order), so a replayed message is
refused; sessions are remembered in a bounded LRU. Without a secret messages carry a zero MAC and are not
checked: the loopback-only default.

With a secret the ZMQ connection itself is CurveZMQ too (`curve_server_keys`: P's key pair comes from
the secret), so a stranger is turned away by libzmq's handshake before any frame reaches Python, and a
tap reads nothing of the control plane (ids, tokens, digests, first tokens)."""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import struct
import threading
from collections import OrderedDict
from typing import Any

import numpy as np
import xxhash
import zmq
from zmq.utils import z85

from kvferry.transfer import secret as secret_rules

MAGIC = b"KVC3"  # the envelope's version: KVC1 had no receiver, KVC2 no boot id in it
TO_PREFILL = 1  # D → P: pulls, heartbeats, releases
TO_DECODE = 2  # P → D: replies, acks
# magic, direction, sender session, receiver, seq: what the MAC covers with the payload
HEAD = struct.Struct("<4sB3x16s16sQ")
ID_BYTES = 16  # a session, or a receiver
MAC_BYTES = 16
HEADER_BYTES = HEAD.size + MAC_BYTES
MAX_SESSIONS = 65_536  # sender sessions a receiver remembers (one per D rank socket, or P rank)


class AuthError(ValueError):
    """A control message that is not sealed with our secret (or is replayed, or malformed)."""

    reason = "auth"  # the label P counts it under (kvferry_control_dropped_total)


class WrongReceiver(AuthError):
    """Sealed with our secret, for another socket (another P rank or process, an earlier P process at
    this address, another D socket)."""

    reason = "receiver"

    def __init__(self, message: str, session: bytes = b"", receiver: bytes = b"") -> None:
        super().__init__(message)
        self.session = session  # the sender's (authentic: the MAC held)
        self.receiver = receiver  # the socket it was sealed for


class OldEnvelope(AuthError):
    """A kvferry control message in another envelope version: P and D run different releases."""

    reason = "version"


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
    holds the secret knows P's public key, so only it completes the handshake."""
    secret_key = z85.encode(secret_rules.derive_key(secret, "control", context=b"curve25519 server key"))
    return zmq.curve_public(secret_key), secret_key


def curve_client(sock: zmq.Socket, secret: bytes | None) -> None:  # type: ignore[type-arg]
    """Make `sock` a CurveZMQ client of a P rank (a fresh key pair of its own); before connect."""
    if secret:
        public, secret_key = zmq.curve_keypair()
        sock.curve_serverkey = curve_server_keys(secret)[0]
        sock.curve_publickey = public
        sock.curve_secretkey = secret_key


def boot_id() -> bytes:
    """What a P rank draws at start: with its address it names this one process."""
    return os.urandom(ID_BYTES)


def prefill_receiver(control_addr: str, boot: bytes) -> bytes:
    """The receiver D seals for: the P rank's advertised control address (`tcp://host:port`), which
    names one rank (D dials exactly it), and that rank's boot id, which names its process: a P
    restarted at the same address (a fixed control port) starts with no sequence numbers, and so must
    not open what D sealed for the old one."""
    if len(boot) != ID_BYTES:
        raise ValueError(f"a P rank's boot id is {ID_BYTES} bytes, not {len(boot)}")
    return hashlib.sha256(b"kvferry control receiver\0" + boot + control_addr.encode()).digest()[:ID_BYTES]


class Sealer:
    """Seals the messages one socket sends (one session, increasing sequence numbers), each for one
    receiver: `receiver` for every message (D's socket to one P rank), or per `seal` (P answering the D
    session it heard from). With a secret a message for no named receiver is a bug: ValueError."""

    def __init__(self, secret: bytes | None, direction: int, receiver: bytes | None = None) -> None:
        self._key = derive(secret, "control") if secret else None
        self._direction = direction
        self.session = os.urandom(ID_BYTES)
        self.receiver = receiver
        self._seq = 0
        self._lock = threading.Lock()  # P's rank loop and send threads share one socket's sealer

    def seal(self, payload: bytes, receiver: bytes | None = None) -> bytes:
        to = receiver if receiver is not None else self.receiver
        if to is None and self._key is not None:
            raise ValueError("an authenticated control message must name its receiver")
        with self._lock:
            self._seq += 1
            seq = self._seq
        head = HEAD.pack(MAGIC, self._direction, self.session, to or bytes(ID_BYTES), seq)
        mac = _mac(self._key, head, payload) if self._key else bytes(MAC_BYTES)
        return head + mac + payload


class Opener:
    """Checks sealed messages for one receiving socket, whose own identity is `receiver` (required with
    a secret); `unseal` returns the sender's session and the payload, or raises AuthError."""

    def __init__(self, secret: bytes | None, direction: int, receiver: bytes | None = None) -> None:
        self._key = derive(secret, "control") if secret else None
        if self._key is not None and receiver is None:
            raise ValueError("an authenticated opener must know its own receiver identity")
        self._direction = direction
        self.receiver = receiver
        self._seen: OrderedDict[bytes, int] = OrderedDict()  # session → highest sequence number

    @property
    def authenticated(self) -> bool:
        return self._key is not None

    def open(self, data: bytes) -> bytes:
        return self.unseal(data)[1]

    def unseal(self, data: bytes) -> tuple[bytes, bytes]:
        magic = data[: len(MAGIC)]
        if magic != MAGIC and magic[:3] == MAGIC[:3] and len(magic) == len(MAGIC):
            raise OldEnvelope(f"control envelope {magic.decode(errors='replace')!r}, this side speaks "
                              f"{MAGIC.decode()!r}: P and D run different kvferry versions")
        if len(data) < HEADER_BYTES:
            raise AuthError("message shorter than its envelope")
        magic, direction, session, receiver, seq = HEAD.unpack_from(data)
        if magic != MAGIC or direction != self._direction:
            raise AuthError("not a kvferry control message for this side")
        payload = data[HEADER_BYTES:]
        if self._key is None:
            return session, payload
        if not hmac.compare_digest(data[HEAD.size : HEADER_BYTES], _mac(self._key, data[: HEAD.size], payload)):
            raise AuthError("bad MAC (wrong or missing KVFERRY_SECRET)")
        # After the MAC: only a holder of the secret sealed it, for someone else.
        if not hmac.compare_digest(receiver, self.receiver or b""):
            raise WrongReceiver("sealed for another receiver", session, receiver)
        if seq <= self._seen.get(session, 0):
            raise AuthError("replayed message")
        remember(self._seen, session, seq)
        return session, payload


def remember(store: OrderedDict[Any, Any], key: Any, value: Any, cap: int = MAX_SESSIONS) -> None:
    """`store[key] = value` in an LRU of at most `cap` entries (the oldest go first)."""
    store[key] = value
    store.move_to_end(key)
    while len(store) > cap:
        store.popitem(last=False)


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
