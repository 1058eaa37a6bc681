"""Batched steps (one forward for many sequences) give each sequence exactly the bits it gets alone."""

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvferry.engine.loader import load_model
from kvferry.engine.model import ModelConfig, SeqChunk, TinyLlama, sample
from kvferry.engine.model_math import RowWeight, rms_norm, rope, swiglu

BS = 16
NUM_BLOCKS = 96
MAX_GENERATED = 8  # tokens each crowd sequence generates before it leaves the batch


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

    @property
    def generated(self) -> int:
        return len(self.tokens) - len(self.prompt)

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
    while seq.generated < steps:
        c = seq.next_chunk()  # one sequence per call, through the single-sequence API
        logits = model.forward(cache, BS, c.token_ids, c.start_pos, c.block_table, c.prompt_len)
        seq.advance(c, logits if c.want_logits else None)
    return seq, kv_of(cache, table, seq.computed)


@pytest.mark.parametrize("shape", [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576), (259, 256)])
def test_row_ops_are_row_invariant(shape: tuple[int, int]) -> None:
    """The property the generated-row path rests on, on this numpy/OpenBLAS: a row's result is the same
    bits whatever the other rows hold, how many there are (1..70) and where the row sits."""
    rng = np.random.default_rng(shape[0])
    weight = RowWeight(rng.standard_normal(shape, dtype=np.float32))
    norm = rng.standard_normal(shape[1], dtype=np.float32)
    cos, sin = rng.standard_normal((2, 1, 1, 16), dtype=np.float32)
    row = rng.standard_normal(shape[1], dtype=np.float32)

    def ops(x: np.ndarray) -> list[np.ndarray]:
        heads = x[:, :64].reshape(len(x), 2, 32)
        return [weight.apply(x), rms_norm(x, norm, 1e-5), swiglu(x, shape[1] // 2),
                rope(heads, np.repeat(cos, len(x), 0), np.repeat(sin, len(x), 0))]

    alone = [op[0].tobytes() for op in ops(row[None])]
    for m in (2, 3, 4, 7, 8, 16, 17, 64, 70):
        x = rng.standard_normal((m, shape[1]), dtype=np.float32)
        at = int(rng.integers(0, m))
        x[at] = row
        assert [op[at].tobytes() for op in ops(x)] == alone, (shape, m, at)


@pytest.mark.parametrize("shape", [(960, 576), (3072, 576), (576, 1536), (259, 256)])
def test_tile_products_are_tile_invariant(shape: tuple[int, int]) -> None:
    """The property the prompt-tile path rests on: a tile's product with a weight is the same bits whatever
    the other tiles of the call hold, how many there are (1..40) and where the tile sits."""
    rng = np.random.default_rng(shape[1])
    weight = RowWeight(rng.standard_normal(shape, dtype=np.float32))
    tile = rng.standard_normal((BS, shape[1]), dtype=np.float32)
    tile[:5] = 0.0  # a partial tile, as the first block of a chunk that starts mid-block
    alone = weight.apply_tiles(tile[None])[0]
    assert np.allclose(alone, tile @ weight.weight.T, rtol=1e-4, atol=1e-4)
    for count in (2, 3, 8, 17, 40):
        tiles = rng.standard_normal((count, BS, shape[1]), dtype=np.float32)
        at = int(rng.integers(0, count))
        tiles[at] = tile
        assert weight.apply_tiles(tiles)[at].tobytes() == alone.tobytes(), (shape, count, at)


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
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
    """Tokens, logits and K/V bytes of one sequence: alone (one forward per call) vs batched with random
    others (random lengths, prefill chunks, start delays, place in the batch) in one cache full of NaN;
    then recomputed (a preempted sequence: prompt and generated tokens in one call) among others again."""
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
        blocks = -(-(length + MAX_GENERATED) // BS)
        if blocks > len(free):
            break
        crowd.append((Seq(rng.integers(0, 256, length).tolist(), free[:blocks], chunk), delay))
        free = free[blocks:]
    step = 0
    while target.generated < steps:
        batch = [(s, s.next_chunk()) for s, delay in crowd if delay <= step and s.generated < MAX_GENERATED]
        batch.insert(int(rng.integers(0, len(batch) + 1)), (target, target.next_chunk()))
        for (s, c), logits in zip(batch, model.forward_batch(cache, BS, [c for _, c in batch]), strict=True):
            s.advance(c, logits)
        step += 1
    assert target.tokens == ref.tokens
    assert target.logits == ref.logits
    assert kv_of(cache, target_table, target.computed) == ref_kv

    fresh = model.allocate_kv_cache(model.kv_cache_spec(NUM_BLOCKS, BS))
    fresh[...] = np.nan
    again = SeqChunk(target.tokens[: target.computed], 0, target_table, len(prompt))
    chunks = [s.next_chunk() for s, _ in crowd if s.generated < MAX_GENERATED]
    at = int(rng.integers(0, len(chunks) + 1))
    logits = model.forward_batch(fresh, BS, [*chunks[:at], again, *chunks[at:]])[at]
    assert logits is not None and logits.tobytes() == ref.logits[-1]
    assert kv_of(fresh, target_table, target.computed) == ref_kv


def test_many_decoding_sequences_in_one_step(model: TinyLlama) -> None:
    """64 sequences decoding together (the scheduler's default max_num_seqs): each equals its lone run."""
    rng = np.random.default_rng(7)
    seqs = [Seq(rng.integers(0, 256, int(n)).tolist(), [i], 1000) for i, n in enumerate(rng.integers(1, 12, 64))]
    cache = model.allocate_kv_cache(model.kv_cache_spec(64, BS))
    while seqs[0].generated < 3:
        chunks = [s.next_chunk() for s in seqs]
        for s, c, logits in zip(seqs, chunks, model.forward_batch(cache, BS, chunks), strict=True):
            s.advance(c, logits)
    for s in seqs[::9]:
        ref, _ = run_alone(model, s.prompt, s.table, 3, 1000)
        assert s.tokens == ref.tokens and s.logits == ref.logits


def test_smollm2_sequence_alone_equals_batched_and_recomputed() -> None:
    """The real model: 4 decode steps of one chat prompt, alone vs among 9 others, then recomputed."""
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
    while target.generated < 4:
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
