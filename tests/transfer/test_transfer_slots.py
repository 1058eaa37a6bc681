"""Issue 31, attack 2: strangers' half-open connections cannot hold the slots proven peers need.

Before: one cap (256 in all, 64 per IP) was shared by strangers and peers; 64 half-open connections
from 127.0.0.1 plus 4 x 64 from 127.0.0.2-5, reopened as D dropped them, made every fresh handshake
of P fail. Now strangers churn a pending budget of their own and a peer's handshake moves it out."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import pytest
from transfer_helpers import parse, pattern, raw_session, wait_for

from kvferry.harness.stranger import HalfOpenFlood
from kvferry.transfer.base import ByteRange, TransferError, WriteOp
from kvferry.transfer.tcp.engine import TcpTransferEngine
from kvferry.transfer.tcp.limits import Limits, bucket

SECRET = b"4cc66f503ee74be2300fc8d6345074da"  # a fixed random secret (128 bits)
ATTACK = {"127.0.0.1": 64, "127.0.0.2": 64, "127.0.0.3": 64, "127.0.0.4": 64, "127.0.0.5": 64}
Make = Callable[..., TcpTransferEngine]


def test_buckets() -> None:
    assert bucket("127.0.0.1") == bucket("127.255.3.9") == "127.0.0.0/8"
    assert bucket("10.1.2.3") == bucket("10.1.2.200") == "10.1.2.0/24" != bucket("10.1.3.1")
    assert bucket("::ffff:10.1.2.3") == "10.1.2.0/24"
    assert bucket("2001:db8:1:2::5") == bucket("2001:db8:1:2:ffff::1") == "2001:db8:1:2::/64"
    assert bucket("::1") == "::1/128"


def test_half_open_flood_does_not_keep_a_peer_out(engines: Make) -> None:
    d = engines(secret=SECRET)
    d.register("dst", np.zeros(1 << 16, np.uint8))
    p = engines(secret=SECRET, limits=Limits(client_idle=0.0))  # every write on a fresh connection
    p.register("src", pattern(1 << 16, 1))
    token = d.open_grant([ByteRange("dst", 0, 1 << 16)])
    ok, n, took = 0, 200, []
    with HalfOpenFlood(*parse(d.address), ATTACK) as flood:
        wait_for(lambda: flood.dropped >= 64, 30, "the flood to be churning")
        for _ in range(n):
            t0 = time.monotonic()
            try:
                p.write(d.address, token, [WriteOp("src", 0, "dst", 0, 4096)], time.monotonic() + 5)
                ok += 1
            except TransferError:
                pass
            took.append(time.monotonic() - t0)
        pending, proven = d._server.budgets
        opened, dropped = flood.opened, flood.dropped
    print(f"\nflood: {ok}/{n} fresh-connection writes ok, p50 {np.percentile(took, 50) * 1e3:.1f} ms "
          f"p99 {np.percentile(took, 99) * 1e3:.1f} ms; stranger connections opened {opened}, dropped {dropped}; "
          f"pending {pending}, evicted {d.stats['evicted_handshakes']}")
    assert ok >= 0.99 * n, f"{ok}/{n} writes succeeded during the flood"
    assert pending <= Limits().max_pending and proven <= 8
    assert d.stats["evicted_handshakes"] > 0 and p.stats["connections_opened"] >= ok


def test_proven_budget_is_the_peers_own(engines: Make) -> None:
    d = engines(secret=SECRET, limits=Limits(max_pending=4, max_pending_per_bucket=4, max_connections=2))
    d.register("dst", np.zeros(4096, np.uint8))
    held = [raw_session(d.address, SECRET)[0] for _ in range(2)]  # the proven budget is full
    with HalfOpenFlood(*parse(d.address), {"127.0.0.9": 3}) as flood:
        wait_for(lambda: d._server.budgets == (3, 2), what="3 pending, 2 proven")
        with pytest.raises(EOFError):  # a third peer is refused before OK ...
            raw_session(d.address, SECRET)
        assert d.stats["refused_connections"] == 1 and flood.held == 3
        held.pop().close()  # ... and gets in once a proven one left
        wait_for(lambda: d._server.budgets[1] == 1, what="the proven slot freed")
        held.append(raw_session(d.address, SECRET)[0])
    for s in held:
        s.close()


def test_a_bucket_evicts_its_own_before_others(engines: Make) -> None:
    """Which pending connection a newcomer evicts: the oldest of its own bucket once that bucket holds its
    share, else the oldest of the fullest bucket; a quiet bucket's handshake is never the one to go."""
    server = engines(limits=Limits(max_pending=4, max_pending_per_bucket=3))._server
    a1, a2, a3, b1 = (object() for _ in range(4))  # stand-ins: only the bookkeeping is under test
    with server._lock:
        for conn, b in ((a1, "A"), (a2, "A"), (b1, "B"), (a3, "A")):
            assert server._make_room(b) is None
            server._add_pending(conn, b)  # type: ignore[arg-type]
        assert server._make_room("C") is a1  # full: the fullest bucket (A) loses its oldest
        server._add_pending(object(), "C")  # type: ignore[arg-type]
        assert server._make_room("B") is a2  # full again: still A, never B's or C's one
        server._add_pending(object(), "B")  # type: ignore[arg-type]
        assert server._make_room("B") is b1  # now B is the fullest (2): B's oldest
        server._drop_pending(a3)  # type: ignore[arg-type]
        server._add_pending(a3, "A")  # type: ignore[arg-type]
        for _ in range(2):
            server._add_pending(object(), "A")  # type: ignore[arg-type]
        assert server._make_room("A") is a3  # A holds its share (3): A's own oldest
