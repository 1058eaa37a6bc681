"""A fixed pool of KV-cache blocks: a FIFO free list and per-block reference counts.

Block ids index the first axis of the KV cache array (see `KVCacheSpec`). A block is owned while its
reference count is positive and free (on the free list) when it is zero; every failing call raises
before changing anything."""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable


class NoFreeBlocksError(RuntimeError):
    """Asked for more blocks than are free."""


class InvariantError(AssertionError):
    """The pool's bookkeeping is inconsistent (a bug, never a user error)."""


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self._num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._refcounts = [0] * num_blocks

    @property
    def num_total(self) -> int:
        return self._num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self._num_blocks - len(self._free)

    def can_allocate(self, n: int) -> bool:
        return 0 <= n <= len(self._free)

    def refcount(self, block_id: int) -> int:
        self._check_in_range(block_id)
        return self._refcounts[block_id]

    def allocate(self, n: int) -> list[int]:
        """Take `n` blocks off the free list (oldest freed first), each with reference count 1."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({n})")
        if n > len(self._free):
            raise NoFreeBlocksError(
                f"asked for {n} blocks but only {len(self._free)} of {self._num_blocks} are free")
        block_ids = [self._free.popleft() for _ in range(n)]
        for block_id in block_ids:
            self._refcounts[block_id] = 1
        return block_ids

    def incref(self, block_ids: Iterable[int]) -> None:
        ids = list(block_ids)
        for block_id in ids:
            self._check_in_range(block_id)
            if self._refcounts[block_id] == 0:
                raise ValueError(f"cannot incref block {block_id}: it is free")
        for block_id in ids:
            self._refcounts[block_id] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference per listed id; blocks reaching zero go to the back of the free list."""
        ids = list(block_ids)
        for block_id, times in Counter(ids).items():
            self._check_in_range(block_id)
            if self._refcounts[block_id] < times:
                raise ValueError(
                    f"cannot free block {block_id} {times} time(s): its reference count is "
                    f"{self._refcounts[block_id]} (double free?)"
                )
        for block_id in ids:
            self._refcounts[block_id] -= 1
            if self._refcounts[block_id] == 0:
                self._free.append(block_id)

    def check_invariants(self) -> None:
        free_set = set(self._free)
        if len(free_set) != len(self._free):
            duplicates = sorted(b for b, c in Counter(self._free).items() if c > 1)
            raise InvariantError(f"free list holds duplicates: {duplicates}")
        for block_id in free_set:
            if not 0 <= block_id < self._num_blocks:
                raise InvariantError(f"free list holds out-of-range block {block_id}")
        for block_id, count in enumerate(self._refcounts):
            if count < 0:
                raise InvariantError(f"block {block_id} has negative reference count {count}")
            if (count == 0) != (block_id in free_set):
                state = "free" if block_id in free_set else "not free"
                raise InvariantError(f"block {block_id} is {state} but has reference count {count}")
        num_owned = sum(1 for count in self._refcounts if count > 0)
        if num_owned + len(self._free) != self._num_blocks:
            raise InvariantError(
                f"free ({len(self._free)}) + used ({num_owned}) != total ({self._num_blocks})")

    def _check_in_range(self, block_id: int) -> None:
        if not 0 <= block_id < self._num_blocks:
            raise ValueError(f"block id {block_id} out of range [0, {self._num_blocks})")
