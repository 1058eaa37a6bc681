"""HTTP API of one instance: OpenAI completions, chat completions and models, health, Prometheus metrics,
debug state."""

from __future__ import annotations

import asyncio
import ipaddress
import json
import os
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvferry.connector.base import AdmissionError
from kvferry.connector.bootstrap import BootstrapError, PrefillAllowList
from kvferry.connector.params import (
    KVParamsShapeError,
    KVTransferParamsError,
    check_kv_transfer_params,
    validate_kv_transfer_params,
)
from kvferry.engine.engine import Engine, EngineDeadError, RequestOutput
from kvferry.engine.request import Request as EngineRequest
from kvferry.engine.request import SamplingParams
from kvferry.engine.text import ChatTemplateError, TextCodec
from kvferry.serving.drain import Drain
from kvferry.serving.openai_chat import (
    ChatCompletionRequest,
    chat_body,
    chat_chunk,
    model_not_found,
    models_body,
)
from kvferry.serving.openai_shapes import (
    COMPLETION_200,
    METRICS_200,
    CompletionRequest,
    completion_body,
    error_body,
    error_responses,
    new_request_id,
    validation_message,
)
from kvferry.serving.resume import TOKEN_IDS_FIELD, Resume, ResumeError, TextAssembler, parse_resume
from kvferry.serving.router_formats import EngineResolver, PDRequest, ProtocolError, translate
from kvferry.serving.sglang_info import install_info_routes

# How often a non-streaming handler checks whether its client went away.
_DISCONNECT_POLL_S = 0.25
# /debug/state waits this long for a fresh snapshot, then serves the one the engine last published.
_SNAPSHOT_WAIT_S = 0.5


