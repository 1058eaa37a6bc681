"""What a stranger who reaches the data-plane port can make the receiver spend, bounded by construction.

Every limit is a named constant, the default of one `Limits` field (tests pass smaller ones), and every
refusal it causes is counted in the engine's `stats`:

| constant | default | bounds | counted as |
|---|---|---|---|
| `MAX_CONNECTIONS` | 256 | data-plane connections (one thread + one fd each) in total | `refused_connections` |
| `MAX_CONNECTIONS_PER_IP` | 64 | ... from one peer IP address | `refused_connections` |
| `HANDSHAKE_TIMEOUT_S` | 5 s | accept to authenticated, however the bytes trickle | `handshake_timeouts` |
| `IDLE_TIMEOUT_S` | 60 s | between two messages; the server then closes | `idle_closed` |
| `FRAME_TIMEOUT_S` | 10 s | a message's header and meta, once its first byte came | `frame_timeouts` |
| `MAX_TTL_S` | 60 s | a message's `ttl_ms` (its whole payload; + `TTL_GRACE_S`) | `frame_timeouts` |
| `wire.MAX_OPS` | 65,536 | ops per message (what the sender's split makes) | `oversized_frames` |
| `wire.max_meta(n_ops)` | n_ops × 18 B + 263,170 B (at most 1.44 MB) | meta bytes; read as they arrive, never preallocated | `oversized_frames` |

`MAX_TTL_S`: the sender sets a message's ttl from its write deadline (P: the abort timeout, 30 s by
default); a message carries at most 256 MiB (4 MiB with a secret), which needs well under a minute
even on a 10 MB/s link, so a minute bounds how long a stalled or hostile message holds a thread. On
the sending side `CLIENT_IDLE_S` (half of `IDLE_TIMEOUT_S`) retires pooled connections before any
server would, and a pooled connection found closed before any reply is retried once on a fresh one
(`stale_retries`).
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_CONNECTIONS = 256
MAX_CONNECTIONS_PER_IP = 64
HANDSHAKE_TIMEOUT_S = 5.0
IDLE_TIMEOUT_S = 60.0
FRAME_TIMEOUT_S = 10.0
MAX_TTL_S = 60.0
TTL_GRACE_S = 1.0  # slack past the sender's own deadline before a stalled message is dropped
CLIENT_IDLE_S = IDLE_TIMEOUT_S / 2


@dataclass(frozen=True, slots=True)
class Limits:
    max_connections: int = MAX_CONNECTIONS
    max_connections_per_ip: int = MAX_CONNECTIONS_PER_IP
    handshake_timeout: float = HANDSHAKE_TIMEOUT_S
    idle_timeout: float = IDLE_TIMEOUT_S
    frame_timeout: float = FRAME_TIMEOUT_S
    max_ttl: float = MAX_TTL_S
    ttl_grace: float = TTL_GRACE_S
    client_idle: float = CLIENT_IDLE_S  # sender: a pooled connection idle longer is closed, not reused
