"""Registered memory regions, shared by the engines (send and receive side)."""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvferry.transfer.base import TransferError, TransferErrorCause


@dataclass(eq=False)
class Region:
    name: str
    view: memoryview  # flat, unsigned bytes, writable
    addr: int  # base pointer (Mooncake needs raw addresses)
    owner: Any = field(repr=False)  # keeps the buffer alive while registered
    alive: bool = True  # cleared by unregister; receivers stop writing into a dead region

    @property
    def size(self) -> int:
        return self.view.nbytes


def byte_view(buffer: Any) -> memoryview:
    """A flat writable byte view of a C-contiguous buffer, without copying."""
    if isinstance(buffer, np.ndarray):
        if not buffer.flags.c_contiguous:
            raise TransferError(TransferErrorCause.INVALID, "buffer must be C-contiguous")
        buffer = buffer.reshape(-1).view(np.uint8)
    try:
        mv = memoryview(buffer)
    except TypeError as e:
        raise TransferError(TransferErrorCause.INVALID, f"not a buffer: {e}") from e
    if mv.readonly or not mv.c_contiguous:
        raise TransferError(TransferErrorCause.INVALID, "buffer must be writable and C-contiguous")
    return mv.cast("B") if (mv.format != "B" or mv.ndim != 1) else mv


def base_address(view: memoryview) -> int:
    if view.nbytes == 0:
        return 0
    return ctypes.addressof(ctypes.c_ubyte.from_buffer(view))


class RegionTable:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._regions: dict[str, Region] = {}

    def add(self, name: str, buffer: Any) -> Region:
        view = byte_view(buffer)
        region = Region(name, view, base_address(view), buffer)
        with self._lock:
            if name in self._regions:
                raise TransferError(TransferErrorCause.INVALID, f"region {name!r} already registered")
            self._regions[name] = region
        return region

    def remove(self, name: str) -> Region:
        with self._lock:
            region = self._regions.pop(name, None)
        if region is None:
            raise TransferError(TransferErrorCause.INVALID, f"unknown region {name!r}")
        region.alive = False
        return region

    def get(self, name: str) -> Region | None:
        return self._regions.get(name)

    def all(self) -> list[Region]:
        with self._lock:
            return list(self._regions.values())
