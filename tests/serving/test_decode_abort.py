"""A D that aborts the request it runs is a D gone. vLLM's SIGTERM without `--shutdown-timeout` answers
HTTP 200 with no token and finish_reason "abort" (tests/serving/fake_vllm.py mimics it): the proxy asks
another D for a non-streamed answer (nothing reached the client yet) and resumes a stream there, within
`--migrations`; a D that always aborts costs that budget, then the client gets an error, never an empty
answer. All in-process: the proxy, a vLLM-like P and aborting D's, and a real kvferry instance as the
D that answers."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import uvicorn
from fake_vllm import Counter, aborting_decode, sequential_prefill
from inproc import ServerThread

from kvferry.engine.engine import Engine, EngineConfig
from kvferry.serving.api_server import build_app
from kvferry.serving.proxy import build_proxy_app

PROMPT = "abort me, then answer: " + "kv " * 8
PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


@dataclass
class Cluster:
    prefill: str
    kvferry_d: str  # a real kvferry instance: the D that answers
    aborting: list[str]  # D's that abort every request
    counters: list[Counter]  # one per aborting D

    def aborts(self) -> int:
        return sum(c.requests for c in self.counters)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    engine = Engine(EngineConfig(num_blocks=256, seed=0))
    engine.start()
    counters = [Counter(), Counter()]
    threads = [ServerThread.of(build_app(engine)), ServerThread.of(sequential_prefill(Counter())),
               *(ServerThread.of(aborting_decode(c)) for c in counters)]
    try:
        for t in threads:
            t.start()
        yield Cluster(threads[1].url, threads[0].url, [t.url for t in threads[2:]], counters)
    finally:
        for t in threads:
            t.stop()
        engine.stop()


@pytest.fixture()
def fresh(cluster: Cluster) -> Cluster:
    for c in cluster.counters:
        c.requests = 0
    return cluster


class Proxy:
    """`kvferry proxy` on a thread (its lifespan runs: pools and probes are closed on stop)."""

    def __init__(self, prefill: str, decodes: list[str], migrations: int) -> None:
        app = build_proxy_app([prefill], decodes, migrations=migrations, health_interval_s=0)
        self.thread = ServerThread(uvicorn.Server(uvicorn.Config(
            app, log_level="warning", access_log=False, timeout_keep_alive=1, lifespan="on",
            timeout_graceful_shutdown=5)))

    def __enter__(self) -> str:
        return self.thread.start().url

    def __exit__(self, *_: object) -> None:
        self.thread.stop()


def _body(kind: str, stream: bool) -> dict[str, Any]:
    prompt = {"messages": [{"role": "user", "content": PROMPT}]} if kind == "chat" else {"prompt": PROMPT}
    return {**prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True, "stream": stream}


def _text(kind: str, answer: dict[str, Any]) -> str:
    choice = answer["choices"][0]
    return str(choice["message"]["content"] if kind == "chat" else choice["text"])


def _reference(cluster: Cluster, kind: str) -> str:
    r = httpx.post(f"{cluster.kvferry_d}{PATHS[kind]}", json=_body(kind, False), timeout=60)
    assert r.status_code == 200, r.text
    return _text(kind, r.json())


def _stream(url: str, kind: str) -> tuple[list[dict[str, Any]], bool]:
    events, done = [], False
    with httpx.stream("POST", f"{url}{PATHS[kind]}", json=_body(kind, True), timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                events.append(json.loads(line[6:]))
    return events, done


def _stream_text(events: list[dict[str, Any]]) -> str:
    choices = [e["choices"][0] for e in events if e.get("choices")]
    return "".join(c.get("text") or (c.get("delta") or {}).get("content") or "" for c in choices)


def _migrations(proxy: str) -> dict[str, float]:
    prefix = 'kvferry_proxy_migrations_total{outcome="'
    lines = httpx.get(f"{proxy}/metrics", timeout=10).text.splitlines()
    return {ln[len(prefix):].split('"')[0]: float(ln.split()[-1]) for ln in lines if ln.startswith(prefix)}


def _no_abort_reached_the_client(events: list[dict[str, Any]]) -> None:
    assert all(c.get("finish_reason") != "abort" for e in events for c in e.get("choices") or []), events


def _one_role_first(events: list[dict[str, Any]]) -> None:
    deltas = [e["choices"][0]["delta"] for e in events if e.get("choices") and "delta" in e["choices"][0]]
    assert [i for i, d in enumerate(deltas) if d.get("role") == "assistant"] == [0], deltas


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_an_answer_a_d_aborted_is_asked_of_another_d(fresh: Cluster, kind: str) -> None:
    want = _reference(fresh, kind)
    with Proxy(fresh.prefill, [fresh.aborting[0], fresh.kvferry_d], migrations=2) as proxy:
        r = httpx.post(f"{proxy}{PATHS[kind]}", json=_body(kind, False), timeout=60)
        assert r.status_code == 200, r.text
        assert _text(kind, r.json()) == want and r.json()["choices"][0]["finish_reason"] == "length"
        assert r.headers["x-kvferry-attempts"] == "2" and fresh.aborts() == 1
        assert _migrations(proxy) == {"retried": 1.0}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_a_stream_a_d_aborted_resumes_on_another_d(fresh: Cluster, kind: str) -> None:
    want = _reference(fresh, kind)
    with Proxy(fresh.prefill, [fresh.aborting[0], fresh.kvferry_d], migrations=2) as proxy:
        events, done = _stream(proxy, kind)
        assert done and _stream_text(events) == want and fresh.aborts() == 1
        _no_abort_reached_the_client(events)
        assert all("error" not in e for e in events), events
        if kind == "chat":
            _one_role_first(events)
        assert _migrations(proxy) == {"resumed": 1.0}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("migrations", [0, 2])
def test_a_d_that_always_aborts_costs_the_budget_then_an_error(fresh: Cluster, migrations: int) -> None:
    with Proxy(fresh.prefill, fresh.aborting, migrations=migrations) as proxy:
        r = httpx.post(f"{proxy}/v1/completions", json=_body("completions", False), timeout=60)
        assert r.status_code == 502 and r.json()["error"]["type"] == "decode_aborted", r.text
        assert r.headers["x-kvferry-attempts"] == str(migrations + 1) and fresh.aborts() == migrations + 1
        assert _migrations(proxy) == {"gave_up": 1.0, **({"retried": float(migrations)} if migrations else {})}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_a_stream_whose_d_always_aborts_ends_with_one_error(fresh: Cluster, kind: str) -> None:
    with Proxy(fresh.prefill, fresh.aborting, migrations=2) as proxy:
        events, done = _stream(proxy, kind)
        assert done and events and events[-1]["error"]["type"] == "decode_died", events
        assert sum("error" in e for e in events) == 1 and _stream_text(events) == ""
        _no_abort_reached_the_client(events)
        if kind == "chat":
            _one_role_first(events[:-1])
        assert fresh.aborts() == 3 and _migrations(proxy) == {"resumed": 2.0, "gave_up": 1.0}
