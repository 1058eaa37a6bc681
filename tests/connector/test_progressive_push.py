"""Progressive push through real processes: while P's chunked prefill of a long prompt is still running,
D's parked pull already gets the blocks P completed, so only the last chunk's blocks move after the
prefill. The answer stays token-identical to the colocated one; a P killed or frozen after some partial
writes fails D's request with `peer_dead` under `fail`, and under `recompute` costs a local prefill of
only the blocks that did not arrive with P's checksums; a transport break or a corrupt block in a partial write ends with its cause; a D that dies
(its lease lapses) or whose client leaves mid-prefill costs P nothing; nothing leaks anywhere."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import threading
import uuid
from typing import Any

import httpx
import pytest

from kvferry.engine.model import ModelConfig, TinyLlama
from kvferry.engine.tokenizer import decode
from procs import Proc, free_port, running, serve, wait_until

MODEL = TinyLlama(ModelConfig(seed=0))
COMMON = ("--num-blocks", "512", "--seed", "0", "--max-prefill-chunk", "64")
LONG = 1200  # tokens: ~19 chunks of 64, over a second of prefill on the tiny model


def prompt(n: int, salt: int) -> list[int]:
    return [(i * 31 + salt * 7 + 3) % 256 for i in range(n)]


def reference(ids: list[int], max_tokens: int) -> str:
    return decode(MODEL.generate_greedy(ids, max_tokens, stop_at_eos=False))


def metric(proc: Proc, name: str) -> float:
    text = httpx.get(f"{proc.url}/metrics", timeout=10).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


def clean(proc: Proc) -> bool:
    state = httpx.get(f"{proc.url}/debug/state", timeout=10).json()
    return bool(state["blocks_free"] == state["blocks_total"] and not state["pending_pulls"]
                and not state["pending_sends"] and not state["requests_by_status"])


class PD:
    """P and D started alone; each request goes to both at once, as the proxy sends it (the proxy is left
    out: a P killed mid-prefill would make it answer for P, and the test is about what D answers)."""

    def __init__(self, p_args: tuple[str, ...] = (), d_args: tuple[str, ...] = ()) -> None:
        self.p = serve(None, "--role", "prefill", "--bootstrap-port", str(free_port()), *COMMON, *p_args)
        self.d = serve(None, "--role", "decode", *COMMON, *d_args)
        self.info: dict[str, Any] = {}

    def ask(self, ids: list[int], max_tokens: int = 6) -> tuple[list[httpx.Response], threading.Thread]:
        """Sends the request to P and D at once; D's answer lands in the list when the thread ends."""
        p_body, d_body = self.bodies(ids, max_tokens)
        self.to_p(p_body)
        out: list[httpx.Response] = []

        def post() -> None:
            with contextlib.suppress(httpx.HTTPError):  # a killed D never answers: `answer` says so
                out.append(httpx.post(f"{self.d.url}/v1/completions", json=d_body, timeout=60))

        thread = threading.Thread(target=post, daemon=True)
        thread.start()
        return out, thread

    def bodies(self, ids: list[int], max_tokens: int) -> tuple[dict[str, Any], dict[str, Any]]:
        tid = f"pp-{uuid.uuid4()}"
        body = {"prompt": ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        p_body = {**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True, "transfer_id": tid}}
        d_body = {**body, "kv_transfer_params": {"do_remote_prefill": True, "transfer_id": tid,
                                                 "remote_engine_id": self.info["engine_id"],
                                                 "remote_bootstrap_addr": self.info["kv_bootstrap_addr"]}}
        return p_body, d_body

    def to_p(self, p_body: dict[str, Any]) -> None:
        def post() -> None:
            with contextlib.suppress(httpx.HTTPError):  # a killed P never answers: D's is what the test reads
                httpx.post(f"{self.p.url}/v1/completions", json=p_body, timeout=60)

        threading.Thread(target=post, daemon=True).start()

    def __enter__(self) -> PD:
        self._running = running(self.p, self.d)
        self._running.__enter__()
        self.info = httpx.get(f"{self.p.url}/health", timeout=10).json()
        return self

    def __exit__(self, *exc: object) -> None:
        self._running.__exit__(None, None, None)


def answer(out: list[httpx.Response], thread: threading.Thread) -> httpx.Response:
    thread.join(timeout=60)
    assert out, "D never answered"
    return out[0]


