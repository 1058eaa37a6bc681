"""`write_ops` merges a run into any earlier op it continues on both sides (layer-major layouts)."""

from __future__ import annotations

from typing import Any

import numpy as np

from kvferry.connector.layout import KVLayout, write_ops
from kvferry.transfer.base import ByteRange

LAYERS, BLOCK = 3, 96  # bytes of one block in one layer


class LayerMajor(KVLayout):
    """One region per layer, blocks back to back in each: a block is one run per layer."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks, self.num_kv_heads, self.block_size = num_blocks, 1, 1
        self.mem = {f"L{i}": np.zeros(num_blocks * BLOCK, np.uint8) for i in range(LAYERS)}

    def regions(self) -> dict[str, Any]:
        return self.mem

    def block_runs(self, block_id: int, heads: tuple[int, int]) -> list[ByteRange]:
        return [ByteRange(f"L{i}", block_id * BLOCK, BLOCK) for i in range(LAYERS)]

    @property
    def block_bytes(self) -> int:
        return LAYERS * BLOCK


def _apply(p: LayerMajor, d: LayerMajor, src: list[int], dst: list[int]) -> int:
    ops = write_ops(p, src, dst, (0, 1))
    for op in ops:
        d.mem[op.dst_region][op.dst_offset : op.dst_offset + op.length] = p.mem[op.src_region][
            op.src_offset : op.src_offset + op.length
        ]
    for s, t in zip(src, dst, strict=True):
        for name in p.mem:
            assert np.array_equal(
                d.mem[name][t * BLOCK : (t + 1) * BLOCK], p.mem[name][s * BLOCK : (s + 1) * BLOCK]
            )
    return len(ops)


def test_consecutive_blocks_cost_one_op_per_layer() -> None:
    p, d = LayerMajor(16), LayerMajor(16)
    for i, m in enumerate(p.mem.values()):
        m[:] = np.random.default_rng(i).integers(1, 256, m.size, np.uint8)
    assert _apply(p, d, [2, 3, 4, 5], [7, 8, 9, 10]) == LAYERS
    assert _apply(p, d, [0, 1, 9, 10], [4, 5, 0, 1]) == 2 * LAYERS  # two runs of two blocks
    assert _apply(p, d, [3, 1], [1, 2]) == 2 * LAYERS  # no adjacency: one op per block and layer
    written = sum(int(np.count_nonzero(m)) for m in d.mem.values())
    assert written == LAYERS * BLOCK * len({7, 8, 9, 10, 4, 5, 0, 1, 2})  # nothing outside the blocks
