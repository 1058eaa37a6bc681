"""Smoke test of `kvferry bench serve`: tiny model, two concurrency levels, colocated and P/D."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvferry.bench import serve
from kvferry.harness.client import RequestResult


def test_serve_bench_tiny(tmp_path: Path) -> None:
    out = tmp_path / "serve.json"
    plan = serve.ServePlan(concurrencies=(1, 5), output_tokens=6, pool=3, min_requests=3, model="tiny")
    rows = serve.run(str(out), plan=plan)  # raises if an answer differs from its one-at-a-time run
    assert [(r["mode"], r["concurrency"], r["requests"]) for r in rows] == [
        ("colocated", 1, 3), ("disaggregated", 1, 3), ("colocated", 5, 10), ("disaggregated", 5, 10),
    ]
    for row in rows:
        assert row["output_tok_s"] > 0 and row["requests_s"] > 0
        assert row["ttft_p99_ms"] >= row["ttft_p50_ms"] > 0 and row["itl_p50_ms"] > 0
        assert row["bit_identical"] == f"{row['requests']}/{row['requests']}"
    assert json.loads(out.read_text()) == rows


def test_serve_bench_poisson(tmp_path: Path) -> None:
    plan = serve.ServePlan(concurrencies=(3,), output_tokens=4, pool=2, min_requests=4, poisson_rate=50.0, model="tiny")
    rows = serve.run(None, plan=plan)
    assert [r["bit_identical"] for r in rows] == ["6/6", "6/6"]


def test_itl_spreads_a_gap_over_the_tokens_it_brought() -> None:
    result = RequestResult(0, 1, 4, first_token_at=1.0, token_times=[(1.0, 1), (1.5, 2), (2.5, 4)])
    assert result.itl == [0.5, 0.5, 0.5]


def test_client_times_vllm_style_streams_by_their_events() -> None:
    """vLLM sends its headers at once and one event per token without `usage`: TTFT is the first event's
    time, not the headers', and every event counts one token (what `bench serve --vllm` relies on)."""
    import asyncio

    import httpx

    from kvferry.harness.client import WorkItem, run_request

    async def body() -> Any:
        await asyncio.sleep(0.2)  # the first token comes well after the headers
        for text in ("a", "b", "c"):
            yield f'data: {{"choices": [{{"text": "{text}", "finish_reason": null}}]}}\n\n'.encode()
            await asyncio.sleep(0.05)
        yield b'data: {"choices": [{"text": "", "finish_reason": "length"}]}\n\n'
        yield b"data: [DONE]\n\n"

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body())

    async def run() -> RequestResult:
        result = RequestResult(0, 2, 3)
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            await run_request(client, "http://vllm", WorkItem(0, [1, 2], 3), result, 0.0, 10.0)
        return result

    result = asyncio.run(run())
    assert result.outcome == "ok" and result.text == "abc"
    assert result.ttft is not None and result.ttft >= 0.2
    assert [n for _, n in result.token_times] == [1, 2, 3]
    assert len(result.itl) == 2
