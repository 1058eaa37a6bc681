"""With a secret: a relayed handshake gets nowhere, an altered, replayed or spliced frame is refused, and
a message counts as written only once its tag verified."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest
from relay import Relay, Tamper
from transfer_helpers import closed_by_peer, message, pattern, raw_session, recv_exact, wait_for

from kvferry.transfer.base import ByteRange, TransferError, TransferErrorCause, WriteOp
from kvferry.transfer.regions import RegionTable
from kvferry.transfer.tcp import mac, wire
from kvferry.transfer.tcp import plan as tcp_plan
from kvferry.transfer.tcp.auth import Tags
from kvferry.transfer.tcp.engine import TcpTransferEngine

MiB = 1 << 20
E = TransferErrorCause
SECRET = b"9c321547800bc3ae675ef681c338a88d"  # a fixed random secret (128 bits)
Make = Callable[..., TcpTransferEngine]


@pytest.fixture
def relays() -> Iterator[Callable[..., Relay]]:
    made: list[Relay] = []

    def make(target: str = "", tamper: Tamper | None = None) -> Relay:
        made.append(Relay(target, tamper))
        return made[-1]

    yield make
    for r in made:
        r.close()


def _ends(engines: Make, **kw: object) -> tuple[TcpTransferEngine, TcpTransferEngine, np.ndarray, np.ndarray]:
    a, b = engines(secret=SECRET), engines(secret=SECRET, **kw)
    src, dst = pattern(4 * MiB, 11), np.zeros(4 * MiB, np.uint8)
    a.register("src", src)
    b.register("dst", dst)
    return a, b, src, dst


@pytest.mark.parametrize(
    "tamper",
    [Tamper(), Tamper(rewrite_hello=True), Tamper(rewrite_hello=True, rewrite_auth=True)],
    ids=["transparent", "rewrite-hello", "rewrite-both"],
)
def test_relayed_handshake_gets_nowhere(engines: Make, relays: Callable[..., Relay], tamper: Tamper) -> None:
    """P dials an attacker, who passes P's handshake on to a real listener with the same secret."""
    a, b, _, dst = _ends(engines)
    token = b.open_grant([ByteRange("dst", 0, 4 * MiB)])
    relay = relays(b.address, tamper)
    with pytest.raises(TransferError) as exc:
        a.write(relay.address, token, [WriteOp("src", 0, "dst", 0, 65536)], time.monotonic() + 5)
    assert exc.value.cause is E.REFUSED, exc.value
    assert not dst.any() and b.written(token) == []
    assert b.stats["accepted_writes"] == 0
    if tamper.rewrite_auth:  # the proof covers the addresses P saw: it fails on the listener
        wait_for(lambda: b.stats["refused_handshakes"] == 1, what="a refused proof")
    elif tamper.rewrite_hello:  # P names the address it dialed: not the listener's own
        wait_for(lambda: b.stats["misdirected_handshakes"] == 1, what="a misdirected handshake")
    a.write(b.address, token, [WriteOp("src", 0, "dst", 0, 65536)], time.monotonic() + 5)  # direct: fine


HEAD, META = wire.MSG.size, 2 + 2 + 3 + wire.OP_DTYPE.itemsize  # one op on region "dst"
FLIPS = {  # offset after the handshake of the byte a middlebox flips, client → server
    "header-token": 10,
    "meta-offset": HEAD + 9,  # lowest byte of the op's destination offset: still inside the grant
    "payload": HEAD + META + 1000,
    "tag": HEAD + META + 65536 + 3,
}


@pytest.mark.parametrize("where", list(FLIPS))
def test_a_flipped_bit_fails_the_write_and_counts_nothing(
    engines: Make, relays: Callable[..., Relay], where: str
) -> None:
    relay = relays(tamper=Tamper(flip_c2s=FLIPS[where]))
    a, b, src, dst = _ends(engines, advertise=relay.address)  # P reaches D through this middlebox
    relay.target = b.bound_address
    token = b.open_grant([ByteRange("dst", 0, 4 * MiB)])
    op = WriteOp("src", 0, "dst", 4096, 65536)
    with pytest.raises(TransferError) as exc:
        a.write(relay.address, token, [op], time.monotonic() + 5)
    assert exc.value.cause is E.PROTOCOL and "authentication" in str(exc.value), exc.value
    assert b.stats["bad_tags"] == 1 and b.stats["accepted_writes"] == 0
    assert b.written(token) == []  # whatever landed is not reported as written
    if where != "header-token":  # a failed tag poisons the grant it names: its transfer fails (#31)
        with pytest.raises(TransferError) as exc:
            a.write(relay.address, token, [op], time.monotonic() + 5)
        assert exc.value.cause is E.REJECTED, exc.value
        assert b.close_grant(token) == []
        token = b.open_grant([ByteRange("dst", 0, 4 * MiB)])
    a.write(relay.address, token, [op], time.monotonic() + 5)  # the next connection is not tampered with
    assert b.written(token) == [ByteRange("dst", 4096, 65536)]
    assert np.array_equal(dst[4096 : 4096 + 65536], src[:65536])


