"""Graceful drain: SIGTERM (or `POST /drain`, for a Kubernetes preStop hook) stops admitting requests and
lets the instance finish what it holds before it exits 0.

P holds the KV of every prefill it answered until D pulls it, releases it, or P's abort timeout expires;
exiting before that turns D's pull into a `bootstrap` or `peer_dead` failure. So a draining instance:
  1. answers `/health` and every new completion with 503 (the proxy and the routers take it out of rotation,
     and retry the request elsewhere);
  2. keeps its engine, bootstrap server and data plane running until nothing is left: no request waiting,
     running or loading KV, no prefill held for a D, no write in flight — and at least `grace_s` has passed,
     so a proxy polling `/health` sees "draining" before the port closes;
  3. then lets uvicorn close (in-flight HTTP responses end first) and the process exits 0.
A second SIGTERM (or SIGINT) ends the drain at once; `timeout_s` bounds it otherwise.

`grace_s` is 0 by default: kvferry's proxy retries a refused connection on another instance, so P may close
its port the moment it holds nothing; a load balancer that only polls `/health` wants a grace of a few of
its polling intervals."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import signal
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

import uvicorn

log = logging.getLogger(__name__)

# How often the drain looks at the engine's state; a snapshot costs the engine thread one command.
_POLL_S = 0.1


def holds_nothing(state: dict[str, Any]) -> bool:
    """Nothing in this engine snapshot (engine.snapshot()) that a peer or a client still waits for."""
    connector = state.get("connector") or {}
    return (
        sum(int(n) for n in (state.get("requests_by_status") or {}).values()) == 0
        and int(state.get("pending_sends", 0)) == 0
        and int(state.get("pending_pulls", 0)) == 0
        and int(connector.get("writes_in_flight", 0)) == 0
    )


class Drain:
    """One instance's drain: started once (by a signal or by `POST /drain`), finished when `snapshot` says
    the instance holds nothing, when `timeout_s` passes, or on `force()`."""

    def __init__(self, snapshot: Callable[[], dict[str, Any]], timeout_s: float, grace_s: float = 0.0) -> None:
        self._snapshot = snapshot
        self.timeout_s = timeout_s
        self.grace_s = grace_s
        self.started_at: float | None = None
        self.outcome = ""  # "idle", "timeout" or "forced" once it ended
        self._forced = False
        # Called once the drain ended (the server sets it to leave its serve loop).
        self.on_done: Callable[[], None] = lambda: None
        self._task: asyncio.Task[None] | None = None

    @property
    def draining(self) -> bool:
        return self.started_at is not None

    def status(self) -> dict[str, Any]:
        since = 0.0 if self.started_at is None else time.monotonic() - self.started_at
        # JSON has no infinity: an unbounded drain says null.
        bound = self.timeout_s if math.isfinite(self.timeout_s) else None
        return {"status": "draining", "draining_for_s": round(since, 3), "drain_timeout_s": bound}

    def start(self, why: str) -> None:
        """Begin draining (idempotent); must be called on the event loop's thread."""
        if self.started_at is not None:
            return
        self.started_at = time.monotonic()
        log.warning("draining (%s): no new requests; exiting once nothing is held (at most %.1fs)", why, self.timeout_s)
        self._task = asyncio.get_running_loop().create_task(self._run())

    def force(self) -> None:
        self._forced = True

    async def _run(self) -> None:
        assert self.started_at is not None
        deadline = self.started_at + self.timeout_s
        loop = asyncio.get_running_loop()
        while not self._forced:
            now = time.monotonic()
            if now >= deadline:
                self.outcome = "timeout"
                break
            if now - self.started_at >= self.grace_s:
                try:
                    # The snapshot waits on the engine thread: keep it off the event loop.
                    state = await loop.run_in_executor(None, self._snapshot)
                except Exception as exc:  # a dead engine holds nothing it could still hand over
                    log.warning("drain: engine state unavailable (%r): ending the drain", exc)
                    self.outcome = "engine gone"
                    break
                if holds_nothing(state):
                    self.outcome = "idle"
                    break
            await asyncio.sleep(_POLL_S)
        else:
            self.outcome = "forced"
        log.warning("drain ended (%s) after %.2fs", self.outcome, time.monotonic() - self.started_at)
        self.on_done()


class DrainingServer(uvicorn.Server):
    """uvicorn's server, but SIGTERM drains instead of closing at once; a second SIGTERM, or SIGINT (Ctrl-C,
    and the test harness's stop), closes now (in-flight HTTP responses still end). The process exits 0
    either way (uvicorn would re-raise the signal: exit -15)."""

    def __init__(self, config: uvicorn.Config, drain: Drain) -> None:
        super().__init__(config)
        self.drain = drain
        drain.on_done = self._drained
        self._loop: asyncio.AbstractEventLoop | None = None
        self._terms = 0

    async def serve(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def _drained(self) -> None:
        self.should_exit = True

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Runs in a signal handler (signals that arrive together may come as one call): flags only, and
        # the drain is started by the event loop (call_soon_threadsafe also wakes it up).
        self._terms += sig == signal.SIGTERM
        if sig != signal.SIGTERM or self._terms > 1 or self._loop is None:
            self.force_exit = self.should_exit  # a third signal: do not wait for in-flight responses
            self.drain.force()
            self.should_exit = True
            return
        with contextlib.suppress(RuntimeError):  # the loop already closed
            self._loop.call_soon_threadsafe(self.drain.start, signal.Signals(sig).name)
