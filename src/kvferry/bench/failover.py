"""`kvferry bench failover`: how long a decode request waits on a prefill instance that died or hung.

For each repetition P prefills a request, D pulls it while P sits on the write (`slow` fault), then P
gets `kill -9` or SIGSTOP; we time until the client holds D's answer (HTTP 500, cause peer_dead), which
is when the request left WAITING_FOR_REMOTE_KVS (plus a loopback round trip). P is then restarted at the
same address, which must work at once. Side by side: kvferry's defaults (heartbeats + connection events)
and liveness off, where only the receive timeout (abort timeout + 5 s; vLLM's Mooncake defaults are
480 + 60 s) frees the request.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid
from typing import Any

import httpx

from kvferry.bench.report import report
from kvferry.harness.client import percentile
from kvferry.harness.processes import ManagedProcess, free_port, wait_all_healthy

LOOPBACK = "127.0.0.1"
PROMPT = list(range(200))


def _wait(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.01)


def _state(url: str) -> dict[str, Any]:
    try:
        return dict(httpx.get(f"{url}/debug/state", timeout=5).json())
    except httpx.HTTPError:
        return {}


def writing(p_url: str, d_url: str) -> bool:
    """P is inside its (slowed) write for the pull; D waits for the blocks."""
    d_waiting = _state(d_url).get("requests_by_status", {}).get("WAITING_FOR_REMOTE_KVS")
    return bool(d_waiting) and bool(_state(p_url).get("connector", {}).get("writes_in_flight"))


class _Rig:
    def __init__(self, liveness: bool, abort_timeout: float) -> None:
        self.p_port, self.d_port = free_port(), free_port()
        common = ["--host", LOOPBACK, "--seed", "0", "--num-blocks", "256", "--abort-timeout", str(abort_timeout)]
        self.p_args = ["serve", "--role", "prefill", "--port", str(self.p_port), "--bootstrap-port", str(free_port()),
                       "--faults", "slow=600000", *common]
        d_args = ["serve", "--role", "decode", "--port", str(self.d_port), "--kv-load-failure-policy", "fail", *common]
        if not liveness:
            d_args += ["--heartbeat-timeout", "0"]
        self.prefill = ManagedProcess("prefill", self.p_args, f"http://{LOOPBACK}:{self.p_port}")
        self.decode = ManagedProcess("decode", d_args, f"http://{LOOPBACK}:{self.d_port}")
        wait_all_healthy([self.prefill, self.decode], 60)

    def one(self, sig: signal.Signals) -> float:
        # The prefill first (as the proxy's sequential mode does), so P's HTTP answer is out before P dies.
        body = {"prompt": PROMPT, "max_tokens": 1, "temperature": 0, "ignore_eos": True,
                "kv_transfer_params": {"do_remote_decode": True, "transfer_id": f"xfer-{uuid.uuid4()}"}}
        prefill = httpx.post(f"{self.prefill.url}/v1/completions", json=body, timeout=60)
        prefill.raise_for_status()
        result: list[httpx.Response] = []
        d_body = {**body, "max_tokens": 2, "kv_transfer_params": prefill.json()["kv_transfer_params"]}

        def send() -> None:
            result.append(httpx.post(f"{self.decode.url}/v1/completions", json=d_body, timeout=120))

        thread = threading.Thread(target=send, daemon=True)
        thread.start()
        _wait(lambda: writing(self.prefill.url, self.decode.url), 30, "P writing the pull")
        killed_at = time.monotonic()
        os.kill(self.prefill.pid, sig)
        thread.join(timeout=120)
        elapsed = time.monotonic() - killed_at
        if not result or result[0].status_code != 500:
            raise RuntimeError(f"expected an HTTP 500 from D, got {result and result[0].text}")
        self.prefill.stop()
        self.prefill = ManagedProcess("prefill", self.p_args, self.prefill.url)  # same address, fresh process
        wait_all_healthy([self.prefill], 60)
        return elapsed

    def stop(self) -> None:
        for proc in (self.decode, self.prefill):
            proc.stop()


def run(json_path: str | None = None, quick: bool = False) -> list[dict[str, Any]]:
    reps_on = 3 if quick else 10
    reps_off = 1 if quick else 3
    abort_timeout = 3.0
    rows = []
    for liveness, reps in ((True, reps_on), (False, reps_off)):
        rig = _Rig(liveness, abort_timeout)
        try:
            for name, sig in (("kill -9", signal.SIGKILL), ("SIGSTOP", signal.SIGSTOP)):
                times = [rig.one(sig) for _ in range(reps)]
                rows.append({
                    "liveness": "heartbeats+events" if liveness else f"off (recv timeout {abort_timeout + 5:.0f}s)",
                    "fault": name,
                    "reps": reps,
                    "p50_s": percentile(times, 50),
                    "p99_s": percentile(times, 99),
                    "max_s": max(times),
                })
        finally:
            rig.stop()
    report("kvferry bench failover: P dies or hangs → D request released", rows, json_path)
    return rows
