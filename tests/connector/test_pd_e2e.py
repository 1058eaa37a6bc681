"""End to end with real processes: proxy + P + D over loopback, outputs token-identical to the
colocated reference, for several tensor-parallel layouts; failures reach the client as HTTP 500."""

from __future__ import annotations

import random

import httpx
import pytest

from kvferry.engine.model import ModelConfig, TinyLlama
from kvferry.engine.tokenizer import decode
from procs import Proc, pd_system

SEED = 0  # procs.pd_system starts every instance with --seed 0


def prompts(n: int, max_len: int, rng_seed: int = 1) -> list[list[int]]:
    rng = random.Random(rng_seed)
    lengths = [1, 15, 16, 17, max_len] + [rng.randint(1, max_len) for _ in range(n - 5)]
    return [[rng.randrange(256) for _ in range(k)] for k in lengths[:n]]


def complete(url: str, prompt: list[int], max_tokens: int = 6) -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=120)


def assert_clean(*procs: Proc) -> None:
    for proc in procs:
        state = httpx.get(f"{proc.url}/debug/state", timeout=10).json()
        assert state["blocks_free"] == state["blocks_total"], state
        assert state["pending_pulls"] == 0 and state["pending_sends"] == 0, state
        assert state["requests_by_status"] == {}, state


@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 1), (2, 1), (1, 2)])
def test_outputs_match_colocated_reference(p_tp: int, d_tp: int) -> None:
    model = TinyLlama(ModelConfig(seed=SEED))
    batch = prompts(12, 600, rng_seed=p_tp * 10 + d_tp)
    with pd_system(p_tp, d_tp) as (p, d, proxy):
        for prompt in batch:
            r = complete(proxy.url, prompt)
            assert r.status_code == 200, r.text
            expected = decode(model.generate_greedy(prompt, 6, stop_at_eos=False))
            assert r.json()["choices"][0]["text"] == expected
        assert_clean(p, d)
        assert_startup_lines_name_every_listener(p, d)


def assert_startup_lines_name_every_listener(*procs: Proc) -> None:
    for proc in procs:
        state = httpx.get(f"{proc.url}/debug/state", timeout=10).json()
        connector = state["connector"]
        assert connector["transfer_addrs"] and bool(connector["control_addrs"]) == (state["role"] == "prefill")
        log = proc.output_tail(20_000)
        assert f"HTTP API on {proc.url}" in log, log
        for rank, addr in enumerate(connector["control_addrs"]):
            assert f"control (ZMQ) of rank {rank} on {addr}" in log, log
        for rank, addr in enumerate(connector["transfer_addrs"]):
            assert f"data plane (tcp) of rank {rank} on {addr}" in log, log


def _metric(text: str, name: str) -> float:
    return sum(float(ln.split()[-1]) for ln in text.splitlines() if ln.startswith(name))


def test_d_measures_heartbeat_round_trips() -> None:
    """P's writes take 1.5 s (`slow`): D heartbeats the pull meanwhile and times every ack."""
    with pd_system(p_args=("--faults", "slow=1500")) as (p, d, proxy):
        r = complete(proxy.url, prompts(1, 40)[0])
        assert r.status_code == 200, r.text
        text = httpx.get(f"{d.url}/metrics", timeout=10).text
        count = _metric(text, "kvferry_heartbeat_rtt_seconds_count")
        assert count >= 2, text
        assert _metric(text, 'kvferry_heartbeat_rtt_seconds_bucket{le="1.0"}') == count  # an idle P answers fast
        assert_clean(p, d)


def test_sequential_proxy_hands_p_params_to_d() -> None:
    """The proxy mode for prefill instances that do not announce a bootstrap (vLLM): P first, then D
    with the kv_transfer_params of P's answer."""
    model = TinyLlama(ModelConfig(seed=SEED))
    with pd_system(proxy_args=("--sequential",)) as (p, d, proxy):
        for prompt in prompts(4, 300, rng_seed=9):
            r = complete(proxy.url, prompt)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == decode(model.generate_greedy(prompt, 6, stop_at_eos=False))
        assert_clean(p, d)
