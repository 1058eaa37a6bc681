"""The engine-core thread: schedule → connector meta → load → model → worker report → scheduler update.

It is the only thread that touches scheduler state; everything else talks to it through a command
queue, and it hands results back through per-request sinks."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, fields
from typing import Any

from kvferry.connector.base import KVConnector, NoOpConnector
from kvferry.connector.metrics import Metrics
from kvferry.engine.block_pool import BlockPool
from kvferry.engine.loader import LoadedModel, load_model
from kvferry.engine.model import ModelConfig, SeqChunk, TinyLlama, sample
from kvferry.engine.outputs import RequestOutput, Sink, Streams, stop_status
from kvferry.engine.request import Request, RequestStatus
from kvferry.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput, WorkerResult
from kvferry.engine.text import ByteCodec

__all__ = ["Engine", "EngineBusyError", "EngineConfig", "EngineDeadError", "RequestOutput", "Sink"]

log = logging.getLogger(__name__)

# While transfers are pending the engine polls its worker this often; a worker that wakes the engine
# (`KVConnector.set_waker`) is polled only as a safety net, so waiting for KV costs no CPU.
_POLL_INTERVAL_S = 0.001
_WOKEN_POLL_INTERVAL_S = 0.05
# The engine thread publishes its state for /debug/state at most this often (and whenever idle).
_PUBLISH_INTERVAL_S = 1.0


class EngineDeadError(RuntimeError):
    """The engine thread is gone (it died or was stopped): nothing submitted now would ever run."""


class EngineBusyError(TimeoutError):
    """The engine thread is alive but inside a step longer than the wait: ask again later."""


@dataclass(frozen=True)
class EngineConfig:
    """The engine's settings (`kvferry serve` reads its defaults here)."""

    num_blocks: int = 2048
    block_size: int = SchedulerConfig.block_size
    seed: int = 0
    kv_load_failure_policy: str = SchedulerConfig.kv_load_failure_policy
    max_num_batched_tokens: int = SchedulerConfig.max_num_batched_tokens
    max_prefill_chunk: int = SchedulerConfig.max_prefill_chunk
    max_num_seqs: int = SchedulerConfig.max_num_seqs
    role: str = "both"
    engine_id: str = "engine-0"
    model: ModelConfig | None = None


