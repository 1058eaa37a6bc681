"""KV memory layouts, and the tensor-parallel head mapping: which P ranks a D rank pulls from and the
byte runs of each pull."""

from __future__ import annotations

import abc
import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np

from kvferry.connector.digest import block_digest
from kvferry.transfer.base import ByteRange, WriteOp

KV_REGION = "kv"


@dataclasses.dataclass(frozen=True)
class KVCacheSpec:
    """Layout of the paged KV cache: ONE float32 array of shape
    `[num_blocks, num_layers, 2 (K, V), num_kv_heads, block_size, head_dim]`, C-contiguous.

    A block is one contiguous run of `block_bytes`; within it, the heads of one (layer, K|V) pair are
    contiguous, so a tensor-parallel rank that owns heads [h0, h1) of a block is `num_layers * 2` runs."""

    num_blocks: int
    num_layers: int
    num_kv_heads: int
    block_size: int
    head_dim: int
    itemsize: int = 4

    @property
    def shape(self) -> tuple[int, int, int, int, int, int]:
        return (self.num_blocks, self.num_layers, 2, self.num_kv_heads, self.block_size, self.head_dim)

    @property
    def head_bytes(self) -> int:
        return self.block_size * self.head_dim * self.itemsize

    @property
    def block_bytes(self) -> int:
        return self.num_layers * 2 * self.num_kv_heads * self.head_bytes

    def head_runs(self, block_id: int, h0: int, h1: int) -> list[tuple[int, int]]:
        """(offset, length) byte runs of heads [h0, h1) in `block_id`, in order."""
        if not 0 <= block_id < self.num_blocks:
            raise ValueError(f"block id {block_id} out of range [0, {self.num_blocks})")
        if h0 == 0 and h1 == self.num_kv_heads:
            return [(block_id * self.block_bytes, self.block_bytes)]
        runs = []
        per_kv = self.num_kv_heads * self.head_bytes
        base = block_id * self.block_bytes
        for i in range(self.num_layers * 2):
            runs.append((base + i * per_kv + h0 * self.head_bytes, (h1 - h0) * self.head_bytes))
        return runs


class StridedSegment(msgspec.Struct, array_like=True, frozen=True):
    """One layer's KV inside a region: kernel block k starts at `base + k * block_stride`; `dims` are the
    dims after the block dim as (size, byte stride), dim 0 being the KV heads."""

    region: str
    base: int
    block_stride: int
    dims: list[tuple[int, int]]
    itemsize: int


