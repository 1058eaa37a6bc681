"""Optional backend on Mooncake Transfer Engine (`pip install 'kvferry[mooncake]'` + Debian libibverbs1).

Mooncake writes raw memory on the receiver without asking it, so this backend cannot enforce grants: the
token carries the receiver's base addresses, `written` is always empty, `close_grant` is NOT a fence and
`tracks_progress` is False. Its listeners bind all interfaces without authentication. One sending engine
per peer with one job in flight (more can wedge the connection), waited for only until the deadline."""

from __future__ import annotations

import base64
import json
import os
import secrets
import threading
import time
from collections.abc import Sequence
from typing import Any

from kvferry.transfer.base import ByteRange, TransferEngine, TransferError, TransferErrorCause, WriteOp
from kvferry.transfer.regions import Region, RegionTable

try:
    import mooncake.engine as _mc

    _Mooncake: Any = _mc.TransferEngine
except ImportError:  # optional dependency (or libibverbs1 missing)
    _Mooncake = None

E = TransferErrorCause
MAX_ENTRIES = 1024  # per call and per peer in flight
MAX_FAILURES = 2  # consecutive failures to a peer before its sending engine is re-created


def available() -> bool:
    return _Mooncake is not None


def _new_engine(host: str, protocol: str) -> Any:
    if _Mooncake is None:
        raise TransferError(E.INVALID, "mooncake is not installed (pip install 'kvferry[mooncake]')")
    os.environ.setdefault("MC_TRANSFER_TIMEOUT", "5")  # its minimum; ours is the caller's deadline
    engine = _Mooncake()
    if engine.initialize(host, "P2PHANDSHAKE", protocol, "") != 0:
        raise TransferError(E.REFUSED, "mooncake engine failed to initialise")
    return engine


def encode_token(regions: dict[str, tuple[int, int]]) -> str:
    blob = base64.urlsafe_b64encode(json.dumps(regions, separators=(",", ":")).encode()).decode()
    return f"{secrets.token_hex(16)}.{blob}"


def decode_token(token: str) -> dict[str, tuple[int, int]]:
    try:
        raw = json.loads(base64.urlsafe_b64decode(token.split(".", 1)[1]))
        return {str(k): (int(v[0]), int(v[1])) for k, v in raw.items()}
    except (IndexError, ValueError, TypeError, AttributeError) as e:
        raise TransferError(E.INVALID, f"bad mooncake grant token: {e}") from e


class _Link:
    """The sending side towards one peer; `busy` is held by the worker while a job is in flight."""

    def __init__(self) -> None:
        self.engine: Any = None
        self.busy = threading.Lock()
        self.failures = 0


