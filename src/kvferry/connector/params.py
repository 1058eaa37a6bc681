"""`kv_transfer_params`, in one place: the shape every protocol's params must have (one typed record,
`KVTransferParams`, its bounds as msgspec constraints), vllm-router's shapes turned into kvferry's, and
what kvferry itself needs to carry a request across.

1. `check_kv_transfer_params`, at the HTTP edge (instances and the proxy), before anything is queued or sent to a
   peer: a malformed or oversized value gets a 400 there, never a dropped control connection on P (an
   oversized transfer_id once failed every other pull to the same P). Only what is malformed or
   oversized is refused; every router's shape passes: null `remote_*` keys and no `transfer_id` with
   `do_remote_decode` (vllm-router), `http://` bootstrap addresses (its Mooncake mode), unknown extra
   keys (vLLM adds some).
2. `normalize_kv_transfer_params`, shared by kvferry's HTTP server and the vLLM adapter (vLLM hands a
   request's params to the connector as the client sent them): vllm-router's NIXL mode sends P
   `do_remote_decode` with no `transfer_id` and null `remote_*` keys (the null keys are dropped and P
   names the transfer `xfer-<request id>`; its answer carries the name to D); its Mooncake mode names
   P's bootstrap server `http://host:port` (the scheme is dropped).
3. `validate_kv_transfer_params`: params that can never work (the API answers 400; the vLLM adapter
   ignores them). vLLM's requests never pass the HTTP edge, so this is all they are checked by.

The params stay a dict after the check: unknown keys travel on (vLLM's own), which a record would drop."""

from __future__ import annotations

import json
import re
from typing import Annotated, Any

import msgspec

MAX_ID_CHARS = 256
MAX_PARAMS_BYTES = 64 * 1024  # remote_block_ids of a 16k-token prompt fit many times over
MAX_KEY_CHARS = 64
_HOST = r"(?:[A-Za-z0-9.\-]+|\[[0-9A-Fa-f:.]+\])"

Id = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_ID_CHARS, pattern=r"^[A-Za-z0-9._:@/+=~\-\[\]]+\Z")]
Host = Annotated[str, msgspec.Meta(min_length=1, max_length=255, pattern=rf"^{_HOST}\Z")]
BlockId = Annotated[int, msgspec.Meta(ge=0)]


class KVTransferParams(msgspec.Struct, kw_only=True, frozen=True):
    """What any protocol's kv_transfer_params may hold (null is absent); fields in the order they are checked."""

    do_remote_decode: bool | None = None
    do_remote_prefill: bool | None = None
    transfer_id: Id | None = None
    remote_engine_id: Id | None = None
    remote_request_id: Id | None = None
    request_id: Id | None = None
    remote_host: Host | None = None
    remote_port: Annotated[int, msgspec.Meta(ge=0, le=65535)] | None = None
    remote_tp_size: Annotated[int, msgspec.Meta(ge=1, le=4096)] | None = None
    remote_bootstrap_addr: Annotated[str, msgspec.Meta(max_length=300)] | None = None  # and host:port, below
    remote_block_ids: list[BlockId | list[BlockId]] | None = None  # vLLM: one list, or one per KV-cache group


class KVParamsShapeError(ValueError):
    """kv_transfer_params that no protocol accepts (HTTP 400, message says which field and why)."""


class RouterParamsError(ValueError):
    pass


class KVTransferParamsError(ValueError):
    pass


_FIELDS = KVTransferParams.__struct_fields__
_ADDR_MESSAGE = "kv_transfer_params.remote_bootstrap_addr must be host:port (optionally http://host:port)"
_BLOCKS_MESSAGE = "kv_transfer_params.remote_block_ids must be a list of non-negative integers"
_MESSAGES = {
    "do_remote_decode": "must be a boolean",
    "do_remote_prefill": "must be a boolean",
    "remote_host": "must be a host name or IP address",
    "remote_port": "must be an integer in [0, 65535]",
    "remote_tp_size": "must be an integer in [1, 4096]",
}
_WHERE = re.compile(r" - at `\$\.(\w+)")


