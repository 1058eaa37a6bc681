"""`kvferry bench failover`: how long a decode request waits on a prefill instance that died (kill -9) or
hung (SIGSTOP) mid-pull, with kvferry's liveness (heartbeats + connection events) and without it, where
only the receive timeout frees the request."""

from __future__ import annotations

import contextlib
import signal
import threading
import time
import uuid
from typing import Any

import httpx

from kvferry.bench.report import report
from kvferry.harness.client import percentile
from kvferry.harness.system import PDSystem, PDSystemConfig, Role

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
    d_waiting = _state(d_url).get("requests_by_status", {}).get("WAITING_FOR_REMOTE_KVS")
    return bool(d_waiting) and bool(_state(p_url).get("connector", {}).get("writes_in_flight"))


def pair(abort_timeout: float, *d_args: str) -> PDSystem:
    return PDSystem(PDSystemConfig(policy="fail", num_blocks=256, abort_timeout=abort_timeout, proxy=False,
                                   prefill=Role(args=("--faults", "slow=600000")), decode=Role(args=d_args)))


def pull(system: PDSystem) -> tuple[threading.Thread, list[httpx.Response]]:
    """P prefills a request (first, so P's answer is out before P dies), then D is asked to decode it from a
    thread; returns once P sits on the write for D's pull, with the thread and where D's answer lands."""
    body = {"prompt": PROMPT, "max_tokens": 1, "temperature": 0, "ignore_eos": True,
            "kv_transfer_params": {"do_remote_decode": True, "transfer_id": f"xfer-{uuid.uuid4()}"}}
    prefill = httpx.post(f"{system.prefill.url}/v1/completions", json=body, timeout=60)
    prefill.raise_for_status()
    answers: list[httpx.Response] = []
    d_body = {**body, "max_tokens": 2, "kv_transfer_params": prefill.json()["kv_transfer_params"]}

    def send() -> None:
        with contextlib.suppress(httpx.HTTPError):  # a D killed under the request answers nothing
            answers.append(httpx.post(f"{system.decode.url}/v1/completions", json=d_body, timeout=120))

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    _wait(lambda: writing(system.prefill.url, system.decode.url), 30, "P writing the pull")
    return thread, answers


def one(system: PDSystem, sig: signal.Signals) -> float:
    """Seconds from `sig` to P until D answers the pull it waits on; P is then restarted at its address."""
    thread, answers = pull(system)
    killed_at = time.monotonic()
    system.prefill.signal(sig)
    thread.join(timeout=120)
    elapsed = time.monotonic() - killed_at
    if not answers or answers[0].status_code != 500:
        raise RuntimeError(f"expected an HTTP 500 from D, got {answers and answers[0].text}")
    system.restart("prefill")
    return elapsed


def run(json_path: str | None = None, quick: bool = False) -> list[dict[str, Any]]:
    reps_on, reps_off = (3, 1) if quick else (10, 3)
    abort_timeout = 3.0
    rows = []
    for liveness, reps in ((True, reps_on), (False, reps_off)):
        mode = "heartbeats+events" if liveness else f"off (recv timeout {abort_timeout + 5:.0f}s)"
        with pair(abort_timeout, *(() if liveness else ("--heartbeat-timeout", "0"))) as system:
            for name, sig in (("kill -9", signal.SIGKILL), ("SIGSTOP", signal.SIGSTOP)):
                times = [one(system, sig) for _ in range(reps)]
                rows.append({"liveness": mode, "fault": name, "reps": reps, "p50_s": percentile(times, 50),
                             "p99_s": percentile(times, 99), "max_s": max(times)})
    report("kvferry bench failover: P dies or hangs → D request released", rows, json_path)
    return rows
