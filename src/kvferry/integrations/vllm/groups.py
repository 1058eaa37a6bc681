"""vLLM's KV cache groups (its hybrid memory allocator, HMA) as kvferry sees them.

A hybrid model has one block table per group drawing from one pool, so a block id names memory of one
group's layers only. kvferry's transfer core moves a flat list of block ids over one `KVLayout`, so each
(group g, block b) is one *virtual* block id `g * num_blocks + b`; with one group they are vLLM's ids.
Every prompt block of a full-attention group moves, and of a sliding-window group only those inside the
window: P and D derive the same list without asking each other (`KVGroups.transfer_ids`). Mamba/SSM
state, special specs, mixed block sizes and non-transferable groups are refused at start by name."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

NULL_BLOCK = 0  # vLLM's BlockPool takes block 0 as its null block first: skipped blocks point at it


@dataclass(frozen=True)
class KVGroup:
    layer_names: tuple[str, ...]
    sliding_window: int | None  # tokens; None: full attention
    extra_retained_tokens: int = 0  # a sliding window's extension below the window (vLLM keeps them)

    def first_block(self, num_tokens: int, block_size: int) -> int:
        """The first block of a `num_tokens` prompt that moves: vLLM's `get_num_skipped_tokens`."""
        if self.sliding_window is None:
            return 0
        skipped = max(0, num_tokens - self.sliding_window + 1 - self.extra_retained_tokens)
        return skipped // block_size


@dataclass(frozen=True)
class KVGroups:
    groups: tuple[KVGroup, ...]
    block_size: int

    @classmethod
    def from_config(cls, kv_cache_config: Any, block_size: int) -> KVGroups:
        """vLLM's `KVCacheConfig` groups, or ValueError naming what kvferry cannot move."""
        from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec

        groups: list[KVGroup] = []
        odd: list[str] = []
        for g, group in enumerate(kv_cache_config.kv_cache_groups):
            spec, names = group.kv_cache_spec, tuple(group.layer_names)
            what = f"KV cache group {g} ({type(spec).__name__}, layers {', '.join(names[:3])}{', ...' if len(names) > 3 else ''})"
            if not getattr(group, "enable_kv_transfer", True):
                raise ValueError(f"KVFerryConnector: {what} is marked not transferable: not supported")
            if type(spec) is SlidingWindowSpec:
                groups.append(KVGroup(names, int(spec.sliding_window), int(spec.extra_retained_tokens)))
            elif type(spec) in (FullAttentionSpec, MLAAttentionSpec):
                # A sliding window on a full-attention spec: vLLM allocates every block (HMA off), so all move.
                groups.append(KVGroup(names, None))
            else:
                kind = "mamba/SSM state" if "Mamba" in type(spec).__name__ else "this kind of KV cache"
                raise ValueError(f"KVFerryConnector: {what}: moving {kind} is not supported (full attention, "
                                 "MLA and sliding-window groups are); serve this model without P/D disaggregation")
            if int(spec.block_size) != block_size:
                odd.append(f"{what} has block size {spec.block_size}, the scheduler {block_size}")
        if not groups:
            raise ValueError("KVFerryConnector: the model has no KV cache groups: nothing to transfer")
        out = cls(tuple(groups), block_size)
        if out.hybrid and odd:  # one full-attention group: its blocks are the scheduler's, as before
            raise ValueError(f"KVFerryConnector: {odd[0]}: groups of another block size are not supported")
        return out

    @property
    def hybrid(self) -> bool:
        """Whether block ids need a group to be read (more than one group, or a sliding window)."""
        return len(self.groups) > 1 or self.groups[0].sliding_window is not None

    def blocks_for(self, num_tokens: int) -> int:
        """How many (virtual) blocks a prompt of `num_tokens` moves."""
        n = -(-num_tokens // self.block_size)
        return sum(n - min(n, g.first_block(num_tokens, self.block_size)) for g in self.groups)

    def pull_positions(self, num_tokens: int, first_block: int) -> list[int]:
        """Which entries of the `blocks_for` list a pull names when D's prefix cache holds the prompt's
        first `first_block` blocks."""
        n = -(-num_tokens // self.block_size)
        out: list[int] = []
        offset = 0  # where this group's blocks start in the list
        for group in self.groups:
            first = min(n, group.first_block(num_tokens, self.block_size))
            out += range(offset + max(first, first_block) - first, offset + n - first)
            offset += n - first
        return out

    def transfer_ids(self, block_ids: Sequence[Sequence[int]], num_tokens: int, num_blocks: int,
                     side: str, first_block: int = 0) -> list[int]:
        """The virtual ids of the blocks a `num_tokens` prompt moves from block `first_block` on, from
        vLLM's per-group block ids; ValueError where one is missing or vLLM's null block."""
        if len(block_ids) != len(self.groups):
            raise ValueError(f"{side}: {len(block_ids)} block lists for {len(self.groups)} KV cache groups")
        n = -(-num_tokens // self.block_size)
        out: list[int] = []
        for g, (group, ids) in enumerate(zip(self.groups, block_ids, strict=True)):
            first = min(n, max(first_block, group.first_block(num_tokens, self.block_size)))
            wanted = list(ids[first:n])
            if len(wanted) != n - first or NULL_BLOCK in wanted:
                raise ValueError(f"{side}: KV cache group {g} has blocks {list(ids[:n])} for a {num_tokens}-token "
                                 f"prompt; blocks {first}..{n - 1} must be real blocks")
            out += [g * num_blocks + b for b in wanted]
        return out
