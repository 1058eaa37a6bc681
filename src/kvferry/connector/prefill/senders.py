"""P's data-plane writes, one queue and one thread per D peer: a hung or slow D delays only its own
writes, never another D's. A peer's thread ends after it has been idle a while, so threads stay
bounded by the peers with work."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable

log = logging.getLogger(__name__)

IDLE_EXIT_S = 5.0


class PeerSenders:
    def __init__(self, name: str, idle_exit_s: float = IDLE_EXIT_S) -> None:
        self._name = name
        self._idle_exit_s = idle_exit_s
        self._cond = threading.Condition()
        self._queues: dict[str, deque[Callable[[], None]]] = {}
        self._threads: dict[str, threading.Thread] = {}
        self._closed = False

    def submit(self, peer: str, job: Callable[[], None]) -> None:
        """Run `job` on `peer`'s thread, after the jobs queued before it for that peer."""
        with self._cond:
            if self._closed:
                raise RuntimeError("senders closed")
            self._queues.setdefault(peer, deque()).append(job)
            if peer not in self._threads:
                thread = threading.Thread(target=self._work, args=(peer,), name=f"{self._name}-{peer}",
                                          daemon=True)
                self._threads[peer] = thread
                thread.start()
            self._cond.notify_all()

    def threads(self) -> int:
        with self._cond:
            return len(self._threads)

    def _work(self, peer: str) -> None:
        while True:
            with self._cond:
                queue = self._queues[peer]
                idle_until = time.monotonic() + self._idle_exit_s
                while not queue and not self._closed and (left := idle_until - time.monotonic()) > 0:
                    self._cond.wait(timeout=left)
                if not queue:  # idle (or closed): this peer's thread ends
                    del self._queues[peer], self._threads[peer]
                    return
                job = queue.popleft()
            try:
                job()
            except Exception:  # a job answers its own errors; this only keeps the thread alive
                log.exception("send job for %s failed", peer)

    def close(self, timeout: float = 5.0) -> None:
        with self._cond:
            self._closed = True
            for queue in self._queues.values():
                queue.clear()
            threads = list(self._threads.values())
            self._cond.notify_all()
        for thread in threads:
            thread.join(timeout)
