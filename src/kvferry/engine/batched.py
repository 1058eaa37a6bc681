"""One forward for every sequence of an engine step, with each sequence's bits independent of the batch.

Every weight matrix is read once per step, not once per sequence: the generated rows (decoding tokens,
or recomputed generated positions) of ALL sequences in the call are gathered into row tiles of exactly
`ROW_TILE` rows (the last one zero-padded), and each tile is one `[ROW_TILE, in] @ [in, out]` product;
the LM head does the same with each sequence's last row. A row's result then depends only on that row:
the product's shape is always the same, and OpenBLAS computes each output row of a fixed-shape sgemm
with the same kernel and the same reduction order whatever the other rows hold or where in the tile the
row sits (checked by tests/engine/test_batched.py on this build, on the tiny model and on SmolLM2).
Prompt tiles keep their own `[block_size, in] @ [in, out]` product, attention and norms stay per
sequence on fixed `[block_size, ...]` tiles (see model.py), so a sequence gets the same bits alone, in
any batch, at any place in it, decoded token by token or recomputed in one call.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from kvferry.engine.model_math import FloatArray, TileRows, rms_norm

if TYPE_CHECKING:
    from kvferry.engine.model import TinyLlama

# Rows per linear-layer tile for generated positions. Fixed for every process (a different height is a
# different sgemm, hence maybe other bits); 8 rows cost about 3x one vector-matrix product on SmolLM2
# (OpenBLAS packs the weight panel per call) and carry 8 decoding sequences.
ROW_TILE = 8


@dataclass(frozen=True)
class SeqChunk:
    """Positions [start_pos, start_pos + len(token_ids)) of one sequence (see `TinyLlama.forward`)."""

    token_ids: Sequence[int]
    start_pos: int
    block_table: Sequence[int]
    prompt_len: int | None = None
    want_logits: bool = True


@dataclass
class _Seq:
    chunk: SeqChunk
    end_pos: int
    first_block: int
    table: npt.NDArray[np.int64]
    tiles: FloatArray  # [num_tiles, block_size, hidden]
    live: list[TileRows] = field(default_factory=list)


def forward_batch(
    model: TinyLlama, kv_cache: FloatArray, block_size: int, chunks: Sequence[SeqChunk]
) -> list[FloatArray | None]:
    """Run every chunk (distinct sequences); return each one's last-position logits (None if not wanted)."""
    cfg = model.config
    seqs: list[_Seq] = []
    for chunk in chunks:
        tokens = np.asarray(chunk.token_ids, dtype=np.int64)
        start, end = chunk.start_pos, chunk.start_pos + len(tokens)
        first_block, last_block = start // block_size, (end - 1) // block_size if len(tokens) else 0
        table = np.asarray(chunk.block_table[: last_block + 1], dtype=np.int64)
        model.validate(kv_cache, block_size, tokens, start, end, table)
        tiles = np.zeros((last_block - first_block + 1, block_size, cfg.hidden_size), dtype=np.float32)
        rows = np.arange(start, end) - first_block * block_size
        tiles.reshape(-1, cfg.hidden_size)[rows] = model.embed[tokens]
        generated_from = end if chunk.prompt_len is None else max(chunk.prompt_len, 0)
        live = [_tile_rows(first_block + i, start, end, generated_from, block_size) for i in range(len(tiles))]
        seqs.append(_Seq(chunk, end, first_block, table, tiles, live))

    for layer_index, w in enumerate(model.layers):
        normed = [np.stack([rms_norm(t, w.attn_norm, cfg.rms_eps) for t in s.tiles]) for s in seqs]
        qkv = _linear(seqs, normed, w.qkv)
        attended = [model.attend_sequence(kv_cache, block_size, layer_index, s.table, s.chunk.start_pos,
                                          s.end_pos, s.first_block, s.live, q) for s, q in zip(seqs, qkv, strict=True)]
        for s, out in zip(seqs, _linear(seqs, attended, w.o_proj), strict=True):
            s.tiles += out
        normed = [np.stack([rms_norm(t, w.mlp_norm, cfg.rms_eps) for t in s.tiles]) for s in seqs]
        gate_up = _linear(seqs, normed, w.gate_up)
        hidden = []
        for gu in gate_up:  # elementwise ops stay on the fixed [block_size, ...] tiles
            hidden.append(np.stack([_swiglu(t, cfg.ffn_size) for t in gu]))
        for s, out in zip(seqs, _linear(seqs, hidden, w.down), strict=True):
            s.tiles += out

    wanted = [i for i, s in enumerate(seqs) if s.chunk.want_logits]
    last_rows = [rms_norm(seqs[i].tiles[-1], model.final_norm, cfg.rms_eps)[(seqs[i].end_pos - 1) % block_size]
                 for i in wanted]
    logits: list[FloatArray | None] = [None] * len(seqs)
    for i, row in zip(wanted, _row_tiles(last_rows, model.lm_head), strict=True):
        logits[i] = row
    return logits


def _swiglu(gate_up: FloatArray, ffn_size: int) -> FloatArray:
    gate, up = gate_up[:, :ffn_size], gate_up[:, ffn_size:]
    return np.ascontiguousarray((gate / (np.float32(1.0) + np.exp(-gate))) * up)


def _tile_rows(block: int, start_pos: int, end_pos: int, generated_from: int, block_size: int) -> TileRows:
    base = block * block_size
    lo, hi = max(start_pos, base) - base, min(end_pos, base + block_size) - base
    split = min(max(generated_from - base, lo), hi)
    return TileRows(lo=lo, split=split, hi=hi)


def _linear(seqs: list[_Seq], inputs: list[FloatArray], weight: FloatArray) -> list[FloatArray]:
    """`x @ weight` for every live row: a prompt row's whole tile is one product (as it always was), and
    the generated rows of all sequences go through fixed-height row tiles (`_row_tiles`)."""
    outs: list[FloatArray] = []
    gathered: list[FloatArray] = []
    where: list[tuple[int, int, int, int]] = []  # (sequence, tile, lo, hi) of each gathered run of rows
    for si, (s, x) in enumerate(zip(seqs, inputs, strict=True)):
        out = np.zeros((x.shape[0], x.shape[1], weight.shape[1]), dtype=np.float32)
        for ti, rows in enumerate(s.live):
            if rows.lo < rows.split:
                out[ti] = x[ti] @ weight
            if rows.split < rows.hi:
                gathered.extend(x[ti, rows.split : rows.hi])
                where.append((si, ti, rows.split, rows.hi))
        outs.append(out)
    if gathered:
        results = _row_tiles(gathered, weight)
        at = 0
        for si, ti, lo, hi in where:
            outs[si][ti, lo:hi] = results[at : at + hi - lo]
            at += hi - lo
    return outs


def _row_tiles(rows: Sequence[FloatArray], weight: FloatArray) -> list[FloatArray]:
    """`row @ weight` for each row, computed `ROW_TILE` rows at a time in always-full (zero-padded) tiles."""
    out: list[FloatArray] = []
    tile = np.zeros((ROW_TILE, weight.shape[0]), dtype=np.float32)
    for begin in range(0, len(rows), ROW_TILE):
        part = rows[begin : begin + ROW_TILE]
        tile[:] = 0.0
        tile[: len(part)] = part
        product: FloatArray = tile @ weight
        out.extend(product[: len(part)])
    return out
