"""A stranger without KVFERRY_SECRET flooding a P/D system's ports (security tests, `kvferry bench flood`),
in a process of its own so its CPU and descriptors are its own:

    python -m kvferry.harness.stranger MODE ADDR [--conns N] [--sources IP=N,...] [--seconds S]

idle: N TCP connections held open; junk: N DEALERs sending 10,000-frame messages; bigframe: N ZMTP
greetings announcing a MAX_FRAME_BYTES - 1 frame; reconnect: N DEALERs reconnecting every 10 ms;
halfopen: N silent connections per source to D's data port, reopened as D drops them. Prints `ready`
once in place and `opened N dropped M` at the end."""

from __future__ import annotations

import argparse
import contextlib
import resource
import selectors
import signal
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from kvferry.connector.messages import MAX_FRAME_BYTES

MODES = ("idle", "junk", "bigframe", "reconnect", "halfopen")
GREETING = b"\xff" + bytes(8) + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\0") + b"\0" + bytes(31)


class HalfOpenFlood:
    """Connect from given source addresses, never send a byte, and reopen each connection the moment the
    server drops it (a thread of its own; use as a context manager)."""

    def __init__(self, host: str, port: int, sources: dict[str, int]) -> None:
        self._addr = (host, port)
        self._want = [src for src, n in sources.items() for _ in range(n)]
        self._sel = selectors.DefaultSelector()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="flood", daemon=True)
        self.opened = 0  # connections made, first ones and reopened ones
        self.dropped = 0  # connections the server closed

    def __enter__(self) -> HalfOpenFlood:
        first, self._want = self._want, []
        for src in first:
            self._open(src)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        for key in list(self._sel.get_map().values()):
            key.fileobj.close()  # type: ignore[union-attr]
        self._sel.close()

    @property
    def held(self) -> int:
        return len(self._sel.get_map())

    def _open(self, src: str) -> None:
        try:
            sock = socket.create_connection(self._addr, timeout=1, source_address=(src, 0))
        except OSError:
            self._want.append(src)  # tried again on the next turn
            return
        sock.setblocking(False)
        self._sel.register(sock, selectors.EVENT_READ, src)
        self.opened += 1

    def _run(self) -> None:
        while not self._stop.is_set():
            retry, self._want = self._want, []
            for src in retry:
                self._open(src)
            for key, _ in self._sel.select(0.02):
                sock: socket.socket = key.fileobj  # type: ignore[assignment]
                try:
                    if sock.recv(4096):
                        continue  # the server's HELLO: never answered
                except BlockingIOError:
                    continue
                except OSError:
                    pass
                self._sel.unregister(sock)
                sock.close()
                self.dropped += 1
                self._open(key.data)


class _Counts:
    def __init__(self) -> None:
        self.opened = self.dropped = 0
        self.ready = False

    def mark_ready(self) -> None:
        if not self.ready:
            self.ready = True
            print("ready", flush=True)


def _gone(s: socket.socket) -> bool:
    try:
        s.setblocking(False)
        return s.recv(1 << 16) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def hold(host: str, port: int, n: int, running: Callable[[], bool], first: bytes, counts: _Counts) -> None:
    """Keep `n` connections open (each sending `first`), reopening the ones the server closes."""
    socks: list[socket.socket] = []
    while running():
        alive = []
        for s in socks:  # P closed it: reopen (as an attacker keeping its share would)
            if _gone(s):
                s.close()
                counts.dropped += 1
            else:
                alive.append(s)
        socks = alive
        while len(socks) < n and running():
            try:
                fresh = socket.create_connection((host, port), timeout=1)
            except OSError:
                break
            if first:
                with contextlib.suppress(OSError):
                    fresh.sendall(first)
            socks.append(fresh)
            counts.opened += 1
        if counts.opened >= n:
            counts.mark_ready()
        time.sleep(0.05)
    for s in socks:
        s.close()


def dealers(addr: str, n: int, junk: bool, running: Callable[[], bool], counts: _Counts) -> None:
    """`n` DEALERs without the secret: `junk` sends 10,000-frame messages, else they only reconnect."""
    ctx: zmq.Context[Any] = zmq.Context()
    socks = []
    for _ in range(n):
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.RECONNECT_IVL, 10)
        s.setsockopt(zmq.SNDHWM, 10)
        s.connect(addr)
        socks.append(s)
    counts.opened = n
    frames = [b""] * 10_000
    while running():
        for s in socks:
            if junk:
                with contextlib.suppress(zmq.Again):
                    s.send_multipart(frames, zmq.NOBLOCK)
        counts.mark_ready()
        time.sleep(0.001 if junk else 0.1)
    ctx.destroy(linger=0)


def half_open(host: str, port: int, sources: dict[str, int], running: Callable[[], bool], counts: _Counts) -> None:
    with HalfOpenFlood(host, port, sources) as flood:
        while running():
            if flood.dropped >= sum(sources.values()):  # D's pending budget is full and churning
                counts.mark_ready()
            time.sleep(0.02)
        counts.opened, counts.dropped = flood.opened, flood.dropped


def parse_sources(text: str) -> dict[str, int]:
    """`127.0.0.1=64,127.0.0.2=64` as {address: connections}."""
    out: dict[str, int] = {}
    for part in text.split(","):
        ip, sep, n = part.partition("=")
        if not sep or not n.isdigit():
            raise argparse.ArgumentTypeError(f"--sources wants IP=N,...; got {part!r}")
        out[ip.strip()] = int(n)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m kvferry.harness.stranger")
    ap.add_argument("mode", choices=MODES)
    ap.add_argument("addr", help="tcp://host:port (P's control port) or host:port (D's data port)")
    ap.add_argument("--conns", type=int, default=1000)
    ap.add_argument("--sources", type=parse_sources, default={"127.0.0.1": 64},
                    help="halfopen: IP=N,... (connections per source address)")
    ap.add_argument("--seconds", type=float, default=10)
    args = ap.parse_args(argv)
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):  # stop cleanly and report what was done
        signal.signal(sig, lambda *_: stop.set())
    until = time.monotonic() + args.seconds

    def running() -> bool:
        return not stop.is_set() and time.monotonic() < until

    host, port = args.addr.removeprefix("tcp://").rsplit(":", 1)
    counts = _Counts()
    if args.mode in ("idle", "bigframe"):
        first = b"" if args.mode == "idle" else GREETING + b"\x02" + struct.pack(">Q", MAX_FRAME_BYTES - 1) + bytes(64 << 10)
        hold(host, int(port), args.conns, running, first, counts)
    elif args.mode == "halfopen":
        half_open(host, int(port), args.sources, running, counts)
    else:
        dealers(args.addr, args.conns, args.mode == "junk", running, counts)
    print(f"opened {counts.opened} dropped {counts.dropped}", flush=True)


if __name__ == "__main__":
    main()
