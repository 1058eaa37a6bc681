"""Prompt positions of the sequences of a forward call, on fixed `[block_size, hidden]` tiles.

Position p sits at row `p % block_size` of its block's tile, unused rows zero. Every operation has a
fixed shape (`RowWeight.apply_tiles`: one product per tile and fixed weight panel), and attention of
block b reads exactly `(b + 1) * block_size` keys/values with those past the call's last prompt position
zeroed and masked, so a prompt position's bits never depend on other rows, tiles or stale cache."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvferry.engine.forward_context import ForwardContext
from kvferry.engine.model_math import FloatArray, TileRows, future_mask, rms_norm, rope, swiglu
from kvferry.engine.weights import LayerWeights, RowLayer


@dataclass
class PromptTiles:
    """Prompt positions [start, end) of one sequence: the tiles of the blocks that hold them."""

    start: int
    end: int
    table: npt.NDArray[np.int64]
    tiles: FloatArray  # [num_tiles, block_size, hidden]
    live: list[TileRows]

    @classmethod
    def of(cls, embed: FloatArray, tokens: npt.NDArray[np.int64], start: int, table: npt.NDArray[np.int64],
           block_size: int) -> PromptTiles:
        """`embed` `[vocab, hidden]`: the model's token embeddings."""
        end, hidden = start + len(tokens), embed.shape[1]
        if not len(tokens):
            return cls(start, end, table, np.zeros((0, block_size, hidden), np.float32), [])
        first_block, last_block = start // block_size, (end - 1) // block_size
        tiles = np.zeros((last_block - first_block + 1, block_size, hidden), dtype=np.float32)
        tiles.reshape(-1, hidden)[np.arange(start, end) - first_block * block_size] = embed[tokens]
        live = []
        for block in range(first_block, last_block + 1):
            base = block * block_size
            lo, hi = max(start, base) - base, min(end, base + block_size) - base
            live.append(TileRows(lo=lo, hi=hi))
        return cls(start, end, table, tiles, live)

    @staticmethod
    def stack(prompts: list[PromptTiles]) -> FloatArray:
        """The tiles of all `prompts` in one `[T, block_size, hidden]` array; each one's `tiles` becomes a view of it."""
        if not prompts:
            return np.zeros((0, 0, 0), np.float32)
        stacked = np.concatenate([p.tiles for p in prompts])
        first = 0
        for p in prompts:
            p.tiles = stacked[first : first + len(p.tiles)]
            first += len(p.tiles)
        return stacked

    def last_row(self, block_size: int) -> FloatArray:
        row: FloatArray = self.tiles[-1][(self.end - 1) % block_size]
        return row


def prompt_layer(ctx: ForwardContext, layer_index: int, weights: LayerWeights, lin: RowLayer, seqs: list[PromptTiles],
                 tiles: FloatArray) -> None:
    """One layer on the prompt tiles of every sequence of the call (in place); writes their K/V into the cache.
    `tiles` `[T, block_size, hidden]` holds all of them; attention runs tile by tile in order."""
    cfg, block_size = ctx.config, ctx.block_size
    rows = tiles.reshape(-1, cfg.hidden_size)  # row-wise ops see rows of one 2-D array, as the generated rows do
    qkv = lin.qkv.apply_tiles(rms_norm(rows, weights.attn_norm, cfg.rms_eps).reshape(tiles.shape))
    attended = np.empty((len(tiles), block_size, cfg.num_heads * cfg.head_dim), dtype=np.float32)
    first_tile = 0
    for seq in seqs:
        _sequence_attention(ctx, layer_index, seq, qkv[first_tile:], attended[first_tile:])
        first_tile += len(seq.live)
    tiles += lin.o_proj.apply_tiles(attended)
    gate_up = lin.gate_up.apply_tiles(rms_norm(rows, weights.mlp_norm, cfg.rms_eps).reshape(tiles.shape))
    tiles += lin.down.apply_tiles(swiglu(gate_up.reshape(len(rows), -1), cfg.ffn_size).reshape(*tiles.shape[:2], -1))


def _sequence_attention(ctx: ForwardContext, layer_index: int, seq: PromptTiles, qkv: FloatArray,
                        attended: FloatArray) -> None:
    """Attention of one sequence's tiles (their `qkv` in order), into `attended`; fills their K/V in the cache."""
    kv_cache, block_size = ctx.kv_cache, ctx.block_size
    first_block = seq.start // block_size
    # Whole blocks are loaded; their slots from start on are overwritten or zeroed below.
    kv = ctx.load_cached_kv(layer_index, seq.table[: -(-seq.start // block_size)])
    kv[:, :, seq.end : (first_block + len(seq.live)) * block_size] = 0.0
    for tile_index, live in enumerate(seq.live):
        block = first_block + tile_index
        attended[tile_index] = _attention(ctx, qkv[tile_index], kv, block, live)
        new_positions = slice(block * block_size + live.lo, block * block_size + live.hi)
        kv_cache[seq.table[block], layer_index, :, :, live.lo : live.hi] = kv[:, :, new_positions]


def _attention(ctx: ForwardContext, qkv: FloatArray, kv: FloatArray, block: int, rows: TileRows) -> FloatArray:
    """Attention output (before o_proj) of the tile of `block` from its `qkv`; also fills its live rows in `kv`."""
    cfg, block_size = ctx.config, ctx.block_size
    heads, kv_heads, head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    group = heads // kv_heads
    q = qkv[:, : heads * head_dim].reshape(block_size, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].reshape(block_size, kv_heads, head_dim)
    v = qkv[:, (heads + kv_heads) * head_dim :].reshape(block_size, kv_heads, head_dim)
    cos, sin = ctx.rope_at(np.arange(block * block_size, (block + 1) * block_size))
    q = rope(q, cos, sin) * ctx.q_scale
    lo, hi = rows.lo, rows.hi
    new = slice(block * block_size + lo, block * block_size + hi)
    kv[0, :, new] = rope(k, cos, sin)[lo:hi].transpose(1, 0, 2)
    kv[1, :, new] = v[lo:hi].transpose(1, 0, 2)

    num_keys = (block + 1) * block_size
    keys_t = kv[0, :, :num_keys].transpose(0, 2, 1)  # [kv_heads, head_dim, num_keys]
    values = kv[1, :, :num_keys]  # [kv_heads, num_keys, head_dim]
    # Row (g, r) of kv head h is query head h * group + g at position block * block_size + r.
    q_grouped = q.reshape(block_size, kv_heads, group, head_dim).transpose(1, 2, 0, 3)
    scores = q_grouped.reshape(kv_heads, group * block_size, head_dim) @ keys_t
    own_block = scores.reshape(kv_heads, group, block_size, num_keys)[..., num_keys - block_size :]
    np.copyto(own_block, -np.inf, where=future_mask(block_size))
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    denominators = scores.sum(axis=-1, keepdims=True)
    out = (scores @ values) / denominators  # [kv_heads, group * block_size, head_dim]
    out = out.reshape(kv_heads, group, block_size, head_dim).transpose(2, 0, 1, 3)
    return np.ascontiguousarray(out).reshape(block_size, heads * head_dim)
