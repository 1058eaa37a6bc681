"""The routers' P/D protocols, replayed from captured router traffic against real P and D processes.

tests/routers/captures/ holds what vllm-router 0.1.17 (NIXL and Mooncake modes) and sglang-router 0.3.2
sent to kvferry instances (request bodies and headers). Each flow is replayed the way its router drives
it; the answer must equal the one through `kvferry proxy`, and the transfer counters must prove that D
pulled the KV instead of computing the prompt itself.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvferry.harness.sampler import parse_metrics
from procs import Proc, free_port, pd_system, serve, wait_until

CAPTURES = Path(__file__).parent / "captures"
TRANSFERS = "kvferry_kv_transfers_total"


def captured(name: str, who: str) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in (CAPTURES / name).read_text().splitlines()]
    return [r for r in rows if r["who"] == who and r["path"] == "/v1/completions"]


@pytest.fixture(scope="module")
def system() -> Iterator[tuple[Proc, Proc, Proc, str]]:
    with pd_system() as (p, d, proxy):
        bootstrap = httpx.get(f"{p.url}/health", timeout=5).json()["kv_bootstrap_addr"]
        yield p, d, proxy, bootstrap


def transfers(proc: Proc) -> float:
    return parse_metrics(httpx.get(f"{proc.url}/metrics", timeout=5).text).value(TRANSFERS)


def text_of(response: httpx.Response, stream: bool) -> str:
    assert response.status_code == 200, response.text
    if not stream:
        return str(response.json()["choices"][0]["text"])
    events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])


def via_proxy(proxy: Proc, body: dict[str, Any]) -> str:
    plain = {k: body[k] for k in ("prompt", "max_tokens", "temperature", "stream") if k in body}
    return text_of(httpx.post(f"{proxy.url}/v1/completions", json=plain, timeout=60), bool(body.get("stream")))


def wait_clean(*procs: Proc) -> None:
    def clean() -> bool:
        states = [httpx.get(f"{p.url}/debug/state", timeout=10).json() for p in procs]
        return all(s["blocks_free"] == s["blocks_total"] and not s["requests_by_status"] for s in states)

    wait_until(clean, 15, "P and D to hold nothing")


def test_vllm_router_nixl_flow(system: tuple[Proc, Proc, Proc, str]) -> None:
    """P gets do_remote_decode with no transfer_id and null remote_* keys; its answer goes to D unchanged."""
    p, d, proxy, _ = system
    (request,) = captured("vllm-router-0.1.17-nixl.jsonl", "P1")
    p_body = request["body"]
    assert "transfer_id" not in p_body["kv_transfer_params"]
    expected = via_proxy(proxy, {**p_body, "max_tokens": 16})  # before counting: the proxy transfers too
    before = transfers(d)
    answer = httpx.post(f"{p.url}/v1/completions", json=p_body, headers=request["headers"], timeout=60)
    assert answer.status_code == 200, answer.text
    params = answer.json()["kv_transfer_params"]
    assert params["do_remote_prefill"] and params["transfer_id"] and params["remote_engine_id"]
    for stream in (False, True):
        d_body = {**p_body, "max_tokens": 16, "stream": stream, "kv_transfer_params": params}
        d_body.pop("min_tokens")
        assert text_of(httpx.post(f"{d.url}/v1/completions", json=d_body, timeout=60), stream) == expected
        if not stream:  # the next flow needs its own prefill on P
            answer = httpx.post(f"{p.url}/v1/completions", json=p_body, headers=request["headers"], timeout=60)
            params = answer.json()["kv_transfer_params"]
    assert transfers(d) == before + 2
    wait_clean(p, d)


def test_vllm_router_mooncake_flow(system: tuple[Proc, Proc, Proc, str]) -> None:
    """The router asks P's bootstrap server for its engines without an engine_id, names the bootstrap
    server with http://, and builds D's parameters itself (P's answer is ignored)."""
    p, d, proxy, bootstrap = system
    engines = httpx.get(f"http://{bootstrap}/query", timeout=5).json()
    engine_id = engines["0"]["engine_id"]
    (p_request,) = captured("vllm-router-0.1.17-mooncake.jsonl", "P1")
    (d_request,) = captured("vllm-router-0.1.17-mooncake.jsonl", "D1")
    expected = via_proxy(proxy, {**d_request["body"], "stream": False})
    before = transfers(d)
    for stream in (False, True):
        transfer_id = f"xfer-{uuid.uuid4()}"
        p_body = {**p_request["body"], "kv_transfer_params": {**p_request["body"]["kv_transfer_params"],
                                                              "transfer_id": transfer_id}}
        d_params = {**d_request["body"]["kv_transfer_params"], "transfer_id": transfer_id,
                    "remote_engine_id": engine_id, "remote_bootstrap_addr": f"http://{bootstrap}"}
        d_body = {**d_request["body"], "stream": stream, "kv_transfer_params": d_params}
        assert httpx.post(f"{p.url}/v1/completions", json=p_body, timeout=60).status_code == 200
        assert text_of(httpx.post(f"{d.url}/v1/completions", json=d_body, timeout=60), stream) == expected
    assert transfers(d) == before + 2
    wait_clean(p, d)