def check_kv_transfer_params(params: Any) -> None:
    """Raise KVParamsShapeError for kv_transfer_params that no protocol accepts (None passes)."""
    if params is None:
        return
    if not isinstance(params, dict):
        raise KVParamsShapeError("kv_transfer_params must be an object")
    for key in params:
        if len(key) > MAX_KEY_CHARS:
            raise KVParamsShapeError(f"kv_transfer_params has a key longer than {MAX_KEY_CHARS} characters")
    # msgspec checks in the input's order: the record's order, so the first bad field is the one named.
    try:
        parsed = msgspec.convert({k: params[k] for k in _FIELDS if k in params}, KVTransferParams)
    except msgspec.ValidationError as exc:
        key = failing_field(exc)
        if key == "remote_block_ids":
            _check_addr(params.get("remote_bootstrap_addr"))  # the address is checked before the blocks
        raise KVParamsShapeError(_message(key, str(exc))) from None
    _check_addr(parsed.remote_bootstrap_addr)
    groups = parsed.remote_block_ids or []
    if len({isinstance(g, list) for g in groups}) > 1:  # one list, or only lists: not both
        raise KVParamsShapeError(_BLOCKS_MESSAGE)
    size = len(json.dumps(params, separators=(",", ":")).encode())
    if size > MAX_PARAMS_BYTES:
        raise KVParamsShapeError(f"kv_transfer_params is {size} bytes; at most {MAX_PARAMS_BYTES}")


def failing_field(exc: msgspec.ValidationError) -> str:
    """The top-level field a msgspec validation error names ("" if none)."""
    where = _WHERE.search(str(exc))
    return where.group(1) if where else ""


def _message(key: str, error: str) -> str:
    if key == "remote_bootstrap_addr":
        return _ADDR_MESSAGE
    if key == "remote_block_ids":
        return _BLOCKS_MESSAGE
    if key in _MESSAGES:
        return f"kv_transfer_params.{key} {_MESSAGES[key]}"
    if " of length " in error:
        return f"kv_transfer_params.{key} must have 1 to {MAX_ID_CHARS} characters"
    if " matching regex " in error:
        return f"kv_transfer_params.{key} may only use letters, digits and ._:@/+=~-[]"
    return f"kv_transfer_params.{key} must be a string"


def _check_addr(value: str | None) -> None:
    if value is None:
        return
    host, sep, port = value.removeprefix("http://").rstrip("/").rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536 or not host or not re.fullmatch(_HOST, host):
        raise KVParamsShapeError(_ADDR_MESSAGE)


_NULLABLE = ("remote_engine_id", "remote_block_ids", "remote_host", "remote_port", "remote_bootstrap_addr")


def normalize_kv_transfer_params(params: dict[str, Any] | None, request_id: str) -> dict[str, Any] | None:
    """kvferry's own parameters for any shape vllm-router sends (a new dict; the input is not changed)."""
    if not params:
        return params
    out = {k: v for k, v in params.items() if not (k in _NULLABLE and v is None)}
    if out.get("do_remote_decode") and out.get("do_remote_prefill"):
        raise RouterParamsError("do_remote_decode and do_remote_prefill are exclusive")
    if out.get("do_remote_decode") and "transfer_id" not in out:
        out["transfer_id"] = f"xfer-{request_id}"
    addr = out.get("remote_bootstrap_addr")
    if isinstance(addr, str) and addr.startswith("http://"):
        out["remote_bootstrap_addr"] = addr = addr.removeprefix("http://").rstrip("/")
    if isinstance(addr, str) and "://" in addr:
        raise RouterParamsError("remote_bootstrap_addr must be host:port or http://host:port")
    return out


def validate_kv_transfer_params(params: dict[str, Any] | None) -> None:
    """Raise a clear error for kv_transfer_params that can never work (the API answers 400)."""
    if not params:
        return
    if params.get("do_remote_decode") and not isinstance(params.get("transfer_id"), str):
        raise KVTransferParamsError("do_remote_decode needs a string transfer_id")
    if params.get("do_remote_prefill"):
        for key in ("transfer_id", "remote_engine_id", "remote_bootstrap_addr"):
            if not isinstance(params.get(key), str) or not params[key]:
                raise KVTransferParamsError(f"do_remote_prefill needs a non-empty string {key}")
        host, sep, port = str(params["remote_bootstrap_addr"]).rpartition(":")
        if not sep or not host or not port.isdigit():
            raise KVTransferParamsError("remote_bootstrap_addr must be host:port")
