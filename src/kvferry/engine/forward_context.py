"""What one forward call (an engine step) hands each layer: the cache, RoPE tables, this thread's scratch K/V.
Passed explicitly, not kept in a global: the scratch K/V is per thread, and one model serves several threads."""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvferry.engine.model_math import FloatArray
from kvferry.engine.weights import ModelConfig


@dataclass(frozen=True)
class Rope:
    """RoPE `cos`, `sin` of every position, `[max_position, head_dim / 2]`."""

    cos: FloatArray
    sin: FloatArray

    @classmethod
    def of(cls, cfg: ModelConfig) -> Rope:
        inv_freq = cfg.rope_theta ** (-np.arange(0, cfg.head_dim, 2, dtype=np.float64) / cfg.head_dim)
        angles = np.outer(np.arange(cfg.max_position, dtype=np.float64), inv_freq)
        return cls(np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32))


class ScratchKV:
    """Per-thread `[2, kv_heads, capacity, head_dim]` K/V, one per block size; its capacity is fixed so a
    position's K/V operands always have the same shape and strides."""

    def __init__(self, cfg: ModelConfig) -> None:
        self._cfg = cfg
        self._local = threading.local()

    def get(self, block_size: int) -> FloatArray:
        buffers: dict[int, FloatArray] = self._local.__dict__.setdefault("buffers", {})
        if block_size not in buffers:
            cfg = self._cfg
            capacity = -(-cfg.max_position // block_size) * block_size
            buffers[block_size] = np.zeros((2, cfg.num_kv_heads, capacity, cfg.head_dim), dtype=np.float32)
        return buffers[block_size]


@dataclass(frozen=True)
class ForwardContext:
    config: ModelConfig
    kv_cache: FloatArray  # [num_blocks, num_layers, 2, kv_heads, block_size, head_dim]
    block_size: int
    kv: FloatArray  # this thread's scratch K/V (`ScratchKV`)
    rope: Rope

    @property
    def q_scale(self) -> np.float32:
        return np.float32(1.0 / math.sqrt(self.config.head_dim))

    def rope_at(self, positions: npt.NDArray[np.int64]) -> tuple[FloatArray, FloatArray]:
        """RoPE `cos`, `sin` of each position, `[rows, 1, head_dim / 2]`."""
        return self.rope.cos[positions, None, :], self.rope.sin[positions, None, :]

    def load_cached_kv(self, layer_index: int, table: npt.NDArray[np.int64]) -> FloatArray:
        """Copy the cache blocks `table` of a layer into the first blocks of the scratch K/V; return it."""
        cached_blocks = self.kv_cache[table, layer_index]  # [n, 2, kv_heads, block_size, head_dim]
        num_blocks, _, kv_heads, block_size, head_dim = cached_blocks.shape
        by_block = self.kv.reshape(2, kv_heads, -1, block_size, head_dim)
        np.copyto(by_block[:, :, :num_blocks], cached_blocks.transpose(1, 2, 0, 3, 4))
        return self.kv
