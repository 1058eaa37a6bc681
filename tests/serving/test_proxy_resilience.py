"""Issue 13.9 / 13.10 through real processes: the proxy ejects a dead P and retries elsewhere (0 lost
with kill -9 of one of 2 P), and a request that D rejects or the client abandons is cancelled on P at
once (P's blocks free within a second or so, not after P's 30 s abort timeout)."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from procs import Proc, free_port, running, serve, wait_until

COMMON = ("--seed", "0", "--heartbeat-timeout", "3.0")


def _proxy(prefills: list[Proc], decodes: list[Proc], *extra: str) -> Proc:
    port = free_port()
    args = ["proxy", "--port", str(port), *extra]
    for p in prefills:
        args += ["--prefill", p.url]
    for d in decodes:
        args += ["--decode", d.url]
    return Proc(args, f"http://127.0.0.1:{port}")


def _prefill(*extra: str) -> Proc:
    return serve(None, "--role", "prefill", "--bootstrap-port", str(free_port()), *COMMON, *extra)


def _all_free(proc: Proc) -> bool:
    """Every block free, by a fresh snapshot (a stale one predates the step in progress)."""
    state = httpx.get(f"{proc.url}/debug/state", timeout=10).json()
    return not state["stale"] and state["blocks_free"] == state["blocks_total"]


def _finished(proc: Proc) -> dict[str, float]:
    prefix = "kvferry_requests_finished_total{reason=\""
    lines = httpx.get(f"{proc.url}/metrics", timeout=10).text.splitlines()
    return {ln[len(prefix):].split('"')[0]: float(ln.split()[-1]) for ln in lines if ln.startswith(prefix)}


@pytest.mark.timeout(240)
def test_kill_9_of_one_of_two_prefills_loses_no_request() -> None:
    p1, p2 = _prefill("--num-blocks", "512"), _prefill("--num-blocks", "512")
    d = serve(None, "--role", "decode", "--num-blocks", "512", *COMMON)
    proxy = _proxy([p1, p2], [d])
    statuses: list[int] = []
    done = threading.Event()

    def one(i: int) -> int:
        body = {"prompt": f"request {i}: " + "kv " * 40, "max_tokens": 8, "temperature": 0}
        r = httpx.post(f"{proxy.url}/v1/completions", json=body, timeout=120)
        statuses.append(r.status_code)
        return r.status_code

    with running(p1, p2, d, proxy, timeout=60):
        with ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(one, i) for i in range(50)]
            wait_until(lambda: len(statuses) >= 10, 120, "10 requests answered")
            os.kill(p1.pid, signal.SIGKILL)
            results = [f.result() for f in futures]
            done.set()
        health = httpx.get(f"{proxy.url}/health", timeout=10).json()
    assert results.count(200) == 50, f"lost {50 - results.count(200)} of 50: {sorted(set(results))}"
    assert p1.url in health["ejected"]


@pytest.fixture()
def pd_small_decode() -> Iterator[tuple[Proc, Proc, Proc]]:
    # D's pool (64 blocks = 1,024 tokens) turns long prompts away; P's (1,024 blocks) takes them.
    p = _prefill("--num-blocks", "1024")
    d = serve(None, "--role", "decode", "--num-blocks", "64", *COMMON)
    proxy = _proxy([p], [d])
    with running(p, d, proxy, timeout=60):
        yield p, d, proxy


HUGE_PROMPT = list(range(3, 253)) * 64  # 16,000 tokens: seconds of prefill on P


@pytest.mark.timeout(180)
def test_request_rejected_by_decode_is_cancelled_on_prefill(pd_small_decode: tuple[Proc, Proc, Proc]) -> None:
    p, _, proxy = pd_small_decode
    r = httpx.post(f"{proxy.url}/v1/completions", json={"prompt": HUGE_PROMPT, "max_tokens": 4}, timeout=60)
    answered = time.monotonic()
    assert r.status_code == 400 and "KV blocks" in r.json()["error"]["message"], r.text
    # P was prefilling it (chunk by chunk): it drops it after the chunk in progress instead of finishing
    # the prefill (and holding the blocks until D's release arrives).
    wait_until(lambda: _all_free(p), 60, "P's blocks free")
    print(f"P freed its blocks {time.monotonic() - answered:.2f}s after D's 400")
    assert _finished(p) == {"abort": 1.0}  # dropped, not prefilled to the end ("length")


@pytest.mark.timeout(180)
def test_client_gone_cancels_both_sides() -> None:
    p = _prefill("--num-blocks", "1024")
    d = serve(None, "--role", "decode", "--num-blocks", "1024", *COMMON)
    proxy = _proxy([p], [d])
    with running(p, d, proxy, timeout=60):
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{proxy.url}/v1/completions", json={"prompt": HUGE_PROMPT, "max_tokens": 64},
                       timeout=httpx.Timeout(1.0, connect=5.0))
        left = time.monotonic()
        for proc in (p, d):
            wait_until(lambda proc=proc: _all_free(proc), 60, f"{proc.url} blocks free")
        print(f"blocks free {time.monotonic() - left:.2f}s after the client left")
        assert _finished(p) == {"abort": 1.0} and _finished(d) == {"abort": 1.0}
        metrics = httpx.get(f"{proxy.url}/metrics", timeout=10).text
        assert 'kvferry_proxy_requests_total{outcome="client_gone"} 1.0' in metrics


@pytest.mark.timeout(180)
def test_client_gone_after_prefill_answered_frees_both_sides() -> None:
    # P answers its prefill at once, then sits 30 s on the write for D's pull: the client leaves in between.
    p = _prefill("--num-blocks", "256", "--faults", "slow=30000")
    d = serve(None, "--role", "decode", "--num-blocks", "256", *COMMON)
    proxy = _proxy([p], [d])
    with running(p, d, proxy, timeout=60):
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{proxy.url}/v1/completions", json={"prompt": list(range(5, 200)), "max_tokens": 8},
                       timeout=httpx.Timeout(3.0, connect=5.0))
        left = time.monotonic()
        assert _finished(p) == {"length": 1.0}, "P's prefill was answered before the client left"
        for proc in (p, d):
            wait_until(lambda proc=proc: _all_free(proc), 25, f"{proc.url} blocks free")
        print(f"blocks free {time.monotonic() - left:.2f}s after the client left (P's write was slowed 30 s)")
        assert _finished(d) == {"abort": 1.0}


@pytest.mark.timeout(240)
def test_decode_restarts_under_load_leave_the_proxy_no_sockets() -> None:
    """Every D restart breaks requests in flight; the proxy cancels their P requests. Before P's requests
    had connections of their own, each cancel could leave a socket open outside httpx's pool (fds 16 -> 29
    over 3 restarts, never reclaimed): the soak's growing proxy fds."""
    p = _prefill("--num-blocks", "256")
    d_port = free_port()
    d = serve(d_port, "--role", "decode", "--num-blocks", "256", *COMMON)
    proxy = _proxy([p], [d])
    stop = threading.Event()
    answered: list[int] = []

    def load() -> None:
        with httpx.Client(timeout=60) as client:
            while not stop.is_set():
                body = {"prompt": "restart " * 30, "max_tokens": 8, "temperature": 0, "stream": True}
                with contextlib.suppress(httpx.HTTPError):
                    answered.append(client.post(f"{proxy.url}/v1/completions", json=body).status_code)

    def wait_for_answers(n: int) -> None:
        target = len(answered) + n
        wait_until(lambda: len(answered) >= target, 60, f"{n} more answers")

    def proxy_fds() -> int:
        return len(os.listdir(f"/proc/{proxy.pid}/fd"))

    restarted: list[Proc] = []
    try:
        with running(p, d, proxy, timeout=60):
            wait_until(lambda: httpx.get(f"{proxy.url}/health", timeout=5).status_code == 200, 30, "proxy")
            before = proxy_fds()
            threads = [threading.Thread(target=load) for _ in range(3)]
            for t in threads:
                t.start()
            for _ in range(4):
                wait_for_answers(20)
                os.kill(d.pid, signal.SIGKILL)
                d.popen.wait(timeout=10)
                d = serve(d_port, "--role", "decode", "--num-blocks", "256", *COMMON)
                restarted.append(d)
                d.wait_healthy(60)
            wait_for_answers(20)
            stop.set()
            for t in threads:
                t.join(timeout=60)
            # Idle pooled connections the instances closed are dropped on the next request: one more.
            httpx.post(f"{proxy.url}/v1/completions", json={"prompt": "x", "max_tokens": 1}, timeout=60)
            print(f"proxy fds {before} -> {proxy_fds()} over 4 D restarts, {len(answered)} answers")
            # What stays: httpx's pool, one connection per concurrent request to D (3) plus /health probes.
            assert proxy_fds() <= before + 8, (before, proxy_fds())
    finally:
        stop.set()
        for proc in restarted:
            proc.stop()


@pytest.mark.timeout(120)
def test_kv_load_retries_on_the_only_prefill_back_off() -> None:
    """Issue 32.7: with one P, a KV-load failure is retried on that same P after a backoff (0.25, 0.5,
    1 s ...), so a P paused for a few seconds gets its next try after the pause, not three within it."""
    p = _prefill("--num-blocks", "256", "--faults", "error_reply=1.0")
    d = serve(None, "--role", "decode", "--num-blocks", "256", *COMMON)
    proxy = _proxy([p], [d], "--retries", "3")
    with running(p, d, proxy, timeout=60):
        started = time.monotonic()
        r = httpx.post(f"{proxy.url}/v1/completions", json={"prompt": "retry me", "max_tokens": 4}, timeout=60)
        took = time.monotonic() - started
    assert r.status_code == 500 and r.json()["error"]["code"] == "error_reply"
    assert r.headers["x-kvferry-attempts"] == "4"
    assert took >= 0.25 + 0.5 + 1.0, f"4 attempts in {took:.2f}s: no backoff between retries on the same P"
