"""Blocks a posted read may still write, kept out of vLLM's block pool while the failed request is
reported on time (D's side, `transfer: "nixl"`).

A NIXL read cannot be cancelled: one posted before P froze ends only when P resumes or dies, and until
then its bytes may land in D's blocks. kvferry's consumer reports such a failed pull at its liveness
verdict all the same, *quarantined* (`PDConnector.quarantine_loads`), and releases it once every read of
it ended. Here that becomes vLLM's:

- the worker half reports a quarantined load in `failed_recving` (a per-request failure), never as
  block ids: vLLM then ends it (`fail`) or resets it to 0 computed tokens and frees its blocks before it
  allocates anew (`recompute`), so it never computes into the blocks a read may write;
- each worker rank tells the scheduler half which requests it quarantined and released
  (`KVFerryWorkerMetadata`; vLLM sums the ranks' counts);
- when vLLM learns the request finished receiving, the scheduler half takes one more reference on each of
  the request's blocks in vLLM's `BlockPool` (`touch`) before vLLM frees them, so freeing the request
  leaves them out of the free queue, and drops it (`free_blocks`) once every rank that quarantined has
  released. Blocks of a local prefix-cache hit before the pulled ones are held too: they stay usable as
  hits (a hit adds its own reference), only not evictable meanwhile.

A staging buffer that NIXL reads into would cost a copy on every healthy transfer to spare a rare failure
a few blocks; the reference is free. vLLM must bind its KV cache manager to the connector
(`bind_kv_cache_manager`, vLLM 0.32 and 0.33 do): a D whose vLLM never does is refused at its first step."""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

from kvferry.connector.facade import PDConnector
from kvferry.integrations.vllm.metadata import KVFerryWorkerMetadata

log = logging.getLogger("kvferry.integrations.vllm.quarantine")


class WorkerQuarantine:
    """The worker half's side: asks D's connector to quarantine, and sorts its report into what vLLM is
    told (`failed_recving`) and what the scheduler half is told (quarantined, released)."""

    def __init__(self, decode: PDConnector | None) -> None:
        self.decode = decode
        if decode is not None:
            decode.quarantine_loads()  # the scheduler half keeps the blocks: report failures at once
        self._failed: set[str] = set()  # quarantined in the last drain: per-request failures for vLLM
        self._quarantined: Counter[str] = Counter()  # for the scheduler half, since the last metadata
        self._released: Counter[str] = Counter()

    def drained(self, released: set[str], quarantined: set[str]) -> None:
        """After D's connector's `get_finished`: the ids whose reads ended (D's connector returns those in
        the sending slot; they are no sends of vLLM's), and its load reports' quarantined ids."""
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
    """The scheduler half's side: one extra reference on each block of a quarantined request in vLLM's
    `BlockPool`, from when vLLM learns the load ended until every rank's reads of it ended."""

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
        """One step's reports (`meta`: the ranks' worker metadata, if any), before vLLM frees the blocks of
        the requests that finished receiving."""
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
