"""Write grants on the receive side: which ranges a token may write, and which bytes landed."""

from __future__ import annotations

import secrets
import threading
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from kvferry.transfer.base import ByteRange, TransferError, TransferErrorCause
from kvferry.transfer.regions import RegionTable

Span = tuple[str, int, int]  # region, start, end


def merge_spans(spans: Iterable[Span]) -> list[Span]:
    """Sorted spans with overlapping and touching ones merged."""
    out: list[Span] = []
    for region, start, end in sorted(spans):
        if out and out[-1][0] == region and start <= out[-1][2]:
            if end > out[-1][2]:
                out[-1] = (region, out[-1][1], end)
        else:
            out.append((region, start, end))
    return out


def allowed_arrays(spans: Sequence[Span]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Merged spans per region as sorted (starts, ends) arrays, for vectorised checks."""
    return {region: (np.array([s[1] for s in spans if s[0] == region], np.uint64),
                     np.array([s[2] for s in spans if s[0] == region], np.uint64))
            for region in dict.fromkeys(s[0] for s in spans)}


class Progress:
    """How far one incoming message got: ops[:done] complete, then `partial` bytes of ops[done]; spans are
    built only when someone asks, so the receive loop bumps two integers per chunk."""

    __slots__ = ("names", "ridx", "offs", "lens", "done", "partial", "folded", "finished")

    def __init__(self, names: list[str], ridx: list[int], offs: list[int], lens: list[int]) -> None:
        self.names, self.ridx, self.offs, self.lens = names, ridx, offs, lens
        self.done = self.partial = self.folded = 0
        self.finished = False  # no byte will land any more (complete, fenced or connection gone)

    def fold(self, out: list[Span]) -> None:
        """Append the spans completed since the last fold (and the current partial prefix)."""
        names, ridx, offs, lens = self.names, self.ridx, self.offs, self.lens
        out.extend((names[ridx[k]], offs[k], offs[k] + lens[k]) for k in range(self.folded, self.done))
        self.folded = self.done
        if self.partial:
            k = self.done
            out.append((names[ridx[k]], offs[k], offs[k] + self.partial))


class Grant:
    """Writers hold `lock` while bytes land and check `open` first, so `close` is a hard fence."""

    def __init__(self, token: str, spans: list[Span]) -> None:
        self.token = token
        self.lock = threading.Lock()
        self.open = True
        self.allowed = allowed_arrays(spans)
        self._landed: list[Span] = []  # merged
        self._active: list[Progress] = []  # messages landing (or that landed) since the last fold
        self.poisoned = False  # a tag failed on this grant: nothing of it counts, nothing more lands

    def track(self, progress: Progress) -> None:
        """Caller holds `lock`."""
        self._active.append(progress)

    def poison(self) -> None:
        """A message failed its tag: nothing counts as written and every further byte is refused, so the
        transfer fails. Caller holds `lock`."""
        self.poisoned = True
        self.open = False

    def landed(self) -> list[ByteRange]:
        """What landed (with a secret only verified messages land, whole). Caller holds `lock`."""
        if self.poisoned:
            return []
        spans = self._landed
        for p in self._active:
            p.fold(spans)
        self._active = [p for p in self._active if not p.finished]
        self._landed = merge_spans(spans)
        return [ByteRange(r, s, e - s) for r, s, e in self._landed]

    def outside(self, region: str, offsets: np.ndarray, lengths: np.ndarray) -> bool:
        """True when any [offset, offset+length) is not inside one allowed (merged) range."""
        allowed = self.allowed.get(region)
        if allowed is None:
            return True
        starts, ends = allowed
        idx = np.searchsorted(starts, offsets, side="right").astype(np.int64) - 1
        inside = (idx >= 0) & (offsets + lengths <= ends[np.maximum(idx, 0)])
        return not bool(inside.all())


class GrantTable:
    def __init__(self, regions: RegionTable) -> None:
        self._regions = regions
        self._lock = threading.Lock()
        self._grants: dict[str, Grant] = {}

    def open(self, ranges: Sequence[ByteRange]) -> str:
        spans = grant_spans(self._regions, ranges)
        token = secrets.token_hex(16)
        with self._lock:
            self._grants[token] = Grant(token, merge_spans(spans))
        return token

    def get(self, token: str) -> Grant | None:
        return self._grants.get(token)

    def written(self, token: str) -> list[ByteRange]:
        grant = self._grants.get(token)
        if grant is None:
            raise TransferError(TransferErrorCause.INVALID, "unknown or closed grant")
        with grant.lock:
            return grant.landed()

    def close(self, token: str) -> list[ByteRange]:
        with self._lock:
            grant = self._grants.pop(token, None)
        if grant is None:
            raise TransferError(TransferErrorCause.INVALID, "unknown or closed grant")
        with grant.lock:  # waits for a chunk that is landing right now
            grant.open = False
            return grant.landed()

    def fence(self, region: str) -> None:
        """Wait until no chunk is landing in any grant on `region` (used by unregister)."""
        with self._lock:
            grants = [g for g in self._grants.values() if region in g.allowed]
        for g in grants:
            with g.lock:
                pass

    def close_all(self) -> None:
        with self._lock:
            grants = list(self._grants.values())
            self._grants.clear()
        for g in grants:
            with g.lock:
                g.open = False


def grant_spans(regions: Any, ranges: Sequence[ByteRange]) -> list[Span]:
    """The non-empty `ranges` as spans, each checked against its registered region (`regions.get`)."""
    spans: list[Span] = []
    for r in ranges:
        region = regions.get(r.region)
        if region is None:
            raise TransferError(TransferErrorCause.INVALID, f"grant on unknown region {r.region!r}")
        if r.offset < 0 or r.length < 0 or r.end > region.size:
            raise TransferError(TransferErrorCause.INVALID, f"grant range {r} outside its region")
        if r.length:
            spans.append((r.region, r.offset, r.end))
    return spans
