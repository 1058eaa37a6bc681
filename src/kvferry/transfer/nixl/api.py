"""Loading NIXL (optional dependency) and making agents, without importing torch.

`import nixl` (the meta package) picks the backend wheel by the CUDA version of whatever stack is
loaded; with a CPU build of torch installed and nothing imported yet it imports torch (~1.5 s, some
hundreds of MB) only to learn that there is no CUDA. The backend wheels themselves (`nixl_cu12`,
`nixl_cu13`, ...) need only numpy, so one is imported directly, unless the meta package is there and
has something to decide (torch is loaded, or several backends are installed).

NIXL's Python logger writes to stdout; it is moved to stderr here (stdout belongs to the program:
`kvferry.harness.peer` speaks JSON lines on it) and kept at WARNING unless NIXL_LOG_LEVEL says."""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import sys
from collections.abc import Callable
from typing import Any

_BACKENDS = ("nixl_cu13", "nixl_cu12", "nixl_rocm")
# The UCX progress thread's poll() timeout (µs, rounded up to ms). It wakes at once on UCX's events;
# the timeout only bounds how late it notices what raises none.
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
    kvferry's own grant tokens and notifications) and thread-safe calls.

    The progress thread sleeps in poll() on UCX's event fd for at most PROGRESS_DELAY_US between
    rounds. nixl_agent hardcodes a delay of 0, and then the thread polls with a zero timeout: it spins,
    about 60 % of a core on an idle agent and more while a read waits on a frozen peer. So the agent
    is built without backends, its C++ agent replaced by one made from a full config, and the UCX
    backend (which starts the thread) created on that.

    On a loopback host (unless the environment says otherwise) UCX is kept on `lo`
    (UCX_NET_DEVICES: by default its TCP transport listens on every interface) and its InfiniBand
    modules are not loaded (UCX_MODULES=^ib*): nothing on one host needs them, and where Debian's
    libibverbs1 is installed too, two copies of libnl-route end up in the process and it crashes at
    exit (SIGSEGV in rtnl_tc_unregister)."""
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
    """Call a NIXL method; None, or what it raised as text (`nixlRemoteDisconnectError(...)`: the
    peer's connection broke). NIXL's errors derive from Exception directly. Only text leaves: a kept
    exception's traceback holds the agent's frames, and so the agent, its threads and sockets, alive."""
    try:
        fn(*args)
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}({e})"
    return None
