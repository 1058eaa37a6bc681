"""Issue 31, attacks 5 and 9: D as a loopback port oracle and an SSRF tool. An HTTP client of D names a
bootstrap address, in `kv_transfer_params` (vLLM's protocol) or in sglang's `bootstrap_host` /
`bootstrap_port` fields; D's answer must not tell an open port from a closed or silent one, nor an
allowed target from a refused one: one error (same status, body and cause) at one time for all of them.
D never connects to a target outside the allow-list, which takes ports."""

from __future__ import annotations

import http.server
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import httpx
import pytest

from kvferry.connector.bootstrap import FAIL_AFTER_S, REFUSED
from procs import Proc, free_port, pd_system

PROMPT = "Which ports are open on this host? " * 3
Answer = tuple[int, Any, float]


class _NotKvferry(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        body = b"<html>some other service</html>"
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


class _Web(http.server.ThreadingHTTPServer):
    """An open port that answers HTTP (not kvferry), counting every connection it accepts."""

    def __init__(self, host: str) -> None:
        super().__init__((host, 0), _NotKvferry)
        self.accepted = 0
        threading.Thread(target=self.serve_forever, daemon=True).start()

    def verify_request(self, request: Any, client_address: Any) -> bool:
        self.accepted += 1
        return True

    @property
    def addr(self) -> str:
        return f"{self.server_address[0]}:{self.server_address[1]}"


@pytest.fixture(scope="module")
def system() -> Iterator[tuple[Proc, Proc, int]]:
    bootstrap = free_port()  # the one 127.0.0.1 port D may ask (pinned), and any port of 127.0.0.2
    with pd_system(p_args=("--bootstrap-port", str(bootstrap)),
                   d_args=("--prefill-allow", f"127.0.0.1:{bootstrap}", "--prefill-allow", "127.0.0.2")) as (p, d, _):
        yield p, d, bootstrap


@contextmanager
def _targets() -> Iterator[tuple[dict[str, str], list[_Web]]]:
    """Five kinds of bootstrap target; the last two are outside the allow-list, and D must never connect
    to them (each is a listener that counts what it accepts)."""
    web = _Web("127.0.0.2")  # allowed host: open, answers, not kvferry
    silent = socket.socket()  # open, never accepts nor answers (as a filtered port looks)
    silent.bind(("127.0.0.2", 0))
    silent.listen(1)
    closed = socket.socket()
    closed.bind(("127.0.0.2", 0))  # bound, not listening: closed, and nobody else takes it meanwhile
    outside = [_Web("127.0.0.1"), _Web("127.0.0.3")]  # allowed host on another port; a host not listed
    targets = {
        "open, not kvferry": web.addr,
        "open, silent": f"127.0.0.2:{silent.getsockname()[1]}",
        "closed": f"127.0.0.2:{closed.getsockname()[1]}",
        "allowed host, other port": outside[0].addr,
        "disallowed host": outside[1].addr,
    }
    try:
        yield targets, outside
    finally:
        for server in (web, *outside):
            server.shutdown()
            server.server_close()
        silent.close()
        closed.close()


def _timed(post: Callable[[], httpx.Response]) -> Answer:
    t0 = time.monotonic()
    r = post()
    return r.status_code, r.json(), time.monotonic() - t0


def _decode(d: Proc, addr: str, tid: str, engine: str = "e") -> Answer:
    return _timed(lambda: httpx.post(f"{d.url}/v1/completions", timeout=30, json={
        "prompt": PROMPT, "max_tokens": 2, "temperature": 0, "kv_transfer_params": {
            "do_remote_prefill": True, "transfer_id": tid, "remote_engine_id": engine, "remote_bootstrap_addr": addr}}))


def _sglang(url: str, addr: str, room: int) -> Answer:
    host, port = addr.rsplit(":", 1)
    return _timed(lambda: httpx.post(f"{url}/v1/completions", timeout=30, json={
        "prompt": PROMPT, "max_tokens": 2, "temperature": 0,
        "bootstrap_host": host, "bootstrap_port": int(port), "bootstrap_room": room}))


def _assert_one_answer(d: Proc, answers: dict[str, Answer], outside: list[_Web]) -> None:
    for what, (status, body, took) in answers.items():
        print(f"{what}: HTTP {status} {body['error']} after {took:.2f} s")
    assert [server.accepted for server in outside] == [0, 0], "D connected to a target outside --prefill-allow"
    shapes = {(status, repr(body)) for status, body, _ in answers.values()}
    assert len(shapes) == 1, answers
    status, body, _ = next(iter(answers.values()))
    assert status == 500 and body["error"] == {"message": REFUSED, "type": "kv_load_failed", "code": "bootstrap"}
    times = [took for _, _, took in answers.values()]
    assert min(times) >= FAIL_AFTER_S - 0.05 and max(times) < FAIL_AFTER_S + 1.0, times
    s = httpx.get(f"{d.url}/debug/state", timeout=5).json()
    assert s["blocks_free"] == s["blocks_total"] and s["pending_pulls"] == 0


def test_every_refused_or_failed_target_gets_one_answer(system: tuple[Proc, Proc, int]) -> None:
    _, d, _ = system
    with _targets() as (targets, outside):
        answers = {what: _decode(d, addr, f"oracle-{k}") for k, (what, addr) in enumerate(targets.items())}
        _assert_one_answer(d, answers, outside)


def test_sglang_fields_get_the_same_one_answer(system: tuple[Proc, Proc, int]) -> None:
    """sglang's D asks the named bootstrap server for its engine list first: that too only for an allowed
    host and port, and every failure is the vLLM path's one answer."""
    _, d, _ = system
    with _targets() as (targets, outside):
        answers = {what: _sglang(d.url, addr, 900 + k) for k, (what, addr) in enumerate(targets.items())}
        _assert_one_answer(d, answers, outside)


def test_the_pinned_bootstrap_port_still_serves(system: tuple[Proc, Proc, int]) -> None:
    p, d, bootstrap = system
    r = httpx.post(f"{p.url}/v1/completions", timeout=30, json={
        "prompt": PROMPT, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True, "transfer_id": "pinned"}})
    params = r.json()["kv_transfer_params"]
    assert params["remote_bootstrap_addr"].endswith(f":{bootstrap}")
    status, body, _ = _decode(d, params["remote_bootstrap_addr"], "pinned", params["remote_engine_id"])
    assert status == 200, body
    with ThreadPoolExecutor(2) as pool:  # sglang-router sends the same request to P and D at once
        p_answer, d_answer = pool.map(lambda url: _sglang(url, f"127.0.0.1:{bootstrap}", 7), (p.url, d.url))
    assert p_answer[0] == 200 and d_answer[0] == 200, (p_answer, d_answer)
