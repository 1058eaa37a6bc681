"""`host:port` addresses of the data planes, spelt one way (`canonical_addr`): both engines check that a
token or handshake names the address the writer dialed."""

from __future__ import annotations

import ipaddress


def join_addr(host: str, port: int) -> str:
    """`host:port`, an IPv6 literal in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def split_addr(addr: str) -> tuple[str, str]:
    """(host without brackets, port text); either may be '' (the caller decides what is malformed)."""
    host, _, port = addr.rpartition(":")
    return host.strip("[]"), port


def canonical_addr(addr: str) -> str:
    """`host:port` in one spelling (IP literals normalised, names lower-case); '' if it is not one."""
    host, port = split_addr(addr)
    if ":" not in addr or not host or not port.isdigit():
        return ""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return f"{host.lower()}:{int(port)}"
    return join_addr(str(ip), int(port))


def advertised_addr(advertise: str | None, host: str, bound: int) -> str:
    """The canonical address peers dial: `advertise` (port 0: the bound one), else host and the bound
    port; '' if `advertise` is no address."""
    addr = canonical_addr(advertise or join_addr(host, bound))
    return addr[:-1] + str(bound) if addr.endswith(":0") else addr
