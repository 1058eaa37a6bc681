"""Turn a write's ops into wire messages: validate, coalesce adjacent runs, split, make iovecs.

Vectorised with numpy, since a per-op Python loop costs more than the bytes. A message holds at most
`wire.MSG_OPS` ops and `wire.MSG_BYTES` bytes (`wire.AUTH_MSG_BYTES` with a secret, as each side
encrypts or decrypts a whole message in one call)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from kvferry.transfer.base import TransferError, TransferErrorCause, WriteOp
from kvferry.transfer.regions import RegionTable
from kvferry.transfer.tcp import gather, iovec, wire

E = TransferErrorCause


@dataclass(slots=True)
class Message:
    """One wire message: header+meta bytes, then the payload as source memoryviews or an iovec table."""

    head: bytes
    views: list[memoryview]  # empty when `iov` is set
    payload: int
    # Without auth (Linux): rows (address, length), the head first; `keep` holds the sources alive.
    iov: np.ndarray | None = None
    keep: list[object] = field(default_factory=list)
    # With a secret and one source region and length: (the region's `windows`, the ops' offsets).
    rows: tuple[np.ndarray, np.ndarray] | None = None


def _index(names: list[str]) -> tuple[list[str], np.ndarray]:
    uniq = list(dict.fromkeys(names))
    if len(uniq) == 1:
        return uniq, np.zeros(len(names), np.int64)
    pos = {n: i for i, n in enumerate(uniq)}
    return uniq, np.array([pos[n] for n in names], np.int64)


def _cut(so: np.ndarray, do: np.ndarray, ln: np.ndarray, sid: np.ndarray, did: np.ndarray,
         cap: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Ops longer than `cap` cut into pieces of at most `cap` bytes, in order."""
    reps = (ln + cap - 1) // cap
    idx = np.repeat(np.arange(len(ln)), reps)
    k = (np.arange(len(idx)) - np.repeat(np.cumsum(reps) - reps, reps)) * cap  # piece start within op
    return so[idx] + k, do[idx] + k, np.minimum(ln[idx] - k, cap), sid[idx], did[idx]


def _bounds(ln: np.ndarray, max_ops: int, max_bytes: int) -> list[tuple[int, int]]:
    """[a, b) op ranges of the messages: at most `max_ops` ops and (ops permitting) `max_bytes`."""
    ends = np.cumsum(ln)
    out, a = [], 0
    while a < len(ln):
        base = int(ends[a - 1]) if a else 0
        b = int(np.searchsorted(ends, base + max_bytes, side="right"))
        b = min(max(b, a + 1), a + max_ops)
        out.append((a, b))
        a = b
    return out


def plan(regions: RegionTable, token: str, ops: Sequence[WriteOp], deadline: float,
         auth: bool = False) -> list[Message]:
    try:
        raw_token = wire.token_bytes(token)
    except ValueError as e:
        raise TransferError(E.INVALID, f"bad grant token: {e}") from e
    if not ops:
        return []
    try:
        so = np.array([op.src_offset for op in ops], np.int64)
        do = np.array([op.dst_offset for op in ops], np.int64)
        ln = np.array([op.length for op in ops], np.int64)
    except OverflowError as e:
        raise TransferError(E.INVALID, f"op offset or length out of range: {e}") from e
    snames, sid = _index([op.src_region for op in ops])
    dnames, did = _index([op.dst_region for op in ops])
    src = []
    for name in snames:
        region = regions.get(name)
        if region is None:
            raise TransferError(E.INVALID, f"unknown local region {name!r}")
        src.append(region)
    size = np.array([r.size for r in src], np.int64)[sid]
    bad = (so < 0) | (do < 0) | (ln < 0) | (so > size - ln)
    if bad.any():
        raise TransferError(E.INVALID, f"bad op {ops[int(np.argmax(bad))]}")
    if not ln.all():  # drop empty ops
        keep = ln > 0
        so, do, ln, sid, did = so[keep], do[keep], ln[keep], sid[keep], did[keep]
    if len(ln) > 1:  # a run continues the previous one when both src and dst are contiguous
        cont = (so[1:] == so[:-1] + ln[:-1]) & (do[1:] == do[:-1] + ln[:-1])
        cont &= (sid[1:] == sid[:-1]) & (did[1:] == did[:-1])
        if cont.any():
            starts = np.flatnonzero(np.concatenate(([True], ~cont)))
            ln = np.add.reduceat(ln, starts)
            so, do, sid, did = so[starts], do[starts], sid[starts], did[starts]
    max_bytes = wire.AUTH_MSG_BYTES if auth else wire.MSG_BYTES
    if len(ln) and int(ln.max()) > max_bytes:
        so, do, ln, sid, did = _cut(so, do, ln, sid, did, max_bytes)
    ttl_ms = max(0, min(int((deadline - time.monotonic()) * 1000) + 1, 0xFFFFFFFF))
    by_addr = not auth and iovec.AVAILABLE  # no Python object per op (with a secret: views to encrypt)
    ptrs = np.array([r.addr for r in src], np.uint64)[sid] + so.astype(np.uint64) if by_addr else None
    messages = []
    wins: dict[tuple[int, int], np.ndarray] = {}  # (source region, op length) → its window view
    for a, b in _bounds(ln, wire.MSG_OPS, max_bytes):
        meta = wire.encode_meta(dnames, did[a:b], do[a:b], ln[a:b])
        payload = int(ln[a:b].sum())
        n = len(ln[a:b])
        head = wire.MSG.pack(wire.MSG_MAGIC, wire.VERSION, raw_token, n, len(meta), payload, ttl_ms)
        if ptrs is not None:
            whole = head + meta
            iov = np.empty((n + 1, 2), np.uint64)
            iov[0] = (iovec.address(whole), len(whole))
            iov[1:, 0], iov[1:, 1] = ptrs[a:b], ln[a:b]
            messages.append(Message(whole, [], payload, iov=iov, keep=[r.view for r in src]))
            continue
        size = gather.uniform(ln[a:b], sid[a:b]) if auth else 0
        if size:
            key = (int(sid[a]), size)
            if key not in wins:
                wins[key] = gather.windows(src[key[0]].view, size, writeable=False)
            messages.append(Message(head + meta, [], payload, rows=(wins[key], so[a:b].astype(np.intp))))
            continue
        offs, lens = so[a:b].tolist(), ln[a:b].tolist()
        if len(src) == 1:
            v = src[0].view
            views = [v[o : o + k] for o, k in zip(offs, lens, strict=True)]
        else:
            mvs = [r.view for r in src]
            views = [mvs[s][o : o + k] for s, o, k in zip(sid[a:b].tolist(), offs, lens, strict=True)]
        messages.append(Message(head + meta, views, payload))
    return messages
