"""`kvferry bench e2e`: TTFT and inter-token latency, colocated vs disaggregated (proxy + P + D).

The same prompts go to both modes in turn (so a slow moment hits both), streamed, greedy; outputs must
be identical and every KV block freed afterwards, or the bench raises. TTFT is the time to the response
headers (sent with the first token); transfer_ms and p_write_ms are per-request deltas of D's and P's
`kvferry_kv_transfer_seconds`."""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvferry.bench.report import ms, report
from kvferry.harness.client import CompletionStream, percentile, spread_itl, stream_body
from kvferry.harness.sampler import MetricSnapshot, get_metrics, require_drained
from kvferry.harness.system import PDSystem, PDSystemConfig

OUTPUT_TOKENS = 16
SEED = 0
NUM_BLOCKS = 1024  # one 8k prompt + output on each instance, with room to spare
BLOCK_SIZE = 16
REQUEST_TIMEOUT_S = 120.0
# (prompt tokens, repetitions) per mode; 8k prefills take seconds on one core, so few of them.
FULL_PLAN = ((128, 30), (2048, 10), (8192, 3))
QUICK_PLAN = ((128, 5), (2048, 2), (8192, 1))

_SECONDS_SUM = "kvferry_kv_transfer_seconds_sum"
_SECONDS_COUNT = "kvferry_kv_transfer_seconds_count"
_BYTES = "kvferry_kv_transfer_bytes_total"


@dataclass
class Measured:
    ttft_s: float
    itl_s: list[float]  # one value per output token after the first
    text: str
    completion_tokens: int


@dataclass
class Series:
    ttft_s: list[float] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)
    transfer_s: list[float] = field(default_factory=list)  # D's histogram delta per request
    p_write_s: list[float] = field(default_factory=list)  # P's histogram delta per request
    kv_bytes: list[float] = field(default_factory=list)


def prompts(length: int, count: int, seed: int = SEED, bench: str = "e2e") -> list[list[int]]:
    rng = random.Random(f"kvferry-{bench}-{seed}-{length}")
    return [[rng.randrange(256) for _ in range(length)] for _ in range(count)]


def stream_completion(client: httpx.Client, url: str, prompt: list[int], max_tokens: int) -> Measured:
    """A streaming greedy completion; raises on anything but a complete HTTP 200 stream."""
    stream = CompletionStream(time.perf_counter)
    sent = time.perf_counter()
    with client.stream("POST", f"{url}/v1/completions", json=stream_body(prompt, max_tokens)) as response:
        first = time.perf_counter()
        if response.status_code != 200:
            body = response.read().decode(errors="replace")[:500]
            raise RuntimeError(f"{url}: HTTP {response.status_code}: {body}")
        stream.read(response.iter_lines())
    if stream.error_event is not None:
        raise RuntimeError(f"{url}: error in stream: {stream.error_event['error']}")
    if not stream.done:
        raise RuntimeError(f"{url}: stream ended without [DONE]")
    tokens = stream.token_times[-1][1] if stream.token_times else 0
    return Measured(first - sent, spread_itl(first, stream.token_times), stream.text, tokens)


def _delta(before: MetricSnapshot, after: MetricSnapshot, name: str) -> float:
    return after.value(name) - before.value(name)


def _transfer_delta(before: MetricSnapshot, after: MetricSnapshot, where: str) -> float:
    count = _delta(before, after, _SECONDS_COUNT)
    if count != 1:
        raise RuntimeError(f"expected exactly one KV transfer on {where} per request, saw {count:g}")
    return _delta(before, after, _SECONDS_SUM)


def _row(mode: str, length: int, reps: int, s: Series) -> dict[str, Any]:
    return {"mode": mode, "prompt_tokens": length, "reps": reps, "ttft_p50_ms": ms(percentile(s.ttft_s, 50)),
            "ttft_p99_ms": ms(percentile(s.ttft_s, 99)), "itl_p50_ms": ms(percentile(s.itl_s, 50)),
            "itl_p99_ms": ms(percentile(s.itl_s, 99)), "transfer_ms": ms(percentile(s.transfer_s, 50)),
            "p_write_ms": ms(percentile(s.p_write_s, 50)),
            "kv_mib": (percentile(s.kv_bytes, 50) or 0) / 2**20 if s.kv_bytes else None,
            "transfer_share_of_ttft": None, "x_ttft_vs_colocated": None}


