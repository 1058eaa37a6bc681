"""Start the production routers (vllm-router, sglang-router) for tests; always stop their process group."""

from __future__ import annotations

import contextlib
import json
import shutil
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import httpx

from kvferry.harness.processes import Supervised
from procs import Proc, free_port

MODES = ("vllm-nixl", "vllm-mooncake", "sglang")


def completion_text(r: httpx.Response, stream: bool) -> str:
    """The text of a completion answer, or of its SSE stream (which must end with [DONE])."""
    assert r.status_code == 200, r.text
    if not stream:
        return str(r.json()["choices"][0]["text"])
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]", r.text[-500:]
    return "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])


def bootstrap_port(p: Proc) -> int:
    addr = httpx.get(f"{p.url}/health", timeout=5).json()["kv_bootstrap_addr"]
    return int(addr.rsplit(":", 1)[1])


def router_command(mode: str, port: int, prefills: Sequence[Proc], decodes: Sequence[Proc],
                   extra: Sequence[str] = ()) -> list[str]:
    """The command line a user would type (docs/deploy.md shows the same)."""
    host = ["--host", "127.0.0.1", "--port", str(port), "--policy", "round_robin"]
    decode_args = [a for d in decodes for a in ("--decode", d.url)]
    if mode == "sglang":
        prefill_args = [a for p in prefills for a in ("--prefill", p.url, str(bootstrap_port(p)))]
        return ["sglang-router", "launch", *host, "--pd-disaggregation", *prefill_args, *decode_args, *extra]
    if mode == "vllm-mooncake":
        prefill_args = [a for p in prefills for a in ("--prefill", p.url, str(bootstrap_port(p)))]
        return ["vllm-router", *host, "--vllm-pd-disaggregation", "--kv-connector", "mooncake", *prefill_args,
                *decode_args, *extra]
    assert mode == "vllm-nixl", mode
    prefill_args = [a for p in prefills for a in ("--prefill", p.url)]
    return ["vllm-router", *host, "--vllm-pd-disaggregation", *prefill_args, *decode_args, *extra]


class Router(Supervised):
    """One router process in its own session, so that stop() takes every process it started."""

    def __init__(self, command: list[str], url: str) -> None:
        self.url = url
        executable = shutil.which(command[0])
        if executable is None:
            raise RuntimeError(f"{command[0]} is not installed (pip install -e '.[test]')")
        super().__init__("router", [executable, *command[1:]], own_group=True, log_prefix="kvferry-")

    def log(self) -> str:
        return self.output_tail(3000)

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Ready once it answers requests: the routers accept connections only after their workers did."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                raise RouterExited(f"router exited with {self.popen.returncode}:\n{self.log()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            time.sleep(0.1)
        raise TimeoutError(f"router not ready after {timeout}s:\n{self.log()}")


class RouterExited(RuntimeError):
    pass


@contextmanager
def router(mode: str, prefills: Sequence[Proc], decodes: Sequence[Proc],
           extra: Sequence[str] = ()) -> Iterator[Router]:
    """A ready router; started again on another port if it exits at once (the free port we picked can
    be taken by another process before the router binds it)."""
    for attempt in range(3):
        port = free_port()
        proc = Router(router_command(mode, port, prefills, decodes, extra), f"http://127.0.0.1:{port}")
        try:
            proc.wait_ready()
            break
        except RouterExited:
            proc.stop()
            if attempt == 2:
                raise
        except BaseException:
            proc.stop()
            raise
    try:
        yield proc
    finally:
        proc.stop()
