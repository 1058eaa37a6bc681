"""P's rank loops survive any exception in one item (issue 13.2) and answer late pulls at once with
cause `expired` (issue 12.3); every ERROR names its pull (issue 12.1)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from test_hostile_input import SPEC, Rig

from kvferry.connector.faults import FaultSpec
from kvferry.connector.messages import Status


class ExplodingFaults:
    """FaultSpec stand-in that raises the second time it is asked about `boom` (a parked retry)."""

    def __init__(self) -> None:
        self.slow_ms = 0
        self.calls = 0

    def fault_for(self, transfer_id: str) -> str | None:
        if transfer_id == "boom":
            self.calls += 1
            if self.calls >= 2:
                raise RuntimeError("bug in a parked retry")
        return None


@pytest.fixture
def rig() -> Iterator[Rig]:
    r = Rig()
    try:
        yield r
    finally:
        r.close()


def test_exception_in_a_parked_retry_costs_that_pull_only(rig: Rig) -> None:
    faults = ExplodingFaults()
    rig.producer.faults = faults  # type: ignore[assignment]
    reply = rig.ask(rig.pull("boom", [1]))  # parked (no prefill yet), then its retry raises
    assert reply.status == Status.ERROR and "P internal error" in reply.err_msg
    assert (reply.transfer_id, reply.d_request_id) == ("boom", "d-boom")
    assert rig.producer.metrics.producer_errors._value.get() >= 1
    rig.producer.faults = FaultSpec()
    rig.check_still_serving()
    # Rank 0 also runs lease expiry: it must still run.
    rig.producer.add_ready("orphan", "p-orphan", [1, 2], 8)
    rig.wait_no_transfers()
    assert "p-orphan" in rig.producer.drain_finished()


def test_late_pull_gets_expired_at_once(rig: Rig) -> None:
    rig.producer.add_ready("late", "p-late", [1, 2], 2 * SPEC.block_size)
    rig.wait_no_transfers()  # the 0.3 s abort timeout passes with nobody pulling
    started = time.monotonic()
    reply = rig.ask(rig.pull("late", [3, 4]), timeout=2.0)
    assert time.monotonic() - started < 1.0
    assert reply.status == Status.ERROR and reply.cause == "expired", reply
    assert (reply.transfer_id, reply.d_request_id) == ("late", "d-late")
    assert len(rig.producer.table) == 0, "a late pull must not create a placeholder"


def test_release_before_prefill_frees_on_arrival_and_late_pull_is_expired(rig: Rig) -> None:
    from kvferry.connector.messages import Release, encode

    rig.sock.send(encode(Release(["gone"])))
    deadline = time.monotonic() + 5
    while rig.producer.table.ended("gone") is None:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    rig.producer.add_ready("gone", "p-gone", [1], SPEC.block_size)
    assert rig.producer.drain_finished() == {"p-gone"}, "blocks handed back the moment the prefill ends"
    reply = rig.ask(rig.pull("gone", [2]))
    assert reply.status == Status.ERROR and reply.cause == "expired"
    assert len(rig.producer.table) == 0
