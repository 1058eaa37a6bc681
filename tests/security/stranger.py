"""A stranger without KVFERRY_SECRET flooding P's ZMQ control port (issue 31.3-6), in its own process so
its CPU and descriptors are its own. Runs until killed or for --seconds.

    python stranger.py idle|junk|bigframe|reconnect ADDR --conns N --seconds S
idle:      N plain TCP connections held open (reopened as P closes them)
junk:      N DEALERs sending messages of 10,000 empty frames as fast as they can
bigframe:  N connections that greet in ZMTP, announce a frame of MAX_FRAME_BYTES - 1 and send 64 KiB of it
reconnect: N DEALERs reconnecting every 10 ms, each one a handshake P refuses (and might log)
"""

from __future__ import annotations

import argparse
import contextlib
import resource
import socket
import struct
import time
from typing import Any

import zmq

from kvferry.connector.messages import MAX_FRAME_BYTES

GREETING = b"\xff" + bytes(8) + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\0") + b"\0" + bytes(31)


def tcp(host: str, port: int) -> socket.socket | None:
    with contextlib.suppress(OSError):
        return socket.create_connection((host, port), timeout=1)
    return None


def hold(host: str, port: int, n: int, until: float, first: bytes) -> None:
    socks: list[socket.socket] = []
    while time.monotonic() < until:
        alive = []
        for s in socks:  # P closed it: reopen (as an attacker keeping its share would)
            try:
                s.setblocking(False)
                gone = s.recv(1 << 16) == b""
            except BlockingIOError:
                gone = False
            except OSError:
                gone = True
            if gone:
                s.close()
            else:
                alive.append(s)
        socks = alive
        while len(socks) < n and time.monotonic() < until:
            s = tcp(host, port)
            if s is None:
                break
            if first:
                with contextlib.suppress(OSError):
                    s.sendall(first)
            socks.append(s)
        time.sleep(0.05)
    for s in socks:
        s.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["idle", "junk", "bigframe", "reconnect"])
    ap.add_argument("addr")  # tcp://host:port
    ap.add_argument("--conns", type=int, default=1000)
    ap.add_argument("--seconds", type=float, default=10)
    args = ap.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    host, port = args.addr.removeprefix("tcp://").rsplit(":", 1)
    until = time.monotonic() + args.seconds
    if args.mode == "idle":
        hold(host, int(port), args.conns, until, b"")
    elif args.mode == "bigframe":
        frame = GREETING + b"\x02" + struct.pack(">Q", MAX_FRAME_BYTES - 1) + bytes(64 << 10)
        hold(host, int(port), args.conns, until, frame)
    else:
        ctx: zmq.Context[Any] = zmq.Context()
        socks = []
        for _ in range(args.conns):
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.RECONNECT_IVL, 10)
            s.setsockopt(zmq.SNDHWM, 10)
            s.connect(args.addr)
            socks.append(s)
        junk = [b""] * 10_000
        while time.monotonic() < until:
            for s in socks:
                if args.mode == "junk":
                    with contextlib.suppress(zmq.Again):
                        s.send_multipart(junk, zmq.NOBLOCK)
            time.sleep(0.001 if args.mode == "junk" else 0.1)
        ctx.destroy(linger=0)


if __name__ == "__main__":
    main()
