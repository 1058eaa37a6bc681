"""What each request's client sees: its output chunks, when it stops, and the per-request latency histograms.

Only the engine thread calls in here (`Streams` is its table of live clients); a sink that raises is logged
and never takes the engine down."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvferry.connector.metrics import Metrics
from kvferry.engine.request import Request, RequestStatus
from kvferry.engine.text import TextCodec

log = logging.getLogger(__name__)


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    error_code: str | None = None
    error_message: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_recomputed_tokens: int = 0


Sink = Callable[[RequestOutput], None]


@dataclass
class _Stream:
    sink: Sink
    emitted: int = 0
    last_token_at: float | None = None  # wall clock of the previous emitted token (for inter-token latency)


def stop_status(request: Request, codec: TextCodec) -> RequestStatus | None:
    """Why a running request stops after its latest token (EOS, a stop token or string, max_tokens), or None."""
    params = request.sampling_params
    token = request.output_token_ids[-1]
    if (token == codec.eos_token_id and not params.ignore_eos) or token in params.stop_token_ids:
        return RequestStatus.FINISHED_STOPPED
    if params.stop and any(stop in codec.decode(request.output_token_ids) for stop in params.stop):
        return RequestStatus.FINISHED_STOPPED
    if len(request.output_token_ids) >= params.max_tokens:
        return RequestStatus.FINISHED_LENGTH_CAPPED
    return None


class Streams:
    """The live requests' sinks, each with how much of its output it has been sent."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self._streams: dict[str, _Stream] = {}

    def __len__(self) -> int:
        return len(self._streams)

    def add(self, request_id: str, sink: Sink, emitted: int = 0) -> None:
        """`emitted`: output tokens the client already has (a resumed request's): never sent again."""
        self._streams[request_id] = _Stream(sink, emitted)

    def fail_all(self, message: str) -> None:
        """The engine died: every live stream ends with `engine_error`."""
        for request_id, stream in list(self._streams.items()):
            try:
                stream.sink(RequestOutput(request_id, [], True, "error", "engine_error", message))
            except Exception:
                log.exception("output sink for %s failed", request_id)
        self._streams.clear()

    def emit(self, request: Request) -> None:
        """Send the request's tokens not yet sent (and its end, once finished) to its sink."""
        stream = self._streams.get(request.request_id)
        if stream is None:
            return
        new_tokens = request.output_token_ids[stream.emitted :]
        stream.emitted = len(request.output_token_ids)
        finished = request.is_finished
        output = RequestOutput(request.request_id, new_tokens, finished, request.status.finish_reason,
                               request.error_code, request.error_message, request.out_kv_transfer_params,
                               request.num_prompt_tokens, len(request.output_token_ids),
                               request.num_recomputed_tokens)
        self._observe_latency(request, stream, len(new_tokens), finished)
        if finished:
            del self._streams[request.request_id]
            self.metrics.requests_finished.labels(reason=request.status.finish_reason).inc()
        try:
            stream.sink(output)
        except Exception:  # a broken client sink must never take the engine down
            log.exception("output sink for %s failed", request.request_id)

    def _observe_latency(self, request: Request, stream: _Stream, num_new: int, finished: bool) -> None:
        """Per-request histograms as vLLM keeps them: TTFT, inter-token latency, e2e, prompt/output tokens."""
        m, now = self.metrics, time.time()
        if num_new:
            if stream.last_token_at is None:
                m.time_to_first_token.observe(max(0.0, now - request.arrival_time))
            else:
                gap = (now - stream.last_token_at) / num_new
                for _ in range(num_new):
                    m.inter_token_latency.observe(gap)
            stream.last_token_at = now
        if finished and request.status.finish_reason != "error":
            m.e2e_request_latency.observe(max(0.0, now - request.arrival_time))
            m.request_prompt_tokens.observe(request.num_prompt_tokens)
            m.request_generation_tokens.observe(len(request.output_token_ids))
