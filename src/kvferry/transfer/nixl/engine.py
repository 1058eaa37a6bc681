"""Optional data plane on NIXL (UCX): `pip install 'kvferry[nixl]'`; `--transfer nixl`.

NIXL and UCX authenticate nothing, and a UCX peer can make a worker write anywhere in its process, so
this engine never lets a peer write into it: the sender asks with a notification (REQ) and D reads the
bytes into its own grant (recv.py). With KVFERRY_SECRET, tokens and notifications carry HMAC tags;
without it the 128-bit grant id is the capability. UCX's listener still accepts anyone, which is why
`kvferry serve` refuses `nixl` off loopback without `--insecure`. The engine's `address` is a reserved,
never-listening port that names it; a sender refuses a token whose address is not the peer it dials."""

from __future__ import annotations

import contextlib
import logging
import secrets
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvferry.transfer import secret as secret_rules
from kvferry.transfer.addr import advertised_addr, canonical_addr
from kvferry.transfer.base import ByteRange, TransferEngine, TransferError, TransferErrorCause, WriteOp
from kvferry.transfer.nixl import api as nixl_api
from kvferry.transfer.nixl import wire as nw
from kvferry.transfer.nixl.recv import Receiver
from kvferry.transfer.nixl.regions import NixlRegions, Peers

log = logging.getLogger(__name__)
E = TransferErrorCause
CHUNK_BYTES = 4 << 20  # one REQ, one READ, one ACK: the unit of progress
CHUNK_OPS = 8192
PROBE_S = 0.05  # while waiting for acks, a PING this often notices a dead receiver
POLL_MIN_S, POLL_MAX_S = 0.0001, 0.002  # the pump's sleep between polls, while it has work
IDLE_POLL_S = 0.05  # ... and while it has none
COUNTERS = ("rejected_writes", "bad_notes", "replayed_notes", "late_reads", "failed_reads", "fences_deferred",
            "unacked")


def available() -> bool:
    return nixl_api.available()


def _is_loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


@dataclass(eq=False)
class _Write:
    peer: str
    token: str
    gid: bytes
    receiver: str  # D's agent name
    chunks: int
    wid: bytes = field(default_factory=lambda: secrets.token_bytes(8))
    acked: int = 0
    error: TransferError | None = None
    done: threading.Event = field(default_factory=threading.Event)

    def fail(self, error: TransferError) -> None:
        if self.error is None:
            self.error = error
        self.done.set()


