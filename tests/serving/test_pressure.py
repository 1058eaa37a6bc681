"""Ordinary pressure on real processes (issue 18): a reused transfer_id, a prompt P did not compute, a
request D turns away. Each ends with a clear answer and both pools whole."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from kvferry.harness.sampler import wait_drained
from procs import Proc, pd_system, wait_until

PROMPT = "Pressure is ordinary: a retried request, a different prompt. " * 2


@pytest.fixture(scope="module")
def system() -> Iterator[tuple[Proc, Proc, Proc]]:
    with pd_system(p_args=("--abort-timeout", "300", "--num-blocks", "128")) as procs:
        yield procs


def prefill(p: Proc, transfer_id: str, prompt: str = PROMPT) -> httpx.Response:
    return httpx.post(f"{p.url}/v1/completions", timeout=30, json={
        "prompt": prompt, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True, "transfer_id": transfer_id}})


def decode(d: Proc, params: dict[str, Any] | None, prompt: str = PROMPT) -> httpx.Response:
    body: dict[str, Any] = {"prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    if params is not None:
        body["kv_transfer_params"] = params
    return httpx.post(f"{d.url}/v1/completions", json=body, timeout=60)


def pools_whole(*procs: Proc) -> None:
    states = wait_drained([p.url for p in procs], 20)
    assert all(s is not None and s["blocks_free"] == s["blocks_total"] for s in states), states


def test_a_live_transfer_id_is_refused_never_overwritten(system: tuple[Proc, Proc, Proc]) -> None:
    """Main leaked 127 of 128 P blocks with 22 retried requests, and gave D the retry's KV."""
    p, d, _ = system
    firsts = []
    for i in range(11):  # 11 × 8 of 128 blocks held; overwritten retries would leak 88 more
        first = prefill(p, f"retried-{i}")
        assert first.status_code == 200, first.text
        firsts.append(first.json()["kv_transfer_params"])
        retry = prefill(p, f"retried-{i}", "another prompt under the same id " * 4)
        assert retry.status_code == 400 and "transfer_id in use" in retry.json()["error"]["message"], retry.text
    reference = decode(d, None).json()["choices"][0]["text"]
    for params in firsts:  # every D gets the KV of the request that owns the id
        r = decode(d, params)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == reference, r.text
    pools_whole(p, d)
    metrics = httpx.get(f"{p.url}/metrics").text
    assert "kvferry_duplicate_transfer_ids_total 11.0" in metrics


def test_a_pull_for_another_prompt_is_prompt_mismatch(system: tuple[Proc, Proc, Proc]) -> None:
    p, d, _ = system
    r = prefill(p, "mismatch")
    assert r.status_code == 200
    other = PROMPT.replace("ordinary", "ORDINARY")  # same length in tokens, other ids
    failed = decode(d, r.json()["kv_transfer_params"], other)
    assert failed.status_code == 500 and failed.json()["error"]["code"] == "prompt_mismatch", failed.text
    pools_whole(p, d)  # D's failure spine released P's transfer: no wait for the 300 s abort timeout


def test_a_request_d_turns_away_releases_p(system: tuple[Proc, Proc, Proc]) -> None:
    """vllm-router never cancels P: D's 404 must free P's blocks itself, not P's abort timeout."""
    p, d, _ = system
    params = prefill(p, "turned-away").json()["kv_transfer_params"]
    assert httpx.get(f"{p.url}/debug/state").json()["pending_sends"] > 0
    r = httpx.post(f"{d.url}/v1/completions", timeout=30, json={
        "prompt": PROMPT, "max_tokens": 2, "model": "no-such-model", "kv_transfer_params": params})
    assert r.status_code == 404
    wait_until(lambda: httpx.get(f"{p.url}/debug/state").json()["pending_sends"] == 0, 5, "P to free the transfer")
    pools_whole(p, d)
