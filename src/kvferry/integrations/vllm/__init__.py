"""kvferry as a vLLM KV connector: vLLM loads `KVFerryConnector` from here
(`"kv_connector_module_path": "kvferry.integrations.vllm"`, docs/vllm.md).

    connector.py   `KVFerryConnector`, the facade: each call goes to the half that owns it
    scheduler.py   the scheduler half, in vLLM's engine core
    worker.py      the worker half, in the model runner's process
    settings.py    `kv_connector_extra_config`, checked once, and each role's `PDConfig`
    metadata.py    what the halves send each other through vLLM
    layout.py      vLLM's per-layer KV tensors as a kvferry `KVLayout`
    groups.py      vLLM's KV cache groups (hybrid allocator)
    progress.py    progressive push inside vLLM (P)
    quarantine.py  D on NIXL: blocks under a read that outlived its failure
    metrics.py     kvferry's failure counters in vLLM's `/metrics`
    affinity.py    where the connector's threads run

Only this package imports vLLM; `import kvferry` never does. Its vLLM-free modules (settings, layout,
groups, affinity) import without vLLM, so the facade is imported here only when vLLM is installed;
without it, asking for `KVFerryConnector` raises the ImportError that says how to install vLLM."""

from __future__ import annotations

import importlib.util
from typing import Any


def _vllm_installed() -> bool:
    """Whether the real vLLM is importable (imports here are absolute: `vllm` is vLLM). A folder named
    `vllm` without an `__init__.py` on the path (tests/vllm, say) is a namespace package, no origin."""
    spec = importlib.util.find_spec("vllm")
    return spec is not None and spec.origin is not None


if _vllm_installed():
    from kvferry.integrations.vllm.connector import KVFerryConnector
else:

    def __getattr__(name: str) -> Any:
        if name == "KVFerryConnector":
            import kvferry.integrations.vllm.connector  # noqa: F401  (raises: vLLM is not installed)
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["KVFerryConnector"]
