"""The stranger process of `kvferry bench flood` and tests/security: it says `ready` once its flood is in
place, reopens what the server closes, and on SIGINT stops and says how many it opened and saw dropped."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from procs import wait_until


@contextmanager
def listener(close_after: int) -> Iterator[tuple[int, list[int]]]:
    """A loopback TCP server that closes the first `close_after` connections it accepts and keeps the rest."""
    server = socket.create_server(("127.0.0.1", 0), backlog=128)
    server.settimeout(0.05)
    accepted, kept, stop = [0], [], threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            accepted[0] += 1
            if accepted[0] <= close_after:
                conn.close()
            else:
                kept.append(conn)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield server.getsockname()[1], accepted
    finally:
        stop.set()
        thread.join(5)
        for conn in kept:
            conn.close()
        server.close()


def _run(args: list[str], meanwhile: Callable[[], object] = lambda: None) -> str:
    """Start the stranger, wait for its `ready`, run `meanwhile`, stop it with SIGINT, return what it printed."""
    proc = subprocess.Popen([sys.executable, "-m", "kvferry.harness.stranger", *args, "--seconds", "60"],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline() == "ready\n"  # blocks until then; the 60 s bound above ends it anyway
        meanwhile()
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == 0
        return out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_idle_holds_its_connections_and_reopens_the_closed_ones() -> None:
    with listener(close_after=3) as (port, accepted):
        out = _run(["idle", f"tcp://127.0.0.1:{port}", "--conns", "5"],
                   lambda: wait_until(lambda: accepted[0] >= 8, 10, "the 3 closed connections reopened"))
    opened, dropped = (int(w) for w in out.split()[1::2])
    assert opened >= 8 and dropped >= 3, out


def test_halfopen_is_ready_once_the_server_dropped_as_many_as_it_holds() -> None:
    with listener(close_after=10) as (port, accepted):
        out = _run(["halfopen", f"127.0.0.1:{port}", "--sources", "127.0.0.1=4,127.0.0.2=2"])
    opened, dropped = (int(w) for w in out.split()[1::2])
    assert dropped >= 6 and opened >= dropped + 6 and accepted[0] >= opened, out
