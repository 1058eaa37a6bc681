"""Graceful drain: SIGTERM (or `POST /drain`, for a Kubernetes preStop hook) stops admitting requests and
lets the instance finish what it holds before it exits 0.

P holds the KV of every prefill it answered until D pulls it, releases it, or P's abort timeout expires;
exiting before that turns D's pull into a `bootstrap` or `peer_dead` failure. So a draining instance:
  1. answers `/health` and every new completion with 503 (the proxy and the routers take it out of rotation,
     and retry the request elsewhere);
  2. keeps its engine, bootstrap server and data plane running until nothing is left: no request waiting,
     running or loading KV, no prefill held for a D, no write in flight — and at least `grace_s` has passed,
     so a proxy polling `/health` sees "draining" before the port closes;
  3. then lets uvicorn close and the process exits 0.
A second SIGTERM (or SIGINT) ends the drain at once; `timeout_s` bounds it otherwise.

A busy engine is not a dead one: while a step runs longer than the drain's wait for the engine's state (a
long prefill without chunking, a full batch on a slow CPU) the drain asks again, up to its bound; only an
engine whose thread is gone (it died or was stopped) ends the drain early, as "engine gone".

`timeout_s` also bounds the HTTP responses still in flight when the drain ends (a stream a slow client reads,
a request the engine still works on): they get what is left of it, then they are cut, so the process exits
within `timeout_s` plus what closing takes (under a second, unless the engine is inside a long step: stopping
the engine waits for that step, at most 10 s). A close without a drain (SIGINT) gives them `timeout_s` from
the signal. What a client sees when cut:
  * a stream that started: its connection closes mid-stream, without `[DONE]` (an incomplete chunked body).
    kvferry's proxy treats that as a D that died and resumes the stream on another D (serving/migrate.py,
    `--migrations`, 2 by default), so its client gets the whole answer; with `--migrations 0` the proxy's
    client sees the same cut;
  * an answer that did not start (a non-streamed completion, or a stream still waiting for its first token):
    the 503 `draining` a new request gets, which kvferry's proxy retries on another instance.

`grace_s` is 0 by default: kvferry's proxy retries a refused connection on another instance, so P may close
its port the moment it holds nothing; a load balancer that only polls `/health` wants a grace of a few of
its polling intervals."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import signal
import socket
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

import uvicorn
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvferry.engine.engine import EngineBusyError
from kvferry.serving.openai_shapes import error_body

log = logging.getLogger(__name__)

# How often the drain looks at the engine's state; a snapshot costs the engine thread one command.
_POLL_S = 0.1
# Most the drain waits for one answer from a busy engine before it asks again (and checks its bound).
_ASK_WAIT_S = 1.0


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
    the instance holds nothing, when `timeout_s` passes, or on `force()`. `snapshot(wait)` is
    `Engine.snapshot`: the engine's state within `wait` seconds, EngineBusyError when its thread is in a
    longer step, any other exception when it is gone."""

    def __init__(self, snapshot: Callable[[float], dict[str, Any]], timeout_s: float, grace_s: float = 0.0) -> None:
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

    def time_left(self) -> float | None:
        """Seconds left of the drain's bound (all of it before the drain starts); None when unbounded."""
        if not math.isfinite(self.timeout_s):
            return None
        since = 0.0 if self.started_at is None else time.monotonic() - self.started_at
        return max(0.0, self.timeout_s - since)

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
        busy = 0
        while not self._forced:
            now = time.monotonic()
            if now >= deadline:
                self.outcome = "timeout"
                break
            if now - self.started_at >= self.grace_s:
                # A wait within the bound: a busy engine never holds the drain past it.
                wait = min(_ASK_WAIT_S, max(deadline - now, 0.01))
                try:
                    # The snapshot waits on the engine thread: keep it off the event loop.
                    state = await loop.run_in_executor(None, self._snapshot, wait)
                except EngineBusyError as exc:  # in a long step: what it holds is still to be served
                    if not busy:
                        log.warning("drain: engine busy (%s): asking again until the drain's bound", exc)
                    busy += 1
                    continue
                except Exception as exc:  # a dead engine holds nothing it could still hand over
                    log.warning("drain: engine gone (%r): ending the drain", exc)
                    self.outcome = "engine gone"
                    break
                if busy:
                    log.warning("drain: engine answers again after %d busy waits", busy)
                    busy = 0
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
    and the test harness's stop), closes now. Either way the HTTP responses still in flight get what is left
    of the drain's bound, then are cut (uvicorn alone would wait for them without a limit). The process exits
    0 (uvicorn would re-raise the signal: exit -15)."""

    def __init__(self, config: uvicorn.Config, drain: Drain) -> None:
        super().__init__(config)
        self.drain = drain
        drain.on_done = self._drained
        self._loop: asyncio.AbstractEventLoop | None = None
        self._terms = 0
        self.closing = False  # set once the server closes: a request task cancelled after that is cut

    async def serve(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        if not self.config.loaded:
            self.config.load()
        self.config.loaded_app = _CutAnswers(self.config.loaded_app, self)
        await super().serve(sockets)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.closing = True
        left = self.drain.time_left()
        cut = None if left is None else asyncio.get_running_loop().create_task(self._cut(left))
        try:
            await super().shutdown(sockets)
        finally:
            if cut is not None:
                cut.cancel()

    async def _cut(self, after_s: float) -> None:
        await asyncio.sleep(after_s)
        cut = False
        while tasks := [t for t in self.server_state.tasks if not t.done()]:
            if not cut:
                log.warning("drain timeout: cutting %d HTTP response(s) still in flight", len(tasks))
                cut = True
            for task in tasks:
                task.cancel()
            # Again while any is left: a cancel that lands as an awaited result arrives is lost (asyncio.wait_for).
            await asyncio.sleep(_POLL_S)

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


class _CutAnswers:
    """ASGI wrapper that gives each request its answer when the server cuts it at the drain's bound: a 503
    `draining` when its response has not started; a connection closed mid-stream when it has (returning
    without completing the response makes uvicorn close the connection)."""

    def __init__(self, app: ASGIApp, server: DrainingServer) -> None:
        self.app = app
        self.server = server

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except asyncio.CancelledError:
            if not self.server.closing:
                raise
            # The cut is this task's end, not an error: answer what can still be answered, and finish.
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()
            if not started:
                await _send_json(send, error_body("instance is draining: its drain timeout passed before this "
                                                  "answer", "draining", 503), 503)


async def _send_json(send: Send, body: dict[str, Any], status: int) -> None:
    content = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(content)).encode())]})
    await send({"type": "http.response.body", "body": content, "more_body": False})
