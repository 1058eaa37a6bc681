"""D's bound on a bootstrap lookup is `--bootstrap-timeout`: a P whose bootstrap server answers later
than it fails D's pull (the uniform refusal, at the bound), one that answers within it is pulled from."""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import httpx
import msgspec
import pytest
import zmq

from kvferry.cli import main
from kvferry.connector.bootstrap import FAIL_AFTER_S, REFUSED, EngineInfo, RankInfo, answer_mac
from kvferry.connector.messages import PullRequest, decode_inbound
from kvferry.harness.processes import HARNESS_SECRET
from kvferry.integrations.vllm.settings import KVFerrySettings
from procs import Proc, free_port, running, serve
from sealed import Sealed

SECRET = HARNESS_SECRET.encode()
ENGINE = "slow-p"


@contextmanager
def slow_prefill(delay_s: float) -> Iterator[tuple[str, Sealed]]:
    """A P rank's control socket, and a bootstrap server that answers for it (MAC'd, as P's own) after
    `delay_s`: the address to name in a pull, and the socket D's pull reaches."""
    ctx: zmq.Context[Any] = zmq.Context()
    control = Sealed(ctx.socket(zmq.ROUTER), SECRET, as_decode=False)
    port, boot = free_port(), os.urandom(16).hex()
    control.bind(f"tcp://127.0.0.1:{port}", boot)
    info = EngineInfo(ENGINE, 1, [RankInfo(0, f"tcp://127.0.0.1:{port}", boot)])

    def answer(path: str) -> dict[str, Any]:
        nonce = urllib.parse.parse_qs(urllib.parse.urlparse(path).query)["nonce"][0]
        return {**msgspec.to_builtins(info), "mac": answer_mac(SECRET, nonce, info)}

    try:
        with slow_json(delay_s, answer) as port:
            yield f"127.0.0.1:{port}", control
    finally:
        control.close(0)
        ctx.destroy(linger=0)


@contextmanager
def slow_json(delay_s: float, answer: Callable[[str], Any]) -> Iterator[int]:
    """An HTTP server on loopback that answers every GET with `answer(path)` as JSON after `delay_s`."""

    class Slow(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            time.sleep(delay_s)
            body = json.dumps(answer(self.path)).encode()
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # D gave up first: the point
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Slow)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def _decode(d: Proc, bootstrap_addr: str, transfer_id: str) -> tuple[httpx.Response, float]:
    started = time.monotonic()
    r = httpx.post(f"{d.url}/v1/completions", timeout=60, json={
        "prompt": "the bootstrap bound is a setting", "max_tokens": 2, "temperature": 0,
        "kv_transfer_params": {"do_remote_prefill": True, "transfer_id": transfer_id, "remote_engine_id": ENGINE,
                               "remote_bootstrap_addr": bootstrap_addr}})
    return r, time.monotonic() - started


def test_the_bootstrap_bound_is_a_setting() -> None:
    common = ("--role", "decode", "--num-blocks", "256", "--heartbeat-timeout", "0.5")
    short = serve(None, *common, "--bootstrap-timeout", "0.5")
    long = serve(None, *common, "--bootstrap-timeout", str(FAIL_AFTER_S + 3))
    with running(short, long), ThreadPoolExecutor(2) as pool:
        # Answered after 1.2 s: past a 0.5 s bound (it would have been within the default).
        with slow_prefill(1.2) as (addr, control):
            r, took = _decode(short, addr, "short-1")
            assert r.status_code == 500, r.text
            assert r.json()["error"]["code"] == "bootstrap" and r.json()["error"]["message"] == REFUSED
            assert 0.45 <= took < 1.1, took
            assert not control.poll(300), "D pulled from a P whose bootstrap answered past its bound"
        # Answered after the default bound, within the longer one: D pulls from that P.
        with slow_prefill(FAIL_AFTER_S + 0.5) as (addr, control):
            pending: Future[tuple[httpx.Response, float]] = pool.submit(_decode, long, addr, "long-1")
            assert control.poll(int((FAIL_AFTER_S + 3) * 1000)), "no pull reached P"
            _, sealed = control.raw.recv_multipart()  # a ROUTER: D's identity, then its message
            pull = decode_inbound(control.opener.open(sealed))
            assert isinstance(pull, PullRequest) and pull.transfer_id == "long-1"
        r, took = pending.result(timeout=30)  # P's control socket is gone now: the pull fails, not the lookup
        assert took >= FAIL_AFTER_S + 0.5
        assert r.status_code == 500 and r.json()["error"]["code"] != "bootstrap", r.text


def test_the_bound_is_checked_and_reaches_the_vllm_connector(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--role", "decode", "--port", "0", "--bootstrap-timeout", "0"]) == 2
    assert "--bootstrap-timeout must be > 0" in capsys.readouterr().err
    settings = KVFerrySettings.from_extra_config({"bootstrap_timeout_s": 5}, "e")
    assert settings.pd_config("decode", 16).bootstrap_timeout_s == 5.0
    assert KVFerrySettings.from_extra_config({}, "e").pd_config("decode", 16).bootstrap_timeout_s == FAIL_AFTER_S
    with pytest.raises(ValueError, match="bootstrap_timeout_s"):
        KVFerrySettings.from_extra_config({"bootstrap_timeout_s": 0}, "e")


def test_the_bootstrap_bound_holds_for_sglangs_fields_too() -> None:
    """sglang's router names P's bootstrap server and a room, not P's engine: D asks the server which engine
    serves the room, within the same `--bootstrap-timeout`."""
    d = serve(None, "--role", "decode", "--num-blocks", "256", "--bootstrap-timeout", "0.5")
    # sglang's bootstrap server (`GET /query`: the engines by rank), answering after 1.2 s.
    with running(d), slow_json(1.2, lambda path: {"0": {"engine_id": ENGINE}}) as port:
        started = time.monotonic()
        r = httpx.post(f"{d.url}/v1/completions", timeout=60, json={
            "prompt": "the bootstrap bound is a setting", "max_tokens": 2, "temperature": 0,
            "bootstrap_host": "127.0.0.1", "bootstrap_port": port, "bootstrap_room": 7})
        took = time.monotonic() - started
        assert r.status_code == 500, r.text
        assert r.json()["error"]["code"] == "bootstrap" and r.json()["error"]["message"] == REFUSED
        assert 0.45 <= took < 1.1, took
