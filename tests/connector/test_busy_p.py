"""Busy is not dead (issue 13.1): while P prefills a long prompt for several seconds, the pulls for it
and for a small request queued behind it wait (P tells D it is still working on them) instead of
failing with `err_reqs` at P's abort timeout or `peer_dead` at D's heartbeat timeout."""

from __future__ import annotations

import os
import threading
import time

import httpx

from kvferry.engine.model import ModelConfig, TinyLlama
from kvferry.engine.tokenizer import decode
from procs import pd_system, wait_until

ABORT_S = 1.0  # P's abort timeout, far below the long prefill
LONG_TOKENS = int(os.environ.get("KVFERRY_BUSY_TOKENS", "6000"))  # README: 16000, with defaults


def prompt(n: int, salt: int) -> list[int]:
    return [(i * 31 + salt * 7 + 3) % 256 for i in range(n)]


def heartbeat_rtts(url: str) -> dict[str, float]:
    """D's kvferry_heartbeat_rtt_seconds histogram: how many acks, and how many within each bound."""
    out: dict[str, float] = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith("kvferry_heartbeat_rtt_seconds_count"):
            out["count"] = float(line.split()[-1])
        elif line.startswith("kvferry_heartbeat_rtt_seconds_bucket") and 'le="+Inf"' not in line:
            bound = line.split('le="')[1].split('"')[0]
            out[f"within_{bound}s"] = float(line.split()[-1])
    return out


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


def test_long_prefill_then_small_request_no_false_failures() -> None:
    abort_s = float(os.environ.get("KVFERRY_BUSY_ABORT_S", ABORT_S))
    args = ("--abort-timeout", str(abort_s), "--kv-load-failure-policy", "fail", "--kv-load-deadline", "600")
    with pd_system(p_args=args, d_args=args) as (p, d, proxy):
        results: dict[str, httpx.Response] = {}
        elapsed: dict[str, float] = {}

        def send(name: str, ids: list[int]) -> None:
            started = time.monotonic()
            body = {"prompt": ids, "max_tokens": 2, "temperature": 0, "ignore_eos": True}
            results[name] = httpx.post(f"{proxy.url}/v1/completions", json=body, timeout=600)
            elapsed[name] = time.monotonic() - started

        small = prompt(40, 2)
        threads = [threading.Thread(target=send, args=("long", prompt(LONG_TOKENS, 1)))]
        threads[0].start()

        def p_prefilling() -> bool:
            state = httpx.get(f"{p.url}/debug/state", timeout=5).json()
            return bool(state.get("requests_by_status", {}).get("RUNNING"))

        wait_until(p_prefilling, 30, "P prefilling the long prompt")
        threads.append(threading.Thread(target=send, args=("small", small)))
        threads[1].start()
        for t in threads:
            t.join(timeout=600)
        for name in ("long", "small"):
            assert results[name].status_code == 200, f"{name}: {results[name].text}"
        rtt = heartbeat_rtts(d.url)
        print(f"long ({LONG_TOKENS} tokens): {elapsed['long']:.1f}s, small: {elapsed['small']:.1f}s, both 200; "
              f"D's heartbeats during it: {rtt}")
        # What the system guarantees, however loaded the box (issue 32.6): every request answered (above)
        # and no false peer_dead; how fast each ack came back is the box's, reported, not asserted.
        assert rtt["count"] > 0, "D heartbeated P during the prefill"
        assert metric(d.url, "kvferry_kv_load_failures_total") == 0, "D called the busy P dead (or failed a load)"
        assert elapsed["long"] > 2 * abort_s, f"the prefill took only {elapsed['long']:.1f}s: nothing was tested"
        expected = decode(TinyLlama(ModelConfig(seed=0)).generate_greedy(small, 2, stop_at_eos=False))
        assert results["small"].json()["choices"][0]["text"] == expected
