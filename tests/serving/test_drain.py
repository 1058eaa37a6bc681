"""Issue 32.1 through real processes: SIGTERM (or POST /drain) drains an instance instead of ending it.
A P that answered its prefill keeps serving D's pull after the signal (D pulls 1.5 s later, or while P's
write is slowed down), says "draining" with a 503 meanwhile, turns new requests away, and exits 0 once
nothing is held; a D finishes the stream it is sending and exits 0; a second SIGTERM ends a drain now."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import uuid
from typing import Any

import httpx
import pytest

from procs import Proc, free_port, running, serve, wait_until

COMMON = ("--seed", "0", "--num-blocks", "512")
PROMPT = "drain me gently: " + "kv " * 30


def _prefill(*extra: str) -> Proc:
    return serve(None, "--role", "prefill", "--bootstrap-port", str(free_port()), *COMMON, *extra)


def _decode(*extra: str) -> Proc:
    return serve(None, "--role", "decode", *COMMON, *extra)


def _prefill_now(p: Proc, transfer_id: str) -> None:
    body = {"prompt": PROMPT, "max_tokens": 1, "temperature": 0,
            "kv_transfer_params": {"do_remote_decode": True, "transfer_id": transfer_id}}
    r = httpx.post(f"{p.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text


def _decode_body(p_info: dict[str, Any], transfer_id: str, max_tokens: int = 12, **extra: Any) -> dict[str, Any]:
    return {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, **extra, "kv_transfer_params": {
        "do_remote_prefill": True, "transfer_id": transfer_id,
        "remote_engine_id": p_info["engine_id"], "remote_bootstrap_addr": p_info["kv_bootstrap_addr"]}}


def _health(proc: Proc) -> httpx.Response:
    return httpx.get(f"{proc.url}/health", timeout=10)


def _exit_code(proc: Proc, timeout: float) -> int:
    return proc.popen.wait(timeout=timeout)


def _reference(p: Proc, d: Proc, info: dict[str, Any]) -> str:
    """The fault-free P/D answer for PROMPT (no signal anywhere)."""
    xid = f"ref-{uuid.uuid4()}"
    _prefill_now(p, xid)
    r = httpx.post(f"{d.url}/v1/completions", json=_decode_body(info, xid), timeout=60)
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["text"])


@pytest.mark.timeout(180)
def test_sigterm_on_p_serves_the_pull_that_comes_after_it_then_exits_0() -> None:
    p = _prefill("--abort-timeout", "60")
    d = _decode()
    with running(p, d, timeout=60):
        info = _health(p).json()
        reference = _reference(p, d, info)
        xid = f"held-{uuid.uuid4()}"
        _prefill_now(p, xid)  # P now holds this prompt's KV for a D that has not asked yet
        os.kill(p.pid, signal.SIGTERM)
        health = wait_until(lambda: (r := _health(p)).status_code == 503 and r, 10, "P's /health to say draining")
        assert health.json()["status"] == "draining"
        refused = httpx.post(f"{p.url}/v1/completions", json={"prompt": "new", "max_tokens": 1}, timeout=10)
        assert refused.status_code == 503 and refused.json()["error"]["type"] == "draining"
        time.sleep(1.5)  # the scenario: D's pull comes 1.5 s after the signal (it failed `bootstrap` before)
        assert p.exited() is None, "P left while it still held a prefill"
        r = httpx.post(f"{d.url}/v1/completions", json=_decode_body(info, xid), timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == reference
        # Pulled: P holds nothing now and leaves long before its 60 s abort timeout.
        assert _exit_code(p, 20) == 0, p.output_tail()


@pytest.mark.timeout(180)
def test_sigterm_while_p_writes_finishes_the_write() -> None:
    p = _prefill("--abort-timeout", "60", "--faults", "slow=1500")
    d = _decode("--heartbeat-timeout", "3.0")
    with running(p, d, timeout=60):
        info = _health(p).json()
        reference = _reference(p, d, info)
        xid = f"slow-{uuid.uuid4()}"
        _prefill_now(p, xid)
        result: dict[str, httpx.Response] = {}
        pull = threading.Thread(target=lambda: result.setdefault("r", httpx.post(
            f"{d.url}/v1/completions", json=_decode_body(info, xid), timeout=60)))
        pull.start()
        # D's pull has reached P: P's write (slowed 1.5 s) is in flight.
        wait_until(lambda: httpx.get(f"{d.url}/debug/state", timeout=10).json().get("pending_pulls", 0) > 0,
                   20, "D's pull to start")
        os.kill(p.pid, signal.SIGTERM)
        pull.join(60)
        assert result["r"].status_code == 200, result["r"].text  # was a 500 peer_dead
        assert result["r"].json()["choices"][0]["text"] == reference
        assert _exit_code(p, 20) == 0, p.output_tail()


@pytest.mark.timeout(180)
def test_sigterm_on_d_finishes_the_stream_it_sends_then_exits_0() -> None:
    # A bound the stream ends well within even on a loaded box: at the bound it would be cut.
    d = serve(None, "--role", "both", "--drain-timeout", "150", *COMMON)
    body = {"prompt": PROMPT, "max_tokens": 3000, "temperature": 0, "ignore_eos": True, "stream": True}
    with running(d, timeout=60):
        whole = httpx.post(f"{d.url}/v1/completions", json={**body, "stream": False}, timeout=120)
        expected = whole.json()["choices"][0]["text"]
        text, done = [], False
        with httpx.stream("POST", f"{d.url}/v1/completions", json=body, timeout=120) as r:
            lines = r.iter_lines()
            for line in lines:  # the first token is out: the stream is in progress
                if line.startswith("data: "):
                    text.append(json.loads(line[6:])["choices"][0]["text"])
                    break
            os.kill(d.pid, signal.SIGTERM)
            assert wait_until(lambda: _health(d).status_code == 503, 10, "D's /health to say draining")
            for line in lines:
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    text.append(json.loads(line[6:])["choices"][0]["text"])
        assert done and "".join(text) == expected
        assert _exit_code(d, 30) == 0, d.output_tail()


@pytest.mark.timeout(120)
def test_post_drain_then_a_second_sigterm_ends_the_drain_at_once() -> None:
    p = _prefill("--abort-timeout", "60")
    with running(p, timeout=60):
        _prefill_now(p, f"held-{uuid.uuid4()}")  # held for 60 s: the drain alone would wait that long
        r = httpx.post(f"{p.url}/drain", timeout=10)
        assert r.status_code == 202 and r.json()["status"] == "draining"
        assert _health(p).status_code == 503
        os.kill(p.pid, signal.SIGTERM)
        time.sleep(1.0)  # the first SIGTERM of a drain already started by POST /drain counts once
        assert p.exited() is None
        started = time.monotonic()
        os.kill(p.pid, signal.SIGTERM)
        assert _exit_code(p, 10) == 0
        assert time.monotonic() - started < 5


def test_post_drain_from_another_host_is_refused() -> None:
    """Anyone who reaches the HTTP port may ask for completions, but only the host itself (a preStop hook)
    may take the instance out of service: the test client's address is not loopback."""
    from fastapi.testclient import TestClient

    from kvferry.connector.fake import ScriptedConnector
    from kvferry.engine.engine import Engine, EngineConfig
    from kvferry.serving.api_server import build_app

    engine = Engine(EngineConfig(num_blocks=16, block_size=16), ScriptedConnector())
    with TestClient(build_app(engine)) as client:
        r = client.post("/drain")
        assert r.status_code == 403 and r.json()["error"]["type"] == "forbidden"
        assert client.get("/health").status_code == 200  # still in rotation


def test_a_drain_without_a_bound_answers_json() -> None:
    """build_app's own drain (no `--drain-timeout`, or `--drain-timeout inf`) has no bound: POST /drain and
    /health still answer JSON while it drains (an infinite float made both a 500)."""
    from inproc import ServerThread

    from kvferry.connector.fake import ScriptedConnector
    from kvferry.engine.engine import Engine, EngineConfig
    from kvferry.serving.api_server import build_app

    engine = Engine(EngineConfig(num_blocks=16, block_size=16), ScriptedConnector())
    engine.start()
    server = ServerThread.of(build_app(engine)).start()
    try:
        r = httpx.post(f"{server.url}/drain", timeout=10)
        assert r.status_code == 202 and r.json()["drain_timeout_s"] is None, r.text
        health = _health_of(server.url)
        assert health.status_code == 503 and health.json()["status"] == "draining", health.text
    finally:
        server.stop()
        engine.stop()


def _health_of(url: str) -> httpx.Response:
    return httpx.get(f"{url}/health", timeout=10)
