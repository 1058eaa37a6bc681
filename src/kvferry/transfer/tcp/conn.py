"""One accepted data-plane connection: handshake, frame checks, grant checks, scatter into memory.

Sockets stay in blocking mode; every wait is a `poll` with a deadline and every read is MSG_DONTWAIT,
so payload bytes are only ever copied by a short non-blocking call made while holding the grant's
lock, right after checking that the grant is still open (this is what makes `close_grant` a fence).
Nothing is allocated for a frame before its bytes arrive (meta grows as it is read) and every wait
has a deadline from `Limits`.

Without a secret, a rejected message is answered at once and its payload then drained, so the
connection stays usable; progress counts as bytes land. With a secret, a message's bytes still land
as they arrive (no staging copy), but they count as written (grant progress, reply OK) only once its
tag verified, checked under the grant's lock. Until then every range its ops touch is out of what
the grant reports, even ranges an earlier message verified (these bytes may have overwritten them),
and for good if the message never verifies (cut, fenced, or still landing when the grant closes).
A bad tag poisons the whole grant (`Grant.poison`: nothing of it counts, further writes are refused,
so the transfer fails and D recomputes) and closes the connection. Malformed frames close it too.

Without a secret (on Linux) payload bytes go from the socket straight to their ops' addresses with
`recvmsg` over an `iovec` table; with one, into memoryviews whose bytes the tag then hashes.
"""

from __future__ import annotations

import bisect
import contextlib
import hmac
import itertools
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kvferry.transfer.grants import Grant, GrantTable, Progress
from kvferry.transfer.regions import Region, RegionTable
from kvferry.transfer.stats import Counters
from kvferry.transfer.tcp import iovec, wire
from kvferry.transfer.tcp.auth import Tags
from kvferry.transfer.tcp.handshake import server_handshake
from kvferry.transfer.tcp.limits import Limits
from kvferry.transfer.tcp.mac import Mac
from kvferry.transfer.tcp.sockio import Eof, SockIO, Stall


@dataclass(frozen=True)
class ConnContext:
    """What every connection of one server shares: the server hands this, not itself."""

    secret: bytes | None
    advertised: str
    regions: RegionTable
    grants: GrantTable
    limits: Limits
    stats: Counters
    admit: Callable[[Conn], bool]  # handshake done: moves it to the proven budget (False: close it)


class Oversized(wire.ProtocolError):
    pass


class BadTag(wire.ProtocolError):
    pass


