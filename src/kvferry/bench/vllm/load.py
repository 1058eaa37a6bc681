"""`kvferry bench serve --vllm`: the same load seen by vLLM's own client (`vllm bench serve`) against
kvferry, and served by `vllm serve` after kvferry stopped (the engines never share cores). vLLM's
answers are compared for information only: its kernels compute differently."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from kvferry.bench.vllm.servers import serve_venv, vllm_server

CLIENT_TIMEOUT_S = 900.0


def vllm_venv() -> Path:
    venv = serve_venv()
    if not (venv / "bin" / "vllm").exists():
        raise SystemExit(f"kvferry bench serve --vllm: no vLLM at {venv}/bin/vllm (bash .ci/vllm-serve.sh --env-only)")
    return venv


def vllm_client_row(venv: Path, url: str, served_name: str, tokenizer: str, mode: str, concurrency: int,
                    requests: int, input_len: int, output_tokens: int, workdir: str) -> dict[str, Any]:
    """One level measured by `vllm bench serve`; its JSON result, in this bench's columns."""
    result = f"vllm-{mode}-{concurrency}.json"
    argv = [str(venv / "bin" / "vllm"), "bench", "serve", "--backend", "openai", "--base-url", url,
            "--endpoint", "/v1/completions", "--model", served_name, "--tokenizer", tokenizer,
            "--dataset-name", "random", "--random-input-len", str(input_len), "--random-output-len",
            str(output_tokens), "--num-prompts", str(requests), "--max-concurrency", str(concurrency),
            "--ignore-eos", "--temperature", "0", "--seed", "0", "--percentile-metrics", "ttft,itl",
            "--metric-percentiles", "50,99", "--disable-tqdm", "--save-result", "--result-dir", workdir,
            "--result-filename", result]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
    done = subprocess.run(argv, capture_output=True, text=True, timeout=CLIENT_TIMEOUT_S, env=env, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"vllm bench serve against {mode} failed ({done.returncode}): {done.stderr[-800:]}")
    data = json.loads((Path(workdir) / result).read_text())
    if data.get("completed") != requests:
        raise RuntimeError(f"vllm bench serve against {mode}: {data.get('completed')} of {requests} completed")
    return {"mode": f"{mode} (vLLM's client)", "concurrency": concurrency, "requests": requests,
            "output_tok_s": data["output_throughput"], "requests_s": data["request_throughput"],
            "ttft_p50_ms": data["p50_ttft_ms"], "ttft_p99_ms": data["p99_ttft_ms"],
            "itl_p50_ms": data["p50_itl_ms"], "itl_p99_ms": data["p99_itl_ms"], "bit_identical": "n/a"}


class VllmServe:
    """`vllm serve` of the exported model, configured as the vLLM lane runs it (docs/vllm.md)."""

    def __init__(self, venv: Path, model_dir: str, max_num_seqs: int) -> None:
        self.model_dir = model_dir
        vllm = venv / "bin" / "vllm"
        self.group = vllm_server("vllm-serve", vllm, model_dir, "--max-num-seqs", str(max_num_seqs))
        self.url = self.group.url

    def __enter__(self) -> VllmServe:
        try:
            self.group.wait_healthy()
        except BaseException:
            self.group.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.group.stop()


def workdir() -> tempfile.TemporaryDirectory[str]:
    return tempfile.TemporaryDirectory(prefix="kvferry-bench-serve-vllm-")
