"""Chunked prefill: a long prompt is computed in block-aligned chunks between other requests' steps, a
short request finishes while it is still prefilling, and every output stays bit-identical."""

from __future__ import annotations

import numpy as np

from kvferry.engine.engine import Engine, EngineConfig, RequestOutput
from kvferry.engine.model import ModelConfig, TinyLlama
from kvferry.engine.request import Request, SamplingParams

MODEL = ModelConfig(seed=5)


def test_long_prompt_is_chunked_at_block_edges_and_short_request_overtakes_it() -> None:
    engine = Engine(EngineConfig(num_blocks=64, block_size=16, max_prefill_chunk=40, model=MODEL))
    rng = np.random.default_rng(0)
    long_ids = rng.integers(0, 256, 300).tolist()
    short_ids = [65, 66]
    outputs: dict[str, list[int]] = {"long": [], "short": []}
    finished_at: dict[str, int] = {}

    def sink(name: str):  # type: ignore[no-untyped-def]
        def put(out: RequestOutput) -> None:
            outputs[name] += out.new_token_ids
            if out.finished:
                finished_at[name] = engine.scheduler.step_count
        return put

    params = SamplingParams(4, 0.0, None, (), (), True)
    engine.submit(Request("long", long_ids, params, None, 0.0), sink("long"))
    engine._drain_commands()
    first = engine.step()
    assert [(c.start_pos, c.num_tokens) for c in first.chunks] == [(0, 32)]  # 40 cut to the block edge
    engine.submit(Request("short", short_ids, SamplingParams(2, 0.0, None, (), (), True), None, 0.0), sink("short"))
    engine.run_until_idle()
    assert finished_at["short"] < finished_at["long"] - 4  # the short one did not wait for 300 prompt tokens
    model = TinyLlama(MODEL)
    assert outputs["long"] == model.generate_greedy(long_ids, 4, stop_at_eos=False)
    assert outputs["short"] == model.generate_greedy(short_ids, 2, stop_at_eos=False)


def test_chunk_cap_zero_means_whole_prompt() -> None:
    engine = Engine(EngineConfig(num_blocks=64, block_size=16, max_prefill_chunk=0, model=MODEL))
    engine.submit(Request("r", list(range(200)), SamplingParams(1, 0.0, None, (), (), True), None, 0.0), lambda o: None)
    engine._drain_commands()
    assert [(c.start_pos, c.num_tokens) for c in engine.step().chunks] == [(0, 200)]