def test_a_flipped_reply_bit_fails_the_write(engines: Make, relays: Callable[..., Relay]) -> None:
    relay = relays(tamper=Tamper(flip_s2c=4))  # REPLY's status byte: REJECTED instead of OK
    a, b, _, _ = _ends(engines, advertise=relay.address)
    relay.target = b.bound_address
    token = b.open_grant([ByteRange("dst", 0, 4 * MiB)])
    with pytest.raises(TransferError) as exc:
        a.write(relay.address, token, [WriteOp("src", 0, "dst", 0, 4096)], time.monotonic() + 5)
    assert exc.value.cause is E.PROTOCOL and "authentication" in str(exc.value)


def _reply(sock: object, tags: Tags) -> int:
    raw = recv_exact(sock, wire.REPLY.size)  # type: ignore[arg-type]
    raw += recv_exact(sock, wire.REPLY.unpack(raw)[3])  # type: ignore[arg-type]
    tag = recv_exact(sock, wire.TAG_BYTES)  # type: ignore[arg-type]
    assert tags.recv.tag(tags.received, raw) == tag
    tags.received += 1
    return int(wire.REPLY.unpack_from(raw)[1])


def test_bytes_land_only_once_the_tag_verified_and_a_replay_is_refused(engines: Make) -> None:
    _, b, src, dst = _ends(engines)
    token = b.open_grant([ByteRange("dst", 0, 4 * MiB)])
    sock, tags = raw_session(b.address, SECRET)
    assert tags is not None
    sent = tags.seal_frame(message(token, [("dst", 0, 8192)]), src[:8192].tobytes())
    sock.sendall(sent[:-5000])  # all but the last bytes of the payload and the tag
    assert b.written(token) == [] and not dst.any()  # staged, not verified: nothing landed
    sock.sendall(sent[-5000:])
    assert _reply(sock, tags) == wire.Status.OK
    assert b.written(token) == [ByteRange("dst", 0, 8192)]
    sock.sendall(sent)  # the same message again: its tag was for sequence number 0
    assert _reply(sock, tags) == wire.Status.PROTOCOL
    assert closed_by_peer(sock)
    assert b.stats["bad_tags"] == 1 and b.stats["accepted_writes"] == 1


def test_small_random_blocks_over_split_sealed_messages(engines: Make) -> None:
    a, b, src, dst = _ends(engines)
    token = b.open_grant([ByteRange("dst", 0, 4 * MiB)])
    bs = 2048
    ids = np.random.default_rng(3).permutation(4 * MiB // bs)[:1024]  # 2 MiB at random places
    ops = [WriteOp("src", i * bs, "dst", int(d) * bs, bs) for i, d in enumerate(ids.tolist())]
    a.write(b.address, token, ops, time.monotonic() + 10)
    for op in ops:
        assert np.array_equal(
            dst[op.dst_offset : op.dst_offset + bs], src[op.src_offset : op.src_offset + bs]
        )
    assert sum(r.length for r in b.close_grant(token)) == 1024 * bs
    link = a._client._idle[b.address][0]
    assert link.tags is not None and isinstance(link.tags.send, mac.Aead)
    assert b.stats["accepted_writes"] == 1024 * bs // wire.AUTH_MSG_BYTES  # 4 sealed messages


def test_authenticated_writes_are_split_into_small_messages() -> None:
    regions = RegionTable()
    regions.add("src", np.zeros(16 * MiB, np.uint8))
    op = [WriteOp("src", 0, "dst", 0, 16 * MiB)]
    deadline = time.monotonic() + 5
    assert len(tcp_plan.plan(regions, "00" * 16, op, deadline)) == 1
    msgs = tcp_plan.plan(regions, "00" * 16, op, deadline, auth=True)
    assert [m.payload for m in msgs] == [wire.AUTH_MSG_BYTES] * (16 * MiB // wire.AUTH_MSG_BYTES)
    src = regions.get("src")
    assert src is not None
    src.view[:] = np.arange(16 * MiB, dtype=np.uint32).view(np.uint8)[: 16 * MiB]
    for k, m in enumerate(msgs):  # one length, one region: gathered by numpy from the window rows
        assert m.rows is not None and not m.views
        got = m.rows[0][m.rows[1]].tobytes()
        assert got == src.view[k * wire.AUTH_MSG_BYTES : (k + 1) * wire.AUTH_MSG_BYTES].tobytes()
