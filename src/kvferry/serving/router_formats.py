"""The P/D protocols an instance speaks, turned into kvferry's own `kv_transfer_params` in one place:
kvferry / vLLM Mooncake proxy (passed through), vllm-router NIXL mode (P makes a transfer id from its
request id), vllm-router Mooncake mode (the `http://` is dropped), and sglang-router (`bootstrap_*`
fields: transfer id `room-<room>`, D asks the named bootstrap server which engine serves the room).

A request whose P/D fields this instance cannot honour is refused (`ProtocolError` → HTTP 400), so a P/D
request is never silently computed in full on both sides."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Annotated, Any

import httpx
import msgspec

from kvferry.connector.bootstrap import FAIL_AFTER_S, BootstrapError, PrefillAllowList, refused_alike
from kvferry.connector.params import RouterParamsError, failing_field, normalize_kv_transfer_params

SGLANG_FIELDS = ("bootstrap_host", "bootstrap_port", "bootstrap_room")
_MAX_ROOM = 2**64 - 1
_ENGINE_CACHE_S = 10.0


class SglangBootstrap(msgspec.Struct, frozen=True):
    """sglang-router's P/D fields, in the order they are checked."""

    bootstrap_host: Annotated[str, msgspec.Meta(min_length=1, max_length=255, pattern=r"^[^/:@ ]*\Z")]
    bootstrap_port: Annotated[int, msgspec.Meta(gt=0, lt=65536)]
    bootstrap_room: Annotated[int, msgspec.Meta(ge=0)]  # and <= _MAX_ROOM: msgspec bounds stop at int64


_SGLANG_ERRORS = {
    "bootstrap_host": "bootstrap_host must be a host name or IPv4 address",
    "bootstrap_port": "bootstrap_port must be an integer port",
    "bootstrap_room": "bootstrap_room must be an unsigned 64-bit integer",
}


class ProtocolError(ValueError):
    """The request's P/D fields cannot be honoured here (the API answers 400 with this message)."""


@dataclass(frozen=True)
class PDRequest:
    """What the engine is asked to do with one request."""

    kv_transfer_params: dict[str, Any] | None
    protocol: str  # "none" | "kvferry" | "vllm-router" | "sglang"
    prefill_only: bool = False  # P of sglang's protocol: one token, whatever max_tokens says
    # D of sglang's protocol: P's engine is looked up by this room before the request is submitted.
    sglang_room: int | None = None


def sglang_transfer_id(room: int) -> str:
    return f"room-{room}"


def translate(role: str, params: dict[str, Any] | None, extra: dict[str, Any], request_id: str) -> PDRequest:
    """Map the request's P/D fields (whatever protocol they follow) onto kvferry's `kv_transfer_params`."""
    sglang = {k: extra[k] for k in SGLANG_FIELDS if extra.get(k) is not None}
    if sglang and params:
        raise ProtocolError("a request carries either kv_transfer_params or sglang's bootstrap_* fields, not both")
    if sglang:
        return _sglang(role, sglang)
    if not params:
        return PDRequest(None, "none")
    try:
        normalized = normalize_kv_transfer_params(params, request_id)
    except RouterParamsError as exc:
        raise ProtocolError(f"kv_transfer_params: {exc}") from None
    remote_decode, remote_prefill = bool(params.get("do_remote_decode")), bool(params.get("do_remote_prefill"))
    if not (remote_decode or remote_prefill):
        return PDRequest(normalized, "none")  # no P/D direction (e.g. both flags false): plain
    _check_role(role, "prefill" if remote_decode else "decode")
    return PDRequest(normalized, "kvferry" if normalized == params else "vllm-router")


def _check_role(role: str, needed: str) -> None:
    if role != needed:
        what = "a colocated instance (role both)" if role == "both" else f"a {role} instance"
        raise ProtocolError(f"this P/D request needs a {needed} instance, but this is {what}")


def _sglang(role: str, fields: dict[str, Any]) -> PDRequest:
    missing = [k for k in SGLANG_FIELDS if k not in fields]
    if missing:
        raise ProtocolError(f"sglang P/D request without {', '.join(missing)}")
    try:
        checked = msgspec.convert({k: fields[k] for k in SGLANG_FIELDS}, SglangBootstrap)
    except msgspec.ValidationError as exc:
        raise ProtocolError(_SGLANG_ERRORS.get(failing_field(exc), _SGLANG_ERRORS["bootstrap_host"])) from None
    host, port, room = checked.bootstrap_host, checked.bootstrap_port, checked.bootstrap_room
    if room > _MAX_ROOM:
        raise ProtocolError(_SGLANG_ERRORS["bootstrap_room"])
    if role == "prefill":
        params = {"do_remote_decode": True, "transfer_id": sglang_transfer_id(room)}
        return PDRequest(params, "sglang", prefill_only=True)
    _check_role(role, "decode")
    params = {
        "do_remote_prefill": True,
        "transfer_id": sglang_transfer_id(room),
        "remote_bootstrap_addr": f"{host}:{port}",
    }
    return PDRequest(params, "sglang", sglang_room=room)


class EngineResolver:
    """sglang's D knows P's bootstrap server and the room, not P's engine id: ask the server (cached); the
    room picks one of its ranks (`room % number of ranks`). The address comes from the client, so only an
    allowed host and port is asked and every failure is one `REFUSED` answer (no SSRF, no port oracle).
    The list needs no MAC: it only names an engine id, whose lookup at the same address must carry one."""

    def __init__(self, allow: PrefillAllowList, timeout_s: float = FAIL_AFTER_S) -> None:
        self._allow = allow
        self._timeout_s = timeout_s
        # Valid answers, kept when stale: a server that once answered fails fast with its reason.
        self._cache: dict[str, tuple[float, list[str]]] = {}

    async def engine_for(self, bootstrap_addr: str, room: int) -> str:
        """Raises BootstrapError (with the secret's rule: `REFUSED` unless this server answered before)."""
        engines = await refused_alike(
            self._allow, bootstrap_addr, lambda: self._engines(bootstrap_addr), self._cache.__contains__,
            self._timeout_s,
        )
        return engines[room % len(engines)]

    async def _engines(self, bootstrap_addr: str) -> list[str]:
        cached = self._cache.get(bootstrap_addr)
        if cached is not None and time.monotonic() - cached[0] < _ENGINE_CACHE_S:
            return cached[1]
        try:  # no redirects (httpx's default): D asks the allowed address and no other
            async with httpx.AsyncClient(timeout=self._timeout_s) as client:
                response = await client.get(f"http://{bootstrap_addr}/query")
            ranks = response.json() if response.status_code == 200 else None
        except (httpx.HTTPError, ValueError) as exc:
            raise BootstrapError(f"bootstrap server {bootstrap_addr} unreachable: {type(exc).__name__}") from exc
        if not isinstance(ranks, dict) or not ranks:
            raise BootstrapError(f"bootstrap server {bootstrap_addr} lists no prefill engine")
        try:
            engines = [str(ranks[k]["engine_id"]) for k in sorted(ranks, key=int)]
        except (KeyError, TypeError, ValueError) as exc:
            raise BootstrapError(f"bootstrap server {bootstrap_addr} sent a malformed engine list") from exc
        self._cache[bootstrap_addr] = (time.monotonic(), engines)
        return engines
