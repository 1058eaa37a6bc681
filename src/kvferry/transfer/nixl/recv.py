"""The receiving side of the NIXL engine: grants, and the reads D makes on a sender's request, after
checking every destination lies inside the open grant and the sender's deadline has not passed.

`close` is a fence that never waits: no read starts afterwards and none that ends counts. Reads already
posted may still land (a frozen sender holds them), so the grant is *draining* until each ended. A read
is never cancelled to end it sooner: NIXL reports releasing an active read as success, yet its bytes
still land when the sender resumes."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvferry.transfer.base import ByteRange, TransferError, TransferErrorCause
from kvferry.transfer.grants import Span, allowed_arrays, grant_spans, merge_spans
from kvferry.transfer.nixl import wire as nw
from kvferry.transfer.nixl.regions import NixlRegions, Peers

log = logging.getLogger(__name__)
E = TransferErrorCause


@dataclass(eq=False)
class Grant:
    token: str
    gid: bytes
    regions: tuple[tuple[str, str, int], ...]
    allowed: dict[str, tuple[np.ndarray, np.ndarray]]
    cond: threading.Condition = field(default_factory=threading.Condition)
    open: bool = True
    landed: list[Span] = field(default_factory=list)
    inflight: int = 0
    seen: set[tuple[bytes, int]] = field(default_factory=set)
    cancelled: set[bytes] = field(default_factory=set)

    def inside(self, names: list[str], ridx: np.ndarray, offs: np.ndarray, lens: np.ndarray) -> bool:
        for k, name in enumerate(names):
            sel = ridx == k
            if not sel.any():
                continue
            allowed = self.allowed.get(name)
            if allowed is None:
                return False
            starts, ends = allowed
            o, n = offs[sel], lens[sel]
            idx = np.searchsorted(starts, o, side="right").astype(np.int64) - 1
            end = ends[np.maximum(idx, 0)]
            # `n <= end - o`, not `o + n <= end`: uint64 sums wrap
            if not bool(((idx >= 0) & (o <= end) & (n <= end - np.minimum(o, end))).all()):
                return False
        return True


@dataclass(eq=False)
class Read:
    grant: Grant
    sender: str
    wid: bytes
    chunk: int
    handle: Any
    spans: list[Span]
    deadline: float


class Receiver:
    def __init__(self, agent: Any, regions: NixlRegions, peers: Peers, keys: nw.Keys | None,
                 token_info: Callable[[], tuple[str, str, bytes]], count: Callable[[str], None]) -> None:
        self._agent, self._regions, self._peers, self._keys = agent, regions, peers, keys
        self._token_info = token_info  # (address, agent name, connection metadata)
        self._count = count
        self._lock = threading.Lock()
        self._by_token: dict[str, Grant] = {}
        self._by_gid: dict[bytes, Grant] = {}
        self._reads: list[Read] = []
        self._draining: dict[str, Grant] = {}  # closed grants with reads still posted
        self._posting = 0  # a read inside its posting call (over UCX's tcp it may stream to its end there)
        self._boot = nw.boot_id()

    @property
    def busy(self) -> bool:
        """Grants are open: requests and reads for them want prompt polls (reads of closed grants do not)."""
        return bool(self._by_token)

    @property
    def in_flight(self) -> tuple[int, int]:
        """(reads posted and not ended, closed grants still draining)."""
        return len(self._reads) + self._posting, len(self._draining)

    def draining(self, token: str) -> bool:
        """True while a closed grant still has posted reads (bytes may land): keep its memory."""
        with self._lock:
            return token in self._draining

    def open(self, ranges: Sequence[ByteRange]) -> str:
        merged = merge_spans(grant_spans(self._regions, ranges))
        names = list(dict.fromkeys(s[0] for s in merged))
        infos = []
        for name in names:
            region = self._regions.get(name)
            assert region is not None
            infos.append((name, region.mem, region.dev))
        allowed = allowed_arrays(merged)
        gid = nw.new_gid()
        address, agent, md = self._token_info()
        token = nw.encode_token(nw.Token(gid, address, agent, md, tuple(infos)), self._keys)
        grant = Grant(token, gid, tuple(infos), allowed)
        with self._lock:
            self._by_token[token] = grant
            self._by_gid[gid] = grant
        return token

    def _grant(self, token: str) -> Grant:
        grant = self._by_token.get(token)
        if grant is None:
            raise TransferError(E.INVALID, "unknown or closed grant")
        return grant

    def written(self, token: str) -> list[ByteRange]:
        grant = self._grant(token)
        with grant.cond:
            grant.landed = merge_spans(grant.landed)
            return [ByteRange(r, s, e - s) for r, s, e in grant.landed]

    def close(self, token: str) -> list[ByteRange]:
        with self._lock:
            grant = self._by_token.pop(token, None)
            if grant is not None:
                self._by_gid.pop(grant.gid, None)
        if grant is None:
            raise TransferError(E.INVALID, "unknown or closed grant")
        with grant.cond:
            grant.open = False  # from here no read starts and none that ends counts
            if grant.inflight:
                with self._lock:  # the pump drops it when its last read ends (`_finish`)
                    self._draining[token] = grant
                self._count("fences_deferred")
            grant.landed = merge_spans(grant.landed)
            return [ByteRange(r, s, e - s) for r, s, e in grant.landed]

    def close_all(self) -> None:
        """Engine close: every grant closed, posted reads checked once more, the agent let go."""
        with self._lock:
            grants = list(self._by_token.values())
            self._by_token.clear()
            self._by_gid.clear()
        for grant in grants:
            with grant.cond:
                grant.open = False
        self.poll()
        with self._lock:
            left, self._reads = self._reads, []
        for read in left:  # still posted: NIXL cancels on release (or keeps it until the agent goes)
            try:
                read.handle.release()
            except Exception:  # noqa: BLE001
                log.warning("a posted NIXL read could not be cancelled at close")
        self._agent = None

    def on_note(self, sender: str, note: nw.Note) -> None:
        grant = self._by_gid.get(note.gid)
        if note.kind == nw.PING:
            return
        if note.kind == nw.CANCEL:
            if grant is not None:
                with grant.cond:
                    grant.cancelled.add(note.wid)
            return
        try:
            req = nw.parse_request(note.body)
        except nw.WireError:
            self._count("bad_notes")
            return
        if req.agent != sender:  # the metadata it carries must be the sender's own
            self._count("bad_notes")
            return
        now = time.monotonic()
        deadline = req.deadline_ns / 1e9 if req.boot_id == self._boot else now + req.ttl_ns / 1e9
        try:
            name = self._peers.load(req.agent, req.metadata)
        except TransferError as e:
            self._count("bad_notes")
            log.warning("NIXL request from %r: sender metadata refused: %s", sender, e)
            return
        status = self._start(grant, name, note, req, deadline)
        if status is not None:
            self._ack(name, note, status)

    def _start(self, grant: Grant | None, sender: str, note: nw.Note, req: nw.Request, deadline: float) -> int | None:
        """Post the read of one chunk; the ack status when it cannot be posted, else None."""
        if grant is None:
            self._count("rejected_writes")
            return nw.REJECTED
        ops = req.ops
        ridx, dst, lens = ops["ridx"].astype(np.int64), ops["dst"], ops["len"]
        with grant.cond:
            if (note.wid, note.chunk) in grant.seen or note.wid in grant.cancelled:
                self._count("replayed_notes")
                return None
            grant.seen.add((note.wid, note.chunk))
            names = [r[0] for r in grant.regions]
            if not grant.open or not self._in_regions(names, ridx, dst, lens):
                self._count("rejected_writes")
                return nw.REJECTED
            mems = {grant.regions[i][1] for i in set(ridx.tolist())}
            if len(mems) > 1 or not grant.inside(names, ridx, dst, lens):
                self._count("rejected_writes")
                return nw.REJECTED
            if time.monotonic() >= deadline:
                self._count("late_reads")
                return nw.LATE
            if not len(ops):
                return nw.OK
            local = np.empty((len(ops), 3), np.uint64)
            for k, name in enumerate(names):
                sel = ridx == k
                region = self._regions.get(name)
                if region is None:  # unregistered since the grant opened
                    return nw.REJECTED
                local[sel, 0] = dst[sel] + np.uint64(region.addr)
                local[sel, 2] = region.dev
            local[:, 1] = lens
            remote = np.stack([ops["src"], lens, ops["dev"].astype(np.uint64)], axis=1)
            self._posting += 1
            try:
                handle = self._agent.initialize_xfer("READ", self._agent.get_xfer_descs(local, mems.pop()),
                                                     self._agent.get_xfer_descs(remote, req.src_mem), sender)
                state = self._agent.transfer(handle)
            except Exception as e:  # noqa: BLE001 - NIXL's errors derive from Exception
                self._count("failed_reads")
                log.warning("NIXL read for a grant failed to start: %r", e)
                return nw.FAILED
            finally:
                self._posting -= 1
            spans = [(names[int(i)], int(o), int(o) + int(n)) for i, o, n in zip(ridx, dst, lens, strict=True)]
            grant.inflight += 1
        read = Read(grant, sender, note.wid, note.chunk, handle, spans, deadline)
        if state == "PROC":
            with self._lock:
                self._reads.append(read)
            return None
        self._finish(read, state)
        return None

    def _in_regions(self, names: list[str], ridx: np.ndarray, dst: np.ndarray, lens: np.ndarray) -> bool:
        """Every op lies inside one of the grant's regions, checked first so that no sum below can wrap."""
        if bool((ridx >= len(names)).any()):
            return False
        sizes = np.array([r.size if (r := self._regions.get(n)) else 0 for n in names], np.uint64)[ridx]
        return not bool(((dst > sizes) | (lens > sizes - np.minimum(dst, sizes))).any())

    def poll(self) -> bool:
        """Check posted reads; True when one ended (the pump's sign of progress)."""
        with self._lock:
            reads = list(self._reads)
        ended = False
        for read in reads:
            try:
                state = self._agent.check_xfer_state(read.handle)
            except Exception:  # noqa: BLE001
                state = "ERR"
            if state != "PROC":
                with self._lock:
                    self._reads.remove(read)
                self._finish(read, state)
                ended = True
        return ended

    def _finish(self, read: Read, state: str) -> None:
        grant = read.grant
        with grant.cond:
            if state != "DONE":
                status = nw.FAILED
                self._count("failed_reads")
            elif not grant.open or read.wid in grant.cancelled:
                status = nw.REJECTED  # landed inside the grant, but after it closed: not counted
            elif time.monotonic() > read.deadline:
                status = nw.LATE
                self._count("late_reads")
            else:
                grant.landed.extend(read.spans)
                status = nw.OK
            grant.inflight -= 1
            if not grant.open and not grant.inflight:
                with self._lock:  # its last posted read ended: the closed grant's memory is D's again
                    self._draining.pop(grant.token, None)
            grant.cond.notify_all()
        try:
            read.handle.release()
        except Exception as e:  # noqa: BLE001
            log.warning("NIXL read handle not released: %r", e)
        self._ack(read.sender, nw.Note(nw.ACK, grant.gid, read.wid, read.chunk, b""), status)

    def _ack(self, sender: str, note: nw.Note, status: int) -> None:
        data = nw.encode_note(nw.ACK, note.gid, note.wid, note.chunk, nw.ack_body(status),
                              self._keys.d2p if self._keys else None)
        try:
            self._agent.send_notif(sender, data)
        except Exception:  # noqa: BLE001 - the sender is gone; its write fails on its side
            self._count("unacked")
