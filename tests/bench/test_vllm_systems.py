"""The pure parts of `kvferry bench vllm`'s system choice (bench/vllm/systems.py): which systems
KVFERRY_BENCH_SYSTEMS selects, how the TP rows run, the TP model and the same-run TTFT ratio."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvferry.bench.vllm.systems import (
    SYSTEMS,
    TP2_ARGS,
    d_failure,
    selected,
    tp_config,
    with_ratios,
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


def test_the_ratio_is_tp2_over_tp1_of_the_same_connector_only_when_both_ran() -> None:
    rows = {"kvferry-tp1": {"TTFT p50 s": 0.5}, "kvferry-tp2": {"TTFT p50 s": 0.6},
            "nixl-tp2": {"TTFT p50 s": 1.0}, "nixl-tp1": {"error": "x"}}
    with_ratios(rows)
    assert rows["kvferry-tp2"]["TTFT p50 / TP 1→1"] == pytest.approx(1.2)
    assert "TTFT p50 / TP 1→1" not in rows["nixl-tp2"]


def test_a_failed_row_names_ds_first_load_failure() -> None:
    log = ("INFO start\nERROR Failing 1 request(s) due to KV load failure (failure_policy=fail)\n"
           "(EngineCore pid=1) WARNING kvferry_kv_load_failed {\"cause\": \"expired\"}\n"
           "kvferry_kv_load_failed {\"cause\": \"peer_dead\"}\n")
    assert d_failure(log) == '; D: {"cause": "expired"}'
    assert d_failure("ERROR Failing 1 request(s) due to KV load failure (x)\n") == "; D: (x)"
    assert d_failure("INFO nothing failed\n") == ""
