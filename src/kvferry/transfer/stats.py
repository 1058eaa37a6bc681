"""Thread-safe counters that an engine exposes as `stats`."""

from __future__ import annotations

import threading

COUNTERS = (
    "accepted_writes",  # messages whose every byte landed
    "rejected_writes",  # messages refused: no grant, closed grant, out of range, unknown region
    "refused_handshakes",  # wrong or missing secret
    "protocol_errors",  # malformed or truncated frames; the connection was closed
    "incomplete_writes",  # connection broke or stalled mid-payload
    "bytes_received",
    "connections_accepted",
    "writes_ok",  # sender side
    "writes_failed",
    "connections_opened",
    "bytes_sent",  # sender side, updated per sendmsg call (tests watch it to see a write in flight)
)


class Counters:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values = dict.fromkeys(COUNTERS, 0)

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._values[name] += n

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._values)
