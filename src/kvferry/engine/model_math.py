"""Numeric pieces shared by the forward (model.py) and the batched step (batched.py)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float32]


@dataclass(frozen=True)
class TileRows:
    """A tile's live rows [lo, hi): prompt positions in [lo, split), generated ones in [split, hi)."""

    lo: int
    split: int
    hi: int


def rms_norm(x: FloatArray, weight: FloatArray, eps: float) -> FloatArray:
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


@functools.cache
def future_mask(block_size: int) -> npt.NDArray[np.bool_]:
    """[row, key] within one block: True where the key's position is after the row's."""
    return np.triu(np.ones((block_size, block_size), dtype=np.bool_), k=1)
