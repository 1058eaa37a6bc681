"""A P stopped (SIGSTOP) inside its write reaches the client behind `kvferry proxy` as a 500 `peer_dead`
within 5 s: D's liveness calls it (one ZMTP timeout, then the re-dial bound), and the proxy takes D's
`peer_dead` as its verdict on P instead of asking the stopped P's /health (which held the answer for its
whole 2 s timeout)."""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid

import httpx

from kvferry.bench.failover import writing
from kvferry.harness.system import PDSystem, PDSystemConfig, Role
from procs import wait_until

PROMPT = list(range(200))


def test_a_p_stopped_mid_write_gives_the_client_peer_dead_within_5s() -> None:
    config = PDSystemConfig(policy="fail", num_blocks=256, abort_timeout=30.0, kv_load_deadline=60.0,
                            prefill=Role(args=("--faults", "slow=600000")))  # P's write never ends by itself
    with PDSystem(config) as system:
        body = {"prompt": PROMPT, "max_tokens": 2, "temperature": 0, "ignore_eos": True,
                "kv_transfer_params": {"transfer_id": f"xfer-{uuid.uuid4()}"}}
        result: list[httpx.Response] = []
        client = threading.Thread(target=lambda: result.append(
            httpx.post(f"{system.proxy.url}/v1/completions", json=body, timeout=120)), daemon=True)
        client.start()
        wait_until(lambda: writing(system.prefill.url, system.decode.url), 60, "P writing D's pull")
        os.kill(system.prefill.pid, signal.SIGSTOP)
        stopped = time.monotonic()
        try:
            client.join(timeout=60)
            took = time.monotonic() - stopped
        finally:
            os.kill(system.prefill.pid, signal.SIGCONT)
        assert result, "no answer within 60 s of P's stop"
        error = result[0].json()["error"]
        assert result[0].status_code == 500 and error["code"] == "peer_dead", result[0].text
        print(f"the client got peer_dead {took:.2f}s after P stopped: {error['message']}")
        assert took <= 5.0, f"the client got its error {took:.2f}s after P stopped"
