"""`kvferry bench chunked`: how long a 2-token request waits behind a long prefill, with chunked prefill
and without, against the same request on an idle engine."""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from kvferry.bench.report import report
from kvferry.engine.engine import Engine, EngineConfig, RequestOutput
from kvferry.engine.request import Request, SamplingParams

LONG_PROMPT = 8192
SHORT_PROMPT = [72, 105]


def _until_finished(done: threading.Event) -> Callable[[RequestOutput], None]:
    return lambda out: done.set() if out.finished else None


def _short_latency(engine: Engine, name: str) -> float:
    done = threading.Event()
    begin = time.monotonic()
    request = Request(name, SHORT_PROMPT, SamplingParams(2, 0.0, None, (), (), True), None, time.time())
    engine.submit(request, _until_finished(done))
    if not done.wait(600):
        raise TimeoutError("short request did not finish")
    return time.monotonic() - begin


def _measure(chunk: int, long_prompt: int, reps: int) -> dict[str, Any]:
    engine = Engine(EngineConfig(num_blocks=long_prompt // 16 + 64, block_size=16, max_prefill_chunk=chunk))
    engine.start()
    try:
        idle = statistics.median(_short_latency(engine, f"idle-{i}") for i in range(reps))
        behind = []
        for i in range(reps):
            long_done = threading.Event()
            ids = np.random.default_rng(i).integers(0, 256, long_prompt).tolist()
            params = SamplingParams(1, 0.0, None, (), (), True)
            engine.submit(Request(f"long-{i}", ids, params, None, time.time()), _until_finished(long_done))
            time.sleep(0.05)  # the long prefill has started
            behind.append(_short_latency(engine, f"behind-{i}"))
            long_done.wait(600)
        waited = statistics.median(behind)
    finally:
        engine.stop()
    return {"max_prefill_chunk": chunk or "off", "long_prompt": long_prompt, "short_idle_s": round(idle, 4),
            "short_behind_long_s": round(waited, 4), "ratio": round(waited / idle, 1)}


def run(json_path: str | None, quick: bool = False) -> list[dict[str, Any]]:
    long_prompt, reps = (2048, 1) if quick else (LONG_PROMPT, 3)
    rows = [_measure(chunk, long_prompt, reps) for chunk in (256, 0)]
    report("kvferry bench chunked: a 2-token request arriving during a long prefill", rows, json_path)
    return rows
