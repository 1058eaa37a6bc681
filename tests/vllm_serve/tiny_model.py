"""A tiny random Llama written locally (nothing downloaded): byte-level tokenizer, 2 layers, head_dim 32.

A random init with a large `initializer_range` gives peaked logits, so greedy outputs depend on the KV:
wrong or missing KV shows up as different tokens (vLLM's `--load-format dummy` would not: its logits are
near-uniform). vLLM's CPU attention needs head_dim >= 32.
"""

from __future__ import annotations

import json
from pathlib import Path

SPECIALS = ["<s>", "</s>", "<pad>"]
CONFIG = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 1024,
    "initializer_range": 0.3,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
}


def _byte_tokenizer() -> object:
    """256 byte tokens (GPT-2's byte↔unicode map, no merges) plus 3 specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    for s in SPECIALS:
        vocab[s] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def write_tiny_llama(path: Path, seed: int = 0) -> Path:
    """Write config, safetensors weights and tokenizer to `path` (idempotent); returns `path`."""
    if (path / "model.safetensors").exists() and (path / "tokenizer.json").exists():
        return path
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path.mkdir(parents=True, exist_ok=True)
    tokenizer = _byte_tokenizer()
    vocab = len(tokenizer)  # type: ignore[arg-type]
    config = LlamaConfig(vocab_size=vocab, bos_token_id=vocab - 3, eos_token_id=vocab - 2, pad_token_id=vocab - 1,
                         torch_dtype="float32", **CONFIG)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)  # type: ignore[attr-defined]
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["head_dim"] == 32, cfg
    return path


if __name__ == "__main__":
    import sys

    print(write_tiny_llama(Path(sys.argv[1])))
