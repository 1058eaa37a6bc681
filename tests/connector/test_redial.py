"""An established control connection that closes is not by itself a dead P (issue 32.6): a whole process
starved of the CPU (its libzmq I/O thread too) misses the ZMTP timeout and libzmq drops the connection,
though P answers again a moment later. D judges by what its re-dial meets: refused (the process is gone)
→ dead at once; a completed handshake within what P's recent round trips allow → the pulls go on (P's
ROUTER hands D's fixed routing id to the new connection, D sends its pulls again, P answers a repeated
pull idempotently); neither → dead by that bound, counted from the drop. A P restarted at the same port
answers what D sealed for the old one with NotMe, so the waiting pull ends at once, and the next one works."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest
from test_starved_p import D_BLOCKS, INTERVAL, SPEC, StarvedP, ended, p_and_d

import kvferry.connector.decode.dealer as dealer_module
from kvferry.connector.bootstrap import BootstrapClient, BootstrapServer, Registration
from kvferry.connector.decode.consumer import Consumer
from kvferry.connector.decode.dealer import Dealer
from kvferry.connector.decode.pulls import ConsumerConfig, PullSpec
from kvferry.connector.faults import FaultSpec
from kvferry.connector.layout import PagedKVLayout
from kvferry.connector.messages import FirstToken, PullRequest, PullResponse, Status
from kvferry.connector.metrics import Metrics
from kvferry.connector.prefill.producer import Producer
from kvferry.connector.prefill.transfers import TransferTable
from kvferry.harness.processes import HARNESS_SECRET
from kvferry.transfer.tcp.engine import TcpTransferEngine
from procs import free_port, wait_until

P_BLOCKS = [1, 2, 3, 4]  # starved_p.py's
SLOW_ACK_S = 1.0  # P's interpreter held this long, twice: its acks come ~1 s late, so D's bound is ~4 s
STOPPED_S = 2.0  # 4x the ZMTP timeout (0.5 s): the connection drops; a second under the bound the slow acks allow


def pulling(consumer: Consumer) -> bool:
    """D's pull went out to P on an established connection."""
    return any(d.connected and d.waiters for d in list(consumer._dealers.values()))


def starve_then_drop(p: StarvedP, dealer: Dealer, starve_s: float, stop_after_s: float) -> None:
    """P's Python silent for `starve_s`; `stop_after_s` into it the whole process is stopped until its
    connection drops, then let go at once; returns when the starve ended."""
    assert p.proc.stdin is not None and p.proc.stdout is not None
    p.proc.stdin.write(f"starve {starve_s}\n")
    p.proc.stdin.flush()
    time.sleep(stop_after_s)
    os.kill(p.proc.pid, signal.SIGSTOP)
    try:
        wait_until(lambda: not dealer.connected, 5, "libzmq to drop the connection of the stopped P", interval=0.002)
    finally:
        os.kill(p.proc.pid, signal.SIGCONT)
    assert p.proc.stdout.readline().strip() == "ok"


def test_a_p_stopped_past_the_zmtp_timeout_within_the_bound_its_slow_acks_allow_is_not_dead() -> None:
    with p_and_d() as (p, consumer, causes, finished):
        p.do("working xfer-a p-a")  # P has the request queued: D's pull is parked there, heartbeating
        consumer.start_pulls([PullSpec("a", "xfer-a", D_BLOCKS, "starved-p", p.bootstrap, 16)])
        wait_until(lambda: pulling(consumer), 10, "D pulling from P")
        dealer = next(iter(consumer._dealers.values()))
        for _ in range(2):  # a loaded box: P's acks come late (its connection holds: libzmq answers)
            time.sleep(3 * INTERVAL)
            p.do(f"starve {SLOW_ACK_S}")
        wait_until(lambda: dealer.silence.threshold() >= STOPPED_S + 1.0, 10, "D's bound to follow the slow acks")
        os.kill(p.proc.pid, signal.SIGSTOP)  # the whole process, its I/O thread too: the ZMTP timeout passes
        stopped = time.monotonic()
        wait_until(lambda: not dealer.connected, 5, "libzmq to drop the connection of the stopped P")
        time.sleep(max(0.0, stopped + STOPPED_S - time.monotonic()))
        os.kill(p.proc.pid, signal.SIGCONT)
        p.do("ready xfer-a p-a")
        wait_until(lambda: ended(consumer, causes, finished, "a"), 20, "the pull to end")
        assert causes == {}, f"D gave up on a P that was only stopped for {STOPPED_S}s: {causes}"
        p_kv = np.random.default_rng(0).standard_normal(SPEC.shape, dtype=np.float32)  # starved_p.py's KV
        d_kv = consumer.layout.kv_cache  # type: ignore[attr-defined]
        assert np.array_equal(d_kv[D_BLOCKS], p_kv[P_BLOCKS]), "D's blocks are not P's bytes"
        assert consumer.pending_pulls == 0 and not dealer.waiters and dealer.connected and dealer.dropped is None
        wait_until(lambda: p.ask("held") == "ok 0", 10, "P to free the transfer")


