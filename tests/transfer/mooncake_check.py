"""Mooncake backend checks; run by test_transfer_mooncake.py inside a private network namespace."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np

from kvferry.harness.netns import loopback_up
from kvferry.transfer.base import ByteRange, TransferError, TransferErrorCause, WriteOp
from kvferry.transfer.mooncake import MooncakeTransferEngine

RECEIVER = """
import json, sys, numpy as np
from kvferry.transfer.mooncake import MooncakeTransferEngine
from kvferry.transfer.base import ByteRange
e = MooncakeTransferEngine(); mem = np.zeros(1 << 20, np.uint8); e.register("dst", mem)
print(json.dumps({"address": e.address, "token": e.open_grant([ByteRange("dst", 0, 1 << 20)])}), flush=True)
sys.stdin.readline()
"""


def check_bytes(
    a: MooncakeTransferEngine, b: MooncakeTransferEngine, src: np.ndarray, dst: np.ndarray
) -> None:
    rng = np.random.default_rng(7)
    for bs, n in ((16384, 256), (2048, 3000)):  # 3000 entries: split into batches of ≤ 1,024
        dst[:] = 0
        si, di = rng.permutation(len(src) // bs)[:n], rng.permutation(len(dst) // bs)[:n]
        ops = [WriteOp("src", int(s) * bs, "dst", int(d) * bs, bs) for s, d in zip(si, di, strict=True)]
        token = b.open_grant([ByteRange("dst", 0, len(dst))])
        a.write(b.address, token, ops, time.monotonic() + 30)
        assert np.array_equal(src.reshape(-1, bs)[si], dst.reshape(-1, bs)[di]), bs
        assert b.written(token) == [] and b.close_grant(token) == []
    # Adjacent runs are coalesced into one entry and still land exactly.
    token = b.open_grant([ByteRange("dst", 0, len(dst))])
    a.write(
        b.address,
        token,
        [WriteOp("src", i * 4096, "dst", 8192 + i * 4096, 4096) for i in range(64)],
        time.monotonic() + 30,
    )
    assert np.array_equal(dst[8192 : 8192 + 64 * 4096], src[: 64 * 4096])


def check_failures(a: MooncakeTransferEngine, token: str) -> None:
    t0 = time.monotonic()
    try:
        a.write("127.0.0.1:1", token, [WriteOp("src", 0, "dst", 0, 16)], t0 + 5)
        raise AssertionError("expected a TransferError")
    except TransferError as e:
        assert e.cause in (TransferErrorCause.RESET, TransferErrorCause.REFUSED), e
    assert time.monotonic() - t0 < 2
    try:
        a.write("127.0.0.1:1", token, [WriteOp("src", 0, "ghost", 0, 16)], t0 + 5)
        raise AssertionError("expected INVALID")
    except TransferError as e:
        assert e.cause is TransferErrorCause.INVALID


def check_frozen_peer(a: MooncakeTransferEngine) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", RECEIVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        hello = json.loads(proc.stdout.readline())
        os.kill(proc.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        try:
            a.write(hello["address"], hello["token"], [WriteOp("src", 0, "dst", 0, 4096)], t0 + 1.0)
            raise AssertionError("expected TIMEOUT")
        except TransferError as e:
            assert e.cause is TransferErrorCause.TIMEOUT, e
        assert 0.95 <= time.monotonic() - t0 < 3.0, time.monotonic() - t0  # slack for a loaded box
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()


def main() -> None:
    loopback_up()
    src = np.random.default_rng(1).integers(0, 256, 16 << 20, np.uint8)
    dst = np.zeros(16 << 20, np.uint8)
    a, b = MooncakeTransferEngine(), MooncakeTransferEngine()
    a.register("src", src)
    b.register("dst", dst)
    assert not b.tracks_progress
    check_bytes(a, b, src, dst)
    check_failures(a, b.open_grant([ByteRange("dst", 0, 16)]))
    check_frozen_peer(a)
    print("MOONCAKE-OK", flush=True)
    os._exit(0)  # a worker may still sit in Mooncake's own (long) timeout; do not wait for it


if __name__ == "__main__":
    main()
