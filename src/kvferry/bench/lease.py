"""`kvferry bench lease`: how long P holds a prefill's blocks after the D pulling them dies or hangs.

For each repetition P prefills a request and D pulls it while P sits on the write (`slow` fault, a
write that D's lease can cancel like a real one); then D gets `kill -9` or SIGSTOP (at a random phase of
its heartbeats), and we time until P's block pool is whole again (`/debug/state`: blocks_free ==
blocks_total). D stops heartbeating, so
its lease (7 × 0.25 s) runs out, P cancels the writes to it and frees the blocks; the abort timeout
(30 s here) no longer matters. D is restarted after each repetition.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import threading
import time
import uuid
from typing import Any

import httpx

from kvferry.bench.failover import _state, _wait, writing
from kvferry.bench.report import report
from kvferry.harness.client import percentile
from kvferry.harness.processes import ManagedProcess, free_port, wait_all_healthy

LOOPBACK = "127.0.0.1"
PROMPT = list(range(200))
ABORT_TIMEOUT_S = 30.0


def p_blocks_free(p_url: str) -> bool:
    state = _state(p_url)
    return bool(state) and state.get("blocks_free") == state.get("blocks_total")


class _Rig:
    def __init__(self) -> None:
        self.rng = random.Random(0)
        self.p_port, self.d_port = free_port(), free_port()
        common = ["--host", LOOPBACK, "--seed", "0", "--num-blocks", "256", "--abort-timeout", str(ABORT_TIMEOUT_S)]
        p_args = ["serve", "--role", "prefill", "--port", str(self.p_port), "--bootstrap-port", str(free_port()),
                  "--faults", "slow=600000", *common]
        self.d_args = ["serve", "--role", "decode", "--port", str(self.d_port), "--kv-load-failure-policy", "fail", *common]
        self.prefill = ManagedProcess("prefill", p_args, f"http://{LOOPBACK}:{self.p_port}")
        self.decode = ManagedProcess("decode", self.d_args, f"http://{LOOPBACK}:{self.d_port}")
        wait_all_healthy([self.prefill, self.decode], 60)

    def one(self, sig: signal.Signals) -> float:
        body = {"prompt": PROMPT, "max_tokens": 1, "temperature": 0, "ignore_eos": True,
                "kv_transfer_params": {"do_remote_decode": True, "transfer_id": f"xfer-{uuid.uuid4()}"}}
        prefill = httpx.post(f"{self.prefill.url}/v1/completions", json=body, timeout=60)
        prefill.raise_for_status()
        d_body = {**body, "max_tokens": 2, "kv_transfer_params": prefill.json()["kv_transfer_params"]}

        def send() -> None:
            # D is killed or frozen under this request: its answer is not what we time.
            with contextlib.suppress(httpx.HTTPError):
                httpx.post(f"{self.decode.url}/v1/completions", json=d_body, timeout=120)

        threading.Thread(target=send, daemon=True).start()
        _wait(lambda: writing(self.prefill.url, self.decode.url), 30, "P writing the pull")
        assert not p_blocks_free(self.prefill.url)
        # At any phase of D's heartbeats (every 0.25 s): the worst case is a fault just after one.
        time.sleep(self.rng.uniform(0.0, 0.5))
        assert not p_blocks_free(self.prefill.url)
        signalled = time.monotonic()
        os.kill(self.decode.pid, sig)
        _wait(lambda: p_blocks_free(self.prefill.url), ABORT_TIMEOUT_S, "P freeing the blocks")
        elapsed = time.monotonic() - signalled
        if sig == signal.SIGSTOP:
            os.kill(self.decode.pid, signal.SIGCONT)
        self.decode.stop()
        self.decode = ManagedProcess("decode", self.d_args, self.decode.url)
        wait_all_healthy([self.decode], 60)
        return elapsed

    def stop(self) -> None:
        for proc in (self.decode, self.prefill):
            proc.stop()


def run(json_path: str | None = None, quick: bool = False) -> list[dict[str, Any]]:
    reps = 2 if quick else 5
    rows = []
    rig = _Rig()
    try:
        for name, sig in (("kill -9", signal.SIGKILL), ("SIGSTOP", signal.SIGSTOP)):
            times = [rig.one(sig) for _ in range(reps)]
            rows.append({"D fault": name, "reps": reps, "p50_s": percentile(times, 50),
                         "max_s": max(times), "abort_timeout_s": ABORT_TIMEOUT_S})
    finally:
        rig.stop()
    report("kvferry bench lease: D dies or hangs mid-pull → P's blocks free", rows, json_path)
    return rows
