"""HTTP fuzzing: no client input gets a 5xx, and every answer conforms to the API.

1. schemathesis, from the OpenAPI specs:
   - instance: `build_app` over an in-process engine with the real tiny model (colocated), through ASGI.
     It has only `SMALL_BLOCKS` KV blocks, so whatever it accepts is short (anything longer is a 400)
     and the fuzzer's max_tokens=1,000,000 costs nothing;
   - proxy: a real `kvferry proxy` in front of real P and D processes (`procs.pd_system`), so a valid
     request really goes P → D, and a 4xx comes from the layer that validated the input.
   Generation is derandomized and bounded (`FUZZ`): the same run every time. KVFERRY_FUZZ_EXAMPLES=N
   raises the number of examples per test for a deeper local run.
2. Hostile JSON that schema-driven generation never produces (lone surrogates, NaN/Infinity, 1e999,
   deep nesting, huge integers, bad UTF-8), sent as raw bytes to the instance app, the proxy, P and D.

The specs are completed with what DESIGN.md promises but the apps do not declare (yet): OpenAI-style
error bodies for 400 (bad input) and 500/502 (failed KV load, instance unavailable), `text/event-stream`
for streams, `text/plain` for /metrics, and for the proxy the request body it forwards (the instance's
`CompletionRequest`). `_complete_spec` only adds what a spec lacks, so once the apps declare these
themselves, their declarations are what is checked.
"""

from __future__ import annotations

import copy
import os
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import schemathesis
from fastapi import FastAPI
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from kvferry.engine.engine import Engine, EngineConfig
from kvferry.engine.model import ModelConfig
from kvferry.harness.sampler import is_drained
from kvferry.serving.api_server import build_app
from kvferry.serving.proxy import build_proxy_app
from procs import Proc, pd_system, wait_until

SMALL_BLOCKS = 8  # x 16 tokens: prompt + max_tokens <= 128; anything longer is a 400
ABORT_TIMEOUT_S = 3.0  # P frees blocks D never pulled (D rejected the request) after this
KV_LOAD_DEADLINE_S = 2.0  # only where a request is expected to hit it
SMALL = ("--num-blocks", str(SMALL_BLOCKS), "--abort-timeout", str(ABORT_TIMEOUT_S))
# Not positive_data_acceptance: "schema-valid" is not "acceptable" here (prompt + max_tokens must fit
# max_position and the KV blocks, which JSON Schema cannot say), and those requests rightly get a 400.
# Not negative_data_rejection (yet): pydantic's lax mode accepts `true` for an integer or a number
# (`{"prompt": [true], "temperature": false}` is a 200); with `strict=True` on CompletionRequest it
# can join.
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
FUZZ = settings(
    max_examples=int(os.environ.get("KVFERRY_FUZZ_EXAMPLES", "60")),
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large],
)
FEW = settings(FUZZ, max_examples=5)  # the GET endpoints take no input

ERROR_BODY: dict[str, Any] = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "code": {"type": ["string", "integer", "null"]},
            },
        }
    },
}


