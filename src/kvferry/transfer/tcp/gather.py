"""Copies between a sealed message's contiguous buffer and its ops' scattered ranges, vectorised.

A Python slice per op costs more than the 2 KiB it copies, so when every op of a message has one length
and one region (paged KV blocks) numpy copies them all in one fancy-indexing call over a window view of
the region; other messages go slice by slice."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import as_strided


def windows(view: memoryview, length: int, writeable: bool) -> np.ndarray:
    """Row k of the result is view[k : k + length] (no copy): index it with op offsets."""
    flat = np.frombuffer(view, np.uint8)
    rows = flat.size - length + 1
    return as_strided(flat, shape=(max(rows, 0), length), strides=(1, 1), writeable=writeable)


def uniform(lengths: np.ndarray, regions: np.ndarray) -> int:
    """The one length of every op when they share it and their region (0: they do not)."""
    if not len(lengths) or not (lengths == lengths[0]).all() or not (regions == regions[0]).all():
        return 0
    return int(lengths[0])


def scatter(views: list[memoryview], ops: np.ndarray, plain: memoryview) -> None:
    """Copy `plain` (the ops' bytes back to back) to the ops' ranges, already checked in bounds."""
    lens = ops["length"]
    n = uniform(lens, ops["region"])
    if n:
        win = windows(views[int(ops["region"][0])], n, writeable=True)
        win[ops["offset"].astype(np.intp)] = np.frombuffer(plain, np.uint8).reshape(-1, n)
        return
    pos = 0
    for r, o, k in zip(ops["region"].tolist(), ops["offset"].tolist(), lens.tolist(), strict=True):
        views[r][o : o + k] = plain[pos : pos + k]
        pos += k
