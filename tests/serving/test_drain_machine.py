"""P's drain under every interleaving hypothesis finds (issue 32.1): prefills answered (transfers held), D's pulls,
D's releases, transfers left to expire, new prefills (also racing the drain's start), the drain started at any
point by `POST /drain` or by SIGTERM (the server's own signal handler), a second SIGTERM or a SIGINT, and a drain
timeout shorter or longer than P's abort timeout. All real and in-process: P's engine with its PDConnector
behind `DrainingServer`, D's engine behind its API, both on loopback sockets; the test thread plays the proxy.

Invariants after every step: before the drain P is healthy; once it started a new prefill is refused with the
503 `draining` (or, once P is gone, the connection); P never leaves while it holds a transfer that has not
expired, unless forced or past its drain timeout; a pull of a held transfer while P serves gives the colocated
text. At teardown: the drain ends within its bound (no hang), idle when nothing forced it, with P's KV pool
whole; D's pool is whole; threads and fds are back where they were."""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid
from typing import Any

import httpx
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from inproc import ServerThread, config

from kvferry.connector.base import ConnectorRole
from kvferry.connector.config import PDConfig
from kvferry.connector.facade import PDConnector
from kvferry.connector.metrics import Metrics
from kvferry.engine.engine import Engine, EngineConfig
from kvferry.engine.request import Request, SamplingParams
from kvferry.serving.api_server import build_app
from kvferry.serving.drain import Drain, DrainingServer
from kvferry.transfer.addr import join_addr
from procs import free_port, wait_until

ABORT_S = 2.0  # P's abort timeout: an unpulled transfer expires this long after its prefill
MARGIN_S = 0.3  # how near a deadline a step may land on either side of it
PROMPT = "drain machine: " + "kv " * 12
SETTLE_S = 10.0  # what a loaded box may take for what should happen at once


def _engine(role: str, engine_id: str, bootstrap_port: int = 0) -> Engine:
    pd = PDConfig(role=role, engine_id=engine_id, bootstrap_port=bootstrap_port, abort_timeout_s=ABORT_S,
                  heartbeat_timeout_s=3.0)
    metrics = Metrics()
    engine = Engine(EngineConfig(num_blocks=64, seed=0, role=role, engine_id=engine_id),
                    PDConnector(ConnectorRole.SCHEDULER, pd, metrics), PDConnector(ConnectorRole.WORKER, pd, metrics),
                    metrics)
    engine.start()
    return engine


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


class Prefill:
    """P as `kvferry serve --role prefill` runs it: the server, and the engine stopped once the server leaves."""

    def __init__(self, drain_timeout_s: float) -> None:
        self.bootstrap_port = free_port()
        self.engine = _engine("prefill", f"p-{uuid.uuid4().hex[:8]}", self.bootstrap_port)
        self.drain = Drain(self.engine.snapshot, timeout_s=drain_timeout_s)
        extra = {"kv_bootstrap_addr": join_addr("127.0.0.1", self.bootstrap_port)}
        self.server = DrainingServer(config(build_app(self.engine, extra, (), self.drain)), self.drain)
        self.thread = ServerThread(self.server)
        self.thread.thread = threading.Thread(target=self._run, daemon=True, name="P server")
        self.final: dict[str, Any] = {}  # P's state the moment its server left
        self.ended_at: float | None = None

    def _run(self) -> None:
        try:
            self.server.run(sockets=[self.thread.sock])
        finally:
            self.ended_at = time.monotonic()
            self.final = self.engine.snapshot()
            self.engine.stop()

    @property
    def url(self) -> str:
        return self.thread.url

    @property
    def up(self) -> bool:
        return self.thread.thread.is_alive()

    def holds(self, transfer_id: str) -> bool:
        producer = self.engine.worker_connector.producer  # type: ignore[attr-defined]
        return producer.table.get(transfer_id) is not None


class DrainMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.threads, self.fds = threading.active_count(), _fds()
        # A fresh connection per request: a kept-alive one closing under a request is not what is tested.
        self.http = httpx.Client(timeout=30, limits=httpx.Limits(max_keepalive_connections=0))
        self.d = _engine("decode", "d")
        self.d_server = ServerThread.of(build_app(self.d)).start()
        self.p: Prefill | None = None
        self.held: dict[str, float] = {}  # transfer id → when its prefill was sent (its KV is older than that)
        self.gone: set[str] = set()  # released or seen expired: never to be pulled
        self.drain_started_at: float | None = None
        self.sigterms = 0
        self.may_expire = 0  # transfers P may have freed by expiry: never one D pulled or released in time
        self.forced = False
        self.reference = ""

    # ---- setup ------------------------------------------------------------------------------------
    @initialize(drain_timeout=st.sampled_from([1.0, 60.0]))
    def start_p(self, drain_timeout: float) -> None:
        self.p = Prefill(drain_timeout)
        self.p.thread.start()
        self.info = self.http.get(f"{self.p.url}/health").json()
        r = self.http.post(f"{self.d_server.url}/v1/completions", json={**self._sampling(), "prompt": PROMPT})
        assert r.status_code == 200, r.text
        self.reference = r.json()["choices"][0]["text"]  # D alone: the colocated text

    @staticmethod
    def _sampling() -> dict[str, Any]:
        return {"max_tokens": 4, "temperature": 0}

    @property
    def prefill(self) -> Prefill:
        assert self.p is not None
        return self.p

    def _live(self, now: float) -> list[str]:
        """Held transfers that certainly have not expired yet."""
        return [t for t, sent in self.held.items() if t not in self.gone and now - sent < ABORT_S - MARGIN_S]

    def _drain_may_have_timed_out(self, now: float) -> bool:
        started = self.drain_started_at
        return started is not None and now >= started + self.prefill.drain.timeout_s - MARGIN_S

    # ---- the proxy's requests -----------------------------------------------------------------------
    def _post_prefill(self, transfer_id: str) -> httpx.Response | None:
        body = {"prompt": PROMPT, "max_tokens": 1, "temperature": 0,
                "kv_transfer_params": {"do_remote_decode": True, "transfer_id": transfer_id}}
        try:
            return self.http.post(f"{self.prefill.url}/v1/completions", json=body)
        except httpx.TransportError:  # refused or reset: P's port closing
            return None

    @rule()
    def new_prefill(self) -> None:
        transfer_id = f"t-{uuid.uuid4().hex[:8]}"
        sent = time.monotonic()
        draining = self.prefill.drain.draining
        r = self._post_prefill(transfer_id)
        if not draining:
            assert r is not None and r.status_code == 200, r and r.text
            self.held[transfer_id] = sent
        else:
            self._assert_refused(r)

    def _assert_refused(self, r: httpx.Response | None) -> None:
        if r is None:  # P already left: only after its drain ended
            assert self.prefill.drain.outcome or self.forced, "P refused connections before its drain ended"
            return
        assert r.status_code == 503 and r.json()["error"]["type"] == "draining", r.text

    # Preconditions read the model only (what the steps did), never the racing world: hypothesis replays them.
    @precondition(lambda self: self.drain_started_at is None and not self.forced)
    @rule(how=st.sampled_from(["POST", "SIGTERM"]))
    def prefill_racing_the_drain(self, how: str) -> None:
        transfer_id = f"race-{uuid.uuid4().hex[:8]}"
        sent = time.monotonic()
        answer: list[httpx.Response | None] = []
        racer = threading.Thread(target=lambda: answer.append(self._post_prefill(transfer_id)))
        racer.start()
        self.start_drain(how)
        racer.join(30)
        assert answer, "the racing prefill never returned"
        if answer[0] is not None and answer[0].status_code == 200:
            self.held[transfer_id] = sent  # admitted before the drain: it must be served like the others
        else:
            self._assert_refused(answer[0])

    def _decode_body(self, transfer_id: str) -> dict[str, Any]:
        return {"prompt": PROMPT, **self._sampling(), "kv_transfer_params": {
            "do_remote_prefill": True, "transfer_id": transfer_id, "remote_engine_id": self.info["engine_id"],
            "remote_bootstrap_addr": self.info["kv_bootstrap_addr"]}}

    def _pullable(self) -> list[str]:
        return sorted(t for t in self.held if t not in self.gone)

    @rule(i=st.integers(0, 50))
    def pull(self, i: int) -> None:
        if not self._pullable():
            return
        transfer_id = self._pullable()[i % len(self._pullable())]
        now = time.monotonic()
        sure = transfer_id in self._live(now) and self.prefill.up and not self._drain_may_have_timed_out(now)
        r = self.http.post(f"{self.d_server.url}/v1/completions", json=self._decode_body(transfer_id))
        del self.held[transfer_id]
        self.may_expire += r.status_code != 200
        if r.status_code == 200:
            assert r.json()["choices"][0]["text"] == self.reference
        else:  # expired, or P left (forced or timed out): a clean 500 with the cause, never while P serves it
            assert not sure, f"P served {transfer_id} yet D's pull failed: {r.text}"
            assert r.status_code == 500 and r.json()["error"]["type"] == "kv_load_failed", r.text

    @rule(i=st.integers(0, 50))
    def release(self, i: int) -> None:
        """D turned its request away: it tells P to free the transfer (a release-only pull)."""
        if not self._pullable():
            return
        transfer_id = self._pullable()[i % len(self._pullable())]
        params = self._decode_body(transfer_id)["kv_transfer_params"]
        self.may_expire += transfer_id not in self._live(time.monotonic())
        self.d.reject(Request(f"rej-{transfer_id}", [], SamplingParams(), params, time.time()))
        self.gone.add(transfer_id)

    @rule(i=st.integers(0, 50))
    def expire(self, i: int) -> None:
        """D never comes for it: P frees it at its abort timeout."""
        if not self._pullable():
            return
        transfer_id = self._pullable()[i % len(self._pullable())]
        p = self.prefill
        wait_until(lambda: not p.up or not p.holds(transfer_id), ABORT_S + SETTLE_S, f"{transfer_id} to expire")
        self.gone.add(transfer_id)
        self.may_expire += 1

    # ---- the drain --------------------------------------------------------------------------------
    @precondition(lambda self: not self.forced)
    @rule(how=st.sampled_from(["POST", "SIGTERM"]))
    def start_drain(self, how: str) -> None:
        p = self.prefill
        if not p.up:  # its drain timed out: nothing to start
            return
        if how == "POST":
            try:
                r = self.http.post(f"{p.url}/drain")
            except httpx.TransportError:
                assert p.drain.outcome, "P refused POST /drain before its drain ended"
                return
            assert r.status_code == 202 and r.json()["status"] == "draining", r.text
        else:
            self.send_signal(signal.SIGTERM)
        if self.drain_started_at is None and not self.forced:
            self.drain_started_at = time.monotonic()
        assert p.drain.draining or self.forced

    @precondition(lambda self: self.drain_started_at is not None and not self.forced)
    @rule(sig=st.sampled_from([signal.SIGTERM, signal.SIGINT]))
    def send_signal(self, sig: signal.Signals) -> None:
        """The signal handler uvicorn would call (the server runs off the main thread: no handler installed)."""
        p = self.prefill
        self.sigterms += sig == signal.SIGTERM
        self.forced = self.forced or sig == signal.SIGINT or self.sigterms > 1
        p.server.handle_exit(sig, None)
        if self.forced:  # a second SIGTERM or SIGINT ends it now, whatever P holds
            wait_until(lambda: not p.up, SETTLE_S, "P to leave on the second signal")
        else:
            wait_until(lambda: p.drain.draining, SETTLE_S, "the drain to start on SIGTERM")

    # ---- invariants -------------------------------------------------------------------------------
    @invariant()
    def p_leaves_only_when_it_may(self) -> None:
        if self.p is None:
            return
        p = self.p
        if p.up:
            try:
                health = self.http.get(f"{p.url}/health")
            except httpx.TransportError:  # the port closes as the server leaves, after its drain ended
                assert p.drain.outcome or self.forced, "P refused /health before its drain ended"
                return
            if not p.drain.outcome:
                expected = 503 if p.drain.draining else 200
                assert health.status_code == expected, health.text
            return
        assert p.ended_at is not None
        live = self._live(p.ended_at)
        assert self.forced or self._drain_may_have_timed_out(p.ended_at) or not live, (
            f"P left holding {live} ({p.drain.outcome})")

    def teardown(self) -> None:
        try:
            if self.p is not None:
                self._end_drain(self.p)
            # Every request of D ended and every release reached P: D holds nothing.
            wait_until(lambda: _whole(self.d.snapshot()), SETTLE_S, "D's pool to be whole")
        finally:
            self.http.close()
            self.d_server.stop()
            self.d.stop()
            if self.p is not None:
                self.p.thread.stop()
        # Nothing leaks from an example: each started and stopped everything it had.
        wait_until(lambda: threading.active_count() <= self.threads, SETTLE_S, "threads to end")
        wait_until(lambda: _fds() <= self.fds + 2, SETTLE_S, "fds to close")

    def _end_drain(self, p: Prefill) -> None:
        now = time.monotonic()
        if p.up and not p.drain.draining:
            self.start_drain("SIGTERM")
        # Its bound: the last held transfer expires, or the drain times out, whichever is first.
        expiries = [self.held[t] + ABORT_S for t in self.held if t not in self.gone]
        started = self.drain_started_at or now
        bound = min(max(expiries, default=now), started + p.drain.timeout_s) + SETTLE_S
        p.thread.thread.join(max(0.0, bound - time.monotonic()))
        assert not p.up, f"the drain did not end within its bound (held: {self.held})"
        self.p_leaves_only_when_it_may()
        if not self.forced:
            assert p.drain.outcome in ("idle", "timeout"), p.drain.outcome
        if p.drain.outcome == "idle":  # every transfer was pulled, released or expired
            assert _whole(p.final), p.final
        # A release frees at once: only transfers nobody pulled or released in time expire.
        left = sum(t not in self.gone for t in self.held)
        expired = p.engine.metrics.registry.get_sample_value("kvferry_kv_leases_expired_total") or 0
        assert expired <= self.may_expire + left, f"{expired} expired, at most {self.may_expire + left} may have"


def _whole(state: dict[str, Any]) -> bool:
    return (state["blocks_free"] == state["blocks_total"] and not any(state["requests_by_status"].values())
            and state["pending_sends"] == 0 and state["pending_pulls"] == 0)


TestDrainMachine = pytest.mark.timeout(300)(DrainMachine.TestCase)
TestDrainMachine.settings = settings(max_examples=int(os.environ.get("KVFERRY_MACHINE_EXAMPLES", "25")),
                                     stateful_step_count=10, deadline=None)
