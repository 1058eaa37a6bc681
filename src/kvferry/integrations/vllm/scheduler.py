"""KVFerryConnector's scheduler half, in vLLM's engine core: vLLM's `Request` and `SchedulerOutput` reach
kvferry's `PDConnector` through small views; kv_transfer_params that can never work read as None."""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from kvferry.connector.bootstrap import BootstrapServer
from kvferry.connector.facade import PDConnector
from kvferry.connector.messages import FirstToken
from kvferry.connector.metadata import PDMetadata
from kvferry.connector.params import (
    KVTransferParamsError,
    RouterParamsError,
    normalize_kv_transfer_params,
    validate_kv_transfer_params,
)
from kvferry.integrations.vllm.groups import KVGroups
from kvferry.integrations.vllm.metadata import (
    KVFerryConnectorMetadata,
    KVFerryHandshake,
    KVFerryWorkerMetadata,
)
from kvferry.integrations.vllm.metrics import KVFerryStats
from kvferry.integrations.vllm.progress import ProgressTracker
from kvferry.integrations.vllm.quarantine import BlockQuarantine
from kvferry.integrations.vllm.settings import DECODE, PREFILL

log = logging.getLogger("kvferry.integrations.vllm.scheduler")

_MAX_REMEMBERED = 10_000  # bounded memory of per-request notes (warnings, failure causes)


class _RequestView:
    """A vLLM `Request` as kvferry's `RequestLike`; kv_transfer_params that can never work read as None."""

    __slots__ = ("_request", "_params")

    def __init__(self, request: Any, params: dict[str, Any] | None) -> None:
        self._request, self._params = request, params

    @property
    def request_id(self) -> str:
        return str(self._request.request_id)

    @property
    def prompt_token_ids(self) -> list[int]:
        return list(self._request.prompt_token_ids or ())

    @property
    def kv_transfer_params(self) -> dict[str, Any] | None:
        return self._params

    @property
    def num_prompt_tokens(self) -> int:
        return int(self._request.num_prompt_tokens)

    @property
    def finish_reason(self) -> str | None:
        reason = self._request.get_finished_reason()
        return None if reason is None else str(reason)  # vLLM's FinishReason prints "stop", "length", ...

    @property
    def first_token(self) -> FirstToken | None:
        return None  # vLLM's D samples its first token itself: nothing for P to hand over


@dataclass(frozen=True)
class _StepView:
    """A vLLM `SchedulerOutput` as kvferry's `SchedulerOutputLike`."""

    step: int
    finished_req_ids: set[str]


