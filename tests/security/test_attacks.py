"""A stranger who reaches P's and D's ports but does not hold KVFERRY_SECRET (issue 19), against real
processes with the secret set (the harness gives every process it starts one): it learns nothing,
changes nothing and holds nothing, and the victim's request is still served, token-identical."""

from __future__ import annotations

import http.server
import json
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import numpy as np
import pytest
import zmq

from kvferry.connector.bootstrap import FAIL_AFTER_S, REFUSED
from kvferry.connector.messages import Heartbeat, PullRequest, Release, encode
from kvferry.harness.processes import HARNESS_SECRET
from kvferry.harness.sampler import wait_drained
from kvferry.transfer.base import ByteRange
from kvferry.transfer.tcp.engine import TcpTransferEngine
from procs import Proc, free_port, pd_system, wait_until
from sealed import Sealed

PROMPT = "The stranger asks for a prompt it should never read, " * 3


@pytest.fixture(scope="module")
def system() -> Iterator[tuple[Proc, Proc, Proc]]:
    with pd_system(p_args=("--abort-timeout", "30")) as procs:
        yield procs


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=5).text
    return sum(float(m.group(1)) for m in re.finditer(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def prefill(p: Proc, transfer_id: str, prompt: str = PROMPT) -> dict[str, Any]:
    r = httpx.post(f"{p.url}/v1/completions", timeout=30, json={
        "prompt": prompt, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True, "transfer_id": transfer_id}})
    assert r.status_code == 200, r.text
    params: dict[str, Any] = r.json()["kv_transfer_params"]
    return params


def decode(d: Proc, params: dict[str, Any] | None, prompt: str = PROMPT) -> httpx.Response:
    body: dict[str, Any] = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    if params is not None:
        body["kv_transfer_params"] = params
    return httpx.post(f"{d.url}/v1/completions", json=body, timeout=60)


def state(url: str) -> dict[str, Any]:
    result: dict[str, Any] = httpx.get(f"{url}/debug/state", timeout=5).json()
    return result


def test_stranger_control_messages_touch_no_transfer(system: tuple[Proc, Proc, Proc]) -> None:
    p, d, _ = system
    params = prefill(p, "victim-1")
    control = state(p.url)["connector"]["control_addrs"][0]
    attacker_kv = np.zeros(1 << 16, dtype=np.uint8)
    attacker = TcpTransferEngine(secret=b"")  # no secret: P would have to drop its own to talk to it
    attacker.register("kv", attacker_kv)
    grant = attacker.open_grant([ByteRange("kv", 0, attacker_kv.nbytes)])
    ctx: zmq.Context[Any] = zmq.Context()
    before = metric(p.url, "kvferry_control_auth_failures_total")
    try:
        socks = []
        for secret in (None, b"d5f313f3ec28c3428ca463f616eab02b"):  # none, or a wrong guess
            raw = ctx.socket(zmq.DEALER)
            raw.setsockopt(zmq.LINGER, 0)
            raw.connect(control)
            sock = Sealed(raw, secret)
            socks.append(sock)
            steal = PullRequest("victim-1", "thief", attacker.address, grant, [0, 1, 2, 3], 64, 1, 0, 64)
            sock.send(encode(steal))  # row 1: read the victim's KV
            sock.send(encode(PullRequest("victim-1", "thief", attacker.address, grant, [], 64, 1, 0, 64)))
            sock.send(encode(Release(["victim-1"])))  # row 3: cancel it
            sock.send(encode(Heartbeat(["victim-1"], lease_s=1e9)))  # row 4: pin it
        raw = ctx.socket(zmq.DEALER)  # no envelope at all
        raw.setsockopt(zmq.LINGER, 0)
        raw.connect(control)
        raw.send(encode(Release(["victim-1"])))
        # With the secret P's ROUTER is a CurveZMQ server: a stranger fails libzmq's handshake, so none of
        # its 9 messages reaches Python; P counts each refused connection (3) instead of each message.
        wait_until(lambda: metric(p.url, "kvferry_control_auth_failures_total") >= before + 3, 10,
                   "P to refuse and count every stranger's connection")
        assert attacker.written(grant) == [], "P wrote KV to the stranger"
        assert not any(s.poll(0) for s in socks) and not raw.poll(0), "P answered a stranger"
        raw.close(0)
        for s in socks:
            s.close(0)
    finally:
        ctx.destroy(linger=0)
        attacker.close()
    # The victim's transfer is untouched: D pulls it and decodes what a local prefill decodes.
    pulled = decode(d, params)
    assert pulled.status_code == 200, pulled.text
    assert pulled.json()["choices"][0]["text"] == decode(d, None).json()["choices"][0]["text"]
    assert all(s is not None and s["blocks_free"] == s["blocks_total"] for s in wait_drained([p.url, d.url], 30))


class _FakeBootstrap(http.server.BaseHTTPRequestHandler):
    """Answers /query like a kvferry bootstrap server would, pointing D at the attacker's ROUTER."""

    answer: dict[str, Any] = {}

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        body = json.dumps(self.answer).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


def test_d_is_not_pointed_at_a_fake_prefill(system: tuple[Proc, Proc, Proc]) -> None:
    p, d, _ = system
    bootstrap = httpx.get(f"{p.url}/health", timeout=5).json()["kv_bootstrap_addr"]
    # Row 2: nobody can re-register P's engine over HTTP any more.
    assert httpx.post(f"http://{bootstrap}/register", json={
        "engine_id": "x", "tp_size": 1, "tp_rank": 0, "control_addr": "tcp://127.0.0.1:1"}).status_code in (404, 405)
    ctx: zmq.Context[Any] = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    fake_control = f"tcp://127.0.0.1:{router.bind_to_random_port('tcp://127.0.0.1')}"
    _FakeBootstrap.answer = {"engine_id": "fake-p", "tp_size": 1, "ranks": [{"tp_rank": 0, "control_addr": fake_control}],
                             "mac": "00" * 32}
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _FakeBootstrap)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        fake = {"do_remote_prefill": True, "transfer_id": "victim-2", "remote_engine_id": "fake-p",
                "remote_bootstrap_addr": f"127.0.0.1:{server.server_address[1]}"}
        r = decode(d, fake)
        assert r.status_code == 500 and r.json()["error"]["code"] == "bootstrap", r.text
        assert "secret" in r.json()["error"]["message"]
        assert not router.poll(200), "D sent a pull to the fake P"
    finally:
        server.shutdown()
        router.close(0)
        ctx.destroy(linger=0)
    httpx.post(f"{d.url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 1, "model": "no-such-model",
               "kv_transfer_params": prefill(p, "victim-3")}, timeout=30)  # 404, and P is told to free it
    assert all(s is not None and s["blocks_free"] == s["blocks_total"] for s in wait_drained([p.url, d.url], 30))


