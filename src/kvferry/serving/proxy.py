"""The P/D proxy: one client request → a prefill on P and a decode on D, sent at the same time with one
transfer_id (the pattern of vLLM's Mooncake proxy). D's answer is streamed back; D's 500 passes through.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, generate_latest
from pydantic import BaseModel, ValidationError

from kvferry.serving.api_server import install_error_handlers
from kvferry.serving.kv_params_check import KVParamsShapeError, check_kv_transfer_params
from kvferry.serving.openai_chat import ChatCompletionRequest
from kvferry.serving.protocol import (
    COMPLETION_200,
    METRICS_200,
    CompletionRequest,
    error_body,
    error_responses,
    validation_message,
)

RETRY_BACKOFF_S = 0.25
TRANSFER_ID_HEADER = "x-kvferry-transfer-id"
ATTEMPTS_HEADER = "x-kvferry-attempts"
# Not relayed from D: hop-by-hop headers, and the ones the proxy's own server sets (no duplicates).
_HOP_HEADERS = {"content-length", "transfer-encoding", "connection", "content-encoding", "date", "server"}


@dataclass
class PrefillTarget:
    url: str
    engine_id: str = ""
    bootstrap_addr: str = ""
    known: bool = False
    # A prefill instance that does not announce its engine id and bootstrap address (vLLM's /health
    # answers an empty 200) is used sequentially: its answer's kv_transfer_params are handed to D.
    sequential: bool = False
    pinned: bool = False  # sequential by configuration, whatever /health says

    async def refresh(self, client: httpx.AsyncClient) -> None:
        r = await client.get(f"{self.url}/health", timeout=5.0)
        r.raise_for_status()
        try:
            info = r.json()
            self.engine_id, self.bootstrap_addr = str(info["engine_id"]), str(info["kv_bootstrap_addr"])
            self.sequential = self.pinned
        except (ValueError, KeyError, TypeError):
            self.sequential = True
        self.known = True

    def forget(self) -> None:
        """P may have restarted (with another engine id): ask again next time."""
        self.known = False


class ProxyMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "kvferry_proxy_requests", "Proxied requests by outcome", ["outcome"], registry=self.registry
        )


def build_proxy_app(
    prefill_urls: list[str],
    decode_urls: list[str],
    retries: int = 0,
    sequential: bool = False,
    retry_unreachable: int = 3,
) -> FastAPI:
    client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0))

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await client.aclose()

    app = FastAPI(title="kvferry P/D proxy", version="0.1.0", lifespan=lifespan)
    install_error_handlers(app)
    prefills = [PrefillTarget(u.rstrip("/"), sequential=sequential, pinned=sequential) for u in prefill_urls]
    decodes = [u.rstrip("/") for u in decode_urls]
    next_p, next_d = itertools.cycle(range(len(prefills))), itertools.cycle(range(len(decodes)))
    metrics = ProxyMetrics()

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "role": "proxy", "prefill": prefill_urls, "decode": decode_urls}

    @app.get("/metrics", response_class=Response, responses=METRICS_200)
    async def prom() -> Response:
        return Response(generate_latest(metrics.registry), media_type="text/plain; version=0.0.4; charset=utf-8")

    # The body is forwarded as it came (unknown fields too), so it is read raw and validated by hand.
    def request_body(model: type[BaseModel]) -> dict[str, Any]:
        return {"requestBody": {"required": True, "content": {"application/json": {"schema": model.model_json_schema()}}}}

    @app.get("/v1/models")
    async def models() -> Response:
        try:
            r = await client.get(f"{decodes[0]}/v1/models", timeout=10.0)
        except httpx.HTTPError as exc:
            return JSONResponse(error_body(f"decode {decodes[0]} unavailable: {exc!r}", "proxy_error", 502), 502)
        return Response(r.content, r.status_code, media_type="application/json")

    @app.post(
        "/v1/completions",
        response_model=None,
        responses={**COMPLETION_200, **error_responses(400, 404, 500, 502)},
        openapi_extra=request_body(CompletionRequest),
    )
    async def completions(request: Request) -> Response:
        return await _handle(request, "/v1/completions", CompletionRequest)

    @app.post(
        "/v1/chat/completions",
        response_model=None,
        responses={**COMPLETION_200, **error_responses(400, 404, 500, 502)},
        openapi_extra=request_body(ChatCompletionRequest),
    )
    async def chat_completions(request: Request) -> Response:
        return await _handle(request, "/v1/chat/completions", ChatCompletionRequest)

    async def _handle(request: Request, path: str, model: type[BaseModel]) -> Response:
        if not _is_json(request.headers.get("content-type", "")):
            try:  # the instance's answer to a body that is not declared JSON, word for word
                model.model_validate(b"", from_attributes=True)
            except ValidationError as exc:
                return JSONResponse(error_body(validation_message(exc), "invalid_request_error", 400), 400)
        try:
            body = json.loads(await request.body())
        except (ValueError, RecursionError, UnicodeDecodeError):  # JSONDecodeError is a ValueError
            return JSONResponse(error_body("body is not valid JSON", "invalid_request_error", 400), 400)
        if not isinstance(body, dict):
            return JSONResponse(error_body("body must be a JSON object", "invalid_request_error", 400), 400)
        try:
            # Reject what the instances would reject before P spends a prefill (and blocks) on it.
            model.model_validate(body)
            check_kv_transfer_params(body.get("kv_transfer_params"))
        except ValidationError as exc:
            return JSONResponse(error_body(validation_message(exc), "invalid_request_error", 400), 400)
        except KVParamsShapeError as exc:
            return JSONResponse(error_body(str(exc), "invalid_request_error", 400), 400)
        stream = bool(body.get("stream"))
        kv_failures = unreachable = 0
        for attempt in itertools.count():
            target = prefills[next(next_p)]
            decode_url = decodes[next(next_d)]
            transfer_id = f"xfer-{uuid.uuid4()}"
            response, retryable = await _one_attempt(client, target, decode_url, body, stream, transfer_id, path)
            # Lets a client (or `kvferry chaos`) match the answer with the fault function's prediction.
            response.headers[TRANSFER_ID_HEADER] = transfer_id
            response.headers[ATTEMPTS_HEADER] = str(attempt + 1)
            # Two budgets: KV-load failures (--retries) and instances that cannot be reached at all
            # (--retry-unreachable, with backoff while a restarted instance comes up).
            is_unreachable = response.status_code == 502
            kv_failures += retryable and not is_unreachable
            unreachable += retryable and is_unreachable
            if not retryable or kv_failures > retries or unreachable > retry_unreachable:
                metrics.requests.labels(outcome=str(response.status_code)).inc()
                return response
            metrics.requests.labels(outcome="retried").inc()
            if is_unreachable:
                await asyncio.sleep(min(2.0, RETRY_BACKOFF_S * 2 ** (unreachable - 1)))
        raise AssertionError("unreachable")

    return app


def _is_json(content_type: str) -> bool:
    """What FastAPI accepts as a JSON body: application/json or a `+json` subtype."""
    main = content_type.split(";", 1)[0].strip().lower()
    return main == "application/json" or (main.startswith("application/") and main.endswith("+json"))


async def _one_attempt(
    client: httpx.AsyncClient,
    target: PrefillTarget,
    decode_url: str,
    body: dict[str, Any],
    stream: bool,
    transfer_id: str,
    path: str,
) -> tuple[Response, bool]:
    """(response, retryable): a KV-load failure before any token reached the client may be retried."""
    if not target.known:
        try:
            await target.refresh(client)
        except httpx.HTTPError as exc:
            return JSONResponse(error_body(f"prefill {target.url} unavailable: {exc!r}", "proxy_error", 502), 502), True
    # P computes the prompt's KV and one token (a chat's max_completion_tokens would outrank max_tokens).
    p_body = {**body, "max_tokens": 1, "stream": False,
              "kv_transfer_params": {"do_remote_decode": True, "transfer_id": transfer_id}}
    p_body.pop("max_completion_tokens", None)
    p_body.pop("stream_options", None)
    if target.sequential:
        return await _sequential(client, target, decode_url, body, p_body, stream, path)
    d_body = {**body, "kv_transfer_params": {
        "do_remote_prefill": True,
        "transfer_id": transfer_id,
        "remote_engine_id": target.engine_id,
        "remote_bootstrap_addr": target.bootstrap_addr,
    }}
    prefill = asyncio.create_task(client.post(f"{target.url}{path}", json=p_body))
    prefill.add_done_callback(_consume_exception)
    d_request = client.build_request("POST", f"{decode_url}{path}", json=d_body)
    decode = asyncio.create_task(client.send(d_request, stream=True))
    done, _ = await asyncio.wait({prefill, decode}, return_when=asyncio.FIRST_COMPLETED)
    if prefill in done:
        p_error = _prefill_error(prefill)
        if p_error is not None:
            # P will never produce this KV: drop D's request (D aborts its pull) and say why.
            decode.cancel()
            await asyncio.gather(decode, return_exceptions=True)
            if decode.done() and not decode.cancelled() and decode.exception() is None:
                await decode.result().aclose()
            target.forget()
            return p_error, p_error.status_code >= 500
    try:
        d_response = await decode
    except httpx.HTTPError as exc:
        prefill.cancel()
        return JSONResponse(error_body(f"decode {decode_url} unavailable: {exc!r}", "proxy_error", 502), 502), True
    return await _relay_decode(d_response, target, stream, prefill)


async def _sequential(
    client: httpx.AsyncClient,
    target: PrefillTarget,
    decode_url: str,
    body: dict[str, Any],
    p_body: dict[str, Any],
    stream: bool,
    path: str,
) -> tuple[Response, bool]:
    """Prefill first, then hand P's kv_transfer_params to D (for prefill instances that are not kvferry)."""
    try:
        p_response = await client.post(f"{target.url}{path}", json=p_body)
    except httpx.HTTPError as exc:
        target.forget()
        return JSONResponse(error_body(f"prefill request failed: {exc!r}", "proxy_error", 502), 502), True
    if p_response.status_code != 200:
        return Response(p_response.content, p_response.status_code, media_type="application/json"), p_response.status_code >= 500
    try:
        params = p_response.json()["kv_transfer_params"]
    except (ValueError, KeyError, TypeError):
        params = None
    if not isinstance(params, dict):
        return JSONResponse(error_body("prefill answer carries no kv_transfer_params", "proxy_error", 502), 502), True
    try:
        check_kv_transfer_params(params)
    except KVParamsShapeError as exc:
        return JSONResponse(error_body(f"prefill answer: {exc}", "proxy_error", 502), 502), True
    d_request = client.build_request("POST", f"{decode_url}{path}", json={**body, "kv_transfer_params": params})
    try:
        d_response = await client.send(d_request, stream=True)
    except httpx.HTTPError as exc:
        return JSONResponse(error_body(f"decode {decode_url} unavailable: {exc!r}", "proxy_error", 502), 502), True
    return await _relay_decode(d_response, target, stream, None)


