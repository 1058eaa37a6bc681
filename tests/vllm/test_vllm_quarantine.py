"""The scheduler half's quarantine (integrations/vllm/quarantine.py) step by step, through the calls
vLLM's scheduler makes (`update_connector_output`, then it frees the loads that ended) on its real
BlockPool: which step takes the extra reference on a quarantined load's blocks, and which gives it back,
for the orders in which tensor parallel ranks report (test_vllm_nixl_frozen_p.py runs the whole thing
with a real P stopped inside D's NIXL read; these orders come out of it only by chance)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

try:  # `tests/` is on sys.path, so a bare `import vllm` would find this directory as a namespace package
    import vllm.v1.core.sched.scheduler  # noqa: F401
except ImportError:
    HAVE_VLLM = False
else:
    HAVE_VLLM = True

pytestmark = pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed (see .ci/vllm-env.sh)")

if HAVE_VLLM:
    from vllm.v1.core.block_pool import BlockPool

    from kvferry.integrations.vllm.metadata import KVFerryWorkerMetadata
    from kvferry.integrations.vllm.scheduler import KVFerryScheduler

NUM_BLOCKS = 16


class Pool:
    """vLLM's BlockPool, and a request holding blocks of it as vLLM's KV cache manager would."""

    def __init__(self) -> None:
        self.block_pool = BlockPool(NUM_BLOCKS, enable_caching=True, hash_block_size=16)
        self.requests: dict[str, list[Any]] = {}

    def allocate(self, request_id: str, n: int) -> list[int]:
        self.requests[request_id] = self.block_pool.get_new_blocks(n)
        return [b.block_id for b in self.requests[request_id]]

    def get_blocks(self, request_id: str) -> Any:
        return SimpleNamespace(blocks=(self.requests.get(request_id, []),))

    def free(self, request_id: str) -> None:
        """What vLLM does after `update_connector_output` for a load that ended: the request lets go."""
        self.block_pool.free_blocks(self.requests.pop(request_id))

    def free_ids(self) -> set[int]:
        return {b.block_id for b in self.block_pool.free_block_queue.get_all_free_blocks()}


def meta(quarantined: dict[str, int] | None = None, released: dict[str, int] | None = None) -> Any:
    return KVFerryWorkerMetadata({}, quarantined or {}, released or {})


class Steps:
    """The scheduler half as vLLM's scheduler drives it: one `update_connector_output` per step."""

    def __init__(self, pool: Pool) -> None:
        self.scheduler = KVFerryScheduler({})
        self.scheduler.quarantine.bind(pool)  # as vLLM's bind_kv_cache_manager does

    def update(self, worker_meta: Any, finished_recving: set[str]) -> None:
        self.scheduler.update_connector_output(SimpleNamespace(
            finished_sending=None, finished_recving=finished_recving or None, kv_connector_worker_meta=worker_meta))

    @property
    def held(self) -> dict[str, list[Any]]:
        return self.scheduler.quarantine.held

    @property
    def num_blocks(self) -> int:
        return self.scheduler.quarantine.num_blocks


@pytest.fixture
def rig() -> tuple[Pool, Steps]:
    pool = Pool()
    return pool, Steps(pool)


def test_the_last_rank_to_finish_with_nothing_to_say_still_quarantines(rig: tuple[Pool, Steps]) -> None:
    """D TP 2: rank 0 quarantines its failed load first; rank 1 ends its own later with no metadata at
    all (its read had ended, or vLLM's abort of the failed request ended it). vLLM learns the load ended
    only then, in a step without worker metadata: the blocks must be held in that step."""
    pool, quarantine = rig
    blocks = pool.allocate("r", 4)
    quarantine.update(meta({"r": 1}), set())  # rank 0: quarantined; vLLM does not know yet
    assert not quarantine.held
    quarantine.update(None, {"r"})  # rank 1 finished: vLLM's finished_recving has it now
    pool.free("r")
    assert quarantine.num_blocks == 4 and not set(blocks) & pool.free_ids()
    quarantine.update(meta(released={"r": 1}), set())  # rank 0's read ended
    assert not quarantine.held and set(blocks) <= pool.free_ids()
    assert pool.block_pool.get_num_free_blocks() == NUM_BLOCKS - 1


def test_blocks_come_back_when_every_rank_that_quarantined_released(rig: tuple[Pool, Steps]) -> None:
    pool, quarantine = rig
    blocks = pool.allocate("r", 3)
    quarantine.update(meta({"r": 1}), set())
    quarantine.update(meta({"r": 1}), {"r"})
    pool.free("r")
    quarantine.update(meta(released={"r": 1}), set())
    assert quarantine.num_blocks == 3 and not set(blocks) & pool.free_ids()  # one rank's read still posted
    quarantine.update(meta(released={"r": 1}), set())
    assert not quarantine.held and set(blocks) <= pool.free_ids()


def test_a_read_that_ended_before_vllm_heard_of_the_load_holds_nothing(rig: tuple[Pool, Steps]) -> None:
    """Quarantined and released in one drain, or rank 0 released before rank 1 finished: nothing to keep."""
    pool, quarantine = rig
    pool.allocate("a", 2)
    pool.allocate("b", 2)
    quarantine.update(meta({"a": 1}, {"a": 1}), {"a"})
    quarantine.update(meta({"b": 1}), set())
    quarantine.update(meta(released={"b": 1}), set())
    quarantine.update(None, {"b"})
    pool.free("a")
    pool.free("b")
    assert not quarantine.held and pool.block_pool.get_num_free_blocks() == NUM_BLOCKS - 1


def test_the_ranks_counts_add_up() -> None:
    """vLLM's KVOutputAggregator folds the ranks' worker metadata with `aggregate`."""
    merged = meta({"r": 1}, {"s": 1}).aggregate(meta({"r": 1, "t": 1}))
    assert isinstance(merged, KVFerryWorkerMetadata)
    assert merged.quarantined == {"r": 2, "t": 1} and merged.released == {"s": 1}
