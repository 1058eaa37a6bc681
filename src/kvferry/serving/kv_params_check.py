"""Shape checks on `kv_transfer_params` at the HTTP edge (instances and the proxy), before anything is
queued or sent to a peer: a malformed or oversized value gets a 400 here, never a dropped control
connection on P (an oversized transfer_id once failed every other pull to the same P).

Only what is malformed or oversized is refused; every router's shape passes: null `remote_*` keys and
no `transfer_id` with `do_remote_decode` (vllm-router), `http://` bootstrap addresses (its Mooncake mode),
unknown extra keys (vLLM adds some). Whether a request can be honoured is `pd_protocols`' business.
"""

from __future__ import annotations

import json
import re
from typing import Any

MAX_ID_CHARS = 256
MAX_PARAMS_BYTES = 64 * 1024  # remote_block_ids of a 16k-token prompt fit many times over
MAX_KEY_CHARS = 64
_ID = re.compile(r"[A-Za-z0-9._:@/+=~\-\[\]]+")
_HOST = re.compile(r"[A-Za-z0-9.\-]+|\[[0-9A-Fa-f:.]+\]")
_IDS = ("transfer_id", "remote_engine_id", "remote_request_id", "request_id")
_FLAGS = ("do_remote_decode", "do_remote_prefill")


class KVParamsShapeError(ValueError):
    """kv_transfer_params that no protocol accepts (HTTP 400, message says which field and why)."""


def check_kv_transfer_params(params: Any) -> None:
    if params is None:
        return
    if not isinstance(params, dict):
        raise KVParamsShapeError("kv_transfer_params must be an object")
    for key in params:
        if len(key) > MAX_KEY_CHARS:
            raise KVParamsShapeError(f"kv_transfer_params has a key longer than {MAX_KEY_CHARS} characters")
    for key in _FLAGS:
        if params.get(key) is not None and not isinstance(params[key], bool):
            raise KVParamsShapeError(f"kv_transfer_params.{key} must be a boolean")
    for key in _IDS:
        _check_id(key, params.get(key))
    _check_host("remote_host", params.get("remote_host"))
    _check_int("remote_port", params.get("remote_port"), 0, 65535)
    _check_int("remote_tp_size", params.get("remote_tp_size"), 1, 4096)
    _check_addr(params.get("remote_bootstrap_addr"))
    _check_block_ids(params.get("remote_block_ids"))
    size = len(json.dumps(params, separators=(",", ":")).encode())
    if size > MAX_PARAMS_BYTES:
        raise KVParamsShapeError(f"kv_transfer_params is {size} bytes; at most {MAX_PARAMS_BYTES}")


def _check_id(key: str, value: Any) -> None:
    if value is None:
        return
    if not isinstance(value, str):
        raise KVParamsShapeError(f"kv_transfer_params.{key} must be a string")
    if not value or len(value) > MAX_ID_CHARS:
        raise KVParamsShapeError(f"kv_transfer_params.{key} must have 1 to {MAX_ID_CHARS} characters")
    if not _ID.fullmatch(value):
        raise KVParamsShapeError(f"kv_transfer_params.{key} may only use letters, digits and ._:@/+=~-[]")


def _check_host(key: str, value: Any) -> None:
    if value is None:
        return
    if not isinstance(value, str) or not 0 < len(value) <= 255 or not _HOST.fullmatch(value):
        raise KVParamsShapeError(f"kv_transfer_params.{key} must be a host name or IP address")


def _check_int(key: str, value: Any, low: int, high: int) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise KVParamsShapeError(f"kv_transfer_params.{key} must be an integer in [{low}, {high}]")


def _check_addr(value: Any) -> None:
    if value is None:
        return
    message = "kv_transfer_params.remote_bootstrap_addr must be host:port (optionally http://host:port)"
    if not isinstance(value, str) or len(value) > 300:
        raise KVParamsShapeError(message)
    host, sep, port = value.removeprefix("http://").rstrip("/").rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536 or not host or not _HOST.fullmatch(host):
        raise KVParamsShapeError(message)


def _check_block_ids(value: Any) -> None:
    if value is None:
        return
    # vLLM sends one list, or one list per KV-cache group.
    groups = value if isinstance(value, list) and value and all(isinstance(g, list) for g in value) else [value]
    for group in groups:
        if not isinstance(group, list) or any(isinstance(b, bool) or not isinstance(b, int) or b < 0 for b in group):
            raise KVParamsShapeError("kv_transfer_params.remote_block_ids must be a list of non-negative integers")
