"""Wire format of the built-in TCP engine (little endian, `struct` on the hot path).

Connection:  server HELLO → client AUTH → server AUTH_RESULT, then any number of write messages.
Write message (client → server): MSG header, meta (region-name table + op table), payload bytes
(the ops' bytes back to back, in op order).  The server answers every message with one REPLY: OK once
every byte landed, or REJECTED/PROTOCOL with a reason (possibly before the payload was read).
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import struct

import numpy as np
import numpy.typing as npt

VERSION = 1
HELLO_MAGIC = b"KVFH"
AUTH_MAGIC = b"KVFA"
RESULT_MAGIC = b"KVFR"
MSG_MAGIC = b"KVFW"
REPLY_MAGIC = b"KVFK"

FLAG_AUTH = 1  # HELLO: the server requires the shared secret / AUTH: a MAC is present

HELLO = struct.Struct("<4sBB2x16s")  # magic, version, flags, server nonce
AUTH = struct.Struct("<4sBB2x16s32s")  # magic, version, flags, client nonce, client MAC
AUTH_RESULT = struct.Struct("<4sB3x32s")  # magic, status (0 ok), server MAC
MSG = struct.Struct("<4sB3x16sIIQI")  # magic, version, token, n_ops, meta_len, payload_len, ttl_ms
REPLY = struct.Struct("<4sBBH")  # magic, status, code, reason length (reason follows)
NAME_LEN = struct.Struct("<H")

# One op of the op table: destination region index, offset, length (packed, 18 bytes).
OP_DTYPE = np.dtype([("region", "<u2"), ("offset", "<u8"), ("length", "<u8")])

TOKEN_BYTES = 16
MAX_OPS = 1 << 20  # per message; the sender splits bigger writes
MAX_META = MAX_OPS * OP_DTYPE.itemsize + (1 << 20)
MAX_REGIONS = 1024
MAX_OP_BYTES = 1 << 40
MSG_OPS = 1 << 16  # the sender's split size
IOV_BATCH = 512  # iovecs per sendmsg/recvmsg_into call (IOV_MAX is 1024 on Linux)


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


class ProtocolError(Exception):
    """The peer sent bytes that do not follow this format."""


def client_mac(secret: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    return hmac.new(secret, b"kvferry/1/client" + server_nonce + client_nonce, hashlib.sha256).digest()


def server_mac(secret: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    return hmac.new(secret, b"kvferry/1/server" + client_nonce + server_nonce, hashlib.sha256).digest()


def encode_reply(status: Status, code: Code, reason: str = "") -> bytes:
    raw = reason.encode()[:1024]
    return REPLY.pack(REPLY_MAGIC, status, code, len(raw)) + raw


def token_bytes(token: str) -> bytes:
    """The 16 raw bytes behind a hex token; ValueError if it is not one."""
    raw = bytes.fromhex(token)
    if len(raw) != TOKEN_BYTES:
        raise ValueError("token must be 32 hex digits")
    return raw


def encode_meta(
    names: list[str], regions: npt.ArrayLike, offsets: npt.ArrayLike, lengths: npt.ArrayLike
) -> bytes:
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