def test_a_drop_after_long_python_silence_is_judged_from_the_drop() -> None:
    """P's Python silent past the bound its slow acks allow (tolerated: libzmq answered for its process),
    then the whole process stopped just past the ZMTP timeout, so the connection drops. The connection
    proves the process answered until a ZMTP timeout before the drop: the bound counts from there. Before,
    it counted from P's last *Python* answer, and such a P was dead the moment its connection dropped
    ("unreachable for 0.0s": 4 of the 5 false peer_dead of `kvferry bench vllm --hogs 6`, 2026-12-06)."""
    with p_and_d() as (p, consumer, causes, finished):
        p.do("working xfer-a p-a")
        consumer.start_pulls([PullSpec("a", "xfer-a", D_BLOCKS, "starved-p", p.bootstrap, 16)])
        wait_until(lambda: pulling(consumer), 10, "D pulling from P")
        dealer = next(iter(consumer._dealers.values()))
        for _ in range(2):  # slow acks, as on a loaded box
            time.sleep(3 * INTERVAL)
            p.do(f"starve {SLOW_ACK_S}")
        wait_until(lambda: dealer.silence.threshold() >= 3.0, 10, "D's bound to follow the slow acks")
        bound = dealer.silence.threshold()
        starve_then_drop(p, dealer, bound + 2.5, bound + 0.5)
        p.do("ready xfer-a p-a")
        wait_until(lambda: ended(consumer, causes, finished, "a"), 20, "the pull to end")
        assert causes == {}, f"D gave up on a P whose process lived until its connection dropped: {causes}"
        assert consumer.pending_pulls == 0 and dealer.connected and dealer.dropped is None


def test_a_drop_after_python_silence_on_an_idle_history_is_judged_by_the_redial() -> None:
    """No slow acks before (D's bound is the 0.5 s floor); P's Python silent past it, then the whole
    process stopped just long enough for its connection to drop, and let go at once: its re-dial
    completes, so P lives. Judged by the silence before the drop, it was dead the moment the connection
    dropped ("unreachable for 0.0s after its connection dropped (last heard 0.5s ago)"): what a D
    starved by vLLM's TP workers met with live P's."""
    with p_and_d() as (p, consumer, causes, finished):
        p.do("working xfer-a p-a")
        consumer.start_pulls([PullSpec("a", "xfer-a", D_BLOCKS, "starved-p", p.bootstrap, 16)])
        wait_until(lambda: pulling(consumer), 10, "D pulling from P")
        dealer = next(iter(consumer._dealers.values()))
        starve_then_drop(p, dealer, 2.0, 0.6)  # P's Python silent four times the bound
        p.do("ready xfer-a p-a")
        wait_until(lambda: ended(consumer, causes, finished, "a"), 20, "the pull to end")
        assert causes == {}, f"D gave up on a P whose connection dropped and came back: {causes}"
        assert consumer.pending_pulls == 0 and dealer.connected and dealer.dropped is None


