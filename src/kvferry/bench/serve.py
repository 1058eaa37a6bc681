"""`kvferry bench serve`: throughput and latency under concurrent load, colocated and P/D.

Closed loop (at most `concurrency` in flight) or, with `--poisson RATE`, Poisson arrivals. Every answer
must be bit-identical to a one-at-a-time greedy run of its prompt, or the bench raises: that is what
batched decoding must not change."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from kvferry.bench.report import ms, report
from kvferry.bench.vllm import load as vllm_load
from kvferry.bench.vllm.servers import export_model
from kvferry.harness.client import RequestResult, WorkItem, new_results, percentile, run_request, run_workload
from kvferry.harness.sampler import require_drained
from kvferry.harness.system import PDSystem, PDSystemConfig

SEED = 0
BLOCK_SIZE = 16
CONCURRENCIES = (1, 4, 16, 64)
PROMPT_TOKENS = (32, 160)  # prompt lengths drawn uniformly from this range
REQUEST_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class ServePlan:
    concurrencies: tuple[int, ...] = CONCURRENCIES
    output_tokens: int = 32
    pool: int = 16  # distinct prompts
    min_requests: int = 8  # per level: max(min_requests, 2 * concurrency)
    poisson_rate: float | None = None  # requests/s; None = closed loop
    model: str = "smollm2"
    vllm: bool = False  # also vLLM's client against kvferry, and `vllm serve` under both (vllm/load.py)

    def requests(self, concurrency: int) -> int:
        return max(self.min_requests, 2 * concurrency)


QUICK = ServePlan(concurrencies=(1, 4), output_tokens=8, pool=4, min_requests=4)


def prompt_pool(count: int, seed: int = SEED) -> list[list[int]]:
    rng = random.Random(f"kvferry-serve-{seed}")
    return [[rng.randrange(256) for _ in range(rng.randint(*PROMPT_TOKENS))] for _ in range(count)]


async def _poisson(url: str, items: Sequence[WorkItem], results: Sequence[RequestResult], t0: float,
                   concurrency: int, rate: float, seed: int) -> None:
    """Request i is sent at the i-th arrival of a Poisson process (then waits for a slot)."""
    rng = random.Random(seed)
    semaphore = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 2, max_keepalive_connections=concurrency + 2)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0), limits=limits) as client:

        async def one(item: WorkItem, result: RequestResult, at: float) -> None:
            await asyncio.sleep(max(0.0, at - (time.monotonic() - t0)))
            async with semaphore:
                await run_request(client, url, item, result, t0, REQUEST_TIMEOUT_S)

        at, tasks = 0.0, []
        for item, result in zip(items, results, strict=True):
            at += rng.expovariate(rate)
            tasks.append(one(item, result, at))
        await asyncio.gather(*tasks)


def run_level(url: str, mode: str, concurrency: int, plan: ServePlan, pool: list[list[int]]) -> tuple[dict[str, Any], list[RequestResult]]:
    items = [WorkItem(i, pool[i % len(pool)], plan.output_tokens) for i in range(plan.requests(concurrency))]
    results = new_results(items)
    t0 = time.monotonic()
    if plan.poisson_rate:
        asyncio.run(_poisson(url, items, results, t0, concurrency, plan.poisson_rate, SEED + concurrency))
    else:
        asyncio.run(run_workload(url, items, results, t0, concurrency, REQUEST_TIMEOUT_S))
    bad = [r for r in results if r.outcome != "ok"]
    if bad:
        raise RuntimeError(f"{mode} at concurrency {concurrency}: {len(bad)} requests not ok, first: {bad[0].as_dict()}")
    begin = min(r.sent_at or 0.0 for r in results)
    wall = max(r.finished_at or 0.0 for r in results) - begin
    tokens = sum(r.token_times[-1][1] if r.token_times else 0 for r in results)
    ttft = [r.ttft for r in results if r.ttft is not None]
    itl = [gap for r in results for gap in r.itl]
    row = {"mode": mode, "concurrency": concurrency, "requests": len(results), "output_tok_s": tokens / wall,
           "requests_s": len(results) / wall, "ttft_p50_ms": ms(percentile(ttft, 50)),
           "ttft_p99_ms": ms(percentile(ttft, 99)), "itl_p50_ms": ms(percentile(itl, 50)),
           "itl_p99_ms": ms(percentile(itl, 99)), "bit_identical": None}
    return row, results


def _vllm_client(venv: Any, url: str, mode: str, concurrency: int, plan: ServePlan, tokenizer: str, workdir: str,
                 served_name: str | None = None) -> dict[str, Any]:
    mean_prompt = sum(PROMPT_TOKENS) // 2
    return vllm_load.vllm_client_row(venv, url, served_name or plan.model, tokenizer, mode, concurrency,
                                     plan.requests(concurrency), mean_prompt, plan.output_tokens, workdir)


def references(plan: ServePlan, pool: list[list[int]]) -> list[str]:
    from kvferry.engine.loader import load_model

    loaded = load_model(plan.model, SEED)
    return [loaded.codec.decode(loaded.model.generate_greedy(p, plan.output_tokens, stop_at_eos=False)) for p in pool]


def run(json_path: str | None = None, quick: bool = False, *, plan: ServePlan | None = None) -> list[dict[str, Any]]:
    plan = plan or (QUICK if quick else ServePlan())
    pool = prompt_pool(plan.pool)
    # Every request of the widest level holds its prompt + output at once, with room to spare.
    num_blocks = 2 * max(plan.concurrencies) * (-(-(PROMPT_TOKENS[1] + plan.output_tokens) // BLOCK_SIZE)) + 64
    pd = PDSystem(PDSystemConfig(seed=SEED, policy="fail", num_blocks=num_blocks, block_size=BLOCK_SIZE,
                                 serve_args=("--model", plan.model), abort_timeout=REQUEST_TIMEOUT_S,
                                 kv_load_deadline=REQUEST_TIMEOUT_S, colocated=True, health_timeout=180.0))
    rows: list[dict[str, Any]] = []
    answers: list[tuple[dict[str, Any], list[RequestResult]]] = []  # kvferry's
    vllm_answers: list[tuple[dict[str, Any], list[RequestResult]]] = []
    scratch = vllm_load.workdir() if plan.vllm else None
    venv = vllm_load.vllm_venv() if plan.vllm else None
    try:
        model_dir = export_model(plan.model, scratch.name) if scratch is not None else ""
        pd.start()
        colocated = pd.colocated
        for url in (colocated.url, pd.proxy.url):  # warm-up: connections, first allocations, D's first pull
            run_level(url, "warm-up", 2, ServePlan(output_tokens=2, min_requests=2, model=plan.model), pool[:2])
        for concurrency in plan.concurrencies:
            for mode, url in (("colocated", colocated.url), ("disaggregated", pd.proxy.url)):
                row, results = run_level(url, mode, concurrency, plan, pool)
                rows.append(row)
                answers.append((row, results))
                if venv is not None and scratch is not None:
                    rows.append(_vllm_client(venv, url, mode, concurrency, plan, model_dir, scratch.name))
        require_drained({"P": pd.prefill.url, "D": pd.decode.url, "colocated": colocated.url}, 30)
        pd.stop()
        if venv is not None and scratch is not None:  # after kvferry stopped: the engines never share cores
            with vllm_load.VllmServe(venv, model_dir, max(plan.concurrencies)) as vllm:
                run_level(vllm.url, "warm-up", 2, ServePlan(output_tokens=2, min_requests=2, model=plan.model), pool[:2])
                for concurrency in plan.concurrencies:
                    row, results = run_level(vllm.url, "vllm serve", concurrency, plan, pool)
                    rows.append(row)
                    vllm_answers.append((row, results))
                    rows.append(_vllm_client(venv, vllm.url, "vllm serve", concurrency, plan, model_dir,
                                             scratch.name, served_name=model_dir))
    finally:
        pd.stop()
        if scratch is not None:
            scratch.cleanup()
    expected = references(plan, pool)
    mismatches = []
    for row, results in answers:
        wrong = [r.index for r in results if r.text != expected[r.index % len(pool)]]
        row["bit_identical"] = f"{len(results) - len(wrong)}/{len(results)}"
        mismatches += [(row["mode"], row["concurrency"], i) for i in wrong]
    for row, results in vllm_answers:  # another engine's numerics: for information, never required
        same = sum(r.text == expected[r.index % len(pool)] for r in results)
        row["bit_identical"] = f"n/a ({same}/{len(results)} same text as kvferry)"
    arrivals = f"Poisson {plan.poisson_rate:g} req/s" if plan.poisson_rate else "closed loop"
    report(f"kvferry bench serve: {plan.model}, {plan.output_tokens} output tokens per request, {arrivals}, "
           f"answers vs one-at-a-time greedy", rows, json_path)
    if mismatches:
        raise RuntimeError(f"{len(mismatches)} answers differ from their one-at-a-time run: {mismatches[:10]}")
    return rows
