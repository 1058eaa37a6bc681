"""Issue 32.3: a rolling restart under load loses nothing. proxy + 2 P + 2 D, 6 client threads sending a
steady stream; every instance in turn gets SIGTERM (it drains and exits 0) and starts again at the same
ports. Every request is answered 200 with the fault-free text, every pool is whole afterwards, and each
restarted instance serves again (the proxy took it out of rotation and back without a restart)."""

from __future__ import annotations

import os
import signal
import threading
from collections import Counter

import httpx
import pytest

from procs import Proc, free_port, running, serve, wait_until

COMMON = ("--seed", "0", "--num-blocks", "512", "--heartbeat-timeout", "3.0")
PROMPTS = [f"rolling {i}: " + "kv " * (8 + 5 * i) for i in range(6)]
MIN_REQUESTS = 300


def _finished(proc: Proc) -> float:
    try:
        text = httpx.get(f"{proc.url}/metrics", timeout=5).text
    except httpx.HTTPError:
        return 0.0
    return sum(float(ln.split()[-1]) for ln in text.splitlines() if ln.startswith("kvferry_requests_finished_total{"))


def _whole(proc: Proc) -> bool:
    state = httpx.get(f"{proc.url}/debug/state", timeout=10).json()
    return not state["stale"] and state["blocks_free"] == state["blocks_total"]


@pytest.mark.timeout(420)
def test_rolling_restart_of_every_instance_under_load_loses_no_request() -> None:
    p_args = [("--role", "prefill", "--bootstrap-port", str(free_port())) for _ in range(2)]
    ports = [free_port() for _ in range(4)]
    args = [*p_args, ("--role", "decode"), ("--role", "decode")]
    procs = [serve(port, *a, *COMMON) for port, a in zip(ports, args, strict=True)]
    proxy_port = free_port()
    proxy = Proc(["proxy", "--port", str(proxy_port), "--prefill", procs[0].url, "--prefill", procs[1].url,
                  "--decode", procs[2].url, "--decode", procs[3].url, "--health-interval", "0.5"],
                 f"http://127.0.0.1:{proxy_port}")
    results: list[tuple[int, int, str]] = []
    stop = threading.Event()

    def client(k: int) -> None:
        with httpx.Client(timeout=120) as http:
            i = k
            while not stop.is_set():
                body = {"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": 8, "temperature": 0}
                r = http.post(f"{proxy.url}/v1/completions", json=body)
                text = r.json()["choices"][0]["text"] if r.status_code == 200 else r.text
                results.append((i % len(PROMPTS), r.status_code, text))
                i += 1

    restarted: list[Proc] = []
    try:
        with running(*procs, proxy, timeout=60):
            reference = {}
            for i, prompt in enumerate(PROMPTS):
                r = httpx.post(f"{proxy.url}/v1/completions", json={"prompt": prompt, "max_tokens": 8,
                                                                   "temperature": 0}, timeout=60)
                assert r.status_code == 200, r.text
                reference[i] = r.json()["choices"][0]["text"]
            threads = [threading.Thread(target=client, args=(k,)) for k in range(6)]
            for t in threads:
                t.start()
            try:
                for n, port in enumerate(ports):
                    wait_until(lambda n=n: len(results) >= (n + 1) * 40, 120, "requests flowing before the restart")
                    old = procs[n]
                    os.kill(old.pid, signal.SIGTERM)
                    code = old.popen.wait(timeout=60)
                    assert code == 0, f"{args[n][1]} {n} exited {code}: {old.output_tail()}"
                    new = serve(port, *args[n], *COMMON)
                    restarted.append(new)
                    new.wait_healthy(60)
                    procs[n] = new
                    wait_until(lambda new=new: _finished(new) > 0, 60, f"restarted {args[n][1]} {n} to serve again")
                wait_until(lambda: len(results) >= MIN_REQUESTS, 180, f"{MIN_REQUESTS} requests answered")
            finally:
                stop.set()
                for t in threads:
                    t.join(120)
            statuses = Counter(status for _, status, _ in results)
            wrong = [(i, text) for i, status, text in results if status == 200 and text != reference[i]]
            assert statuses == {200: len(results)}, f"lost requests: {statuses}; e.g. " + str(
                next((text for _, s, text in results if s != 200), ""))[:500]
            assert not wrong, f"{len(wrong)} answers differ from the fault-free text"
            assert len(results) >= MIN_REQUESTS
            for proc in procs:
                wait_until(lambda proc=proc: _whole(proc), 30, f"{proc.url}'s pool whole")
    finally:
        for proc in restarted:
            proc.stop()
