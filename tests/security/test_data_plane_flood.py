"""Issue 31, attack 2, against real processes with the secret set: 64 half-open data-plane connections
from 127.0.0.1 (P's own address) plus 4 x 64 from 127.0.0.2-5, each reopened the moment D drops it.
Before, strangers and P shared one cap and 12/12 requests failed "handshake failed"; now strangers
churn a pending budget of their own and P's handshakes, once proven, hold slots no stranger reaches."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import httpx
import numpy as np
import pytest

from kvferry.harness.processes import HARNESS_SECRET
from kvferry.harness.stranger import HalfOpenFlood
from kvferry.transfer import secret as secret_rules
from kvferry.transfer.tcp.handshake import client_handshake
from procs import Proc, pd_system

ATTACK = {"127.0.0.1": 64, "127.0.0.2": 64, "127.0.0.3": 64, "127.0.0.4": 64, "127.0.0.5": 64}
PROMPT = "A legitimate request, served while strangers hold half-open connections to D. " * 2
pytestmark = pytest.mark.timeout(360)  # 120 requests one after another: minutes on a box at load 30+


@pytest.fixture(scope="module")
def system() -> Iterator[tuple[Proc, Proc, Proc]]:
    with pd_system() as procs:
        yield procs


def _request(p: Proc, d: Proc, i: int) -> tuple[bool, float]:
    t0 = time.monotonic()
    r = httpx.post(f"{p.url}/v1/completions", timeout=30, json={
        "prompt": f"{i}: {PROMPT}", "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True,
                                                                            "transfer_id": f"flood-{i}"}})
    if r.status_code != 200:
        return False, time.monotonic() - t0
    r = httpx.post(f"{d.url}/v1/completions", timeout=30, json={
        "prompt": f"{i}: {PROMPT}", "max_tokens": 2, "temperature": 0, "kv_transfer_params": r.json()["kv_transfer_params"]})
    return r.status_code == 200, time.monotonic() - t0


def _handshake(host: str, port: int, key: bytes) -> bool:
    try:
        with socket.create_connection((host, port), timeout=5) as sock:
            return client_handshake(sock, f"{host}:{port}", key, time.monotonic() + 5) is not None
    except Exception:  # noqa: BLE001 - any failure (reset, EOF, refused) is a failed handshake
        return False


def test_half_open_flood_on_d_data_port(system: tuple[Proc, Proc, Proc]) -> None:
    p, d, _ = system
    addr = httpx.get(f"{d.url}/debug/state", timeout=5).json()["connector"]["transfer_addrs"][0]
    host, port = addr.rsplit(":", 1)
    key = secret_rules.check_secret(HARNESS_SECRET)
    # The flood comes first: P has no pooled connection to D yet, so its first one is made under it.
    results, shakes = [], []
    with HalfOpenFlood(host, int(port), ATTACK) as flood:
        deadline = time.monotonic() + 30
        while flood.dropped < 320 and time.monotonic() < deadline:
            time.sleep(0.05)
        for i in range(100):
            results.append(_request(p, d, i))
            shakes.append(_handshake(host, int(port), key))  # a peer's fresh handshake, as P's next one
        opened, dropped = flood.opened, flood.dropped
    quiet = [_request(p, d, -k - 1)[1] for k in range(20)]
    ok = sum(r[0] for r in results)
    lat = [r[1] for r in results]
    print(f"\nflood on D's data port: requests {ok}/{len(results)} ok, fresh handshakes {sum(shakes)}/{len(shakes)} ok; "
          f"request p50/p99 {np.percentile(lat, 50) * 1e3:.0f}/{np.percentile(lat, 99) * 1e3:.0f} ms vs quiet "
          f"{np.percentile(quiet, 50) * 1e3:.0f}/{np.percentile(quiet, 99) * 1e3:.0f} ms; "
          f"stranger connections opened {opened}, dropped by D {dropped}")
    assert ok >= 99 and sum(shakes) >= 99, (ok, sum(shakes))
