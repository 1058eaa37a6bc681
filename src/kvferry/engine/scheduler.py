"""Continuous batching under a token budget, recompute-style preemption, and the connector contract."""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from kvferry.connector.base import KVConnector
from kvferry.connector.loads import LoadCause, LoadReport
from kvferry.connector.messages import FirstToken
from kvferry.engine.block_pool import BlockPool
from kvferry.engine.request import Request, RequestStatus

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SchedulerConfig:
    # As `PDConfig.block_size`, which the engine does not import (it would load the connector's servers).
    block_size: int = 16
    max_num_batched_tokens: int = 4096
    max_num_seqs: int = 64
    kv_load_failure_policy: str = "fail"  # or "recompute"
    # Chunked prefill cap per request and step, so decodes run between a long prompt's chunks. 0 = no cap.
    max_prefill_chunk: int = 256
    vocab_size: int | None = None  # P's first token is used only if it is one of these ids (None: any)


@dataclass
class ScheduledChunk:
    request: Request
    start_pos: int
    num_tokens: int


@dataclass
class SchedulerOutput:
    step: int
    chunks: list[ScheduledChunk] = field(default_factory=list)
    finished_req_ids: set[str] = field(default_factory=set)


@dataclass
class WorkerResult:
    """What the worker side reported after one step."""

    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    # What the loads of finished_recving lost (blocks, cause, quarantine) or brought (P's first token).
    loads: list[LoadReport] = field(default_factory=list)


