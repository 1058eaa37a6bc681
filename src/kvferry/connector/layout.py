"""KV memory layouts, and the tensor-parallel head mapping: which P ranks a D rank pulls from and the
byte runs of each pull."""

from __future__ import annotations

import abc
import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import numpy as np
import xxhash

from kvferry.connector.base import KVCacheSpec
from kvferry.transfer.base import ByteRange, WriteOp

KV_REGION = "kv"


class KVLayout(abc.ABC):
    """Where a block's KV bytes live: named memory regions, and per block the byte runs of some heads.

    The runs of a block for given heads must come in the same order on P and D, so that run i on P is
    written into run i on D and both sides checksum the same bytes.
    """

    num_blocks: int
    num_kv_heads: int
    block_size: int

    @abc.abstractmethod
    def regions(self) -> dict[str, Any]:
        """name → writable C-contiguous buffer, registered with the transfer engine."""

    @abc.abstractmethod
    def block_runs(self, block_id: int, heads: tuple[int, int]) -> list[ByteRange]: ...

    @property
    @abc.abstractmethod
    def block_bytes(self) -> int: ...

    def peer_block_runs(self, block_id: int, heads: tuple[int, int], peer_num_blocks: int) -> list[ByteRange]:
        """Runs of a block in a peer with the same layout but its own number of blocks."""
        if not 0 <= block_id < peer_num_blocks:
            raise ValueError(f"block id {block_id} out of range [0, {peer_num_blocks})")
        if peer_num_blocks != self.num_blocks:
            raise ValueError("this layout cannot describe a peer with a different number of blocks")
        return self.block_runs(block_id, heads)

    def checksum(self, block_id: int, heads: tuple[int, int]) -> int:
        h = xxhash.xxh64()
        for r in self.block_runs(block_id, heads):
            h.update(self._byte_views[r.region][r.offset : r.end])
        return h.intdigest()

    @functools.cached_property
    def _byte_views(self) -> dict[str, memoryview]:
        return {name: memoryview(np.asarray(buf).reshape(-1).view(np.uint8)) for name, buf in self.regions().items()}  # type: ignore[arg-type]


class PagedKVLayout(KVLayout):
    """kvferry's own engine: ONE array in the `KVCacheSpec` layout."""

    def __init__(self, spec: KVCacheSpec, kv_cache: np.ndarray) -> None:
        if kv_cache.shape != spec.shape or not kv_cache.flags.c_contiguous:
            raise ValueError(f"KV cache must be C-contiguous with shape {spec.shape}, got {kv_cache.shape}")
        self.spec, self.kv_cache = spec, kv_cache
        self.num_blocks, self.num_kv_heads, self.block_size = spec.num_blocks, spec.num_kv_heads, spec.block_size

    def regions(self) -> dict[str, Any]:
        return {KV_REGION: self.kv_cache}

    def block_runs(self, block_id: int, heads: tuple[int, int]) -> list[ByteRange]:
        return [ByteRange(KV_REGION, off, n) for off, n in self.spec.head_runs(block_id, *heads)]

    @property
    def block_bytes(self) -> int:
        return self.spec.block_bytes

    def peer_block_runs(self, block_id: int, heads: tuple[int, int], peer_num_blocks: int) -> list[ByteRange]:
        peer = dataclasses.replace(self.spec, num_blocks=peer_num_blocks)
        return [ByteRange(KV_REGION, off, n) for off, n in peer.head_runs(block_id, *heads)]


def head_range(num_heads: int, tp_size: int, rank: int) -> tuple[int, int]:
    if tp_size < 1 or num_heads % tp_size:
        raise ValueError(f"{num_heads} KV heads cannot be split over tp={tp_size}")
    if not 0 <= rank < tp_size:
        raise ValueError(f"rank {rank} out of range for tp={tp_size}")
    per = num_heads // tp_size
    return rank * per, (rank + 1) * per


def overlap(num_heads: int, p_tp: int, p_rank: int, d_tp: int, d_rank: int) -> tuple[int, int] | None:
    p0, p1 = head_range(num_heads, p_tp, p_rank)
    d0, d1 = head_range(num_heads, d_tp, d_rank)
    lo, hi = max(p0, d0), min(p1, d1)
    return (lo, hi) if lo < hi else None


def p_ranks_for(num_heads: int, p_tp: int, d_tp: int, d_rank: int) -> list[int]:
    """The P ranks whose heads overlap D rank `d_rank`'s heads."""
    return [r for r in range(p_tp) if overlap(num_heads, p_tp, r, d_tp, d_rank) is not None]


def d_ranks_for(num_heads: int, p_tp: int, p_rank: int, d_tp: int) -> list[int]:
    """The D ranks that pull from P rank `p_rank`."""
    return [d for d in range(d_tp) if overlap(num_heads, p_tp, p_rank, d_tp, d) is not None]


def write_ops(
    layout: KVLayout,
    src_blocks: Sequence[int],
    dst_blocks: Sequence[int],
    heads: tuple[int, int],
    dst_num_blocks: int | None = None,
) -> list[WriteOp]:
    """Ops copying `heads` of each src block into the matching dst block (in a peer with
    `dst_num_blocks` blocks; default: same as ours), adjacent runs merged."""
    n_dst = layout.num_blocks if dst_num_blocks is None else dst_num_blocks
    ops: list[WriteOp] = []
    for src, dst in zip(src_blocks, dst_blocks, strict=True):
        src_runs, dst_runs = layout.block_runs(src, heads), layout.peer_block_runs(dst, heads, n_dst)
        for s, d in zip(src_runs, dst_runs, strict=True):
            last = ops[-1] if ops else None
            if (
                last
                and last.src_region == s.region
                and last.dst_region == d.region
                and last.src_offset + last.length == s.offset
                and last.dst_offset + last.length == d.offset
            ):
                ops[-1] = WriteOp(s.region, last.src_offset, d.region, last.dst_offset, last.length + s.length)
            else:
                ops.append(WriteOp(s.region, s.offset, d.region, d.offset, s.length))
    return ops
