"""One attempt of the proxy: a prefill on P and a decode on D with one transfer_id, and what the outcome
means for a retry. Whatever ends the attempt cancels the other side's request at once, so P never keeps
prefilling, or holding blocks for, a request nobody will pull."""

from __future__ import annotations

import asyncio
import contextlib
import enum
import functools
import json
import ssl
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvferry.connector.params import KVParamsShapeError, check_kv_transfer_params
from kvferry.serving.instances import Instance, InstancePool, PrefillTarget
from kvferry.serving.migrate import Migration, is_aborted
from kvferry.serving.openai_shapes import error_body

# Not relayed from D: hop-by-hop headers, and the ones the proxy's own server sets (no duplicates).
_HOP_HEADERS = {"content-length", "transfer-encoding", "connection", "content-encoding", "date", "server"}
# After D reports a failed KV load, how long to wait for P's own request to show whether P is gone.
_P_VERDICT_WAIT_S = 0.5


class Outcome(enum.Enum):
    DONE = "done"  # final: the client gets this answer
    KV_FAILED = "kv_failed"  # a KV-load failure before the first token (--retries)
    UNREACHABLE = "unreachable"  # an instance could not be reached or died (--retry-unreachable)
    ABORTED = "aborted"  # D aborted the request (it is shutting down) before the client got any of it (--migrations)


class PrefillConnections:
    """P's requests, each on a connection of its own while it runs, closed on every way out but a whole
    answer (cancelled mid-flight on a shared pool, httpx would leak the socket). A connection read in full
    is kept for that P's next request, at most `max_idle` per P and for `idle_s`, below uvicorn's 5 s
    keep-alive so P never closes one about to be used."""

    def __init__(self, max_idle: int = 8, idle_s: float = 2.0) -> None:
        self.max_idle = max_idle
        self.idle_s = idle_s
        self._idle: dict[str, list[httpx.AsyncClient]] = {}

    async def post(self, url: str, body: dict[str, Any]) -> httpx.Response:
        origin = _origin(url)
        idle = self._idle.get(origin)
        client = idle.pop() if idle else self._new()
        try:
            response = await client.post(url, json=body)
        except BaseException:  # cancelled (P must abort), or the connection broke: close it
            await client.aclose()
            raise
        if len(self._idle.setdefault(origin, [])) < self.max_idle:
            self._idle[origin].append(client)
        else:
            await client.aclose()
        return response

    def idle(self) -> int:
        return sum(len(clients) for clients in self._idle.values())

    async def close(self) -> None:
        clients = [c for idle in self._idle.values() for c in idle]
        self._idle.clear()
        for client in clients:
            await client.aclose()

    def _new(self) -> httpx.AsyncClient:
        limits = httpx.Limits(max_connections=1, max_keepalive_connections=1, keepalive_expiry=self.idle_s)
        return httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0), verify=_tls(), limits=limits)


def _origin(url: str) -> str:
    parsed = httpx.URL(url)
    return f"{parsed.scheme}://{parsed.netloc.decode()}"


@functools.cache
def _tls() -> ssl.SSLContext:
    """One TLS context for every P connection: httpx builds a new one per client otherwise (~40 ms here)."""
    return ssl.create_default_context()


