"""Thread-safe counters that an engine exposes as `stats`."""

from __future__ import annotations

import threading

COUNTERS = (
    "accepted_writes",  # messages whose every byte landed
    "rejected_writes",  # messages refused: no grant, closed grant, out of range, unknown region
    "refused_handshakes",  # wrong or missing secret
    "misdirected_handshakes",  # with a secret: the client dialed another address (a relay)
    "handshake_timeouts",  # no complete handshake within Limits.handshake_timeout
    "protocol_errors",  # malformed or truncated frames; the connection was closed
    "oversized_frames",  # (also a protocol error) more ops or meta than the limits allow
    "bad_tags",  # (also a protocol error) with a secret: a message whose tag did not verify
    "frame_timeouts",  # a message not complete in time (frame timeout, clamped ttl); closed
    "incomplete_writes",  # connection broke or stalled mid-payload
    "idle_closed",  # connections closed after Limits.idle_timeout without a message
    "refused_connections",  # handshake done but Limits.max_connections proven ones held already; closed
    "evicted_handshakes",  # pending (mid-handshake) connections evicted by newer ones (Limits.max_pending*)
    "bytes_received",
    "connections_accepted",
    "writes_ok",  # sender side
    "writes_failed",
    "connections_opened",
    "idle_retired",  # sender: pooled connections closed after Limits.client_idle unused
    "stale_retries",  # sender: a pooled connection was found closed before any reply; retried once
    "handshake_retries",  # sender: the server cut a handshake (a starved peer, or us); dialled again
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
