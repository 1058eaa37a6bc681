"""Blocks a posted read may still write, kept out of vLLM's block pool while the failed request is
reported on time (D's side, `transfer: "nixl"`).

A NIXL read cannot be cancelled: one posted before P froze may land in D's blocks until P resumes or
dies. So a failed pull is reported at once but *quarantined*: the worker half reports it in
`failed_recving` (never as block ids, so vLLM never computes into those blocks), and the scheduler half
holds one extra `BlockPool` reference on its blocks until every rank's reads ended. A reference is free
where a staging buffer would cost a copy on every healthy transfer. vLLM must bind its KV cache manager
(`bind_kv_cache_manager`); a D whose vLLM never does is refused at its first step."""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

from kvferry.connector.facade import PDConnector
from kvferry.integrations.vllm.metadata import KVFerryWorkerMetadata

log = logging.getLogger("kvferry.integrations.vllm.quarantine")


class WorkerQuarantine:
    """The worker half's side: sorts D's reports into what vLLM is told (`failed_recving`) and what the
    scheduler half is told (quarantined, released)."""

    def __init__(self, decode: PDConnector | None) -> None:
        self.decode = decode
        if decode is not None:
            decode.quarantine_loads()  # the scheduler half keeps the blocks: report failures at once
        self._failed: set[str] = set()  # quarantined in the last drain: per-request failures for vLLM
        self._quarantined: Counter[str] = Counter()  # for the scheduler half, since the last metadata
        self._released: Counter[str] = Counter()

    def drained(self, released: set[str], quarantined: set[str]) -> None:
        """After D's connector's `get_finished`: the ids whose reads ended, and the quarantined ids."""
        self._failed = quarantined
        self._quarantined.update(self._failed)
        self._released.update(released)

    def failed(self, recving: set[str]) -> set[str]:
        """Of this drain's finished loads, those vLLM must take as failed per request."""
        failed, self._failed = self._failed & recving, set()
        return failed

    def take(self) -> tuple[dict[str, int], dict[str, int]]:
        q, r = dict(self._quarantined), dict(self._released)
        self._quarantined.clear()
        self._released.clear()
        return q, r


class BlockQuarantine:
    """The scheduler half's side: one extra `BlockPool` reference on each block of a quarantined request
    until every rank's reads of it ended."""

    def __init__(self) -> None:
        self.manager: Any = None  # vLLM's KVCacheManager (bind)
        self._open: Counter[str] = Counter()  # request id → ranks that quarantined and have not released
        self.held: dict[str, list[Any]] = {}  # request id → the KVCacheBlocks referenced here

    def bind(self, kv_cache_manager: Any) -> None:
        self.manager = kv_cache_manager

    def check_bound(self) -> None:
        if self.manager is None:
            raise RuntimeError(
                "KVFerryConnector (kv_consumer): vLLM did not bind its KV cache manager to the connector "
                "(bind_kv_cache_manager, vLLM 0.32 and 0.33 do): kvferry cannot keep blocks a posted read may "
                "still write out of the block pool; use vLLM 0.32 or 0.33")

    @property
    def num_blocks(self) -> int:
        return sum(len(blocks) for blocks in self.held.values())

    def update(self, meta: Any, finished_recving: set[str]) -> None:
        """One step's reports, before vLLM frees the blocks of the requests that finished receiving."""
        quarantined, released = {}, {}
        if isinstance(meta, KVFerryWorkerMetadata):
            quarantined, released = meta.quarantined, meta.released
        self._open.update(quarantined)
        self._open.subtract(released)
        for request_id in finished_recving:
            if self._open[request_id] > 0 and request_id not in self.held:
                self._hold(request_id)
        for request_id in set(released) | set(quarantined):
            if self._open[request_id] <= 0:
                del self._open[request_id]
                blocks = self.held.pop(request_id, None)
                if blocks is not None:
                    self.manager.block_pool.free_blocks(blocks)
                    log.info("request %s: %d quarantined block(s) back in the pool (its reads ended)",
                             request_id, len(blocks))

    def _hold(self, request_id: str) -> None:
        self.check_bound()
        groups = self.manager.get_blocks(request_id).blocks
        blocks = [b for group in groups for b in group if not b.is_null]
        self.manager.block_pool.touch(blocks)
        self.held[request_id] = blocks
        log.warning("request %s: %d block(s) quarantined: a posted read may still write them", request_id,
                    len(blocks))
