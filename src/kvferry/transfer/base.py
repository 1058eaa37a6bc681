"""The data-plane interface: move bytes from local registered memory into a peer's registered memory.

The receiver accepts bytes only into ranges one of its open *grants* allows, so a stale or hostile writer
never touches memory it was not invited into, and it knows exactly which ranges each grant got written."""

from __future__ import annotations

import abc
import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


class TransferErrorCause(enum.StrEnum):
    TIMEOUT = "timeout"  # deadline passed (peer frozen or too slow)
    REFUSED = "refused"  # could not connect, or authentication refused
    RESET = "reset"  # connection broke mid-transfer (peer died)
    REJECTED = "rejected"  # peer refused the write: no grant, closed grant, out of range, unknown region
    PROTOCOL = "protocol"  # malformed frame
    CLOSED = "closed"  # this engine was closed
    INVALID = "invalid"  # the caller asked for something impossible (unknown local region, bad range)


class TransferError(Exception):
    def __init__(self, cause: TransferErrorCause, message: str) -> None:
        super().__init__(f"{cause.value}: {message}")
        self.cause = cause
        self.message = message


@dataclass(frozen=True, slots=True)
class WriteOp:
    """Copy `length` bytes from local `src_region[src_offset:]` to the peer's `dst_region[dst_offset:]`."""

    src_region: str
    src_offset: int
    dst_region: str
    dst_offset: int
    length: int


@dataclass(frozen=True, slots=True)
class ByteRange:
    region: str
    offset: int
    length: int

    @property
    def end(self) -> int:
        return self.offset + self.length


class TransferEngine(abc.ABC):
    """One endpoint: it can both send (`write`) and receive (its listener, guarded by grants)."""

    @property
    @abc.abstractmethod
    def address(self) -> str:
        """`host:port` that peers pass to `write`."""

    @abc.abstractmethod
    def register(self, name: str, buffer: Any) -> None:
        """Register a writable, C-contiguous buffer (numpy array, bytearray, ...) under `name`."""

    @abc.abstractmethod
    def unregister(self, name: str) -> None: ...

    @abc.abstractmethod
    def open_grant(self, ranges: Sequence[ByteRange]) -> str:
        """Allow peers that present the returned token to write into `ranges` (receiver side)."""

    @abc.abstractmethod
    def written(self, token: str) -> list[ByteRange]:
        """The byte ranges written completely so far under `token`, merged and sorted."""

    @abc.abstractmethod
    def close_grant(self, token: str) -> list[ByteRange]:
        """Close the grant: no byte lands after this returns, or (see `draining`) after the grant has
        drained; nothing that lands after it counts. Returns the final `written` list."""

    @abc.abstractmethod
    def write(self, peer: str, token: str, ops: Sequence[WriteOp], deadline: float) -> None:
        """Write `ops` into `peer` under its grant `token`; returns when all bytes landed. Raises
        `TransferError` on any failure, never later than `deadline` (`time.monotonic()`)."""

    def abort_writes(self, peer: str, token: str | None = None) -> None:  # noqa: B027 (optional: a no-op is correct)
        """Best effort: make the write to `peer` for `token` (all when None) fail now, not at its deadline."""

    def draining(self, token: str) -> bool:
        """True while a closed grant's memory may still receive bytes (a read posted before the close has
        not ended): the caller must not reuse that memory yet."""
        return False

    @property
    def tracks_progress(self) -> bool:
        """True when `written` reports partial progress exactly (per-block recovery is possible)."""
        return True

    @abc.abstractmethod
    def close(self) -> None: ...

    def __enter__(self) -> TransferEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def covered(written: Sequence[ByteRange], want: ByteRange) -> bool:
    """True when `want` lies entirely inside one of the merged, sorted `written` ranges."""
    return any(r.region == want.region and r.offset <= want.offset and want.end <= r.end for r in written)
