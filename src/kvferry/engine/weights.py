"""The model's shape (`ModelConfig`) and weights: as checkpoints store them, and cut into panels for the forward.

Weights are stored `[out, in]` (C-contiguous), as checkpoints store them; `RowLayer` wraps one layer's
linear weights as `RowWeight`s (fixed panels) once, at load, for both the prompt tiles and the generated rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from kvferry.engine.model_math import FloatArray, RowWeight
from kvferry.engine.tokenizer import VOCAB_SIZE


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = VOCAB_SIZE
    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 8
    num_kv_heads: int = 4
    head_dim: int = 32
    ffn_size: int = 512
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    max_position: int = 16384
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        if self.head_dim % 2:
            raise ValueError("head_dim must be even (RoPE rotates pairs)")


@dataclass(frozen=True)
class LayerWeights:  # [out, in] layout (`y = W @ x`), C-contiguous
    attn_norm: FloatArray  # [hidden]
    qkv: FloatArray  # [(heads + 2 * kv_heads) * head_dim, hidden]
    o_proj: FloatArray  # [hidden, heads * head_dim]
    mlp_norm: FloatArray  # [hidden]
    gate_up: FloatArray  # [2 * ffn, hidden]
    down: FloatArray  # [hidden, ffn]


@dataclass(frozen=True)
class LlamaWeights:
    embed: FloatArray  # [vocab, hidden]
    layers: list[LayerWeights]
    final_norm: FloatArray  # [hidden]
    lm_head: FloatArray  # [vocab, hidden] (`embed` itself when tied)


@dataclass(frozen=True)
class RowLayer:
    """One layer's linear weights, ready for `RowWeight.apply`."""

    qkv: RowWeight
    o_proj: RowWeight
    gate_up: RowWeight
    down: RowWeight

    @classmethod
    def of(cls, w: LayerWeights) -> RowLayer:
        return cls(RowWeight(w.qkv), RowWeight(w.o_proj), RowWeight(w.gate_up), RowWeight(w.down))


def random_weights(cfg: ModelConfig) -> LlamaWeights:
    """The tiny model's weights: random, from `cfg.seed` (its answers are bytes, not language)."""
    rng = np.random.default_rng(cfg.seed)

    def linear(fan_in: int, fan_out: int) -> FloatArray:
        w = rng.standard_normal((fan_in, fan_out), dtype=np.float32)
        return np.ascontiguousarray((w * np.float32(1.0 / math.sqrt(fan_in))).T)

    embed = rng.standard_normal((cfg.vocab_size, cfg.hidden_size), dtype=np.float32)
    q_width = cfg.num_heads * cfg.head_dim
    kv_width = cfg.num_kv_heads * cfg.head_dim
    layers = [
        LayerWeights(attn_norm=np.ones(cfg.hidden_size, np.float32),
                     qkv=linear(cfg.hidden_size, q_width + 2 * kv_width),
                     o_proj=linear(q_width, cfg.hidden_size), mlp_norm=np.ones(cfg.hidden_size, np.float32),
                     gate_up=linear(cfg.hidden_size, 2 * cfg.ffn_size),
                     down=linear(cfg.ffn_size, cfg.hidden_size))
        for _ in range(cfg.num_layers)
    ]
    return LlamaWeights(embed, layers, np.ones(cfg.hidden_size, np.float32), linear(cfg.hidden_size, cfg.vocab_size))
