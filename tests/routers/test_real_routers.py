"""kvferry P and D driven by the real router binaries (vllm-router 0.1.17 in NIXL and Mooncake mode,
sglang-router 0.3.2): completions and chat completions, streaming and not, equal `kvferry proxy`'s, and the transfer counters prove that every
request was disaggregated, split exactly by round robin over 2 P and 2 D."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import pytest
from router_procs import MODES, completion_text, router

from kvferry.harness.sampler import parse_metrics
from procs import Proc, free_port, running, serve, wait_until

PROMPTS = ["Hello world, this is", "a", "The quick brown fox jumps over the lazy dog. " * 4,
           "0123456789abcdef", "kv" * 150, "Why do routers need a bootstrap port?"]
MAX_TOKENS = 12
TRANSFERS = "kvferry_kv_transfers_total"


@dataclass
class Cluster:
    prefills: list[Proc]
    decodes: list[Proc]
    expected: dict[str, str]  # prompt → text through `kvferry proxy`
    expected_chat: dict[str, str]  # user message → the assistant's answer through `kvferry proxy`


def instance(role: str) -> Proc:
    extra = ("--bootstrap-port", str(free_port())) if role == "prefill" else ()
    return serve(None, "--role", role, "--num-blocks", "512", "--seed", "0", *extra)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    prefills, decodes = [instance("prefill"), instance("prefill")], [instance("decode"), instance("decode")]
    port = free_port()
    proxy = Proc(["proxy", "--prefill", prefills[0].url, "--decode", decodes[0].url, "--port", str(port)],
                 f"http://127.0.0.1:{port}")
    with running(*prefills, *decodes, proxy):
        expected = {prompt: complete(proxy.url, prompt, stream=False) for prompt in PROMPTS}
        expected_chat = {prompt: chat(proxy.url, prompt, stream=False) for prompt in PROMPTS[:3]}
        yield Cluster(prefills, decodes, expected, expected_chat)


def complete(url: str, prompt: str, stream: bool) -> str:
    body = {"model": "kvferry-tiny-llama", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "stream": stream}
    return completion_text(httpx.post(f"{url}/v1/completions", json=body, timeout=60), stream)


def chat(url: str, message: str, stream: bool) -> str:
    body = {"model": "kvferry-tiny-llama", "messages": [{"role": "user", "content": message}],
            "max_tokens": MAX_TOKENS, "temperature": 0, "stream": stream}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    if not stream:
        return str(r.json()["choices"][0]["message"]["content"])
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]", r.text[-500:]
    chunks = [json.loads(e) for e in events[:-1]]
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])


def transfers(proc: Proc) -> float:
    return parse_metrics(httpx.get(f"{proc.url}/metrics", timeout=5).text).value(TRANSFERS)


def assert_idle(procs: list[Proc]) -> None:
    def idle() -> bool:
        states = [httpx.get(f"{p.url}/debug/state", timeout=10).json() for p in procs]
        return all(s["blocks_free"] == s["blocks_total"] and not s["requests_by_status"] for s in states)

    wait_until(idle, 15, "every instance to hold nothing")


@pytest.mark.parametrize("pairs", [1, 2], ids=["1P1D", "2P2D"])
@pytest.mark.parametrize("mode", MODES)
def test_router_answers_match_proxy_and_every_request_is_disaggregated(
    cluster: Cluster, mode: str, pairs: int
) -> None:
    prefills, decodes = cluster.prefills[:pairs], cluster.decodes[:pairs]
    with router(mode, prefills, decodes) as r:
        before = {p.url: transfers(p) for p in prefills + decodes}
        sent = 0
        for stream in (False, True):
            for prompt in PROMPTS:
                assert complete(r.url, prompt, stream) == cluster.expected[prompt], (mode, prompt, stream)
                sent += 1
            for message, answer in cluster.expected_chat.items():
                assert chat(r.url, message, stream) == answer, (mode, message, stream)
                sent += 1
        # Every request was pulled by a D from a P (none computed in full on D), split evenly.
        for proc in prefills + decodes:
            assert transfers(proc) - before[proc.url] == sent / pairs, (mode, proc.url)
    assert_idle(prefills + decodes)


@pytest.mark.parametrize("mode", MODES)
def test_kill_of_one_prefill_instance_under_a_router(mode: str) -> None:
    """`kill -9` of one of 2 P under load, with the router's health checks tightened: once the router has
    ejected the dead P every request succeeds, nothing hangs, and the survivors hold nothing afterwards."""
    ports, boots = [free_port(), free_port()], [free_port(), free_port()]

    def prefill(i: int) -> Proc:
        return serve(ports[i], "--role", "prefill", "--num-blocks", "512", "--bootstrap-port", str(boots[i]))

    prefills, decodes = [prefill(0), prefill(1)], [instance("decode"), instance("decode")]
    checks = ("--health-check-interval-secs", "1", "--health-failure-threshold", "2",
              "--health-success-threshold", "1", "--health-check-timeout-secs", "1")
    try:
        with running(*prefills, *decodes), router(mode, prefills, decodes, checks) as r:
            load = Load(r.url)
            with ThreadPoolExecutor(4) as pool:
                first = [pool.submit(load.one, i) for i in range(12)]
                wait_until(lambda: len(load.outcomes) >= 4, 30, "the first answers")
                os.kill(prefills[0].pid, signal.SIGKILL)
                killed_at = load.now()
                for f in first:
                    f.result(timeout=120)
                # Ejected: round robin over 2 P gives 4 successes in a row only once the dead one is out.
                wait_until(lambda: all(load.one(i) == 200 for i in range(4)), 20, "the router to eject the dead P",
                           interval=0.2)
                ejected_at = load.now()
                rest = [pool.submit(load.one, i) for i in range(24)]
                assert [f.result(timeout=120) for f in rest] == [200] * 24
            failed = [o for o in load.outcomes if o[2] != 200]
            assert all(answered - sent < 60 for sent, answered, _ in load.outcomes)  # nothing hung
            print(f"\n{mode}: kill -9 of 1 of 2 P at {killed_at:.1f}s: {len(failed)} of {len(load.outcomes)} requests "
                  f"failed; ejected by {ejected_at:.1f}s; every request after that succeeded")
            assert_idle([prefills[1], *decodes])
    finally:
        for proc in prefills + decodes:
            proc.stop()


class Load:
    """Requests through a router; every outcome is kept as (sent, answered, HTTP status; 0 = no answer)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.t0 = time.monotonic()
        self.outcomes: list[tuple[float, float, int]] = []

    def now(self) -> float:
        return time.monotonic() - self.t0

    def one(self, i: int) -> int:
        sent = self.now()
        body = {"model": "kvferry-tiny-llama", "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": MAX_TOKENS,
                "temperature": 0}
        try:
            status = httpx.post(f"{self.url}/v1/completions", json=body, timeout=60).status_code
        except httpx.HTTPError:
            status = 0
        self.outcomes.append((sent, self.now(), status))
        return status


def test_restarted_prefill_instance_serves_its_first_request_through_the_router() -> None:
    """A P that comes back at the same address (same engine id, new ZMQ ports behind its bootstrap
    server) must not fail the first requests the router sends it: D must not reuse what it knew."""
    port, boot = free_port(), free_port()

    def prefill() -> Proc:
        return serve(port, "--role", "prefill", "--num-blocks", "512", "--bootstrap-port", str(boot))

    p, d = prefill(), instance("decode")
    try:
        with running(p, d), router("vllm-nixl", [p], [d]) as r:
            load = Load(r.url)
            assert load.one(0) == 200
            p.stop()
            p = prefill()
            p.wait_healthy()
            for i in range(4):
                assert load.one(i) == 200, load.outcomes
    finally:
        p.stop()
        d.stop()
