"""The tiny Llama (RMSNorm, RoPE, grouped-query attention, SwiGLU) over a paged KV cache, in numpy.

KV cache layout: ONE float32 array `[num_blocks, num_layers, 2 (K, V), num_kv_heads, block_size,
head_dim]` (`KVCacheSpec`); position p of a sequence lives in block `block_table[p // block_size]`,
slot `p % block_size`. Weights are stored `[out, in]` (C-contiguous), as checkpoints store them.

One call (`forward_batch`, one per engine step) runs chunks of any number of distinct sequences.
Bit-identity by construction: every numpy operation that touches position p has operands whose
shapes and strides depend only on p and on whether p is a prompt position or a generated one
(`prompt_len`), never on the other positions or sequences of the call:
  * prompt positions run on fixed `[block_size, hidden]` tiles, position p at row `p % block_size`,
    unused rows zero: row-wise norms, one matrix product per tile and per fixed weight panel for each
    linear layer (prefill speed; panels outermost, so a panel is read from memory once for all the
    call's tiles of all sequences), and attention of block b over exactly `(b + 1) * block_size`
    keys/values gathered into a per-thread buffer of fixed capacity; keys after the chunk's prompt
    positions are zero and masked, so stale cache contents and later positions never matter;
  * generated positions (decoded tokens, or recomputed ones) of ALL sequences of the call are rows of
    one array (rows.py): row-wise norms and activations, one vector-matrix product per row and per
    fixed weight panel (each weight read from memory once per step for all rows, and one row alone
    costs what a lone decode always cost), attention over exactly p + 1 keys;
  * the LM head runs on each sequence's last row alone, as a generated row does.
So the K/V written and the logits are the same bits whether a prompt is run in one call, split at any
position, continued from K/V copied in from elsewhere, decoded token by token, recomputed after a
preemption, or batched with any other sequences at any place in the step (tests/engine/test_batched.py).
This holds for one CPU type, numpy/OpenBLAS build and BLAS thread count: OpenBLAS splits a matmul
differently with a different OPENBLAS_NUM_THREADS.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvferry.connector.base import KVCacheSpec
from kvferry.engine.model_math import FloatArray, RowWeight, rms_norm
from kvferry.engine.rows import GeneratedRows, RowLayer, layer_step
from kvferry.engine.tiles import PromptTiles, prompt_layer
from kvferry.engine.tokenizer import EOS_TOKEN_ID, VOCAB_SIZE

__all__ = ["FloatArray", "LayerWeights", "LlamaWeights", "ModelConfig", "SeqChunk", "TinyLlama", "sample"]


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
    prompt: PromptTiles  # the call's prompt positions [chunk.start_pos, prompt.end)
    end: int
    rows: tuple[int, int] = (0, 0)  # its generated positions [prompt.end, end): rows [lo, hi) of GeneratedRows


class TinyLlama:
    """A Llama forward over a paged KV cache: the tiny random model, or real weights (`weights=`)."""

    def __init__(self, config: ModelConfig | None = None, weights: LlamaWeights | None = None) -> None:
        self.config = cfg = config or ModelConfig()
        w = weights or random_weights(cfg)
        self.embed, self.layers, self.final_norm = w.embed, w.layers, w.final_norm
        self.row_layers = [RowLayer.of(layer) for layer in self.layers]
        self.lm_head = RowWeight(w.lm_head)  # `[vocab, hidden]`: no copy when tied to `embed`

        inv_freq = cfg.rope_theta ** (-np.arange(0, cfg.head_dim, 2, dtype=np.float64) / cfg.head_dim)
        angles = np.outer(np.arange(cfg.max_position, dtype=np.float64), inv_freq)
        self._rope_cos = np.cos(angles).astype(np.float32)  # [max_position, head_dim / 2]
        self._rope_sin = np.sin(angles).astype(np.float32)
        self.q_scale = np.float32(1.0 / math.sqrt(cfg.head_dim))
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
        logits = self.forward_batch(kv_cache, block_size, [SeqChunk(token_ids, start_pos, block_table, prompt_len)])[0]
        assert logits is not None
        return logits

    def forward_batch(self, kv_cache: FloatArray, block_size: int, chunks: Sequence[SeqChunk]) -> list[FloatArray | None]:
        """`forward` for chunks of distinct sequences in one call (an engine step); each one's last-position
        logits (None where `want_logits` is False). Each sequence gets the bits it would get alone."""
        seqs = [self._prepare(kv_cache, block_size, chunk) for chunk in chunks]
        rows = self._generated_rows(seqs, block_size)
        prompts = [seq.prompt for seq in seqs if seq.prompt.live]
        tiles = PromptTiles.stack(prompts)
        for layer_index in range(len(self.layers)):
            if prompts:
                prompt_layer(self, kv_cache, block_size, layer_index, prompts, tiles)
            if len(rows.hidden):
                layer_step(self, kv_cache, block_size, layer_index, rows)

        last = [rows.hidden[s.rows[1] - 1] if s.end > s.prompt.end else s.prompt.last_row(block_size)
                for s in seqs if s.chunk.want_logits]
        if not last:
            return [None] * len(seqs)
        logits = iter(self.lm_head.apply(rms_norm(np.stack(last), self.final_norm, self.config.rms_eps)))
        return [next(logits) if s.chunk.want_logits else None for s in seqs]

    def _prepare(self, kv_cache: FloatArray, block_size: int, chunk: SeqChunk) -> _Seq:
        tokens = np.asarray(chunk.token_ids, dtype=np.int64)
        start, end = chunk.start_pos, chunk.start_pos + len(tokens)
        table = np.asarray(chunk.block_table[: (end - 1) // block_size + 1 if len(tokens) else 1], dtype=np.int64)
        self._validate(kv_cache, block_size, tokens, start, end, table)
        prompt_end = end if chunk.prompt_len is None else min(max(chunk.prompt_len, start), end)
        return _Seq(chunk, PromptTiles.of(self, tokens[: prompt_end - start], start, table, block_size), end)

    def _generated_rows(self, seqs: list[_Seq], block_size: int) -> GeneratedRows:
        """The generated positions of all sequences, sequence after sequence."""
        positions: list[npt.NDArray[np.int64]] = []
        blocks: list[npt.NDArray[np.int64]] = []
        tokens: list[int] = []
        spans: list[tuple[int, int, npt.NDArray[np.int64]]] = []
        count = 0
        for seq in seqs:
            first = seq.prompt.end
            if seq.end > first:
                positions.append(np.arange(first, seq.end, dtype=np.int64))
                blocks.append(seq.prompt.table[positions[-1] // block_size])
                tokens.extend(seq.chunk.token_ids[first - seq.chunk.start_pos :])
                seq.rows = (count, count + seq.end - first)
                spans.append((*seq.rows, seq.prompt.table))
                count = seq.rows[1]
        pos = np.concatenate(positions) if positions else np.zeros(0, np.int64)
        hidden = np.ascontiguousarray(self.embed[np.asarray(tokens, dtype=np.int64)])
        return GeneratedRows(hidden, pos, np.concatenate(blocks) if blocks else pos, pos % block_size, spans)

    def rope_at(self, positions: npt.NDArray[np.int64]) -> tuple[FloatArray, FloatArray]:
        """RoPE `cos`, `sin` of each position, `[rows, 1, head_dim / 2]`."""
        return self._rope_cos[positions, None, :], self._rope_sin[positions, None, :]

    def scratch_kv(self, block_size: int) -> FloatArray:
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
    def load_cached_kv(kv: FloatArray, cached_blocks: FloatArray) -> None:
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
