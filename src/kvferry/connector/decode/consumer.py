"""Decode side (worker role): pull KV from P ranks into local blocks, and the failure spine.

Every pull runs as a coroutine on one asyncio loop (its own thread). Whatever goes wrong — ERROR
reply, err_reqs, data-plane error, exception, receive timeout (liveness off; a live P is asked
again), bootstrap failure, lost peer, deadline, bad checksum — ends in `_handle_failed_recv`, which
reports the request with exactly the blocks not completely and correctly written. The loop never
touches scheduler state: it only fills the outbox that the engine thread drains once per step.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections.abc import Iterable, Mapping, Sequence

import zmq
import zmq.asyncio

from kvferry.connector.bootstrap import (
    BootstrapClient,
    BootstrapError,
    BootstrapSlow,
    EngineInfo,
    PrefillAllowList,
    lookup_uniform,
)
from kvferry.connector.decode.dealer import Dealer, Dealers
from kvferry.connector.decode.landed import Landed, ask_again, p_owes_since, stall_stage
from kvferry.connector.decode.liveness import DelayEstimator
from kvferry.connector.decode.pulls import (
    LEASE_HEARTBEATS,
    ConsumerConfig,
    Outbox,
    PullMeta,
    PullSpec,
    PullTask,
)
from kvferry.connector.digest import block_key
from kvferry.connector.layout import KVLayout, overlap, p_ranks_for
from kvferry.connector.loads import P_CAUSES, LoadCause, LoadReport
from kvferry.connector.messages import MAX_MESSAGE_BYTES, PullRequest, PullResponse, Release, Status, encode
from kvferry.connector.metrics import Metrics
from kvferry.connector.zmq_context import liveness_context
from kvferry.transfer.base import TransferEngine

log = logging.getLogger(__name__)


class PullTooLarge(ValueError):
    """A pull D must not send: over the control-message limit."""


class Consumer:
    def __init__(
        self,
        layout: KVLayout,
        engines: Sequence[TransferEngine] | Mapping[int, TransferEngine],
        config: ConsumerConfig,
        metrics: Metrics,
        bootstrap: BootstrapClient | None = None,
    ) -> None:
        self.layout = layout
        # D rank → its engine: every rank (kvferry's engine), or only this process's (a vLLM worker)
        self.engines = dict(engines) if isinstance(engines, Mapping) else dict(enumerate(engines))
        self.config = config
        self.metrics = metrics
        self.bootstrap = bootstrap or BootstrapClient(config.bootstrap_timeout_s, config.secret)
        self._allow = PrefillAllowList(config.prefill_allow)
        for engine in self.engines.values():
            for name, buffer in layout.regions().items():
                engine.register(name, buffer)
        self.outbox = Outbox()
        self._pulls: dict[str, PullMeta] = {}  # loop thread only
        self._dealers = Dealers(self._new_dealer)
        self._landed = Landed(self.outbox, layout, self.engines, config.checksums, self._dealers)
        self._ctx, _ = liveness_context(zmq.asyncio.Context)
        # Gaps between our own heartbeat ticks. When this loop lags, P hears from us late: we ask for a
        # lease that covers it (floor: LEASE_HEARTBEATS intervals; P caps it at its abort timeout). And
        # the box is loaded: a P that shares it gets as much slack before we call it dead.
        ceiling = config.heartbeat_ceiling_s
        self._tick_gaps = DelayEstimator(config.lease_s, ceiling, margin=float(LEASE_HEARTBEATS))
        self._own_lag = DelayEstimator(config.heartbeat_timeout_s, ceiling)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="kv-consumer", daemon=True)
        self._thread.start()
        if config.liveness:
            self._watchdog = asyncio.run_coroutine_threadsafe(self._heartbeats(), self.loop)
        self._sweeper = asyncio.run_coroutine_threadsafe(self._sweep_dealers(), self.loop)

    # ---- engine thread ----------------------------------------------------------------------------
    def start_pulls(self, specs: Iterable[PullSpec]) -> None:
        for spec in specs:
            self.loop.call_soon_threadsafe(self._start, spec)

    def abort(self, request_ids: Iterable[str]) -> None:
        ids = list(request_ids)
        if ids:
            self.loop.call_soon_threadsafe(self._abort, ids)

    def drain(self) -> tuple[set[str], set[int], dict[str, tuple[str, str]]]:
        return self.outbox.drain()

    @property
    def pending_pulls(self) -> int:
        return len(self._pulls)

    def close(self) -> None:
        async def shutdown() -> None:
            for coroutine in [p.coroutine for p in self._pulls.values() if p.coroutine is not None]:
                coroutine.cancel()
            if self.config.liveness:
                self._watchdog.cancel()
            self._sweeper.cancel()
            for dealer in self._dealers.values():
                dealer.close()

        if self.loop.is_running():
            asyncio.run_coroutine_threadsafe(shutdown(), self.loop).result(timeout=5)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=5)
        if not self._thread.is_alive():  # its epoll and self-pipe, not left to the garbage collector
            self.loop.close()
        self._ctx.destroy(linger=0)
        self.bootstrap.close()

    # ---- loop thread ------------------------------------------------------------------------------
    def _start(self, spec: PullSpec) -> None:
        now = time.monotonic()
        pull = PullMeta(spec, now, now + self.config.kv_load_deadline_s)
        if spec.request_id in self._pulls:
            log.warning("duplicate pull for request %s ignored", spec.request_id)
            return
        self._pulls[spec.request_id] = pull
        pull.coroutine = self.loop.create_task(self._run_pull(pull))

    async def _run_pull(self, pull: PullMeta) -> None:
        try:
            async with asyncio.timeout_at(self.loop.time() + (pull.deadline - time.monotonic())):
                info = await self._lookup(pull.spec)
                self._send_pulls(pull, info)
                await self._await_replies(pull)
        except TimeoutError:
            stage = stall_stage(pull, self._dealers, self.loop.time())
            self._handle_failed_recv([pull], LoadCause.DEADLINE, f"KV not loaded within {self.config.kv_load_deadline_s}s ({stage})")
        except BootstrapError as exc:
            self._handle_failed_recv([pull], LoadCause.BOOTSTRAP, str(exc))
        except PullTooLarge as exc:
            self._handle_failed_recv([pull], LoadCause.ERROR_REPLY, str(exc))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a receiver bug must still release the request
            log.exception("pull for %s failed unexpectedly", pull.request_id)
            self._handle_failed_recv([pull], LoadCause.TRANSPORT, f"receiver error: {exc!r}")

    async def _lookup(self, spec: PullSpec) -> EngineInfo:
        injected = self.config.faults.fault_for(spec.transfer_id) == "bootstrap"
        cached = self.bootstrap.cached(spec.bootstrap_addr, spec.engine_id)
        # A cached answer is trusted only while we are connected to its ranks: a P restarted at the
        # same address has new ZMQ ports, so ask again rather than pull from a dead port.
        fresh = injected or (self.config.liveness and cached is not None and not self._connected(cached))
        # A target outside the allow-list is never asked; every failure is one answer at one time.
        tid = spec.transfer_id if injected else None
        try:
            info = await lookup_uniform(self.bootstrap, self._allow, spec.bootstrap_addr, spec.engine_id, tid, fresh)
        except BootstrapSlow:
            if cached is None or injected:
                raise
            # P answered before and is slow now (its bootstrap server is Python, starved with the rest of
            # P): its last answer names its ranks, judged on the control plane (`docs/architecture.md`).
            log.info("bootstrap server %s slow to answer again: pulling from its last answer", spec.bootstrap_addr)
            info = cached
        if any(self._dealers.retired(r.receiver()) for r in info.ranks):
            # A P that restarted at its address since this (cached) answer, as another pull learnt.
            info = await lookup_uniform(self.bootstrap, self._allow, spec.bootstrap_addr, spec.engine_id, tid, True)
        return info

    def _connected(self, info: EngineInfo) -> bool:
        live = self._dealers.live()  # a P restarted at a rank's address since is another receiver
        heads, d_tp = self.layout.num_kv_heads, self.config.tp_size  # only the P ranks our D ranks pull from
        needed = {p for d in self.engines for p in p_ranks_for(heads, info.tp_size, d_tp, d, self.layout.replicated)}
        return all((r.control_addr, r.receiver()) in live for r in info.ranks if r.tp_rank in needed)

    def _send_pulls(self, pull: PullMeta, info: EngineInfo) -> None:
        heads_total = self.layout.num_kv_heads
        d_tp = self.config.tp_size
        for d_rank in self.engines:
            for p_rank in p_ranks_for(heads_total, info.tp_size, d_tp, d_rank, self.layout.replicated):
                heads = overlap(heads_total, info.tp_size, p_rank, d_tp, d_rank, self.layout.replicated)
                assert heads is not None
                rank = info.rank(p_rank)
                pull.tasks.append(PullTask(d_rank, p_rank, heads, rank.control_addr, rank.receiver()))
        pull.pull_tasks_count = len(pull.tasks)
        for task in pull.tasks:
            engine = self.engines[task.d_rank]
            ranges = [r for b in pull.block_ids for r in self.layout.block_runs(b, task.heads)]
            task.grant = engine.open_grant(ranges)
            task.digest_key = block_key(self.config.secret, pull.spec.transfer_id, task.grant)
            task.future = self.loop.create_future()
            request = PullRequest(
                transfer_id=pull.spec.transfer_id,
                d_request_id=pull.request_id,
                d_transfer_addr=engine.address,
                grant_token=task.grant,
                block_ids=pull.block_ids,
                d_num_blocks=self.layout.num_blocks,
                d_tp_size=d_tp,
                d_tp_rank=task.d_rank,
                num_tokens=pull.spec.num_tokens,
                lease_s=self.lease_s,
                want_checksums=self.config.checksums,
                d_layout=self.layout.describe(),
                prompt_digest=pull.spec.prompt_digest,
                first_block=pull.spec.first_block,
            )
            data = encode(request)
            if len(data) > MAX_MESSAGE_BYTES:  # P would refuse it; a huge frame would cost every pull
                raise PullTooLarge(f"pull message of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}: not sent")
            self._dealers.for_pull(task.d_rank, task.control_addr, task.receiver).send(
                (pull.spec.transfer_id, pull.request_id), task.future, data
            )

    async def _await_replies(self, pull: PullMeta) -> None:
        waiting = {t.future: t for t in pull.tasks if t.future is not None}
        deadline = self.loop.time() + self.config.recv_timeout_s
        while waiting and not pull.failed:
            done, _ = await asyncio.wait(
                waiting, timeout=max(0.0, deadline - self.loop.time()), return_when=asyncio.FIRST_COMPLETED
            )
            if not done:
                # P owes its answer (`p_owes_since`) or lives (`ask_again`): the request's deadline bounds it.
                owes = p_owes_since(pull, self._dealers)
                if owes is not None and owes + self.config.recv_timeout_s > self.loop.time():
                    deadline = owes + self.config.recv_timeout_s
                    continue
                if self.config.liveness and ask_again(pull, self._dealers):
                    deadline = self.loop.time() + self.config.recv_timeout_s
                    continue
                self._handle_failed_recv(
                    [pull], LoadCause.RECV_TIMEOUT, f"no reply from P within {self.config.recv_timeout_s}s"
                )
                return
            for future in done:
                self._on_response(pull, waiting.pop(future), future.result())

    def _on_response(self, pull: PullMeta, task: PullTask, resp: PullResponse) -> None:
        task.checksums = list(resp.checksums)
        if resp.status == Status.ERROR:
            cause = LoadCause(resp.cause) if resp.cause in P_CAUSES else LoadCause.ERROR_REPLY
            if not resp.cause and resp.err_msg.startswith("transport"):
                cause = LoadCause.TRANSPORT  # a P that predates the cause field
            self._handle_failed_recv([pull], cause, f"P rank {task.p_rank}: {resp.err_msg}")
        elif pull.request_id in resp.err_reqs:
            self._handle_failed_recv([pull], LoadCause.ERR_REQS, f"P rank {task.p_rank}: {resp.err_msg}")
        elif pull.request_id not in resp.ok_reqs and pull.block_ids:
            self._handle_failed_recv([pull], LoadCause.ERROR_REPLY, f"P rank {task.p_rank} finished without this request")
        else:
            self._landed.close_grant(task)
            bad = self._landed.bad_blocks(pull, [task])
            if bad:
                covered = all(self._landed.covered(pull, task, b) for b in bad)
                cause = LoadCause.CHECKSUM if covered else LoadCause.TRANSPORT
                self._handle_failed_recv(
                    [pull], cause, f"{len(bad)} block(s) from P rank {task.p_rank} {cause} error"
                )
                return
            task.done, task.first_token = True, resp.first_token
            pull.pull_tasks_count = max(0, pull.pull_tasks_count - 1)
            if pull.failed:  # another P rank already failed this request
                return
            if pull.pull_tasks_count == 0:
                self._succeed(pull)

    def _succeed(self, pull: PullMeta) -> None:
        if not self._stage_in(pull.block_ids):
            self._handle_failed_recv([pull], LoadCause.TRANSPORT,
                                     "received blocks could not be copied into the KV cache")
            return
        # Both clocks are time.monotonic() (asyncio's loop.time() is too).
        elapsed = time.monotonic() - self._end(pull)
        nbytes = len(pull.block_ids) * self.layout.block_bytes
        self.metrics.kv_transfers.inc()
        self.metrics.kv_transfer_bytes.inc(nbytes)
        self.metrics.kv_transfer_seconds.observe(elapsed)
        if pull.block_ids:  # a release-only pull is not the scheduler's business
            # P's first token, when every P rank named the same one (they sample once, in one engine).
            tokens = {t.first_token for t in pull.tasks}
            token = tokens.pop() if len(tokens) == 1 else None
            self._landed.report(pull, None if token is None else LoadReport(pull.request_id, first_token=token))

    def _stage_in(self, block_ids: list[int]) -> bool:
        try:
            self.layout.stage_in(block_ids)
        except Exception:
            log.exception("copying %d received block(s) into the KV cache failed", len(block_ids))
            return False
        return True

    # ---- the failure spine ------------------------------------------------------------------------
    def _handle_failed_recv(self, pulls: Iterable[PullMeta], cause: LoadCause, message: str) -> None:
        for pull in pulls:
            if self._pulls.get(pull.request_id) is not pull or pull.failed:
                continue  # unknown or already failed: each failure is counted once
            pull.failed = True
            invalid = [pull.block_ids[i] for i in self._landed.invalid_indices(pull)]
            self._end(pull)
            self._release_remote(pull)
            if cause in (LoadCause.RECV_TIMEOUT, LoadCause.TRANSPORT, LoadCause.PEER_DEAD, LoadCause.BOOTSTRAP):
                self.bootstrap.forget(pull.spec.bootstrap_addr, pull.spec.engine_id)
            if not pull.block_ids:  # release-only: it loads nothing (and the scheduler holds no request)
                log.info("release for %s not confirmed by P (%s): %s", pull.request_id, cause, message)
                continue
            self.metrics.kv_load_failures.labels(cause=cause).inc()
            log.warning("KV load for %s failed (%s): %s", pull.request_id, cause, message)
            bad = set(invalid)  # under `recompute` the scheduler keeps the blocks before the first bad one
            if not self._stage_in([b for b in pull.block_ids if b not in bad]):
                invalid = list(pull.block_ids)
            self._landed.report(pull, LoadReport(pull.request_id, tuple(invalid), cause, message))  # held while a grant drains

    def _end(self, pull: PullMeta) -> float:
        """The pull is over (success, failure or abort): no byte may land after this. Returns when P
        started writing (the earliest rank), or when the pull started if no rank did."""
        self._pulls.pop(pull.request_id, None)
        writing_since = []
        for task in pull.tasks:
            self._landed.close_grant(task)
            if task.future is not None and not task.future.done():
                task.future.cancel()
            dealer = self._dealers.get((task.d_rank, task.control_addr))
            if dealer is not None and (since := dealer.forget((pull.spec.transfer_id, pull.request_id))) is not None:
                writing_since.append(since)
        if pull.coroutine is not None and pull.coroutine is not asyncio.current_task():
            pull.coroutine.cancel()
        return min(writing_since, default=pull.started)

    def _release_remote(self, pull: PullMeta) -> None:
        """Tell P it may free the transfer's blocks now rather than at its timeout (best effort: the
        failure path must finish whatever this hits)."""
        try:
            data = encode(Release([pull.spec.transfer_id]))
            if len(data) > MAX_MESSAGE_BYTES:
                return  # its pull was never sent either
            for d_rank, addr, receiver in {(t.d_rank, t.control_addr, t.receiver) for t in pull.tasks}:
                if (dealer := self._dealers.for_release(d_rank, addr, receiver)) is not None:
                    dealer.send_raw(data)
        except Exception:
            log.exception("could not tell P to release transfer %r", pull.spec.transfer_id)

    def _abort(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            pull = self._pulls.get(request_id)
            if pull is None:
                continue
            pull.failed = True
            self._end(pull)
            if pull.tasks:
                self._release_remote(pull)
            elif pull.block_ids:  # aborted before P was asked: a release-only pull frees P's blocks
                self._start(dataclasses.replace(pull.spec, block_ids=[]))
            if pull.block_ids:
                self._landed.report(pull)

    def _new_dealer(self, addr: str, receiver: bytes) -> Dealer:
        c = self.config  # the ZMTP heartbeat: every interval, dead after the timeout (dealer.py)
        return Dealer(self._ctx, addr, receiver, self._on_peer_dead, c.liveness, self.metrics.heartbeat_rtt_seconds.observe,
                      c.secret, self.metrics.control_auth_failures.labels(side="decode").inc,
                      DelayEstimator(c.heartbeat_timeout_s, c.heartbeat_ceiling_s), c.heartbeat_interval_s)

    def _on_peer_dead(self, request_ids: list[str], cause: LoadCause, reason: str) -> None:
        """P is gone (`peer_dead`), or alive but not progressing (`deadline`: each pull names its stage)."""
        for pull in [self._pulls[r] for r in request_ids if r in self._pulls]:
            stage = f" ({stall_stage(pull, self._dealers, self.loop.time())})" if cause == LoadCause.DEADLINE else ""
            self._handle_failed_recv([pull], cause, reason + stage)

    async def _sweep_dealers(self) -> None:
        """Close DEALERs no pull waits on (`Dealers.sweep`)."""
        while True:
            await asyncio.sleep(min(0.5, self.config.dealer_idle_s))
            self._dealers.sweep(self.loop.time(), self.config.liveness, self.config.dealer_idle_s)

    @property
    def lease_s(self) -> float:
        """The lease D asks P for (0: liveness off, P's abort timeout): LEASE_HEARTBEATS intervals on an
        idle box, more while this loop's heartbeat ticks come late."""
        return self._tick_gaps.threshold() if self.config.liveness else 0.0

    async def _heartbeats(self) -> None:
        last = self.loop.time()
        while True:
            await asyncio.sleep(self.config.heartbeat_interval_s)
            now = self.loop.time()
            # The gap P sees between our heartbeats: the interval plus however late this loop woke.
            self._tick_gaps.observe(now - last)
            self._own_lag.observe(max(0.0, now - last - self.config.heartbeat_interval_s))  # how late we woke
            last = now
            lease_s, at_least = self.lease_s, self._own_lag.threshold()
            for dealer in list(self._dealers.values()):
                dealer.heartbeat(now, lease_s, at_least)
