"""A Llama-family GGUF file → an HF-style checkpoint in memory (config, float32 tensors, tokenizer, template).

llama.cpp's converter permuted Q and K rows for ggml's interleaved RoPE, so they are un-permuted to the
model's rotate-half layout; tied embeddings have no `output.weight`. The tokenizer is a byte-level BPE
from the GGUF's tokens and merges, control tokens as special."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float32]
_CONTROL = 3  # llama.cpp token type of a control (special) token


@dataclass
class Checkpoint:
    """What a model directory holds: HF config, tensors in HF names, tokenizer.json and chat template."""

    config: dict[str, Any]
    tensors: dict[str, FloatArray]
    tokenizer_json: str
    chat_template: str
    bos_token: str
    eos_token: str


def _unpermute(weight: FloatArray, num_heads: int) -> FloatArray:
    """Undo llama.cpp's `permute` of Q/K rows (interleaved pairs → two halves per head)."""
    rows, cols = weight.shape
    half = rows // num_heads // 2
    return np.ascontiguousarray(weight.reshape(num_heads, half, 2, cols).swapaxes(1, 2).reshape(rows, cols))


def read_gguf(path: Path) -> Checkpoint:
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(str(path))
    fields = {name: field.contents() for name, field in reader.fields.items() if name != "tokenizer.ggml.scores"}
    arch = str(fields["general.architecture"])
    if arch != "llama":
        raise ValueError(f"{path}: architecture {arch!r}; only Llama-family GGUF files are supported")

    def meta(key: str) -> Any:
        return fields[f"{arch}.{key}"]

    heads, kv_heads = int(meta("attention.head_count")), int(meta("attention.head_count_kv"))
    hidden = int(meta("embedding_length"))
    raw = {t.name: np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32) for t in reader.tensors}
    tokens: list[str] = list(fields["tokenizer.ggml.tokens"])
    bos_id, eos_id = int(fields["tokenizer.ggml.bos_token_id"]), int(fields["tokenizer.ggml.eos_token_id"])
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(meta("feed_forward_length")),
        "num_hidden_layers": int(meta("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": hidden // heads,
        "rms_norm_eps": float(meta("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(fields.get(f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(meta("context_length")),
        "vocab_size": len(tokens),
        "tie_word_embeddings": "output.weight" not in raw,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "torch_dtype": "float32",
        "hidden_act": "silu",
    }
    tensors = {"model.embed_tokens.weight": raw.pop("token_embd.weight"), "model.norm.weight": raw.pop("output_norm.weight")}
    if "output.weight" in raw:
        tensors["lm_head.weight"] = raw.pop("output.weight")
    names = {
        "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
        "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    }  # fmt: skip
    for name, array in raw.items():
        _, layer, kind, _ = name.split(".")
        if kind == "attn_q":
            array = _unpermute(array, heads)
        elif kind == "attn_k":
            array = _unpermute(array, kv_heads)
        tensors[f"model.layers.{layer}.{names[kind]}.weight"] = array
    tokenizer_json = _tokenizer_json(tokens, list(fields["tokenizer.ggml.merges"]), list(fields["tokenizer.ggml.token_type"]))
    return Checkpoint(config, tensors, tokenizer_json, str(fields["tokenizer.chat_template"]), tokens[bos_id],
                      tokens[eos_id])


def _tokenizer_json(tokens: list[str], merges: list[str], token_types: list[int]) -> str:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {token: index for index, token in enumerate(tokens)}
    pairs = [(a, b) for a, b in (merge.split(" ", 1) for merge in merges)]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=pairs))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tokenizer.decoder = decoders.ByteLevel()
    special = [tokens[i] for i, kind in enumerate(token_types) if kind == _CONTROL]
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    return str(tokenizer.to_str())


def tokenizer_config(checkpoint: Checkpoint) -> dict[str, Any]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": checkpoint.chat_template,
        "bos_token": checkpoint.bos_token,
        "eos_token": checkpoint.eos_token,
        "model_max_length": checkpoint.config["max_position_embeddings"],
        "clean_up_tokenization_spaces": False,
    }


def dumps(obj: Any) -> str:
    return json.dumps(obj, indent=2, ensure_ascii=False)
