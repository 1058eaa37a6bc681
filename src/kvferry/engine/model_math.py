"""Numeric pieces shared by the prompt-tile path (tiles.py) and the generated-row path (rows.py).

`RowWeight.apply` is how every generated row meets a weight matrix: one vector-matrix product per row
and per fixed panel of the matrix, so a row's bits never depend on the other rows of the step."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float32]

# Bytes per panel of a `[out, in]` weight, so a panel stays in L2 while every row of the step uses it.
# A property of the weight's shape only, never of the batch.
PANEL_BYTES = 256 * 1024


@dataclass(frozen=True)
class TileRows:
    """A tile's live rows [lo, hi): the call's prompt positions in that block."""

    lo: int
    hi: int


class RowWeight:
    """A `[out, in]` (C-contiguous) weight, cut into fixed panels of `rows` output rows (and a rest)."""

    def __init__(self, weight: FloatArray) -> None:
        if weight.ndim != 2 or weight.dtype != np.float32:
            raise ValueError(f"a weight must be a float32 matrix, got {weight.dtype} {weight.shape}")
        self.weight = w = np.ascontiguousarray(weight)
        out_dim, in_dim = w.shape
        rows = max(1, PANEL_BYTES // (4 * in_dim))
        self.rows = rows = min(out_dim, rows - rows % 16 if rows >= 16 else rows)
        self.split = split = out_dim - out_dim % rows
        self._panels = w[:split].reshape(split // rows, rows, in_dim)[:, None]  # [P, 1, rows, in]
        self._rest = w[split:]

    def apply(self, x: FloatArray) -> FloatArray:
        """`x @ weight.T` for `x` `[m, in]`: one vector-matrix product per row and panel, panels outermost,
        so a row's bits never depend on the other rows and a panel is read from memory once."""
        m = x.shape[0]
        out = np.empty((m, self.weight.shape[0]), dtype=np.float32)
        column = x[None, :, :, None]  # [1, m, in, 1]
        by_panel = self._panels @ column  # [P, m, rows, 1]
        out[:, : self.split] = by_panel[..., 0].transpose(1, 0, 2).reshape(m, self.split)
        if len(self._rest):
            out[:, self.split :] = (self._rest[None] @ x[:, :, None])[..., 0]
        return out

    def apply_tiles(self, x: FloatArray) -> FloatArray:
        """`x @ weight.T` for prompt tiles `x` `[T, block_size, in]`: one fixed-shape product per tile and
        panel, panels outermost, so a tile's bits never depend on the other tiles."""
        tiles, block_size, _ = x.shape
        out = np.empty((tiles, block_size, self.weight.shape[0]), dtype=np.float32)
        columns = x.transpose(0, 2, 1)  # [T, in, block_size]
        by_panel = self._panels @ columns[None]  # [P, T, rows, block_size]
        out[:, :, : self.split] = by_panel.transpose(1, 3, 0, 2).reshape(tiles, block_size, self.split)
        if len(self._rest):
            out[:, :, self.split :] = (self._rest[None] @ columns).transpose(0, 2, 1)
        return out


def rms_norm(x: FloatArray, weight: FloatArray, eps: float) -> FloatArray:
    """RMSNorm of each row of `x` (a C-contiguous `[rows, hidden]`): a row's bits depend on that row only."""
    mean_square = np.mean(x * x, axis=-1, keepdims=True)
    normed: FloatArray = (x / np.sqrt(mean_square + np.float32(eps))) * weight
    return normed


def rope(x: FloatArray, cos: FloatArray, sin: FloatArray) -> FloatArray:
    """Rotate-half RoPE on `[rows, heads, head_dim]` with `cos`/`sin` of shape `[rows, 1, head_dim / 2]`."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    out = np.empty_like(x)
    out[..., :half] = x1 * cos - x2 * sin
    out[..., half:] = x2 * cos + x1 * sin
    return out


def swiglu(gate_up: FloatArray, ffn_size: int) -> FloatArray:
    gate, up = gate_up[:, :ffn_size], gate_up[:, ffn_size:]
    return np.ascontiguousarray((gate / (np.float32(1.0) + np.exp(-gate))) * up)


@functools.cache
def future_mask(block_size: int) -> npt.NDArray[np.bool_]:
    """[row, key] within one block: True where the key's position is after the row's."""
    return np.triu(np.ones((block_size, block_size), dtype=np.bool_), k=1)
