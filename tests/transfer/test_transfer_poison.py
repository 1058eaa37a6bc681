"""Verify before use (#31 item 1): with a secret, no byte whose tag has not verified reaches D's memory
or is reported written. An on-path attacker inside an authenticated session (here: a raw session that
knows the secret, standing in for a relay that injects frames) sends a message over ranges D already
verified: a failed tag poisons the whole grant and the verified bytes stay as they were, and a message
still unverified when the grant closes changes nothing."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import pytest
from transfer_helpers import closed_by_peer, message, pattern, raw_session, recv_exact, wait_for

from kvferry.transfer.base import ByteRange, TransferError, TransferErrorCause, WriteOp
from kvferry.transfer.tcp import wire
from kvferry.transfer.tcp.auth import Tags
from kvferry.transfer.tcp.engine import TcpTransferEngine

MiB = 1 << 20
SECRET = b"poison-test-" + b"k" * 4 + bytes(range(32, 64))
Make = Callable[..., TcpTransferEngine]
N = 8192


def _ends(engines: Make) -> tuple[TcpTransferEngine, TcpTransferEngine, np.ndarray, np.ndarray]:
    a, b = engines(secret=SECRET), engines(secret=SECRET)
    src, dst = pattern(MiB, 5), np.zeros(MiB, np.uint8)
    a.register("src", src)
    b.register("dst", dst)
    return a, b, src, dst


def _send_good(sock: object, tags: Tags, token: str, offset: int, payload: bytes) -> int:
    sock.sendall(tags.seal_frame(message(token, [("dst", offset, len(payload))]), payload))  # type: ignore[attr-defined]
    raw = recv_exact(sock, wire.REPLY.size)  # type: ignore[arg-type]
    raw += recv_exact(sock, wire.REPLY.unpack(raw)[3])  # type: ignore[arg-type]
    assert tags.recv.tag(tags.received, raw) == recv_exact(sock, wire.TAG_BYTES)  # type: ignore[arg-type]
    tags.received += 1
    return int(wire.REPLY.unpack_from(raw)[1])


def test_a_bad_tag_over_verified_ranges_fails_the_whole_grant(engines: Make) -> None:
    a, b, src, dst = _ends(engines)
    token = b.open_grant([ByteRange("dst", 0, MiB)])
    sock, tags = raw_session(b.address, SECRET)
    assert tags is not None
    assert _send_good(sock, tags, token, 0, src[:N].tobytes()) == wire.Status.OK
    assert b.written(token) == [ByteRange("dst", 0, N)]  # verified
    forged = bytes(N)  # what the attacker wants D to decode, over the verified range
    sock.sendall(message(token, [("dst", 0, N)]) + forged + bytes(wire.TAG_BYTES))
    assert closed_by_peer(sock)
    wait_for(lambda: b.stats["bad_tags"] == 1, what="the bad tag")
    assert np.array_equal(dst[:N], src[:N])  # the forged bytes never reached D's memory
    assert b.written(token) == []
    with pytest.raises(TransferError) as exc:  # P's next write under the poisoned grant fails
        a.write(b.address, token, [WriteOp("src", 0, "dst", N, N)], time.monotonic() + 5)
    assert exc.value.cause is TransferErrorCause.REJECTED, exc.value
    assert b.close_grant(token) == []


def test_a_message_unverified_at_close_takes_its_ranges_out(engines: Make) -> None:
    """The attacker holds the forged message's tag back and lets P's OK through: D closes the grant
    while forged bytes sit over verified ranges."""
    _, b, src, dst = _ends(engines)
    token = b.open_grant([ByteRange("dst", 0, MiB)])
    sock, tags = raw_session(b.address, SECRET)
    assert tags is not None
    assert _send_good(sock, tags, token, 0, src[: 2 * N].tobytes()) == wire.Status.OK
    assert _send_good(sock, tags, token, 4 * N, src[4 * N : 5 * N].tobytes()) == wire.Status.OK
    sock.sendall(message(token, [("dst", N, N)]) + bytes(N))  # no tag yet
    verified = [ByteRange("dst", 0, 2 * N), ByteRange("dst", 4 * N, N)]
    assert b.written(token) == verified  # staged, not landed: the verified bytes are intact
    assert b.close_grant(token) == verified
    assert np.array_equal(dst[: 2 * N], src[: 2 * N])
    sock.close()


def test_a_cut_message_spoils_only_its_own_ranges(engines: Make) -> None:
    """A real P that dies mid-message: what it verified before still counts (per-block recovery)."""
    _, b, src, _ = _ends(engines)
    token = b.open_grant([ByteRange("dst", 0, MiB)])
    sock, tags = raw_session(b.address, SECRET)
    assert tags is not None
    assert _send_good(sock, tags, token, 0, src[:N].tobytes()) == wire.Status.OK
    sock.sendall(message(token, [("dst", 2 * N, N)]) + src[2 * N : 2 * N + 100].tobytes())
    sock.close()
    wait_for(lambda: b.connections == 0, what="the connection to end")
    assert b.close_grant(token) == [ByteRange("dst", 0, N)]
