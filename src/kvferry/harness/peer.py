"""A transfer receiver in its own process, driven by JSON lines on stdin (tests and the bench): honest
numbers (no GIL shared with the sender), and it can be frozen or killed.

    python -m kvferry.harness.peer --size BYTES [--region dst] [--transfer tcp|nixl]"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from typing import TYPE_CHECKING, Any, Self

import numpy as np
import xxhash

from kvferry.transfer.base import ByteRange, TransferError, WriteOp
from kvferry.transfer.tcp.engine import TcpTransferEngine

if TYPE_CHECKING:
    from kvferry.transfer.nixl.engine import NixlTransferEngine


def _ranges(items: list[list[Any]]) -> list[ByteRange]:
    return [ByteRange(str(r), int(o), int(n)) for r, o, n in items]


def _dump(ranges: list[ByteRange]) -> list[list[Any]]:
    return [[r.region, r.offset, r.length] for r in ranges]


def handle(engine: TcpTransferEngine | NixlTransferEngine, mem: np.ndarray, cmd: dict[str, Any]) -> dict[str, Any]:
    op = cmd["cmd"]
    if op == "grant":
        return {"token": engine.open_grant(_ranges(cmd["ranges"]))}
    if op == "written":
        return {"ranges": _dump(engine.written(cmd["token"]))}
    if op == "close_grant":
        return {"ranges": _dump(engine.close_grant(cmd["token"]))}
    if op == "write":  # ops: [src offset, dst region, dst offset, length], from this process's region
        ops = [WriteOp(str(cmd["region"]), int(s), str(r), int(d), int(n)) for s, r, d, n in cmd["ops"]]
        engine.write(str(cmd["peer"]), str(cmd["token"]), ops, time.monotonic() + float(cmd.get("timeout", 30)))
        return {}
    if op == "stats":
        return {"stats": engine.stats, "cpu": time.process_time()}
    if op == "fill":
        mem.fill(int(cmd.get("value", 0)))
        return {}
    if op == "digest":  # xxh3_64 over [offset, length] pieces in order
        h = xxhash.xxh3_64()
        for off, length in cmd["pieces"]:
            h.update(mem[int(off) : int(off) + int(length)].data)
        return {"digest": h.hexdigest()}
    raise ValueError(f"unknown command {op!r}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvferry.harness.peer")
    parser.add_argument("--size", type=int, required=True)
    parser.add_argument("--region", default="dst")
    parser.add_argument("--transfer", choices=["tcp", "nixl"], default="tcp")
    args = parser.parse_args(argv)
    mem = np.zeros(args.size, np.uint8)
    engine: TcpTransferEngine | NixlTransferEngine
    if args.transfer == "nixl":
        from kvferry.transfer.nixl.engine import NixlTransferEngine

        engine = NixlTransferEngine()
    else:
        engine = TcpTransferEngine()
    try:
        engine.register(args.region, mem)
        print(json.dumps({"address": engine.address, "pid": os.getpid()}), flush=True)
        for line in sys.stdin:
            if not line.strip():
                continue
            try:
                out = handle(engine, mem, {"region": args.region, **json.loads(line)})
            except (TransferError, ValueError, KeyError) as e:
                out = {"error": str(e)}
            print(json.dumps(out), flush=True)
    finally:
        engine.close()
    return 0


class PeerProcess:
    """Parent-side handle: starts the peer, sends commands, and always stops it by pid."""

    def __init__(self, size: int, region: str = "dst", env: dict[str, str] | None = None,
                 transfer: str = "tcp") -> None:
        self.region = region
        argv = [sys.executable, "-m", "kvferry.harness.peer", "--size", str(size), "--region", region,
                "--transfer", transfer]
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.pid = self.proc.pid
        try:
            hello = self._read()
        except BaseException:
            self.stop()
            raise
        self.address: str = hello["address"]

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"peer {self.pid} exited (rc={self.proc.poll()})")
        out: dict[str, Any] = json.loads(line)
        if "error" in out:
            raise RuntimeError(out["error"])
        return out

    def call(self, cmd: str, **kw: Any) -> dict[str, Any]:
        self.send(cmd, **kw)
        return self._read()

    def send(self, cmd: str, **kw: Any) -> None:
        """Send a command without waiting; `reply` reads its answer (e.g. a write the test freezes)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"cmd": cmd, **kw}) + "\n")
        self.proc.stdin.flush()

    def reply(self) -> dict[str, Any]:
        return self._read()

    def grant(self, ranges: list[ByteRange]) -> str:
        return str(self.call("grant", ranges=_dump(ranges))["token"])

    def written(self, token: str) -> list[ByteRange]:
        return _ranges(self.call("written", token=token)["ranges"])

    def close_grant(self, token: str) -> list[ByteRange]:
        return _ranges(self.call("close_grant", token=token)["ranges"])

    def digest(self, pieces: list[tuple[int, int]]) -> str:
        return str(self.call("digest", pieces=pieces)["digest"])

    def signal(self, sig: signal.Signals) -> None:
        if self.proc.poll() is None:
            os.kill(self.pid, sig)

    def stop(self) -> None:
        """Idempotent: continue (if frozen), kill and reap."""
        if self.proc.poll() is None:
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.kill(self.pid, sig)
                except ProcessLookupError:
                    break
        self.proc.wait(timeout=10)
        for f in (self.proc.stdin, self.proc.stdout):
            if f is not None:
                with contextlib.suppress(OSError):
                    f.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


if __name__ == "__main__":
    sys.exit(main())
