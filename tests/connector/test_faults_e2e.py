"""Fault injection through the real processes: under `fail` exactly the requests the fault function
predicts get HTTP 500 with the right cause; under `recompute` every output equals the colocated one and
only the lost blocks are recomputed. A killed or frozen P is noticed (peer_dead) and a restarted P works
again at once."""

from __future__ import annotations

import os
import signal
import threading

import httpx
import pytest

from kvferry.connector.faults import FaultSpec
from kvferry.engine.model import ModelConfig, TinyLlama
from kvferry.engine.tokenizer import decode
from procs import Proc, free_port, pd_system, running, serve, wait_until

BS = 16
MODEL = TinyLlama(ModelConfig(seed=0))


def prompt(n: int, salt: int) -> list[int]:
    return [(i * 31 + salt * 7 + 3) % 256 for i in range(n)]


def complete(url: str, ids: list[int], max_tokens: int = 4) -> httpx.Response:
    body = {"prompt": ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=60)


def reference(ids: list[int], max_tokens: int = 4) -> str:
    return decode(MODEL.generate_greedy(ids, max_tokens, stop_at_eos=False))


MIXED = "error_reply=0.2,err_reqs=0.15,transport=0.2,corrupt=0.2,seed=5"


def test_fail_policy_fails_exactly_the_predicted_requests_with_their_cause() -> None:
    spec = FaultSpec.parse(MIXED)
    args = ("--faults", MIXED, "--kv-load-failure-policy", "fail", "--abort-timeout", "3")
    seen: set[str | None] = set()
    with pd_system(p_args=args, d_args=args) as (p, d, proxy):
        for i in range(16):
            ids = prompt(40 + 9 * i, i)
            r = complete(proxy.url, ids)
            expected = spec.expected_cause(r.headers["x-kvferry-transfer-id"])
            seen.add(expected)
            if expected is None:
                assert r.status_code == 200, r.text
                assert r.json()["choices"][0]["text"] == reference(ids)
            else:
                assert r.status_code == 500, r.text
                error = r.json()["error"]
                assert (error["type"], error["code"]) == ("kv_load_failed", expected), error
        wait_until(lambda: drained(p) and drained(d), 10, "P and D drained")
    assert len(seen) >= 3, f"the workload should hit several causes, saw {seen}"


def drained(proc: Proc) -> bool:
    state = httpx.get(f"{proc.url}/debug/state", timeout=5).json()
    return bool(state["blocks_free"] == state["blocks_total"] and not state["pending_pulls"] and not state["pending_sends"])


def test_recompute_policy_outputs_identical_and_recomputes_only_lost_blocks() -> None:
    spec = FaultSpec.parse(MIXED)
    args = ("--faults", MIXED, "--kv-load-failure-policy", "recompute", "--abort-timeout", "3")
    with pd_system(p_args=args, d_args=args) as (p, d, proxy):
        recomputed_total = 0
        for i in range(16):
            n_blocks = 2 + i % 5
            ids = prompt(n_blocks * BS, 100 + i)
            r = complete(proxy.url, ids)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == reference(ids)
            recomputed = r.json()["kvferry"]["recomputed_tokens"]
            fault = spec.fault_for(r.headers["x-kvferry-transfer-id"])
            if fault == "transport":  # the data plane broke after half of the blocks
                assert recomputed == (n_blocks - n_blocks // 2) * BS
            elif fault == "corrupt":  # one block flipped, found by its checksum
                assert 0 < recomputed <= (n_blocks - (n_blocks - 1) // 2) * BS
            elif fault is None:
                assert recomputed == 0
            else:  # the whole request
                assert recomputed == len(ids)
            recomputed_total += recomputed
        wait_until(lambda: drained(p) and drained(d), 10, "P and D drained")
        metrics = httpx.get(f"{d.url}/metrics").text
        line = next(x for x in metrics.splitlines() if x.startswith("kvferry_recomputed_tokens_total"))
        assert float(line.split()[-1]) == recomputed_total


@pytest.mark.parametrize(("fault", "cause"), [("bootstrap", "bootstrap"), ("p_not_ready", "err_reqs")])
def test_single_fault_kinds(fault: str, cause: str) -> None:
    args = ("--faults", f"{fault}=1", "--kv-load-failure-policy", "fail", "--abort-timeout", "1")
    with pd_system(p_args=args, d_args=args) as (p, d, proxy):
        r = complete(proxy.url, prompt(33, 1))
        assert r.status_code == 500 and r.json()["error"]["code"] == cause, r.text
        wait_until(lambda: drained(p) and drained(d), 10, "P and D drained")


def send_in_background(url: str, ids: list[int]) -> tuple[threading.Thread, list[httpx.Response]]:
    out: list[httpx.Response] = []
    thread = threading.Thread(target=lambda: out.append(complete(url, ids)), daemon=True)
    thread.start()
    return thread, out


def in_transfer(p: Proc, d: Proc) -> bool:
    """P is inside its (slowed) write for D's pull, so its HTTP answer is long out; D waits."""
    d_state = httpx.get(f"{d.url}/debug/state", timeout=5).json()
    p_state = httpx.get(f"{p.url}/debug/state", timeout=5).json()
    return bool(d_state["requests_by_status"].get("WAITING_FOR_REMOTE_KVS")) and bool(
        p_state["connector"]["writes_in_flight"]
    )


@pytest.mark.parametrize(("how", "fixed"), [("kill", False), ("stop", False), ("kill", True)])
def test_dead_or_hung_prefill_is_noticed_and_a_restarted_one_works(how: str, fixed: bool) -> None:
    """`fixed`: P restarts at the same control port too, a new process at an address D still holds a
    connection for (issue 31: D must seal for the new P's boot id, so it asks the bootstrap again)."""
    bootstrap_port = str(free_port())
    slow = ("--faults", "slow=30000")  # P accepts the pull, then sits on it
    p_args = ("--role", "prefill", "--bootstrap-port", bootstrap_port, "--num-blocks", "256", "--seed", "0",
              *(("--control-port", str(free_port())) if fixed else ()))
    p = serve(None, *p_args, *slow)
    p_port = p.url.rsplit(":", 1)[1]
    d = serve(None, "--role", "decode", "--num-blocks", "256", "--seed", "0", "--kv-load-failure-policy", "fail")
    proxy_port = free_port()
    proxy = Proc(["proxy", "--prefill", p.url, "--decode", d.url, "--port", str(proxy_port)],
                 f"http://127.0.0.1:{proxy_port}")
    restarted: Proc | None = None
    try:
        with running(p, d, proxy):
            thread, out = send_in_background(proxy.url, prompt(50, 2))
            wait_until(lambda: in_transfer(p, d), 20, "a transfer in flight")
            os.kill(p.pid, signal.SIGKILL if how == "kill" else signal.SIGSTOP)
            thread.join(timeout=20)
            assert out and out[0].status_code == 500, out
            assert out[0].json()["error"]["code"] == "peer_dead"
            p.stop()
            restarted = serve(int(p_port), *p_args)  # same address, no faults
            with running(restarted):
                ids = prompt(50, 3)
                r = complete(proxy.url, ids)
                assert r.status_code == 200, r.text
                assert r.json()["choices"][0]["text"] == reference(ids)
                wait_until(lambda: drained(d), 10, "D drained")
    finally:
        for proc in (p, restarted):
            if proc is not None:
                proc.stop()

