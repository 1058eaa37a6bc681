"""Issue 13.5 / 13.8: a dead engine thread and a long engine step, seen through the HTTP API.

After the engine thread dies, /health answers 503, in-flight requests fail, new requests get 503 at
once and nothing waits forever; /debug/state never answers a 5xx (a long step gets the last published
state)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from kvferry.connector.fake import ScriptedConnector
from kvferry.engine.engine import Engine, EngineConfig, EngineDeadError
from kvferry.engine.model import ModelConfig
from kvferry.engine.request import Request, SamplingParams
from kvferry.serving.api_server import build_app
from procs import wait_until


@pytest.fixture()
def engine() -> Iterator[Engine]:
    engine = Engine(EngineConfig(num_blocks=64, block_size=16, model=ModelConfig(seed=1)), ScriptedConnector())
    engine.start()
    try:
        yield engine
    finally:
        engine.stop()


def _post(client: TestClient, results: list[Any], **body: Any) -> None:
    results.append(client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 8, **body}))


@pytest.mark.timeout(60)
def test_dead_engine_thread_fails_in_flight_and_new_requests(engine: Engine) -> None:
    entered, release = threading.Event(), threading.Event()
    forward = engine.model.forward_batch

    def dying_forward(*args: Any, **kwargs: Any) -> Any:
        entered.set()
        release.wait(30)
        raise RuntimeError("simulated engine bug")

    engine.model.forward_batch = dying_forward  # type: ignore[method-assign]
    with TestClient(build_app(engine)) as client:
        in_flight: list[Any] = []
        streaming: list[Any] = []
        threads = [threading.Thread(target=_post, args=(client, in_flight)),
                   threading.Thread(target=_post, args=(client, streaming), kwargs={"stream": True})]
        for t in threads:
            t.start()
        assert entered.wait(30)
        # Both requests are in flight (in the step about to die, or queued behind it).
        try:
            wait_until(lambda: engine._commands.qsize() + len(engine._streams) >= 2, 10, "both requests in flight")
        finally:
            release.set()
        for t in threads:
            t.join(30)
        assert not any(t.is_alive() for t in threads), "an in-flight request hangs on a dead engine"
        assert in_flight[0].status_code == 500 and in_flight[0].json()["error"]["code"] == "engine_error"
        assert streaming[0].status_code == 500
        assert "simulated engine bug" in in_flight[0].json()["error"]["message"]

        wait_until(lambda: engine.fatal_error is not None, 10, "engine marked dead")
        health = client.get("/health")
        assert health.status_code == 503 and "simulated engine bug" in health.json()["error"]
        engine.model.forward_batch = forward  # type: ignore[method-assign]
        for stream in (False, True):
            started = time.monotonic()
            late: list[Any] = []
            t = threading.Thread(target=_post, args=(client, late), kwargs={"stream": stream})
            t.start()
            t.join(10)
            assert not t.is_alive(), "a new request waits forever on a dead engine"
            assert late[0].status_code == 503, late[0].text
            assert late[0].json()["error"]["type"] == "engine_dead"
            assert time.monotonic() - started < 5
        state = client.get("/debug/state")
        assert state.status_code == 200 and state.json()["stale"] is True
        assert "simulated engine bug" in state.json()["fatal_error"]


def test_submit_after_death_raises_and_never_strands_a_sink(engine: Engine) -> None:
    engine.model.forward_batch = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom"))  # type: ignore[method-assign]
    outputs: list[Any] = []
    engine.submit(Request("r1", list(range(5, 40)), SamplingParams(4), None, time.time()), outputs.append)
    wait_until(lambda: outputs, 10, "in-flight request failed")
    assert outputs[0].error_code == "engine_error"
    with pytest.raises(EngineDeadError):
        engine.submit(Request("r2", [5, 6], SamplingParams(4), None, time.time()), outputs.append)
    engine.abort("r2")  # no-op, never raises
    with pytest.raises(EngineDeadError):
        engine.snapshot(timeout=1)


@pytest.mark.timeout(60)
def test_debug_state_during_a_long_step_is_never_5xx(engine: Engine) -> None:
    entered, release = threading.Event(), threading.Event()
    forward = engine.model.forward_batch

    def slow_forward(*args: Any, **kwargs: Any) -> Any:
        entered.set()
        release.wait(30)
        return forward(*args, **kwargs)

    engine.model.forward_batch = slow_forward  # type: ignore[method-assign]
    with TestClient(build_app(engine)) as client:
        results: list[Any] = []
        t = threading.Thread(target=_post, args=(client, results))
        t.start()
        try:
            assert entered.wait(30)
            started = time.monotonic()
            state = client.get("/debug/state")
            assert state.status_code == 200, state.text
            assert state.json()["stale"] is True and state.json()["engine_id"] == "engine-0"
            assert "blocks_free" in state.json()
            assert time.monotonic() - started < 4
        finally:
            release.set()
            t.join(30)
        assert results[0].status_code == 200
        fresh = client.get("/debug/state").json()
        assert fresh["stale"] is False
