"""Control-plane messages between a decode rank (ZMQ DEALER) and a prefill rank (ZMQ ROUTER).

D sends `PullRequest`s (and `Heartbeat`s for its pending pulls); P answers each pull with
`PullResponse` frames: CONTINUE while it is working, then FINISH (ok) or ERROR. Anything that fails to
decode is answered with an ERROR, never a crash.
"""

from __future__ import annotations

import enum
from typing import TypeVar

import msgspec

from kvferry.connector.layout import LayoutDescription

# Far above any real pull (a 100k-token prompt is ~6k blocks); a bigger frame is hostile.
MAX_MESSAGE_BYTES = 1 << 20
# ZMQ drops a connection that sends a bigger frame (P's MAXMSGSIZE: what a stranger's half-sent frame
# can pin); below it every message gets its own answer. Pulls are far below MAX_MESSAGE_BYTES.
MAX_FRAME_BYTES = MAX_MESSAGE_BYTES + 4096
MAX_ID_BYTES = 64 << 10


class Status(enum.IntEnum):
    FINISH = 0
    CONTINUE = 1
    ERROR = 2


# Fields at their default are left out, so a P that predates one still reads every pull that does not
# use it (it refuses unknown fields).
class PullRequest(msgspec.Struct, tag="pull", forbid_unknown_fields=True, omit_defaults=True):
    transfer_id: str
    d_request_id: str
    d_transfer_addr: str  # host:port of D rank's TransferEngine
    grant_token: str  # D's open grant for exactly these blocks
    # D's local block ids, one per prompt block from `first_block` on; empty = release-only pull
    block_ids: list[int]
    d_num_blocks: int  # size of D's pool (same layout otherwise), so P can place and check D's ids
    d_tp_size: int
    d_tp_rank: int
    num_tokens: int  # prompt tokens D expects to receive
    lease_s: float = 0.0  # 0 = P's default lease (P clamps any other value to its abort timeout)
    want_checksums: bool = True
    d_layout: LayoutDescription | None = None  # D's own memory (bases, strides), when its layout has one
    # D's prompt, chained per block (`auth.prompt_digest`): P writes only KV of the prompt D decodes.
    prompt_digest: str = ""
    # The prompt blocks D already holds (its prefix cache): `block_ids` name blocks from this prompt block
    # on, in every KV cache group (`KVLayout.pull_positions`); the prompt digest still covers all of it.
    first_block: int = 0


class Heartbeat(msgspec.Struct, tag="hb", forbid_unknown_fields=True):
    """Keeps P's leases on these transfers alive and proves D is still there."""

    transfer_ids: list[str]
    lease_s: float = 0.0


class Release(msgspec.Struct, tag="release", forbid_unknown_fields=True):
    """D no longer wants these transfers (aborted before its pull): P may free their blocks."""

    transfer_ids: list[str]


Inbound = PullRequest | Heartbeat | Release


class FirstToken(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The token P sampled after the prompt and how it sampled it: D emits it as its first token, without
    computing the last prompt position again, when its own request samples the same way."""

    token: int
    temperature: float
    seed: int | None = None


class PullResponse(msgspec.Struct, tag="resp", forbid_unknown_fields=True):
    status: Status
    d_request_id: str = ""
    transfer_id: str = ""
    ok_reqs: list[str] = []
    err_reqs: list[str] = []
    err_msg: str = ""
    # One xxh64 per block written, in the order of PullRequest.block_ids (D verifies before accepting).
    checksums: list[int] = []
    bytes_written: int = 0
    # True when the answer comes from fault injection (diagnostics only).
    injected: bool = False
    # For ERROR: the failure cause D reports (`expired`, `transport`, ...); empty = `error_reply`.
    cause: str = ""
    # For FINISH: P's first sampled token, when P's engine is kvferry's (None: D computes it).
    first_token: FirstToken | None = None


class HeartbeatAck(msgspec.Struct, tag="hb_ack", forbid_unknown_fields=True):
    unknown: list[str] = []  # transfer ids P does not hold (expired or never seen)
    working: list[str] = []  # transfer ids P still has queued, prefilling or being written: keep waiting


class NotMe(msgspec.Struct, tag="not_me", forbid_unknown_fields=True):
    """P → a D socket that sealed for another receiver at this address (an earlier P process, whose
    boot id it named): that process is gone, so D need not wait out any bound. Sealed for the D
    session that sent it, so only that socket can act on it."""

    receiver: bytes  # what D sealed for


Outbound = PullResponse | HeartbeatAck | NotMe


class _Ids(msgspec.Struct):
    """The ids of a message P could not accept, so its ERROR names what it is about."""

    transfer_id: str = ""
    d_request_id: str = ""


_inbound_decoder = msgspec.msgpack.Decoder(Inbound)
_response_decoder = msgspec.msgpack.Decoder(Outbound)
_encoder = msgspec.msgpack.Encoder()


T = TypeVar("T")


class MessageError(ValueError):
    pass


def encode(message: msgspec.Struct) -> bytes:
    return _encoder.encode(message)


def _decode(decoder: msgspec.msgpack.Decoder[T], data: bytes) -> T:
    if len(data) > MAX_MESSAGE_BYTES:
        raise MessageError(f"message of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}")
    try:
        return decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise MessageError(str(exc)) from exc


def decode_inbound(data: bytes) -> Inbound:
    return _decode(_inbound_decoder, data)


_ids_decoder = msgspec.msgpack.Decoder(_Ids)


def salvage_ids(data: bytes) -> tuple[str, str]:
    """(transfer_id, d_request_id) of a message that failed validation, or empty strings."""
    try:
        ids = _ids_decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return "", ""
    if len(ids.transfer_id) + len(ids.d_request_id) > MAX_ID_BYTES:
        return "", ""  # echoing it would make the reply itself oversized
    return ids.transfer_id, ids.d_request_id


def decode_response(data: bytes) -> Outbound:
    return _decode(_response_decoder, data)