class MooncakeTransferEngine(TransferEngine):
    def __init__(self, host: str = "127.0.0.1", protocol: str = "tcp") -> None:
        self._host, self._protocol = host, protocol
        self._recv = _new_engine(host, protocol)
        self._address = f"{host}:{self._recv.get_rpc_port()}"
        self._regions = RegionTable()
        self._grants: dict[str, list[ByteRange]] = {}
        self._links: dict[str, _Link] = {}
        self._lock = threading.Lock()
        self._closed = False

    @property
    def address(self) -> str:
        return self._address

    @property
    def tracks_progress(self) -> bool:
        return False

    def remote_region_addrs(self) -> dict[str, tuple[int, int]]:
        """Registered regions as name → (base address, size), as a sender needs them."""
        return {r.name: (r.addr, r.size) for r in self._regions.all()}

    def register(self, name: str, buffer: Any) -> None:
        self._check_open()
        region = self._regions.add(name, buffer)
        if self._recv.register_memory(region.addr, region.size) != 0:
            self._regions.remove(name)
            raise TransferError(E.INVALID, f"mooncake refused to register {name!r}")

    def unregister(self, name: str) -> None:
        region = self._regions.remove(name)
        if self._recv is not None:
            self._recv.unregister_memory(region.addr)

    def open_grant(self, ranges: Sequence[ByteRange]) -> str:
        self._check_open()
        addrs = self.remote_region_addrs()
        for r in ranges:
            if r.region not in addrs or r.offset < 0 or r.end > addrs[r.region][1]:
                raise TransferError(E.INVALID, f"grant range {r} outside a registered region")
        token = encode_token({r.region: addrs[r.region] for r in ranges})
        with self._lock:
            self._grants[token] = list(ranges)
        return token

    def written(self, token: str) -> list[ByteRange]:
        return []  # Mooncake never tells the receiver what landed

    def close_grant(self, token: str) -> list[ByteRange]:
        with self._lock:
            self._grants.pop(token, None)
        return []

    def write(self, peer: str, token: str, ops: Sequence[WriteOp], deadline: float) -> None:
        self._check_open()
        remote = decode_token(token)
        batches, keep = self._plan(remote, ops)
        if not batches:
            return
        with self._lock:
            link = self._links.setdefault(peer, _Link())
        if not link.busy.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise TransferError(E.TIMEOUT, f"an earlier transfer to {peer} is still in flight")
        try:
            if link.engine is None:
                link.engine = _new_engine(self._host, self._protocol)
        except BaseException:
            link.busy.release()
            raise
        job = _Job(link, peer, batches, keep)
        threading.Thread(target=job.run, name="kvferry-mooncake", daemon=True).start()
        if not job.done.wait(max(0.0, deadline - time.monotonic())):
            job.cancel = True
            self._fail(link, force=True)
            raise TransferError(E.TIMEOUT, f"mooncake write to {peer} passed its deadline")
        if job.error:
            self._fail(link, force=False)
            raise TransferError(E.RESET, f"mooncake write to {peer} failed: {job.error}")
        link.failures = 0

    def _fail(self, link: _Link, force: bool) -> None:
        link.failures += 1
        if force or link.failures >= MAX_FAILURES:
            link.engine = None  # the worker keeps the old one alive until its call returns
            link.failures = 0

    def _plan(self, remote: dict[str, tuple[int, int]],
              ops: Sequence[WriteOp]) -> tuple[list[tuple[list[int], list[int], list[int]]], list[Region]]:
        """Coalesced (src address, dst address, length) runs, in batches of ≤ MAX_ENTRIES."""
        srcs: list[int] = []
        dsts: list[int] = []
        lens: list[int] = []
        keep: dict[str, Region] = {}
        for op in ops:
            region = keep.get(op.src_region) or self._regions.get(op.src_region)
            if region is None:
                raise TransferError(E.INVALID, f"unknown local region {op.src_region!r}")
            keep[op.src_region] = region
            if op.dst_region not in remote:
                raise TransferError(E.INVALID, f"the grant token does not cover region {op.dst_region!r}")
            base, size = remote[op.dst_region]
            bad_src = op.src_offset < 0 or op.src_offset + op.length > region.size
            if op.length < 0 or bad_src or op.dst_offset < 0 or op.dst_offset + op.length > size:
                raise TransferError(E.INVALID, f"bad op {op}")
            if op.length == 0:
                continue
            s, d = region.addr + op.src_offset, base + op.dst_offset
            if lens and srcs[-1] + lens[-1] == s and dsts[-1] + lens[-1] == d:
                lens[-1] += op.length
            else:
                srcs.append(s)
                dsts.append(d)
                lens.append(op.length)
        batches = [
            (srcs[i : i + MAX_ENTRIES], dsts[i : i + MAX_ENTRIES], lens[i : i + MAX_ENTRIES])
            for i in range(0, len(lens), MAX_ENTRIES)
        ]
        return batches, list(keep.values())

    def _check_open(self) -> None:
        if self._closed:
            raise TransferError(E.CLOSED, "engine closed")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with self._lock:
            for link in self._links.values():
                link.engine = None
            self._links.clear()
        for region in self._regions.all():
            self._recv.unregister_memory(region.addr)
        self._recv = None


class _Job:
    def __init__(self, link: _Link, peer: str, batches: list[tuple[list[int], list[int], list[int]]],
                 keep: list[Region]) -> None:
        self.engine = link.engine
        self.busy = link.busy
        self.peer = peer
        self.batches = batches
        self.keep = keep  # source buffers stay alive while Mooncake reads them
        self.cancel = False
        self.error = ""
        self.done = threading.Event()

    def run(self) -> None:
        try:
            for srcs, dsts, lens in self.batches:
                if self.cancel:
                    return
                ret = self.engine.batch_transfer_sync_write(self.peer, srcs, dsts, lens)
                if ret != 0:
                    self.error = f"batch_transfer_sync_write returned {ret}"
                    return
        except Exception as e:  # noqa: BLE001 - reported to the waiting caller
            self.error = repr(e)
        finally:
            self.busy.release()
            self.done.set()
