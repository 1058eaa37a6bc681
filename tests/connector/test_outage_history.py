"""A P that came back from an outage (its whole process out of reach, libzmq's re-dial completing once it
runs again) has shown how long a merely starved P can be gone: the next drop is judged by that delay as by
its acks' round trips, so a box whose hogs starve P in growing bursts does not get it called dead at the
idle floor. The history belongs to the P process, not to one DEALER: a DEALER that is replaced (lost, or
closed when idle) hands it to the next one."""

from __future__ import annotations

import os
import signal
import time
from types import SimpleNamespace

from test_starved_p import D_BLOCKS, StarvedP, ended, p_and_d

from kvferry.connector.decode.dealer import Dealer, Dealers
from kvferry.connector.decode.liveness import DelayEstimator
from kvferry.connector.decode.pulls import PullSpec
from procs import wait_until

FLOOR = 1.0  # the ZMTP timeout and the idle bound after a drop
FIRST_S = 0.5  # the first outage, counted from the drop: within the floor
SECOND_S = 1.5  # the second: past the floor, within what the first allows (MARGIN x, 4x)


def out_of_reach(p: StarvedP, dealer: Dealer, after_drop_s: float) -> None:
    """P's whole process stopped until libzmq drops its connection, and `after_drop_s` longer."""
    os.kill(p.proc.pid, signal.SIGSTOP)
    try:
        wait_until(lambda: dealer.dropped is not None, 10, "libzmq to drop the stopped P's connection", interval=0.002)
        assert dealer.dropped is not None
        time.sleep(max(0.0, dealer.dropped + after_drop_s - time.monotonic()))
    finally:
        os.kill(p.proc.pid, signal.SIGCONT)
    wait_until(lambda: dealer.connected and dealer.dropped is None, 10, "the re-dial to reach P again")


def test_the_next_drop_is_judged_by_the_outage_p_came_back_from() -> None:
    with p_and_d(FLOOR) as (p, consumer, causes, finished):
        p.do("working xfer-o p-o")  # P has the request queued: D's pull is parked there, heartbeating
        consumer.start_pulls([PullSpec("o", "xfer-o", D_BLOCKS, "starved-p", p.bootstrap, 16)])
        wait_until(lambda: any(d.connected and d.waiters for d in list(consumer._dealers.values())), 10, "D pulling")
        dealer = next(iter(consumer._dealers.values()))
        assert dealer.silence.threshold() == FLOOR  # an idle history
        out_of_reach(p, dealer, FIRST_S)
        assert dealer.silence.threshold() > SECOND_S, "the outage P came back from was not learnt"
        out_of_reach(p, dealer, SECOND_S)  # at the idle floor this P would have been called dead
        p.do("ready xfer-o p-o")
        wait_until(lambda: ended(consumer, causes, finished, "o"), 20, "the pull to end")
        assert causes == {}, f"D gave up on a P that came back after {SECOND_S}s, as it had before: {causes}"


def test_a_p_processs_delays_outlive_its_dealer() -> None:
    made: list[SimpleNamespace] = []

    def make(addr: str, receiver: bytes) -> Dealer:
        made.append(SimpleNamespace(silence=DelayEstimator(FLOOR, 10.0), receiver=receiver, lost=False))
        return made[-1]  # type: ignore[return-value]

    dealers = Dealers(make)
    first = dealers._new("tcp://p:1", b"p-boot-1")
    first.silence.observe(2.0)
    assert dealers._new("tcp://p:1", b"p-boot-1").silence is first.silence  # the same P process, a new DEALER
    assert dealers._new("tcp://p:1", b"p-boot-2").silence.threshold() == FLOOR  # a new process starts afresh
