"""The HTTP load client: deterministic workloads, streaming completions, outcomes and percentiles. TTFT
is the time to the response headers: an instance sends them only once the first token exists."""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx


@dataclass(frozen=True)
class WorkItem:
    index: int
    prompt: list[int]
    max_tokens: int
    ignore_eos: bool = True  # random byte prompts run to max_tokens; a real model's chat stops at EOS
    question: str = ""  # the chat question behind `prompt` (real models), for the report


def make_workload(n: int, seed: int, max_prompt: int = 2000, max_tokens: tuple[int, int] = (8, 32),
                  long_share: float = 0.12) -> list[WorkItem]:
    """n requests of byte token ids, deterministic in (n, seed, ...): the block edges 1, 15, 16, 17 and
    `max_prompt`, then mostly short, some medium and `long_share` long ones, shuffled to spread them out."""
    rng = random.Random(seed)
    edges = [k for k in (1, 15, 16, 17, max_prompt) if k <= max_prompt]
    lengths = edges[:n]
    while len(lengths) < n:
        draw = rng.random()
        if draw < long_share and max_prompt > 512:
            lengths.append(rng.randint(513, max_prompt))
        elif draw < long_share + 0.3 and max_prompt > 128:
            lengths.append(rng.randint(129, min(512, max_prompt)))
        else:
            lengths.append(rng.randint(min(2, max_prompt), min(128, max_prompt)))
    rng.shuffle(lengths)
    lo, hi = max_tokens
    return [WorkItem(i, [rng.randrange(256) for _ in range(k)], rng.randint(lo, hi))
            for i, k in enumerate(lengths)]


@dataclass
class RequestResult:
    index: int
    prompt_tokens: int
    max_tokens: int
    # "pending" | "running" | "ok" | "failed" (HTTP 500 kv_load_failed) | "stuck" | "error"
    outcome: str = "pending"
    sent_at: float | None = None  # seconds since the run started
    first_token_at: float | None = None
    finished_at: float | None = None
    http_status: int | None = None
    text: str = ""
    error_type: str | None = None
    error_code: str | None = None
    error_message: str | None = None
    transfer_id: str | None = None  # the proxy's x-kvferry-transfer-id (its last attempt)
    # (seconds since the run started, completion tokens so far) per stream event carrying usage (for ITL)
    token_times: list[tuple[float, int]] = field(default_factory=list)

    @property
    def ttft(self) -> float | None:
        if self.sent_at is None or self.first_token_at is None or self.outcome != "ok":
            return None
        return self.first_token_at - self.sent_at

    @property
    def itl(self) -> list[float]:
        return [] if self.first_token_at is None else spread_itl(self.first_token_at, self.token_times)

    @property
    def latency(self) -> float | None:
        if self.sent_at is None or self.finished_at is None:
            return None
        return self.finished_at - self.sent_at

    def as_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in asdict(self).items() if k not in ("text", "token_times")}
        return d | {"ttft_s": self.ttft, "latency_s": self.latency}


def _error_fields(content: bytes | str) -> tuple[str | None, str | None, str]:
    try:
        body = json.loads(content)
        error = body.get("error") if isinstance(body, dict) else None
    except ValueError:
        error = None
    if not isinstance(error, dict):
        text = content.decode(errors="replace") if isinstance(content, bytes) else content
        return None, None, text[:300]
    code = error.get("code")
    return error.get("type"), None if code in (None, "") else str(code), str(error.get("message", ""))[:300]


def stream_body(prompt: list[int] | str, max_tokens: int, ignore_eos: bool = True) -> dict[str, Any]:
    """A greedy streaming completion request."""
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": ignore_eos, "stream": True}


