"""OpenAI chat completions and models: request shape, response bodies, and how a chat becomes a prompt."""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kvferry.serving.openai_shapes import OpenAIRequest, error_body, response_body, usage


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False


class ChatCompletionRequest(OpenAIRequest):
    model: str | None = None
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: int | None = Field(None, ge=1, le=1_000_000)
    max_completion_tokens: int | None = Field(None, ge=1, le=1_000_000)
    temperature: float = Field(1.0, ge=0.0, le=100.0)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=1)
    ignore_eos: bool = False
    kv_transfer_params: dict[str, Any] | None = None

    def token_limit(self, default: int) -> int:
        return self.max_completion_tokens or self.max_tokens or default

    def template_messages(self) -> list[dict[str, str]]:
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in self.messages]


def models_body(names: list[str], max_model_len: int) -> dict[str, Any]:
    """One entry per served name; every one is the same model (`root`: the first name)."""
    return {
        "object": "list",
        "data": [
            {"id": name, "object": "model", "created": int(time.time()), "owned_by": "kvferry", "root": names[0],
             "max_model_len": max_model_len}
            for name in names
        ],
    }  # fmt: skip


def model_not_found(name: str) -> dict[str, Any]:
    return error_body(f"The model `{name}` does not exist.", "invalid_request_error", "model_not_found")


def chat_body(request_id: str, model: str, text: str, finish_reason: str | None, prompt_tokens: int,
              completion_tokens: int, kv_transfer_params: dict[str, Any] | None,
              extra: dict[str, Any] | None = None) -> dict[str, Any]:
    choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
              "finish_reason": finish_reason}
    return response_body(_chat_id(request_id), "chat.completion", model, choice, extra,
                         usage=usage(prompt_tokens, completion_tokens), kv_transfer_params=kv_transfer_params)


def chat_chunk(request_id: str, model: str, text: str, finish_reason: str | None, prompt_tokens: int,
               completion_tokens: int, kv_transfer_params: dict[str, Any] | None,
               extra: dict[str, Any] | None = None, first: bool = False,
               include_usage: bool = False) -> dict[str, Any]:
    delta: dict[str, Any] = {"content": text}
    if first:
        delta["role"] = "assistant"
    fields: dict[str, Any] = {}
    if finish_reason is not None:
        fields["kv_transfer_params"] = kv_transfer_params
        if include_usage:
            fields["usage"] = usage(prompt_tokens, completion_tokens)
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
    return response_body(_chat_id(request_id), "chat.completion.chunk", model, choice, extra, **fields)


def _chat_id(request_id: str) -> str:
    return request_id.replace("cmpl-", "chatcmpl-", 1)
