"""The servers of the vllm-serve lane (one set per module; a test restarts only what it must) and the
requests the tests send."""

from __future__ import annotations

import contextlib
import random
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
from servers import VLLM_DEFAULTS, Server, kv_config, proxy_server, vllm_server

from kvferry.connector.faults import FaultSpec
from kvferry.harness.processes import free_port
from procs import wait_until as _wait_until

P_BLOCKS, D_BLOCKS = 16, 40  # different pool sizes on purpose (issue 12.1)
# How long P keeps blocks nobody pulled. At vLLM's defaults (a worker process that spin-waits after every
# step, two spinning OpenMP threads per server) five servers on 2 cores stretched D's steps so far that
# its pull came more than 20 s after P's answer (docs/vllm.md): the abort timeouts grow with them.
ABORT_TIMEOUT_S = 15.0 if VLLM_DEFAULTS else 6.0  # the restarted P of the fault tests: (b) fails within it
CLEAN_ABORT_TIMEOUT_S = 60.0 if VLLM_DEFAULTS else 20.0  # the clean P
# How long D waits on a silent P: at least the floor (what a P with no slow history gets), at most the
# ceiling however slow P was before. At vLLM's defaults a freshly restarted P left heartbeats unanswered
# for 4 s, a busy one for 8-14 s (load 17-38); a killed P is still seen at once (its connection closes).
HEARTBEAT_FLOOR_S = 10.0 if VLLM_DEFAULTS else 4.0
HEARTBEAT_CEILING_S = 30.0 if VLLM_DEFAULTS else 10.0
# D's early rejection releases P's blocks (issue 18.6) through D's engine and worker and P's next step.
RELEASE_S = 10.0 if VLLM_DEFAULTS else 1.5  # 4.1 s at vLLM's defaults at load 29-38; P's abort timeout is 60 s
FAULTS = "p_not_ready=0.5,seed=11,slow=1500"  # the restarted P: some transfers never ready, every write slow


class Cluster:
    def __init__(self, model: str) -> None:
        self.model = model
        self.p_port, self.bootstrap_port = free_port(), free_port()
        self.p_faults: str | None = None
        self.p_args: tuple[str, ...] = ()
        self.p: Server | None = None
        self.c = vllm_server("colocated", model, free_port(), "--num-gpu-blocks-override", str(P_BLOCKS))
        self.d = self._decode("decode", "fail", D_BLOCKS)
        self.d_recompute: Server | None = None
        self.proxy = proxy_server(free_port(), f"http://127.0.0.1:{self.p_port}", self.d.url)
        self.servers: list[Server] = [self.c, self.d, self.proxy]

    def _decode(self, name: str, policy: str, blocks: int, *args: str) -> Server:
        return vllm_server(name, self.model, free_port(), "--num-gpu-blocks-override", str(blocks),
                           "--kv-transfer-config", kv_config("kv_consumer", policy, kv_load_deadline_s=30,
                                                     heartbeat_interval_s=1.0, heartbeat_timeout_s=HEARTBEAT_FLOOR_S,
                                                     heartbeat_ceiling_s=HEARTBEAT_CEILING_S), *args)

    def decode_draining(self, drain_s: int) -> Server:
        """A D of its own with vLLM's drain on SIGTERM (the test ends it)."""
        d = self._decode("decode-drain", "fail", D_BLOCKS, "--shutdown-timeout", str(drain_s))
        self.servers.append(d)
        d.start().wait_healthy()
        return d

    def _new_p(self, faults: str, *args: str) -> Server:
        extra: dict[str, Any] = {"engine_id": "kvferry-ci-p", "bootstrap_port": self.bootstrap_port,
                                 "abort_timeout_s": ABORT_TIMEOUT_S if faults else CLEAN_ABORT_TIMEOUT_S,
                                 "faults": faults}
        p = vllm_server("prefill", self.model, self.p_port, "--num-gpu-blocks-override", str(P_BLOCKS),
                        "--kv-transfer-config", kv_config("kv_producer", **extra), *args)
        self.servers.append(p)
        self.p, self.p_faults, self.p_args = p, faults, args
        return p

    def start(self) -> None:
        p = self._new_p("")
        for s in (self.c, p, self.d, self.proxy):
            s.start()
        for s in (self.c, p, self.d, self.proxy):
            s.wait_healthy()

    def prefill(self, faults: str = "", *args: str) -> Server:
        """P, healthy, with this fault spec and these extra `vllm serve` arguments; restarted (same address,
        same engine id) only if needed."""
        if self.p is not None and self.p.alive() and (self.p_faults, self.p_args) == (faults, args):
            return self.p
        if self.p is not None:
            self.p.kill9()
        p = self._new_p(faults, *args).start()
        p.wait_healthy()
        return p

    def decode_recompute(self) -> Server:
        if self.d_recompute is None:
            self.d_recompute = self._decode("decode-recompute", "recompute", P_BLOCKS)
            self.servers.append(self.d_recompute)
            self.d_recompute.start()
        self.d_recompute.wait_healthy()
        return self.d_recompute

    def stop(self) -> None:
        for s in self.servers:
            with contextlib.suppress(Exception):
                s.stop()


# ---- requests -------------------------------------------------------------------------------------
def prompt_of(n_tokens: int, seed: int) -> str:
    """A prompt of exactly n tokens (the tokenizer is byte-level: one ASCII char = one token)."""
    rng = random.Random(seed)
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ,.") for _ in range(n_tokens))


def completion(url: str, model: str, prompt: str, max_tokens: int = 16, timeout: float = 120,
               **extra: Any) -> httpx.Response:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "return_token_ids": True, **extra}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=timeout)


def streamed_text(url: str, model: str, prompt: str, max_tokens: int = 16) -> str:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    text = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                import json

                text.append(json.loads(line[6:])["choices"][0]["text"])
    return "".join(text)


def tokens(r: httpx.Response) -> list[int]:
    assert r.status_code == 200, r.text
    return list(r.json()["choices"][0]["token_ids"])


def prefill_on_p(p: Server, model: str, prompt: str, transfer_id: str) -> dict[str, Any]:
    r = completion(p.url, model, prompt, max_tokens=1,
                   kv_transfer_params={"do_remote_decode": True, "transfer_id": transfer_id})
    assert r.status_code == 200, r.text
    params = r.json()["kv_transfer_params"]
    assert params and params["transfer_id"] == transfer_id, params
    return dict(params)


def transfer_id_where(fault: str | None, spec: str = FAULTS) -> str:
    faults = FaultSpec.parse(spec)
    while True:
        tid = f"xfer-{uuid.uuid4()}"
        if faults.fault_for(tid) == fault:
            return tid


def wait_until(predicate: Any, timeout: float, what: str) -> Any:
    return _wait_until(predicate, timeout, what, interval=0.05)  # the predicates read /metrics: 20 a second is plenty


def in_background(fn: Any, *args: Any, **kwargs: Any) -> Any:
    pool = ThreadPoolExecutor(1)
    future = pool.submit(fn, *args, **kwargs)
    pool.shutdown(wait=False)
    return future


__all__ = ["RELEASE_S", "Cluster", "completion", "in_background", "prefill_on_p", "prompt_of", "streamed_text",
           "tokens", "transfer_id_where", "wait_until"]