@dataclass
class Attempt:
    client: httpx.AsyncClient
    prefills: InstancePool[PrefillTarget]
    decodes: InstancePool[Instance]
    target: PrefillTarget
    decode: Instance
    body: dict[str, Any]
    stream: bool
    transfer_id: str
    path: str = "/v1/completions"  # or /v1/chat/completions
    p_conns: PrefillConnections | None = None  # None: one connection per request, closed after it
    migrations: int = 0  # a stream whose D dies is resumed on another D at most this often
    on_migration: Callable[[str], None] = lambda _outcome: None

    @property
    def _p(self) -> PrefillConnections:
        return self.p_conns or PrefillConnections(max_idle=0)

    async def run(self) -> tuple[Response, Outcome]:
        if not self.target.known:
            try:
                await self.target.refresh(self.client)
            except httpx.HTTPError as exc:
                return self._unreachable(self.prefills, self.target, f"prefill {self.target.url} unavailable: {exc!r}")
        # P computes the prompt's KV and one token (a chat's max_completion_tokens would outrank max_tokens).
        p_body = {**self.body, "max_tokens": 1, "stream": False,
                  "kv_transfer_params": {"do_remote_decode": True, "transfer_id": self.transfer_id}}
        p_body.pop("max_completion_tokens", None)
        p_body.pop("stream_options", None)
        if self.target.sequential:
            return await self._sequential(p_body)
        d_body = {**self.body, "kv_transfer_params": {
            "do_remote_prefill": True,
            "transfer_id": self.transfer_id,
            "remote_engine_id": self.target.engine_id,
            "remote_bootstrap_addr": self.target.bootstrap_addr,
        }}
        prefill = asyncio.create_task(self._p.post(f"{self.target.url}{self.path}", p_body))
        prefill.add_done_callback(_consume_exception)
        d_request = self.client.build_request("POST", f"{self.decode.url}{self.path}", json=d_body)
        decode = asyncio.create_task(self.client.send(d_request, stream=True))
        handed_over = False
        try:
            done, _ = await asyncio.wait({prefill, decode}, return_when=asyncio.FIRST_COMPLETED)
            if prefill in done:
                verdict = self._prefill_verdict(prefill)
                if verdict is not None:
                    return verdict  # P will never produce this KV: D's request is dropped below
            try:
                d_response = await decode
            except httpx.HTTPError as exc:
                return self._unreachable(self.decodes, self.decode, f"decode {self.decode.url} unavailable: {exc!r}")
            result = await self._relay(d_response, prefill)
            handed_over = result[0].status_code == 200 and self.stream
            return result
        finally:
            # Every way out drops both requests, except a stream being relayed: its generator owns them.
            if not handed_over:
                await _cancel(decode, prefill if not prefill.done() else None)

    def _unreachable(self, pool: InstancePool[Any], instance: Instance, message: str) -> tuple[Response, Outcome]:
        pool.eject(instance, message)
        return JSONResponse(error_body(message, "proxy_error", 502), 502), Outcome.UNREACHABLE

    def _prefill_verdict(self, prefill: asyncio.Task[httpx.Response]) -> tuple[Response, Outcome] | None:
        exc = prefill.exception()
        if exc is not None:
            return self._unreachable(self.prefills, self.target, f"prefill request failed: {exc!r}")
        r = prefill.result()
        if r.status_code == 200:
            return None
        if r.status_code == 503:  # P's engine is dead: /health says so too, the probe brings it back
            return self._unreachable(self.prefills, self.target, f"prefill {self.target.url} answered 503")
        self.target.forget()
        try:
            content = r.json()
        except ValueError:
            content = error_body(r.text[:500], "proxy_error", r.status_code)
        return JSONResponse(content, r.status_code), Outcome.KV_FAILED if r.status_code >= 500 else Outcome.DONE

    async def _relay(self, d_response: httpx.Response,
                     prefill: asyncio.Task[httpx.Response] | None) -> tuple[Response, Outcome]:
        """D's answer for the client; a 500 kv_load_failed (before any token) is retryable."""
        if d_response.status_code != 200:
            content = await d_response.aread()
            await d_response.aclose()
            if prefill is not None and not prefill.done():
                prefill.cancel()  # D turned it away: P must not go on prefilling it
            if d_response.status_code == 503:
                return self._unreachable(self.decodes, self.decode, f"decode {self.decode.url} answered 503")
            response = Response(content, d_response.status_code, media_type="application/json")
            if d_response.status_code != 500 or b"kv_load_failed" not in content:
                return response, Outcome.DONE
            self.target.forget()
            if prefill is not None and await self._p_is_gone(prefill, _failure_code(content)):
                self.prefills.eject(self.target, "its request failed while D's load failed")
                if self.prefills.healthy():  # another P can serve it: P's death is not this request's fault
                    return response, Outcome.UNREACHABLE
            return response, Outcome.KV_FAILED
        headers = {k: v for k, v in d_response.headers.items() if k.lower() not in _HOP_HEADERS}
        if not self.stream:
            try:
                content = await d_response.aread()
            except httpx.HTTPError as exc:  # D died before its whole answer: nothing reached the client yet
                return self._unreachable(self.decodes, self.decode, f"decode {self.decode.url} broke: {exc!r}")
            finally:
                await d_response.aclose()
            if b'"abort"' in content and is_aborted(_json(content)):
                # vLLM's SIGTERM answers 200 with no token: nothing reached the client, another D is asked.
                self.decodes.eject(self.decode, "it aborted a request")
                message = f"decode {self.decode.url} aborted the request (shutting down?)"
                return JSONResponse(error_body(message, "decode_aborted", 502), 502), Outcome.ABORTED
            return Response(content, 200, headers=headers), Outcome.DONE
        if self.migrations > 0:
            migration = Migration(self.client, self.decodes, self.body, self.path, self.migrations, self.on_migration)
            events = _cancel_after(migration.relay(d_response, self.decode), prefill)
            return StreamingResponse(events, 200, headers=headers), Outcome.DONE
        return StreamingResponse(_relay(d_response, prefill), 200, headers=headers), Outcome.DONE

    async def _p_is_gone(self, prefill: asyncio.Task[httpx.Response], code: str) -> bool:
        """Did D's load fail because P died? D's `peer_dead` is that verdict already (a stopped P would hold
        the /health probe for its whole timeout); else P's own request broke or its /health fails."""
        if code == "peer_dead":
            return True
        await asyncio.wait({prefill}, timeout=_P_VERDICT_WAIT_S)
        if prefill.done() and not prefill.cancelled() and prefill.exception() is not None:
            return True
        try:
            r = await self.client.get(f"{self.target.url}/health", timeout=2.0)
        except httpx.HTTPError:
            return True
        return r.status_code != 200

    async def _sequential(self, p_body: dict[str, Any]) -> tuple[Response, Outcome]:
        """Prefill first, then hand P's kv_transfer_params to D (for prefill instances that are not kvferry)."""
        try:
            p_response = await self._p.post(f"{self.target.url}{self.path}", p_body)
        except httpx.HTTPError as exc:
            return self._unreachable(self.prefills, self.target, f"prefill request failed: {exc!r}")
        if p_response.status_code != 200:
            outcome = Outcome.KV_FAILED if p_response.status_code >= 500 else Outcome.DONE
            return Response(p_response.content, p_response.status_code, media_type="application/json"), outcome
        try:
            params = p_response.json()["kv_transfer_params"]
        except (ValueError, KeyError, TypeError):
            params = None
        if not isinstance(params, dict):
            return JSONResponse(error_body("prefill answer carries no kv_transfer_params", "proxy_error", 502), 502), \
                Outcome.KV_FAILED
        try:
            check_kv_transfer_params(params)
        except KVParamsShapeError as exc:
            return JSONResponse(error_body(f"prefill answer: {exc}", "proxy_error", 502), 502), Outcome.KV_FAILED
        d_request = self.client.build_request("POST", f"{self.decode.url}{self.path}",
                                              json={**self.body, "kv_transfer_params": params})
        try:
            d_response = await self.client.send(d_request, stream=True)
        except httpx.HTTPError as exc:
            return self._unreachable(self.decodes, self.decode, f"decode {self.decode.url} unavailable: {exc!r}")
        return await self._relay(d_response, None)


