"""The tiny Llama: bit-identity across splits, transfers, batching and reruns; sampling; tokenizer."""

from collections.abc import Sequence

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvferry.engine.block_pool import BlockPool
from kvferry.engine.model import ModelConfig, TinyLlama, sample
from kvferry.engine.tokenizer import (
    EOS_TOKEN_ID,
    VOCAB_SIZE,
    IncrementalDetokenizer,
    decode,
    encode,
)

BS = 16
NUM_BLOCKS = 64


@pytest.fixture(scope="module")
def model() -> TinyLlama:
    return TinyLlama(ModelConfig(seed=0))


def prompt(length: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(0, 256, length).tolist()


def shuffled_table(num: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).permutation(NUM_BLOCKS)[:num].tolist()


def new_cache(model: TinyLlama, fill: float = 0.0) -> np.ndarray:
    cache = model.allocate_kv_cache(model.kv_cache_spec(NUM_BLOCKS, BS))
    cache[...] = fill
    return cache


def run_pieces(
    model: TinyLlama, cache: np.ndarray, tokens: Sequence[int], cuts: Sequence[int], table: Sequence[int],
    prompt_len: int | None = None,
) -> np.ndarray:
    """Forward `tokens` in pieces ending at each cut (and at the end); the last piece's logits."""
    bounds = [0, *sorted({c for c in cuts if 0 < c < len(tokens)}), len(tokens)]
    logits = np.empty(0, np.float32)
    for start, end in zip(bounds, bounds[1:], strict=False):
        logits = model.forward(cache, BS, tokens[start:end], start, table, prompt_len)
    return logits


def kv_of(cache: np.ndarray, table: Sequence[int], num_tokens: int) -> bytes:
    """The sequence's K/V bytes in position order (written slots only)."""
    blocks = cache[list(table[: -(-num_tokens // BS)])]  # [n, layers, 2, heads, BS, dim]
    by_position = blocks.transpose(1, 2, 3, 0, 4, 5).reshape(*blocks.shape[1:4], -1, blocks.shape[-1])
    return by_position[..., :num_tokens, :].tobytes()


@pytest.mark.parametrize("length", [1, 5, 16, 17, 47, 100, 300])
def test_every_block_boundary_split_is_bit_identical(model: TinyLlama, length: int) -> None:
    tokens = prompt(length, seed=length)
    table = shuffled_table(-(-length // BS), seed=length)
    ref_cache = new_cache(model)
    ref = model.forward(ref_cache, BS, tokens, 0, table)
    ref_kv = kv_of(ref_cache, table, length)
    for cut in range(BS, length, BS):
        cache = new_cache(model)
        logits = run_pieces(model, cache, tokens, [cut], table)
        assert logits.tobytes() == ref.tobytes(), f"split at {cut}"
        assert kv_of(cache, table, length) == ref_kv, f"split at {cut}"


@pytest.mark.parametrize("length", [17, 40, 300])
def test_token_by_token_and_unaligned_splits_are_bit_identical(model: TinyLlama, length: int) -> None:
    tokens = prompt(length, seed=1000 + length)
    table = shuffled_table(-(-length // BS), seed=length)
    ref_cache = new_cache(model)
    ref = model.forward(ref_cache, BS, tokens, 0, table)
    for cuts in (range(1, length), [3], [BS - 1, BS + 1, 2 * BS + 5], range(7, length, 7)):
        cache = new_cache(model)
        assert run_pieces(model, cache, tokens, list(cuts), table).tobytes() == ref.tobytes()
        assert kv_of(cache, table, length) == kv_of(ref_cache, table, length)


@settings(max_examples=25, deadline=None)
@given(
    length=st.integers(1, 120),
    cut_fractions=st.lists(st.floats(0, 1), max_size=5),
    garbage=st.sampled_from([0.0, 7.5, np.nan]),
)
def test_random_splits_over_stale_cache_are_bit_identical(
    model: TinyLlama, length: int, cut_fractions: list[float], garbage: float
) -> None:
    tokens = prompt(length, seed=length)
    table = shuffled_table(-(-length // BS), seed=length + 1)
    ref_cache = new_cache(model)
    ref = model.forward(ref_cache, BS, tokens, 0, table)
    cache = new_cache(model, fill=garbage)  # stale contents of reused blocks must never leak in
    logits = run_pieces(model, cache, tokens, [int(f * length) for f in cut_fractions], table)
    assert logits.tobytes() == ref.tobytes()
    assert kv_of(cache, table, length) == kv_of(ref_cache, table, length)


@settings(max_examples=25, deadline=None)
@given(
    prompt_len=st.integers(1, 70),
    generated=st.integers(1, 40),
    cut_fractions=st.lists(st.floats(0, 1), max_size=4),
    garbage=st.sampled_from([0.0, np.nan]),
)
def test_generated_tokens_recomputed_in_any_pieces_match_decoding_them(
    model: TinyLlama, prompt_len: int, generated: int, cut_fractions: list[float], garbage: float
) -> None:
    """Generated positions run row by row, prompt positions as tiles: a preempted sequence recomputed
    in one call or in any pieces (prompt and generated rows sharing a tile) gives the decoded bits."""
    length = prompt_len + generated
    tokens = prompt(length, seed=length)
    table = shuffled_table(-(-length // BS), seed=prompt_len)
    ref_cache = new_cache(model)
    ref = model.forward(ref_cache, BS, tokens[:prompt_len], 0, table, prompt_len)
    for position in range(prompt_len, length):  # decoding, one token per call
        ref = model.forward(ref_cache, BS, tokens[position : position + 1], position, table, prompt_len)
    cache = new_cache(model, fill=garbage)
    cuts = [int(f * length) for f in cut_fractions]
    assert run_pieces(model, cache, tokens, cuts, table, prompt_len).tobytes() == ref.tobytes()
    assert kv_of(cache, table, length) == kv_of(ref_cache, table, length)


def test_prompt_positions_never_depend_on_the_generated_ones_in_their_tile(model: TinyLlama) -> None:
    """A prompt's K/V and last logits are the same bits whatever is generated after it (P sends them
    before D generates anything)."""
    tokens = prompt(40, seed=11)
    table = shuffled_table(3, seed=11)
    alone = new_cache(model)
    ref = model.forward(alone, BS, tokens[:37], 0, table, 37)
    with_output = new_cache(model)
    model.forward(with_output, BS, tokens, 0, table, 37)
    assert kv_of(with_output, table, 37) == kv_of(alone, table, 37)
    assert model.forward(new_cache(model), BS, tokens[:37], 0, table, 37).tobytes() == ref.tobytes()


@pytest.mark.parametrize("length", [40, 300])
def test_continuing_after_kv_copied_from_another_cache_is_bit_identical(
    model: TinyLlama, length: int
) -> None:
    """Simulates a remote transfer: the first blocks' bytes arrive in different block ids of another cache."""
    tokens = prompt(length, seed=7)
    num_blocks = -(-length // BS)
    src_table, dst_table = shuffled_table(num_blocks, seed=1), shuffled_table(num_blocks, seed=2)
    src = new_cache(model)
    ref = model.forward(src, BS, tokens, 0, src_table)
    for transferred in range(1, num_blocks):
        dst = new_cache(model, fill=np.nan)
        dst[dst_table[:transferred]] = src[src_table[:transferred]]
        start = transferred * BS
        logits = model.forward(dst, BS, tokens[start:], start, dst_table)
        assert logits.tobytes() == ref.tobytes(), f"{transferred} blocks transferred"
        assert kv_of(dst, dst_table, length) == kv_of(src, src_table, length)


def test_recompute_after_corrupted_blocks_is_bit_identical(model: TinyLlama) -> None:
    """The `recompute` failure policy: blocks from the first invalid one on hold garbage and are recomputed."""
    tokens = prompt(150, seed=3)
    table = shuffled_table(-(-150 // BS), seed=3)
    cache = new_cache(model)
    ref = model.forward(cache, BS, tokens, 0, table)
    ref_kv = kv_of(cache, table, 150)
    for first_invalid in range(len(table)):
        cache[table[first_invalid:]] = np.random.default_rng(first_invalid).standard_normal(
            cache[table[first_invalid:]].shape
        )
        start = first_invalid * BS
        assert model.forward(cache, BS, tokens[start:], start, table).tobytes() == ref.tobytes()
        assert kv_of(cache, table, 150) == ref_kv


def test_kv_bytes_identical_between_runs_and_model_instances(model: TinyLlama) -> None:
    tokens = prompt(100, seed=5)
    table = shuffled_table(7, seed=5)
    caches = [new_cache(model), new_cache(model), new_cache(TinyLlama(ModelConfig(seed=0)))]
    for cache in caches[:2]:
        model.forward(cache, BS, tokens, 0, table)
    TinyLlama(ModelConfig(seed=0)).forward(caches[2], BS, tokens, 0, table)
    assert caches[0].tobytes() == caches[1].tobytes() == caches[2].tobytes()


def test_interleaved_sequences_in_one_cache_match_each_run_alone(model: TinyLlama) -> None:
    """Continuous batching: several sequences, chunked prefill and decode interleaved in one shared cache."""
    prompts = [prompt(n, seed=n) for n in (5, 33, 64, 130)]
    max_tokens = 12
    references = [model.generate_greedy(p, max_tokens, stop_at_eos=False) for p in prompts]

    pool = BlockPool(NUM_BLOCKS)
    cache = new_cache(model, fill=np.nan)
    tables = [pool.allocate(-(-(len(p) + max_tokens) // BS)) for p in prompts]
    sequences = [list(p) for p in prompts]
    computed = [0] * len(prompts)
    outputs: list[list[int]] = [[] for _ in prompts]
    chunk = 24  # a per-step prefill budget that is not block aligned
    while any(len(out) < max_tokens for out in outputs):
        for i in reversed(range(len(prompts))):  # a different order than the references ran in
            if len(outputs[i]) >= max_tokens:
                continue
            end = min(len(sequences[i]), computed[i] + chunk)
            logits = model.forward(cache, BS, sequences[i][computed[i] : end], computed[i], tables[i], len(prompts[i]))
            computed[i] = end
            if end == len(sequences[i]):
                token = sample(logits, 0.0, None, end)
                outputs[i].append(token)
                sequences[i].append(token)
    assert outputs == references
    for table in tables:
        pool.free(table)
    pool.check_invariants()
    assert pool.num_free == NUM_BLOCKS


def test_generate_greedy_is_reproducible_and_not_degenerate(model: TinyLlama) -> None:
    tokens = encode("The quick brown fox jumps over the lazy dog. ")
    first = model.generate_greedy(tokens, 24, stop_at_eos=False)
    assert first == model.generate_greedy(tokens, 24, stop_at_eos=False, num_blocks=32, block_size=BS)
    assert len(first) == 24 and all(0 <= t < VOCAB_SIZE for t in first)
    assert len(set(first)) > 3
    other = TinyLlama(ModelConfig(seed=1)).generate_greedy(tokens, 24, stop_at_eos=False)
    assert other != first


def test_generate_greedy_stops_at_eos(model: TinyLlama, monkeypatch: pytest.MonkeyPatch) -> None:
    eos_logits = np.zeros(VOCAB_SIZE, np.float32)
    eos_logits[EOS_TOKEN_ID] = 1.0
    monkeypatch.setattr(model, "forward", lambda *args: eos_logits)
    assert model.generate_greedy([1, 2, 3], 10) == [EOS_TOKEN_ID]
    assert model.generate_greedy([1, 2, 3], 3, stop_at_eos=False) == [EOS_TOKEN_ID] * 3


def test_logits_are_finite_and_spread(model: TinyLlama) -> None:
    cache = new_cache(model)
    logits = model.forward(cache, BS, prompt(300), 0, list(range(19)))
    assert logits.dtype == np.float32 and logits.shape == (VOCAB_SIZE,)
    assert np.isfinite(logits).all() and 0.3 < float(logits.std()) < 10


def test_kv_lands_in_the_documented_slots(model: TinyLlama) -> None:
    cache = new_cache(model)
    table = [9, 2, 5]
    model.forward(cache, BS, prompt(37), 0, table)
    written = np.abs(cache).sum(axis=(1, 2, 3, 5)) != 0  # [block, slot]
    expected = np.zeros_like(written)
    expected[9, :] = expected[2, :] = True
    expected[5, : 37 - 2 * BS] = True
    assert (written == expected).all()
    spec = model.kv_cache_spec(NUM_BLOCKS, BS)
    assert cache.shape == spec.shape and cache.flags.c_contiguous
    assert spec.block_bytes == cache[0].nbytes


def test_default_config_shards_over_1_2_4_ranks() -> None:
    config = ModelConfig()
    assert all(config.num_kv_heads % tp == 0 for tp in (1, 2, 4))
    assert config.vocab_size == VOCAB_SIZE


def test_forward_rejects_bad_inputs(model: TinyLlama) -> None:
    cache = new_cache(model)
    with pytest.raises(ValueError, match="at least one token"):
        model.forward(cache, BS, [], 0, [0])
    with pytest.raises(ValueError, match="cannot hold"):
        model.forward(cache, BS, prompt(17), 0, [0])
    with pytest.raises(ValueError, match="block table entries"):
        model.forward(cache, BS, prompt(3), 0, [NUM_BLOCKS])
    with pytest.raises(ValueError, match="token ids"):
        model.forward(cache, BS, [VOCAB_SIZE], 0, [0])
    with pytest.raises(ValueError, match="kv_cache"):
        model.forward(cache, 8, prompt(3), 0, [0])
    with pytest.raises(ValueError, match="does not match"):
        model.allocate_kv_cache(TinyLlama(ModelConfig(num_layers=2)).kv_cache_spec(4, BS))


# ---- sampling ----------------------------------------------------------------------------------


def test_greedy_sampling_breaks_ties_toward_lowest_id() -> None:
    logits = np.array([0.0, 3.0, 1.0, 3.0], np.float32)
    assert sample(logits, 0.0, None, 0) == 1


def test_seeded_sampling_depends_only_on_seed_and_position() -> None:
    logits = np.random.default_rng(0).standard_normal(VOCAB_SIZE).astype(np.float32)
    draws = [sample(logits, 1.0, 42, pos) for pos in range(200)]
    assert draws == [sample(logits, 1.0, 42, pos) for pos in range(200)]
    assert draws != [sample(logits, 1.0, 43, pos) for pos in range(200)]
    assert len(set(draws)) > 50


def test_sampling_follows_the_softmax() -> None:
    logits = np.log(np.array([0.7, 0.2, 0.1, 1e-9], np.float32))
    counts = np.bincount([sample(logits, 1.0, 0, pos) for pos in range(4000)], minlength=4)
    assert np.allclose(counts / 4000, [0.7, 0.2, 0.1, 0.0], atol=0.03)
    assert sample(logits, 1e-4, 0, 0) == 0  # a tiny temperature approaches greedy


# ---- tokenizer ---------------------------------------------------------------------------------


@given(st.text())
def test_tokenizer_round_trips(text: str) -> None:
    ids = encode(text)
    assert all(0 <= i < EOS_TOKEN_ID for i in ids)
    assert decode(ids + [EOS_TOKEN_ID]) == text


@given(st.text(), st.lists(st.integers(0, EOS_TOKEN_ID), max_size=20))
def test_incremental_detokenizer_matches_decode(text: str, extra: list[int]) -> None:
    ids = encode(text) + extra  # extra may hold invalid UTF-8 and EOS
    detok = IncrementalDetokenizer()
    streamed = "".join(detok.push(i) for i in ids) + detok.finish()
    assert streamed == decode(ids)


def test_incremental_detokenizer_holds_back_partial_characters() -> None:
    detok = IncrementalDetokenizer()
    euro = encode("€")
    assert [detok.push(i) for i in euro] == ["", "", "€"]
    assert detok.push_many(encode("ab")[:1]) == "a"
    assert detok.push(euro[0]) == "" and detok.finish() == "\ufffd"


def test_tokenizer_rejects_out_of_vocab_ids() -> None:
    assert decode([0xFF]) == "\ufffd"
    with pytest.raises(ValueError, match="outside the vocabulary"):
        decode([VOCAB_SIZE])
