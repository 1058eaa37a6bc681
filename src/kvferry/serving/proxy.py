"""The P/D proxy: one client request → a prefill on P and a decode on D, sent at the same time with one
transfer_id (the pattern of vLLM's Mooncake proxy). D's answer is streamed back; D's 500 passes through."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CollectorRegistry, Counter, generate_latest
from pydantic import BaseModel, ValidationError

from kvferry.connector.params import KVParamsShapeError, check_kv_transfer_params
from kvferry.serving import migrate
from kvferry.serving.api_server import install_error_handlers
from kvferry.serving.instances import CHECK_INTERVAL_S, Instance, InstancePool, PrefillTarget
from kvferry.serving.openai_chat import ChatCompletionRequest
from kvferry.serving.openai_shapes import (
    COMPLETION_200,
    METRICS_200,
    CompletionRequest,
    error_body,
    error_responses,
    validation_message,
)
from kvferry.serving.proxy_attempt import Attempt, Outcome, PrefillConnections

RETRY_BACKOFF_S = 0.25
TRANSFER_ID_HEADER = "x-kvferry-transfer-id"
ATTEMPTS_HEADER = "x-kvferry-attempts"
# How often a waiting handler checks whether its client went away (then both requests are dropped).
_DISCONNECT_POLL_S = 0.1


class ProxyMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("kvferry_proxy_requests", "Proxied requests by outcome", ["outcome"],
                                registry=self.registry)
        self.migrations = Counter(
            "kvferry_proxy_migrations",
            "Answers whose D died mid-stream or aborted them, by outcome: resumed (a stream, on another D), "
            "retried (an answer the client had none of, asked of another D), or gave up",
            ["outcome"], registry=self.registry,
        )
        self.ejections = Counter("kvferry_proxy_ejections", "Instances ejected after a failed connect",
                                 ["role"], registry=self.registry)


@dataclass(frozen=True)
class ProxyConfig:
    """The proxy's settings: `kvferry proxy`'s flags and `build_proxy_app` read their defaults here."""

    retries: int = 0  # a KV-load failure before the first token is retried this often
    sequential: bool = False  # prefill first, then D with P's kv_transfer_params
    retry_unreachable: int = 3  # an instance that cannot be reached at all
    health_interval_s: float = CHECK_INTERVAL_S
    migrations: int = 2  # a stream whose D dies is resumed on another D at most this often


def build_proxy_app(prefill_urls: list[str], decode_urls: list[str], retries: int = ProxyConfig.retries,
                    sequential: bool = ProxyConfig.sequential,
                    retry_unreachable: int = ProxyConfig.retry_unreachable,
                    health_interval_s: float = ProxyConfig.health_interval_s,
                    migrations: int = ProxyConfig.migrations) -> FastAPI:
    client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0))
    prefills = InstancePool([PrefillTarget(u.rstrip("/"), sequential=sequential, pinned=sequential)
                             for u in prefill_urls], client)
    decodes = InstancePool([Instance(u.rstrip("/")) for u in decode_urls], client)
    p_conns = PrefillConnections()

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        prefills.start_checks(health_interval_s)
        decodes.start_checks(health_interval_s)
        yield
        await prefills.close()
        await decodes.close()
        await p_conns.close()
        await client.aclose()

    app = FastAPI(title="kvferry P/D proxy", version="0.1.0", lifespan=lifespan)
    install_error_handlers(app)
    metrics = ProxyMetrics()

    @app.get("/health")
    async def health() -> dict[str, Any]:
        ejected = [i.url for i in [*prefills.instances, *decodes.instances] if i.ejected]
        return {"status": "ok", "role": "proxy", "pid": os.getpid(), "prefill": prefill_urls, "decode": decode_urls, "ejected": ejected}

    @app.get("/metrics", response_class=Response, responses=METRICS_200)
    async def prom() -> Response:
        return Response(generate_latest(metrics.registry), media_type="text/plain; version=0.0.4; charset=utf-8")

    # The body is forwarded as it came (unknown fields too), so it is read raw and validated by hand.
    def request_body(model: type[BaseModel]) -> dict[str, Any]:
        return {"requestBody": {"required": True, "content": {"application/json": {"schema": model.model_json_schema()}}}}

    @app.get("/v1/models")
    async def models() -> Response:
        try:
            r = await client.get(f"{decodes.instances[0].url}/v1/models", timeout=10.0)
        except httpx.HTTPError as exc:
            url = decodes.instances[0].url
            return JSONResponse(error_body(f"decode {url} unavailable: {exc!r}", "proxy_error", 502), 502)
        return Response(r.content, r.status_code, media_type="application/json")

    @app.post("/v1/completions", response_model=None,
              responses={**COMPLETION_200, **error_responses(400, 404, 500, 502)},
              openapi_extra=request_body(CompletionRequest))
    async def completions(request: Request) -> Response:
        return await _handle(request, "/v1/completions", CompletionRequest)

    @app.post("/v1/chat/completions", response_model=None,
              responses={**COMPLETION_200, **error_responses(400, 404, 500, 502)},
              openapi_extra=request_body(ChatCompletionRequest))
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
        serving = asyncio.create_task(_serve(body, path))
        # A client that goes away (before the answer starts) takes both of its requests with it.
        while True:
            done, _ = await asyncio.wait({serving}, timeout=_DISCONNECT_POLL_S)
            if done:
                return serving.result()
            if await request.is_disconnected():
                serving.cancel()
                await asyncio.gather(serving, return_exceptions=True)
                metrics.requests.labels(outcome="client_gone").inc()
                return Response(status_code=499)

    async def _serve(body: dict[str, Any], path: str) -> Response:
        stream = bool(body.get("stream"))
        if stream and migrations > 0:
            body = migrate.prepare(body)  # P and D see the same seed: P's first token stays D's
        kv_failures = unreachable = aborted = 0
        last_p: PrefillTarget | None = None
        last_d: Instance | None = None
        for attempt in itertools.count():
            target, decode = prefills.pick(avoid=last_p), decodes.pick(avoid=last_d)
            ejections = prefills.ejections(), decodes.ejections()
            transfer_id = f"xfer-{uuid.uuid4()}"
            response, outcome = await Attempt(
                client, prefills, decodes, target, decode, body, stream, transfer_id, path, p_conns, migrations,
                lambda outcome: metrics.migrations.labels(outcome=outcome).inc(),
            ).run()
            metrics.ejections.labels(role="prefill").inc(prefills.ejections() - ejections[0])
            metrics.ejections.labels(role="decode").inc(decodes.ejections() - ejections[1])
            # Lets a client (or `kvferry chaos`) match the answer with the fault function's prediction.
            response.headers[TRANSFER_ID_HEADER] = transfer_id
            response.headers[ATTEMPTS_HEADER] = str(attempt + 1)
            # Three budgets (--retries, --retry-unreachable, --migrations). The next attempt avoids the
            # instance that failed; it backs off only when no other healthy one is left (one restarting or
            # paused: its next try should come after, not within, that).
            kv_failures += outcome is Outcome.KV_FAILED
            unreachable += outcome is Outcome.UNREACHABLE
            aborted += outcome is Outcome.ABORTED
            if outcome is Outcome.ABORTED:
                metrics.migrations.labels(outcome="retried" if aborted <= migrations else "gave_up").inc()
            if (outcome is Outcome.DONE or kv_failures > retries or unreachable > retry_unreachable
                    or aborted > migrations):
                metrics.requests.labels(outcome=str(response.status_code)).inc()
                return response
            metrics.requests.labels(outcome="retried").inc()
            last_p, last_d = target, decode
            count, alone = {Outcome.UNREACHABLE: (unreachable, prefills.healthy() == 0 or decodes.healthy() == 0),
                            Outcome.KV_FAILED: (kv_failures, prefills.healthy() <= 1),
                            Outcome.ABORTED: (aborted, decodes.healthy() == 0)}[outcome]
            if alone:
                await asyncio.sleep(min(2.0, RETRY_BACKOFF_S * 2 ** (count - 1)))
        raise AssertionError("unreachable")

    return app


def _is_json(content_type: str) -> bool:
    """What FastAPI accepts as a JSON body: application/json or a `+json` subtype."""
    main = content_type.split(";", 1)[0].strip().lower()
    return main == "application/json" or (main.startswith("application/") and main.endswith("+json"))