class Conn(SockIO):
    """One accepted connection; `serve` runs on its own thread (the server forgets it after)."""

    def __init__(self, ctx: ConnContext, sock: socket.socket, ip: str) -> None:
        super().__init__(sock)
        self.ctx = ctx
        self.limits = ctx.limits
        self.ip = ip
        self.tags: Tags | None = None  # set by an authenticated handshake

    def reply(self, status: wire.Status, code: wire.Code, reason: str = "") -> None:
        data = wire.encode_reply(status, code, reason)
        if self.tags is not None:  # the reply to message k carries a tag with sequence number k
            data += self.tags.send.tag(self.tags.sent, data)
            self.tags.sent += 1
        self.send_all(data, time.monotonic() + self.limits.handshake_timeout)

    def start_tag(self, head: bytes) -> Mac:
        assert self.tags is not None
        mac = self.tags.recv
        mac.start(self.tags.received)
        mac.update(head)
        return mac

    def end_tag(self, mac: Mac, tag: bytes) -> bool:
        assert self.tags is not None
        self.tags.received += 1
        return hmac.compare_digest(mac.finish(), tag)

    def serve(self) -> None:
        stats = self.ctx.stats
        try:
            try:
                ok, self.tags = server_handshake(
                    self, self.ctx.secret, self.ctx.advertised, self.limits.handshake_timeout, stats,
                    lambda: self.ctx.admit(self),
                )
                if not ok:
                    return
            except Stall:
                stats.add("handshake_timeouts")
                return
            while self.serve_message():
                pass
        except wire.ProtocolError as e:
            stats.add("protocol_errors")
            if isinstance(e, Oversized):
                stats.add("oversized_frames")
            if isinstance(e, BadTag):
                stats.add("bad_tags")
            with contextlib.suppress(OSError, Stall):
                self.reply(wire.Status.PROTOCOL, wire.Code.MALFORMED, str(e))
        except Stall:
            stats.add("frame_timeouts")
        except (Eof, OSError):
            pass

    def serve_message(self) -> bool:
        """Handle one write message; False when the peer closed or idled out between messages."""
        lim = self.limits
        try:
            self.wait(time.monotonic() + lim.idle_timeout)
        except Stall:
            self.ctx.stats.add("idle_closed")
            return False
        try:  # a header that started must be complete within the frame timeout (else Stall)
            head = self.recv_exact(wire.MSG.size, time.monotonic() + lim.frame_timeout, eof_ok=True)
        except Eof:
            return False
        magic, version, token, n_ops, meta_len, payload_len, ttl_ms = wire.MSG.unpack(head)
        if magic != wire.MSG_MAGIC or version != wire.VERSION:
            raise wire.ProtocolError("bad message magic or version")
        if n_ops > wire.MAX_OPS or meta_len > wire.max_meta(n_ops):
            raise Oversized(f"message too large ({n_ops} ops, {meta_len} meta bytes)")
        if meta_len < wire.min_meta(n_ops):
            raise wire.ProtocolError("meta too short for its op count")
        now = time.monotonic()
        stop_at = now + min(ttl_ms / 1000, lim.max_ttl) + lim.ttl_grace
        meta = self.recv_grow(meta_len, min(stop_at, now + lim.frame_timeout))
        names, ops = wire.decode_meta(meta, n_ops)
        lengths = ops["length"]
        if n_ops and int(lengths.max()) > wire.MAX_OP_BYTES:
            raise wire.ProtocolError("op too large")
        if int(lengths.sum()) != payload_len:  # cannot overflow: at most 2**16 ops of 2**40 bytes
            raise wire.ProtocolError("payload length does not match the ops")
        grant = self.ctx.grants.get(token.hex())
        verdict = self.check(grant, names, ops)
        if isinstance(verdict, tuple) or grant is None:
            code, reason = verdict if isinstance(verdict, tuple) else (wire.Code.UNKNOWN_GRANT, "")
            if self.tags is None:
                self.ctx.stats.add("rejected_writes")
                self.reply(wire.Status.REJECTED, code, reason)
                self.drain(payload_len, stop_at)
                return True
            mac = self.start_tag(head + meta)
            self.drain(payload_len, stop_at, mac)
            if not self.end_tag(mac, self.recv_exact(wire.TAG_BYTES, stop_at)):
                self._poison(grant)
                raise BadTag("message failed authentication")
            self.ctx.stats.add("rejected_writes")
            self.reply(wire.Status.REJECTED, code, reason)
            return True
        self.scatter(grant, verdict, names, ops, stop_at, head + meta)
        return True

    def check(
        self, grant: Grant | None, names: list[str], ops: np.ndarray
    ) -> tuple[wire.Code, str] | list[Region]:
        """The destination regions (in table order) when every op is allowed, else why not."""
        if grant is None or not grant.open:
            return wire.Code.UNKNOWN_GRANT, "unknown or closed grant"
        regions = []
        for idx, name in enumerate(names):
            region = self.ctx.regions.get(name)
            if region is None or not region.alive:
                return wire.Code.UNKNOWN_REGION, f"region {name!r} is not registered"
            regions.append(region)
            mine = ops[ops["region"] == idx] if len(names) > 1 else ops
            off, ln = mine["offset"], mine["length"]
            size = np.uint64(region.size)
            if bool(((off > size) | (ln > size - np.minimum(off, size))).any()):
                return wire.Code.OUT_OF_REGION, f"op outside region {name!r}"
            if grant.outside(name, off, ln):
                return wire.Code.OUTSIDE_GRANT, f"op outside the grant on {name!r}"
        return regions

    def scatter(
        self,
        grant: Grant,
        regions: list[Region],
        names: list[str],
        ops: np.ndarray,
        stop_at: float,
        head: bytes,
    ) -> None:
        ridx, offs, lens = ops["region"].tolist(), ops["offset"].tolist(), ops["length"].tolist()
        ends = list(itertools.accumulate(lens))  # payload position where each op ends
        n_ops = len(lens)
        live = self.tags is None  # without a secret, progress counts as bytes land
        progress = Progress(names, ridx, offs, lens, unverified=not live)
        pos = 0  # payload bytes landed
        i = bisect.bisect_right(ends, 0)  # first incomplete op (skips empty ones)
        with grant.lock:
            if live:
                progress.done = i
            grant.track(progress)
        # Where each op lands; checked against its region by `check`, and `regions` keeps them alive.
        ptrs = np.array([r.addr for r in regions], np.uint64)[ops["region"]] + ops["offset"]
        # Without a secret (Linux): recvmsg straight into an iovec table, no Python object per op.
        io = iovec.Io(self.sock) if live and iovec.AVAILABLE else None
        iov = iovec.table(ptrs, ops["length"]) if io is not None else np.empty((0, 2), np.uint64)
        base: list[memoryview] = []
        if io is None:
            mvs = [r.view for r in regions]
            base = [mvs[r][o : o + n] for r, o, n in zip(ridx, offs, lens, strict=True)]
        views = list(base)  # views[i] is re-sliced when op i landed partially
        mac, hashed = None, 0  # with a secret: ops[:hashed] are in the tag's running hash
        if not live:
            mac = self.start_tag(head)
        sock = self.sock
        fenced = False
        try:
            try:
                while i < n_ops:
                    self.wait(stop_at)
                    with grant.lock:
                        if not grant.open or not all(r.alive for r in regions):
                            fenced = True
                            break
                        if io is not None:
                            got = io.recv(iov, i, i + iovec.IOV_MAX)
                            if got is None:
                                continue
                            n = got
                        else:
                            j = i + wire.IOV_BATCH
                            if mac is not None:  # a batch small enough to hash while it is in cache
                                j = wire.tag_batch_end(ends, i, pos)
                            try:
                                n = sock.recvmsg_into(views[i:j], 0, socket.MSG_DONTWAIT)[0]
                            except BlockingIOError:
                                continue
                        if n == 0:
                            raise Eof()
                        pos += n
                        if io is not None:
                            i = iovec.advance(iov, ends, i, pos)
                        else:
                            i = bisect.bisect_right(ends, pos, i)
                        partial = pos - (ends[i - 1] if i else 0)
                        if partial and io is None:
                            views[i] = base[i][partial:]
                        if live:
                            progress.done, progress.partial = i, partial
                        elif mac is not None and i > hashed:  # ops that just landed are in cache: hash now
                            mac.update_pieces(base[hashed:i])
                            hashed = i
            except (Eof, Stall, OSError):
                self.ctx.stats.add("incomplete_writes")
                raise
            finally:
                self.ctx.stats.add("bytes_received", pos)
            if fenced:
                self.drain((ends[-1] if ends else 0) - pos, stop_at)
                if self.tags is not None:  # not verified: a REJECTED reply claims nothing
                    self.recv_exact(wire.TAG_BYTES, stop_at)
                    self.tags.received += 1
            elif mac is not None:
                fenced = not self._verify(grant, regions, mac, progress, stop_at)
        finally:
            with grant.lock:
                progress.finished = True
        if fenced:
            self.ctx.stats.add("rejected_writes")
            self.reply(wire.Status.REJECTED, wire.Code.GRANT_CLOSED, "grant closed mid-write")
            return
        self.ctx.stats.add("accepted_writes")
        self.reply(wire.Status.OK, wire.Code.OK)

    def _verify(
        self, grant: Grant, regions: list[Region], mac: Mac, progress: Progress, stop_at: float
    ) -> bool:
        """Every byte landed and was hashed as it did: check the tag, and only then count the bytes.

        False when the grant closed meanwhile (nothing counts); BadTag when the tag is wrong (the grant
        is poisoned first).
        """
        ok = self.end_tag(mac, self.recv_exact(wire.TAG_BYTES, stop_at))
        with grant.lock:
            progress.finished = True
            if not ok:
                grant.poison()
                raise BadTag("message failed authentication")
            if not grant.open or not all(r.alive for r in regions):
                return False
            progress.done, progress.partial, progress.unverified = len(progress.lens), 0, False
        return True

    @staticmethod
    def _poison(grant: Grant | None) -> None:
        """A tag failed on a message naming this grant: none of it may count (see `Grant.poison`)."""
        if grant is not None:
            with grant.lock:
                grant.poison()
