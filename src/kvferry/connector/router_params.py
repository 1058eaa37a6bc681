"""vllm-router's shapes of `kv_transfer_params`, turned into kvferry's. Shared by kvferry's own HTTP server
and the vLLM adapter (vLLM hands a request's kv_transfer_params to the connector as the client sent them).

- NIXL mode sends P `do_remote_decode` with no `transfer_id` and null `remote_*` keys: the null keys are
  dropped and P names the transfer `xfer-<request id>` (its answer carries the name to D).
- Mooncake mode names P's bootstrap server `http://host:port`: the scheme is dropped.
"""

from __future__ import annotations

from typing import Any

_NULLABLE = ("remote_engine_id", "remote_block_ids", "remote_host", "remote_port", "remote_bootstrap_addr")


class RouterParamsError(ValueError):
    pass


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
