"""The tiny Llama (RMSNorm, RoPE, grouped-query attention, SwiGLU) over a paged KV cache, in numpy.

KV cache: one float32 array `[num_blocks, num_layers, 2 (K, V), num_kv_heads, block_size, head_dim]`;
position p lives in block `block_table[p // block_size]`, slot `p % block_size`. Weights are `[out, in]`.

Bit-identity by construction: every operation touching position p has operand shapes and strides that
depend only on p and on whether p is a prompt or a generated position, never on the call's other
positions or sequences. Prompt positions run on fixed `[block_size, hidden]` tiles (tiles.py); generated
positions of all sequences are rows of one array (rows.py); the LM head runs per last row. So K/V and
logits are the same bits however a prompt is split, transferred, decoded, recomputed or batched, for one
CPU type, numpy/OpenBLAS build and BLAS thread count."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvferry.connector.layout import KVCacheSpec
from kvferry.engine.forward_context import ForwardContext, Rope, ScratchKV
from kvferry.engine.model_math import FloatArray, RowWeight, rms_norm
from kvferry.engine.rows import GeneratedRows, layer_step
from kvferry.engine.tiles import PromptTiles, prompt_layer
from kvferry.engine.tokenizer import EOS_TOKEN_ID
from kvferry.engine.weights import LayerWeights, LlamaWeights, ModelConfig, RowLayer, random_weights

__all__ = ["FloatArray", "LayerWeights", "LlamaWeights", "ModelConfig", "SeqChunk", "TinyLlama", "sample"]


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
        self._rope = Rope.of(cfg)
        self._scratch = ScratchKV(cfg)

    def kv_cache_spec(self, num_blocks: int, block_size: int) -> KVCacheSpec:
        cfg = self.config
        return KVCacheSpec(num_blocks, cfg.num_layers, cfg.num_kv_heads, block_size, cfg.head_dim)

    def allocate_kv_cache(self, spec: KVCacheSpec) -> FloatArray:
        cfg = self.config
        expected = (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 4)
        if (spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.itemsize) != expected:
            raise ValueError(f"KV cache spec {spec} does not match the model config")
        return np.zeros(spec.shape, dtype=np.float32)

    def forward(self, kv_cache: FloatArray, block_size: int, token_ids: Sequence[int], start_pos: int,
                block_table: Sequence[int], prompt_len: int | None = None) -> FloatArray:
        """Run positions [start_pos, start_pos + len(token_ids)) of one sequence; return the last one's logits.
        Positions from `prompt_len` on are generated (None: all prompt); callers must agree per sequence,
        since the two kinds are computed differently."""
        logits = self.forward_batch(kv_cache, block_size, [SeqChunk(token_ids, start_pos, block_table, prompt_len)])[0]
        assert logits is not None
        return logits

    def forward_batch(self, kv_cache: FloatArray, block_size: int, chunks: Sequence[SeqChunk]) -> list[FloatArray | None]:
        """`forward` for chunks of distinct sequences in one call; each one's last-position logits (None
        where `want_logits` is False), the bits it would get alone."""
        seqs = [self._prepare(kv_cache, block_size, chunk) for chunk in chunks]
        rows = self._generated_rows(seqs, block_size)
        prompts = [seq.prompt for seq in seqs if seq.prompt.live]
        tiles = PromptTiles.stack(prompts)
        ctx = ForwardContext(self.config, kv_cache, block_size, self._scratch.get(block_size), self._rope)
        for layer_index, (weights, lin) in enumerate(zip(self.layers, self.row_layers, strict=True)):
            if prompts:
                prompt_layer(ctx, layer_index, weights, lin, prompts, tiles)
            if len(rows.hidden):
                layer_step(ctx, layer_index, weights, lin, rows)

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
        return _Seq(chunk, PromptTiles.of(self.embed, tokens[: prompt_end - start], start, table, block_size), end)

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

    def _validate(self, kv_cache: FloatArray, block_size: int, tokens: npt.NDArray[np.int64], start_pos: int,
                  end_pos: int, table: npt.NDArray[np.int64]) -> None:
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

    def generate_greedy(self, prompt_ids: Sequence[int], max_tokens: int, num_blocks: int | None = None,
                        block_size: int = 16, stop_at_eos: bool = True,
                        eos_token_id: int = EOS_TOKEN_ID) -> list[int]:
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
