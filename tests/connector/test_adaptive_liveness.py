"""Liveness that adapts to load (issue 18.4), against a fake P whose heartbeat acks the test delays on
purpose: a P that stalls but answers is waited on (the fixed threshold would have killed it); a P
whose Python stops answering (its process alive) fails its pulls only at their own deadline; a D whose own loop lags asks P for a
longer lease. Every delay is the scenario itself, with at least 2× slack either way."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np
import pytest
from test_consumer_spine import D_BLOCKS, ENGINE_ID, P_BLOCKS, SPEC, FakePRank, Rig, make_rig

from kvferry.connector.bootstrap import BootstrapServer, Registration
from kvferry.connector.decode.consumer import Consumer
from kvferry.connector.decode.pulls import ConsumerConfig, PullSpec
from kvferry.connector.faults import FaultSpec
from kvferry.connector.layout import PagedKVLayout
from kvferry.connector.messages import Heartbeat, HeartbeatAck, PullRequest, Release, Status, encode
from kvferry.connector.metrics import Metrics
from kvferry.connector.prefill.producer import Producer
from kvferry.transfer.tcp.engine import TcpTransferEngine
from procs import free_port, wait_until

INTERVAL, FLOOR = 0.1, 0.5  # D heartbeats every 0.1 s; an idle P is dead after 0.5 s of silence
LONG = {"recv_timeout_s": 30.0, "kv_load_deadline_s": 60.0}  # only liveness may end these pulls
# P goes quiet (answers nothing) for this long when heartbeat n arrives, then answers all it owes:
# how a starved process behaves. Each stall is at most half of 4× (the margin) the one before it.
STALLS = {5: 0.25, 10: 0.25, 15: 0.5, 20: 1.0}
D_STALLS = (0.25, 0.25, 0.6, 1.4)  # D's loop blocked this long, in turn, while P writes
SLOW_WRITE_S = 6.0  # P's write outlasts the stalls
LAST = 35  # heartbeats P has received by the end of the ramp (the last stall is over by then)


class SlowP:
    """Answers heartbeats at once, except through the stalls above; silent for good once frozen."""

    def __init__(self, rank: FakePRank, stalls: dict[int, float]) -> None:
        self.rank = rank
        self.stalls = stalls
        self.owed: list[tuple[float, bytes]] = []  # (when, identity): acks due, in arrival order
        self.quiet_until = 0.0
        self.pings = 0
        self.leases: list[float] = []  # lease_s of every heartbeat
        self.released = False
        self.last_ack = 0.0
        self.ack = HeartbeatAck()  # what each heartbeat is answered with
        self.pulls: list[tuple[bytes, PullRequest]] = []  # pulls D sent (again) while we serve

    def serve(self, until: Callable[[], bool], timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while not until() and not self.released:
            assert time.monotonic() < deadline, f"P answered {self.pings} heartbeats, D never settled"
            if self.rank.sock.poll(5):
                identity, msg = self.rank.recv()
                if isinstance(msg, Heartbeat):
                    now = time.monotonic()
                    if self.pings in self.stalls:
                        self.quiet_until = now + self.stalls[self.pings]
                    self.owed.append((max(now, self.quiet_until), identity))
                    self.leases.append(msg.lease_s)
                    self.pings += 1
                elif isinstance(msg, Release):
                    self.released = True  # D gave up on this P
                elif isinstance(msg, PullRequest):
                    self.pulls.append((identity, msg))
            while self.owed and self.owed[0][0] <= time.monotonic():
                self.rank.sock.send_multipart([self.owed.pop(0)[1], self.rank.sealer.seal(encode(self.ack))])
                self.last_ack = time.monotonic()


def start(rig: Rig) -> tuple[SlowP, bytes, PullRequest]:
    rig.pull("r", D_BLOCKS)
    identity, pull = rig.ranks[0].recv_pull()
    return SlowP(rig.ranks[0], STALLS), identity, pull


def threshold(rig: Rig) -> float:
    return float(rig.on_loop(lambda: next(iter(rig.consumer._dealers.values())).silence.threshold()))


@pytest.mark.parametrize("adaptive", [True, False])
def test_p_that_stalls_ever_longer_but_answers_is_waited_on(adaptive: bool) -> None:
    ceiling = 10.0 if adaptive else 0.0  # 0: the old fixed threshold, for contrast
    with make_rig(heartbeat_interval_s=INTERVAL, heartbeat_timeout_s=FLOOR, heartbeat_ceiling_s=ceiling, **LONG) as rig:
        p, identity, pull = start(rig)
        p.serve(until=lambda: p.pings >= LAST and not p.owed)
        if not adaptive:
            # A 1 s stall against a fixed 0.5 s: a slow P is declared dead.
            rig.wait_finished("r")
            assert p.released and rig.causes["r"][0] == "peer_dead", rig.causes
            return
        assert not p.released, rig.causes
        # It learnt the stalls, with room to spare.
        wait_until(lambda: threshold(rig) >= 2 * max(STALLS.values()), 5, "D's threshold after the stalls")
        sums = p.rank.write(pull, P_BLOCKS)
        p.rank.reply(identity, pull, Status.FINISH, ok_reqs=["r"], checksums=sums)
        rig.wait_finished("r")
        assert rig.causes == {} and rig.invalid == set()
        assert rig.failures("peer_dead") == 0


@pytest.mark.parametrize("answers_again", [True, False], ids=["answers-before-the-deadline", "never-answers"])
def test_p_whose_python_stops_answering_is_waited_on_until_the_requests_deadline(answers_again: bool) -> None:
    """P's Python stops (its libzmq still answers the ZMTP pings: the process is alive, starved or hung).
    Its silence past the ceiling fails nothing: a P that answers again before the request's own deadline
    serves the pull, one that never does fails it at that deadline as `deadline`, naming the stage, never
    as `peer_dead`."""
    ceiling, deadline = 1.0, 5.0
    with make_rig(heartbeat_interval_s=INTERVAL, heartbeat_timeout_s=FLOOR, heartbeat_ceiling_s=ceiling,
                  recv_timeout_s=30.0, kv_load_deadline_s=deadline) as rig:
        started = time.monotonic()
        p, identity, pull = start(rig)
        p.stalls = {}
        p.serve(until=lambda: p.pings >= 5 and not p.owed)
        frozen = p.last_ack  # from now on P's Python answers nothing; its libzmq still does
        if answers_again:
            time.sleep(3 * ceiling)  # three ceilings of silence
            assert "r" not in rig.finished, rig.causes
            p.serve(until=lambda: p.pings >= 10 and not p.owed)
            sums = p.rank.write(pull, P_BLOCKS)
            p.rank.reply(identity, pull, Status.FINISH, ok_reqs=["r"], checksums=sums)
            rig.wait_finished("r")
            assert rig.causes == {} and rig.invalid == set() and not p.released
            assert np.array_equal(rig.d_kv[D_BLOCKS], rig.p_kv[P_BLOCKS])
            return
        rig.wait_finished("r", timeout=deadline + 5)
        detected = time.monotonic() - frozen
        cause, message = rig.causes["r"]
        assert cause == "deadline" and rig.failures("peer_dead") == 0, rig.causes
        assert f"within {deadline}s" in message and "P rank 0: pull not answered" in message, message
        # The request's own deadline, counted from its start (and a second of slack for a busy box).
        assert deadline - (frozen - started) - 0.5 < detected <= deadline + 1.0, detected


def test_a_p_that_answers_heartbeats_gets_to_give_its_own_answer_past_recv_timeout() -> None:
    """P holds D's pull but has not taken in the request (vLLM still queues it; its heartbeat acks say
    so), and its own answer (`not ready` after its abort timeout, counted on P's clock) comes after D's
    `recv_timeout_s`: D waits for P's answer. Before, D failed the pull `recv_timeout` first
    (`kvferry bench vllm --hogs 6`: a P whose Python was starved took in D's pull late, so its abort
    timeout ran out after D's)."""
    recv = 0.5
    with make_rig(heartbeat_interval_s=INTERVAL, heartbeat_timeout_s=FLOOR, recv_timeout_s=recv,
                  kv_load_deadline_s=10.0) as rig:
        p, identity, pull = start(rig)
        p.stalls, p.ack = {}, HeartbeatAck(unknown=[pull.transfer_id])
        held_until = time.monotonic() + 3 * recv
        p.serve(until=lambda: time.monotonic() > held_until)
        assert "r" not in rig.finished and not p.released, f"D gave up on a P that answers: {rig.causes}"
        p.rank.reply(identity, pull, Status.FINISH, err_reqs=["r"], err_msg="Timeout waiting for P side ready")
        rig.wait_finished("r")
        assert rig.causes["r"][0] == "err_reqs" and rig.invalid == set(D_BLOCKS), rig.causes


def test_a_live_p_that_has_not_answered_the_pull_is_asked_again_not_failed() -> None:
    """P answers heartbeats but not D's pull past `recv_timeout_s` (the pull or its answer was lost, or
    P's write runs long on a starved box): a live P is never failed by the receive timeout. D sends the
    same pull again (P answers a repeat idempotently) and waits, and P's answer to the repeat serves
    the request. Before, D failed it `recv_timeout` while P lived (`kvferry bench vllm --hogs 6`: one
    request per full run, 35 s after its pull, well before its 60 s deadline)."""
    recv = 0.4
    with make_rig(heartbeat_interval_s=INTERVAL, heartbeat_timeout_s=FLOOR, recv_timeout_s=recv,
                  kv_load_deadline_s=10.0) as rig:
        p, _, pull = start(rig)
        p.stalls = {}
        p.serve(until=lambda: len(p.pulls) >= 2)  # asked again twice: P was never given up on
        rig.drain()
        assert "r" not in rig.finished and not p.released, f"D gave up on a P that answers: {rig.causes}"
        identity, again = p.pulls[-1]
        assert (again.transfer_id, again.grant_token, again.block_ids) == (pull.transfer_id, pull.grant_token,
                                                                           pull.block_ids)
        sums = p.rank.write(again, P_BLOCKS)
        p.rank.reply(identity, again, Status.FINISH, ok_reqs=["r"], checksums=sums)
        rig.wait_finished("r")
        assert rig.causes == {} and rig.invalid == set(), rig.causes
        np.testing.assert_array_equal(rig.d_kv[D_BLOCKS], rig.p_kv[P_BLOCKS])


def test_a_live_p_that_never_answers_fails_at_the_requests_deadline() -> None:
    """The `drop_reply` fault against a live P: asked again and again, it never answers, so the
    request's own deadline ends it (`deadline`, naming the stage), never `recv_timeout`."""
    recv, deadline = 0.3, 1.5
    with make_rig(heartbeat_interval_s=INTERVAL, heartbeat_timeout_s=FLOOR, recv_timeout_s=recv,
                  kv_load_deadline_s=deadline) as rig:
        p, _, _ = start(rig)
        p.stalls = {}
        started = time.monotonic()
        p.serve(until=lambda: bool(rig.drain() or "r" in rig.finished))
        cause, message = rig.causes["r"]
        assert cause == "deadline" and "asked again" in message, rig.causes
        assert time.monotonic() - started >= deadline - 0.5 and len(p.pulls) >= 2, p.pulls


def test_lagging_d_asks_for_a_longer_lease() -> None:
    stall = 0.6
    with make_rig(heartbeat_interval_s=INTERVAL, heartbeat_timeout_s=FLOOR, **LONG) as rig:
        p, _, _ = start(rig)
        p.stalls = {}
        p.serve(until=lambda: p.pings >= 3)
        assert all(lease >= 7 * INTERVAL for lease in p.leases)  # the floor: 7 heartbeats

        async def block_the_loop() -> None:
            time.sleep(stall)  # D's loop starved, as on an overloaded box

        asyncio.run_coroutine_threadsafe(block_the_loop(), rig.consumer.loop).result(timeout=10)
        seen = len(p.leases)
        p.serve(until=lambda: len(p.leases) > seen)
        # The gap it just lived through, with margin: P keeps the transfer across one like it.
        assert p.leases[-1] >= 2 * stall, p.leases


@contextmanager
def p_and_d(ceiling: float) -> Iterator[tuple[Producer, Consumer, Metrics, str]]:
    """A real producer (its writes slowed, so D's lease must hold them up) and a real consumer."""
    p_kv = np.random.default_rng(0).standard_normal(SPEC.shape, dtype=np.float32)
    p_metrics = Metrics()
    producer = Producer(PagedKVLayout(SPEC, p_kv), [TcpTransferEngine()], "127.0.0.1", 30.0,
                        FaultSpec(slow_ms=SLOW_WRITE_S * 1000), p_metrics)
    server = BootstrapServer("127.0.0.1", free_port())
    server.register(Registration(ENGINE_ID, 1, 0, producer.control_addrs[0], producer.boot_ids[0]))
    server.start()
    d_engine = TcpTransferEngine()
    config = ConsumerConfig(heartbeat_interval_s=INTERVAL, heartbeat_timeout_s=FLOOR, heartbeat_ceiling_s=ceiling,
                            **LONG)
    consumer = Consumer(PagedKVLayout(SPEC, np.zeros(SPEC.shape, dtype=np.float32)), [d_engine], config, Metrics())
    try:
        yield producer, consumer, p_metrics, f"127.0.0.1:{server.port}"
    finally:
        consumer.close()
        d_engine.close()
        producer.close()
        for engine in producer.engines.values():
            engine.close()
        server.stop()


@pytest.mark.parametrize("adaptive", [True, False])
def test_p_keeps_the_transfer_of_a_d_whose_loop_lags(adaptive: bool) -> None:
    """D's loop stalls (0.25, 0.25, 0.6, then 1.4 s) while P writes: D asks for a lease that covers
    the stalls it has lived through, so P never cancels; with the fixed lease (0.7 s) it does."""
    with p_and_d(10.0 if adaptive else 0.0) as (producer, consumer, p_metrics, bootstrap):
        producer.add_ready("xfer-r", "p-r", P_BLOCKS, len(P_BLOCKS) * SPEC.block_size)
        consumer.start_pulls([PullSpec("r", "xfer-r", D_BLOCKS, ENGINE_ID, bootstrap, len(D_BLOCKS) * SPEC.block_size)])
        wait_until(lambda: producer.table.writes_in_flight() == 1, 10, "P writing the pull")

        async def stall(seconds: float) -> int:
            time.sleep(seconds)  # D's loop starved, as on an overloaded box
            return consumer._tick_gaps.count

        for seconds in D_STALLS:
            ticks = asyncio.run_coroutine_threadsafe(stall(seconds), consumer.loop).result(timeout=10)
            wait_until(lambda t=ticks: consumer._tick_gaps.count >= t + 3, 10, "D heartbeating again")
        finished: set[str] = set()
        causes: dict[str, tuple[str, str]] = {}

        def done() -> bool:
            f, _, c = consumer.drain()
            finished.update(f)
            causes.update(c)
            return "r" in finished

        wait_until(done, SLOW_WRITE_S + 10, "the pull to end")
        expired = p_metrics.kv_leases_expired._value.get()
        if adaptive:
            assert causes == {} and expired == 0, causes
        else:
            assert causes["r"][0] == "transport" and expired == 1, causes