class KVFerryScheduler:
    """The scheduler half: vLLM's scheduler-side calls on the `PDConnector` of each role this instance runs."""

    def __init__(self, pd: dict[str, PDConnector], groups: KVGroups | None = None, num_blocks: int = 0) -> None:
        self.pd = pd
        self.groups, self.num_blocks = groups, num_blocks
        self._step = 0
        self._bad_params: OrderedDict[str, None] = OrderedDict()
        self.failure_causes: OrderedDict[str, tuple[str, str]] = OrderedDict()  # for logs and tests
        self._failures = KVFerryStats()  # failures by cause since the last stats report
        self._transfer_ids: OrderedDict[str, str] = OrderedDict()  # request id → transfer id (for logs)
        # Requests already told to the prefill side as queued (reported once; forgotten when they finish).
        self.queued: OrderedDict[str, None] = OrderedDict()
        self._warned_local = False
        self.bootstrap_server: BootstrapServer | None = None
        # D: blocks a posted read may still write stay out of vLLM's pool (quarantine.py)
        self.quarantine = BlockQuarantine()
        # P: long prompts go to D while vLLM's chunked prefill computes them (progress.py)
        self.progress = ProgressTracker(pd[PREFILL], groups, self._view) if PREFILL in pd else None

    def set_handshake(self, metadata: dict[int, Any]) -> None:
        """P: every worker's bootstrap entries, once the KV caches are registered; served for all ranks."""
        prefill = self.pd.get(PREFILL)
        if prefill is None or self.bootstrap_server is not None:
            return
        config = prefill.config
        regs = [reg for m in metadata.values() if isinstance(m, KVFerryHandshake) for reg in m.registrations]
        ranks = sorted(reg.tp_rank for reg in regs)
        if ranks != list(range(config.tp_size)):
            raise RuntimeError(f"kvferry: bootstrap entries for P ranks {ranks}, expected 0..{config.tp_size - 1}: "
                               "a worker did not register its KV cache")
        server = BootstrapServer(config.host, config.bootstrap_port, config.faults, config.secret)
        for reg in regs:
            server.register(reg)
        server.start()
        self.bootstrap_server = server
        log.info("kvferry bootstrap on %s:%d serves engine %s, %d rank(s)", config.host, config.bootstrap_port,
                 config.engine_id, config.tp_size)

    def close(self) -> None:
        if self.bootstrap_server is not None:
            self.bootstrap_server.stop()

    def _view(self, request: Any) -> _RequestView:
        params = request.kv_transfer_params
        try:
            # vllm-router's shapes (NIXL: no transfer_id; Mooncake: http:// bootstrap address) → kvferry's.
            params = normalize_kv_transfer_params(params, str(request.request_id))
            validate_kv_transfer_params(params)
        except (KVTransferParamsError, RouterParamsError) as exc:
            if request.request_id not in self._bad_params:
                _remember(self._bad_params, request.request_id, None)
                log.warning("request %s: kv_transfer_params ignored (%s): %s", request.request_id, exc, params)
            params = None
        return _RequestView(request, params)

    def on_new_request(self, request: Any) -> None:
        """vLLM (0.33) added a request to its waiting queue."""
        self._note_queued(request)

    def _note_queued(self, request: Any) -> None:
        """P: tell the prefill side once that a `do_remote_decode` request is queued, so its transfer is
        `working` however long P's queue is."""
        prefill = self.pd.get(PREFILL)
        if prefill is None or request.request_id in self.queued:
            return
        _remember(self.queued, request.request_id, None)  # also for requests without a transfer: looked at once
        view = self._view(request)
        if (view.kv_transfer_params or {}).get("do_remote_decode"):
            prefill.on_request_added(view)
            if self.progress is not None:
                self.progress.add(request)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        # Where `on_new_request` does not exist (older vLLM), P learns here its request is queued.
        self._note_queued(request)
        decode = self.pd.get(DECODE)
        if decode is None:
            return 0, False
        view = self._view(request)
        if num_computed_tokens % decode.config.block_size:
            # A pull starts on a block edge: a hit ending inside a block computes the rest locally.
            return 0, False
        return decode.get_num_new_matched_tokens(view, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        decode = self.pd.get(DECODE)
        if decode is None or num_external_tokens == 0:
            return  # the 2nd call after an async load (0 tokens) and every non-load call
        _remember(self._transfer_ids, request.request_id, str((request.kv_transfer_params or {}).get("transfer_id", "")))
        view = self._view(request)
        if self.groups is None or not self.groups.hybrid:
            (block_ids,) = blocks.get_block_ids()
            decode.update_state_after_alloc(view, block_ids, num_external_tokens)
        elif (view.kv_transfer_params or {}).get("do_remote_prefill"):
            try:  # past D's prefix-cache hit, in every group (a sliding window's from the hit at the earliest)
                first = decode.scheduler.first_block(view, num_external_tokens)
                ids = self.groups.transfer_ids(blocks.get_block_ids(), view.num_prompt_tokens, self.num_blocks, "D",
                                               first)
            except ValueError as exc:  # vLLM allocated other blocks than its sliding window skips: a bug
                raise RuntimeError(f"request {request.request_id}: vLLM's blocks do not match its KV cache "
                                   f"groups' windows: {exc}") from exc
            decode.scheduler.pull(view, ids, first)

    def build_connector_meta(self, scheduler_output: Any) -> KVFerryConnectorMetadata:
        if self._step == 0 and DECODE in self.pd and self.pd[DECODE].config.transfer == "nixl":
            self.quarantine.check_bound()  # before the first pull: NIXL reads outlive failures (quarantine)
        self._step += 1
        step = _StepView(self._step, set(scheduler_output.finished_req_ids))
        # Before the roles' metadata is built, so it carries the progress this step reaches.
        preempted = [] if self.progress is None else self.progress.step(scheduler_output)
        by_role = {}
        for r, pd in self.pd.items():
            meta = pd.build_connector_meta(step)
            assert isinstance(meta, PDMetadata)
            # A request that ended before admission has a release-only pull here: that release is its
            # abort (aborting it too would leave P holding the blocks until its lease expires).
            meta.finished_req_ids -= {p.request_id for p in meta.to_pull if not p.block_ids}
            by_role[r] = meta
        return KVFerryConnectorMetadata(by_role, preempted)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self.queued.pop(request.request_id, None)  # vLLM calls this once per request: nothing left to report
        if self.progress is not None:
            self.progress.finished(request.request_id)
        view = self._view(request)
        params = view.kv_transfer_params or {}
        if params.get("do_remote_decode") and PREFILL in self.pd:
            return self.pd[PREFILL].request_finished(view, block_ids)
        if params.get("do_remote_prefill") and DECODE in self.pd:
            return self.pd[DECODE].request_finished(view, block_ids)
        if len(self.pd) == 1 and not self._warned_local:
            # Legal, but usually a router whose P/D fields vLLM drops: both sides compute everything.
            self._warned_local = True
            log.warning("request %s on this %s carried no kv_transfer_params for it: served locally, no KV "
                        "transfer (a router whose P/D fields vLLM drops, e.g. sglang-router, makes every "
                        "request do this; logged once)", request.request_id, next(iter(self.pd)))
        return False, None

    def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's hybrid allocator (`SupportsHMA`): the request's block ids per KV cache group."""
        if self.groups is None or not self.groups.hybrid:
            return self.request_finished(request, list(block_ids[0]))
        ids: list[int] = []
        if (self._view(request).kv_transfer_params or {}).get("do_remote_decode"):
            try:
                ids = self.groups.transfer_ids(block_ids, int(request.num_prompt_tokens), self.num_blocks, "P")
            except ValueError as exc:  # no blocks to lend: the transfer is dead, D hears so at once
                if request.get_finished_reason() is not None and str(request.get_finished_reason()) in ("stop", "length"):
                    log.error("request %s: its KV cannot be sent: %s", request.request_id, exc)
        return self.request_finished(request, ids)

    def update_connector_output(self, connector_output: Any) -> None:
        prefill = self.pd.get(PREFILL)
        sent = getattr(connector_output, "finished_sending", None)
        if prefill is not None and sent:
            prefill.transfers_ended(set(sent))  # their transfer_ids are free for another request again
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        # Before vLLM frees the ended loads' blocks; also without worker metadata (a TP rank may have none).
        self.quarantine.update(meta, set(connector_output.finished_recving or ()))
        if isinstance(meta, KVFerryWorkerMetadata):
            for request_id, (cause, message) in meta.causes.items():
                _remember(self.failure_causes, request_id, (cause, message))
                self._failures.add(cause)
                # One structured line per failure (grep "kvferry_kv_load_failed"), in the engine core's log.
                log.warning("kvferry_kv_load_failed %s", json.dumps(
                    {"request_id": request_id, "transfer_id": self._transfer_ids.get(request_id, ""),
                     "cause": cause, "message": message}, sort_keys=True))

    def get_kv_connector_stats(self) -> KVFerryStats | None:
        """Failures since the last call: vLLM carries them to its /metrics."""
        if self._failures.is_empty():
            return None
        stats, self._failures = self._failures, KVFerryStats()
        return stats


def _remember(store: OrderedDict[str, Any], key: str, value: Any) -> None:
    store[key] = value
    store.move_to_end(key)
    while len(store) > _MAX_REMEMBERED:
        store.popitem(last=False)

