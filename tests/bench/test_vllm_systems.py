"""The pure parts of `kvferry bench vllm`'s system choice (bench/vllm/systems.py): which systems
KVFERRY_BENCH_SYSTEMS selects, how the TP rows run, the TP model and the same-run TTFT ratio."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from kvferry.bench.vllm.systems import (
    SYSTEMS,
    TP2_ARGS,
    d_failure,
    selected,
    tp_config,
    with_ratios,
    write_doubled_heads,
    write_tp_model,
)


def test_unset_or_empty_selects_every_system_in_the_bench_order() -> None:
    assert [s.key for s in selected(None)] == list(SYSTEMS)
    assert [s.key for s in selected(" ")] == list(SYSTEMS)


def test_a_subset_runs_in_the_bench_order_once_each() -> None:
    assert [s.key for s in selected("nixl-tp2, kvferry-tp2,kvferry-tp1,nixl-tp2")] == \
        ["kvferry-tp1", "kvferry-tp2", "nixl-tp2"]


def test_an_unknown_system_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="unknown system\\(s\\) kvferry-tp3.*known: colocated"):
        selected("kvferry,kvferry-tp3")


def test_tp2_systems_run_p_at_tp2_on_the_dummy_model_and_d_at_tp1() -> None:
    tp2 = SYSTEMS["nixl-tp2"]
    assert tp2.p_args() == [*TP2_ARGS, "--load-format", "dummy"]
    assert tp2.d_args() == ["--load-format", "dummy"]
    assert tp2.p_env() == {"VLLM_CPU_OMP_THREADS_BIND": "1|1"}
    assert "P TP 2 → D TP 1" in tp2.title() and "NixlConnector" in tp2.title()
    assert SYSTEMS["kvferry-tp1"].p_args() == ["--load-format", "dummy"] and SYSTEMS["kvferry-tp1"].p_env() == {}
    assert SYSTEMS["kvferry"].p_args() == [] and SYSTEMS["kvferry"].d_args() == []
    colocated = SYSTEMS["colocated-tp2"]  # vLLM's own TP 2 on the same model and binding: the P/D ratio's yardstick
    assert colocated.connector is None and colocated.p_args() == tp2.p_args() and colocated.p_env() == tp2.p_env()
    assert colocated.title().startswith("colocated vllm serve, TP 2") and SYSTEMS["colocated"].title() == "colocated vllm serve"


def test_the_tp_model_has_heads_tp2_splits_and_keeps_head_dim(tmp_path: Path) -> None:
    smollm2 = {"hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3, "num_hidden_layers": 30}
    config = tp_config(smollm2)
    assert (config["num_attention_heads"] % 2, config["num_key_value_heads"] % 2, config["head_dim"]) == (0, 0, 64)
    source = tmp_path / "src"
    source.mkdir()
    (source / "config.json").write_text(json.dumps(smollm2))
    (source / "tokenizer.json").write_text("{}")
    (source / "model.safetensors").write_bytes(b"weights")
    target = Path(write_tp_model(str(source), str(tmp_path / "tp")))
    assert sorted(f.name for f in target.iterdir()) == ["config.json", "tokenizer.json"]
    assert json.loads((target / "config.json").read_text()) == config


def _attention(w: dict[str, np.ndarray], x: np.ndarray, nq: int, nkv: int, hd: int) -> np.ndarray:
    """One causal GQA attention layer (no rope: it acts on each head alike) as Llama computes it."""
    t = x.shape[0]
    q = (x @ w["q_proj.weight"].T).reshape(t, nq, hd)
    k = (x @ w["k_proj.weight"].T).reshape(t, nkv, hd)
    v = (x @ w["v_proj.weight"].T).reshape(t, nkv, hd)
    heads = []
    for h in range(nq):
        kv = h // (nq // nkv)
        scores = q[:, h] @ k[:, kv].T / np.sqrt(hd) + np.triu(np.full((t, t), -np.inf), 1)
        p = np.exp(scores - scores.max(axis=1, keepdims=True))
        heads.append((p / p.sum(axis=1, keepdims=True)) @ v[:, kv])
    return np.concatenate(heads, axis=1) @ w["o_proj.weight"].T


def test_the_doubled_heads_model_computes_the_same_attention_with_heads_tp2_splits(tmp_path: Path) -> None:
    from safetensors.numpy import load_file, save_file

    nq, nkv, hd, hidden = 9, 3, 4, 12
    rng = np.random.default_rng(0)
    shapes = {"q_proj.weight": (nq * hd, hidden), "k_proj.weight": (nkv * hd, hidden),
              "v_proj.weight": (nkv * hd, hidden), "o_proj.weight": (hidden, nq * hd)}
    weights = {f"model.layers.0.self_attn.{k}": rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    weights["model.embed_tokens.weight"] = rng.standard_normal((7, hidden)).astype(np.float32)
    source = tmp_path / "src"
    source.mkdir()
    config = {"hidden_size": hidden, "num_attention_heads": nq, "num_key_value_heads": nkv, "head_dim": hd}
    (source / "config.json").write_text(json.dumps(config))
    (source / "tokenizer.json").write_text("{}")
    save_file(weights, str(source / "model.safetensors"))
    target = Path(write_doubled_heads(str(source), str(tmp_path / "x2")))
    doubled = json.loads((target / "config.json").read_text())
    assert (doubled["num_attention_heads"], doubled["num_key_value_heads"], doubled["head_dim"]) == (18, 6, hd)
    assert (target / "tokenizer.json").read_text() == "{}"
    got = load_file(str(target / "model.safetensors"))
    np.testing.assert_array_equal(got["model.embed_tokens.weight"], weights["model.embed_tokens.weight"])
    prefix = "model.layers.0.self_attn."

    def layer(w: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {k.removeprefix(prefix): v for k, v in w.items() if k.startswith(prefix)}

    x = rng.standard_normal((5, hidden)).astype(np.float32)
    want = _attention(layer(weights), x, nq, nkv, hd)
    np.testing.assert_allclose(_attention(layer(got), x, 18, 6, hd), want, rtol=1e-5, atol=1e-5)
    # TP 2 splits it: each rank's 9 query heads attend only to its own 3 KV heads.
    assert doubled["num_attention_heads"] // 2 // (doubled["num_key_value_heads"] // 2) == nq // nkv


def test_the_ratio_is_tp2_over_tp1_of_the_same_connector_only_when_both_ran() -> None:
    rows = {"kvferry-tp1": {"TTFT p50 s": 0.5}, "kvferry-tp2": {"TTFT p50 s": 0.6},
            "nixl-tp2": {"TTFT p50 s": 1.0}, "nixl-tp1": {"error": "x"},
            "colocated-tp1": {"TTFT p50 s": 0.4}, "colocated-tp2": {"TTFT p50 s": 0.5}}
    with_ratios(rows)
    assert rows["kvferry-tp2"]["TTFT p50 / TP 1→1"] == pytest.approx(1.2)
    assert rows["colocated-tp2"]["TTFT p50 / TP 1→1"] == pytest.approx(1.25)
    assert "TTFT p50 / TP 1→1" not in rows["nixl-tp2"]


def test_a_failed_row_names_ds_first_load_failure() -> None:
    log = ("INFO start\nERROR Failing 1 request(s) due to KV load failure (failure_policy=fail)\n"
           "(EngineCore pid=1) WARNING kvferry_kv_load_failed {\"cause\": \"expired\"}\n"
           "kvferry_kv_load_failed {\"cause\": \"peer_dead\"}\n")
    assert d_failure(log) == '; D: {"cause": "expired"}'
    assert d_failure("ERROR Failing 1 request(s) due to KV load failure (x)\n") == "; D: (x)"
    assert d_failure("INFO nothing failed\n") == ""
