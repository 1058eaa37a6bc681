"""Slow is not failed: a drain outlives an engine step longer than the engine's snapshot wait (a busy engine is
asked again, only a dead one ends the drain early), and `--drain-timeout` bounds the process's exit even while a
client reads its stream slowly (the stream is cut at the bound, without `[DONE]`)."""

from __future__ import annotations

import asyncio
import json
import os
import queue
import signal
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from kvferry.connector.base import ConnectorMetadata
from kvferry.connector.fake import ScriptedConnector
from kvferry.engine.engine import Engine, EngineConfig
from kvferry.engine.outputs import RequestOutput
from kvferry.engine.request import Request, SamplingParams
from kvferry.serving.drain import Drain
from procs import free_port, running, serve, wait_until

COMMON = ("--seed", "0", "--num-blocks", "1024")
PROMPT = "drain me slowly: " + "kv " * 30
# Prefilled in one step (chunking off), this prompt keeps P's engine thread busy far longer than the 5 s an
# engine snapshot waits, on any CPU this suite runs on (about 14 s on a 2-core test box).
LONG_PROMPT_TOKENS = 12_000
SNAPSHOT_WAIT_S = 5.0  # Engine.snapshot's default wait, which the drain of `kvferry serve` uses


class _GatedConnector(ScriptedConnector):
    """While `gate` is closed, an engine step waits in `start_load_kv`: a step exactly as long as the test
    wants. `fail` makes the step raise instead (an engine bug: the engine thread dies)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.in_step = threading.Event()
        self.fail = False

    def start_load_kv(self, metadata: ConnectorMetadata) -> None:
        self.in_step.set()
        if not self.gate.wait(30):
            raise AssertionError("the test never opened the gate")
        if self.fail:
            raise RuntimeError("injected: the engine step failed")
        super().start_load_kv(metadata)


def _busy_engine() -> tuple[Engine, _GatedConnector]:
    """A started engine whose thread sits in a step until the test opens the gate."""
    connector = _GatedConnector()
    engine = Engine(EngineConfig(num_blocks=16, block_size=16), connector)
    engine.start()
    outputs: queue.Queue[RequestOutput] = queue.Queue()
    engine.submit(Request(f"r-{uuid.uuid4().hex[:6]}", list(range(20)), SamplingParams(max_tokens=2)), outputs.put)
    assert connector.in_step.wait(10), "the engine never started its step"
    return engine, connector


def _drain_through(engine: Engine, asked: list[float], timeout_s: float) -> Drain:
    def snapshot(wait: float = 5.0) -> dict[str, Any]:
        asked.append(time.monotonic())
        return engine.snapshot(min(wait, 0.1))  # the drain waits up to a second; the same path, faster

    return Drain(snapshot, timeout_s=timeout_s)


async def _run_drain(drain: Drain, then: Callable[[], None], asks: list[float], after_asks: int) -> float:
    """Start `drain`; once it asked `after_asks` times (or ended), call `then`; return when the drain ended."""
    done = asyncio.Event()
    drain.on_done = done.set
    drain.start("test")
    deadline = time.monotonic() + 10
    while len(asks) < after_asks and not done.is_set():
        assert time.monotonic() < deadline, "the drain stopped asking"
        await asyncio.sleep(0.01)
    then()
    await asyncio.wait_for(done.wait(), 10)
    return time.monotonic()


def test_a_step_longer_than_the_snapshot_wait_is_busy_not_gone() -> None:
    engine, connector = _busy_engine()
    try:
        asked: list[float] = []
        drain = _drain_through(engine, asked, timeout_s=30)
        opened: list[float] = []
        ended = asyncio.run(_run_drain(drain, lambda: (opened.append(time.monotonic()), connector.gate.set()),
                                       asked, after_asks=4))
        # Four snapshots timed out while the step ran; the drain asked again and ended once the request finished.
        assert drain.outcome == "idle", drain.outcome
        assert len(asked) >= 4 and ended > opened[0]
    finally:
        connector.gate.set()
        engine.stop()


def test_an_engine_that_dies_mid_step_ends_the_drain_at_once() -> None:
    engine, connector = _busy_engine()
    try:
        asked: list[float] = []
        drain = _drain_through(engine, asked, timeout_s=30)

        def die() -> None:
            connector.fail = True
            connector.gate.set()

        ended = asyncio.run(_run_drain(drain, die, asked, after_asks=2))
        assert drain.outcome == "engine gone", drain.outcome
        assert drain.started_at is not None and ended - drain.started_at < 10  # not its 30 s bound
    finally:
        connector.gate.set()
        engine.stop()


def test_a_stopped_engine_ends_the_drain_as_gone() -> None:
    engine = Engine(EngineConfig(num_blocks=16, block_size=16), ScriptedConnector())
    engine.start()
    engine.stop()
    asked: list[float] = []
    drain = _drain_through(engine, asked, timeout_s=30)
    asyncio.run(_run_drain(drain, lambda: None, asked, after_asks=1))
    assert drain.outcome == "engine gone", drain.outcome


def _prefill_body(transfer_id: str) -> dict[str, Any]:
    return {"prompt": PROMPT, "max_tokens": 1, "temperature": 0,
            "kv_transfer_params": {"do_remote_decode": True, "transfer_id": transfer_id}}


def _decode_body(p_info: dict[str, Any], transfer_id: str) -> dict[str, Any]:
    return {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "kv_transfer_params": {
        "do_remote_prefill": True, "transfer_id": transfer_id,
        "remote_engine_id": p_info["engine_id"], "remote_bootstrap_addr": p_info["kv_bootstrap_addr"]}}


@pytest.mark.timeout(300)
def test_sigterm_on_p_during_a_long_step_still_serves_the_prefill_it_holds() -> None:
    p = serve(None, "--role", "prefill", "--bootstrap-port", str(free_port()), "--abort-timeout", "120",
              "--max-prefill-chunk", "0", *COMMON)
    d = serve(None, "--role", "decode", *COMMON)
    with running(p, d, timeout=60):
        info = httpx.get(f"{p.url}/health", timeout=10).json()
        ref = f"ref-{uuid.uuid4()}"
        assert httpx.post(f"{p.url}/v1/completions", json=_prefill_body(ref), timeout=60).status_code == 200
        reference = httpx.post(f"{d.url}/v1/completions", json=_decode_body(info, ref), timeout=60)
        assert reference.status_code == 200, reference.text
        xid = f"held-{uuid.uuid4()}"
        assert httpx.post(f"{p.url}/v1/completions", json=_prefill_body(xid), timeout=60).status_code == 200
        long_body = {"prompt": "x" * LONG_PROMPT_TOKENS, "max_tokens": 1, "temperature": 0}
        result: dict[str, Any] = {}
        long = threading.Thread(target=lambda: result.setdefault("r", httpx.post(
            f"{p.url}/v1/completions", json=long_body, timeout=240)))
        long.start()
        try:
            # P's engine thread is in the long step: /debug/state serves its last published state.
            wait_until(lambda: httpx.get(f"{p.url}/debug/state", timeout=10).json()["stale"], 60,
                       "P's engine to be in its long step")
            os.kill(p.pid, signal.SIGTERM)
            signalled = time.monotonic()
        finally:
            long.join(240)
        busy_s = time.monotonic() - signalled
        assert result["r"].status_code == 200, result["r"].text
        if busy_s < SNAPSHOT_WAIT_S + 1:
            pytest.skip(f"P's long step ended {busy_s:.1f}s after the signal: not longer than the snapshot wait")
        time.sleep(1.0)  # the scenario: D's pull comes 1 s after P's long step (P left at once before)
        assert p.exited() is None, f"P left while it still held a prefill:\n{p.output_tail()}"
        r = httpx.post(f"{d.url}/v1/completions", json=_decode_body(info, xid), timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == reference.json()["choices"][0]["text"]
        assert p.popen.wait(timeout=20) == 0, p.output_tail()
        assert "engine gone" not in p.output_tail()


DRAIN_TIMEOUT_S = 2.0
EXIT_MARGIN_S = 3.0  # what the exit may take past the drain's bound (closing the server, stopping the engine)


@pytest.mark.timeout(120)
def test_drain_timeout_bounds_the_exit_under_a_slow_reader() -> None:
    inst = serve(None, "--role", "both", "--drain-timeout", str(DRAIN_TIMEOUT_S), *COMMON)
    body = {"prompt": PROMPT, "max_tokens": 12_000, "temperature": 0, "ignore_eos": True, "stream": True}
    with running(inst, timeout=60):
        lines: list[str] = []
        failure: list[BaseException] = []
        exited = threading.Event()

        def read() -> None:
            try:
                with httpx.stream("POST", f"{inst.url}/v1/completions", json=body, timeout=60) as r:
                    for line in r.iter_lines():
                        lines.append(line)
                        if not exited.is_set():
                            time.sleep(0.05)  # the slow reader: 20 events a second, far slower than they come
            except httpx.HTTPError as exc:
                failure.append(exc)

        whole: dict[str, httpx.Response] = {}  # a non-streamed answer the engine still computes at the bound
        asker = threading.Thread(target=lambda: whole.setdefault("r", httpx.post(
            f"{inst.url}/v1/completions", json={**body, "stream": False}, timeout=60)))
        reader = threading.Thread(target=read)
        reader.start()
        asker.start()
        try:
            wait_until(lambda: any(line.startswith("data: ") for line in lines), 60, "the stream's first token")
            wait_until(lambda: _running(inst) >= 2, 60, "the non-streamed request to run")
            os.kill(inst.pid, signal.SIGTERM)
            started = time.monotonic()
            try:
                code = inst.popen.wait(timeout=DRAIN_TIMEOUT_S + EXIT_MARGIN_S)
            except Exception:
                pytest.fail(f"still running {DRAIN_TIMEOUT_S + EXIT_MARGIN_S}s after SIGTERM with "
                            f"--drain-timeout {DRAIN_TIMEOUT_S}:\n{inst.output_tail()}")
            took = time.monotonic() - started
        finally:
            exited.set()
            reader.join(60)
            asker.join(60)
        assert code == 0, inst.output_tail()
        assert took >= DRAIN_TIMEOUT_S - 0.5, f"exited {took:.2f}s after SIGTERM: before its in-flight stream's bound"
        # What the client sees: its stream cut short, without `[DONE]` (kvferry's proxy resumes such a stream
        # on another D); every event it did get is whole.
        assert "data: [DONE]" not in lines
        events = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
        assert 0 < len(events) < body["max_tokens"]
        assert all("error" not in e for e in events)
        assert failure and isinstance(failure[0], httpx.RemoteProtocolError), failure
        # An answer that had not started gets the 503 a new request gets (kvferry's proxy retries it elsewhere).
        assert whole["r"].status_code == 503 and whole["r"].json()["error"]["type"] == "draining", whole["r"].text


def _running(inst: Any) -> int:
    state = httpx.get(f"{inst.url}/debug/state", timeout=10).json()
    return int(state["requests_by_status"].get("RUNNING", 0))
