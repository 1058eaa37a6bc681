"""Test doubles that answer as vLLM's OpenAI server does, byte for byte where it matters.

`aborting_decode()`: a vLLM 0.33 D whose engine aborts every request it runs, as SIGTERM without
`--shutdown-timeout` does (EngineCore finishes them FINISHED_ABORTED and sends each a final output with no
token, finish_reason "abort"). The OpenAI layer answers that HTTP 200 (`_raise_if_error` raises for "error"
only): a non-streamed completion with empty text and 0 completion tokens; a stream of one chunk with empty
text and finish_reason "abort" (a chat stream: its role chunk first), then `[DONE]`. The bodies below are
what vLLM 0.33's pydantic models dump for that output (completion/serving.py, chat_completion/serving.py).

`sequential_prefill()`: a vLLM P that announces no engine id (its /health is an empty 200), so the proxy
prefills first and hands D the answer's kv_transfer_params: empty ones, so any D serves the prompt alone."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse


class Counter:
    """How many completion requests an instance was sent."""

    def __init__(self) -> None:
        self.requests = 0


def _usage(prompt_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens, "completion_tokens": 0,
            "prompt_tokens_details": None, "completion_tokens_details": None}


def aborted_completion(model: str, prompt_tokens: int) -> dict[str, Any]:
    return {
        "id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()), "model": model,
        "choices": [{"index": 0, "text": "", "logprobs": None, "finish_reason": "abort", "stop_reason": None,
                     "token_ids": None, "prompt_logprobs": None, "prompt_token_ids": None, "routed_experts": None,
                     "weight_versions": None}],
        "service_tier": None, "system_fingerprint": None, "usage": _usage(prompt_tokens),
        "kv_transfer_params": None, "ec_transfer_params": None, "metrics": None,
    }  # fmt: skip


def aborted_chat(model: str, prompt_tokens: int) -> dict[str, Any]:
    message = {"role": "assistant", "content": "", "refusal": None, "annotations": None, "audio": None,
               "function_call": None, "reasoning": None}
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()), "model": model,
        "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": "abort", "stop_reason": None,
                     "token_ids": None, "routed_experts": None, "weight_versions": None}],
        "service_tier": None, "system_fingerprint": None, "usage": _usage(prompt_tokens), "prompt_logprobs": None,
        "prompt_token_ids": None, "prompt_text": None, "kv_transfer_params": None, "ec_transfer_params": None,
        "metrics": None,
    }  # fmt: skip


def aborted_stream(model: str, chat: bool) -> Iterator[str]:
    """The SSE lines, compact JSON as pydantic's model_dump_json(exclude_unset=True) writes them."""
    created = int(time.time())
    if chat:
        head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion.chunk", "created": created,
                "model": model}
        yield _sse({**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                         "finish_reason": None}], "prompt_token_ids": None, "prompt_text": None})
        yield _sse({**head, "choices": [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "abort",
                                         "stop_reason": None, "token_ids": None, "weight_versions": None}],
                    "kv_transfer_params": None})
    else:
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": created, "model": model}
        yield _sse({**head, "choices": [{"index": 0, "text": "", "logprobs": None, "finish_reason": "abort",
                                         "stop_reason": None, "prompt_token_ids": None, "token_ids": None,
                                         "weight_versions": None}], "kv_transfer_params": None})
    yield "data: [DONE]\n\n"


def _sse(event: dict[str, Any]) -> str:
    return f"data: {json.dumps(event, separators=(',', ':'))}\n\n"


def aborting_decode(counter: Counter, model: str = "tiny") -> FastAPI:
    app = FastAPI()

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)  # vLLM's: an empty 200 while its engine shuts down

    async def answer(request: Request, chat: bool) -> Response:
        counter.requests += 1
        body = await request.json()
        if body.get("stream"):
            return StreamingResponse(aborted_stream(model, chat), media_type="text/event-stream")
        return JSONResponse(aborted_chat(model, 5) if chat else aborted_completion(model, 5))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await answer(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await answer(request, chat=True)

    return app


def sequential_prefill(counter: Counter) -> FastAPI:
    app = FastAPI()

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    async def prefill(request: Request) -> JSONResponse:
        counter.requests += 1
        await request.body()
        return JSONResponse({"id": "cmpl-p", "object": "text_completion", "model": "tiny",
                             "choices": [{"index": 0, "text": "", "finish_reason": "length"}],
                             "kv_transfer_params": {}})

    @app.post("/v1/completions")
    async def completions(request: Request) -> JSONResponse:
        return await prefill(request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> JSONResponse:
        return await prefill(request)

    return app
