"""Prefill side (worker role): hold finished prefills' blocks per transfer_id and serve D's pulls.

One ZMQ ROUTER and one TransferEngine per TP rank, each served by its own thread. A pull may arrive
before the prefill is done: it is parked, gets the blocks the running prefill completed after each
engine step (progressive push, `parked.py`) and the rest when the KV is ready; while P has the request
queued or prefilling it waits (D is told so in heartbeat acks), otherwise it is answered err_reqs
"Timeout waiting for P side ready" after the abort timeout. Writes run on one thread per D peer
(`senders.py`), so a hung D stalls only its own writes; a D whose lease runs out has its writes
cancelled. Replies go back through the rank thread (ZMQ sockets are not thread-safe). No rank loop
dies of one bad item: it answers that item with ERROR, logs, counts and goes on.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence

import numpy as np
import zmq

from kvferry.connector.faults import FaultSpec
from kvferry.connector.layout import KVLayout, d_ranks_for
from kvferry.connector.messages import FirstToken
from kvferry.connector.metrics import Metrics
from kvferry.connector.prefill.guard import RealTimeWhileCalm, state_fd_budget
from kvferry.connector.prefill.rank_loop import RankLoop
from kvferry.connector.prefill.senders import PeerSenders
from kvferry.connector.prefill.transfers import TransferTable
from kvferry.connector.prefill.writes import SCRATCH_REGION, RankShared
from kvferry.connector.zmq_context import liveness_context
from kvferry.transfer.base import TransferEngine


class Producer:
    def __init__(
        self,
        layout: KVLayout,
        engines: Sequence[TransferEngine] | Mapping[int, TransferEngine],
        host: str,
        abort_timeout_s: float,
        faults: FaultSpec,
        metrics: Metrics,
        secret: bytes | None = None,
        *,
        control_port: int = 0,
        advertise_host: str | None = None,
        tp_size: int | None = None,
    ) -> None:
        """`engines`: one per P rank, or rank → engine for only the ranks this process serves (a vLLM
        worker is one rank of `tp_size`); `control_port`: rank r's ROUTER binds it + r (0: the kernel
        picks); `advertise_host`: the host D is told to dial (default `host`)."""
        self.layout = layout
        self.secret = secret  # seals every control message (connector/auth.py); None: loopback only
        self.engines = dict(engines) if isinstance(engines, Mapping) else dict(enumerate(engines))
        self.tp_size = len(self.engines) if tp_size is None else tp_size
        self.abort_timeout_s = abort_timeout_s
        self.metrics = metrics
        # Replicated KV (MLA) is sent by P rank 0 alone: the other ranks hold no transfer, and hand a
        # finished prefill's blocks back at once (vLLM frees them only once every rank did).
        self.serves_nobody = layout.replicated and 0 not in self.engines
        self._scratch = np.frombuffer(b"\xa5" * 64, dtype=np.uint8).copy()
        for engine in self.engines.values():
            for name, buffer in layout.regions().items():
                engine.register(name, buffer)
            engine.register(SCRATCH_REGION, self._scratch)
        self.table = TransferTable(abort_timeout_s, metrics, self._pairs)
        self._stop = threading.Event()
        self._in_step = threading.Event()
        state_fd_budget(self.tp_size)
        self._ctx, io_threads = liveness_context(zmq.Context, lift=False)
        self.senders = PeerSenders("kv-send")
        # The loops get exactly what they use, never the producer itself.
        self._shared = RankShared(self._ctx, self._stop, self._in_step, secret, layout, self.engines, self.table,
                                  self.senders, faults, metrics, abort_timeout_s, self.tp_size,
                                  RealTimeWhileCalm(io_threads, metrics))
        self._ranks = [RankLoop(self._shared, rank, host, control_port and control_port + rank, advertise_host or host)
                       for rank in self.engines]
        self.control_addrs = [r.address for r in self._ranks]  # advertised
        self.boot_ids = [r.boot.hex() for r in self._ranks]  # each rank's, drawn at start (bootstrap answer)
        self.control_bound = [r.bound for r in self._ranks]
        for r in self._ranks:
            r.start()

    @property
    def faults(self) -> FaultSpec:
        return self._shared.faults

    @faults.setter
    def faults(self, faults: FaultSpec) -> None:
        self._shared.faults = faults  # the loops read it per pull: takes effect at once

    # ---- engine thread ----------------------------------------------------------------------------
    def step_started(self) -> None:
        """The engine is inside a step: a request sent to P meanwhile may still sit in its queue."""
        self._in_step.set()

    def step_ended(self) -> None:
        self._in_step.clear()

    @property
    def in_step(self) -> bool:
        return self._in_step.is_set()

    def add_working(self, transfer_id: str, request_id: str) -> None:
        """P queued the request: pulls for it wait for the prefill, however long it takes."""
        if not self.serves_nobody:
            self.table.add_working(transfer_id, request_id)

    def add_progress(self, transfer_id: str, request_id: str, block_ids: list[int], num_tokens: int,
                     prompt_digest: str) -> None:
        """The running prefill completed these prompt blocks: a parked pull gets them now."""
        if not self.serves_nobody:
            self.table.add_progress(transfer_id, request_id, block_ids, num_tokens, prompt_digest)
            self._wake_all()

    def add_ready(self, transfer_id: str, request_id: str, block_ids: list[int], num_tokens: int,
                  prompt_digest: str = "", first_token: FirstToken | None = None) -> None:
        if self.serves_nobody:
            self.table.add_unserved(request_id)
            return
        self.table.add_ready(transfer_id, request_id, block_ids, num_tokens, time.monotonic(), prompt_digest,
                             first_token)
        self._wake_all()

    def add_dead(self, transfer_id: str, request_id: str, lent: bool = False) -> None:
        """The P request ended without KV: answer any pull for it with ERROR. `lent`: its blocks come too
        (a partial write may read them), handed back once none does."""
        if self.serves_nobody:
            if lent:
                self.table.add_unserved(request_id)
        else:
            self.table.add_dead(transfer_id, request_id, time.monotonic(), lent)
        self._wake_all()

    def drain_finished(self) -> set[str]:
        return self.table.drain_finished()

    def close(self) -> None:
        self._stop.set()
        self._wake_all()
        for r in self._ranks:
            r.join()
        self.senders.close()
        self._ctx.destroy(linger=0)

    def _wake_all(self) -> None:
        for r in self._ranks:
            r.wake()

    def _pairs(self, d_tp: int) -> set[tuple[int, int]]:
        """(P rank, D rank) pairs that share heads: a transfer is done when each was served."""
        heads = self.layout.num_kv_heads
        return {(p, d) for p in self.engines for d in d_ranks_for(heads, self.tp_size, p, d_tp, self.layout.replicated)}
