"""OpenAI-compatible request/response shapes (plus vLLM's `kv_transfer_params` extension)."""

from __future__ import annotations

import time
import uuid
from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class CompletionRequest(BaseModel):
    # Unknown OpenAI fields (user, logit_bias, ...) are accepted and ignored, as vLLM does.
    model_config = ConfigDict(extra="allow")

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


def error_body(message: str, type_: str, code: str | int | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "code": code}}


def completion_body(
    request_id: str,
    model: str,
    text: str,
    finish_reason: str | None,
    prompt_tokens: int,
    completion_tokens: int,
    kv_transfer_params: dict[str, Any] | None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": request_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
        "kv_transfer_params": kv_transfer_params,
    }
    if extra:
        body.update(extra)
    return body


def new_request_id() -> str:
    return f"cmpl-{uuid.uuid4().hex}"