@pytest.mark.parametrize("sig", [signal.SIGSTOP, signal.SIGKILL], ids=["SIGSTOP", "kill-9"])
def test_a_stopped_or_killed_p_on_an_idle_history_is_dead_as_fast_as_before(sig: signal.Signals) -> None:
    """Stopped: dead as its connection drops (the bound, 0.5 s, has run out by then). Killed: the
    re-dial is refused ~10-20 ms later."""
    with p_and_d() as (p, consumer, causes, finished):
        p.do("working xfer-b p-b")
        consumer.start_pulls([PullSpec("b", "xfer-b", D_BLOCKS, "starved-p", p.bootstrap, 16)])
        wait_until(lambda: pulling(consumer), 10, "D pulling from P")
        time.sleep(3 * INTERVAL)
        os.kill(p.proc.pid, sig)
        signalled = time.monotonic()
        wait_until(lambda: ended(consumer, causes, finished, "b"), 10, "D to notice P", interval=0.002)
        detected = time.monotonic() - signalled
        assert causes["b"][0] == "peer_dead", causes
        assert ("unreachable" if sig == signal.SIGSTOP else "refused") in causes["b"][1], causes
        # The ZMTP timeout (0.5 s) and a heartbeat tick; the refusal, ~10-30 ms (`kvferry bench failover`
        # measures it), with room for a box whose load is 20-30 (the scheduler alone then costs 0.1-0.3 s).
        bound = 1.5 if sig == signal.SIGSTOP else 0.5
        print(f"{sig.name}: peer_dead after {detected:.3f}s ({causes['b'][1]})")
        assert detected <= bound, f"P was seen {detected:.3f}s after {sig.name}"