class Scheduler:
    def __init__(self, config: SchedulerConfig, pool: BlockPool, connector: KVConnector) -> None:
        self.config = config
        self.pool = pool
        self.connector = connector
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        # KV landed (or recomputed after a failed load): they hold every block they need, so they are
        # admitted ahead of `waiting`.
        self.ready: deque[Request] = deque()
        self.running: list[Request] = []
        self.remote: dict[str, Request] = {}  # WAITING_FOR_REMOTE_KVS, or aborted while waiting
        self.block_tables: dict[str, list[int]] = {}
        self.sending: dict[str, list[int]] = {}  # finished, blocks lent to the connector (delay_free)
        # Blocks of failed loads a read may still write: out of the pool until the connector releases them.
        self.quarantine: dict[str, list[int]] = {}
        self._loads: dict[str, LoadReport] = {}  # reported, their request not yet in finished_recving
        self._finished_since_last_step: set[str] = set()
        self.step_count = 0
        self.num_unknown_ids = 0
        self.num_recomputed_tokens = 0

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        self.requests[request.request_id] = request
        self.waiting.append(request)
        self.connector.on_request_added(request)

    def abort_request(self, request_id: str) -> Request | None:
        request = self.requests.get(request_id)
        if request is None or request.is_finished:
            return None
        if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            # The worker may be writing into these blocks: free them only once it reports the request.
            request.status = RequestStatus.FINISHED_ABORTED
            self._finished_since_last_step.add(request_id)
            return request
        if request in self.running:
            self.running.remove(request)
        elif request in self.ready:
            self.ready.remove(request)
        else:
            self.waiting.remove(request)
        self._finish(request, RequestStatus.FINISHED_ABORTED)
        return request

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.ready or self.running)

    @property
    def has_finished_pending(self) -> bool:
        """Requests finished since the last step: the next one tells the connector."""
        return bool(self._finished_since_last_step)

    def schedule(self) -> SchedulerOutput:
        self.step_count += 1
        out = SchedulerOutput(self.step_count, finished_req_ids=self._finished_since_last_step)
        self._finished_since_last_step = set()
        budget = self.config.max_num_batched_tokens
        preempted = False
        scheduled: list[Request] = []
        running = list(self.running)
        while running and budget > 0:
            request = running.pop(0)
            n = self._chunk_size(request, budget)
            while not self._grow(request, request.num_computed_tokens + n):
                # A lent request is never the victim (a write may read its blocks); it never grows either.
                victim = next((r for r in reversed(running) if not r.kv_lent), None)
                if victim is None:
                    if not request.kv_lent:
                        self._preempt(request)
                    preempted = True
                    break
                running.remove(victim)
                self._preempt(victim)
                preempted = True
            else:
                scheduled.append(request)
                out.chunks.append(ScheduledChunk(request, request.num_computed_tokens, n))
                budget -= n
        # Ready requests first: they need no new block, so a head of `waiting` that cannot fit never
        # strands them.
        for queue in (self.ready, self.waiting):
            while queue and budget > 0 and not preempted and len(scheduled) < self.config.max_num_seqs:
                request = queue[0]
                if queue is self.waiting and request.status != RequestStatus.PREEMPTED:
                    if not self._admit_remote(request):
                        break
                    if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                        queue.popleft()
                        continue
                n = self._chunk_size(request, budget)
                lend = queue is self.waiting and request.status != RequestStatus.PREEMPTED and (
                    self.connector.pushes_progressively(request))
                want = request.num_prompt_tokens + request.sampling_params.max_tokens - 1 if lend else n
                if not self._grow(request, request.num_computed_tokens + want):
                    break  # first come, first served: nothing behind it may take the blocks it waits for
                request.kv_lent = request.kv_lent or lend
                queue.popleft()
                request.status = RequestStatus.RUNNING
                self.running.append(request)
                scheduled.append(request)
                out.chunks.append(ScheduledChunk(request, request.num_computed_tokens, n))
                budget -= n
        return out

    def _chunk_size(self, request: Request, budget: int) -> int:
        """Tokens of `request` to compute this step: all that remain, or a chunk ending on a block edge
        (where a chunk ends never changes the arithmetic)."""
        start, remaining = request.num_computed_tokens, request.num_tokens - request.num_computed_tokens
        cap = self.config.max_prefill_chunk or remaining
        n = min(remaining, budget, cap)
        if n < remaining:
            aligned = (start + n) // self.config.block_size * self.config.block_size - start
            n = aligned if aligned > 0 else n
        return n

    def _admit_remote(self, request: Request) -> bool:
        """Ask the connector about external KV; park async loads. False = not admissible yet."""
        matched, load_async = self.connector.get_num_new_matched_tokens(request, request.num_computed_tokens)
        if matched is None:
            return False
        blocks_needed = -(-request.num_tokens // self.config.block_size) if load_async else 0
        if load_async and not self.pool.can_allocate(blocks_needed):
            return False
        if load_async and matched > 0:
            blocks = self.pool.allocate(blocks_needed)
            self.block_tables[request.request_id] = blocks
            self.connector.update_state_after_alloc(request, blocks, matched)
            request.num_external_tokens = matched
            request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
            self.remote[request.request_id] = request
            return True
        self.connector.update_state_after_alloc(request, [], 0)
        return True

    def _grow(self, request: Request, num_tokens: int) -> bool:
        table = self.block_tables.get(request.request_id, [])
        need = -(-num_tokens // self.config.block_size) - len(table)
        if need <= 0:
            return True
        if not self.pool.can_allocate(need):
            return False  # leaves no empty table behind: a request without blocks has none
        self.block_tables[request.request_id] = table
        table.extend(self.pool.allocate(need))
        return True

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.pool.free(self.block_tables.pop(request.request_id, []))
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.waiting.appendleft(request)

    def update(self, out: SchedulerOutput, sampled: dict[str, int], worker: WorkerResult) -> list[Request]:
        """Apply one step's results; returns the requests that got a token or finished."""
        touched: list[Request] = []
        for chunk in out.chunks:
            request = chunk.request
            if request.is_finished:  # aborted during the step
                continue
            request.num_computed_tokens = chunk.start_pos + chunk.num_tokens
            if request.kv_lent and request.num_computed_tokens < request.num_prompt_tokens:
                table = self.block_tables[request.request_id]
                self.connector.prefill_progress(request, table, request.num_computed_tokens)
            token = sampled.get(request.request_id)
            if token is not None:
                request.output_token_ids.append(token)
                touched.append(request)
        touched.extend(self._apply_load_results(worker))
        for request_id in worker.finished_sending:
            returned = self.sending.pop(request_id, None)
            if returned is None:
                returned = self.quarantine.pop(request_id, None)
            if returned is None:
                self._unknown("finished_sending", request_id)
                continue
            self.pool.free(returned)
        return touched

    def _apply_load_results(self, worker: WorkerResult) -> list[Request]:
        # A load's report may come before (never after) its request shows up in finished_recving.
        for load in worker.loads:
            if load.request_id in self.remote:
                self._loads[load.request_id] = load
            else:
                self._unknown("load report", load.request_id)
        touched: list[Request] = []
        for request_id in worker.finished_recving:
            request = self.remote.pop(request_id, None)
            if request is None:
                self._unknown("finished_recving", request_id)
                continue
            load = self._loads.pop(request_id, LoadReport(request_id))
            if request.status == RequestStatus.FINISHED_ABORTED:
                self._release(request, load.quarantined)
                continue
            quarantined, first_invalid = load.quarantined, self._first_invalid(request_id, load)
            if quarantined or (load.cause is not None and first_invalid is None):
                first_invalid = 0  # without block detail, or with blocks still written: the whole request
            cause, message = (load.cause, load.detail) if load.cause else (LoadCause.KV_LOAD_FAILED,
                                                                           "KV load failed")
            if first_invalid is not None:
                if self.config.kv_load_failure_policy == "fail":
                    request.error_code, request.error_message = cause.value, message
                    self._finish(request, RequestStatus.FINISHED_ERROR, quarantined)
                    touched.append(request)
                    continue
                if quarantined:
                    self._recompute_elsewhere(request)
                    continue
                cut = first_invalid * self.config.block_size
                self.num_recomputed_tokens += request.num_tokens - cut
                request.num_recomputed_tokens += request.num_tokens - cut
                request.num_computed_tokens = cut
            elif (first := load.first_token) is not None and len(self.running) < self.config.max_num_seqs and (
                self._samples_alike(first, request)
            ):
                # The whole prompt landed and P sampled the first token as this request would: emit it.
                request.num_computed_tokens = request.num_tokens
                request.output_token_ids.append(first.token)
                request.status = RequestStatus.RUNNING
                self.running.append(request)
                touched.append(request)
                continue
            else:
                # The first output token is sampled locally: recompute the last prompt token.
                request.num_computed_tokens = request.num_tokens - 1
            request.status = RequestStatus.WAITING
            self.ready.append(request)
        return touched

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Called by the engine when a running request hits a stop condition."""
        self.running.remove(request)
        self._finish(request, status)

    def _finish(self, request: Request, status: RequestStatus, quarantined: bool = False) -> None:
        request.status = status
        self._finished_since_last_step.add(request.request_id)
        blocks = self.block_tables.pop(request.request_id, [])
        delay_free, params = self.connector.request_finished(request, [] if quarantined else blocks)
        request.out_kv_transfer_params = params
        del self.requests[request.request_id]
        self._put_away(request.request_id, blocks, quarantined, delay_free)

    def _release(self, request: Request, quarantined: bool) -> None:
        """An aborted remote load was reported: its blocks are safe to reuse (quarantined: once released)."""
        blocks = self.block_tables.pop(request.request_id, [])
        self.requests.pop(request.request_id, None)
        self.connector.request_finished(request, [] if quarantined else blocks)
        self._put_away(request.request_id, blocks, quarantined)

    def _put_away(self, request_id: str, blocks: list[int], quarantined: bool, delay_free: bool = False) -> None:
        """A finished request's blocks: quarantined (a read may still write them), lent to the connector
        (`delay_free`), or back to the pool."""
        if quarantined:
            self.quarantine[request_id] = blocks
        elif delay_free and blocks:
            self.sending[request_id] = blocks
        else:
            self.pool.free(blocks)

    def _recompute_elsewhere(self, request: Request) -> None:
        """`recompute` of a load whose blocks a read may still write: they go to quarantine and the whole
        prompt is computed again into fresh blocks."""
        self.quarantine[request.request_id] = self.block_tables.pop(request.request_id, [])
        self.num_recomputed_tokens += request.num_tokens
        request.num_recomputed_tokens += request.num_tokens
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(request)

    def _first_invalid(self, request_id: str, load: LoadReport) -> int | None:
        """The index of the load's first lost block in its request's table (None: none lost)."""
        index = {block_id: i for i, block_id in enumerate(self.block_tables[request_id])}
        first: int | None = None
        for block_id in load.block_ids:
            if block_id not in index:
                self._unknown("invalid_block_ids", str(block_id))
            elif first is None or index[block_id] < first:
                first = index[block_id]
        return first

    def _samples_alike(self, first: FirstToken, request: Request) -> bool:
        """P's first token is this request's own: in the vocabulary, same sampling, nothing generated yet."""
        params, vocab = request.sampling_params, self.config.vocab_size
        return (not request.output_token_ids and (vocab is None or 0 <= first.token < vocab)
                and (first.temperature, first.seed) == (params.temperature, params.seed))

    def _unknown(self, where: str, request_id: str) -> None:
        # vLLM asserts here and loses the whole engine; an unknown id is a connector bug, not a crash.
        self.num_unknown_ids += 1
        log.warning("connector reported %s for unknown request %s; ignored", where, request_id)

    def check_integrity(self) -> None:
        """Every block is free or held by exactly one owner (run whenever the engine goes idle)."""
        self.pool.check_invariants()
        held = sum(len(b) for b in (*self.block_tables.values(), *self.sending.values(), *self.quarantine.values()))
        if held + self.pool.num_free != self.pool.num_total:
            raise AssertionError(f"blocks leaked: free {self.pool.num_free} + held {held} != {self.pool.num_total}")

    def requests_by_status(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for request in self._all_live():
            counts[request.status.name] = counts.get(request.status.name, 0) + 1
        return counts

    def _all_live(self) -> Iterable[Request]:
        yield from self.waiting
        yield from self.ready
        yield from self.running
        yield from self.remote.values()

