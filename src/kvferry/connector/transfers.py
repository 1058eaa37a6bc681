"""P's transfers by transfer_id: blocks held for D, placeholders for early pulls, leases, tombstones.

Shared by the engine thread (ready / dead transfers) and every rank thread (pulls, heartbeats,
releases) under one lock; finished transfers are handed to the engine as `finished_sending`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from kvferry.connector.metrics import Metrics

log = logging.getLogger(__name__)

NOT_READY_MSG = "Timeout waiting for P side ready."
MAX_PLACEHOLDERS = 100_000  # transfers we track before their prefill is done (pull-before-ready)


@dataclass
class Transfer:
    transfer_id: str
    expires: float  # blocks (or a placeholder) are dropped after this
    request_id: str | None = None
    block_ids: list[int] | None = None  # set once the prefill is done
    num_tokens: int = 0
    dead: str | None = None  # the P request ended without KV (aborted, error)
    inflight: int = 0  # writes reading these blocks right now: never free under them
    abandoned: bool = False  # D released it (or gave up) before it was ready: free on arrival
    served: set[tuple[int, int]] = field(default_factory=set)  # (p_rank, d_rank) pairs done

    @property
    def ready(self) -> bool:
        return self.block_ids is not None


class TransferTable:
    def __init__(
        self, abort_timeout_s: float, metrics: Metrics, pairs: Callable[[int], set[tuple[int, int]]]
    ) -> None:
        self.abort_timeout_s = abort_timeout_s
        self.metrics = metrics
        self._pairs = pairs  # D tp size → the (P rank, D rank) pairs a transfer must serve
        self.lock = threading.Lock()
        self._transfers: dict[str, Transfer] = {}
        self._finished: set[str] = set()

    def __len__(self) -> int:
        return len(self._transfers)

    def ids(self) -> list[str]:
        with self.lock:
            return list(self._transfers)

    # ---- engine thread ----------------------------------------------------------------------------
    def add_ready(self, transfer_id: str, request_id: str, block_ids: list[int], num_tokens: int, now: float) -> None:
        with self.lock:
            t = self._transfers.get(transfer_id)
            if t is None:
                t = self._transfers[transfer_id] = Transfer(transfer_id, 0.0)
            t.request_id, t.block_ids, t.num_tokens = request_id, block_ids, num_tokens
            t.expires = now + self.abort_timeout_s
            if t.abandoned:  # D gave up before the prefill finished: nobody will pull
                self.finish(t)

    def add_dead(self, transfer_id: str, now: float) -> None:
        with self.lock:
            t = self._transfers.setdefault(transfer_id, Transfer(transfer_id, now + self.abort_timeout_s))
            t.dead = "prefill request ended without KV (aborted or failed)"

    def drain_finished(self) -> set[str]:
        with self.lock:
            finished, self._finished = self._finished, set()
        return finished

    def pending_sends(self) -> int:
        with self.lock:
            return sum(1 for t in self._transfers.values() if t.ready)

    def writes_in_flight(self) -> int:
        with self.lock:
            return sum(t.inflight for t in self._transfers.values())

    # ---- rank threads -----------------------------------------------------------------------------
    def get(self, transfer_id: str) -> Transfer | None:
        return self._transfers.get(transfer_id)

    def get_or_placeholder(self, transfer_id: str, now: float) -> Transfer | None:
        """Under the lock. A pull may come before the prefill ends: track it (None: too many)."""
        t = self._transfers.get(transfer_id)
        if t is None:
            if len(self._transfers) >= MAX_PLACEHOLDERS:
                return None
            t = self._transfers[transfer_id] = Transfer(transfer_id, now + self.abort_timeout_s)
        return t

    def finish(self, t: Transfer, expired: bool = False) -> None:
        """Under the lock: forget the transfer and hand its blocks back to the engine."""
        self._transfers.pop(t.transfer_id, None)
        if t.request_id is not None:
            self._finished.add(t.request_id)
        if expired and t.ready:
            self.metrics.kv_leases_expired.inc()
            log.warning("transfer %s expired: its blocks were never (fully) pulled", t.transfer_id)

    def abandon(self, transfer_id: str, now: float) -> None:
        """Under the lock. D gave up on a transfer whose prefill is not done: free its blocks the
        moment it finishes instead of at the abort timeout."""
        t = self.get_or_placeholder(transfer_id, now)
        if t is not None:
            t.abandoned = True

    def renew(self, transfer_ids: Iterable[str], lease_s: float, now: float) -> list[str]:
        """D's heartbeat: extend the leases it names; returns the ids we do not hold."""
        unknown = []
        with self.lock:
            for tid in transfer_ids:
                t = self._transfers.get(tid)
                if t is None:
                    unknown.append(tid)
                elif t.ready:
                    t.expires = max(t.expires, now + (lease_s or self.abort_timeout_s))
        return unknown

    def release(self, transfer_ids: Iterable[str], now: float) -> None:
        with self.lock:
            for tid in transfer_ids:
                t = self._transfers.get(tid)
                if t is not None and (t.ready or t.dead):
                    self.finish(t)
                else:
                    self.abandon(tid, now)

    def write_done(self, transfer_id: str, p_rank: int, d_rank: int, d_tp: int, failed: bool) -> None:
        with self.lock:
            t = self._transfers.get(transfer_id)
            if t is None:
                return
            t.inflight -= 1
            if failed:
                self.finish(t)  # D fails the request; nobody will pull this transfer again
                return
            t.served.add((p_rank, d_rank))
            if self._pairs(d_tp) <= t.served:
                self.finish(t)

    def expire(self, now: float) -> None:
        with self.lock:
            for t in [t for t in self._transfers.values() if t.expires <= now and not t.inflight]:
                self.finish(t, expired=True)