class LayoutDescription(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A rank's own KV memory, as D sends it in its pull: P places D's blocks from it, whatever D's pool
    size (strides of layouts with heads or K/V outside the block dim depend on it)."""

    num_blocks: int
    kernel_blocks: int  # kernel blocks per scheduler block
    segments: list[StridedSegment]
    # The model-wide index of the first KV head held here: a tensor-parallel rank holds heads
    # [first_head, first_head + dims[0]) of every layer (vLLM's workers hold only their own slice).
    first_head: int = 0
    num_kv_heads: int = 0  # the model's KV heads in all (0: those held here)
    replicated: bool = False  # every rank holds all of it (MLA's one latent): see `overlap`
    # vLLM's KV cache groups (integrations/vllm/groups.py): block id g * (num_blocks // groups) + b is
    # block b of the segments whose `segment_groups` entry is g (empty: every segment, one group).
    groups: int = 1
    segment_groups: list[int] = []


def strided_block_runs(desc: LayoutDescription, block_id: int, heads: tuple[int, int]) -> list[ByteRange]:
    """Byte runs of `heads` of one block, segment by segment, adjacent runs merged."""
    if not 0 <= block_id < desc.num_blocks:
        raise ValueError(f"block id {block_id} out of range [0, {desc.num_blocks})")
    h0, h1 = heads[0] - desc.first_head, heads[1] - desc.first_head  # model-wide → held here
    group, block_id = divmod(block_id, desc.num_blocks // desc.groups)
    out: list[ByteRange] = []
    for i, seg in enumerate(desc.segments):
        if desc.segment_groups and desc.segment_groups[i] != group:
            continue  # another group's layer: its memory at this block id belongs to that group
        (held, head_stride), *rest = seg.dims
        if not 0 <= h0 < h1 <= held:
            raise ValueError(f"heads {heads} are not among the KV heads held here "
                             f"[{desc.first_head}, {desc.first_head + held})")
        dims = [(h1 - h0, head_stride), *rest]
        for kb in range(block_id * desc.kernel_blocks, (block_id + 1) * desc.kernel_blocks):
            for offset, length in _runs(seg.base + kb * seg.block_stride + h0 * head_stride, dims, seg.itemsize):
                last = out[-1] if out else None
                if last is not None and last.region == seg.region and last.end == offset:
                    out[-1] = ByteRange(seg.region, last.offset, last.length + length)
                else:
                    out.append(ByteRange(seg.region, offset, length))
    return out


def _runs(base: int, dims: list[tuple[int, int]], itemsize: int) -> list[tuple[int, int]]:
    """(offset, length) byte runs of a strided sub-array, ascending; contiguous inner dims become one run."""
    outer = sorted((d for d in dims if d[0] != 1), key=lambda d: d[1], reverse=True)
    run = itemsize
    while outer and outer[-1][1] == run:
        run *= outer.pop()[0]
    offsets = [base]
    for size, stride in outer:
        offsets = [o + i * stride for o in offsets for i in range(size)]
    return [(o, run) for o in offsets]


class KVLayout(abc.ABC):
    """Where a block's KV bytes live: named memory regions, and per block the byte runs of some heads.

    The runs of a block for given heads must come in the same order on P and D, so that run i on P is
    written into run i on D and both sides checksum the same bytes."""

    num_blocks: int
    num_kv_heads: int
    block_size: int
    replicated: bool = False  # every TP rank holds all KV heads (MLA): see `overlap`

    @abc.abstractmethod
    def regions(self) -> dict[str, Any]:
        """name → writable C-contiguous buffer, registered with the transfer engine."""

    @abc.abstractmethod
    def block_runs(self, block_id: int, heads: tuple[int, int]) -> list[ByteRange]: ...

    @property
    @abc.abstractmethod
    def block_bytes(self) -> int: ...

    def describe(self) -> LayoutDescription | None:
        """This rank's memory for a peer (sent in pulls); None: peers derive it from the block count."""
        return None

    def stage_out(self, block_ids: Sequence[int]) -> None:
        """P, before it reads blocks for a write: bring them into the registered memory (a no-op when
        that memory is the KV cache itself; a device-to-host copy when the KV cache is on a device)."""
        return

    def stage_in(self, block_ids: Sequence[int]) -> None:
        """D, once blocks were received and verified: move them from the registered memory into the KV
        cache (a no-op when that memory is the KV cache itself)."""
        return

    def blocks_for(self, num_tokens: int) -> int:
        """How many block ids a pull of a `num_tokens` prompt lists (one per block of tokens; vLLM's
        hybrid KV cache lists each group's blocks that move, integrations/vllm/groups.py)."""
        return -(-num_tokens // self.block_size)

    def pull_positions(self, num_tokens: int, first_block: int) -> list[int]:
        """Which entries of a `num_tokens` prompt's block list (the `blocks_for` blocks, in order) a pull
        names when the puller already holds the prompt's first `first_block` blocks: those from there on."""
        return list(range(first_block, self.blocks_for(num_tokens)))

    def peer_mismatch(self, peer: LayoutDescription) -> str | None:
        """Why a peer's memory cannot take our blocks position for position (None: it can)."""
        ours = self.describe()
        if ours is None:
            return "this layout cannot place blocks in a described peer"
        if peer.kernel_blocks != ours.kernel_blocks or len(peer.segments) != len(ours.segments):
            return (f"peer has {len(peer.segments)} layer(s) x {peer.kernel_blocks} kernel block(s) per block, "
                    f"we have {len(ours.segments)} x {ours.kernel_blocks}")
        # The head dim may differ (P's and D's tensor parallel sizes split the heads differently); the
        # model's head count may not.
        peer_heads = peer.num_kv_heads or (peer.segments[0].dims[0][0] if peer.segments else 0)
        for a, b in zip(ours.segments, peer.segments, strict=True):
            if ([n for n, _ in a.dims[1:]] != [n for n, _ in b.dims[1:]] or a.itemsize != b.itemsize
                    or peer_heads != self.num_kv_heads):
                return (f"peer layer shape {[n for n, _ in b.dims]} x {b.itemsize} B of {peer_heads} KV heads "
                        f"differs from ours ({self.num_kv_heads} KV heads)")
        if peer.replicated != self.replicated:
            return f"peer's KV is {'' if peer.replicated else 'not '}replicated on every rank (MLA), ours is{'' if self.replicated else ' not'}"
        if peer.num_blocks < 1:
            return f"peer has {peer.num_blocks} blocks"
        if (peer.groups, peer.segment_groups) != (ours.groups, ours.segment_groups) or peer.num_blocks % peer.groups:
            return f"peer has {peer.groups} KV cache group(s) {peer.segment_groups}, we have {ours.groups} {ours.segment_groups}"
        # Bytes are copied in order, so both sides must order a block's dims alike; the runs may be cut
        # differently (a slice of the heads is one run where a side holds only those heads).
        same = ours.segments[0].dims[0][0] == peer.segments[0].dims[0][0]  # both hold as many heads
        mine = [r.length for r in self.block_runs(0, (ours.first_head, ours.first_head + 1))] if same else []
        theirs = [r.length for r in strided_block_runs(peer, 0, (peer.first_head, peer.first_head + 1))] if same else []
        if mine != theirs or any(_dim_orders_differ(a, b) for a, b in zip(ours.segments, peer.segments, strict=True)):
            return "peer's KV layout orders a block's bytes differently (use the same VLLM_KV_CACHE_LAYOUT)"
        return None

    def peer_block_runs(self, block_id: int, heads: tuple[int, int], peer_num_blocks: int,
                        peer: LayoutDescription | None = None) -> list[ByteRange]:
        """Runs of a block in a peer with the same layout but its own number of blocks (and its own memory,
        when it described it)."""
        if not 0 <= block_id < peer_num_blocks:
            raise ValueError(f"block id {block_id} out of range [0, {peer_num_blocks})")
        if peer is not None:
            if peer.num_blocks != peer_num_blocks:
                raise ValueError(f"peer describes {peer.num_blocks} blocks but claims {peer_num_blocks}")
            return strided_block_runs(peer, block_id, heads)
        if peer_num_blocks != self.num_blocks:
            raise ValueError("this layout cannot describe a peer with a different number of blocks")
        return self.block_runs(block_id, heads)

    def checksum(self, block_id: int, heads: tuple[int, int], key: bytes | None = None, index: int = 0) -> int:
        """The block's digest (`digest.block_digest`): keyed with `key` (a pull's, at position `index`)."""
        views = self._byte_views
        return block_digest((views[r.region][r.offset : r.end] for r in self.block_runs(block_id, heads)), key, index)

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

    def peer_block_runs(self, block_id: int, heads: tuple[int, int], peer_num_blocks: int,
                        peer: LayoutDescription | None = None) -> list[ByteRange]:
        if peer is not None:
            return super().peer_block_runs(block_id, heads, peer_num_blocks, peer)
        spec = dataclasses.replace(self.spec, num_blocks=peer_num_blocks)
        return [ByteRange(KV_REGION, off, n) for off, n in spec.head_runs(block_id, *heads)]


def _dim_orders_differ(a: StridedSegment, b: StridedSegment) -> bool:
    """Whether two sides order the dims after the block dim differently in memory. A dim of size 1 on
    either side is left out: its stride says nothing (a rank holding one KV head)."""
    dims = [i for i in range(len(a.dims)) if a.dims[i][0] > 1 and b.dims[i][0] > 1]
    return sorted(dims, key=lambda i: -a.dims[i][1]) != sorted(dims, key=lambda i: -b.dims[i][1])


def _aligned(src: list[ByteRange], dst: list[ByteRange]) -> list[tuple[ByteRange, ByteRange]]:
    """The same bytes cut into runs on each side (P and D hold different head slices): pieces of equal
    length, in order."""
    if sum(r.length for r in src) != sum(r.length for r in dst):
        raise ValueError("peer's KV layout orders a block's bytes differently")
    out: list[tuple[ByteRange, ByteRange]] = []
    i = j = si = dj = 0  # run index and bytes used of it, per side
    while i < len(src):
        s, d = src[i], dst[j]
        n = min(s.length - si, d.length - dj)
        out.append((ByteRange(s.region, s.offset + si, n), ByteRange(d.region, d.offset + dj, n)))
        si, dj = si + n, dj + n
        if si == s.length:
            i, si = i + 1, 0
        if dj == d.length:
            j, dj = j + 1, 0
    return out


def head_range(num_heads: int, tp_size: int, rank: int) -> tuple[int, int]:
    if tp_size < 1 or num_heads % tp_size:
        raise ValueError(f"{num_heads} KV heads cannot be split over tp={tp_size}")
    if not 0 <= rank < tp_size:
        raise ValueError(f"rank {rank} out of range for tp={tp_size}")
    per = num_heads // tp_size
    return rank * per, (rank + 1) * per


def overlap(num_heads: int, p_tp: int, p_rank: int, d_tp: int, d_rank: int,
            replicated: bool = False) -> tuple[int, int] | None:
    """The heads P rank `p_rank` sends D rank `d_rank` (None: none). `replicated` (MLA: one latent KV,
    the same on every rank): P rank 0 alone sends, all of it, to every D rank; no other P rank is asked."""
    if replicated:
        if not (0 <= p_rank < p_tp and 0 <= d_rank < d_tp):
            raise ValueError(f"rank out of range: P {p_rank} of {p_tp}, D {d_rank} of {d_tp}")
        return (0, num_heads) if p_rank == 0 else None
    p0, p1 = head_range(num_heads, p_tp, p_rank)
    d0, d1 = head_range(num_heads, d_tp, d_rank)
    lo, hi = max(p0, d0), min(p1, d1)
    return (lo, hi) if lo < hi else None


def p_ranks_for(num_heads: int, p_tp: int, d_tp: int, d_rank: int, replicated: bool = False) -> list[int]:
    """The P ranks D rank `d_rank` pulls from."""
    return [r for r in range(p_tp) if overlap(num_heads, p_tp, r, d_tp, d_rank, replicated) is not None]


def d_ranks_for(num_heads: int, p_tp: int, p_rank: int, d_tp: int, replicated: bool = False) -> list[int]:
    """The D ranks that pull from P rank `p_rank`."""
    return [d for d in range(d_tp) if overlap(num_heads, p_tp, p_rank, d_tp, d, replicated) is not None]


def write_ops(layout: KVLayout, src_blocks: Sequence[int], dst_blocks: Sequence[int], heads: tuple[int, int],
              dst_num_blocks: int | None = None,
              dst_layout: LayoutDescription | None = None) -> list[WriteOp]:
    """Ops copying `heads` of each src block into the matching dst block (in a peer with
    `dst_num_blocks` blocks, default: same as ours; laid out as `dst_layout` when the peer described
    its memory), adjacent runs merged.

    A run merges into any earlier op it continues on both sides, not only the previous one: with a
    layer-major layout (a region or stride per layer) block b+1's run of a layer continues block b's run
    of that layer, several runs back, and consecutive blocks then cost one op per layer, not per block."""
    n_dst = layout.num_blocks if dst_num_blocks is None else dst_num_blocks
    ops: list[WriteOp] = []
    ends: dict[tuple[str, int, str, int], int] = {}  # where an op ends (src, dst) → its index
    for src, dst in zip(src_blocks, dst_blocks, strict=True):
        src_runs, dst_runs = layout.block_runs(src, heads), layout.peer_block_runs(dst, heads, n_dst, dst_layout)
        for s, d in _aligned(src_runs, dst_runs):
            k = ends.pop((s.region, s.offset, d.region, d.offset), None)
            if k is None:
                k = len(ops)
                ops.append(WriteOp(s.region, s.offset, d.region, d.offset, s.length))
            else:
                last = ops[k]
                ops[k] = WriteOp(s.region, last.src_offset, d.region, last.dst_offset, last.length + s.length)
            ends[(s.region, s.offset + s.length, d.region, d.offset + d.length)] = k
    return ops
