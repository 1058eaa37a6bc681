"""`TransferTable.rewind`: an engine that preempts a prefilling request (vLLM) frees its blocks, so no
partial write may start from them afterwards and the call returns only once no write reads them; a
write that outlasts the wait ends the transfer and is handed back to be cancelled."""

from __future__ import annotations

import threading

from kvferry.connector.messages import PullRequest
from kvferry.connector.metrics import Metrics
from kvferry.connector.prefill.records import Kind
from kvferry.connector.prefill.transfers import TransferTable

TOKENS = 48  # 3 blocks of 16


def table_with_a_part_in_flight() -> tuple[TransferTable, PullRequest, object]:
    table = TransferTable(30.0, Metrics(), lambda d_tp: {(0, 0)})
    table.add_working("t", "r")
    table.add_progress("t", "r", [7, 8], TOKENS, "digest")
    pull = PullRequest("t", "d-t", "d:1", "grant", [0, 1, 2], 8, 1, 0, TOKENS, prompt_digest="digest")
    v = table.begin_part(pull, 0, [0, 1, 2], 0)
    assert v.kind == Kind.PART and v.blocks == [7, 8]
    return table, pull, v.write


def test_rewind_waits_for_the_write_and_no_part_starts_from_the_old_blocks() -> None:
    table, pull, write = table_with_a_part_in_flight()
    returned = threading.Event()

    def rewind() -> None:
        assert table.rewind("t", "r", 10.0) == []
        returned.set()

    waiter = threading.Thread(target=rewind)
    waiter.start()
    assert not returned.wait(0.2)  # the part still reads blocks 7 and 8
    table.write_done(write, failed=False, partial=True)  # type: ignore[arg-type]
    assert returned.wait(10.0)
    waiter.join()
    # The resumed prefill's blocks are new: nothing past what the pull already had is written from the old.
    assert table.begin_part(pull, 0, [0, 1, 2], 2).kind == Kind.WAIT
    table.add_progress("t", "r", [4, 5, 6], TOKENS, "digest")
    v = table.begin_part(pull, 0, [0, 1, 2], 2)
    assert v.kind == Kind.PART and v.blocks == [6]


def test_a_write_past_the_wait_ends_the_transfer_and_is_handed_back() -> None:
    table, _, write = table_with_a_part_in_flight()
    assert table.rewind("t", "r", 0.05) == [write]
    assert not table.write_wanted(write)  # doomed: a queued write would write nothing
    table.write_done(write, failed=True)  # type: ignore[arg-type]
    assert table.get("t") is None and table.ended("t") is not None


def test_rewind_of_another_request_or_a_finished_prefill_changes_nothing() -> None:
    table, _, write = table_with_a_part_in_flight()
    assert table.rewind("t", "other", 0.0) == [] and table.rewind("unknown", "r", 0.0) == []
    assert table.write_wanted(write)  # type: ignore[arg-type]
