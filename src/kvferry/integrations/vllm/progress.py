"""Progressive push inside vLLM: P writes a long prompt's blocks to D as chunked prefill completes them.

`ProgressTracker` (scheduler): a step's progress is `num_computed_tokens` plus the tokens scheduled in it.
`ProgressGate` (worker): that progress reaches the producer only after the step's forward ran; a request
preempted mid-prefill is rewound before the forward that may reuse its blocks."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

from kvferry.connector.base import RequestLike
from kvferry.connector.facade import PDConnector
from kvferry.connector.metadata import PDMetadata, Progress
from kvferry.integrations.vllm.groups import KVGroups

log = logging.getLogger("kvferry.integrations.vllm.progress")

PREEMPT_WAIT_S = 5.0  # how long a preemption waits for a write reading the request's blocks


class ProgressTracker:
    """Scheduler half: P requests that push progressively, their block ids, and each step's progress."""

    def __init__(self, prefill: PDConnector, groups: KVGroups | None, view: Callable[[Any], RequestLike]) -> None:
        self.prefill, self.view = prefill, view
        self.enabled = prefill.config.progressive_push and (groups is None or not groups.hybrid)
        self._requests: dict[str, Any] = {}  # request id → vLLM's Request, from queued until finished
        self._blocks: dict[str, list[int]] = {}  # request id → its block ids, as vLLM's worker holds them

    def __len__(self) -> int:
        return len(self._requests)

    def add(self, request: Any) -> None:
        """A `do_remote_decode` request was queued: it may push progressively once scheduled."""
        if self.enabled:
            self._requests[str(request.request_id)] = request

    def finished(self, request_id: str) -> None:
        self._requests.pop(request_id, None)
        self._blocks.pop(request_id, None)

    def step(self, scheduler_output: Any) -> list[tuple[str, str]]:
        """Tell the prefill side the progress this step reaches; returns (transfer id, request id) of
        tracked requests preempted in it."""
        if not self._requests:
            return []
        for new in scheduler_output.scheduled_new_reqs:
            if new.req_id in self._requests:
                self._blocks[new.req_id] = list(new.block_ids[0])
        cached = scheduler_output.scheduled_cached_reqs
        for req_id, new_ids in zip(cached.req_ids, cached.new_block_ids, strict=True):
            if req_id not in self._requests:
                continue
            if req_id in cached.resumed_req_ids:
                self._blocks[req_id] = list(new_ids[0]) if new_ids is not None else []
            elif new_ids is not None and req_id in self._blocks:  # never a list that misses its first blocks
                self._blocks[req_id].extend(new_ids[0])
        preempted = []
        for req_id in scheduler_output.preempted_req_ids or ():
            request = self._requests.get(req_id)
            if request is not None:
                self._blocks.pop(req_id, None)  # freed: a resumed request gets new ones
                params = request.kv_transfer_params or {}
                if isinstance(params.get("transfer_id"), str):
                    preempted.append((str(params["transfer_id"]), req_id))
        for req_id, n in scheduler_output.num_scheduled_tokens.items():
            request = self._requests.get(req_id)
            if request is None or req_id not in self._blocks:
                continue
            view = self.view(request)
            if self.prefill.pushes_progressively(view):
                self.prefill.prefill_progress(view, self._blocks[req_id], int(request.num_computed_tokens) + int(n))
        return preempted


class ProgressGate:
    """Worker half: each step's progress waits for that step's forward; preempted requests rewound."""

    def __init__(self, prefill: PDConnector, device: Callable[[], Any]) -> None:
        self.prefill = prefill
        self.device = device  # the KV cache's device (None: host memory, nothing to wait for)
        self._pending: list[Progress] = []

    def hold(self, meta: PDMetadata) -> PDMetadata:
        """The step's metadata without its progress, which waits here for `forward_ended`."""
        if not meta.progress:
            return meta
        self._pending.extend(meta.progress)
        return dataclasses.replace(meta, progress=[])

    def forward_ended(self) -> None:
        """vLLM's `wait_for_save`: the step's forward was issued; once it ran, its blocks may go."""
        if not self._pending:
            return
        _synchronize(self.device())
        pending, self._pending = self._pending, []
        producer = self.prefill.worker.producer
        assert producer is not None
        for p in pending:
            producer.add_progress(p.transfer_id, p.request_id, p.block_ids, p.num_tokens, p.prompt_digest)

    def preempted(self, requests: list[tuple[str, str]]) -> None:
        """vLLM's `handle_preemptions`: no write reads their blocks when this returns."""
        producer = self.prefill.worker.producer
        if not requests or producer is None:
            return
        gone = {r for _, r in requests}
        self._pending = [p for p in self._pending if p.request_id not in gone]
        for transfer_id, request_id in requests:
            writes = producer.table.rewind(transfer_id, request_id, PREEMPT_WAIT_S)
            if not writes:
                continue
            log.warning("request %s preempted while %d write(s) of its blocks ran past %.0fs: cancelled, "
                        "its transfer %s ends", request_id, len(writes), PREEMPT_WAIT_S, transfer_id)
            for w in writes:
                producer.engines[w.p_rank].abort_writes(w.peer, w.token)
            if producer.table.rewind(transfer_id, request_id, PREEMPT_WAIT_S):
                log.error("request %s: a cancelled write still reads its freed blocks; D's checksums reject "
                          "what it changes", request_id)


def _synchronize(device: Any) -> None:
    """Wait for the kernels already issued on `device` (the step's forward); host memory: nothing."""
    if device is None or getattr(device, "type", "cpu") in ("cpu", "meta"):
        return
    import torch

    started = time.monotonic()
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
    else:
        accelerator = getattr(torch, device.type, None)
        if accelerator is None or not hasattr(accelerator, "synchronize"):
            raise RuntimeError(f"kvferry cannot wait for a forward on device {device}: progressive push needs it")
        accelerator.synchronize(device)
    log.debug("waited %.3fs for the forward's kernels", time.monotonic() - started)