def test_sglang_router_flow(system: tuple[Proc, Proc, Proc, str]) -> None:
    """The same request goes to P and D at once with bootstrap_host/port/room and no kv_transfer_params:
    P only prefills, D pulls the room's transfer (never a second full computation)."""
    p, d, proxy, bootstrap = system
    host, port = bootstrap.rsplit(":", 1)
    rows = captured("sglang-router-0.3.2-pd.jsonl", "D1")
    assert {r["body"]["stream"] for r in rows} == {False, True}
    expected = [via_proxy(proxy, {**r["body"], "stream": False}) for r in rows]
    p_before, d_before = transfers(p), transfers(d)
    for row, want in zip(rows, expected, strict=True):
        body = {**row["body"], "bootstrap_host": host, "bootstrap_port": int(port)}
        with ThreadPoolExecutor(2) as pool:  # at once, as the router does
            answers = {name: pool.submit(httpx.post, f"{url}/v1/completions", json=body, timeout=60)
                       for name, url in (("P", p.url), ("D", d.url))}
        stream = bool(body["stream"])
        assert len(text_of(answers["P"].result(), stream)) <= 4  # one token: P prefilled only
        assert text_of(answers["D"].result(), stream) == want
    assert transfers(d) == d_before + len(rows)
    assert transfers(p) == p_before + len(rows)
    wait_clean(p, d)


@pytest.mark.parametrize(
    ("role", "body", "message"),
    [
        ("decode", {"kv_transfer_params": {"do_remote_decode": True}}, "needs a prefill instance"),
        ("prefill", {"kv_transfer_params": {"do_remote_prefill": True}}, "needs a decode instance"),
        ("both", {"bootstrap_host": "127.0.0.1", "bootstrap_port": 8998, "bootstrap_room": 7}, "role both"),
        ("both", {"kv_transfer_params": {"do_remote_decode": True, "transfer_id": "x"}}, "role both"),
        ("prefill", {"bootstrap_host": "127.0.0.1", "bootstrap_room": 7}, "without bootstrap_port"),
        ("prefill", {"bootstrap_host": "h", "bootstrap_port": 1, "bootstrap_room": -1}, "bootstrap_room"),
        ("decode", {"bootstrap_host": "h", "bootstrap_port": "x", "bootstrap_room": 1}, "bootstrap_port"),
        ("prefill", {"bootstrap_host": "h", "bootstrap_port": 1, "bootstrap_room": 1,
                     "kv_transfer_params": {"do_remote_decode": True}}, "not both"),
        ("decode", {"kv_transfer_params": {"do_remote_prefill": True, "transfer_id": "t", "remote_engine_id": "e",
                                           "remote_bootstrap_addr": "https://h:1"}}, "remote_bootstrap_addr must be host:port"),
    ],
)
def test_p_d_fields_an_instance_cannot_honour_get_400(role: str, body: dict[str, Any], message: str) -> None:
    proc = instance(role)
    r = httpx.post(f"{proc.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2, **body}, timeout=30)
    assert r.status_code == 400, r.text
    assert message in r.json()["error"]["message"]


_instances: dict[str, Proc] = {}


def instance(role: str) -> Proc:
    """One instance per role for the whole module (started on first use, stopped at the end)."""
    if role not in _instances:
        extra = ("--bootstrap-port", str(free_port())) if role == "prefill" else ()
        proc = serve(None, "--role", role, "--num-blocks", "64", *extra)
        _instances[role] = proc
        proc.wait_healthy()
    return _instances[role]


@pytest.fixture(scope="module", autouse=True)
def _stop_instances() -> Iterator[None]:
    yield
    for proc in _instances.values():
        proc.stop()
    _instances.clear()


def test_sglang_decode_with_unreachable_bootstrap_fails_with_cause() -> None:
    d = instance("decode")
    body = {"prompt": "hi", "max_tokens": 2, "bootstrap_host": "127.0.0.1", "bootstrap_port": 9,
            "bootstrap_room": 5}
    r = httpx.post(f"{d.url}/v1/completions", json=body, timeout=30)
    assert r.status_code == 500
    assert r.json()["error"]["type"] == "kv_load_failed" and r.json()["error"]["code"] == "bootstrap"


def test_sglang_router_info_probes(system: tuple[Proc, Proc, Proc, str]) -> None:
    p, d, _, bootstrap = system
    for proc, mode in ((p, "prefill"), (d, "decode")):
        for path in ("/get_server_info", "/server_info"):
            info = httpx.get(f"{proc.url}{path}", timeout=5).json()
            assert info["disaggregation_mode"] == mode and info["model_path"]
        for path in ("/get_model_info", "/model_info"):
            assert httpx.get(f"{proc.url}{path}", timeout=5).json()["is_generation"] is True
    assert httpx.get(f"{p.url}/get_server_info", timeout=5).json()["disaggregation_bootstrap_port"] == int(
        bootstrap.rsplit(":", 1)[1])
