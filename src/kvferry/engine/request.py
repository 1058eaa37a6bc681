"""Plain request data: status, sampling parameters, token bookkeeping."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from kvferry.connector.messages import FirstToken


class RequestStatus(enum.IntEnum):
    WAITING = 0
    WAITING_FOR_REMOTE_KVS = 1
    RUNNING = 2
    PREEMPTED = 3
    FINISHED_STOPPED = 10
    FINISHED_LENGTH_CAPPED = 11
    FINISHED_ABORTED = 12
    FINISHED_ERROR = 13

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    kv_transfer_params: dict[str, Any] | None = None
    arrival_time: float = 0.0

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    # Set when the request ends FINISHED_ERROR: the failure cause (e.g. "transport") and a message.
    error_code: str | None = None
    error_message: str | None = None
    # Filled by the connector's request_finished (P side): params handed back to the client.
    out_kv_transfer_params: dict[str, Any] | None = None
    num_recomputed_tokens: int = 0
    num_external_tokens: int = 0
    num_preemptions: int = 0
    # P, progressive push: the connector reads its blocks while it runs, so it holds every block it can
    # need from admission on and is never preempted.
    kv_lent: bool = False

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output, without building the whole list (engine hot path)."""
        n = len(self.prompt_token_ids)
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        if end <= n:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.finish_reason

    @property
    def first_token(self) -> FirstToken | None:
        """What P sampled after the prompt, and how: D emits it instead of computing that position again."""
        if not self.output_token_ids:
            return None
        return FirstToken(self.output_token_ids[0], self.sampling_params.temperature, self.sampling_params.seed)
