"""Run a process in a private network namespace (only a loopback inside): Mooncake's listeners bind every
interface without authentication."""

from __future__ import annotations

import fcntl
import functools
import os
import shutil
import socket
import struct
import subprocess

_SIOCGIFFLAGS = 0x8913
_SIOCSIFFLAGS = 0x8914
_IFF_UP = 0x1
_IFREQ = struct.Struct("16sH22x")


@functools.cache
def unshare_prefix() -> list[str] | None:
    """The command prefix that enters a fresh network namespace here, or None when none works."""
    exe = shutil.which("unshare")
    if exe is None:
        return None
    candidates = [[exe, "--net"]] if os.geteuid() == 0 else []
    candidates.append([exe, "--user", "--map-root-user", "--net"])  # unprivileged users
    for prefix in candidates:
        try:
            ok = subprocess.run([*prefix, "true"], capture_output=True, timeout=10).returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            ok = False
        if ok:
            return prefix
    return None


def loopback_up() -> None:
    """Bring `lo` up (a new namespace starts with it down); no `ip` binary needed."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        got = fcntl.ioctl(s, _SIOCGIFFLAGS, _IFREQ.pack(b"lo", 0))
        flags = _IFREQ.unpack(got)[1]
        fcntl.ioctl(s, _SIOCSIFFLAGS, _IFREQ.pack(b"lo", flags | _IFF_UP))
