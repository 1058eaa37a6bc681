"""`kvferry serve --transfer nixl`: P/D answers equal the colocated ones, and the injected fault kinds
end as they do on the TCP data plane (fail: the predicted cause; recompute: identical text, only the
lost blocks recomputed). Skips when nixl is not installed."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from kvferry.connector.faults import FaultSpec
from kvferry.engine.model import ModelConfig, TinyLlama
from kvferry.engine.tokenizer import decode
from kvferry.transfer.nixl import api as nixl_api
from procs import Proc, pd_system, wait_until

if not nixl_api.available():
    pytest.skip(f"nixl not installed: {nixl_api.IMPORT_ERROR}", allow_module_level=True)

BS = 16
MODEL = TinyLlama(ModelConfig(seed=0))
NIXL = ("--transfer", "nixl")
FAULTS = "error_reply=0.15,transport=0.3,corrupt=0.3,seed=11"


def prompt(n: int, salt: int) -> list[int]:
    return [(i * 37 + salt * 11 + 5) % 256 for i in range(n)]


def complete(url: str, ids: list[int]) -> httpx.Response:
    body = {"prompt": ids, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=60)


def reference(ids: list[int]) -> str:
    return decode(MODEL.generate_greedy(ids, 4, stop_at_eos=False))


def drained(proc: Proc) -> bool:
    state = httpx.get(f"{proc.url}/debug/state", timeout=5).json()
    return bool(state["blocks_free"] == state["blocks_total"] and not state["pending_pulls"] and not state["pending_sends"])


def test_pd_answers_are_identical_and_the_kv_moved_over_nixl() -> None:
    with pd_system(p_args=NIXL, d_args=NIXL) as (p, d, proxy):
        for i in range(4):
            ids = prompt(40 + 23 * i, i)
            r = complete(proxy.url, ids)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == reference(ids)
            assert r.json()["kvferry"]["recomputed_tokens"] == 0
        wait_until(lambda: drained(p) and drained(d), 10, "P and D drained")
        metrics = httpx.get(f"{d.url}/metrics", timeout=5).text
        line = next(x for x in metrics.splitlines() if x.startswith("kvferry_kv_transfers_total"))
        assert float(line.split()[-1]) == 4


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_fault_kinds_over_nixl(policy: str) -> None:
    spec = FaultSpec.parse(FAULTS)
    args = (*NIXL, "--faults", FAULTS, "--kv-load-failure-policy", policy, "--abort-timeout", "3")
    seen: set[str | None] = set()
    with pd_system(p_args=args, d_args=args) as (p, d, proxy):
        for i in range(40):  # the proxy's transfer ids pick the faults: go on until both kinds came
            if i >= 10 and {"transport", "corrupt"} <= seen:
                break
            n_blocks = 2 + i % 4
            ids = prompt(n_blocks * BS, 50 + i)
            r = complete(proxy.url, ids)
            tid = r.headers["x-kvferry-transfer-id"]
            fault, expected = spec.fault_for(tid), spec.expected_cause(tid)
            seen.add(fault)
            if policy == "fail" and expected is not None:
                assert r.status_code == 500, r.text
                assert r.json()["error"]["code"] == expected, r.text
                continue
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == reference(ids)
            recomputed = r.json()["kvferry"]["recomputed_tokens"]
            if fault == "transport":  # the write broke after half of the blocks: those count (exact progress)
                assert recomputed == (n_blocks - n_blocks // 2) * BS
            elif fault == "corrupt":  # one block flipped by a second write, found by its checksum
                assert 0 < recomputed <= (n_blocks - (n_blocks - 1) // 2) * BS
            elif fault is None:
                assert recomputed == 0
        wait_until(lambda: drained(p) and drained(d), 10, "P and D drained")
    assert {"transport", "corrupt"} <= seen, seen


def test_serve_refuses_nixl_off_loopback_without_insecure() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvferry", "serve", "--role", "decode", "--host", "10.255.255.1", "--transfer", "nixl"],
        capture_output=True, text=True, timeout=60, env={"KVFERRY_SECRET": "c2VjcmV0LW9mLWF0LWxlYXN0LTEyOC1iaXRz", "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 2 and "--insecure" in proc.stderr and "UCX" in proc.stderr, proc.stderr
