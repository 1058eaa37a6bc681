"""Wire format of the built-in TCP engine (little endian, `struct` on the hot path).

Connection: server HELLO (+ advertised address) → client AUTH (+ dialed address) → server AUTH_RESULT,
then write messages: MSG header, meta (region-name table + op table), the ops' bytes in op order. Each
gets one REPLY: OK once every byte landed, or REJECTED/PROTOCOL with a reason. With a secret the payload
is encrypted and every message and reply ends with a TAG_BYTES tag (`auth`, `mac`)."""

from __future__ import annotations

import enum
import struct

import numpy as np
import numpy.typing as npt

VERSION = 3  # 2: addresses in the handshake, tagged messages and replies; 3: encrypted payloads
HELLO_MAGIC = b"KVFH"
AUTH_MAGIC = b"KVFA"
RESULT_MAGIC = b"KVFR"
MSG_MAGIC = b"KVFW"
REPLY_MAGIC = b"KVFK"

FLAG_AUTH = 1  # HELLO: the server requires the shared secret / AUTH: a proof is present

HELLO = struct.Struct("<4sBBH16s")  # magic, version, flags, address length, server nonce; address
AUTH = struct.Struct("<4sBBH16s32s")  # magic, version, flags, address length, client nonce, MAC; address
AUTH_RESULT = struct.Struct("<4sB3x32s")  # magic, status (AuthStatus), server MAC
MSG = struct.Struct("<4sB3x16sIIQI")  # magic, version, token, n_ops, meta_len, payload_len, ttl_ms
REPLY = struct.Struct("<4sBBH")  # magic, status, code, reason length (reason follows)
NAME_LEN = struct.Struct("<H")

# One op of the op table: destination region index, offset, length (packed, 18 bytes).
OP_DTYPE = np.dtype([("region", "<u2"), ("offset", "<u8"), ("length", "<u8")])

TOKEN_BYTES = 16
NONCE_BYTES = 16
TAG_BYTES = 16
MAX_ADDR = 300  # bytes of an address in the handshake (a 253-byte name, brackets and a port fit)
MSG_OPS = 1 << 16  # the sender's split size (ops per message)
MAX_OPS = MSG_OPS  # the receiver refuses more: nobody legitimate sends them
MSG_BYTES = 256 << 20  # the sender's split size (payload bytes per message), without a secret
# With a secret the receiver stages, decrypts and verifies a whole message before scattering it: at most
# this much payload (more is refused), in buffers each side holds per connection.
AUTH_MSG_BYTES = 1 << 20
MAX_REGIONS = 1024
MAX_NAME = 255  # bytes of one region name
MAX_TABLE = NAME_LEN.size + MAX_REGIONS * (NAME_LEN.size + MAX_NAME)  # the largest region-name table
MAX_OP_BYTES = 1 << 40
IOV_BATCH = 512  # iovecs per socket.sendmsg/recvmsg_into call (memoryview path; `iovec` uses IOV_MAX)


def max_meta(n_ops: int) -> int:
    """The largest meta that `n_ops` ops can need: the op table plus the largest region table."""
    return MAX_TABLE + n_ops * OP_DTYPE.itemsize


def min_meta(n_ops: int) -> int:
    return NAME_LEN.size + n_ops * OP_DTYPE.itemsize


class Status(enum.IntEnum):
    OK = 0
    REJECTED = 1
    PROTOCOL = 2


class Code(enum.IntEnum):
    OK = 0
    UNKNOWN_GRANT = 1  # unknown token, or the grant was already closed
    GRANT_CLOSED = 2  # the grant closed while the message was landing
    UNKNOWN_REGION = 3
    OUT_OF_REGION = 4
    OUTSIDE_GRANT = 5
    MALFORMED = 6


class AuthStatus(enum.IntEnum):
    OK = 0
    BAD_PROOF = 1  # wrong or missing secret
    MISDIRECTED = 2  # the client dialed another address than this server's (a relay)


class ProtocolError(Exception):
    """The peer sent bytes that do not follow this format."""


def encode_reply(status: Status, code: Code, reason: str = "") -> bytes:
    raw = reason.encode()[:1024]
    return REPLY.pack(REPLY_MAGIC, status, code, len(raw)) + raw


def token_bytes(token: str) -> bytes:
    """The 16 raw bytes behind a hex token; ValueError if it is not one."""
    raw = bytes.fromhex(token)
    if len(raw) != TOKEN_BYTES:
        raise ValueError("token must be 32 hex digits")
    return raw


def encode_meta(names: list[str], regions: npt.ArrayLike, offsets: npt.ArrayLike,
                lengths: npt.ArrayLike) -> bytes:
    parts = [NAME_LEN.pack(len(names))]
    for name in names:
        raw = name.encode()
        parts.append(NAME_LEN.pack(len(raw)))
        parts.append(raw)
    table = np.empty(np.shape(regions), OP_DTYPE)
    table["region"] = regions
    table["offset"] = offsets
    table["length"] = lengths
    parts.append(table.tobytes())
    return b"".join(parts)


def decode_meta(meta: bytes, n_ops: int) -> tuple[list[str], np.ndarray]:
    """Region names and the op table; ProtocolError when the sizes do not add up."""
    try:
        (n_names,) = NAME_LEN.unpack_from(meta, 0)
        if n_names > MAX_REGIONS:
            raise ProtocolError("too many regions")
        pos = NAME_LEN.size
        names: list[str] = []
        for _ in range(n_names):
            (ln,) = NAME_LEN.unpack_from(meta, pos)
            pos += NAME_LEN.size
            if ln > MAX_NAME:
                raise ProtocolError("region name too long")
            if pos + ln > len(meta):
                raise ProtocolError("truncated region name")
            names.append(meta[pos : pos + ln].decode())
            pos += ln
    except (struct.error, UnicodeDecodeError) as e:
        raise ProtocolError(f"bad region table: {e}") from e
    if len(meta) - pos != n_ops * OP_DTYPE.itemsize:
        raise ProtocolError("op table size does not match the op count")
    ops = np.frombuffer(meta, OP_DTYPE, count=n_ops, offset=pos)
    if n_ops and int(ops["region"].max()) >= len(names):
        raise ProtocolError("op refers to a region index outside the table")
    return names, ops