def _error_response(description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": ERROR_BODY}}}


def _complete_spec(spec: dict[str, Any], instance_spec: dict[str, Any], proxy: bool) -> dict[str, Any]:
    """A copy of `spec` with DESIGN.md's contract added where the app does not declare it."""
    spec = copy.deepcopy(spec)
    completions = spec["paths"]["/v1/completions"]["post"]
    if "requestBody" not in completions:  # the proxy reads the raw body and forwards it
        body = instance_spec["paths"]["/v1/completions"]["post"]["requestBody"]
        completions["requestBody"] = copy.deepcopy(body)
        schemas = spec.setdefault("components", {}).setdefault("schemas", {})
        for name, schema in instance_spec["components"]["schemas"].items():
            schemas.setdefault(name, copy.deepcopy(schema))
    responses = completions.setdefault("responses", {})
    responses.setdefault("400", _error_response("Invalid request"))
    responses.setdefault("500", _error_response("KV load failed (type kv_load_failed, code = cause)"))
    if proxy:
        responses.setdefault("502", _error_response("An instance is unavailable"))
    responses.setdefault("200", {"description": "OK"}).setdefault("content", {}).setdefault(
        "text/event-stream", {}
    )
    metrics = spec["paths"]["/metrics"]["get"]["responses"].setdefault("200", {"description": "OK"})
    metrics.setdefault("content", {}).setdefault("text/plain", {})
    return spec


def _small_engine() -> Engine:
    return Engine(EngineConfig(num_blocks=SMALL_BLOCKS, block_size=16, model=ModelConfig(seed=1)))


@pytest.fixture(scope="module")
def instance_app() -> Iterator[FastAPI]:
    engine = _small_engine()
    engine.start()
    try:
        yield build_app(engine)
    finally:
        engine.stop()


@pytest.fixture(scope="module")
def instance_schema(instance_app: FastAPI) -> schemathesis.BaseSchema:
    spec = instance_app.openapi()
    schema = schemathesis.openapi.from_dict(_complete_spec(spec, spec, proxy=False))
    schema.app = instance_app  # the ASGI transport, as schemathesis.openapi.from_asgi sets it
    return schema


@pytest.fixture(scope="module")
def pd() -> Iterator[tuple[Proc, Proc, Proc]]:
    # D is small (it bounds what the proxy accepts); P keeps pd_system's 1024 blocks, because every
    # request D rejects still holds P's blocks until the lease expires (see
    # test_request_rejected_by_decode_does_not_hold_prefill_blocks): a small P would run out and answer
    # later, valid requests with "Timeout waiting for P side ready" (HTTP 500).
    with pd_system(p_args=("--abort-timeout", str(ABORT_TIMEOUT_S)), d_args=SMALL) as procs:
        yield procs


@pytest.fixture(scope="module")
def proxy_schema(pd: tuple[Proc, Proc, Proc]) -> schemathesis.BaseSchema:
    instance_spec = build_app(_small_engine()).openapi()  # the engine is never started
    proxy_spec = build_proxy_app(["http://127.0.0.1:9"], ["http://127.0.0.1:9"]).openapi()  # spec only
    return schemathesis.openapi.from_dict(_complete_spec(proxy_spec, instance_spec, proxy=True))


# ---- 1. schemathesis ----------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
@FUZZ
@given(data=st.data())
def test_instance_completions_fuzz(
    instance_schema: schemathesis.BaseSchema, mode: GenerationMode, data: st.DataObject
) -> None:
    case = data.draw(instance_schema["/v1/completions"]["POST"].as_strategy(mode))
    case.call_and_validate(checks=CHECKS)


@pytest.mark.parametrize("path", ["/health", "/metrics", "/debug/state"])
@FEW
@given(data=st.data())
def test_instance_get_endpoints_fuzz(
    instance_schema: schemathesis.BaseSchema, path: str, data: st.DataObject
) -> None:
    case = data.draw(instance_schema[path]["GET"].as_strategy())
    case.call_and_validate(checks=CHECKS)


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
@FUZZ
@given(data=st.data())
def test_proxy_completions_fuzz(
    pd: tuple[Proc, Proc, Proc],
    proxy_schema: schemathesis.BaseSchema,
    mode: GenerationMode,
    data: st.DataObject,
) -> None:
    case = data.draw(proxy_schema["/v1/completions"]["POST"].as_strategy(mode))
    case.call_and_validate(base_url=pd[2].url, checks=CHECKS, timeout=60)


@pytest.mark.parametrize("path", ["/health", "/metrics"])
@FEW
@given(data=st.data())
def test_proxy_get_endpoints_fuzz(
    pd: tuple[Proc, Proc, Proc], proxy_schema: schemathesis.BaseSchema, path: str, data: st.DataObject
) -> None:
    case = data.draw(proxy_schema[path]["GET"].as_strategy())
    case.call_and_validate(base_url=pd[2].url, checks=CHECKS, timeout=30)


# ---- 2. hostile JSON ------------------------------------------------------------------------------------
def _body(fields: str) -> bytes:
    return b'{"prompt": "hi", "max_tokens": 2, ' + fields.encode() + b"}"


SURROGATE = '"\\ud800"'  # valid JSON, but no UTF-8 encoding of it exists
HOSTILE = {
    "temperature-NaN": _body('"temperature": NaN'),
    "temperature-Infinity": _body('"temperature": Infinity'),
    "max_tokens-1e999": _body('"max_tokens": 1e999'),
    "unused-NaN": _body('"user_field": NaN'),
    "unused-1e999": _body('"user_field": 1e999'),
    "prompt-surrogate": _body('"prompt": ' + SURROGATE),
    "model-surrogate": _body('"model": ' + SURROGATE),
    "stop-surrogate": _body('"stop": ' + SURROGATE),
    "deep-nesting": b'{"prompt": "hi", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    "huge-int": _body('"x": ' + "9" * 5000),  # beyond Python's int-from-string limit (4300 digits)
    "bad-utf8": b'{"prompt": "h\xff\xfei"}',
    "empty": b"",
    "not-an-object": b"[1, 2]",
}


def _hostile() -> list[Any]:
    return [pytest.param(body, id=name) for name, body in HOSTILE.items()]


def _post_raw(url: str, body: bytes, timeout: float = 30) -> httpx.Response:
    return httpx.post(
        f"{url}/v1/completions", content=body, headers={"content-type": "application/json"}, timeout=timeout
    )


@pytest.mark.parametrize("body", _hostile())
def test_instance_hostile_json(instance_app: FastAPI, body: bytes) -> None:
    with TestClient(instance_app, raise_server_exceptions=False) as client:
        r = client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code < 500, r.text


@pytest.mark.parametrize("body", _hostile())
def test_proxy_hostile_json(pd: tuple[Proc, Proc, Proc], body: bytes) -> None:
    r = _post_raw(pd[2].url, body)
    assert r.status_code < 500, r.text


def test_prefill_surrogate_transfer_id(pd: tuple[Proc, Proc, Proc]) -> None:
    r = _post_raw(
        pd[0].url, _body(f'"kv_transfer_params": {{"do_remote_decode": true, "transfer_id": {SURROGATE}}}')
    )
    assert r.status_code < 500, r.text


@pytest.mark.parametrize(
    "field",
    ["remote_engine_id", "remote_bootstrap_addr"],
)
def test_decode_surrogate_remote_params(pd: tuple[Proc, Proc, Proc], field: str) -> None:
    p, d, _ = pd
    info = httpx.get(f"{p.url}/health", timeout=5).json()
    params = {
        "remote_engine_id": f'"{info["engine_id"]}"',
        "remote_bootstrap_addr": f'"{info["kv_bootstrap_addr"]}"',
    }
    params[field] = SURROGATE if field == "remote_engine_id" else '"\\ud800:1"'
    fields = ", ".join(f'"{k}": {v}' for k, v in params.items())
    r = _post_raw(
        d.url,
        _body(f'"kv_transfer_params": {{"do_remote_prefill": true, "transfer_id": "xfer-x", {fields}}}'),
    )
    assert r.status_code < 500, r.text


def _drained(*urls: str) -> bool:
    return all(is_drained(httpx.get(f"{u}/debug/state", timeout=5).json()) for u in urls)


@pytest.mark.parametrize(
    "body",
    [
        # the proxy could catch this one by validating the body as the instances do
        pytest.param({"prompt": "x" * 100, "max_tokens": 0}, id="invalid-max_tokens"),
        # this one only D knows (P sees max_tokens=1): P must be released when D says no
        pytest.param({"prompt": "x" * 100, "max_tokens": 1000}, id="too-long-for-D"),
    ],
)
def test_request_rejected_by_decode_does_not_hold_prefill_blocks(
    pd: tuple[Proc, Proc, Proc], body: dict[str, Any]
) -> None:
    p, d, proxy = pd
    wait_until(lambda: _drained(p.url, d.url), ABORT_TIMEOUT_S + 10, "P and D idle", interval=0.2)
    r = httpx.post(f"{proxy.url}/v1/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    time.sleep(ABORT_TIMEOUT_S / 2)  # P got the request by now; its lease (if any) has not expired yet
    assert _drained(p.url), httpx.get(f"{p.url}/debug/state", timeout=5).json()


def test_pd_fuzzing_leaves_nothing_behind(pd: tuple[Proc, Proc, Proc]) -> None:
    """After everything above, P and D hold no request and no block (leases D never took expire)."""
    p, d, _ = pd
    wait_until(
        lambda: _drained(p.url, d.url), ABORT_TIMEOUT_S + 10, "P and D to free every block", interval=0.2
    )


def test_decode_surrogate_transfer_id_is_not_stuck() -> None:
    # Its own P and D: the bug leaks a block on D, which would starve the other tests' tiny D.
    deadline = ("--kv-load-deadline", str(KV_LOAD_DEADLINE_S))
    with pd_system(p_args=SMALL, d_args=(*SMALL, *deadline)) as (p, d, _):
        info = httpx.get(f"{p.url}/health", timeout=5).json()
        params = (
            f'"do_remote_prefill": true, "transfer_id": {SURROGATE}, "remote_engine_id": '
            f'"{info["engine_id"]}", "remote_bootstrap_addr": "{info["kv_bootstrap_addr"]}"'
        )
        r = _post_raw(d.url, _body(f'"kv_transfer_params": {{{params}}}'), timeout=KV_LOAD_DEADLINE_S + 3)
        assert r.status_code < 500, r.text
        wait_until(lambda: is_drained(httpx.get(f"{d.url}/debug/state", timeout=5).json()), 5, "D drained")
