"""The NIXL engine's registered regions (host or CUDA memory) and the remote agents it has loaded."""

from __future__ import annotations

import contextlib
import hashlib
import sys
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvferry.transfer.base import TransferError, TransferErrorCause
from kvferry.transfer.nixl import api as nixl_api
from kvferry.transfer.regions import base_address, byte_view

E = TransferErrorCause
MAX_PEERS = 256  # remote agents kept loaded (least recently used dropped first)


@dataclass(eq=False)
class NxRegion:
    name: str
    addr: int
    size: int
    mem: str  # "DRAM" or "VRAM"
    dev: int
    owner: Any = field(repr=False)  # keeps the buffer alive while registered
    reg: Any = field(default=None, repr=False)  # NIXL's registration list


def describe(buffer: Any) -> tuple[int, int, str, int]:
    """(address, bytes, memory type, device) of a writable C-contiguous host buffer or CUDA tensor."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(buffer, torch.Tensor):
        if not buffer.is_contiguous():
            raise TransferError(E.INVALID, "tensor must be contiguous")
        size = buffer.numel() * buffer.element_size()
        if buffer.is_cuda:
            return int(buffer.data_ptr()), size, "VRAM", int(buffer.get_device())
        buffer = buffer.numpy()  # host tensor: a view of the same memory
    view = byte_view(buffer)
    return base_address(view), view.nbytes, "DRAM", 0


class NixlRegions:
    def __init__(self, agent: Any) -> None:
        self._agent = agent
        self._lock = threading.Lock()
        self._regions: dict[str, NxRegion] = {}
        self._md: dict[tuple[str, frozenset[str]], bytes] = {}

    def add(self, name: str, buffer: Any) -> NxRegion:
        addr, size, mem, dev = describe(buffer)
        region = NxRegion(name, addr, size, mem, dev, buffer)
        with self._lock:
            if name in self._regions:
                raise TransferError(E.INVALID, f"region {name!r} already registered")
            self._regions[name] = region
            self._md.clear()
        if size:
            rows = np.array([[addr, size, dev]], np.uint64)
            failed = nixl_api.call(lambda: setattr(region, "reg", self._agent.register_memory(rows, mem)))
            if failed is not None:
                with self._lock:
                    self._regions.pop(name, None)
                raise TransferError(E.INVALID, f"NIXL refused to register {name!r}: {failed}")
        return region

    def remove(self, name: str) -> NxRegion:
        with self._lock:
            region = self._regions.pop(name, None)
            self._md.clear()
        if region is None:
            raise TransferError(E.INVALID, f"unknown region {name!r}")
        self._deregister(region)
        return region

    def _deregister(self, region: NxRegion) -> None:
        if region.reg is not None:
            self._agent.deregister_memory(region.reg)
            region.reg = None

    def get(self, name: str) -> NxRegion | None:
        return self._regions.get(name)

    def metadata(self, mem: str, names: frozenset[str]) -> bytes:
        """Partial metadata: connection info and exactly the regions `names` (all of type `mem`)."""
        key = (mem, names)
        md = self._md.get(key)
        if md is None:
            with self._lock:
                rows = [[r.addr, r.size, r.dev] for n in sorted(names) if (r := self._regions.get(n)) and r.size]
            md = self._agent.get_partial_agent_metadata(
                self._agent.get_reg_descs(np.array(rows, np.uint64), mem), True)
            self._md[key] = md
        return bytes(md)

    def clear(self) -> None:
        with self._lock:
            regions = list(self._regions.values())
            self._regions.clear()
            self._md.clear()
        for region in regions:
            self._deregister(region)
        self._agent = None


class Peers:
    """Remote agents loaded from tokens (D's, on P) and requests (P's, on D); bounded."""

    def __init__(self, agent: Any) -> None:
        self._agent = agent
        self._lock = threading.Lock()
        self._loaded: OrderedDict[str, set[bytes]] = OrderedDict()

    def load(self, name: str, metadata: bytes) -> str:
        digest = hashlib.sha256(metadata).digest()[:16]
        with self._lock:
            known = self._loaded.get(name)
            if known is not None and digest in known:
                self._loaded.move_to_end(name)
                return name
            out: list[Any] = []
            failed = nixl_api.call(lambda: out.append(self._agent.add_remote_agent(metadata)))
            if failed is not None:
                raise TransferError(E.REFUSED, f"NIXL refused the peer's metadata: {failed}")
            loaded = out[0].decode() if isinstance(out[0], bytes) else str(out[0])
            if loaded != name:
                if loaded not in self._loaded:
                    self._remove(loaded)
                raise TransferError(E.REJECTED, f"metadata names agent {loaded!r}, not {name!r}")
            self._loaded.setdefault(name, set()).add(digest)
            self._loaded.move_to_end(name)
            while len(self._loaded) > MAX_PEERS:
                self._remove(next(iter(self._loaded)))
        return name

    def _remove(self, name: str) -> None:
        self._loaded.pop(name, None)
        with contextlib.suppress(Exception):  # already gone
            self._agent.remove_remote_agent(name)

    def clear(self) -> None:
        with self._lock:
            for name in list(self._loaded):
                self._remove(name)
            self._agent = None