def install_error_handlers(app: FastAPI) -> None:
    """Bad client input gets an OpenAI-style 4xx body, never a 500."""

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(error_body(validation_message(exc), "invalid_request_error", 400), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(error_body(str(exc.detail), "invalid_request_error", exc.status_code), exc.status_code)


def build_app(engine: Engine, health_extra: dict[str, Any] | None = None,
              served_model_names: Sequence[str] = (), drain: Drain | None = None,
              resolver: EngineResolver | None = None) -> FastAPI:
    """`served_model_names`: the names clients may send as `model`, the first reported (default: the
    model's). `drain`: what SIGTERM and `POST /drain` start (without it a drain only stops admitting).
    `resolver`: how D finds P's engine from sglang's bootstrap fields (default: loopback only)."""
    app = FastAPI(title="kvferry instance", version="0.1.0")
    install_error_handlers(app)
    names = list(dict.fromkeys(served_model_names)) or [engine.loaded.name]
    model_name = names[0]
    install_info_routes(app, engine, model_name, health_extra or {})
    codec: TextCodec = engine.codec
    max_len = engine.model.config.max_position
    max_prompt_blocks = engine.pool.num_total
    drain = drain or Drain(engine.snapshot, timeout_s=float("inf"))

    @app.get("/health")
    async def health() -> JSONResponse:
        if not engine.alive:
            why = repr(engine.fatal_error) if engine.fatal_error is not None else "engine stopped"
            return JSONResponse({"status": "error", "error": why}, status_code=503)
        if drain.draining:  # out of rotation: the proxy and the routers stop sending here
            return JSONResponse({**drain.status(), "role": engine.config.role}, status_code=503)
        info = {"status": "ok", "role": engine.config.role, "engine_id": engine.config.engine_id, "pid": os.getpid()}
        return JSONResponse({**info, **(health_extra or {})})

    @app.post("/drain", status_code=202)
    async def start_drain(http_request: Request) -> JSONResponse:
        """For a Kubernetes preStop hook: the same drain as SIGTERM. Loopback only, so nobody else who
        reaches the HTTP port can take the instance out of service."""
        if not _is_loopback(http_request.client.host if http_request.client else ""):
            return JSONResponse(error_body("POST /drain is accepted from loopback only", "forbidden", 403), 403)
        drain.start("POST /drain")
        return JSONResponse(drain.status(), status_code=202)

    @app.get("/metrics", response_class=Response, responses=METRICS_200)
    async def metrics() -> Response:
        return Response(engine.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/debug/state")
    async def debug_state() -> JSONResponse:
        # Never a 5xx: a long step (or a dead engine) gets the last published state, marked stale.
        try:
            state = await asyncio.get_running_loop().run_in_executor(None, engine.snapshot, _SNAPSHOT_WAIT_S)
            return JSONResponse({**state, "stale": False})
        except (TimeoutError, EngineDeadError):
            pass
        published = engine.published_state() or {"role": engine.config.role, "engine_id": engine.config.engine_id}
        age = time.time() - float(published.get("time", time.time()))
        extra = {"fatal_error": repr(engine.fatal_error)} if engine.fatal_error is not None else {}
        return JSONResponse({**published, **extra, "stale": True, "age_s": round(age, 3)})

    resolver = resolver or EngineResolver(PrefillAllowList())

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse(models_body(names, max_len))

    @app.post("/v1/completions", response_model=None, responses={**COMPLETION_200, **error_responses(400, 404, 500, 503)})
    async def completions(body: CompletionRequest, http_request: Request) -> Response:
        return await _serve(body, http_request, None)

    @app.post("/v1/chat/completions", response_model=None, responses={**COMPLETION_200, **error_responses(400, 404, 500, 503)})
    async def chat_completions(body: ChatCompletionRequest, http_request: Request) -> Response:
        try:
            prompt = codec.apply_chat_template(body.template_messages())
        except ChatTemplateError as exc:
            return _bad_request(str(exc))
        as_completion = CompletionRequest(
            **{**(body.model_extra or {}), "model": body.model, "prompt": prompt, "max_tokens": body.token_limit(max_len),
               "temperature": body.temperature, "seed": body.seed, "stop": body.stop, "stream": body.stream,
               "ignore_eos": body.ignore_eos, "kv_transfer_params": body.kv_transfer_params}
        )  # fmt: skip
        if body.max_tokens is None and body.max_completion_tokens is None:
            as_completion.max_tokens = 0  # the rest of the context, once the prompt length is known
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return await _serve(as_completion, http_request, _Chat(include_usage))

    async def _serve(body: CompletionRequest, http_request: Request, chat: _Chat | None) -> Response:
        if drain.draining:  # 503: the proxy retries it on another instance
            _release_prefill(body.kv_transfer_params)
            return JSONResponse(error_body("instance is draining", "draining", 503), status_code=503)
        request_id = new_request_id()
        try:
            check_kv_transfer_params(body.kv_transfer_params)
        except KVParamsShapeError as exc:
            return _bad_request(str(exc))
        try:
            pd = translate(engine.config.role, body.kv_transfer_params, body.model_extra or {}, request_id)
        except ProtocolError as exc:
            return _bad_request(str(exc))
        params = pd.kv_transfer_params
        connector = engine.scheduler_connector
        try:  # D: a prefill host it may pull from; P: a transfer_id no live request uses
            connector.claim(request_id, params)
        except AdmissionError as exc:
            return _bad_request(str(exc))
        try:
            response = await _admitted(body, http_request, chat, request_id, pd)
        except BaseException:
            connector.unclaim(request_id, params)
            raise
        if response.status_code in (400, 404, 503):  # turned away before the engine saw it
            connector.unclaim(request_id, params)
        if response.status_code in (400, 404):
            _release_prefill(params)
        return response

    def _release_prefill(params: dict[str, Any] | None) -> None:
        """Turned away here, but P already prefills it (the proxy and vllm-router ask both at once):
        free P now rather than at its abort timeout."""
        if not isinstance(params, dict) or not params.get("do_remote_prefill"):
            return
        try:
            validate_kv_transfer_params(params)
        except KVTransferParamsError:
            return  # nowhere to send the release
        engine.reject(EngineRequest(new_request_id(), [], SamplingParams(), params, time.time()))

    async def _admitted(body: CompletionRequest, http_request: Request, chat: _Chat | None, request_id: str,
                        pd: PDRequest) -> Response:
        params = pd.kv_transfer_params
        if body.model is not None and body.model not in names:
            return JSONResponse(model_not_found(body.model), status_code=404)
        if pd.sglang_room is not None and params is not None:
            try:
                params["remote_engine_id"] = await resolver.engine_for(params["remote_bootstrap_addr"], pd.sglang_room)
            except BootstrapError as exc:  # REFUSED, as the consumer answers for kv_transfer_params
                engine.metrics.kv_load_failures.labels(cause="bootstrap").inc()
                return JSONResponse(error_body(str(exc), "kv_load_failed", "bootstrap"), status_code=500)
        max_tokens = 1 if pd.prefill_only else body.max_tokens
        return await _completions(body, http_request, request_id, params, max_tokens, chat)

    async def _completions(body: CompletionRequest, http_request: Request, request_id: str,
                           kv_params: dict[str, Any] | None, max_tokens: int, chat: _Chat | None) -> Response:
        if isinstance(body.prompt, str):
            prompt_ids = codec.encode(body.prompt)
        else:
            prompt_ids = list(body.prompt)
            if any(not 0 <= t < codec.vocab_size for t in prompt_ids):
                return _bad_request(f"prompt token ids must be in [0, {codec.vocab_size})")
        if not prompt_ids:
            return _bad_request("prompt must not be empty")
        if max_tokens == 0:  # a chat without a limit: up to the model's context
            max_tokens = max(1, max_len - len(prompt_ids))
        total = len(prompt_ids) + max_tokens
        if total > max_len:
            return _bad_request(f"prompt ({len(prompt_ids)} tokens) + max_tokens exceeds the maximum length {max_len}")
        if -(-total // engine.config.block_size) > max_prompt_blocks:
            return _bad_request("prompt + max_tokens needs more KV blocks than this instance has")
        try:
            validate_kv_transfer_params(kv_params)
        except KVTransferParamsError as exc:
            return _bad_request(f"kv_transfer_params: {exc}")
        stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
        if any(not s for s in stop):
            return _bad_request("stop strings must not be empty")
        params = SamplingParams(max_tokens, body.temperature, body.seed, stop, (), body.ignore_eos)
        try:
            resume = parse_resume(body.model_extra or {}, codec.vocab_size, max_tokens)
            if resume is not None and kv_params:
                raise ResumeError("a resumed request computes its KV here: no kv_transfer_params")
            TextAssembler(codec, stop, resume)  # text_sent must fit the tokens' text
        except ResumeError as exc:
            return _bad_request(str(exc))
        request = EngineRequest(request_id, prompt_ids, params, kv_params, time.time())
        if resume is not None:  # already generated: computed again like a preempted request's
            request.output_token_ids = list(resume.token_ids)
        outputs: asyncio.Queue[RequestOutput] = asyncio.Queue()
        loop = asyncio.get_running_loop()

        def sink(out: RequestOutput) -> None:
            loop.call_soon_threadsafe(outputs.put_nowait, out)

        try:
            engine.submit(request, sink)
        except EngineDeadError as exc:
            return _engine_dead(exc)
        call = _Call(engine, request_id, body, stop, outputs, http_request, body.model or model_name, chat, resume)
        return await (_stream(call) if body.stream else _complete(call))

    return app


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _engine_dead(exc: EngineDeadError) -> JSONResponse:
    return JSONResponse(error_body(f"instance unavailable: {exc}", "engine_dead", 503), status_code=503)


def _bad_request(message: str) -> JSONResponse:
    return JSONResponse(error_body(message, "invalid_request_error", 400), status_code=400)


def _error_response(out: RequestOutput) -> JSONResponse:
    kind = "internal_error" if out.error_code in (None, "engine_error", "invalid_request") else "kv_load_failed"
    return JSONResponse(error_body(out.error_message or "request failed", kind, out.error_code), status_code=500)


@dataclass(frozen=True)
class _Chat:
    """A chat completion: answered as chat.completion (chunks), usage in the last chunk if asked."""

    include_usage: bool


@dataclass
class _Call:
    """One completion request in flight: what its answer is built from."""

    engine: Engine
    request_id: str
    body: CompletionRequest
    stop: tuple[str, ...]
    outputs: asyncio.Queue[RequestOutput]
    http_request: Request
    model: str
    chat: _Chat | None
    resume: Resume | None = None

    def body_json(self, text: str, out: RequestOutput, chunk: bool = False, first: bool = False) -> dict[str, Any]:
        """A completion / chat.completion body, or (chunk) one event of a stream."""
        final = out.finished
        args = (self.request_id, self.model, text, out.finish_reason if final else None, out.num_prompt_tokens,
                out.num_output_tokens, out.kv_transfer_params if final else None,
                {"kvferry": {"recomputed_tokens": out.num_recomputed_tokens}} if final else None)  # fmt: skip
        if self.chat is None:
            return completion_body(*args)
        if chunk:
            return chat_chunk(*args, first=first, include_usage=self.chat.include_usage)
        return chat_body(*args)

    async def next(self) -> RequestOutput | None:
        """The next engine output, or None (and the request aborted) when the client went away."""
        while True:
            try:
                # asyncio.timeout, not wait_for: wait_for drops a cancel that lands as an output arrives.
                async with asyncio.timeout(_DISCONNECT_POLL_S):
                    return await self.outputs.get()
            except TimeoutError:
                if await self.http_request.is_disconnected():
                    self.engine.abort(self.request_id)
                    return None
            except asyncio.CancelledError:  # cut at the drain's bound: nobody waits for the rest any more
                self.engine.abort(self.request_id)
                raise


async def _complete(call: _Call) -> Response:
    assembler = TextAssembler(call.engine.codec, call.stop, call.resume)
    while True:
        out = await call.next()
        if out is None:
            return Response(status_code=499)
        assembler.add(out.new_token_ids, out.finished)
        if out.finished:
            break
    if out.finish_reason == "error":
        return _error_response(out)
    return JSONResponse(call.body_json(assembler.text, out))


async def _stream(call: _Call) -> Response:
    # Wait for the first output before answering, so a failed KV load is still a clean HTTP 500.
    first = await call.next()
    if first is None:
        return Response(status_code=499)
    if first.finished and first.finish_reason == "error":
        return _error_response(first)
    assembler = TextAssembler(call.engine.codec, call.stop, call.resume)
    sent_first = call.resume is not None  # a resumed chat stream's role chunk comes from the proxy
    # The proxy asks for each chunk's token ids, to resume the stream elsewhere if this instance dies.
    with_ids = bool((call.body.model_extra or {}).get(TOKEN_IDS_FIELD))
    pending_ids: list[int] = []

    def chunk(text: str, out: RequestOutput) -> str:
        nonlocal sent_first
        data = call.body_json(text, out, chunk=True, first=not sent_first)
        if with_ids:
            data[TOKEN_IDS_FIELD] = pending_ids.copy()
            pending_ids.clear()
        sent_first = True
        return f"data: {json.dumps(data)}\n\n"

    async def events() -> AsyncIterator[str]:
        out: RequestOutput | None = first
        finished = False
        try:
            while out is not None:
                if out.finished and out.finish_reason == "error":
                    yield f"data: {json.dumps(error_body(out.error_message or 'failed', 'kv_load_failed', out.error_code))}\n\n"
                    finished = True
                    break
                text = assembler.add(out.new_token_ids, out.finished)
                if with_ids:  # tokens whose text is held back ride the next chunk
                    pending_ids.extend(out.new_token_ids)
                if text or out.finished:
                    yield chunk(text, out)
                if out.finished:
                    finished = True
                    break
                out = await call.outputs.get()
            yield "data: [DONE]\n\n"
        finally:
            if not finished:
                call.engine.abort(call.request_id)

    return StreamingResponse(events(), media_type="text/event-stream")
