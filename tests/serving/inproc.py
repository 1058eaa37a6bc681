"""Real kvferry servers inside the test process, for state machines that run many examples: an app served by
uvicorn on its own thread over a loopback socket bound before it starts (no port race), stopped by the test."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import uvicorn


class ServerThread:
    """`server.run()` on a thread, over a socket bound here; `stop()` ends it (and waits)."""

    def __init__(self, server: uvicorn.Server) -> None:
        self.server = server
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.thread = threading.Thread(target=server.run, kwargs={"sockets": [self.sock]}, daemon=True,
                                       name=f"uvicorn {self.url}")

    @classmethod
    def of(cls, app: Any) -> ServerThread:
        return cls(uvicorn.Server(config(app)))

    def start(self, timeout: float = 10.0) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"server on {self.url} did not start")
            time.sleep(0.005)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
        self.sock.close()
        assert not self.thread.is_alive(), f"server on {self.url} did not stop"


def config(app: Any) -> uvicorn.Config:
    # No access log: hundreds of examples; a short keep-alive so idle connections do not outlive an example;
    # no lifespan (the instance app has no startup or shutdown hooks; a forced exit would cancel its task loudly).
    return uvicorn.Config(app, log_level="warning", access_log=False, timeout_keep_alive=1, lifespan="off",
                          timeout_graceful_shutdown=5)
