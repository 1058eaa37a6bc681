"""`kvferry bench scheduler`: per-step scheduler overhead (no model) with 0, 1k or 10k requests parked for
remote KV that never arrives; a scheduler that scanned parked requests would show it as growth. The
set-ups are stepped in interleaved rounds, so a noisy neighbour slows them alike."""

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
PARKED = (0, 1_000, 10_000)


class _Setup:
    def __init__(self, parked: int, steps: int) -> None:
        self.parked = parked
        self.connector = ScriptedConnector()
        blocks_per_running = -(-(BLOCK_SIZE + steps + 20) // BLOCK_SIZE)  # they decode every step
        pool = BlockPool(parked + RUNNING * blocks_per_running + 16)
        config = SchedulerConfig(block_size=BLOCK_SIZE, max_num_seqs=RUNNING)
        self.scheduler = Scheduler(config, pool, self.connector)
        for i in range(parked):
            rid = f"parked-{i}"
            self.connector.plan_load(rid, LoadPlan(num_tokens=None, never_finish=True))
            self.scheduler.add_request(Request(rid, [1] * BLOCK_SIZE, SamplingParams(max_tokens=1)))
        for i in range(RUNNING):
            self.scheduler.add_request(Request(f"run-{i}", [2] * BLOCK_SIZE, SamplingParams(max_tokens=10**6)))
        self.durations: list[float] = []
        self.steps(20, record=False)  # admits the parked requests
        assert len(self.scheduler.remote) == parked and len(self.scheduler.running) == RUNNING

    def steps(self, n: int, record: bool = True) -> None:
        s, c = self.scheduler, self.connector
        for _ in range(n):
            t0 = time.perf_counter()
            out = s.schedule()
            c.start_load_kv(c.build_connector_meta(out))
            sampled = {ch.request.request_id: 7 for ch in out.chunks if ch.start_pos + ch.num_tokens == ch.request.num_tokens}
            sending, recving = c.get_finished(out.finished_req_ids)
            s.update(out, sampled, WorkerResult(sending, recving, c.take_load_reports()))
            if record:
                self.durations.append(time.perf_counter() - t0)


def run(json_path: str | None = None, quick: bool = False) -> list[dict[str, Any]]:
    rounds, per_round = (6, 50) if quick else (30, 100)
    setups = [_Setup(parked, rounds * per_round) for parked in PARKED]
    for _ in range(rounds):
        for setup in setups:
            setup.steps(per_round)
    rows = []
    for setup in setups:
        d = sorted(setup.durations)
        assert len(setup.scheduler.remote) == setup.parked and len(setup.scheduler.running) == RUNNING
        rows.append({"parked": setup.parked, "running": RUNNING, "steps": len(d),
                     "median_us": statistics.median(d) * 1e6, "p99_us": d[int(len(d) * 0.99) - 1] * 1e6})
    base = rows[1]["median_us"]
    for row in rows:
        row["x_vs_1k"] = row["median_us"] / base
    report("kvferry bench scheduler: per-step overhead (no model)", rows, json_path)
    return rows
