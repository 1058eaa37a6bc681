"""Issue 18.1 through real processes: D with a nearly full pool (4 blocks of 16) and three concurrent
pulled requests that each outgrow their 2 prompt blocks. D used to preempt the one running request in
front of a loaded one that held the remaining blocks, and then schedule nothing, for ever. Every request
must answer 200 within a deadline, and both pools must be full again afterwards."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx

from kvferry.harness.sampler import is_drained, wait_drained
from procs import pd_system

REQUEST_DEADLINE_S = 60.0  # the tiny model answers in well under a second; a hung request never does
ROUNDS = 3  # each round is a fresh race between the three loads and the first one's decoding


def _complete(url: str, prompt: str) -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=REQUEST_DEADLINE_S)


def test_three_requests_on_a_four_block_decode_pool_all_finish() -> None:
    with pd_system(d_args=("--num-blocks", "4")) as (p, d, proxy), ThreadPoolExecutor(3) as pool:
        for round_ in range(ROUNDS):
            prompts = [f"{round_}{i} the quick brown fox jumps over"[:31] for i in range(3)]
            assert all(len(prompt.encode()) == 31 for prompt in prompts)
            responses = list(pool.map(lambda prompt: _complete(proxy.url, prompt), prompts))
            for response in responses:
                assert response.status_code == 200, response.text
                assert response.json()["usage"]["completion_tokens"] == 12, response.text
            states = wait_drained([p.url, d.url], timeout=30)
            assert all(s is not None and is_drained(s) for s in states), states
            assert states[1] is not None and states[1]["blocks_total"] == 4