def test_d_refuses_prefill_hosts_outside_its_allow_list(system: tuple[Proc, Proc, Proc]) -> None:
    _, d, _ = system
    started = time.monotonic()
    with ThreadPoolExecutor(4) as pool:  # row 5: each would have held D's blocks for its whole deadline
        answers = list(pool.map(lambda i: decode(d, {"do_remote_prefill": True, "transfer_id": f"x{i}",
                                                     "remote_engine_id": "e", "remote_bootstrap_addr": "192.0.2.7:8998"}),
                                range(4)))
    for r in answers:  # the answer of every failed target (issue 31.9: no port oracle)
        assert r.status_code == 500 and r.json()["error"]["message"] == REFUSED, r.text
    assert time.monotonic() - started < FAIL_AFTER_S + 3, "refused without asking that host anything"
    s = state(d.url)
    assert s["blocks_free"] == s["blocks_total"] and s["pending_pulls"] == 0


def test_no_secret_no_network() -> None:
    """Without KVFERRY_SECRET a non-loopback bind is refused (nothing is bound: it exits first)."""
    env = {"KVFERRY_SECRET": "", "PATH": "/usr/bin:/bin"}
    run = subprocess.run([sys.executable, "-m", "kvferry", "serve", "--host", "0.0.0.0", "--port", str(free_port())],
                         env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "KVFERRY_SECRET" in run.stderr and "--insecure" in run.stderr, run.stderr
    assert HARNESS_SECRET, "the harness runs every system with a secret"
