"""Graceful drain: SIGTERM (or `POST /drain`) stops admitting requests and lets the instance finish what it
holds before it exits 0, because P holds the KV of every prefill it answered until D pulls it.

A draining instance answers `/health` and new completions with 503, so proxies retry elsewhere. A second
SIGTERM (or SIGINT) ends the drain at once; `timeout_s` bounds it and the responses still in flight. A
busy engine is not a dead one: only an engine whose thread is gone ends the drain early."""

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
    """One instance's drain, finished when `snapshot` says it holds nothing, when `timeout_s` passes, or on
    `force()`. `snapshot(wait)` is `Engine.snapshot` (EngineBusyError while in a longer step)."""

    def __init__(self, snapshot: Callable[[float], dict[str, Any]], timeout_s: float, grace_s: float = 0.0) -> None:
        self._snapshot = snapshot
        self.timeout_s = timeout_s
        self.grace_s = grace_s
        self.started_at: float | None = None
        self.outcome = ""  # "idle", "timeout" or "forced" once it ended
        self._forced = False
        self.on_done: Callable[[], None] = lambda: None
        self._task: asyncio.Task[None] | None = None

    @property
    def draining(self) -> bool:
        return self.started_at is not None

    def _since(self) -> float:
        return 0.0 if self.started_at is None else time.monotonic() - self.started_at

    def status(self) -> dict[str, Any]:
        # JSON has no infinity: an unbounded drain says null.
        bound = self.timeout_s if math.isfinite(self.timeout_s) else None
        return {"status": "draining", "draining_for_s": round(self._since(), 3), "drain_timeout_s": bound}

    def time_left(self) -> float | None:
        """Seconds left of the drain's bound (all of it before the drain starts); None when unbounded."""
        return max(0.0, self.timeout_s - self._since()) if math.isfinite(self.timeout_s) else None

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
    """uvicorn's server, but SIGTERM drains; a second SIGTERM or SIGINT closes now. Responses in flight get
    what is left of the drain's bound, then are cut (uvicorn would wait without limit); exits 0."""

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
        # In a signal handler: flags only; the event loop starts the drain (call_soon_threadsafe wakes it).
        self._terms += sig == signal.SIGTERM
        if sig != signal.SIGTERM or self._terms > 1 or self._loop is None:
            self.force_exit = self.should_exit  # a third signal: do not wait for in-flight responses
            self.drain.force()
            self.should_exit = True
            return
        with contextlib.suppress(RuntimeError):  # the loop already closed
            self._loop.call_soon_threadsafe(self.drain.start, signal.Signals(sig).name)


class _CutAnswers:
    """ASGI wrapper for a request cut at the drain's bound: a 503 `draining` when its response has not
    started; otherwise returning without completing it makes uvicorn close the connection mid-stream."""

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
