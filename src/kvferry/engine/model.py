"""The tiny Llama (RMSNorm, RoPE, grouped-query attention, SwiGLU) over a paged KV cache, in numpy.

KV cache layout: ONE float32 array `[num_blocks, num_layers, 2 (K, V), num_kv_heads, block_size,
head_dim]` (`KVCacheSpec`); position p of a sequence lives in block `block_table[p // block_size]`,
slot `p % block_size`.

Bit-identity by construction: a forward call is cut into block-aligned chunks, and every numpy
operation that touches position p has operands whose shapes and strides depend only on p's block and
on whether p is a prompt position or a generated one (`prompt_len`):
  * norms run on a fixed `[block_size, hidden]` tile, position p at row `p % block_size`, unused rows
    zero; linear layers run on that whole tile for prompt positions (one matrix product: prefill
    speed) and row by row for generated positions (one vector-matrix product each: what decoding
    costs in any engine), so a generated token never pays for a whole tile;
  * the LM head runs on the last position's row alone (a vector-matrix product);
  * attention for block b reads exactly `(b + 1) * block_size` keys/values, gathered into a per-thread
    buffer of fixed capacity (so the operands also have the same strides whatever the call's length);
    keys after the chunk's last position are zero and masked, so stale cache contents never matter.
So the K/V written and the logits are the same bits whether a prompt is run in one call, split at any
position, continued from K/V copied in from elsewhere, decoded token by token, recomputed after a
preemption, or interleaved with other sequences (one call per sequence). This holds for one CPU type,
numpy/OpenBLAS build and BLAS thread count: OpenBLAS splits a matmul differently with a different
OPENBLAS_NUM_THREADS.
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvferry.connector.base import KVCacheSpec
from kvferry.engine.tokenizer import EOS_TOKEN_ID, VOCAB_SIZE

FloatArray = npt.NDArray[np.float32]


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
class TileRows:
    """A tile's live rows [lo, hi): prompt positions in [lo, split), generated ones in [split, hi)."""

    lo: int
    split: int
    hi: int


@dataclass(frozen=True)
class LayerWeights:  # x @ W layout: [in, out]
    attn_norm: FloatArray  # [hidden]
    qkv: FloatArray  # [hidden, (heads + 2 * kv_heads) * head_dim]
    o_proj: FloatArray  # [heads * head_dim, hidden]
    mlp_norm: FloatArray  # [hidden]
    gate_up: FloatArray  # [hidden, 2 * ffn]
    down: FloatArray  # [ffn, hidden]


@dataclass(frozen=True)
class LlamaWeights:
    embed: FloatArray  # [vocab, hidden]
    layers: list[LayerWeights]
    final_norm: FloatArray  # [hidden]
    lm_head: FloatArray  # [hidden, vocab] (a transposed view of `embed` when tied)


def random_weights(cfg: ModelConfig) -> LlamaWeights:
    """The tiny model's weights: random, from `cfg.seed` (its answers are bytes, not language)."""
    rng = np.random.default_rng(cfg.seed)

    def linear(fan_in: int, fan_out: int) -> FloatArray:
        w = rng.standard_normal((fan_in, fan_out), dtype=np.float32)
        return w * np.float32(1.0 / math.sqrt(fan_in))

    embed = rng.standard_normal((cfg.vocab_size, cfg.hidden_size), dtype=np.float32)
    q_width = cfg.num_heads * cfg.head_dim
    kv_width = cfg.num_kv_heads * cfg.head_dim
    layers = [
        LayerWeights(
            attn_norm=np.ones(cfg.hidden_size, np.float32),
            qkv=linear(cfg.hidden_size, q_width + 2 * kv_width),
            o_proj=linear(q_width, cfg.hidden_size),
            mlp_norm=np.ones(cfg.hidden_size, np.float32),
            gate_up=linear(cfg.hidden_size, 2 * cfg.ffn_size),
            down=linear(cfg.ffn_size, cfg.hidden_size),
        )
        for _ in range(cfg.num_layers)
    ]
    return LlamaWeights(embed, layers, np.ones(cfg.hidden_size, np.float32), linear(cfg.hidden_size, cfg.vocab_size))