@dataclass
class CompletionStream:
    """One OpenAI completion stream, fed line by line until `[DONE]` or an error event; every streaming
    client reads through it, so they all parse and time a stream alike."""

    clock: Callable[[], float]
    parts: list[str] = field(default_factory=list)  # each event's text, empty ones included
    arrivals: list[float] = field(default_factory=list)  # when each of `parts` came
    # (arrival, completion tokens so far) per event that brings tokens (for ITL)
    token_times: list[tuple[float, int]] = field(default_factory=list)
    done: bool = False
    error_event: dict[str, Any] | None = None  # the event with "error" that ended the stream

    def feed(self, line: str) -> bool:
        """False once the stream is over."""
        if not line.startswith("data: "):
            return True
        if line == "data: [DONE]":
            self.done = True
            return False
        event: dict[str, Any] = json.loads(line[len("data: ") :])
        if "error" in event:
            self.error_event = event
            return False
        now, choice = self.clock(), event["choices"][0]
        self.parts.append(choice["text"])
        self.arrivals.append(now)
        if "usage" in event:
            self.token_times.append((now, int(event["usage"]["completion_tokens"])))
        elif choice["text"] or not choice.get("finish_reason"):  # vLLM: one event per token
            self.token_times.append((now, (self.token_times[-1][1] if self.token_times else 0) + 1))
        return True

    def read(self, lines: Iterable[str]) -> CompletionStream:
        for line in lines:
            if not self.feed(line):
                break
        return self

    @property
    def first_at(self) -> float | None:
        return self.arrivals[0] if self.arrivals else None

    @property
    def text(self) -> str:
        return "".join(self.parts)


def spread_itl(first_at: float, token_times: Iterable[tuple[float, int]]) -> list[float]:
    """Inter-token latency, one value per token after the first: the gap before an event is spread over
    the tokens it brought (a byte token that ends inside a UTF-8 character comes with the next event)."""
    out: list[float] = []
    last_t, last_n = first_at, 1  # `first_at` brings the first token
    for t, n in token_times:
        if n > last_n:
            out += [(t - last_t) / (n - last_n)] * (n - last_n)
            last_t, last_n = t, n
    return out


async def run_request(client: httpx.AsyncClient, url: str, item: WorkItem, result: RequestResult, t0: float,
                      timeout: float) -> None:
    """One streaming completion; fills `result` (times relative to the monotonic `t0`)."""
    body = stream_body(item.prompt, item.max_tokens, item.ignore_eos)
    result.outcome, result.sent_at = "running", time.monotonic() - t0
    # The stream fills `result.token_times` in place, so a stuck request keeps what it got.
    stream = CompletionStream(lambda: time.monotonic() - t0, token_times=result.token_times)
    try:
        async with asyncio.timeout(timeout):
            async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
                result.http_status = response.status_code
                result.transfer_id = response.headers.get("x-kvferry-transfer-id")
                if response.status_code != 200:
                    content = await response.aread()
                    result.error_type, result.error_code, result.error_message = _error_fields(content)
                    kv_failed = response.status_code == 500 and result.error_type == "kv_load_failed"
                    result.outcome = "failed" if kv_failed else "error"
                    return
                async for line in response.aiter_lines():
                    going = stream.feed(line)
                    result.first_token_at = stream.first_at  # kvferry sends its headers with the first token, vLLM at once
                    if not going:
                        break
                if stream.error_event is not None:  # an error after the stream started
                    error = stream.error_event["error"]
                    result.error_type, result.error_code = error.get("type"), error.get("code")
                    result.error_message = str(error.get("message", ""))[:300]
                    result.outcome = "error"
                    return
                result.text = stream.text
                if stream.done:
                    result.outcome = "ok"
                else:
                    result.outcome, result.error_message = "error", "stream ended without [DONE]"
    except TimeoutError:
        result.outcome, result.error_message = "stuck", f"no complete answer within {timeout:.0f}s"
    except (httpx.HTTPError, ValueError, KeyError) as exc:
        result.outcome, result.error_message = "error", repr(exc)[:300]
    finally:
        result.finished_at = time.monotonic() - t0


async def run_workload(url: str, items: Sequence[WorkItem], results: Sequence[RequestResult], t0: float,
                       concurrency: int = 4, timeout: float = 90.0) -> None:
    """Send every item (at most `concurrency` in flight); `results[i]` is updated in place as it goes."""
    semaphore = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 2, max_keepalive_connections=concurrency + 2)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0), limits=limits) as client:

        async def one(item: WorkItem, result: RequestResult) -> None:
            async with semaphore:
                await run_request(client, url, item, result, t0, timeout)

        await asyncio.gather(*(one(item, result) for item, result in zip(items, results, strict=True)))


def new_results(items: Iterable[WorkItem]) -> list[RequestResult]:
    return [RequestResult(item.index, len(item.prompt), item.max_tokens) for item in items]


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100) by linear interpolation; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)