class NixlTransferEngine(TransferEngine):
    def __init__(self, host: str = "127.0.0.1", port: int = 0, secret: str | bytes | None = None, *,
                 advertise: str | None = None) -> None:
        if not nixl_api.available():
            raise TransferError(E.INVALID, f"nixl is not installed ({nixl_api.INSTALL_HINT})")
        # Env KVFERRY_SECRET when not given; a weak one is refused (WeakSecret) before anything binds.
        key = secret_rules.from_env() if secret is None else (secret_rules.check_secret(secret) if secret else None)
        self._keys = nw.Keys.from_secret(key)
        self._reserved = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        try:
            self._reserved.bind((host, port))
            bound = self._reserved.getsockname()[1]
            self._name = f"kvferry-{secrets.token_hex(8)}"
            self._agent = nixl_api.new_agent(self._name, _is_loopback(host))
        except BaseException:
            self._reserved.close()
            raise
        self._address = advertised_addr(advertise, host, bound)
        self._conn_md = bytes(self._agent.get_partial_agent_metadata(nixl_api.empty_reg_list("DRAM"), True))
        self._regions = NixlRegions(self._agent)
        self._peers = Peers(self._agent)
        self._counts = dict.fromkeys(COUNTERS, 0)
        self._recv = Receiver(self._agent, self._regions, self._peers, self._keys,
                              lambda: (self._address, self._name, self._conn_md), self._count)
        self._writes: dict[bytes, _Write] = {}
        self._cond = threading.Condition()
        self._closed = False
        self._pump = threading.Thread(target=self._run, name="kvferry-nixl", daemon=True)
        self._pump.start()

    @property
    def address(self) -> str:
        return self._address

    @property
    def stats(self) -> dict[str, int]:
        """Counters (COUNTERS), and gauges: reads posted and not ended, closed grants still draining."""
        reads, draining = self._recv.in_flight
        return {**self._counts, "reads_in_flight": reads, "grants_draining": draining}

    def register(self, name: str, buffer: Any) -> None:
        self._check_open()
        self._regions.add(name, buffer)

    def unregister(self, name: str) -> None:
        self._regions.remove(name)

    def open_grant(self, ranges: Sequence[ByteRange]) -> str:
        self._check_open()
        token = self._recv.open(ranges)
        self._wake()
        return token

    def written(self, token: str) -> list[ByteRange]:
        return self._recv.written(token)

    def close_grant(self, token: str) -> list[ByteRange]:
        return self._recv.close(token)  # returns at once; reads still posted make it `draining`

    def draining(self, token: str) -> bool:
        return self._recv.draining(token)

    def write(self, peer: str, token: str, ops: Sequence[WriteOp], deadline: float) -> None:
        self._check_open()
        try:
            tok = nw.decode_token(token, self._keys)
        except nw.WireError as e:
            raise TransferError(E.REJECTED, f"grant token refused: {e}") from e
        if canonical_addr(tok.address) != canonical_addr(peer):
            raise TransferError(E.REJECTED, f"the grant token is for {tok.address}, not {peer}")
        chunks = self._plan(tok, ops)
        if not chunks:
            return
        receiver = self._peers.load(tok.agent, tok.metadata)
        w = _Write(peer, token, tok.gid, receiver, len(chunks))
        with self._cond:
            self._writes[w.wid] = w
            self._cond.notify_all()
        try:
            self._send_chunks(w, chunks, deadline)
            while not w.done.wait(max(0.0, min(PROBE_S, deadline - time.monotonic()))):
                if time.monotonic() >= deadline:
                    raise TransferError(E.TIMEOUT, f"NIXL write to {peer} passed its deadline")
                self._send(w, nw.PING, 0, b"")
            if w.error is not None:
                raise w.error
        except TransferError:
            with contextlib.suppress(TransferError):
                self._send(w, nw.CANCEL, 0, b"")
            raise
        finally:
            with self._cond:
                self._writes.pop(w.wid, None)

    def abort_writes(self, peer: str, token: str | None = None) -> None:
        with self._cond:
            hit = [w for w in self._writes.values() if w.peer == peer and token in (None, w.token)]
        for w in hit:
            w.fail(TransferError(E.RESET, f"NIXL write to {peer} aborted"))

    def close(self) -> None:
        with self._cond:
            if self._closed:
                return
            self._closed = True
            writes = list(self._writes.values())
            self._cond.notify_all()
        for w in writes:
            w.fail(TransferError(E.CLOSED, "engine closed"))
        self._pump.join(timeout=10)
        self._recv.close_all()
        self._peers.clear()
        self._regions.clear()
        self._agent = None  # the C++ agent (its UCX workers and threads) goes with the last reference
        self._reserved.close()

    def _plan(self, tok: nw.Token, ops: Sequence[WriteOp]) -> list[tuple[str, np.ndarray, frozenset[str]]]:
        """Coalesced ops in chunks of one source memory type: (memory type, OP_DTYPE rows, src regions)."""
        ridx = {name: i for i, (name, _, _) in enumerate(tok.regions)}
        rows: dict[str, list[tuple[int, int, int, int, int]]] = {}
        names: dict[str, set[str]] = {}
        for op in ops:
            region = self._regions.get(op.src_region)
            if region is None:
                raise TransferError(E.INVALID, f"unknown local region {op.src_region!r}")
            if op.dst_region not in ridx:
                raise TransferError(E.INVALID, f"the grant token does not cover region {op.dst_region!r}")
            if op.length < 0 or op.src_offset < 0 or op.src_offset + op.length > region.size or op.dst_offset < 0:
                raise TransferError(E.INVALID, f"bad op {op}")
            if op.length == 0:
                continue
            key = f"{region.mem}/{tok.regions[ridx[op.dst_region]][1]}"
            out = rows.setdefault(key, [])
            names.setdefault(key, set()).add(op.src_region)
            r, src = ridx[op.dst_region], region.addr + op.src_offset
            last = out[-1] if out else None
            if last and last[0] == r and last[1] + last[3] == op.dst_offset and last[2] + last[3] == src \
                    and last[4] == region.dev:
                out[-1] = (r, last[1], last[2], last[3] + op.length, last[4])
            else:
                out.append((r, op.dst_offset, src, op.length, region.dev))
        chunks = []
        for key, table in rows.items():
            arr = np.array(table, nw.OP_DTYPE)
            ends = np.cumsum(arr["len"])
            start = 0
            while start < len(arr):
                base = int(ends[start - 1]) if start else 0
                stop = max(start + 1, int(np.searchsorted(ends, base + CHUNK_BYTES, side="right")))
                stop = min(stop, start + CHUNK_OPS)
                chunks.append((key.split("/")[0], arr[start:stop], frozenset(names[key])))
                start = stop
        return chunks

    def _send_chunks(self, w: _Write, chunks: list[tuple[str, np.ndarray, frozenset[str]]], deadline: float) -> None:
        boot = nw.boot_id()
        for i, (mem, arr, names) in enumerate(chunks):
            if w.done.is_set():
                return
            now = time.monotonic()
            if now >= deadline:
                raise TransferError(E.TIMEOUT, f"NIXL write to {w.peer} passed its deadline")
            req = nw.Request(int(deadline * 1e9), int((deadline - now) * 1e9), boot, mem, self._name,
                             self._regions.metadata(mem, names), arr)
            self._send(w, nw.REQ, i, nw.request_body(req))

    def _send(self, w: _Write, kind: int, chunk: int, body: bytes) -> None:
        data = nw.encode_note(kind, w.gid, w.wid, chunk, body, self._keys.p2d if self._keys else None)
        agent = self._agent
        if agent is None:
            raise TransferError(E.CLOSED, "engine closed")
        failed = nixl_api.call(agent.send_notif, w.receiver, data)
        if failed is not None and self._closed:  # `close` let the peers go under this write
            raise TransferError(E.CLOSED, "engine closed")
        if failed is not None:
            cause = E.RESET if "REMOTE_DISCONNECT" in failed else E.REFUSED
            raise TransferError(cause, f"NIXL notification to {w.peer} failed: {failed}")

    def _on_ack(self, sender: str, note: nw.Note) -> None:
        w = self._writes.get(note.wid)
        if w is None or w.gid != note.gid or w.receiver != sender:
            return
        try:
            status = nw.parse_ack(note.body)
        except nw.WireError:
            self._count("bad_notes")
            return
        if status == nw.OK:
            w.acked += 1
            if w.acked >= w.chunks:
                w.done.set()
            return
        cause, what = {nw.REJECTED: (E.REJECTED, "refused the write (closed grant or outside it)"),
                       nw.LATE: (E.TIMEOUT, "read it after the deadline"),
                       nw.FAILED: (E.RESET, "failed to read it")}[status]
        w.fail(TransferError(cause, f"{w.peer} {what}"))

    def _busy(self) -> bool:
        return bool(self._writes) or self._recv.busy

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def _run(self) -> None:
        """Poll fast right after progress, backing off to POLL_MAX_S while busy and IDLE_POLL_S otherwise,
        so a read a frozen sender holds costs a poll now and then, not a spinning core."""
        delay = POLL_MIN_S
        while True:
            with self._cond:
                if not self._closed:
                    self._cond.wait(delay if self._busy() else IDLE_POLL_S)
                if self._closed:
                    return
            delay = POLL_MIN_S if self._turn() else min(POLL_MAX_S, delay * 2)

    def _turn(self) -> bool:
        try:
            notes = self._agent.get_new_notifs()
        except Exception as e:  # noqa: BLE001
            log.warning("NIXL get_new_notifs failed: %r", e)
            notes = {}
        for sender, messages in notes.items():
            name = sender.decode() if isinstance(sender, bytes) else str(sender)
            for data in messages:
                self._dispatch(name, bytes(data))
        return self._recv.poll() or bool(notes)  # progress: poll again soon

    def _dispatch(self, sender: str, data: bytes) -> None:
        try:
            note = nw.decode_note(data, self._keys)
        except nw.WireError:
            self._count("bad_notes")
            return
        try:
            if note.kind == nw.ACK:
                self._on_ack(sender, note)
            else:
                self._recv.on_note(sender, note)
        except Exception:  # never let the pump die
            log.exception("NIXL notification from %r", sender)

    def _count(self, name: str) -> None:
        self._counts[name] = self._counts.get(name, 0) + 1

    def _check_open(self) -> None:
        if self._closed:
            raise TransferError(E.CLOSED, "engine closed")