class TinyLlama:
    """A Llama forward over a paged KV cache: the tiny random model, or real weights (`weights=`)."""

    def __init__(self, config: ModelConfig | None = None, weights: LlamaWeights | None = None) -> None:
        self.config = cfg = config or ModelConfig()
        w = weights or random_weights(cfg)
        self.embed, self.layers, self.final_norm, self.lm_head = w.embed, w.layers, w.final_norm, w.lm_head
        # `[vocab, hidden]`, row-major: for tied weights that is `embed` itself (no copy), and a
        # matrix-vector product over it reads memory in order (about twice as fast as `x @ lm_head`).
        self._lm_head_rows = np.ascontiguousarray(self.lm_head.T)

        inv_freq = cfg.rope_theta ** (-np.arange(0, cfg.head_dim, 2, dtype=np.float64) / cfg.head_dim)
        angles = np.outer(np.arange(cfg.max_position, dtype=np.float64), inv_freq)
        self._rope_cos = np.cos(angles).astype(np.float32)  # [max_position, head_dim / 2]
        self._rope_sin = np.sin(angles).astype(np.float32)
        self._q_scale = np.float32(1.0 / math.sqrt(cfg.head_dim))
        self._scratch = threading.local()

    # ---- KV cache -------------------------------------------------------------------------------
    def kv_cache_spec(self, num_blocks: int, block_size: int) -> KVCacheSpec:
        cfg = self.config
        return KVCacheSpec(num_blocks, cfg.num_layers, cfg.num_kv_heads, block_size, cfg.head_dim)

    def allocate_kv_cache(self, spec: KVCacheSpec) -> FloatArray:
        cfg = self.config
        expected = (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 4)
        if (spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.itemsize) != expected:
            raise ValueError(f"KV cache spec {spec} does not match the model config")
        return np.zeros(spec.shape, dtype=np.float32)

    # ---- forward --------------------------------------------------------------------------------
    def forward(
        self,
        kv_cache: FloatArray,
        block_size: int,
        token_ids: Sequence[int],
        start_pos: int,
        block_table: Sequence[int],
        prompt_len: int | None = None,
    ) -> FloatArray:
        """Run positions [start_pos, start_pos + len(token_ids)) of one sequence; return the last one's logits.

        Positions before start_pos must already be in the cache; the new K/V are written into it.
        Positions from `prompt_len` on are generated tokens (None: all are prompt positions); every
        caller must say the same for a sequence, since the two kinds are computed differently.
        """
        cfg = self.config
        tokens = np.asarray(token_ids, dtype=np.int64)
        end_pos = start_pos + len(tokens)
        first_block, last_block = start_pos // block_size, (end_pos - 1) // block_size
        table = np.asarray(block_table[: last_block + 1], dtype=np.int64)
        self._validate(kv_cache, block_size, tokens, start_pos, end_pos, table)

        num_tiles = last_block - first_block + 1
        tiles = np.zeros((num_tiles, block_size, cfg.hidden_size), dtype=np.float32)
        rows = np.arange(start_pos, end_pos) - first_block * block_size
        tiles.reshape(-1, cfg.hidden_size)[rows] = self.embed[tokens]

        generated_from = end_pos if prompt_len is None else max(prompt_len, 0)
        live_rows = [self._tile_rows(first_block + i, start_pos, end_pos, generated_from, block_size)
                   for i in range(num_tiles)]
        kv = self._scratch_kv(block_size)
        prefix_len = (last_block + 1) * block_size
        for layer_index, weights in enumerate(self.layers):
            # Whole blocks are loaded; their slots from start_pos on are overwritten or zeroed below.
            self._load_cached_kv(kv, kv_cache[table[: -(-start_pos // block_size)], layer_index])
            kv[:, :, end_pos:prefix_len] = 0.0
            for tile_index, live in enumerate(live_rows):
                block = first_block + tile_index
                x = tiles[tile_index]
                x += self._attention(x, weights, kv, block, live, block_size)
                new_positions = slice(block * block_size + live.lo, block * block_size + live.hi)
                kv_cache[table[block], layer_index, :, :, live.lo : live.hi] = kv[:, :, new_positions]
                x += self._mlp(x, weights, live)

        last_row = _rms_norm(tiles[-1], self.final_norm, cfg.rms_eps)[(end_pos - 1) % block_size]
        logits: FloatArray = self._lm_head_rows @ last_row
        return logits

    @staticmethod
    def _tile_rows(block: int, start_pos: int, end_pos: int, generated_from: int, block_size: int) -> TileRows:
        base = block * block_size
        lo, hi = max(start_pos, base) - base, min(end_pos, base + block_size) - base
        split = min(max(generated_from - base, lo), hi)
        return TileRows(lo=lo, split=split, hi=hi)

    @staticmethod
    def _linear(x: FloatArray, weight: FloatArray, rows: TileRows) -> FloatArray:
        """`x @ weight` for the tile's live rows: the whole tile if a prompt row is live, then each
        generated row as its own vector-matrix product (a batch of them is still one product each)."""
        if rows.lo < rows.split:
            out: FloatArray = x @ weight
        else:
            out = np.zeros((x.shape[0], weight.shape[1]), dtype=np.float32)
        if rows.split < rows.hi:
            out[rows.split : rows.hi] = (x[rows.split : rows.hi, None, :] @ weight)[:, 0]
        return out

    def _attention(
        self, x: FloatArray, w: LayerWeights, kv: FloatArray, block: int, rows: TileRows, block_size: int
    ) -> FloatArray:
        """Attention output for the tile of `block`; also fills its live rows in `kv`."""
        cfg = self.config
        heads, kv_heads, head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        group = heads // kv_heads
        qkv = self._linear(_rms_norm(x, w.attn_norm, cfg.rms_eps), w.qkv, rows)
        q = qkv[:, : heads * head_dim].reshape(block_size, heads, head_dim)
        k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].reshape(block_size, kv_heads, head_dim)
        v = qkv[:, (heads + kv_heads) * head_dim :].reshape(block_size, kv_heads, head_dim)
        positions = slice(block * block_size, (block + 1) * block_size)
        cos, sin = self._rope_cos[positions, None, :], self._rope_sin[positions, None, :]
        q = _rope(q, cos, sin) * self._q_scale
        lo, hi = rows.lo, rows.hi
        new = slice(block * block_size + lo, block * block_size + hi)
        kv[0, :, new] = _rope(k, cos, sin)[lo:hi].transpose(1, 0, 2)
        kv[1, :, new] = v[lo:hi].transpose(1, 0, 2)

        num_keys = (block + 1) * block_size
        keys_t = kv[0, :, :num_keys].transpose(0, 2, 1)  # [kv_heads, head_dim, num_keys]
        values = kv[1, :, :num_keys]  # [kv_heads, num_keys, head_dim]
        # Row (g, r) of kv head h is query head h * group + g at position block * block_size + r.
        q_grouped = q.reshape(block_size, kv_heads, group, head_dim).transpose(1, 2, 0, 3)
        scores = q_grouped.reshape(kv_heads, group * block_size, head_dim) @ keys_t
        own_block = scores.reshape(kv_heads, group, block_size, num_keys)[..., num_keys - block_size :]
        np.copyto(own_block, -np.inf, where=_future_mask(block_size))
        scores -= scores.max(axis=-1, keepdims=True)
        np.exp(scores, out=scores)
        denominators = scores.sum(axis=-1, keepdims=True)
        out = (scores @ values) / denominators  # [kv_heads, group * block_size, head_dim]
        out = out.reshape(kv_heads, group, block_size, head_dim).transpose(2, 0, 1, 3)
        return self._linear(np.ascontiguousarray(out).reshape(block_size, heads * head_dim), w.o_proj, rows)

    def _mlp(self, x: FloatArray, w: LayerWeights, rows: TileRows) -> FloatArray:
        cfg = self.config
        gate_up = self._linear(_rms_norm(x, w.mlp_norm, cfg.rms_eps), w.gate_up, rows)
        gate, up = gate_up[:, : cfg.ffn_size], gate_up[:, cfg.ffn_size :]
        silu = gate / (np.float32(1.0) + np.exp(-gate))
        return self._linear(np.ascontiguousarray(silu * up), w.down, rows)

    def _scratch_kv(self, block_size: int) -> FloatArray:
        """This thread's `[2, kv_heads, capacity, head_dim]` K/V of the sequence being run.

        Its capacity is fixed, so the K/V operands of a position always have the same shape and strides.
        """
        buffers: dict[int, FloatArray] = self._scratch.__dict__.setdefault("buffers", {})
        if block_size not in buffers:
            cfg = self.config
            capacity = -(-cfg.max_position // block_size) * block_size
            buffers[block_size] = np.zeros((2, cfg.num_kv_heads, capacity, cfg.head_dim), dtype=np.float32)
        return buffers[block_size]

    @staticmethod
    def _load_cached_kv(kv: FloatArray, cached_blocks: FloatArray) -> None:
        """Copy cache blocks `[n, 2, kv_heads, block_size, head_dim]` into the first n blocks of `kv`."""
        num_blocks, _, kv_heads, block_size, head_dim = cached_blocks.shape
        by_block = kv.reshape(2, kv_heads, -1, block_size, head_dim)
        np.copyto(by_block[:, :, :num_blocks], cached_blocks.transpose(1, 2, 0, 3, 4))

    def _validate(
        self,
        kv_cache: FloatArray,
        block_size: int,
        tokens: npt.NDArray[np.int64],
        start_pos: int,
        end_pos: int,
        table: npt.NDArray[np.int64],
    ) -> None:
        cfg = self.config
        expected = (cfg.num_layers, 2, cfg.num_kv_heads, block_size, cfg.head_dim)
        if kv_cache.dtype != np.float32 or kv_cache.ndim != 6 or kv_cache.shape[1:] != expected:
            got = f"{kv_cache.dtype} {kv_cache.shape}"
            raise ValueError(f"kv_cache must be float32 [num_blocks, *{expected}], got {got}")
        if len(tokens) == 0:
            raise ValueError("forward needs at least one token")
        if tokens.min() < 0 or tokens.max() >= cfg.vocab_size:
            raise ValueError(f"token ids must be in [0, {cfg.vocab_size})")
        if start_pos < 0 or end_pos > cfg.max_position:
            raise ValueError(f"positions [{start_pos}, {end_pos}) outside [0, {cfg.max_position})")
        if len(table) * block_size < end_pos:
            raise ValueError(f"block table of {len(table)} blocks cannot hold {end_pos} positions")
        if table.min() < 0 or table.max() >= kv_cache.shape[0]:
            raise ValueError(f"block table entries must be in [0, {kv_cache.shape[0]})")

    # ---- reference generation -------------------------------------------------------------------
    def generate_greedy(
        self,
        prompt_ids: Sequence[int],
        max_tokens: int,
        num_blocks: int | None = None,
        block_size: int = 16,
        stop_at_eos: bool = True,
        eos_token_id: int = EOS_TOKEN_ID,
    ) -> list[int]:
        """The colocated reference: one sequence alone, prefilled in one call, then decoded token by token."""
        if max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        needed = -(-(len(prompt_ids) + max_tokens) // block_size)
        num_blocks = needed if num_blocks is None else num_blocks
        kv_cache = self.allocate_kv_cache(self.kv_cache_spec(num_blocks, block_size))
        block_table = list(range(needed))
        logits = self.forward(kv_cache, block_size, prompt_ids, 0, block_table, len(prompt_ids))
        output: list[int] = []
        while True:
            token = sample(logits, 0.0, None, len(prompt_ids) + len(output))
            output.append(token)
            if len(output) >= max_tokens or (stop_at_eos and token == eos_token_id):
                return output
            position = len(prompt_ids) + len(output) - 1
            logits = self.forward(kv_cache, block_size, [token], position, block_table, len(prompt_ids))


_MIN_TEMPERATURE = 1e-5


def sample(logits: FloatArray, temperature: float, seed: int | None, position: int) -> int:
    """Greedy argmax at temperature 0 (ties go to the lowest id); otherwise a softmax draw that depends
    only on (seed, position), so a sequence resumed elsewhere samples the same tokens. No seed: unseeded."""
    if temperature < _MIN_TEMPERATURE:  # below this, logits / temperature overflows: it is greedy
        return int(np.argmax(logits))
    scaled = logits.astype(np.float64) / temperature
    probs = np.exp(scaled - scaled.max())
    cumulative = np.cumsum(probs / probs.sum())
    rng = np.random.default_rng(None if seed is None else (seed, position))
    index = int(np.searchsorted(cumulative, rng.random(), side="right"))
    return min(index, len(cumulative) - 1)


def _rms_norm(x: FloatArray, weight: FloatArray, eps: float) -> FloatArray:
    mean_square = np.mean(x * x, axis=-1, keepdims=True)
    normed: FloatArray = (x / np.sqrt(mean_square + np.float32(eps))) * weight
    return normed


def _rope(x: FloatArray, cos: FloatArray, sin: FloatArray) -> FloatArray:
    """Rotate-half RoPE on `[rows, heads, head_dim]` with `cos`/`sin` of shape `[rows, 1, head_dim / 2]`."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    out = np.empty_like(x)
    out[..., :half] = x1 * cos - x2 * sin
    out[..., half:] = x2 * cos + x1 * sin
    return out


@functools.cache
def _future_mask(block_size: int) -> npt.NDArray[np.bool_]:
    """[row, key] within one block: True where the key's position is after the row's."""
    return np.triu(np.ones((block_size, block_size), dtype=np.bool_), k=1)
