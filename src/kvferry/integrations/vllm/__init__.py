"""kvferry as a vLLM KV connector: vLLM loads `KVFerryConnector` from here
(`"kv_connector_module_path": "kvferry.integrations.vllm"`, docs/vllm.md).

Only this package imports vLLM; its vLLM-free modules (settings, layout, groups, affinity) import without
it, so the facade is imported here only when vLLM is installed; otherwise asking for `KVFerryConnector`
raises the ImportError that says how to install it."""

from __future__ import annotations

import importlib.util
from typing import Any


def _vllm_installed() -> bool:
    """Whether the real vLLM is importable: a `vllm` folder without `__init__.py` (tests/vllm) has no origin."""
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
