"""vLLM's own NixlConnector on the lane's servers (the peer `kvferry bench vllm` measures against): P/D
through vllm-router's NIXL-mode requests gives the colocated tokens with the KV moved, and `kill -9` of P
after its answer fails D's request within a bound. Needs `nixl` in the lane's environment
(.ci/vllm-serve.sh adds it); skipped without it."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest
from cluster import completion, prompt_of, tokens
from servers import Server, vllm_server

from kvferry.bench.vllm.client import ROUTER_NIXL_P_PARAMS
from kvferry.bench.vllm.servers import NIXL_CONFIG, nixl_env
from kvferry.harness.processes import free_port

pytest.importorskip("nixl._api")
pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def nixl_pd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Server, str]]:
    from tiny_model import write_tiny_llama

    model = str(write_tiny_llama(tmp_path_factory.mktemp("tiny-llama-nixl")))
    config = json.dumps(NIXL_CONFIG)
    p = vllm_server("nixl-prefill", model, free_port(), "--num-gpu-blocks-override", "16",
                    "--kv-transfer-config", config, env=nixl_env("127.0.0.1", "lo", "23000-23499"))
    d = vllm_server("nixl-decode", model, free_port(), "--num-gpu-blocks-override", "16",
                    "--kv-transfer-config", config, env=nixl_env("127.0.0.1", "lo", "23500-23999"))
    try:
        for server in (p, d):
            server.start()
        for server in (p, d):
            server.wait_healthy()
        yield p, d, model
    finally:
        for server in (d, p):
            server.stop()


def _prefill(p: Server, model: str, prompt: str) -> dict[str, Any]:
    r = completion(p.url, model, prompt, max_tokens=1, kv_transfer_params=dict(ROUTER_NIXL_P_PARAMS))
    assert r.status_code == 200, r.text
    params = r.json()["kv_transfer_params"]
    assert params and params["do_remote_prefill"], params
    return dict(params)


def test_nixl_pd_is_token_identical_and_moves_the_kv(nixl_pd: tuple[Server, Server, str]) -> None:
    p, d, model = nixl_pd
    for seed, n in enumerate([300, 200]):
        prompt = prompt_of(n, 500 + seed)
        want = tokens(completion(p.url, model, prompt))  # P without kv_transfer_params: a plain vllm serve
        moved = d.metric("vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
        assert tokens(completion(d.url, model, prompt, kv_transfer_params=_prefill(p, model, prompt))) == want
        assert d.metric("vllm:prompt_tokens_by_source_total", source="external_kv_transfer") > moved


def test_nixl_kill_p_after_its_answer_fails_d_within_a_bound(nixl_pd: tuple[Server, Server, str]) -> None:
    """D handshook with this P in the test before: UCX sees the closed connection at once (the issue
    measured 13-36 ms; 5.1 s for a P D never talked to). The bound leaves room for a loaded box."""
    p, d, model = nixl_pd
    prompt = prompt_of(250, 600)
    params = _prefill(p, model, prompt)
    p.kill9()
    started = time.monotonic()
    r = completion(d.url, model, prompt, kv_transfer_params=params, timeout=60)
    took = time.monotonic() - started
    assert r.status_code == 500, r.text  # kv_load_failure_policy "fail": vLLM's HTTP 500, no cause
    assert took < 10.0, f"D answered {took:.2f} s after P's kill"
    plain = prompt_of(90, 601)  # D still serves
    assert completion(d.url, model, plain).status_code == 200
