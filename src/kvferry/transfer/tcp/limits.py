"""What a stranger who reaches the data-plane port can make the receiver spend, bounded by construction:
each limit is the default of one `Limits` field, each refusal counted in `stats`.

Strangers and peers never share a budget: a connection is *pending* until its handshake succeeded. A full
pending budget evicts the oldest pending connection of the arrival's bucket when that bucket holds its
share, else of the fullest bucket, so a flood of half-open connections only churns itself."""

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
    """The addresses one party is assumed to hold: an IPv4 /24 (all of 127/8), an IPv6 /64."""
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
