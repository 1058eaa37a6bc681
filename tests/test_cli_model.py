"""The CLI's surface: --version, a help text and default for every flag, `model export`; and the
per-request Prometheus histograms (no `_created` series)."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

import numpy as np

from kvferry import __version__
from kvferry.cli import build_parser, main
from kvferry.engine.engine import Engine, EngineConfig
from kvferry.engine.loader import load_model
from kvferry.engine.request import Request, SamplingParams


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    found: dict[str, argparse.ArgumentParser] = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                found[name] = child
                found.update({f"{name} {k}": v for k, v in _subcommands(child).items()})
    return found


def test_version() -> None:
    out = subprocess.run([sys.executable, "-m", "kvferry", "--version"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == f"kvferry {__version__}"


def test_every_flag_has_help_and_shows_its_default() -> None:
    commands = _subcommands(build_parser())
    assert {"serve", "proxy", "demo", "chaos", "bench", "model", "model export"} <= set(commands)
    for name, parser in commands.items():
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            assert action.help, f"kvferry {name}: {action.option_strings or action.dest} has no help"
        if name != "model":
            assert parser.formatter_class is argparse.ArgumentDefaultsHelpFormatter, name
    assert "(default: 8100)" in " ".join(commands["serve"].format_help().split())


def test_model_export_writes_a_loadable_hf_dir(tmp_path: Path) -> None:
    target = tmp_path / "smol"
    assert main(["model", "export", "smollm2", str(target)]) == 0
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (target / name).is_file()
    assert main(["model", "export", "smollm2", str(target)]) == 2  # never overwrites
    exported, original = load_model(str(target)), load_model("smollm2")
    ids = original.codec.encode("The capital of France is")
    spec = original.model.kv_cache_spec(4, 16)
    a = original.model.forward(original.model.allocate_kv_cache(spec), 16, ids, 0, [0, 1, 2, 3])
    b = exported.model.forward(exported.model.allocate_kv_cache(spec), 16, ids, 0, [0, 1, 2, 3])
    assert np.array_equal(a, b)


def test_request_histograms_and_no_created_series() -> None:
    engine = Engine(EngineConfig(num_blocks=32, block_size=16))
    outputs: list[object] = []
    for i in range(3):
        engine.submit(Request(f"r{i}", [1, 2, 3, 4, 5], SamplingParams(6, 0.0, None, (), (), True), None, 0.0), outputs.append)
    engine.run_until_idle()
    text = engine.metrics.render().decode()
    assert "_created" not in text
    counts = {m[0]: float(m[1]) for m in re.findall(r"^(kvferry_\w+)_count (\S+)$", text, re.M)}
    assert counts["kvferry_time_to_first_token_seconds"] == 3
    assert counts["kvferry_inter_token_latency_seconds"] == 3 * 5
    assert counts["kvferry_e2e_request_latency_seconds"] == 3
    assert counts["kvferry_request_prompt_tokens"] == 3
    sums = {m[0]: float(m[1]) for m in re.findall(r"^(kvferry_\w+)_sum (\S+)$", text, re.M)}
    assert sums["kvferry_request_prompt_tokens"] == 15 and sums["kvferry_request_generation_tokens"] == 18
