"""What the vLLM benches send a `vllm serve` (or the router before it): prompts and completions, streamed
or whole, and P's prefill as vllm-router's NIXL mode asks for it."""

from __future__ import annotations

import random
import time
from typing import Any

import httpx

from kvferry.harness.client import CompletionStream, stream_body

# vllm-router's NIXL mode, as its captures show (tests/routers/captures): P is asked to keep the KV.
ROUTER_NIXL_P_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                        "remote_block_ids": None, "remote_host": None, "remote_port": None}
VOCAB = ("river", "stone", "light", "paper", "garden", "engine", "cloud", "market", "silver", "window",
         "orange", "doctor", "winter", "castle", "pencil", "rabbit", "forest", "bottle", "camera", "ladder")


def prompt(seed: int, words: int = 900) -> str:
    """Random words (seeded): an answer that depends on every token's KV, unlike a repeating pattern."""
    rng = random.Random(seed)
    return "Continue the list: " + " ".join(rng.choice(VOCAB) for _ in range(words))


def stream(url: str, model: str, prompt: str, max_tokens: int,
           timeout: float = 300) -> tuple[float, list[float], str]:
    """TTFT, the gaps between later chunks with text and the text of one streamed greedy completion."""
    body = {"model": model, **stream_body(prompt, max_tokens)}
    begin, events = time.monotonic(), CompletionStream(time.monotonic)
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=timeout) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {response.read().decode(errors='replace')[:300]}")
        events.read(response.iter_lines())
    stamps = [at for at, text in zip(events.arrivals, events.parts, strict=True) if text]
    if not stamps:
        raise RuntimeError("no tokens streamed")
    return stamps[0] - begin, [b - a for a, b in zip(stamps, stamps[1:], strict=False)], events.text


def complete(url: str, model: str, text: str, max_tokens: int, timeout: float,
             params: dict[str, Any] | None = None) -> httpx.Response:
    body: dict[str, Any] = {"model": model, "prompt": text, "max_tokens": max_tokens, "temperature": 0}
    if params is not None:
        body["kv_transfer_params"] = params
    return httpx.post(f"{url}/v1/completions", json=body, timeout=timeout)


def prefill(p_url: str, model: str, text: str, timeout: float = 120) -> dict[str, Any]:
    """P's prefill of `text` (one token, KV kept for D): the kv_transfer_params D needs."""
    r = complete(p_url, model, text, 1, timeout, dict(ROUTER_NIXL_P_PARAMS))
    if r.status_code != 200 or not r.json().get("kv_transfer_params"):
        raise RuntimeError(f"P's prefill: HTTP {r.status_code} {r.text[:200]}")
    return dict(r.json()["kv_transfer_params"])


def answer_text(r: httpx.Response) -> str:
    return str(r.json()["choices"][0]["text"])
