"""OpenAI-compatible request/response shapes (plus vLLM's `kv_transfer_params` extension)."""

from __future__ import annotations

import math
import time
import uuid
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

# Deeper JSON than any real request; also keeps a hostile body from exhausting the recursion limit.
MAX_JSON_DEPTH = 64


def check_json_safe(value: Any, depth: int = 0) -> None:
    """Raise ValueError for what JSON can carry but we cannot echo or forward: strings with lone
    surrogates (no UTF-8 form), NaN / Infinity, and absurd nesting."""
    if depth > MAX_JSON_DEPTH:
        raise ValueError(f"JSON nested deeper than {MAX_JSON_DEPTH} levels")
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError("string is not valid Unicode (lone surrogate)") from None
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError("numbers must be finite (no NaN or Infinity)")
    elif isinstance(value, dict):
        for k, v in value.items():
            check_json_safe(k, depth + 1)
            check_json_safe(v, depth + 1)
    elif isinstance(value, list):
        for v in value:
            check_json_safe(v, depth + 1)


class OpenAIRequest(BaseModel):
    """A request body: unknown OpenAI fields (user, logit_bias, ...) are accepted and ignored, as vLLM
    does; what JSON can carry but we cannot echo or forward is refused (`check_json_safe`)."""

    model_config = ConfigDict(extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _json_safe(cls, data: Any) -> Any:
        check_json_safe(data)
        return data


class CompletionRequest(OpenAIRequest):
    model: str | None = None
    prompt: str | list[int] = Field(..., description="One prompt: text, or byte-level token ids")
    max_tokens: int = Field(16, ge=1, le=1_000_000)
    temperature: float = Field(1.0, ge=0.0, le=100.0)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stop: str | list[str] | None = None
    stream: bool = False
    n: int = Field(1, ge=1, le=1)
    ignore_eos: bool = False
    kv_transfer_params: dict[str, Any] | None = None


class ErrorDetail(BaseModel):
    message: str
    type: str
    code: str | int | None = None


class ErrorBody(BaseModel):
    """OpenAI-style error; for a failed KV load `type` is "kv_load_failed" and `code` the cause."""

    error: ErrorDetail


_ERROR_DESCRIPTIONS = {
    400: "Invalid request",
    404: "No such model (code model_not_found)",
    500: "KV load failed (type kv_load_failed, code = the cause) or an engine error",
    502: "An instance could not be reached (proxy)",
    503: "The instance's engine is dead (type engine_dead); /health answers 503 too",
}
# OpenAPI declarations shared by the instance and the proxy.
COMPLETION_200: dict[int | str, dict[str, Any]] = {
    200: {"description": "A completion; with stream=true, server-sent events", "content": {"text/event-stream": {}}}
}
METRICS_200: dict[int | str, dict[str, Any]] = {
    200: {"description": "Prometheus text format", "content": {"text/plain": {}}}
}


def error_responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    return {code: {"model": ErrorBody, "description": _ERROR_DESCRIPTIONS[code]} for code in codes}


def error_body(message: str, type_: str, code: str | int | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "code": code}}


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def response_body(request_id: str, kind: str, model: str, choice: dict[str, Any], extra: dict[str, Any] | None,
                  **fields: Any) -> dict[str, Any]:
    """A completion-like body with one choice; `fields` and then `extra` follow the choices."""
    body = {"id": request_id, "object": kind, "created": int(time.time()), "model": model, "choices": [choice],
            **fields}
    return {**body, **extra} if extra else body


def completion_body(request_id: str, model: str, text: str, finish_reason: str | None, prompt_tokens: int,
                    completion_tokens: int, kv_transfer_params: dict[str, Any] | None,
                    extra: dict[str, Any] | None = None) -> dict[str, Any]:
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    return response_body(request_id, "text_completion", model, choice, extra,
                         usage=usage(prompt_tokens, completion_tokens), kv_transfer_params=kv_transfer_params)


def new_request_id() -> str:
    return f"cmpl-{uuid.uuid4().hex}"


def validation_message(exc: Any) -> str:
    """One readable line from a pydantic / FastAPI validation error."""
    errors = exc.errors()
    first = errors[0] if errors else {}
    where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
    message = str(first.get("msg", "invalid request"))
    return f"{where}: {message}" if where else message
