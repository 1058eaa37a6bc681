"""Decode migration: the proxy relays D's stream event by event and, when D dies mid-stream (the
connection breaks, the stream ends without `[DONE]`, or D aborts the request), resumes it on another D
from the prompt plus the tokens the client already has (serving/resume.py). kvferry's engine samples
from (seed, position) and computes the same bits anywhere, so the client's text is the fault-free
answer; the proxy gives every unseeded sampled request a seed so it can be resumed. A chat stream keeps
exactly one role chunk. A D that announces no token ids (vLLM) cannot be resumed once text reached the
client: that stream ends with an error event."""

from __future__ import annotations

import json
import logging
import secrets
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvferry.serving.instances import Instance, InstancePool
from kvferry.serving.openai_shapes import error_body
from kvferry.serving.resume import RESUME_FIELD, TOKEN_IDS_FIELD

log = logging.getLogger(__name__)


def prepare(body: dict[str, Any]) -> dict[str, Any]:
    """D's body for a stream that can be migrated: token ids in every chunk, and a seed if it samples."""
    out = {**body, TOKEN_IDS_FIELD: True}
    if out.get("seed") is None and out.get("temperature", 1.0) != 0:
        out["seed"] = secrets.randbits(62)
    return out


@dataclass
class StreamState:
    """What the client has received so far."""

    token_ids: list[int] = field(default_factory=list)
    text_sent: int = 0
    resumable: bool = True  # every event with text so far announced its token ids
    first_id: str | None = None
    role_sent: bool = False  # a chat chunk with the role reached the client
    done: bool = False
    finished: bool = False  # an event with a finish_reason was relayed: the client has the whole answer
    aborted: bool = False  # the D being relayed aborted the request: its stream ends here


@dataclass
class Migration:
    client: httpx.AsyncClient
    decodes: InstancePool[Instance]
    body: dict[str, Any]  # the client's body, as prepare() made it for D
    path: str
    budget: int
    on_outcome: Callable[[str], None] = lambda _outcome: None
    state: StreamState = field(default_factory=StreamState)

    async def relay(self, d_response: httpx.Response, decode: Instance) -> AsyncIterator[bytes]:
        """The client's stream: D's events, then (if D dies) another D's, until `[DONE]`."""
        response: httpx.Response | None = d_response
        attempts = 0
        while response is not None:
            try:
                async for event in self._events(response):
                    yield event
            except httpx.HTTPError as exc:
                log.warning("decode %s broke mid-stream: %r", decode.url, exc)
            finally:
                await response.aclose()
            if self.state.done:
                return
            if self.state.finished:  # D died between its last event and [DONE]: nothing left to resume
                yield b"data: [DONE]\n\n"
                return
            self.decodes.eject(decode, "it aborted the stream" if self.state.aborted else "its stream broke")
            self.state.aborted = False
            response = None
            while response is None:
                if not self.state.resumable or attempts >= self.budget:
                    self.on_outcome("gave_up")
                    # As an instance ends a stream that failed after its start: one error event, then [DONE].
                    yield _error_event("decode instance died or aborted mid-stream; the stream cannot be resumed")
                    yield b"data: [DONE]\n\n"
                    return
                attempts += 1
                decode = self.decodes.pick(avoid=decode)
                response = await self._resume_on(decode)
            self.on_outcome("resumed")

    async def _resume_on(self, decode: Instance) -> httpx.Response | None:
        body = {k: v for k, v in self.body.items() if k != "kv_transfer_params"}
        body[RESUME_FIELD] = {"token_ids": self.state.token_ids, "text_sent": self.state.text_sent}
        request = self.client.build_request("POST", f"{decode.url}{self.path}", json=body)
        try:
            response = await self.client.send(request, stream=True)
        except httpx.HTTPError as exc:
            self.decodes.eject(decode, f"resume failed: {exc!r}")
            return None
        if response.status_code != 200:
            content = await response.aread()
            await response.aclose()
            log.warning("resume on %s answered %d: %s", decode.url, response.status_code, content[:300])
            return None
        return response

    async def _events(self, response: httpx.Response) -> AsyncIterator[bytes]:
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            payload = line[6:]
            if payload == "[DONE]":
                self.state.done = True
                yield b"data: [DONE]\n\n"
                return
            event = self._rewrite(payload)
            if event is None:  # D aborted: nothing of its last event reaches the client, as if it died here
                self.state.aborted = True
                return
            yield event

    def _rewrite(self, payload: str) -> bytes | None:
        """The event for the client, or None when D aborted the request."""
        try:
            event = json.loads(payload)
        except ValueError:
            event = None
        if not isinstance(event, dict):
            self.state.resumable = False
            return f"data: {payload}\n\n".encode()
        if is_aborted(event):
            return None
        ids = event.pop(TOKEN_IDS_FIELD, None)
        if isinstance(ids, list):
            self.state.token_ids.extend(ids)
        elif "error" not in event and _text_of(event):
            # Text without its tokens (a vLLM D); an event without text takes nothing a resume needs.
            self.state.resumable = False
        self._one_role(event)
        # One stream, one id: a resumed D names its events as the first D did.
        if isinstance(event.get("id"), str):
            self.state.first_id = self.state.first_id or event["id"]
            event["id"] = self.state.first_id
        self.state.text_sent += len(_text_of(event))
        self.state.finished = self.state.finished or _finish_reason(event) is not None
        return f"data: {json.dumps(event)}\n\n".encode()

    def _one_role(self, event: dict[str, Any]) -> None:
        """A chat stream's first delta carries the role, and no other does, whichever D sent which."""
        delta = _choice(event).get("delta")
        if not isinstance(delta, dict):
            return
        if self.state.role_sent:
            delta.pop("role", None)  # a resumed D's own role chunk: the client has one
        else:
            _choice(event)["delta"] = {"role": "assistant", **delta}
            self.state.role_sent = True


def is_aborted(body: Any) -> bool:
    """An answer or a stream event in which D aborted the request (vLLM's finish_reason "abort")."""
    return isinstance(body, dict) and _finish_reason(body) == "abort"


def _choice(event: dict[str, Any]) -> dict[str, Any]:
    choices = event.get("choices")
    return choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else {}


def _finish_reason(event: dict[str, Any]) -> Any:
    return _choice(event).get("finish_reason")


def _text_of(event: dict[str, Any]) -> str:
    choice = _choice(event)
    text = choice.get("text")
    if text is None and isinstance(choice.get("delta"), dict):
        text = choice["delta"].get("content")
    return text if isinstance(text, str) else ""


def _error_event(message: str) -> bytes:
    return f"data: {json.dumps(error_body(message, 'decode_died', 502))}\n\n".encode()
