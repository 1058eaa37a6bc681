"""Dead, frozen and hostile peers: every failure is a typed TransferError within the deadline."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
import time
from collections.abc import Callable

import numpy as np
import pytest
from transfer_helpers import (
    closed_by_peer,
    message,
    parse,
    pattern,
    raw_connect,
    read_hello,
    read_reply,
    wait_for,
)

from kvferry.harness.peer import PeerProcess
from kvferry.transfer.base import ByteRange, TransferError, TransferErrorCause, WriteOp
from kvferry.transfer.tcp import wire
from kvferry.transfer.tcp.engine import TcpTransferEngine

MiB = 1 << 20
E = TransferErrorCause
MakeEngine = Callable[..., TcpTransferEngine]
MakePeer = Callable[..., PeerProcess]


def _sender(engines: MakeEngine, size: int = 64 * MiB, **kw: object) -> tuple[TcpTransferEngine, np.ndarray]:
    a = engines(**kw)
    src = pattern(size, 5)
    a.register("src", src)
    return a, src


def _blocks(n: int, bs: int = 16384) -> list[WriteOp]:
    return [WriteOp("src", i * bs, "dst", ((i * 7) % n) * bs, bs) for i in range(n)]


def _write_in_thread(
    a: TcpTransferEngine, peer: str, token: str, ops: list[WriteOp], deadline: float
) -> dict[str, object]:
    out: dict[str, object] = {}

    def run() -> None:
        try:
            a.write(peer, token, ops, deadline)
            out["ok"] = True
        except TransferError as e:
            out["error"] = e
        out["at"] = time.monotonic()

    t = threading.Thread(target=run, daemon=True)
    out["thread"] = t
    t.start()
    return out


def test_killed_peer_mid_transfer_fails_fast(engines: MakeEngine, peers: MakePeer) -> None:
    a, _ = _sender(engines)
    peer = peers(64 * MiB)
    token = peer.grant([ByteRange("dst", 0, 64 * MiB)])
    a.write(peer.address, token, _blocks(4), time.monotonic() + 5)  # pooled connection
    peer.signal(signal.SIGSTOP)  # so the big write is surely still in flight when it dies
    sent = a.stats["bytes_sent"]
    res = _write_in_thread(a, peer.address, token, _blocks(4096), time.monotonic() + 20)
    wait_for(lambda: a.stats["bytes_sent"] > sent, what="the write to start")
    peer.signal(signal.SIGKILL)
    killed = time.monotonic()
    res["thread"].join(10)  # type: ignore[attr-defined]
    err = res.get("error")
    assert isinstance(err, TransferError) and err.cause is E.RESET, err
    assert float(res["at"]) - killed < 2.0  # type: ignore[arg-type]


def test_frozen_peer_times_out_at_the_deadline_then_recovers(engines: MakeEngine, peers: MakePeer) -> None:
    a, src = _sender(engines, 4 * MiB)
    frozen = peers(4 * MiB)
    token = frozen.grant([ByteRange("dst", 0, 4 * MiB)])
    a.write(frozen.address, token, _blocks(4), time.monotonic() + 5)
    frozen.signal(signal.SIGSTOP)
    for engine in (a, engines()):  # a pooled connection, then a fresh one (stuck in the handshake)
        if engine is not a:
            engine.register("src", src)
        t0 = time.monotonic()
        with pytest.raises(TransferError) as exc:
            engine.write(frozen.address, token, _blocks(256), t0 + 0.5)
        assert exc.value.cause is E.TIMEOUT
        assert 0.45 <= time.monotonic() - t0 < 1.5  # at the deadline, with slack for a loaded box
    fresh = peers(4 * MiB)
    token2 = fresh.grant([ByteRange("dst", 0, 4 * MiB)])
    a.write(fresh.address, token2, _blocks(256), time.monotonic() + 5)
    assert fresh.digest([(0, 256 * 16384)]) == _digest_of(src, _blocks(256), 256 * 16384)
    frozen.signal(signal.SIGCONT)  # and the thawed peer is not wedged either
    a.write(frozen.address, token, _blocks(256), time.monotonic() + 5)


def _digest_of(src: np.ndarray, ops: list[WriteOp], size: int) -> str:
    import xxhash

    mem = np.zeros(size, np.uint8)
    for op in ops:
        mem[op.dst_offset : op.dst_offset + op.length] = src[op.src_offset : op.src_offset + op.length]
    return str(xxhash.xxh3_64(mem.data).hexdigest())


def test_close_aborts_a_write_in_flight(engines: MakeEngine, peers: MakePeer) -> None:
    a, _ = _sender(engines, 16 * MiB)
    peer = peers(16 * MiB)
    token = peer.grant([ByteRange("dst", 0, 16 * MiB)])
    a.write(peer.address, token, _blocks(4), time.monotonic() + 5)
    peer.signal(signal.SIGSTOP)
    sent = a.stats["bytes_sent"]
    res = _write_in_thread(a, peer.address, token, _blocks(1024), time.monotonic() + 30)
    wait_for(lambda: a.stats["bytes_sent"] > sent, what="the write to start")
    a.close()
    res["thread"].join(5)  # type: ignore[attr-defined]
    err = res.get("error")
    assert isinstance(err, TransferError) and err.cause is E.CLOSED, err


def test_abort_writes_fails_a_pooled_write_at_once_without_a_retry(
    engines: MakeEngine, peers: MakePeer
) -> None:
    a, _ = _sender(engines, 16 * MiB)
    peer = peers(16 * MiB)
    token = peer.grant([ByteRange("dst", 0, 16 * MiB)])
    a.write(peer.address, token, _blocks(4), time.monotonic() + 5)  # the next write reuses this one
    peer.signal(signal.SIGSTOP)
    sent = a.stats["bytes_sent"]
    res = _write_in_thread(a, peer.address, token, _blocks(1024), time.monotonic() + 30)
    wait_for(lambda: a.stats["bytes_sent"] > sent, what="the write to start")
    t0 = time.monotonic()
    a.abort_writes(peer.address)  # P's lease on this D ran out
    res["thread"].join(5)  # type: ignore[attr-defined]
    err = res.get("error")
    assert isinstance(err, TransferError) and err.cause is E.RESET, err
    assert float(res["at"]) - t0 < 1.0  # type: ignore[arg-type]
    assert a.stats["stale_retries"] == 0 and a.stats["connections_opened"] == 1


WRONG, RIGHT = "b7d8adfc040dcad5083f97cd3cd59b71", "953ff16eff8a44792d5ff93d9e28e485"  # two fixed random secrets


@pytest.mark.parametrize(
    ("client", "server"),
    [(WRONG, RIGHT), (None, RIGHT), (RIGHT, None)],
    ids=["wrong", "none", "impostor"],
)
def test_secret_mismatch_is_refused(engines: MakeEngine, client: str | None, server: str | None) -> None:
    a, _ = _sender(engines, 1 * MiB, secret=client)
    b = engines(secret=server)
    dst = np.zeros(MiB, np.uint8)
    b.register("dst", dst)
    token = b.open_grant([ByteRange("dst", 0, MiB)])
    with pytest.raises(TransferError) as exc:
        a.write(b.address, token, [WriteOp("src", 0, "dst", 0, 4096)], time.monotonic() + 5)
    assert exc.value.cause is E.REFUSED
    assert not dst.any()
    if server is not None:
        assert b.stats["refused_handshakes"] == 1


def test_shared_secret_from_env(engines: MakeEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVFERRY_SECRET", "KaM3hGXN2LR6m44Bg4yocllaluc5vwCh")
    a, src = _sender(engines, 1 * MiB)
    b = engines()
    dst = np.zeros(MiB, np.uint8)
    b.register("dst", dst)
    token = b.open_grant([ByteRange("dst", 0, MiB)])
    a.write(b.address, token, [WriteOp("src", 0, "dst", 0, 4096)], time.monotonic() + 5)
    assert np.array_equal(dst[:4096], src[:4096])
    raw = raw_connect(b.address, handshake=False)  # a stranger without the secret
    read_hello(raw)
    me = b.address.encode()
    raw.sendall(
        wire.AUTH.pack(wire.AUTH_MAGIC, wire.VERSION, wire.FLAG_AUTH, len(me), os.urandom(16), os.urandom(32))
        + me
    )
    assert wire.AUTH_RESULT.unpack(raw.recv(wire.AUTH_RESULT.size))[1] == 1
    assert closed_by_peer(raw)
    assert b.stats["refused_handshakes"] == 1


def _garbage_frames(token: str) -> list[bytes]:
    good = message(token, [("dst", 0, 16)])
    bad_table = wire.encode_meta(["dst"], [3], [0], [16])  # region index outside the table
    return [
        b"\x00" * wire.MSG.size,  # bad magic
        good[:10],  # truncated header, then EOF
        wire.MSG.pack(wire.MSG_MAGIC, 99, bytes(16), 1, 10, 16, 1000),  # bad version
        wire.MSG.pack(wire.MSG_MAGIC, wire.VERSION, bytes.fromhex(token), 1, 5, 16, 1000) + b"\x01\x00xyz",
        wire.MSG.pack(wire.MSG_MAGIC, wire.VERSION, bytes.fromhex(token), 1, len(bad_table), 16, 1000)
        + bad_table,
        good[: wire.MSG.size] + good[wire.MSG.size :][:-1],  # op table one byte short, then EOF
        wire.MSG.pack(
            wire.MSG_MAGIC, wire.VERSION, bytes.fromhex(token), 1, len(good) - wire.MSG.size, 17, 1000
        )
        + good[wire.MSG.size :],  # payload length does not match the ops
        wire.MSG.pack(wire.MSG_MAGIC, wire.VERSION, bytes(16), wire.MAX_OPS + 1, 0, 0, 1000),
    ]


def test_malformed_frames_close_that_connection_only(engines: MakeEngine) -> None:
    a, src = _sender(engines, 1 * MiB)
    b = engines()
    dst = np.zeros(MiB, np.uint8)
    b.register("dst", dst)
    token = b.open_grant([ByteRange("dst", 0, MiB)])
    bystander = raw_connect(b.address)  # an honest connection open the whole time
    for k, frame in enumerate(_garbage_frames(token)):
        raw = raw_connect(b.address)
        raw.sendall(frame)
        with contextlib.suppress(OSError):  # the server may have refused the frame already
            raw.shutdown(socket.SHUT_WR)  # truncated frames end here
        assert closed_by_peer(raw), k
        raw.close()
    stranger = socket.create_connection(parse(b.address))  # garbage instead of a handshake
    stranger.sendall(os.urandom(wire.AUTH.size))
    assert closed_by_peer(stranger)
    wait_for(lambda: b.stats["protocol_errors"] >= 8, what="protocol errors counted")
    assert not dst.any()
    bystander.sendall(message(token, [("dst", 0, 16)]) + src[:16].tobytes())
    assert read_reply(bystander)[:2] == (wire.Status.OK, wire.Code.OK)
    a.write(b.address, token, [WriteOp("src", 0, "dst", 4096, 4096)], time.monotonic() + 5)
    assert np.array_equal(dst[4096:8192], src[:4096])
