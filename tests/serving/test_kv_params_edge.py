"""Issue 13.6 (HTTP edge): malformed or oversized kv_transfer_params get a clear 400 on instances and
on the proxy, before anything reaches P's control socket; every router's shape still passes."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from kvferry.connector.fake import ScriptedConnector
from kvferry.connector.params import KVParamsShapeError, check_kv_transfer_params
from kvferry.engine.engine import Engine, EngineConfig
from kvferry.engine.model import ModelConfig
from kvferry.serving.api_server import build_app
from kvferry.serving.proxy import build_proxy_app

BAD: list[tuple[dict[str, Any], str]] = [
    ({"do_remote_decode": True, "transfer_id": "x" * (3 << 20)}, "transfer_id"),
    ({"do_remote_decode": True, "transfer_id": "x" * 257}, "transfer_id"),
    ({"do_remote_decode": True, "transfer_id": "a b\n"}, "transfer_id"),
    ({"do_remote_decode": True, "transfer_id": 7}, "transfer_id"),
    ({"do_remote_decode": "yes", "transfer_id": "t"}, "do_remote_decode"),
    ({"do_remote_prefill": True, "transfer_id": "t", "remote_engine_id": ["e"],
      "remote_bootstrap_addr": "127.0.0.1:9"}, "remote_engine_id"),
    ({"do_remote_prefill": True, "transfer_id": "t", "remote_engine_id": "e",
      "remote_bootstrap_addr": "127.0.0.1:99999"}, "remote_bootstrap_addr"),
    ({"do_remote_prefill": True, "transfer_id": "t", "remote_engine_id": "e",
      "remote_bootstrap_addr": "ftp://h:1"}, "remote_bootstrap_addr"),
    ({"do_remote_prefill": True, "remote_port": "80"}, "remote_port"),
    ({"do_remote_prefill": True, "remote_host": "evil host"}, "remote_host"),
    ({"do_remote_prefill": True, "remote_block_ids": [1, -2]}, "remote_block_ids"),
    ({"do_remote_decode": True, "x" * 100: 1}, "key"),
    ({"do_remote_decode": True, "junk": "y" * 70_000}, "bytes"),
]

GOOD: list[dict[str, Any]] = [
    # kvferry's proxy
    {"do_remote_decode": True, "transfer_id": "xfer-2b7e4c1a-0000-4000-8000-000000000000"},
    {"do_remote_prefill": True, "transfer_id": "xfer-1", "remote_engine_id": "prefill-127.0.0.1:8100",
     "remote_bootstrap_addr": "127.0.0.1:8998"},
    # vllm-router (NIXL): no transfer_id on P, null remote_* keys
    {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None, "remote_block_ids": None,
     "remote_host": None, "remote_port": None},
    # vllm-router (Mooncake): http:// bootstrap address
    {"do_remote_prefill": True, "transfer_id": "cmpl-abc", "remote_engine_id": "e1",
     "remote_bootstrap_addr": "http://p0.local:8998", "remote_block_ids": [0, 1, 2], "remote_host": "10.0.0.5",
     "remote_port": 5600, "remote_tp_size": 2},
    {"remote_block_ids": [[0, 1], [2]], "tp_size": 1},
    {"do_remote_prefill": True, "remote_bootstrap_addr": "[::1]:8998", "transfer_id": "room-18446744073709551615"},
]


@pytest.mark.parametrize("params", GOOD)
def test_router_shapes_pass(params: dict[str, Any]) -> None:
    check_kv_transfer_params(params)


@pytest.mark.parametrize(("params", "field"), BAD)
def test_malformed_shapes_are_refused(params: dict[str, Any], field: str) -> None:
    with pytest.raises(KVParamsShapeError, match=field):
        check_kv_transfer_params(params)


@pytest.fixture(scope="module")
def prefill_client() -> Iterator[TestClient]:
    engine = Engine(EngineConfig(num_blocks=64, block_size=16, role="prefill", model=ModelConfig(seed=1)),
                    ScriptedConnector())
    engine.start()
    try:
        with TestClient(build_app(engine)) as client:
            yield client
    finally:
        engine.stop()


@pytest.mark.parametrize(("params", "field"), BAD)
def test_instance_answers_400(prefill_client: TestClient, params: dict[str, Any], field: str) -> None:
    r = prefill_client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "kv_transfer_params": params})
    assert r.status_code == 400, r.text[:300]
    assert r.json()["error"]["type"] == "invalid_request_error" and field in r.json()["error"]["message"]


def test_instance_serves_a_vllm_router_prefill(prefill_client: TestClient) -> None:
    r = prefill_client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "kv_transfer_params": GOOD[2]})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(("params", "field"), BAD[:4])
def test_proxy_answers_400_before_contacting_anyone(params: dict[str, Any], field: str) -> None:
    # Nothing listens on these URLs: a 400 proves the proxy refused the body itself.
    app = build_proxy_app(["http://127.0.0.1:9"], ["http://127.0.0.1:9"])
    with TestClient(app) as client:
        r = client.post("/v1/completions", json={"prompt": "hi", "kv_transfer_params": params})
    assert r.status_code == 400, r.text[:300]
    assert field in r.json()["error"]["message"]