class Engine:
    def __init__(self, config: EngineConfig, scheduler_connector: KVConnector | None = None,
                 worker_connector: KVConnector | None = None, metrics: Metrics | None = None,
                 loaded: LoadedModel | None = None) -> None:
        self.config = config
        self.metrics = metrics or Metrics()
        if loaded is None:
            if config.model is not None:
                loaded = LoadedModel("kvferry-tiny-llama", TinyLlama(config.model), ByteCodec(), "tiny")
            else:
                loaded = load_model("tiny", config.seed)
        self.loaded = loaded
        self.model = loaded.model
        self.codec = loaded.codec
        self.kv_spec = self.model.kv_cache_spec(config.num_blocks, config.block_size)
        self.kv_cache = self.model.allocate_kv_cache(self.kv_spec)
        # Resident from the start (the pool hands out blocks in turn, so otherwise every first use of a
        # block faults its pages in): no page faults mid-request, the footprint is taken at startup,
        # and RSS that grows later is a leak, which `kvferry soak` judges.
        self.kv_cache.fill(0.0)
        self.pool = BlockPool(config.num_blocks)
        self.scheduler_connector = scheduler_connector or NoOpConnector()
        self.worker_connector = worker_connector or self.scheduler_connector
        self.worker_connector.register_kv_cache(self.kv_spec, self.kv_cache)
        shared = {f.name for f in fields(SchedulerConfig)} & {f.name for f in fields(config)}
        # vocab_size: P's first token in any other id is not used (D computes its own).
        sched_config = SchedulerConfig(vocab_size=self.model.config.vocab_size,
                                       **{n: getattr(config, n) for n in shared})
        self.scheduler = Scheduler(sched_config, self.pool, self.scheduler_connector)
        self._streams = Streams(self.metrics)
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        woken = self.worker_connector.set_waker(self._wakeup.set)
        self.worker_connector.quarantine_loads()  # the scheduler quarantines (LoadReport.quarantined)
        self._poll_interval_s = _WOKEN_POLL_INTERVAL_S if woken else _POLL_INTERVAL_S
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"engine-core-{config.engine_id}", daemon=True)
        self.metrics.kv_blocks_total.set(config.num_blocks)
        self.metrics.kv_blocks_free.set(config.num_blocks)
        self.fatal_error: BaseException | None = None
        self._connector_step = False
        # Held across "is the thread alive?" + put, and across the dying thread's last drain, so no
        # command can be queued after that drain (it would never run and its caller would wait forever).
        self._call_lock = threading.Lock()
        self._published: dict[str, Any] | None = None
        self._published_at = 0.0
        # The snapshot command still queued (a long step): later callers wait for it rather than queue more.
        self._snapshot_lock = threading.Lock()
        self._pending_snapshot: Future[dict[str, Any]] | None = None

    # ---- thread-safe API --------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        self._wakeup.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        self.worker_connector.close()
        if self.scheduler_connector is not self.worker_connector:
            self.scheduler_connector.close()

    @property
    def alive(self) -> bool:
        return self.fatal_error is None and not self._stopped.is_set()

    def submit(self, request: Request, sink: Sink) -> None:
        """Queue a request; raises EngineDeadError (and never calls sink) when the engine is gone."""
        self._call(lambda: self._add(request, sink))

    def abort(self, request_id: str) -> None:
        if self.alive:  # a dead engine has already failed every stream: nothing left to abort
            self._call(lambda: self._abort(request_id), quiet=True)

    def reject(self, request: Request) -> None:
        """A request the API turned away before the engine saw it: its connector may still owe a peer
        something (D tells P to free the prefill it holds for this request)."""
        if self.alive:
            self._call(lambda: self._reject(request), quiet=True)

    def snapshot(self, timeout: float = 5.0) -> dict[str, Any]:
        """State for /debug/state, computed on the engine thread so no step pays for it. Raises
        EngineBusyError when the thread is in a step longer than `timeout`, EngineDeadError when it is
        gone."""
        with self._snapshot_lock:
            future = self._pending_snapshot
            if future is None or future.done():
                fresh: Future[dict[str, Any]] = Future()
                self._call(lambda: self._answer_snapshot(fresh))
                future = self._pending_snapshot = fresh
        try:
            return future.result(timeout=timeout)
        except TimeoutError:
            if not self.alive:  # stopped mid-step: the queued command never runs
                raise EngineDeadError("engine is stopped") from None
            raise EngineBusyError(f"the engine thread is in a step longer than {timeout}s") from None

    def published_state(self) -> dict[str, Any] | None:
        """The state the engine thread last published (between steps), or None before the first."""
        return self._published

    def run_until_idle(self, max_steps: int = 100_000) -> int:
        """Drive the engine on the calling thread (tests, benches; never with start()). Returns steps."""
        for steps in range(max_steps):
            self._drain_commands()
            s = self.scheduler
            if not (s.has_unfinished or s.remote or s.sending or s.quarantine):
                s.check_integrity()
                return steps
            self.step()
        raise RuntimeError(f"engine not idle after {max_steps} steps")

    def _call(self, command: Callable[[], None], quiet: bool = False) -> None:
        with self._call_lock:
            if not self.alive:
                if quiet:
                    return
                why = f"engine thread died: {self.fatal_error!r}" if self.fatal_error else "engine is stopped"
                raise EngineDeadError(why)
            self._commands.put(command)
        self._wakeup.set()

    # ---- engine thread ----------------------------------------------------------------------------
    def _run(self) -> None:
        idle_checked = False
        try:
            self._publish(force=True)
            while not self._stopped.is_set():
                self._drain_commands()
                s = self.scheduler
                if s.has_unfinished or s.remote or s.sending or s.quarantine or self._connector_step:
                    idle_checked = False
                    self._connector_step = False
                    self.step()
                    self._publish()
                    # A request that just finished has connector work for the next step (P: hand its
                    # blocks to the producer for D's pull): no wait before it.
                    if not (s.has_unfinished or s.has_finished_pending):
                        self._wakeup.wait(self._poll_interval_s)
                        self._wakeup.clear()
                    continue
                if not idle_checked:
                    s.check_integrity()
                    self._publish(force=True)
                    idle_checked = True
                self._wakeup.wait(0.05)
                self._wakeup.clear()
        except BaseException as exc:  # an engine bug: fail every stream loudly rather than hang them
            log.exception("engine core died")
            self._die(exc)

    def _die(self, exc: BaseException) -> None:
        with self._call_lock:
            self.fatal_error = exc
        # No command can be queued any more; run what was queued in dead mode (submits fail at once).
        try:
            self._drain_commands()
        except BaseException:
            log.exception("draining commands of a dead engine")
        message = f"engine thread died: {exc!r}"
        self._streams.fail_all(message)
        if self._published is not None:
            self._published = {**self._published, "fatal_error": message}

    def _drain_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if self.fatal_error is None:
                command()
                continue
            try:  # dead mode: one failing command must not strand the ones behind it
                command()
            except Exception:
                log.exception("command on a dead engine")

    def _answer_snapshot(self, future: Future[dict[str, Any]]) -> None:
        try:
            future.set_result(self._snapshot())
        except BaseException as exc:
            future.set_exception(exc)

    def _publish(self, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self._published_at >= _PUBLISH_INTERVAL_S:
            self._published, self._published_at = self._snapshot(), now

    def _add(self, request: Request, sink: Sink) -> None:
        if self.fatal_error is not None:
            sink(RequestOutput(request.request_id, [], True, "error", "engine_error",
                               f"engine thread died: {self.fatal_error!r}"))
            return
        try:
            self.scheduler.add_request(request)
        except ValueError as exc:
            sink(RequestOutput(request.request_id, [], True, "error", "invalid_request", str(exc)))
            return
        self._streams.add(request.request_id, sink, emitted=len(request.output_token_ids))

    def _reject(self, request: Request) -> None:
        request.status = RequestStatus.FINISHED_ABORTED
        self.scheduler_connector.request_finished(request, [])
        self._connector_step = True  # the connector hands its work to the worker in a step

    def _abort(self, request_id: str) -> None:
        request = self.scheduler.abort_request(request_id)
        if request is not None:
            self._streams.emit(request)

    def step(self) -> SchedulerOutput:
        out = self.scheduler.schedule()
        self.worker_connector.start_load_kv(self.scheduler_connector.build_connector_meta(out))
        sampled: dict[str, int] = {}
        block_tables = self.scheduler.block_tables
        seq_chunks = [
            SeqChunk(chunk.request.token_ids(chunk.start_pos, chunk.start_pos + chunk.num_tokens),
                     chunk.start_pos, block_tables[chunk.request.request_id], chunk.request.num_prompt_tokens,
                     want_logits=chunk.start_pos + chunk.num_tokens == chunk.request.num_tokens)
            for chunk in out.chunks
        ]
        if seq_chunks:
            all_logits = self.model.forward_batch(self.kv_cache, self.config.block_size, seq_chunks)
            for chunk, logits in zip(out.chunks, all_logits, strict=True):
                if logits is not None:
                    request, params = chunk.request, chunk.request.sampling_params
                    sampled[request.request_id] = sample(logits, params.temperature, params.seed, request.num_tokens)
        finished_sending, finished_recving = self.worker_connector.get_finished(out.finished_req_ids)
        if finished_sending:
            self.scheduler_connector.transfers_ended(finished_sending)
        report = WorkerResult(finished_sending, finished_recving, self.worker_connector.take_load_reports())
        recomputed_before, unknown_before = self.scheduler.num_recomputed_tokens, self.scheduler.num_unknown_ids
        for request in self.scheduler.update(out, sampled, report):
            if not request.is_finished:
                status = stop_status(request, self.codec)
                if status is not None:
                    self.scheduler.finish(request, status)
            self._streams.emit(request)
        self._update_gauges(recomputed_before, unknown_before)
        return out

    def _update_gauges(self, recomputed_before: int, unknown_before: int) -> None:
        m, s = self.metrics, self.scheduler
        m.kv_blocks_free.set(self.pool.num_free)
        m.requests_waiting_for_remote_kv.set(len(s.remote))
        if s.num_recomputed_tokens > recomputed_before:
            m.recomputed_tokens.inc(s.num_recomputed_tokens - recomputed_before)
        if s.num_unknown_ids > unknown_before:
            m.unknown_connector_ids.inc(s.num_unknown_ids - unknown_before)

    def _snapshot(self) -> dict[str, Any]:
        stats = self.worker_connector.stats()
        return {
            "role": self.config.role,
            "engine_id": self.config.engine_id,
            "requests_by_status": self.scheduler.requests_by_status(),
            "blocks_total": self.pool.num_total,
            "blocks_free": self.pool.num_free,
            "blocks_quarantined": sum(len(b) for b in self.scheduler.quarantine.values()),
            "pending_pulls": int(stats.get("pending_pulls", 0)),
            "pending_sends": int(stats.get("pending_sends", 0)) + len(self.scheduler.sending),
            "step": self.scheduler.step_count,
            "unknown_connector_ids": self.scheduler.num_unknown_ids,
            "recomputed_tokens": self.scheduler.num_recomputed_tokens,
            "connector": stats,
            "time": time.time(),
        }