@pytest.mark.parametrize("fast", [False, True], ids=["after-the-refused-redial", "before-the-redial"])
def test_p_restarted_at_its_fixed_port_mid_pull_ends_the_pull_and_the_next_one_works(
        fast: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The new P comes up after D's re-dial was refused, or before it (libzmq's re-dial held back
    0.5-1 s, so the re-dial reaches the new P, which answers what D sealed for the old one with NotMe)."""
    if fast:
        monkeypatch.setattr(dealer_module, "RECONNECT_MS", 500)
    secret, port = HARNESS_SECRET.encode(), free_port()
    server = BootstrapServer("127.0.0.1", free_port(), secret=secret)
    server.start()
    d_kv = np.zeros(SPEC.shape, dtype=np.float32)
    d_engine = TcpTransferEngine(secret=secret)
    consumer = Consumer(PagedKVLayout(SPEC, d_kv), [d_engine],
                        ConsumerConfig(recv_timeout_s=30, kv_load_deadline_s=30, secret=secret), Metrics(),
                        BootstrapClient(secret=secret))
    causes: dict[str, tuple[str, str]] = {}
    finished: set[str] = set()
    ps: list[tuple[Producer, TcpTransferEngine]] = []

    def start_p(value: float) -> Producer:
        engine = TcpTransferEngine(secret=secret)
        producer = Producer(PagedKVLayout(SPEC, np.full(SPEC.shape, value, dtype=np.float32)), [engine], "127.0.0.1",
                            30.0, FaultSpec(), Metrics(), secret, control_port=port)
        ps.append((producer, engine))
        server.register(Registration("p", 1, 0, producer.control_addrs[0], producer.boot_ids[0]))
        return producer

    try:
        first = start_p(1.0)
        first.add_working("x0", "p0")  # the pull waits at P
        consumer.start_pulls([PullSpec("d0", "x0", D_BLOCKS, "p", f"127.0.0.1:{server.port}", 16)])
        wait_until(lambda: pulling(consumer), 10, "D pulling")
        closed = time.monotonic()
        first.close()
        if fast:
            start_p(2.0).add_ready("x1", "p1", P_BLOCKS, 16)
        wait_until(lambda: ended(consumer, causes, finished, "d0"), 10, "the pull on the old P to end")
        took = time.monotonic() - closed
        if not fast:
            start_p(2.0).add_ready("x1", "p1", P_BLOCKS, 16)
        assert causes["d0"][0] == "peer_dead", causes
        assert ("a new process answers" if fast else "refused") in causes["d0"][1], causes
        # The re-dial (1 s at most), then the new P's NotMe to the pull sent again; or the refusal.
        assert took <= (1.5 if fast else 0.2), f"the pull on the restarted P ended after {took:.2f}s"
        consumer.start_pulls([PullSpec("d1", "x1", D_BLOCKS, "p", f"127.0.0.1:{server.port}", 16)])
        wait_until(lambda: ended(consumer, causes, finished, "d1"), 10, "the next pull")
        assert "d1" not in causes, causes
        assert (d_kv[D_BLOCKS] == 2.0).all()
    finally:
        consumer.close()
        d_engine.close()
        for producer, engine in ps:
            producer.close()
            engine.close()
        server.stop()


def test_p_answers_a_repeated_pull_as_it_did_the_first() -> None:
    """What D sends again after a re-dial: while the write is in flight, CONTINUE and no second write;
    once it ended, the very answer it gave (its checksums, P's first token); another grant is refused."""
    table = TransferTable(30.0, Metrics(), lambda d_tp: {(0, 0)})
    table.add_ready("t", "p-t", [4, 5], 8, 0.0, "digest", FirstToken(7, 0.0))
    pull = PullRequest("t", "d-t", "127.0.0.1:1", "grant-1", [0, 1], 8, 1, 0, 8, lease_s=2.0, prompt_digest="digest")
    first = table.begin_pull(pull, 0, 1.0)
    assert first.kind == "write" and first.write is not None
    assert table.begin_pull(pull, 0, 1.5).kind == "writing"
    assert table.writes_in_flight() == 1
    # D's heartbeat meanwhile: P owes the pull its answer, so D waits past its receive timeout (a
    # write on a starved box may outlast it). Before, the ack listed nothing for a transfer in flight.
    assert table.renew(["t"], 2.0, 1.6) == ([], ["t"])
    other = PullRequest("t", "d-t", "127.0.0.1:1", "grant-2", [0, 1], 8, 1, 0, 8, lease_s=2.0, prompt_digest="digest")
    assert table.begin_pull(other, 0, 1.5).kind == "refused"
    finish = PullResponse(Status.FINISH, "d-t", "t", ok_reqs=["d-t"], checksums=[11, 12], first_token=FirstToken(7, 0.0))
    table.write_done(first.write, failed=False, answer=finish)
    assert len(table) == 0  # served and freed: only its answer is remembered
    again = table.begin_pull(pull, 0, 2.0)
    assert again.kind == "answered" and again.answer == finish
    assert table.begin_pull(other, 0, 2.0).kind == "ended"


def test_a_p_rank_gone_before_d_ever_connected_fails_the_pull_at_once() -> None:
    """P's bootstrap server still names a rank whose process is gone (its worker died; the engine and
    its bootstrap server live on): D's first dial is refused, so the pull fails `peer_dead` at once,
    not at the receive timeout (abort timeout + 5 s) as before."""
    secret = HARNESS_SECRET.encode()
    server = BootstrapServer("127.0.0.1", free_port(), secret=secret)
    server.start()
    engine = TcpTransferEngine(secret=secret)
    producer = Producer(PagedKVLayout(SPEC, np.ones(SPEC.shape, dtype=np.float32)), [engine], "127.0.0.1", 30.0,
                        FaultSpec(), Metrics(), secret)
    server.register(Registration("p", 1, 0, producer.control_addrs[0], producer.boot_ids[0]))
    producer.close()  # the rank is gone; its registration stays
    engine.close()
    d_engine = TcpTransferEngine(secret=secret)
    consumer = Consumer(PagedKVLayout(SPEC, np.zeros(SPEC.shape, dtype=np.float32)), [d_engine],
                        ConsumerConfig(recv_timeout_s=30, kv_load_deadline_s=60, secret=secret), Metrics(),
                        BootstrapClient(secret=secret))
    causes: dict[str, tuple[str, str]] = {}
    finished: set[str] = set()
    try:
        started = time.monotonic()
        consumer.start_pulls([PullSpec("d0", "x0", D_BLOCKS, "p", f"127.0.0.1:{server.port}", 16)])
        wait_until(lambda: ended(consumer, causes, finished, "d0"), 40, "the pull to end")
        took = time.monotonic() - started
        assert causes["d0"][0] == "peer_dead" and "refused" in causes["d0"][1], causes
        assert took <= 1.0, f"the pull on a gone P rank ended after {took:.2f}s"
    finally:
        consumer.close()
        d_engine.close()
        server.stop()
