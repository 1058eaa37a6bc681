"""What the NIXL engine puts into grant tokens and NIXL notifications, and the tags on both.

Token (D → P, inside the sealed PullRequest): grant id, D's address, agent name, *connection-only*
metadata and the grant's regions. Notifications: REQ (P → D: read these ops into your grant), ACK (D →
P: how a chunk's read ended), CANCEL (P gave up), PING (a probe). With a deployment secret each carries a
16-byte HMAC-SHA256 tag under a key for that use alone; without one the tag is zeros and the 128-bit
grant id is the capability."""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import secrets
import struct
from dataclasses import dataclass

import numpy as np

from kvferry.transfer.secret import derive_key

TAG = 16
_TOKEN_HEAD = struct.Struct("<4sB16s")  # magic, version, grant id
_NOTE_HEAD = struct.Struct("<4sBB16s8sI")  # magic, version, kind, grant id, write id, chunk
_REQ = struct.Struct("<QQ16sBI")  # deadline (sender's CLOCK_MONOTONIC ns), ttl ns, boot id, src mem, n ops
_ACK = struct.Struct("<B")
TOKEN_PREFIX = "nx1."
VERSION = 1
REQ, ACK, CANCEL, PING = 1, 2, 3, 4
OK, REJECTED, FAILED, LATE = 0, 1, 2, 3  # ACK statuses
MEMS = ("DRAM", "VRAM")
# One op in a REQ: dst region index, dst offset, src address, length, src device.
OP_DTYPE = np.dtype([("ridx", "<u2"), ("dst", "<u8"), ("src", "<u8"), ("len", "<u8"), ("dev", "<u4")])


class WireError(ValueError):
    """An undecodable token or notification, or one whose tag does not verify."""


@dataclass(frozen=True, slots=True)
class Keys:
    token: bytes
    p2d: bytes
    d2p: bytes

    @classmethod
    def from_secret(cls, secret: bytes | None) -> Keys | None:
        if not secret:
            return None
        # HKDF under one label per use (transfer/secret.py); a weak secret raises WeakSecret here too
        return cls(*(derive_key(secret, "nixl", context=b" " + use) for use in (b"token", b"p2d", b"d2p")))


def _tag(key: bytes | None, data: bytes) -> bytes:
    return hmac.digest(key, data, "sha256")[:TAG] if key else bytes(TAG)


def _check(key: bytes | None, data: bytes) -> bytes:
    body, tag = data[:-TAG], data[-TAG:]
    if len(data) < TAG or not hmac.compare_digest(_tag(key, body), tag):
        raise WireError("tag does not verify")
    return body


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0

    def take(self, n: int) -> bytes:
        if n < 0 or self.pos + n > len(self.data):
            raise WireError("truncated")
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out

    def unpack(self, st: struct.Struct) -> tuple[object, ...]:
        return st.unpack(self.take(st.size))

    def blob(self, wide: bool = False) -> bytes:
        (n,) = struct.unpack("<I" if wide else "<H", self.take(4 if wide else 2))
        return self.take(n)

    def done(self) -> None:
        if self.pos != len(self.data):
            raise WireError("trailing bytes")


def _blob(data: bytes, wide: bool = False) -> bytes:
    return struct.pack("<I" if wide else "<H", len(data)) + data


@dataclass(frozen=True, slots=True)
class Token:
    gid: bytes
    address: str
    agent: str
    metadata: bytes
    regions: tuple[tuple[str, str, int], ...]  # name, memory type, device


