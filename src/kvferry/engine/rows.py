"""Generated positions of every sequence of a forward call, computed together, each row on its own.

Generated positions of all sequences are rows of one `[m, hidden]` array. Norms, RoPE, SwiGLU and
residuals are elementwise or row-wise; each linear layer is one vector-matrix product per row and per
fixed weight panel (`RowWeight.apply`), never a matrix-matrix product, whose rows' bits would depend on
its height; attention at position p reads exactly p + 1 keys/values. So a row's bits depend on that row
only, whatever else the step holds."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvferry.engine.forward_context import ForwardContext
from kvferry.engine.model_math import FloatArray, rms_norm, rope, swiglu
from kvferry.engine.weights import LayerWeights, RowLayer

IntArray = npt.NDArray[np.int64]


@dataclass
class GeneratedRows:
    """The generated rows of a call, sequence after sequence, positions ascending within one."""

    hidden: FloatArray  # [m, hidden]
    positions: IntArray  # [m]
    blocks: IntArray  # [m] cache block of each row
    slots: IntArray  # [m] slot within it
    spans: list[tuple[int, int, IntArray]]  # per sequence: its rows [lo, hi) and block table


def layer_step(ctx: ForwardContext, layer_index: int, w: LayerWeights, lin: RowLayer, rows: GeneratedRows) -> None:
    """Run one layer on every generated row (in place); writes their K/V into the cache."""
    cfg, kv_cache, block_size = ctx.config, ctx.kv_cache, ctx.block_size
    heads, kv_heads, head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    x, m = rows.hidden, len(rows.hidden)
    qkv = lin.qkv.apply(rms_norm(x, w.attn_norm, cfg.rms_eps))
    cos, sin = ctx.rope_at(rows.positions)
    q = rope(qkv[:, : heads * head_dim].reshape(m, heads, head_dim), cos, sin) * ctx.q_scale
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].reshape(m, kv_heads, head_dim)
    kv_cache[rows.blocks, layer_index, 0, :, rows.slots] = rope(k, cos, sin)
    kv_cache[rows.blocks, layer_index, 1, :, rows.slots] = qkv[:, (heads + kv_heads) * head_dim :].reshape(
        m, kv_heads, head_dim)

    attended = np.empty((m, heads * head_dim), dtype=np.float32)
    grouped = q.reshape(m, kv_heads, heads // kv_heads, head_dim)  # query head h is kv head h // group
    for lo, hi, table in rows.spans:
        last = int(rows.positions[hi - 1])
        kv = ctx.load_cached_kv(layer_index, table[: last // block_size + 1])
        for i in range(lo, hi):
            n = int(rows.positions[i]) + 1
            scores = grouped[i] @ kv[0, :, :n].transpose(0, 2, 1)  # [kv_heads, group, n]
            scores -= scores.max(axis=-1, keepdims=True)
            np.exp(scores, out=scores)
            attended[i] = ((scores @ kv[1, :, :n]) / scores.sum(axis=-1, keepdims=True)).reshape(-1)
    x += lin.o_proj.apply(attended)
    x += lin.down.apply(swiglu(lin.gate_up.apply(rms_norm(x, w.mlp_norm, cfg.rms_eps)), cfg.ffn_size))
