"""`kvferry bench scheduler`: per-step scheduler overhead with many requests parked for remote KV.

The step here is everything the engine does per step except the model: schedule, connector metadata,
worker report, update. A few requests keep decoding while 0, 1k or 10k wait for remote KV that never
arrives; a scheduler that scans parked requests would show it as growth.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from kvferry.bench.report import report
from kvferry.connector.fake import LoadPlan, ScriptedConnector
from kvferry.engine.block_pool import BlockPool
from kvferry.engine.request import Request, SamplingParams
from kvferry.engine.scheduler import Scheduler, SchedulerConfig, WorkerResult

RUNNING = 8
BLOCK_SIZE = 16


def measure(parked: int, steps: int) -> dict[str, Any]:
    connector = ScriptedConnector()
    blocks_per_running = -(-(BLOCK_SIZE + steps + 20) // BLOCK_SIZE)  # they decode every step
    pool = BlockPool(parked + RUNNING * blocks_per_running + 16)
    scheduler = Scheduler(SchedulerConfig(block_size=BLOCK_SIZE, max_num_seqs=RUNNING), pool, connector)
    for i in range(parked):
        rid = f"parked-{i}"
        connector.plan_load(rid, LoadPlan(num_tokens=None, never_finish=True))
        scheduler.add_request(Request(rid, [1] * BLOCK_SIZE, SamplingParams(max_tokens=1)))
    for i in range(RUNNING):
        scheduler.add_request(Request(f"run-{i}", [2] * BLOCK_SIZE, SamplingParams(max_tokens=10**6)))
    durations = []
    for _ in range(steps + 20):
        t0 = time.perf_counter()
        out = scheduler.schedule()
        connector.start_load_kv(connector.build_connector_meta(out))
        sampled = {c.request.request_id: 7 for c in out.chunks if c.start_pos + c.num_tokens == c.request.num_tokens}
        sending, recving = connector.get_finished(out.finished_req_ids)
        result = WorkerResult(sending, recving, connector.get_block_ids_with_load_errors(), connector.get_failure_causes())
        scheduler.update(out, sampled, result)
        durations.append(time.perf_counter() - t0)
    assert len(scheduler.remote) == parked and len(scheduler.running) == RUNNING
    steady = sorted(durations[20:])  # the first steps admit the parked requests
    return {
        "parked": parked,
        "running": RUNNING,
        "steps": steps,
        "median_us": statistics.median(steady) * 1e6,
        "p99_us": steady[int(len(steady) * 0.99) - 1] * 1e6,
    }


def run(json_path: str | None = None, quick: bool = False) -> list[dict[str, Any]]:
    steps = 300 if quick else 3000
    rows = [measure(parked, steps) for parked in (0, 1_000, 10_000)]
    base = rows[1]["median_us"]
    for row in rows:
        row["x_vs_1k"] = row["median_us"] / base
    report("kvferry bench scheduler: per-step overhead (no model)", rows, json_path)
    return rows