def encode_token(t: Token, keys: Keys | None) -> str:
    parts = [_TOKEN_HEAD.pack(b"KVFT", VERSION, t.gid), _blob(t.address.encode()), _blob(t.agent.encode()),
             _blob(t.metadata, wide=True), struct.pack("<H", len(t.regions))]
    parts += [_blob(name.encode()) + struct.pack("<BI", MEMS.index(mem), dev) for name, mem, dev in t.regions]
    body = b"".join(parts)
    raw = body + _tag(keys.token if keys else None, body)
    return TOKEN_PREFIX + base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_token(token: str, keys: Keys | None) -> Token:
    if not token.startswith(TOKEN_PREFIX):
        raise WireError("not a NIXL grant token")
    b64 = token[len(TOKEN_PREFIX) :]
    try:
        raw = base64.urlsafe_b64decode(b64 + "=" * (-len(b64) % 4))
    except (binascii.Error, ValueError) as e:
        raise WireError(f"bad base64: {e}") from e
    r = _Reader(_check(keys.token if keys else None, raw))
    magic, version, gid = r.unpack(_TOKEN_HEAD)
    if magic != b"KVFT" or version != VERSION:
        raise WireError("bad token magic or version")
    try:
        address, agent, md = r.blob().decode(), r.blob().decode(), r.blob(wide=True)
        (n,) = struct.unpack("<H", r.take(2))
        regions = []
        for _ in range(n):
            name = r.blob().decode()
            mem, dev = struct.unpack("<BI", r.take(5))
            regions.append((name, MEMS[mem], dev))
    except (UnicodeDecodeError, IndexError) as e:
        raise WireError(f"bad token field: {e}") from e
    r.done()
    assert isinstance(gid, bytes)
    return Token(gid, address, agent, md, tuple(regions))


def new_gid() -> bytes:
    return secrets.token_bytes(16)


@dataclass(frozen=True, slots=True)
class Note:
    kind: int
    gid: bytes
    wid: bytes
    chunk: int
    body: bytes  # what follows the header, tag removed


def encode_note(kind: int, gid: bytes, wid: bytes, chunk: int, body: bytes, key: bytes | None) -> bytes:
    data = _NOTE_HEAD.pack(b"KVFN", VERSION, kind, gid, wid, chunk) + body
    return data + _tag(key, data)


def decode_note(data: bytes, keys: Keys | None) -> Note:
    """A notification whose tag verified under the key of its direction (ACK: D → P, else P → D)."""
    if len(data) < _NOTE_HEAD.size + TAG or data[:4] != b"KVFN":
        raise WireError("not a kvferry notification")
    kind = data[5]
    key = None if keys is None else (keys.d2p if kind == ACK else keys.p2d)
    body = _check(key, data)
    magic, version, kind, gid, wid, chunk = _NOTE_HEAD.unpack(body[: _NOTE_HEAD.size])
    if version != VERSION or kind not in (REQ, ACK, CANCEL, PING):
        raise WireError("bad notification version or kind")
    return Note(kind, gid, wid, chunk, body[_NOTE_HEAD.size :])  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class Request:
    deadline_ns: int
    ttl_ns: int
    boot_id: bytes
    src_mem: str
    agent: str
    metadata: bytes
    ops: np.ndarray  # OP_DTYPE


def request_body(r: Request) -> bytes:
    head = _REQ.pack(r.deadline_ns, r.ttl_ns, r.boot_id, MEMS.index(r.src_mem), len(r.ops))
    return head + _blob(r.agent.encode()) + _blob(r.metadata, wide=True) + r.ops.astype(OP_DTYPE).tobytes()


def parse_request(body: bytes) -> Request:
    rd = _Reader(body)
    deadline, ttl, boot, mem, n = rd.unpack(_REQ)
    assert isinstance(mem, int) and isinstance(n, int)
    if mem >= len(MEMS):
        raise WireError("bad memory type")
    try:
        agent = rd.blob().decode()
    except UnicodeDecodeError as e:
        raise WireError("bad agent name") from e
    md = rd.blob(wide=True)
    ops = np.frombuffer(rd.take(n * OP_DTYPE.itemsize), OP_DTYPE)
    rd.done()
    return Request(int(deadline), int(ttl), bytes(boot), MEMS[mem], agent, md, ops)  # type: ignore[call-overload]


def ack_body(status: int) -> bytes:
    return _ACK.pack(status)


def parse_ack(body: bytes) -> int:
    if len(body) != _ACK.size or body[0] not in (OK, REJECTED, FAILED, LATE):
        raise WireError("bad ack")
    return body[0]


def boot_id() -> bytes:
    """This kernel's boot id: two processes with the same one share CLOCK_MONOTONIC."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return hashlib.sha256(f.read().strip().encode()).digest()[:16]
    except OSError:
        return secrets.token_bytes(16)  # unknown: never equal, so only the ttl counts
