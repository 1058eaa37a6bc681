"""Issue 31, attack 9: D as a loopback port oracle. An HTTP client of D names a bootstrap address; D's
answer must not tell an open port from a closed or silent one, nor an allowed target from a refused one:
one error (same status, body and cause) at one time for all of them. And the allow-list takes ports."""

from __future__ import annotations

import http.server
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from kvferry.connector.bootstrap import FAIL_AFTER_S, REFUSED
from procs import Proc, free_port, pd_system

PROMPT = "Which ports are open on this host? " * 3


class _NotKvferry(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        body = b"<html>some other service</html>"
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def system() -> Iterator[tuple[Proc, Proc, int]]:
    bootstrap = free_port()  # the one loopback port D may ask (pinned), and any port of 127.0.0.2
    with pd_system(p_args=("--bootstrap-port", str(bootstrap)),
                   d_args=("--prefill-allow", f"127.0.0.1:{bootstrap}", "--prefill-allow", "127.0.0.2")) as (p, d, _):
        yield p, d, bootstrap


def _decode(d: Proc, addr: str, tid: str, engine: str = "e") -> tuple[int, Any, float]:
    t0 = time.monotonic()
    r = httpx.post(f"{d.url}/v1/completions", timeout=30, json={
        "prompt": PROMPT, "max_tokens": 2, "temperature": 0, "kv_transfer_params": {
            "do_remote_prefill": True, "transfer_id": tid, "remote_engine_id": engine, "remote_bootstrap_addr": addr}})
    return r.status_code, r.json(), time.monotonic() - t0


def test_every_refused_or_failed_target_gets_one_answer(system: tuple[Proc, Proc, int]) -> None:
    p, d, bootstrap = system
    web = http.server.ThreadingHTTPServer(("127.0.0.2", 0), _NotKvferry)  # open, answers, not kvferry
    threading.Thread(target=web.serve_forever, daemon=True).start()
    silent = socket.socket()  # open, never accepts nor answers (as a filtered port looks)
    silent.bind(("127.0.0.2", 0))
    silent.listen(1)
    closed = socket.socket()
    closed.bind(("127.0.0.2", 0))  # bound, not listening: closed, and nobody else takes it meanwhile
    p_api = p.url.rsplit(":", 1)[1]
    targets = {
        "open, not kvferry": f"127.0.0.2:{web.server_address[1]}",
        "open, silent": f"127.0.0.2:{silent.getsockname()[1]}",
        "closed": f"127.0.0.2:{closed.getsockname()[1]}",
        "allowed host, other port (P's HTTP API)": f"127.0.0.1:{p_api}",
        "disallowed host": "192.0.2.7:8998",
    }
    try:
        answers = {what: _decode(d, addr, f"oracle-{k}") for k, (what, addr) in enumerate(targets.items())}
    finally:
        web.shutdown()
        silent.close()
        closed.close()
    for what, (status, body, took) in answers.items():
        print(f"{what}: HTTP {status} {body['error']['code']} after {took:.2f} s")
    shapes = {(status, repr(body)) for status, body, _ in answers.values()}
    assert len(shapes) == 1, answers
    status, body, _ = next(iter(answers.values()))
    assert status == 500 and body["error"] == {"message": REFUSED, "type": "kv_load_failed", "code": "bootstrap"}
    times = [took for _, _, took in answers.values()]
    assert min(times) >= FAIL_AFTER_S - 0.05 and max(times) < FAIL_AFTER_S + 1.0, times
    s = httpx.get(f"{d.url}/debug/state", timeout=5).json()
    assert s["blocks_free"] == s["blocks_total"] and s["pending_pulls"] == 0


def test_the_pinned_bootstrap_port_still_serves(system: tuple[Proc, Proc, int]) -> None:
    p, d, bootstrap = system
    r = httpx.post(f"{p.url}/v1/completions", timeout=30, json={
        "prompt": PROMPT, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True, "transfer_id": "pinned"}})
    params = r.json()["kv_transfer_params"]
    assert params["remote_bootstrap_addr"].endswith(f":{bootstrap}")
    status, body, _ = _decode(d, params["remote_bootstrap_addr"], "pinned", params["remote_engine_id"])
    assert status == 200, body
