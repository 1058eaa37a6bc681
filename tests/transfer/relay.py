"""A hostile middlebox for the transfer tests: relays TCP to a real listener, optionally rewriting the
handshake's addresses or flipping one byte of a stream, and keeps what it saw (a passive tap)."""

from __future__ import annotations

import contextlib
import socket
import threading
from dataclasses import dataclass

from transfer_helpers import parse, read_hello, recv_exact

from kvferry.transfer.tcp import wire


@dataclass
class Tamper:
    rewrite_hello: bool = False  # tell the client the relay's address instead of the listener's
    rewrite_auth: bool = False  # tell the listener the client dialed the listener itself
    flip_c2s: int | None = None  # offset (from the first byte after the handshake) of a byte to flip
    flip_s2c: int | None = None  # the same, server → client (after AUTH_RESULT)
    connections: int = 1  # tamper with the first N connections only


class Relay:
    def __init__(self, target: str = "", tamper: Tamper | None = None) -> None:
        self.target = target
        self.tamper = tamper or Tamper()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._socks: list[socket.socket] = [self._listener]
        self._lock = threading.Lock()
        self.accepted = 0
        self.seen = bytearray()  # every byte relayed client → server after the handshake (the tap)
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(parse(self.target))
            with self._lock:
                self._socks += [client, server]
                self.accepted += 1
                tamper = self.tamper if self.accepted <= self.tamper.connections else Tamper()
            threading.Thread(target=self._session, args=(client, server, tamper), daemon=True).start()

    def _session(self, client: socket.socket, server: socket.socket, t: Tamper) -> None:
        try:
            hello = read_hello(server)
            if t.rewrite_hello:
                me = self.address.encode()
                magic, version, flags, _, nonce = wire.HELLO.unpack_from(hello)
                hello = wire.HELLO.pack(magic, version, flags, len(me), nonce) + me
            client.sendall(hello)
            auth = recv_exact(client, wire.AUTH.size)
            auth += recv_exact(client, wire.AUTH.unpack(auth)[3])
            if t.rewrite_auth:
                them = self.target.encode()
                magic, version, flags, _, nonce, proof = wire.AUTH.unpack_from(auth)
                auth = wire.AUTH.pack(magic, version, flags, len(them), nonce, proof) + them
            server.sendall(auth)
            client.sendall(recv_exact(server, wire.AUTH_RESULT.size))
        except (OSError, EOFError):
            self._close_pair(client, server)
            return
        threading.Thread(target=self._pump, args=(server, client, t.flip_s2c), daemon=True).start()
        self._pump(client, server, t.flip_c2s, self.seen)

    def _pump(
        self, src: socket.socket, dst: socket.socket, flip: int | None, tap: bytearray | None = None
    ) -> None:
        pos = 0
        try:
            while chunk := src.recv(1 << 16):
                if flip is not None and pos <= flip < pos + len(chunk):
                    raw = bytearray(chunk)
                    raw[flip - pos] ^= 0x01
                    chunk = bytes(raw)
                pos += len(chunk)
                if tap is not None:
                    with self._lock:
                        tap += chunk
                dst.sendall(chunk)
        except OSError:
            pass
        self._close_pair(src, dst)

    @staticmethod
    def _close_pair(a: socket.socket, b: socket.socket) -> None:
        for s in (a, b):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        with self._lock:
            socks = list(self._socks)
        for s in socks:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()
