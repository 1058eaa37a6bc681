"""A stranger's flood of half-open connections (issue 31, attack 2): connect from given source
addresses, never send a byte, and reopen each one the moment the server drops it."""

from __future__ import annotations

import selectors
import socket
import threading


class HalfOpenFlood:
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
