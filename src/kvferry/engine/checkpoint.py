"""HF-style model directories: read one (config.json, *.safetensors, tokenizer.json, tokenizer_config.json)
and write one (float32 safetensors; what `kvferry model export` produces and the GGUF cache holds)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from kvferry.engine.gguf_import import Checkpoint, dumps, tokenizer_config


def write_model_dir(checkpoint: Checkpoint, target: Path) -> None:
    """Write the directory atomically: a half-written cache or export is never seen under `target`."""
    from safetensors.numpy import save_file

    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        save_file(checkpoint.tensors, str(staging / "model.safetensors"), metadata={"format": "pt"})
        (staging / "config.json").write_text(dumps(checkpoint.config))
        (staging / "generation_config.json").write_text(
            dumps({"bos_token_id": checkpoint.config["bos_token_id"], "eos_token_id": checkpoint.config["eos_token_id"]})
        )
        (staging / "tokenizer.json").write_text(checkpoint.tokenizer_json)
        (staging / "tokenizer_config.json").write_text(dumps(tokenizer_config(checkpoint)))
        (staging / "special_tokens_map.json").write_text(
            dumps({"bos_token": checkpoint.bos_token, "eos_token": checkpoint.eos_token}))
        try:
            os.rename(staging, target)
        except OSError:
            if not (target / "model.safetensors").exists():
                raise
            # Another process wrote the same directory first: keep its copy.
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)


def read_model_dir(path: Path) -> Checkpoint:
    from safetensors.numpy import load_file

    config: dict[str, Any] = json.loads((path / "config.json").read_text())
    if config.get("model_type") not in ("llama", None) and "LlamaForCausalLM" not in config.get("architectures", []):
        raise ValueError(f"{path}: model_type {config.get('model_type')!r}; only Llama-family models are supported")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path}: no *.safetensors file")
    tensors: dict[str, Any] = {}
    for file in files:
        for name, array in load_file(str(file)).items():
            tensors[name] = _to_float32(array)
    tokenizer_json, template, bos, eos = read_tokenizer(path)
    eos_id = config.get("eos_token_id")
    if isinstance(eos_id, list):
        config["eos_token_id"] = eos_id[0]
    return Checkpoint(config, tensors, tokenizer_json, template, bos, eos)


def read_tokenizer(path: Path) -> tuple[str, str, str, str]:
    """(tokenizer.json text, chat template, bos token, eos token) of a model directory."""
    tok_config: dict[str, Any] = {}
    if (path / "tokenizer_config.json").exists():
        tok_config = json.loads((path / "tokenizer_config.json").read_text())
    template = tok_config.get("chat_template")
    if template is None and (path / "chat_template.jinja").exists():
        template = (path / "chat_template.jinja").read_text()
    if not isinstance(template, str):
        raise ValueError(f"{path}: no chat template (tokenizer_config.json chat_template or chat_template.jinja)")
    if not (path / "tokenizer.json").exists():
        raise ValueError(f"{path}: no tokenizer.json")
    return (
        (path / "tokenizer.json").read_text(),
        template,
        _token_text(tok_config.get("bos_token")),
        _token_text(tok_config.get("eos_token")),
    )


def _token_text(token: Any) -> str:
    if isinstance(token, dict):
        return str(token.get("content", ""))
    return "" if token is None else str(token)


def _to_float32(array: Any) -> Any:
    if array.dtype == np.float32:
        return array
    if array.dtype == np.uint16:  # safetensors.numpy has no bfloat16: it hands BF16 over as raw uint16
        return (array.astype(np.uint32) << 16).view(np.float32)
    return array.astype(np.float32)