async def _cancel(decode: asyncio.Task[httpx.Response], prefill: asyncio.Task[httpx.Response] | None) -> None:
    """Drop requests still open: closing the connection makes the instance abort the request."""
    tasks = [t for t in (decode, prefill) if t is not None]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    if decode.done() and not decode.cancelled() and decode.exception() is None:
        with contextlib.suppress(httpx.HTTPError):
            await decode.result().aclose()


def _failure_code(content: bytes) -> str:
    """The `code` of an OpenAI-style error body (D's KV-load failure cause), or ""."""
    body = _json(content)
    error = body.get("error") if isinstance(body, dict) else None
    code = error.get("code") if isinstance(error, dict) else None
    return code if isinstance(code, str) else ""


def _json(content: bytes) -> Any:
    try:
        return json.loads(content)
    except ValueError:  # UnicodeDecodeError is one too
        return None


def _consume_exception(task: asyncio.Task[httpx.Response]) -> None:
    if not task.cancelled():
        task.exception()  # retrieved here so an ignored P failure is not logged as "never retrieved"


async def _cancel_after(events: AsyncIterator[bytes], prefill: asyncio.Task[httpx.Response] | None) -> AsyncIterator[bytes]:
    try:
        async for event in events:
            yield event
    finally:
        if prefill is not None and not prefill.done():
            prefill.cancel()


async def _relay(d_response: httpx.Response, prefill: asyncio.Task[httpx.Response] | None) -> AsyncIterator[bytes]:
    try:
        async for chunk in d_response.aiter_raw():
            yield chunk
    finally:
        await d_response.aclose()
        if prefill is not None and not prefill.done():
            prefill.cancel()
