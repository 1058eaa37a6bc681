"""`sendmsg`/`recvmsg` on iovec tables built with numpy: scatter/gather without a Python object per op
(with 2 KiB blocks, building a buffer per piece costs more than the kernel's copy). The table goes to libc
through ctypes with the GIL released. Linux only (glibc's and musl's 64-bit `msghdr`); elsewhere
`AVAILABLE` is False. Callers pass only addresses inside memory they keep alive and checked."""

from __future__ import annotations

import bisect
import ctypes
import errno
import os
import select
import socket
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

IOV_MAX = 1024  # Linux's UIO_MAXIOV: iovecs per call
_RETRY = (errno.EINTR,)
_AGAIN = (errno.EAGAIN, errno.EWOULDBLOCK)


class _MsgHdr(ctypes.Structure):
    _fields_ = [
        ("msg_name", ctypes.c_void_p),
        ("msg_namelen", ctypes.c_uint32),
        ("msg_iov", ctypes.c_void_p),
        ("msg_iovlen", ctypes.c_size_t),
        ("msg_control", ctypes.c_void_p),
        ("msg_controllen", ctypes.c_size_t),
        ("msg_flags", ctypes.c_int),
    ]


def _libc() -> ctypes.CDLL | None:
    if sys.platform != "linux" or ctypes.sizeof(ctypes.c_void_p) != 8:
        return None
    try:
        lib = ctypes.CDLL(None, use_errno=True)
        for name in ("sendmsg", "recvmsg"):
            fn = getattr(lib, name)
            fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
            fn.restype = ctypes.c_ssize_t
    except (OSError, AttributeError):
        return None
    return lib


_LIB = _libc()
AVAILABLE = _LIB is not None and ctypes.sizeof(_MsgHdr) == 56


def table(addrs: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """An (n, 2) uint64 iovec table: row i is (address, length) of piece i."""
    iov = np.empty((len(lens), 2), np.uint64)
    iov[:, 0] = addrs
    iov[:, 1] = lens
    return iov


def address(data: bytes) -> int:
    """Where the bytes of an (immutable, kept alive) bytes object start."""
    return int(np.frombuffer(data, np.uint8).ctypes.data) if data else 0


class Io:
    """One socket's calls over rows [i, j) of an iovec table; reuses one msghdr."""

    def __init__(self, sock: socket.socket) -> None:
        assert _LIB is not None
        self._fd = sock.fileno()
        self._hdr = _MsgHdr()
        self._ref = ctypes.byref(self._hdr)
        self._recv = _LIB.recvmsg
        self._send = _LIB.sendmsg

    def _call(self, fn: Callable[[int, Any, int], int], iov: np.ndarray, i: int, j: int,
              flags: int) -> int | None:
        hdr = self._hdr
        hdr.msg_iov = iov.ctypes.data + 16 * i
        hdr.msg_iovlen = min(j, len(iov)) - i
        while True:
            n = fn(self._fd, self._ref, flags)
            if n >= 0:
                return int(n)
            err = ctypes.get_errno()
            if err in _AGAIN:
                return None
            if err not in _RETRY:
                raise OSError(err, os.strerror(err))

    def recv(self, iov: np.ndarray, i: int, j: int) -> int | None:
        """Bytes read into rows [i, j) (0 at EOF); None when nothing is there yet (never blocks)."""
        return self._call(self._recv, iov, i, j, socket.MSG_DONTWAIT)

    def send_all(self, iov: np.ndarray, deadline: float, on_sent: Callable[[int], None]) -> None:
        """Send every row, polling for room until `deadline` (TimeoutError after it). Rows are consumed;
        `on_sent` gets each call's byte count."""
        ends = np.cumsum(iov[:, 1]).tolist()
        n_rows, i, pos = len(iov), 0, 0
        poll = select.poll()
        poll.register(self._fd, select.POLLOUT | select.POLLERR | select.POLLHUP)
        flags = socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL
        while i < n_rows:
            if time.monotonic() >= deadline:  # also when a slow reader keeps taking a little
                raise TimeoutError("send passed its deadline")
            sent = self._call(self._send, iov, i, i + IOV_MAX, flags)
            if sent is None:
                poll.poll(max(0, int((deadline - time.monotonic()) * 1000) + 1))
                continue
            on_sent(sent)
            pos += sent
            i = advance(iov, ends, i, pos)


def advance(iov: np.ndarray, ends: list[int], i: int, pos: int) -> int:
    """The first incomplete row after `pos` bytes went through, re-pointed at its rest; `ends[k]` is where
    row k ends in the stream."""
    k = bisect.bisect_right(ends, pos, i)
    if k < len(ends):
        rest = ends[k] - pos
        done = int(iov[k, 1]) - rest
        if done:
            iov[k, 0] += np.uint64(done)
            iov[k, 1] = rest
    return k