def measure(colocated_url: str, proxy_url: str, p_url: str, d_url: str,
            plan: Sequence[tuple[int, int]]) -> list[dict[str, Any]]:
    """Both modes, prompt length by prompt length; raises if an output differs between the modes."""
    rows: list[dict[str, Any]] = []
    timeout = httpx.Timeout(REQUEST_TIMEOUT_S, connect=10.0)
    with httpx.Client(timeout=timeout) as client:
        # Warm-up (connections, D's first pull from P, first allocations); not measured.
        for url in (colocated_url, proxy_url):
            for warm in prompts(64, 2, seed=SEED + 1):
                stream_completion(client, url, warm, OUTPUT_TOKENS)
        for length, reps in plan:
            colocated, disaggregated = Series(), Series()
            for i, prompt in enumerate(prompts(length, reps)):
                a = stream_completion(client, colocated_url, prompt, OUTPUT_TOKENS)
                p_before, d_before = get_metrics(client, p_url), get_metrics(client, d_url)
                b = stream_completion(client, proxy_url, prompt, OUTPUT_TOKENS)
                p_after, d_after = get_metrics(client, p_url), get_metrics(client, d_url)
                if (a.text, a.completion_tokens) != (b.text, b.completion_tokens):
                    raise RuntimeError(f"outputs differ for prompt {i} of {length} tokens: colocated "
                                       f"{a.completion_tokens} tokens {a.text!r}, disaggregated "
                                       f"{b.completion_tokens} tokens {b.text!r}")
                if a.completion_tokens != OUTPUT_TOKENS:
                    raise RuntimeError(f"expected {OUTPUT_TOKENS} output tokens, got {a.completion_tokens}")
                colocated.ttft_s.append(a.ttft_s)
                colocated.itl_s += a.itl_s
                disaggregated.ttft_s.append(b.ttft_s)
                disaggregated.itl_s += b.itl_s
                disaggregated.transfer_s.append(_transfer_delta(d_before, d_after, "D"))
                disaggregated.p_write_s.append(_transfer_delta(p_before, p_after, "P"))
                disaggregated.kv_bytes.append(_delta(d_before, d_after, _BYTES))
            base, pd = _row("colocated", length, reps, colocated), _row("disaggregated", length, reps,
                                                                         disaggregated)
            if pd["ttft_p50_ms"] and pd["transfer_ms"] is not None:
                pd["transfer_share_of_ttft"] = pd["transfer_ms"] / pd["ttft_p50_ms"]
            if pd["ttft_p50_ms"] and base["ttft_p50_ms"]:
                pd["x_ttft_vs_colocated"] = pd["ttft_p50_ms"] / base["ttft_p50_ms"]
            rows += [base, pd]
    return rows


def run(json_path: str | None = None, quick: bool = False, *,
        plan: Sequence[tuple[int, int]] | None = None) -> list[dict[str, Any]]:
    """`plan` ((prompt tokens, reps), ...) overrides the default one (tests use a tiny one)."""
    plan = plan or (QUICK_PLAN if quick else FULL_PLAN)
    # D waits for P's prefill as long as the client does: an 8k prefill on a loaded box takes long.
    with PDSystem(PDSystemConfig(seed=SEED, policy="fail", num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE,
                                 abort_timeout=10.0, kv_load_deadline=REQUEST_TIMEOUT_S, colocated=True)) as pd:
        rows = measure(pd.colocated.url, pd.proxy.url, pd.prefill.url, pd.decode.url, plan)
        require_drained({"P": pd.prefill.url, "D": pd.decode.url, "colocated": pd.colocated.url}, 15)
    report(f"kvferry bench e2e: colocated vs disaggregated, {OUTPUT_TOKENS} output tokens, one request at a "
           "time", rows, json_path)
    return rows
