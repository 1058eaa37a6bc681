"""A hypothesis state machine over D's view of one P's liveness (issue 32.6; house rule: let hypothesis
look for the hang or the leak in every state machine). A real P process (starved_p.py: producer, TCP data
plane, bootstrap server, the secret set) and a real consumer on loopback; hypothesis interleaves pulls
(served at once, parked while P "prefills", or sent before P has heard of the request at all, so P
parks it as unknown), P's Python starved (the GIL held: libzmq still answers),
the whole process stopped (SIGSTOP, then SIGCONT), kill -9 (and a new P), and time passing.

Checked after every step: a pull that ended has the outcome its history allows — served with P's exact
bytes; `deadline` only after P's Python was silent past the ceiling while its process lived; `peer_dead`
only after the process itself was stopped past every bound or killed: a starved P is never called dead,
a pull P never answered is never loaded; `bootstrap` only when P's bootstrap server could not answer
D's first query (starved, stopped or killed). At the end every pull ended within a bound (no hang), D's
tables are empty, and P holds no transfer but those of pulls that failed `bootstrap` (D never learnt
where to release them: P frees them at its abort timeout): nothing leaks on either side.

CI runs a few derandomized examples (real processes and seconds of real time each);
`KVFERRY_DEALER_EXAMPLES=N` hunts with N random ones.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass, field

import hypothesis.strategies as st
import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from starved_p import P_BLOCKS, SPEC
from test_starved_p import INTERVAL, TIMEOUT, StarvedP

from kvferry.connector.decode.consumer import Consumer
from kvferry.connector.decode.pulls import ConsumerConfig, PullSpec
from kvferry.connector.layout import PagedKVLayout
from kvferry.connector.metrics import Metrics
from kvferry.harness.processes import HARNESS_SECRET
from kvferry.transfer.tcp.engine import TcpTransferEngine
from procs import wait_until

CEILING_S = 3.0  # D's bound on P's Python silence while libzmq says the process lives
LONG_S = CEILING_S + 1.0  # a starve or a stop past every bound
SHORT_STARVE_S, SHORT_STOP_S = 0.5, 0.2  # well inside the ceiling / the ZMTP timeout (0.5 s)
# D's blocks for each pull in flight: disjoint groups of P_BLOCKS' size, none of P's own.
GROUPS = [[8 + k, 14 + k, 20 + k, 26 + k] for k in range(6)]
END_S = 15.0  # every pull ends within this once P answers or is judged (no hang)
P_KV = np.random.default_rng(0).standard_normal(SPEC.shape, dtype=np.float32)  # starved_p.py's KV


@dataclass
class Pull:
    rid: str
    tid: str
    group: list[int]
    parked: bool  # P "prefills" it, or has not heard of it yet: it waits until `make_ready`
    p_gen: int  # which P process holds its transfer
    allowed: set[str | None] = field(default_factory=lambda: {None})  # outcomes its history allows


class DealerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.p = StarvedP()
        self.engine = TcpTransferEngine(secret=HARNESS_SECRET.encode())
        config = ConsumerConfig(heartbeat_interval_s=INTERVAL, heartbeat_timeout_s=TIMEOUT,
                                heartbeat_ceiling_s=CEILING_S, recv_timeout_s=30, kv_load_deadline_s=60,
                                secret=HARNESS_SECRET.encode())
        self.kv = np.zeros(SPEC.shape, dtype=np.float32)
        self.consumer = Consumer(PagedKVLayout(SPEC, self.kv), [self.engine], config, Metrics())
        self.pulls: dict[str, Pull] = {}  # in flight
        self.free = list(range(len(GROUPS)))
        self.n = 0
        self.p_gen = 0  # P processes started before this one
        # Transfers the current P holds for pulls that failed `bootstrap` (D never learnt P's control
        # address, so it cannot release them): P frees them at its abort timeout, by design.
        self.unreached = 0
        self.log: list[str] = []

    # ---- rules ---------------------------------------------------------------------------------------
    @precondition(lambda self: self.free)
    @rule(start=st.sampled_from(["ready", "working", "unknown"]))
    def start_pull(self, start: str) -> None:
        """`unknown`: D's pull comes before P's scheduler has the request (vLLM's P still queues it)."""
        self.n += 1
        pull = Pull(f"r{self.n}", f"x{self.n}", GROUPS[self.free.pop(0)], start != "ready", self.p_gen)
        if start != "unknown":
            self.p.do(f"{start} {pull.tid} p-{pull.tid}")
        self.pulls[pull.rid] = pull
        self.consumer.start_pulls([PullSpec(pull.rid, pull.tid, pull.group, "starved-p", self.p.bootstrap, 16)])
        self.log.append(f"pull {pull.rid} {start}")

    @precondition(lambda self: any(p.parked for p in self.pulls.values()))
    @rule(which=st.integers(0, 5))
    def make_ready(self, which: int) -> None:
        parked = [p for p in self.pulls.values() if p.parked]
        pull = parked[which % len(parked)]
        pull.parked = False
        self.p.do(f"ready {pull.tid} p-{pull.tid}")
        self.log.append(f"ready {pull.rid}")

    @rule(long=st.booleans())
    def starve(self, long: bool) -> None:
        """P's Python held (its libzmq answers): past the ceiling, what waits fails as `deadline` (or
        `bootstrap`: D's query to P's bootstrap server, if still out, is bounded at 2 s)."""
        if long:
            self.allow("deadline", "bootstrap")
        self.p.do(f"starve {LONG_S if long else SHORT_STARVE_S}")
        self.log.append(f"starve {'long' if long else 'short'}")

    @rule(long=st.booleans())
    def stop(self, long: bool) -> None:
        """The whole process stopped (its I/O thread too): past every bound, what waits is `peer_dead`
        (or `bootstrap`, as above)."""
        if long:
            self.allow("peer_dead", "bootstrap")
        os.kill(self.p.proc.pid, signal.SIGSTOP)
        time.sleep(LONG_S if long else SHORT_STOP_S)
        os.kill(self.p.proc.pid, signal.SIGCONT)
        self.log.append(f"stop {'long' if long else 'short'}")

    @rule()
    def kill_and_restart(self) -> None:
        """kill -9: what waits is `peer_dead` (`bootstrap` if D had not reached P yet); a new P (another
        bootstrap address) takes the next pulls."""
        self.allow("peer_dead", "bootstrap")
        self.p.proc.kill()
        self.p.proc.wait()
        self.p = StarvedP()
        self.p_gen += 1
        self.unreached = 0
        for pull in self.pulls.values():
            pull.parked = False  # the new P never heard of them: nothing to make ready
        self.log.append("kill -9, new P")

    @rule(seconds=st.sampled_from([0.1, 0.5]))
    def wait(self, seconds: float) -> None:
        time.sleep(seconds)

    def allow(self, *causes: str) -> None:
        for pull in self.pulls.values():
            pull.allowed.update(causes)

    # ---- checks --------------------------------------------------------------------------------------
    @invariant()
    def ended_pulls_are_right(self) -> None:
        finished, _, causes = self.consumer.drain()
        for rid in finished:
            pull = self.pulls.pop(rid)
            cause = causes.get(rid, (None, ""))
            assert cause[0] in pull.allowed, f"{rid} ended {cause}, allowed {pull.allowed}; steps: {self.log}"
            if cause[0] is None:
                assert np.array_equal(self.kv[pull.group], P_KV[P_BLOCKS]), f"{rid}: D's blocks are not P's bytes"
            if pull.p_gen == self.p_gen:
                self.unreached += cause[0] == "bootstrap"
                if pull.parked:  # P's prefill ends whether or not D still waits (as in vLLM)
                    self.make_ready_now(pull)
            self.free.append(GROUPS.index(pull.group))
            self.log.append(f"ended {rid} {cause[0] or 'ok'}")

    def teardown(self) -> None:
        try:
            for pull in self.pulls.values():
                if pull.parked:
                    self.make_ready_now(pull)
            wait_until(self.all_ended, END_S, f"every pull to end; steps: {self.log}")
            assert self.consumer.pending_pulls == 0
            assert not any(d.waiters for d in list(self.consumer._dealers.values()))
            wait_until(lambda: self.p.ask("held") == f"ok {self.unreached}", 10,
                       f"P to hold only the {self.unreached} transfer(s) D never reached; steps: {self.log}")
        finally:
            self.consumer.close()
            self.engine.close()
            os.kill(self.p.proc.pid, signal.SIGCONT)
            self.p.proc.kill()
            self.p.proc.wait()

    def all_ended(self) -> bool:
        self.ended_pulls_are_right()
        return not self.pulls

    def make_ready_now(self, pull: Pull) -> None:
        pull.parked = False
        self.p.do(f"ready {pull.tid} p-{pull.tid}")


def test_dealer_liveness_machine() -> None:
    hunt = int(os.environ.get("KVFERRY_DEALER_EXAMPLES", "0"))
    run_state_machine_as_test(DealerMachine, settings=settings(
        max_examples=hunt or 4, stateful_step_count=8, deadline=None, derandomize=not hunt,
        suppress_health_check=list(HealthCheck), print_blob=True))
