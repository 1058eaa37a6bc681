"""Loading NIXL (optional dependency) and making agents, without importing torch.

`import nixl` (the meta package) may import torch only to learn there is no CUDA; the backend wheels
(`nixl_cu12`, ...) need only numpy, so one is imported directly unless the meta package has something to
decide. NIXL's logger is moved to stderr (stdout belongs to the program) and kept at WARNING unless
NIXL_LOG_LEVEL says."""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import sys
from collections.abc import Callable
from typing import Any

_BACKENDS = ("nixl_cu13", "nixl_cu12", "nixl_rocm")
# The UCX progress thread's poll() timeout (µs): it bounds how late it notices what raises no event.
PROGRESS_DELAY_US = 1000
LISTEN_DELAY_US = 100_000  # nixl_agent's own value (there is no listener thread here)
INSTALL_HINT = "pip install 'kvferry[nixl]' (or nixl-cu12 and nixl --no-deps)"


def _import_api() -> Any:
    installed = [m for m in _BACKENDS if importlib.util.find_spec(m) is not None]
    meta = importlib.util.find_spec("nixl") is not None
    if installed and not (meta and ("torch" in sys.modules or len(installed) > 1)):
        return importlib.import_module(f"{installed[0]}._api")
    return importlib.import_module("nixl._api")  # the meta package matches torch's CUDA version


def _quiet_logger() -> None:
    logger = logging.getLogger("nixl")
    for handler in logger.handlers:
        if isinstance(handler, logging.StreamHandler) and handler.stream is sys.stdout:
            handler.setStream(sys.stderr)
    if not os.environ.get("NIXL_LOG_LEVEL"):
        logger.setLevel(logging.WARNING)


try:
    _api: Any = _import_api()
    _bind: Any = sys.modules[_api.__name__.rsplit(".", 1)[0] + "._bindings"]
    _quiet_logger()
    IMPORT_ERROR = ""
except ImportError as exc:  # not installed, or its libraries cannot load
    _api = _bind = None
    IMPORT_ERROR = str(exc)


def available() -> bool:
    return _api is not None


def new_agent(name: str, loopback: bool) -> Any:
    """One agent with the UCX backend, its progress thread, no listener thread (metadata travels in
    kvferry's own tokens) and thread-safe calls. nixl_agent hardcodes a progress delay of 0, which
    spins a core, so its C++ agent is replaced by one made from a full config (PROGRESS_DELAY_US) before
    the UCX backend starts the thread. On loopback UCX is kept on `lo` (its TCP transport otherwise
    listens on every interface) without InfiniBand modules (a second libnl-route crashes at exit)."""
    if _api is None:
        raise ImportError(f"nixl is not installed ({INSTALL_HINT}): {IMPORT_ERROR}")
    if loopback:
        os.environ.setdefault("UCX_NET_DEVICES", "lo")
        os.environ.setdefault("UCX_MODULES", "^ib*")
    strict = _api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT
    agent = _api.nixl_agent(name, _api.nixl_agent_config(enable_prog_thread=True, enable_listen_thread=False,
                                                         backends=[], sync_mode=strict))
    config = _bind.nixlAgentConfig()
    config.useProgThread = True
    config.useListenThread = False
    config.syncMode = strict.value
    config.pthrDelay = PROGRESS_DELAY_US
    config.lthrDelay = LISTEN_DELAY_US
    agent.agent = _bind.nixlAgent(name, config)
    agent.create_backend("UCX", {})
    if "UCX" not in agent.backends:
        raise RuntimeError("NIXL could not create its UCX backend")
    return agent


def empty_reg_list(mem: str) -> Any:
    """An empty registration list: partial metadata with connection info only."""
    return _bind.nixlRegDList(_bind.DRAM_SEG if mem == "DRAM" else _bind.VRAM_SEG)


def call(fn: Callable[..., Any], *args: Any) -> str | None:
    """Call a NIXL method; None, or what it raised as text. Only text leaves: a kept exception's
    traceback would keep the agent, its threads and sockets, alive."""
    try:
        fn(*args)
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}({e})"
    return None