async def _relay_decode(
    d_response: httpx.Response, target: PrefillTarget, stream: bool, prefill: asyncio.Task[httpx.Response] | None
) -> tuple[Response, bool]:
    """D's answer for the client; a 500 kv_load_failed (before any token) is retryable."""
    if d_response.status_code != 200:
        content = await d_response.aread()
        await d_response.aclose()
        retryable = d_response.status_code == 500 and b"kv_load_failed" in content
        if retryable:
            target.forget()
        return Response(content, d_response.status_code, media_type="application/json"), retryable
    headers = {k: v for k, v in d_response.headers.items() if k.lower() not in _HOP_HEADERS}
    if not stream:
        content = await d_response.aread()
        await d_response.aclose()
        return Response(content, 200, headers=headers), False
    return StreamingResponse(_relay(d_response, prefill), 200, headers=headers), False


def _consume_exception(task: asyncio.Task[httpx.Response]) -> None:
    if not task.cancelled():
        task.exception()  # retrieved here so an ignored P failure is not logged as "never retrieved"


def _prefill_error(prefill: asyncio.Task[httpx.Response]) -> JSONResponse | None:
    exc = prefill.exception()
    if exc is not None:
        return JSONResponse(error_body(f"prefill request failed: {exc!r}", "proxy_error", 502), 502)
    r = prefill.result()
    if r.status_code == 200:
        return None
    try:
        content = r.json()
    except ValueError:
        content = error_body(r.text[:500], "proxy_error", r.status_code)
    return JSONResponse(content, r.status_code)


async def _relay(d_response: httpx.Response, prefill: asyncio.Task[httpx.Response] | None) -> AsyncIterator[bytes]:
    try:
        async for chunk in d_response.aiter_raw():
            yield chunk
    finally:
        await d_response.aclose()
        if prefill is not None and not prefill.done():
            prefill.cancel()
