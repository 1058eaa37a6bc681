"""Tensor-parallel head mapping: which P ranks a D rank pulls from, and the byte runs of each pull."""

from __future__ import annotations

from collections.abc import Sequence

from kvferry.connector.base import KVCacheSpec
from kvferry.transfer.base import ByteRange, WriteOp

KV_REGION = "kv"


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


def block_runs(spec: KVCacheSpec, block_id: int, heads: tuple[int, int]) -> list[ByteRange]:
    return [ByteRange(KV_REGION, off, n) for off, n in spec.head_runs(block_id, *heads)]


def write_ops(
    spec: KVCacheSpec, src_blocks: Sequence[int], dst_blocks: Sequence[int], heads: tuple[int, int]
) -> list[WriteOp]:
    """Ops copying `heads` of each src block into the matching dst block, adjacent runs merged."""
    ops: list[WriteOp] = []
    for src, dst in zip(src_blocks, dst_blocks, strict=True):
        for (s_off, n), (d_off, _) in zip(spec.head_runs(src, *heads), spec.head_runs(dst, *heads), strict=True):
            last = ops[-1] if ops else None
            if last and last.src_offset + last.length == s_off and last.dst_offset + last.length == d_off:
                ops[-1] = WriteOp(KV_REGION, last.src_offset, KV_REGION, last.dst_offset, last.length + n)
            else:
                ops.append(WriteOp(KV_REGION, s_off, KV_REGION, d_off, n))
    return ops
