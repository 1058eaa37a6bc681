"""End to end with real processes: proxy + P + D over loopback, outputs token-identical to the
colocated reference, for several tensor-parallel layouts; failures reach the client as HTTP 500."""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest

from kvferry.engine.model import ModelConfig, TinyLlama
from kvferry.engine.tokenizer import decode
from procs import Proc, free_port, running, serve

SEED = 0


def prompts(n: int, max_len: int, rng_seed: int = 1) -> list[list[int]]:
    rng = random.Random(rng_seed)
    lengths = [1, 15, 16, 17, max_len] + [rng.randint(1, max_len) for _ in range(n - 5)]
    return [[rng.randrange(256) for _ in range(k)] for k in lengths[:n]]


@contextmanager
def pd_system(p_tp: int = 1, d_tp: int = 1, p_args: tuple[str, ...] = (), d_args: tuple[str, ...] = (),
              env: dict[str, str] | None = None) -> Iterator[tuple[Proc, Proc, Proc]]:
    common = ("--num-blocks", "1024", "--seed", str(SEED))
    p = serve(None, "--role", "prefill", "--tp", str(p_tp), "--bootstrap-port", str(free_port()), *common, *p_args,
              env=env)
    d = serve(None, "--role", "decode", "--tp", str(d_tp), *common, *d_args, env=env)
    port = free_port()
    proxy = Proc(["proxy", "--prefill", p.url, "--decode", d.url, "--port", str(port)], f"http://127.0.0.1:{port}")
    with running(p, d, proxy):
        yield p, d, proxy


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
