from collections import Counter, deque
from collections.abc import Callable

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvferry.engine.block_pool import BlockPool, InvariantError, NoFreeBlocksError

NUM_BLOCKS = 8


class BlockPoolMachine(RuleBasedStateMachine):
    """Random allocate / free / incref sequences against a plain model of the pool (FIFO free list)."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(NUM_BLOCKS)
        self.model_free: deque[int] = deque(range(NUM_BLOCKS))
        self.model_refs = [0] * NUM_BLOCKS

    def owned(self) -> list[int]:
        return [b for b, refs in enumerate(self.model_refs) if refs > 0]

    def snapshot(self) -> tuple[int, list[int]]:
        return self.pool.num_free, [self.pool.refcount(b) for b in range(NUM_BLOCKS)]

    @rule(n=st.integers(0, NUM_BLOCKS + 2))
    def allocate(self, n: int) -> None:
        assert self.pool.can_allocate(n) == (n <= len(self.model_free))
        if n > len(self.model_free):
            before = self.snapshot()
            with pytest.raises(NoFreeBlocksError):
                self.pool.allocate(n)
            assert self.snapshot() == before
            return
        expected = [self.model_free.popleft() for _ in range(n)]
        assert self.pool.allocate(n) == expected
        for b in expected:
            self.model_refs[b] = 1

    @precondition(lambda self: any(self.model_refs))
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        ids = data.draw(st.lists(st.sampled_from(self.owned()), min_size=1, max_size=6))
        counts = Counter(ids)
        if any(times > self.model_refs[b] for b, times in counts.items()):
            before = self.snapshot()
            with pytest.raises(ValueError, match="double free"):
                self.pool.free(ids)
            assert self.snapshot() == before
            return
        self.pool.free(ids)
        for b in ids:
            self.model_refs[b] -= 1
            if self.model_refs[b] == 0:
                self.model_free.append(b)

    @precondition(lambda self: any(self.model_refs))
    @rule(data=st.data())
    def incref(self, data: st.DataObject) -> None:
        ids = data.draw(st.lists(st.sampled_from(self.owned()), min_size=1, max_size=4))
        self.pool.incref(ids)
        for b in ids:
            self.model_refs[b] += 1

    @rule(block=st.integers(-2, NUM_BLOCKS + 2), use_incref=st.booleans())
    def bad_block_is_rejected(self, block: int, use_incref: bool) -> None:
        if 0 <= block < NUM_BLOCKS and self.model_refs[block] > 0:
            return  # a valid target, covered by the other rules
        before = self.snapshot()
        with pytest.raises(ValueError):
            (self.pool.incref if use_incref else self.pool.free)([block])
        assert self.snapshot() == before

    @precondition(lambda self: any(self.model_refs))
    @rule(data=st.data())
    def mixed_valid_and_bad_ids_change_nothing(self, data: st.DataObject) -> None:
        good = data.draw(st.sampled_from(self.owned()))
        before = self.snapshot()
        with pytest.raises(ValueError):
            self.pool.free([good, NUM_BLOCKS])
        assert self.snapshot() == before

    @invariant()
    def matches_model(self) -> None:
        self.pool.check_invariants()
        assert self.pool.num_free == len(self.model_free)
        assert self.pool.num_used == NUM_BLOCKS - len(self.model_free)
        assert self.pool.num_total == NUM_BLOCKS
        assert [self.pool.refcount(b) for b in range(NUM_BLOCKS)] == self.model_refs


TestBlockPoolStateful = BlockPoolMachine.TestCase
TestBlockPoolStateful.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_free_list_is_fifo() -> None:
    pool = BlockPool(4)
    a = pool.allocate(3)
    pool.free([a[1]])
    pool.free([a[0]])
    assert pool.allocate(3) == [3, a[1], a[0]]


def test_shared_block_returns_to_free_list_after_last_reference() -> None:
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    pool.incref([b])
    pool.free([b])
    assert pool.num_free == 1 and pool.refcount(b) == 1
    pool.free([b])
    assert pool.num_free == 2
    with pytest.raises(ValueError, match="double free"):
        pool.free([b])


def test_allocate_too_many_allocates_nothing() -> None:
    pool = BlockPool(3)
    pool.allocate(2)
    with pytest.raises(NoFreeBlocksError, match="asked for 2 blocks but only 1 of 3 are free"):
        pool.allocate(2)
    assert pool.num_free == 1
    with pytest.raises(ValueError):
        pool.allocate(-1)


def test_constructor_rejects_empty_pool() -> None:
    with pytest.raises(ValueError):
        BlockPool(0)


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (lambda pool: pool._free.append(pool._free[0]), "duplicates"),
        (lambda pool: pool._free.append(0), "free but has reference count 1"),
        (lambda pool: pool._free.popleft(), "not free but has reference count 0"),
        (lambda pool: pool._refcounts.__setitem__(0, -1), "negative"),
        (lambda pool: pool._free.append(99), "out-of-range"),
    ],
)
def test_check_invariants_detects_corruption(corrupt: Callable[[BlockPool], object], message: str) -> None:
    pool = BlockPool(4)
    pool.allocate(2)
    pool.check_invariants()
    corrupt(pool)
    with pytest.raises(InvariantError, match=message):
        pool.check_invariants()
