"""The instance HTTP API: the official openai client against a real `kvferry serve` process, error
bodies, bad input, metrics and debug state."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest
from fastapi.testclient import TestClient

from kvferry.connector.fake import LoadPlan, ScriptedConnector
from kvferry.engine.engine import Engine, EngineConfig
from kvferry.engine.model import ModelConfig, TinyLlama
from kvferry.engine.tokenizer import decode, encode
from kvferry.serving.api_server import build_app
from procs import running, serve, wait_until


def test_openai_client_stream_and_non_stream_against_real_server() -> None:
    proc = serve(None, "--role", "both", "--num-blocks", "256", "--seed", "0")
    with running(proc):
        client = openai.OpenAI(base_url=f"{proc.url}/v1", api_key="unused", max_retries=0)
        prompt = "Prefill here, decode there. "
        first = client.completions.create(model="kvferry-tiny-llama", prompt=prompt, max_tokens=24, temperature=0)
        second = client.completions.create(model="kvferry-tiny-llama", prompt=prompt, max_tokens=24, temperature=0)
        streamed = client.completions.create(model="kvferry-tiny-llama", prompt=prompt, max_tokens=24, temperature=0, stream=True)
        pieces = [chunk.choices[0].text for chunk in streamed]
    reference = TinyLlama(ModelConfig(seed=0)).generate_greedy(encode(prompt), 24)
    assert first.choices[0].text == decode(reference)
    assert second.choices[0].text == first.choices[0].text
    assert "".join(pieces) == first.choices[0].text
    assert first.usage is not None and first.usage.prompt_tokens == len(encode(prompt))
    assert first.choices[0].finish_reason in ("stop", "length")


@pytest.fixture()
def app_client() -> Iterator[tuple[TestClient, ScriptedConnector, Engine]]:
    connector = ScriptedConnector()
    engine = Engine(EngineConfig(num_blocks=64, block_size=16, model=ModelConfig(seed=1)), connector)
    engine.start()
    try:
        with TestClient(build_app(engine)) as client:
            yield client, connector, engine
    finally:
        engine.stop()


def test_failed_kv_load_answers_500_with_cause(app_client: tuple[TestClient, ScriptedConnector, Engine]) -> None:
    client, connector, engine = app_client
    for tid in ("xfer-a", "xfer-b"):
        connector.plan_load(tid, LoadPlan(None, 1, (0,), ("peer_dead", "prefill instance died")))
    for tid, stream in (("xfer-a", False), ("xfer-b", True)):
        body = {"prompt": "x" * 40, "max_tokens": 4, "stream": stream, "kv_transfer_params": {"transfer_id": tid}}
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 500
        assert r.json() == {"error": {"message": "prefill instance died", "type": "kv_load_failed", "code": "peer_dead"}}
    wait_until(lambda: engine.snapshot()["blocks_free"] == 64, 5, "blocks back")


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"prompt": ""},
        {"prompt": "hi", "max_tokens": 0},
        {"prompt": "hi", "max_tokens": "many"},
        {"prompt": "hi", "temperature": -1},
        {"prompt": 42},
        {"prompt": [1, 2, 999]},
        {"prompt": "hi", "n": 3},
        {"prompt": "hi", "stop": [""]},
        {"prompt": "hi", "max_tokens": 10**5},
        {"prompt": "hi", "kv_transfer_params": "not a dict"},
        [1, 2, 3],
    ],
)
def test_bad_bodies_get_400_openai_error(app_client: tuple[TestClient, ScriptedConnector, Engine], body: object) -> None:
    client, _, _ = app_client
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_non_json_body_gets_400(app_client: tuple[TestClient, ScriptedConnector, Engine]) -> None:
    client, _, _ = app_client
    r = client.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400


def test_stop_strings_cut_the_text(app_client: tuple[TestClient, ScriptedConnector, Engine]) -> None:
    client, _, _ = app_client
    full = client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 30, "temperature": 0, "ignore_eos": True})
    text = full.json()["choices"][0]["text"]
    stop = text[5:7]
    cut = client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 30, "temperature": 0, "ignore_eos": True, "stop": stop})
    assert cut.json()["choices"][0]["text"] == text[: text.find(stop)]
    assert cut.json()["choices"][0]["finish_reason"] == "stop"


def test_debug_state_metrics_and_health(app_client: tuple[TestClient, ScriptedConnector, Engine]) -> None:
    client, _, _ = app_client
    assert client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 3, "temperature": 0}).status_code == 200
    state = client.get("/debug/state").json()
    for key in ("role", "engine_id", "requests_by_status", "blocks_total", "blocks_free", "pending_pulls", "pending_sends"):
        assert key in state
    assert state["blocks_free"] == state["blocks_total"] == 64
    metrics = client.get("/metrics").text
    for name in ("kvferry_requests_finished_total", "kvferry_kv_blocks_free", "kvferry_kv_load_failures_total"):
        assert name in metrics
    assert client.get("/health").json()["status"] == "ok"


def test_seeded_sampling_is_reproducible(app_client: tuple[TestClient, ScriptedConnector, Engine]) -> None:
    client, _, _ = app_client
    body = {"prompt": "seeded", "max_tokens": 10, "temperature": 0.8, "seed": 42, "ignore_eos": True}
    a = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    b = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    assert a == b
