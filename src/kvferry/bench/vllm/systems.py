"""Which systems `kvferry bench vllm` measures (`KVFERRY_BENCH_SYSTEMS`, e.g. `kvferry-tp1,nixl-tp2`) and
how the tensor-parallel ones run.

vLLM refuses SmolLM2 (9 heads, 3 KV heads) at TP 2, so the TP systems serve its shape with 8/2 heads and
dummy weights; `-tp1` is the same-run baseline of `-tp2`. A TP 2 P's two workers share CPU 1: each
busy-waits after every step, and workers pinned to every core starve D, P's API server and the router."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TP_HEADS, TP_KV_HEADS = 8, 2
TP2_ARGS = ("--tensor-parallel-size", "2", "--distributed-executor-backend", "mp")
TP2_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "1|1"}
CONNECTOR_NAMES = {"kvferry": "KVFerryConnector", "nixl": "vLLM's NixlConnector", "mooncake": "vLLM's MooncakeConnector"}


@dataclass(frozen=True)
class System:
    key: str
    connector: str | None  # None: one colocated `vllm serve`
    p_tp: int = 1
    tp_model: bool = False  # the 8/2-head SmolLM2 shape with dummy weights (TP 2 can split it)

    def title(self) -> str:
        model = f"; SmolLM2 shape {TP_HEADS}/{TP_KV_HEADS} heads, dummy weights" if self.tp_model else ""
        if self.connector is None:
            return f"colocated vllm serve, TP {self.p_tp}{model}" if self.tp_model else "colocated vllm serve"
        mode = "Mooncake" if self.connector == "mooncake" else "NIXL"
        shape = f"P TP {self.p_tp} → D TP 1, " if self.tp_model else ""
        return f"P/D, {shape}{CONNECTOR_NAMES[self.connector]} (router: {mode} mode{model})"

    def p_args(self) -> list[str]:  # D's are those of a TP 1 P
        return [*(TP2_ARGS if self.p_tp == 2 else ()), *self.d_args()]

    def d_args(self) -> list[str]:
        return ["--load-format", "dummy"] if self.tp_model else []

    def p_env(self) -> dict[str, str]:
        return dict(TP2_ENV) if self.p_tp == 2 else {}


SYSTEMS: dict[str, System] = {s.key: s for s in (
    System("colocated", None), System("kvferry", "kvferry"), System("nixl", "nixl"), System("mooncake", "mooncake"),
    System("kvferry-tp1", "kvferry", 1, True), System("kvferry-tp2", "kvferry", 2, True),
    System("nixl-tp1", "nixl", 1, True), System("nixl-tp2", "nixl", 2, True),
    # vLLM's own cost of TP 2 on this box (no P/D): what the P/D ratios are to be read against.
    System("colocated-tp1", None, 1, True), System("colocated-tp2", None, 2, True),
)}


def selected(value: str | None) -> list[System]:
    """The systems `value` names (comma-separated), in the bench's order; unset or empty: all."""
    if value is None or not value.strip():
        return list(SYSTEMS.values())
    names = {n.strip() for n in value.split(",") if n.strip()}
    unknown = sorted(names - set(SYSTEMS))
    if unknown:
        raise ValueError(f"KVFERRY_BENCH_SYSTEMS: unknown system(s) {', '.join(unknown)}; "
                         f"known: {', '.join(SYSTEMS)}")
    return [s for key, s in SYSTEMS.items() if key in names]


def tp_config(config: dict[str, Any]) -> dict[str, Any]:
    """SmolLM2's config with heads TP 2 can split; head_dim kept (vLLM's CPU attention supports 64, not 72)."""
    head_dim = int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])
    return {**config, "num_attention_heads": TP_HEADS, "num_key_value_heads": TP_KV_HEADS, "head_dim": head_dim}


def _model_dir(source: str, target: str, config: dict[str, Any]) -> Path:
    """`target` holding `source`'s files but its weights, and `config`."""
    out = Path(target)
    out.mkdir(parents=True)
    for f in Path(source).iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copy(f, out / f.name)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def write_tp_model(source: str, target: str) -> str:
    """`source`'s tokenizer and `tp_config` in `target`, no weights (the TP systems load dummy ones)."""
    return str(_model_dir(source, target, tp_config(json.loads((Path(source) / "config.json").read_text()))))


def write_doubled_heads(source: str, target: str) -> str:
    """`source` with every KV head and query group twice (18 on 6: TP 2 can split it), each o_proj column of a
    pair halved: the same function with real weights, so `--faults` at P TP 2 still compares answers."""
    import numpy as np
    from safetensors.numpy import load_file, save_file

    config = json.loads((Path(source) / "config.json").read_text())
    hd, nq, nkv = int(config["head_dim"]), int(config["num_attention_heads"]), int(config["num_key_value_heads"])
    group = nq // nkv
    # New KV head k is old head k // 2; its query group is the old group of k // 2, so GQA pairs stay pairs.
    order = [h for k in range(2 * nkv) for h in range(k // 2 * group, (k // 2 + 1) * group)]
    weights = {}
    for name, w in load_file(str(Path(source) / "model.safetensors")).items():
        if name.endswith("q_proj.weight"):
            w = w.reshape(nq, hd, -1)[order].reshape(2 * nq * hd, -1)
        elif name.endswith(("k_proj.weight", "v_proj.weight")):
            w = np.repeat(w.reshape(nkv, hd, -1), 2, axis=0).reshape(2 * nkv * hd, -1)
        elif name.endswith("o_proj.weight"):  # each head's output now arrives twice
            w = (w.reshape(w.shape[0], nq, hd)[:, order] * 0.5).reshape(w.shape[0], -1)
        weights[name] = np.ascontiguousarray(w)
    doubled = {**config, "num_attention_heads": 2 * nq, "num_key_value_heads": 2 * nkv}
    out = _model_dir(source, target, doubled)
    save_file(weights, str(out / "model.safetensors"))
    return str(out)


def with_ratios(rows: dict[str, dict[str, Any]]) -> None:
    """On each `<system>-tp2` row, its TTFT p50 over the same system's `-tp1` row (same run)."""
    for connector in ("kvferry", "nixl", "colocated"):
        tp1, tp2 = rows.get(f"{connector}-tp1"), rows.get(f"{connector}-tp2")
        if tp1 is None or tp2 is None:
            continue
        a, b = tp1.get("TTFT p50 s"), tp2.get("TTFT p50 s")
        if isinstance(a, float) and isinstance(b, float) and a > 0:
            tp2["TTFT p50 / TP 1→1"] = b / a


def d_failure(log: str) -> str:
    """D's first KV load failure in its log (kvferry's line, else vLLM's), so a failed row says why."""
    lines = log.splitlines()
    for marker in ("kvferry_kv_load_failed", "KV load failure"):
        for line in lines:
            if marker in line:
                return "; D: " + line.split(marker, 1)[-1].strip()[:300]
    return ""
