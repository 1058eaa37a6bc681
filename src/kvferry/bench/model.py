"""`kvferry bench model`: prefill and decode tokens/s of kvferry's numpy engine on SmolLM2, beside
transformers (torch, CPU, float32) on the same weights when torch is installed, at one thread count.

It also times batch-8 decode with plain `x @ W.T` products and checks whether a sequence still gets its
lone bits: OpenBLAS picks its kernel by the product's height, which is why the engine does not do it."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from kvferry.bench.report import report

PREFILL_LENGTHS = (128, 512)
DECODE_TOKENS = 32
DECODE_BATCH = 8
BLOCK_SIZE = 16


def _numpy_rows(spec: str, lengths: tuple[int, ...], decode_tokens: int) -> tuple[dict[str, float], bool]:
    """tok/s by row, and whether the plain-matmul batch gave the first sequence its lone bits."""
    from kvferry.engine.loader import load_model

    model = load_model(spec).model
    out: dict[str, float] = {}
    rng = np.random.default_rng(0)
    for n in lengths:
        ids = rng.integers(100, 40000, n).tolist()
        blocks = -(-(n + decode_tokens) // BLOCK_SIZE)
        cache = model.allocate_kv_cache(model.kv_cache_spec(blocks, BLOCK_SIZE))
        begin = time.perf_counter()
        model.forward(cache, BLOCK_SIZE, ids, 0, list(range(blocks)))
        out[f"prefill_{n}"] = n / (time.perf_counter() - begin)
    ids = rng.integers(100, 40000, 128).tolist()
    blocks = -(-(128 + decode_tokens) // BLOCK_SIZE)
    cache = model.allocate_kv_cache(model.kv_cache_spec(blocks, BLOCK_SIZE))
    logits = model.forward(cache, BLOCK_SIZE, ids, 0, list(range(blocks)))
    begin = time.perf_counter()
    for i in range(decode_tokens):
        logits = model.forward(cache, BLOCK_SIZE, [int(np.argmax(logits))], 128 + i, list(range(blocks)), 128)
    out["decode"] = decode_tokens / (time.perf_counter() - begin)
    out["decode_batch"] = _numpy_batch_decode(model, np.random.default_rng(1), decode_tokens)[0]
    with _plain_matmul():
        out["decode_batch_plain"], alike = _numpy_batch_decode(model, np.random.default_rng(1), decode_tokens)
    return out, alike


@contextlib.contextmanager
def _plain_matmul() -> Iterator[None]:
    from kvferry.engine.model_math import RowWeight

    invariant = RowWeight.apply
    RowWeight.apply = lambda self, x: x @ self.weight.T  # type: ignore[method-assign]
    try:
        yield
    finally:
        RowWeight.apply = invariant  # type: ignore[method-assign]


def _numpy_batch_decode(model: Any, rng: np.random.Generator, decode_tokens: int) -> tuple[float, bool]:
    """Aggregate tok/s of DECODE_BATCH sequences decoding together, and whether the first one's last
    logits are the bits it gets alone (replayed over the same cache, whose K/V the batch wrote)."""
    from kvferry.engine.model import SeqChunk

    blocks = -(-(128 + decode_tokens) // BLOCK_SIZE)
    cache = model.allocate_kv_cache(model.kv_cache_spec(blocks * DECODE_BATCH, BLOCK_SIZE))
    tables = [list(range(i * blocks, (i + 1) * blocks)) for i in range(DECODE_BATCH)]
    last = []
    for table in tables:
        logits = model.forward(cache, BLOCK_SIZE, rng.integers(100, 40000, 128).tolist(), 0, table, 128)
        last.append(int(np.argmax(logits)))
    first_alone = last[0]
    begin = time.perf_counter()
    for i in range(decode_tokens):
        chunks = [SeqChunk([token], 128 + i, table, 128) for token, table in zip(last, tables, strict=True)]
        batch_logits = model.forward_batch(cache, BLOCK_SIZE, chunks)
        last = [int(np.argmax(logits)) for logits in batch_logits]
    elapsed = time.perf_counter() - begin
    alone = first_alone
    for i in range(decode_tokens):
        logits = model.forward(cache, BLOCK_SIZE, [alone], 128 + i, tables[0], 128)
        alone = int(np.argmax(logits))
    return DECODE_BATCH * decode_tokens / elapsed, bool(np.array_equal(logits, batch_logits[0]))


def _transformers_rows(spec: str, lengths: tuple[int, ...], decode_tokens: int, threads: int) -> dict[str, float]:
    import torch
    from transformers import AutoModelForCausalLM

    from kvferry.engine.loader import model_dir

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir(spec)), torch_dtype=torch.float32)
    model.eval()  # type: ignore[no-untyped-call]
    out: dict[str, float] = {}
    rng = np.random.default_rng(0)
    with torch.inference_mode():
        for n in lengths:
            ids = torch.tensor([rng.integers(100, 40000, n).tolist()])
            begin = time.perf_counter()
            model(ids, use_cache=True)
            out[f"prefill_{n}"] = n / (time.perf_counter() - begin)
        for key, batch in (("decode", 1), ("decode_batch", DECODE_BATCH)):
            ids = torch.tensor([rng.integers(100, 40000, 128).tolist() for _ in range(batch)])
            result = model(ids, use_cache=True)
            past, token = result.past_key_values, result.logits[:, -1:].argmax(-1)
            begin = time.perf_counter()
            for _ in range(decode_tokens):
                result = model(token, past_key_values=past, use_cache=True)
                past, token = result.past_key_values, result.logits[:, -1:].argmax(-1)
            out[key] = batch * decode_tokens / (time.perf_counter() - begin)
    return out


def run(json_path: str | None, quick: bool = False, model: str = "smollm2") -> list[dict[str, Any]]:
    threads = int(os.environ.get("OPENBLAS_NUM_THREADS", "1"))
    lengths, decode_tokens = ((128,), 8) if quick else (PREFILL_LENGTHS, DECODE_TOKENS)
    ours, plain_alike = _numpy_rows(model, lengths, decode_tokens)
    try:
        theirs: dict[str, float] | None = _transformers_rows(model, lengths, decode_tokens, threads)
    except ImportError as exc:
        print(f"kvferry bench model: transformers side skipped ({exc.name} not installed: pip install torch==2.13.0 transformers)")
        theirs = None
    rows = []
    for key, value in ours.items():
        other = None if theirs is None else theirs.get(key)
        rows.append({"what": _label(key, decode_tokens, plain_alike), "numpy tok/s": round(value, 1),
                     "transformers tok/s": None if other is None else round(other, 1),
                     "ratio": None if other is None else round(value / other, 2), "threads": threads})
    report(f"kvferry bench model: {model}, numpy engine vs transformers (float32, CPU)", rows, json_path)
    return rows


def _label(key: str, decode_tokens: int, plain_alike: bool) -> str:
    if key == "decode_batch_plain":
        alike = "same bits as alone" if plain_alike else "NOT the bits it gets alone"
        return f"decode (batch {DECODE_BATCH}, plain x @ W.T per step: {alike})"
    if key == "decode":
        return f"decode (batch 1, {decode_tokens} tokens)"
    if key == "decode_batch":
        return f"decode (batch {DECODE_BATCH}, {decode_tokens} steps, aggregate)"
    return key.replace("_", " ") + " tokens"
