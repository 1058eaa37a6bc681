"""Both halves of the data-plane handshake: HELLO (+ server address) → AUTH (+ dialed address) → RESULT.

With a secret the client refuses, before proving anything, a server that does not require the secret
or names another address than the one dialed (a relay); its proof covers both addresses, and the server
refuses a dialed address not its own (MISDIRECTED) or a wrong proof. The server's half runs under one
deadline however the bytes trickle in."""

from __future__ import annotations

import hmac
import os
import socket
import time
from collections.abc import Callable

from kvferry.transfer.addr import canonical_addr
from kvferry.transfer.base import TransferError, TransferErrorCause
from kvferry.transfer.stats import Counters
from kvferry.transfer.tcp import wire
from kvferry.transfer.tcp.auth import Tags, derive, transcript
from kvferry.transfer.tcp.sockio import SockIO

E = TransferErrorCause


def remaining(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TransferError(E.TIMEOUT, "deadline passed")
    return left


def recv_exact(sock: socket.socket, n: int, deadline: float) -> bytes:
    buf = bytearray(n)
    mv = memoryview(buf)
    got = 0
    while got < n:
        sock.settimeout(remaining(deadline))
        k = sock.recv_into(mv[got:])
        if k == 0:
            raise EOFError("connection closed")
        got += k
    return bytes(buf)


def client_handshake(sock: socket.socket, peer: str, secret: bytes | None, deadline: float) -> Tags | None:
    """Run the handshake on a fresh connection; the session's tagging state when a secret is set."""
    magic, version, sflags, alen, snonce = wire.HELLO.unpack(recv_exact(sock, wire.HELLO.size, deadline))
    if magic != wire.HELLO_MAGIC or version != wire.VERSION or alen > wire.MAX_ADDR:
        raise TransferError(E.PROTOCOL, f"{peer} is not a kvferry endpoint (of this version)")
    server = canonical_addr(recv_exact(sock, alen, deadline).decode(errors="replace"))
    dialed = canonical_addr(peer)
    cnonce = os.urandom(wire.NONCE_BYTES)
    session = None
    if secret:
        if not sflags & wire.FLAG_AUTH:
            raise TransferError(E.REFUSED, f"{peer} does not require the secret: not our peer")
        if server != dialed:
            raise TransferError(E.REFUSED, f"{peer} answers as {server[:100]!r}: a relay, refused")
        cflags = wire.FLAG_AUTH
        record = transcript(sflags, cflags, snonce, cnonce, dialed, server)
        session = derive(secret, snonce, cnonce, record)
        proof = session.client_proof
    else:
        cflags, proof = 0, bytes(32)
    me = dialed.encode()
    sock.settimeout(remaining(deadline))
    sock.sendall(wire.AUTH.pack(wire.AUTH_MAGIC, wire.VERSION, cflags, len(me), cnonce, proof) + me)
    magic, status, sproof = wire.AUTH_RESULT.unpack(recv_exact(sock, wire.AUTH_RESULT.size, deadline))
    if magic != wire.RESULT_MAGIC:
        raise TransferError(E.PROTOCOL, f"{peer} sent a bad handshake reply")
    if status == wire.AuthStatus.MISDIRECTED:
        raise TransferError(E.REFUSED, f"{peer} is another listener than the one dialed (a relay?)")
    if status != wire.AuthStatus.OK:
        raise TransferError(E.REFUSED, f"{peer} refused the handshake (wrong or missing secret)")
    if session is None:
        return None
    if not hmac.compare_digest(sproof, session.server_proof):
        raise TransferError(E.REFUSED, f"{peer} could not prove it knows the secret")
    return Tags.for_client(session)


def server_handshake(
    io: SockIO, secret: bytes | None, advertised: str, timeout: float, stats: Counters,
    admit: Callable[[], bool] = lambda: True,
) -> tuple[bool, Tags | None]:
    """(admitted, tagging state); raises Stall past `timeout`, ProtocolError on a malformed AUTH. `admit`
    is asked before OK is sent: when it says no, nothing is sent and the caller closes the connection."""
    deadline = time.monotonic() + timeout
    nonce = os.urandom(wire.NONCE_BYTES)
    sflags = wire.FLAG_AUTH if secret else 0
    me = advertised.encode()
    io.send_all(wire.HELLO.pack(wire.HELLO_MAGIC, wire.VERSION, sflags, len(me), nonce) + me, deadline)
    magic, version, cflags, alen, cnonce, proof = wire.AUTH.unpack(io.recv_exact(wire.AUTH.size, deadline))
    if magic != wire.AUTH_MAGIC or version != wire.VERSION or alen > wire.MAX_ADDR:
        raise wire.ProtocolError("bad handshake")
    dialed = canonical_addr(io.recv_exact(alen, deadline).decode(errors="replace"))
    status, sproof, tags = wire.AuthStatus.OK, bytes(32), None
    if secret:
        if not cflags & wire.FLAG_AUTH:
            status = wire.AuthStatus.BAD_PROOF
        elif dialed != advertised:  # P meant another listener: a relay passed its handshake on
            status = wire.AuthStatus.MISDIRECTED
        else:
            record = transcript(sflags, cflags, nonce, cnonce, dialed, advertised)
            session = derive(secret, nonce, cnonce, record)
            if hmac.compare_digest(proof, session.client_proof):
                sproof, tags = session.server_proof, Tags.for_server(session)
            else:
                status = wire.AuthStatus.BAD_PROOF
    if status == wire.AuthStatus.MISDIRECTED:  # counted before answering: a refused client sees it
        stats.add("misdirected_handshakes")
    elif status != wire.AuthStatus.OK:
        stats.add("refused_handshakes")
    if status == wire.AuthStatus.OK and not admit():
        return False, None
    io.send_all(wire.AUTH_RESULT.pack(wire.RESULT_MAGIC, status, sproof), deadline)
    return status == wire.AuthStatus.OK, tags
