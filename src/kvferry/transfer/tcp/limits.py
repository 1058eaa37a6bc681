"""What a stranger who reaches the data-plane port can make the receiver spend, bounded by construction.

Every limit is a named constant, the default of one `Limits` field (tests pass smaller ones), and every
refusal it causes is counted in the engine's `stats`:

| constant | default | bounds | counted as |
|---|---|---|---|
| `MAX_PENDING` | 128 | connections still in the handshake (one thread + one fd each); a new one evicts the oldest | `evicted_handshakes` |
| `MAX_PENDING_PER_BUCKET` | 64 | ... from one address bucket (`bucket`: IPv4 /24, all of 127/8, IPv6 /64) | `evicted_handshakes` |
| `HANDSHAKE_TIMEOUT_S` | 2 s | accept to authenticated, however the bytes trickle | `handshake_timeouts` |
| `MAX_CONNECTIONS` | 256 | connections that completed the handshake (proven peers) | `refused_connections` |
| `IDLE_TIMEOUT_S` | 60 s | between two messages; the server then closes | `idle_closed` |
| `FRAME_TIMEOUT_S` | 10 s | a message's header and meta, once its first byte came | `frame_timeouts` |
| `MAX_TTL_S` | 60 s | a message's `ttl_ms` (its whole payload; + `TTL_GRACE_S`) | `frame_timeouts` |
| `wire.MAX_OPS` | 65,536 | ops per message (what the sender's split makes) | `oversized_frames` |
| `wire.max_meta(n_ops)` | n_ops × 18 B + 263,170 B (at most 1.44 MB) | meta bytes; read as they arrive, never preallocated | `oversized_frames` |

Strangers and peers never share a budget: a connection is *pending* from accept until its handshake
succeeded (with a secret: the peer proved it), then moves to the proven budget, which only peers reach.
A pending connection arriving to a full budget evicts the oldest pending one of its own bucket when
that bucket holds its share, else the oldest of the fullest bucket: a flood of half-open connections
only churns itself, and a peer's handshake (a few ms) would have to be outrun by a bucket's whole
share of new arrivals to be cut (measured in docs/security.md).

`MAX_TTL_S`: the sender sets a message's ttl from its write deadline (P: the abort timeout, 30 s by
default); a message carries at most 256 MiB (4 MiB with a secret), which needs well under a minute
even on a 10 MB/s link, so a minute bounds how long a stalled or hostile message holds a thread. On
the sending side `CLIENT_IDLE_S` (half of `IDLE_TIMEOUT_S`) retires pooled connections before any
server would, and a pooled connection found closed before any reply is retried once on a fresh one
(`stale_retries`)."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

MAX_PENDING = 128
MAX_PENDING_PER_BUCKET = 64
HANDSHAKE_TIMEOUT_S = 2.0
MAX_CONNECTIONS = 256
IDLE_TIMEOUT_S = 60.0
FRAME_TIMEOUT_S = 10.0
MAX_TTL_S = 60.0
TTL_GRACE_S = 1.0  # slack past the sender's own deadline before a stalled message is dropped
CLIENT_IDLE_S = IDLE_TIMEOUT_S / 2


@dataclass(frozen=True, slots=True)
class Limits:
    max_pending: int = MAX_PENDING
    max_pending_per_bucket: int = MAX_PENDING_PER_BUCKET
    max_connections: int = MAX_CONNECTIONS
    handshake_timeout: float = HANDSHAKE_TIMEOUT_S
    idle_timeout: float = IDLE_TIMEOUT_S
    frame_timeout: float = FRAME_TIMEOUT_S
    max_ttl: float = MAX_TTL_S
    ttl_grace: float = TTL_GRACE_S
    client_idle: float = CLIENT_IDLE_S  # sender: a pooled connection idle longer is closed, not reused


def bucket(ip: str) -> str:
    """The block of addresses one party is assumed to hold: an IPv4 /24 (all of 127/8 as one: any
    local process can use any of it), an IPv6 /64 (what one subscriber gets); mapped IPv4 as IPv4."""
    try:
        addr = ipaddress.ip_address(ip.split("%", 1)[0])
    except ValueError:
        return ip
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    if isinstance(addr, ipaddress.IPv4Address):
        prefix = 8 if addr.is_loopback else 24
    else:
        prefix = 128 if addr.is_loopback else 64
    return str(ipaddress.ip_network(f"{addr}/{prefix}", strict=False))