def test_blocks_move_while_p_still_prefills_and_the_answer_is_colocated() -> None:
    ids = prompt(LONG, 1)
    with PD() as pd:
        r = answer(*pd.ask(ids))
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == reference(ids, 6)
        assert r.json()["kvferry"]["recomputed_tokens"] == 0
        assert metric(pd.p, "kvferry_progressive_writes_total") >= 1  # bytes reached D before the prefill ended
        # A prompt that fits one step is pushed as before: once, after its prefill.
        before = metric(pd.p, "kvferry_progressive_writes_total")
        short = prompt(60, 2)
        r = answer(*pd.ask(short))
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == reference(short, 6), r.text
        assert metric(pd.p, "kvferry_progressive_writes_total") == before
        wait_until(lambda: clean(pd.p) and clean(pd.d), 10, "P and D back to full pools")


def test_no_progressive_push_writes_once_after_the_prefill() -> None:
    ids = prompt(LONG, 3)
    with PD(p_args=("--no-progressive-push",)) as pd:
        r = answer(*pd.ask(ids))
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == reference(ids, 6), r.text
        assert metric(pd.p, "kvferry_progressive_writes_total") == 0
        wait_until(lambda: clean(pd.p) and clean(pd.d), 10, "P and D back to full pools")


@pytest.mark.parametrize("policy", ["fail", "recompute"])
@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGSTOP], ids=["kill-9", "SIGSTOP"])
def test_p_killed_or_frozen_mid_prefill_after_partial_writes(how: signal.Signals, policy: str) -> None:
    ids = prompt(2 * LONG, 4)  # a longer prefill: the signal lands well before its end
    with PD(d_args=("--kv-load-failure-policy", policy)) as pd:
        out, thread = pd.ask(ids)
        # The third part starts after the first one's answer (its checksums) went out and the second ended.
        wait_until(lambda: partial_writes(pd.p) >= 3, 30, "three partial writes")
        os.kill(pd.p.pid, how)
        r = answer(out, thread)
        if policy == "fail":
            assert r.status_code == 500, r.text
            assert r.json()["error"]["code"] == "peer_dead", r.text
        else:
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == reference(ids, 6)
            # Only what did not arrive with P's checksums is computed again: the pushed blocks are kept.
            assert 0 < r.json()["kvferry"]["recomputed_tokens"] < len(ids) - 16, r.json()["kvferry"]
        wait_until(lambda: clean(pd.d), 10, "D back to a full pool")


def partial_writes(p: Proc) -> float:
    return metric(p, "kvferry_progressive_writes_total")


def test_d_killed_mid_prefill_costs_p_nothing() -> None:
    """D dies after P's first partial writes: its lease lapses (or a write to it fails), P's prefill ends
    into a transfer nobody will pull, and P's pool is full again."""
    ids = prompt(2 * LONG, 6)
    with PD() as pd:
        pd.ask(ids)
        wait_until(lambda: partial_writes(pd.p) >= 1, 30, "a partial write")
        os.kill(pd.d.pid, signal.SIGKILL)
        wait_until(lambda: clean(pd.p), 60, "P back to a full pool")


def test_client_leaving_d_mid_prefill_ends_the_transfer_on_both_sides() -> None:
    """D's client hangs up while P still prefills: D aborts the request and lets P go; both pools fill
    again, and the next request is served as usual."""
    ids = prompt(2 * LONG, 7)
    with PD() as pd:
        p_body, d_body = pd.bodies(ids, 6)
        pd.to_p(p_body)
        host, port = pd.d.url.removeprefix("http://").rsplit(":", 1)
        raw = json.dumps(d_body).encode()
        with socket.create_connection((host, int(port))) as client:
            client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: d\r\nContent-Type: application/json\r\n"
                           b"Content-Length: %d\r\n\r\n%s" % (len(raw), raw))
            wait_until(lambda: partial_writes(pd.p) >= 1, 30, "a partial write")
        wait_until(lambda: clean(pd.p) and clean(pd.d), 60, "P and D back to full pools")
        short = prompt(LONG, 8)
        r = answer(*pd.ask(short))
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == reference(short, 6), r.text


@pytest.mark.parametrize(("fault", "cause"), [("transport", "transport"), ("corrupt", "checksum")])
@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_a_broken_partial_write_ends_with_its_cause(fault: str, cause: str, policy: str) -> None:
    ids = prompt(LONG, 5)
    with PD(p_args=("--faults", f"{fault}=1"), d_args=("--kv-load-failure-policy", policy)) as pd:
        r = answer(*pd.ask(ids))
        assert metric(pd.p, "kvferry_progressive_writes_total") >= 1
        if policy == "fail":
            assert r.status_code == 500 and r.json()["error"]["code"] == cause, r.text
        else:
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == reference(ids, 6), r.text
            # Only what did not arrive intact is computed again: the blocks before the break stay.
            assert 0 < r.json()["kvferry"]["recomputed_tokens"] < len(ids)
        wait_until(lambda: clean(pd.p) and clean(pd.d), 10, "P and D back to full pools")
