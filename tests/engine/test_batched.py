"""Batched steps (one forward for many sequences) give each sequence exactly the bits it gets alone."""

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvferry.engine.batched import ROW_TILE, SeqChunk, _row_tiles
from kvferry.engine.loader import load_model
from kvferry.engine.model import ModelConfig, TinyLlama, sample

BS = 16
NUM_BLOCKS = 96


@pytest.fixture(scope="module")
def model() -> TinyLlama:
    return TinyLlama(ModelConfig(seed=0))


def kv_of(cache: np.ndarray, table: Sequence[int], num_tokens: int) -> bytes:
    blocks = cache[list(table[: -(-num_tokens // BS)])]
    by_position = blocks.transpose(1, 2, 3, 0, 4, 5).reshape(*blocks.shape[1:4], -1, blocks.shape[-1])
    return by_position[..., :num_tokens, :].tobytes()


@dataclass
class Seq:
    """A sequence being prefilled (in chunks of `chunk` tokens) then decoded greedily."""

    prompt: list[int]
    table: list[int]
    chunk: int
    tokens: list[int] = field(default_factory=list)
    computed: int = 0
    logits: list[bytes] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.tokens = list(self.prompt)

    def next_chunk(self) -> SeqChunk:
        end = min(len(self.tokens), self.computed + self.chunk)
        return SeqChunk(self.tokens[self.computed : end], self.computed, self.table, len(self.prompt),
                        want_logits=end == len(self.tokens))

    def advance(self, chunk: SeqChunk, logits: np.ndarray | None) -> None:
        self.computed += len(chunk.token_ids)
        if logits is not None:
            self.logits.append(logits.tobytes())
            self.tokens.append(sample(logits, 0.0, None, len(self.tokens)))


def run_alone(model: TinyLlama, prompt: list[int], table: list[int], steps: int, chunk: int) -> tuple[Seq, bytes]:
    cache = model.allocate_kv_cache(model.kv_cache_spec(NUM_BLOCKS, BS))
    seq = Seq(prompt, table, chunk)
    while len(seq.tokens) - len(prompt) < steps:
        c = seq.next_chunk()
        seq.advance(c, model.forward_batch(cache, BS, [c])[0])
    return seq, kv_of(cache, table, seq.computed)


def test_row_tiles_are_row_invariant(model: TinyLlama) -> None:
    """The property the design rests on, on this numpy/OpenBLAS: a row's product is the same bits whatever
    the other rows of its fixed-height tile hold and wherever it sits in the tile."""
    rng = np.random.default_rng(0)
    weights = [model.layers[0].qkv, model.layers[0].o_proj, model.layers[0].gate_up, model.layers[0].down,
               model.lm_head]
    for weight in weights:
        row = rng.standard_normal(weight.shape[0], dtype=np.float32)
        alone = _row_tiles([row], weight)[0].tobytes()
        for trial in range(20):
            others = list(rng.standard_normal((int(rng.integers(0, 3 * ROW_TILE)), weight.shape[0]), dtype=np.float32))
            at = int(rng.integers(0, len(others) + 1))
            rows = [*others[:at], row, *others[at:]]
            assert _row_tiles(rows, weight)[at].tobytes() == alone, (weight.shape, trial)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    target_len=st.integers(1, 70),
    target_chunk=st.sampled_from([7, 16, 33, 1000]),
    others=st.lists(st.tuples(st.integers(1, 60), st.sampled_from([5, 16, 1000]), st.integers(0, 6)), max_size=11),
    order_seed=st.integers(0, 1000),
    steps=st.integers(1, 6),
)
def test_a_sequence_gets_its_bits_in_any_batch(
    model: TinyLlama, target_len: int, target_chunk: int, others: list[tuple[int, int, int]], order_seed: int,
    steps: int,
) -> None:
    """Tokens, logits and K/V bytes of one sequence: alone vs batched with random others (random lengths,
    prefill chunks, start delays, place in the batch), all sharing one cache; then recomputed in one call."""
    rng = np.random.default_rng(order_seed)
    tables = rng.permutation(NUM_BLOCKS).tolist()
    need = -(-(target_len + steps) // BS)
    target_table, free = tables[:need], tables[need:]
    prompt = rng.integers(0, 256, target_len).tolist()
    ref, ref_kv = run_alone(model, prompt, target_table, steps, target_chunk)

    cache = model.allocate_kv_cache(model.kv_cache_spec(NUM_BLOCKS, BS))
    cache[...] = np.nan  # stale contents must never matter
    target = Seq(prompt, target_table, target_chunk)
    crowd: list[tuple[Seq, int]] = []
    for length, chunk, delay in others:
        blocks = -(-(length + 8) // BS)
        if blocks > len(free):
            break
        crowd.append((Seq(rng.integers(0, 256, length).tolist(), free[:blocks], chunk), delay))
        free = free[blocks:]
    step = 0
    while len(target.tokens) - len(prompt) < steps:
        batch: list[tuple[Seq, SeqChunk]] = [(s, s.next_chunk()) for s, delay in crowd
                                            if delay <= step and len(s.tokens) - len(s.prompt) < 8]
        batch.insert(int(rng.integers(0, len(batch) + 1)), (target, target.next_chunk()))
        for (s, c), logits in zip(batch, model.forward_batch(cache, BS, [c for _, c in batch]), strict=True):
            s.advance(c, logits)
        step += 1
    assert target.tokens == ref.tokens
    assert target.logits == ref.logits
    assert kv_of(cache, target_table, target.computed) == ref_kv

    # Recompute (a preempted sequence): prompt and generated tokens in one call, among others again.
    fresh = model.allocate_kv_cache(model.kv_cache_spec(NUM_BLOCKS, BS))
    again = SeqChunk(target.tokens[: target.computed], 0, target_table, len(prompt))
    batch_chunks = [s.next_chunk() for s, _ in crowd if len(s.tokens) - len(s.prompt) < 8]
    at = int(rng.integers(0, len(batch_chunks) + 1))
    logits = model.forward_batch(fresh, BS, [*batch_chunks[:at], again, *batch_chunks[at:]])[at]
    assert logits is not None and logits.tobytes() == ref.logits[-1]
    assert kv_of(fresh, target_table, target.computed) == ref_kv


def test_smollm2_sequence_alone_equals_batched_and_recomputed() -> None:
    """One case on the real model: 4 decode steps of one chat prompt, alone vs among 9 others."""
    smol = load_model("smollm2")
    m, codec = smol.model, smol.codec
    ids = codec.encode(codec.apply_chat_template([{"role": "user", "content": "Name three rivers."}]))
    blocks = -(-(len(ids) + 4) // BS)
    ref, ref_kv = run_alone(m, ids, list(range(blocks)), 4, 1000)

    rng = np.random.default_rng(1)
    cache = m.allocate_kv_cache(m.kv_cache_spec(NUM_BLOCKS, BS))
    target = Seq(ids, list(range(40, 40 + blocks)), 1000)
    crowd = [Seq(rng.integers(100, 40000, int(n)).tolist(), list(range(4 * i, 4 * i + 4)), 1000)
             for i, n in enumerate(rng.integers(3, 50, 9))]
    while len(target.tokens) - len(ids) < 4:
        batch = [(s, s.next_chunk()) for s in crowd]
        batch.insert(int(rng.integers(0, len(batch) + 1)), (target, target.next_chunk()))
        for (s, c), logits in zip(batch, m.forward_batch(cache, BS, [c for _, c in batch]), strict=True):
            s.advance(c, logits)
    assert target.tokens == ref.tokens and target.logits == ref.logits
    assert kv_of(cache, target.table, target.computed) == ref_kv
    fresh = m.allocate_kv_cache(m.kv_cache_spec(NUM_BLOCKS, BS))
    chunks = [s.next_chunk() for s in crowd[:5]]
    again = SeqChunk(target.tokens[: target.computed], 0, target.table, len(ids))
    logits = m.forward_batch(fresh, BS, [*chunks[:2], again, *chunks[2:]])[2]
    assert logits is not None and logits.tobytes() == ref.logits[-1]
    assert kv_of(fresh, target.table, target.computed) == ref_kv
