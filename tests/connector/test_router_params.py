"""vllm-router's kv_transfer_params shapes → kvferry's (shared by the HTTP server and the vLLM adapter)."""

from __future__ import annotations

import pytest

from kvferry.connector.params import (
    RouterParamsError,
    normalize_kv_transfer_params,
    validate_kv_transfer_params,
)


def test_nixl_mode_prefill_gets_a_transfer_id_named_after_the_request() -> None:
    sent = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
            "remote_block_ids": None, "remote_host": None, "remote_port": None}
    out = normalize_kv_transfer_params(sent, "cmpl-7")
    assert out == {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": "xfer-cmpl-7"}
    assert normalize_kv_transfer_params(sent, "cmpl-7") == out  # the same request always gets the same name
    assert "transfer_id" not in sent
    validate_kv_transfer_params(out)


def test_mooncake_mode_bootstrap_address_loses_its_scheme() -> None:
    sent = {"do_remote_decode": False, "do_remote_prefill": True, "transfer_id": "xfer-1",
            "remote_engine_id": "p0", "remote_bootstrap_addr": "http://10.0.0.11:8998/"}
    out = normalize_kv_transfer_params(sent, "r")
    assert out is not None and out["remote_bootstrap_addr"] == "10.0.0.11:8998"
    validate_kv_transfer_params(out)


@pytest.mark.parametrize("params", [
    {"do_remote_decode": True, "do_remote_prefill": True, "transfer_id": "t"},
    {"do_remote_prefill": True, "transfer_id": "t", "remote_engine_id": "e", "remote_bootstrap_addr": "https://h:1"},
])
def test_shapes_that_cannot_work_are_refused(params: dict[str, object]) -> None:
    with pytest.raises(RouterParamsError):
        normalize_kv_transfer_params(params, "r")


def test_kvferry_shape_passes_unchanged() -> None:
    sent = {"do_remote_decode": True, "transfer_id": "xfer-9"}
    assert normalize_kv_transfer_params(sent, "r") == sent
    assert normalize_kv_transfer_params(None, "r") is None
