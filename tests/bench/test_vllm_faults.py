"""The pure part of `kvferry bench vllm --faults`: outcomes, the comparison, the table, counter deltas."""

from __future__ import annotations

from kvferry.bench.vllm.client import prompt
from kvferry.bench.vllm.fault_cells import (
    FAILURE_COUNTERS,
    FAULT_KEYS,
    Cell,
    compare,
    counter_deltas,
    next_prefill,
    outcome,
    retry_backoff_s,
    retryable,
    summary,
    table_rows,
)
from kvferry.bench.vllm.servers import metric_sum, parse_prometheus


def _cell(connector: str = "kvferry", http: int | None = 200, identical: bool | None = True,
          answer_s: float | None = 1.0, freed: dict[str, float | str | None] | None = None, **kw: object) -> Cell:
    return Cell(connector, kw.pop("policy", "fail"), kw.pop("fault", "clean"), http=http,  # type: ignore[arg-type]
                identical=identical, answer_s=answer_s, freed_s=freed or {"P": 0.1, "D": 0.1}, **kw)  # type: ignore[arg-type]


def test_outcomes() -> None:
    assert outcome(_cell()) == "identical"
    assert outcome(_cell(identical=False)) == "wrong"
    assert outcome(_cell(http=500, identical=None)) == "error"
    assert outcome(_cell(http=None, identical=None, error="RemoteProtocolError")) == "dropped"
    assert outcome(_cell(http=None, identical=None, error="no answer", answer_s=None)) == "none"


def test_a_wrong_text_loses_to_any_error_and_an_error_to_the_right_text() -> None:
    wrong = _cell("nixl", identical=False, answer_s=0.1)
    error = _cell("kvferry", http=500, identical=None, answer_s=5.0)
    assert compare(error, wrong) == ("kvferry", "error vs wrong")
    right = _cell("nixl", answer_s=9.0)
    assert compare(error, right) == ("nixl", "identical vs error")
    hung = _cell("nixl", http=None, identical=None, error="no answer", answer_s=None)
    assert compare(error, hung)[0] == "kvferry"


def test_same_outcome_sooner_answer_then_sooner_release() -> None:
    fast, slow = _cell("kvferry", http=500, identical=None, answer_s=0.2), _cell("nixl", http=500, identical=None,
                                                                               answer_s=5.1)
    assert compare(fast, slow) == ("kvferry", "answer 0.20 s vs 5.10 s")
    assert compare(_cell(answer_s=1.0), _cell("nixl", answer_s=1.3))[0] == "same"  # within the slack
    assert compare(_cell(answer_s=10.0), _cell("nixl", answer_s=12.0))[0] == "same"  # within a quarter
    dropped = {"http": None, "identical": None, "error": "RemoteProtocolError"}
    assert compare(_cell(answer_s=0.4, **dropped), _cell("nixl", answer_s=1.0, **dropped))[0] == "same"
    held = _cell("nixl", freed={"P": 30.2, "D": 0.1})
    assert compare(_cell(freed={"P": 1.9, "D": "killed"}), held) == ("kvferry", "blocks freed 1.9 s vs 30.2 s")
    never = _cell("nixl", freed={"P": None, "D": 0.1})
    assert compare(_cell(freed={"P": 40.0, "D": 0.1}), never) == ("kvferry", "blocks freed 40.0 s vs never")


def test_summary_names_the_cause_and_the_time() -> None:
    assert summary(_cell(http=500, identical=None, causes={"peer_dead": 1.0}, answer_s=0.43)) == "500 peer_dead 430 ms"
    assert summary(_cell(http=500, identical=None, error="Internal server error", answer_s=5.1)) == \
        "500 Internal server error 5.1 s"
    assert summary(_cell(identical=False, answer_s=0.2)) == "200 WRONG TEXT 200 ms"
    assert summary(_cell(answer_s=12.0)) == "200 = 12.0 s"


def test_table_has_one_row_per_fault_and_policy_in_matrix_order() -> None:
    cells = [_cell(c, fault=f, policy=p) for f in ("kill_d", "clean") for p in ("recompute", "fail")
             for c in ("nixl", "kvferry")]
    cells.append(_cell("kvferry", fault="corrupt"))  # no NIXL cell: shown, nobody ahead
    rows = table_rows(cells)
    assert [(r["policy"], r["ahead"]) for r in rows] == [("fail", "same"), ("recompute", "same"), ("fail", "-"),
                                                         ("fail", "same"), ("recompute", "same")]
    assert rows[0]["fault"].startswith("no fault") and rows[2]["NIXL"] == "-"
    assert list(FAULT_KEYS).index("clean") < list(FAULT_KEYS).index("corrupt") < list(FAULT_KEYS).index("kill_d")


def test_counter_deltas_by_cause_and_by_nixl_counter() -> None:
    before = parse_prometheus(
        'kvferry:kv_load_failures_total{engine="0",cause="peer_dead"} 1.0\n'
        'kvferry:kv_load_failures_total{engine="0",cause="checksum"} 0.0\n'
        'vllm:nixl_num_failed_transfers_total{engine="0"} 2.0\n'
        'vllm:nixl_num_failed_transfers_created{engine="0"} 1.7e9\n')
    after = parse_prometheus(
        'kvferry:kv_load_failures_total{engine="0",cause="peer_dead"} 1.0\n'
        'kvferry:kv_load_failures_total{engine="0",cause="checksum"} 1.0\n'
        'vllm:nixl_num_failed_transfers_total{engine="0"} 3.0\n'
        'vllm:nixl_num_failed_transfers_created{engine="0"} 1.8e9\n'
        'vllm:num_requests_waiting{engine="0"} 4.0\n')
    assert counter_deltas(before, after, FAILURE_COUNTERS) == {"checksum": 1.0, "nixl failed_transfers": 1.0}
    assert metric_sum(after, "vllm:num_requests_waiting") == 4.0


def test_prompts_are_seeded_and_one_token_per_word() -> None:
    assert prompt(3) == prompt(3) != prompt(4)
    assert len(prompt(3, 900).split()) == 903


def test_the_client_retries_only_vllms_answer_to_a_failed_kv_load() -> None:
    failed = {"error": {"message": "Internal server error", "type": "InternalServerError", "param": None, "code": 500}}
    assert retryable(500, failed)
    assert not retryable(200, {"choices": []})
    assert not retryable(400, {"error": {"message": "bad", "type": "BadRequestError"}})
    assert not retryable(503, {"error": {"message": "busy", "type": "ServiceUnavailableError"}})
    assert not retryable(500, "not json") and not retryable(None, None)


def test_a_retry_goes_to_another_answering_p_else_the_same_after_a_backoff() -> None:
    assert next_prefill(0, [False, True]) == (1, False)  # P 0 paused: P 1 at once
    assert next_prefill(1, [True, True]) == (0, False)
    assert next_prefill(0, [True, False]) == (0, True)  # only the same P answers again: back off first
    assert next_prefill(0, [False, False]) == (1, True)  # nobody answers: another one, after a backoff
    assert next_prefill(0, [True]) == (0, True)
    assert [retry_backoff_s(n) for n in (1, 2, 3, 4, 5)] == [0.25, 0.5, 1.0, 2.0, 2.0]


def test_a_retried_answer_says_which_try_gave_it() -> None:
    assert summary(_cell(answer_s=4.2, tries=2, causes={"peer_dead": 1.0})) == "200 = 4.2 s (try 2)"
    assert summary(_cell(answer_s=4.2)) == "200 = 4.2 s"
