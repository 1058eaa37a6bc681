"""One accepted data-plane connection: handshake, frame checks, grant checks, scatter into memory.

Payload bytes are only copied by a short non-blocking call made under the grant's lock right after
checking the grant is open: that makes `close_grant` a fence. Without a secret a rejected message is
answered at once and its payload drained, keeping the connection usable. With a secret the whole message
is staged and verified first, so no unverified byte reaches D's memory; a bad tag poisons the grant and
closes the connection, as does a malformed frame."""

from __future__ import annotations

import bisect
import contextlib
import itertools
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kvferry.transfer.grants import Grant, GrantTable, Progress
from kvferry.transfer.regions import Region, RegionTable
from kvferry.transfer.stats import Counters
from kvferry.transfer.tcp import gather, iovec, wire
from kvferry.transfer.tcp.auth import Tags
from kvferry.transfer.tcp.handshake import server_handshake
from kvferry.transfer.tcp.limits import Limits
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


_REPLY_BATCH = 4096  # bytes of replies held back at most
_NO_GRANT = (wire.Code.UNKNOWN_GRANT, "")
_CLOSED_MID_WRITE = (wire.Code.GRANT_CLOSED, "grant closed mid-write")


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
        self._sealed = bytearray()  # with a secret: the message being staged (ciphertext + tag) ...
        self._plain = bytearray()  # ... and its plaintext once verified
        self._replies = bytearray()  # replies not sent yet (`reply`)

    def reply(self, status: wire.Status, code: wire.Code, reason: str = "") -> None:
        """Replies go out in order; an OK waits while the next message is already arriving, so many
        messages cost one send."""
        data = wire.encode_reply(status, code, reason)
        if self.tags is not None:  # the reply to message k carries a tag with sequence number k
            data += self.tags.send.tag(self.tags.sent, data)
            self.tags.sent += 1
        self._replies += data
        if status != wire.Status.OK or len(self._replies) > _REPLY_BATCH or not self._poll_in.poll(0):
            self.flush()

    def answer(self, refusal: tuple[wire.Code, str] | None) -> None:
        """Counts a write and replies to it: accepted (None), else rejected with `refusal`'s code and reason."""
        if refusal is None:
            self.ctx.stats.add("accepted_writes")
            self.reply(wire.Status.OK, wire.Code.OK)
        else:
            self.ctx.stats.add("rejected_writes")
            self.reply(wire.Status.REJECTED, *refusal)

    def flush(self) -> None:
        if self._replies:
            data, self._replies = bytes(self._replies), bytearray()
            self.send_all(data, time.monotonic() + self.limits.handshake_timeout)

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
        with contextlib.suppress(OSError, Stall):  # what was answered before the peer went away
            self.flush()

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
        if self.tags is not None and payload_len > wire.AUTH_MSG_BYTES:  # the staging buffer's bound
            raise Oversized(f"sealed message too large ({payload_len} payload bytes)")
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
        if self.tags is not None:
            self.serve_sealed(grant, verdict, names, ops, head + meta, stop_at)
            return True
        if isinstance(verdict, tuple) or grant is None:
            self.answer(verdict if isinstance(verdict, tuple) else _NO_GRANT)
            self.drain(payload_len, stop_at)
            return True
        self.scatter(grant, verdict, names, ops, stop_at)
        return True

    def serve_sealed(self, grant: Grant | None, verdict: tuple[wire.Code, str] | list[Region],
                     names: list[str], ops: np.ndarray, aad: bytes, stop_at: float) -> None:
        """With a secret: stage the message, decrypt and verify it, and only then copy it into the grant."""
        assert self.tags is not None
        lens = ops["length"].tolist()
        payload = sum(lens)
        if len(self._sealed) < payload + wire.TAG_BYTES:  # grows to at most AUTH_MSG_BYTES + a tag
            self._sealed, self._plain = bytearray(payload + wire.TAG_BYTES), bytearray(payload)
        sealed = memoryview(self._sealed)[: payload + wire.TAG_BYTES]
        plain = memoryview(self._plain)[:payload]
        try:
            self.recv_into(sealed, stop_at)
        except wire.ProtocolError:  # the peer went away mid-message
            self.ctx.stats.add("incomplete_writes")
            raise Eof() from None
        except (Stall, OSError):
            self.ctx.stats.add("incomplete_writes")
            raise
        self.ctx.stats.add("bytes_received", payload)
        ok = self.tags.recv.open_into(self.tags.received, sealed, aad, plain)
        self.tags.received += 1
        if not ok:
            self._poison(grant)
            raise BadTag("message failed authentication")
        if isinstance(verdict, tuple) or grant is None:
            self.answer(verdict if isinstance(verdict, tuple) else _NO_GRANT)
            return
        with grant.lock:  # the fence: nothing lands once the grant closed
            landed = grant.open and all(r.alive for r in verdict)
            if landed:
                gather.scatter([r.view for r in verdict], ops, plain)  # checked against them by `check`
                progress = Progress(names, ops["region"].tolist(), ops["offset"].tolist(), lens)
                progress.done, progress.finished = len(lens), True
                grant.track(progress)
        self.answer(None if landed else _CLOSED_MID_WRITE)

    def check(self, grant: Grant | None, names: list[str],
              ops: np.ndarray) -> tuple[wire.Code, str] | list[Region]:
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

    def scatter(self, grant: Grant, regions: list[Region], names: list[str], ops: np.ndarray,
                stop_at: float) -> None:
        """Without a secret: payload bytes land as they arrive, and count as they do."""
        ridx, offs, lens = ops["region"].tolist(), ops["offset"].tolist(), ops["length"].tolist()
        ends = list(itertools.accumulate(lens))  # payload position where each op ends
        n_ops = len(lens)
        progress = Progress(names, ridx, offs, lens)
        pos = 0  # payload bytes landed
        i = bisect.bisect_right(ends, 0)  # first incomplete op (skips empty ones)
        with grant.lock:
            progress.done = i
            grant.track(progress)
        # Where each op lands; checked against its region by `check`, and `regions` keeps them alive.
        ptrs = np.array([r.addr for r in regions], np.uint64)[ops["region"]] + ops["offset"]
        # On Linux: recvmsg straight into an iovec table, no Python object per op.
        io = iovec.Io(self.sock) if iovec.AVAILABLE else None
        iov = iovec.table(ptrs, ops["length"]) if io is not None else np.empty((0, 2), np.uint64)
        base: list[memoryview] = []
        if io is None:
            mvs = [r.view for r in regions]
            base = [mvs[r][o : o + n] for r, o, n in zip(ridx, offs, lens, strict=True)]
        views = list(base)  # views[i] is re-sliced when op i landed partially
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
                            try:
                                n = sock.recvmsg_into(views[i : i + wire.IOV_BATCH], 0, socket.MSG_DONTWAIT)[0]
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
                        progress.done, progress.partial = i, partial
            except (Eof, Stall, OSError):
                self.ctx.stats.add("incomplete_writes")
                raise
            finally:
                self.ctx.stats.add("bytes_received", pos)
            if fenced:
                self.drain((ends[-1] if ends else 0) - pos, stop_at)
        finally:
            with grant.lock:
                progress.finished = True
        self.answer(_CLOSED_MID_WRITE if fenced else None)

    @staticmethod
    def _poison(grant: Grant | None) -> None:
        """A tag failed on a message naming this grant: none of it may count (see `Grant.poison`)."""
        if grant is not None:
            with grant.lock:
                grant.poison()
