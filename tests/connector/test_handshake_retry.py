"""A ZMTP handshake that does not complete in time is not a dead P (issue 30: P TP 2 on 2 loaded cores).
P's ROUTER closes a connection still in its handshake after 2 s, D's DEALER after its own interval: on a
starved box a live P's first connection can end that way. libzmq dials again by itself, so D waits for
that connection instead of failing the pull; only an established connection that closes, or P's silence
past the ceiling, is death (a P that accepts TCP but never completes a handshake is dead by the ceiling)."""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest

from kvferry.connector.bootstrap import BootstrapServer, Registration
from kvferry.connector.decode.consumer import Consumer
from kvferry.connector.decode.pulls import ConsumerConfig, PullSpec
from kvferry.connector.faults import FaultSpec
from kvferry.connector.layout import KVCacheSpec, PagedKVLayout
from kvferry.connector.metrics import Metrics
from kvferry.connector.prefill.producer import Producer
from kvferry.transfer.tcp.engine import TcpTransferEngine
from procs import free_port

SPEC = KVCacheSpec(num_blocks=8, num_layers=2, num_kv_heads=2, block_size=4, head_dim=8)
SECRET = bytes(range(32))
RELAY_HOST = "127.0.0.2"


class StallingRelay:
    """TCP in front of P's control ROUTER: the first `stall` connections are accepted and never answered
    (as a starved P's I/O thread looks from D), later ones are relayed both ways."""

    def __init__(self, target_port: int, stall: int) -> None:
        self.target_port, self.stall = target_port, stall
        # P's own port on another loopback address: P advertises this one (control MACs name the
        # address D dials, so the relay must be where P says it is).
        self.listener = socket.create_server((RELAY_HOST, target_port))
        self.accepted = 0
        self.socks: list[socket.socket] = [self.listener]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            self.accepted += 1
            self.socks.append(client)
            if self.accepted <= self.stall:
                threading.Thread(target=_swallow, args=(client,), daemon=True).start()
                continue
            server = socket.create_connection(("127.0.0.1", self.target_port))
            self.socks.append(server)
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=_pipe, args=(a, b), daemon=True).start()

    def close(self) -> None:
        for s in self.socks:
            s.close()


def _swallow(s: socket.socket) -> None:
    while True:
        try:
            if not s.recv(65536):
                return
        except OSError:
            return


def _pipe(src: socket.socket, dst: socket.socket) -> None:
    while True:
        try:
            data = src.recv(65536)
            if not data:
                dst.shutdown(socket.SHUT_WR)
                return
            dst.sendall(data)
        except OSError:
            return


def pull_through(stall: int, secret: bytes | None, deadline_s: float) -> tuple[dict[str, tuple[str, str]], np.ndarray,
                                                                                  float, int]:
    """One pull from a real P via the relay; returns the causes, D's KV, the seconds it took, connections."""
    server = BootstrapServer("127.0.0.1", free_port(), secret=secret)  # D with a secret trusts no other
    server.start()
    d_kv = np.zeros(SPEC.shape, dtype=np.float32)
    p_kv = np.full(SPEC.shape, 7.0, dtype=np.float32)
    d_engine, p_engine = TcpTransferEngine(secret=secret), TcpTransferEngine(secret=secret)
    producer = Producer(PagedKVLayout(SPEC, p_kv), [p_engine], "127.0.0.1", 30.0, FaultSpec(), Metrics(), secret,
                        advertise_host=RELAY_HOST)
    relay = StallingRelay(int(producer.control_addrs[0].rsplit(":", 1)[1]), stall)
    consumer = Consumer(PagedKVLayout(SPEC, d_kv), [d_engine],
                        ConsumerConfig(kv_load_deadline_s=deadline_s, secret=secret), Metrics())
    try:
        server.register(Registration("p", 1, 0, producer.control_addrs[0], producer.boot_ids[0]))
        producer.add_ready("x", "p", [1, 2], 2 * SPEC.block_size)
        started = time.monotonic()
        consumer.start_pulls([PullSpec("d", "x", [3, 4], "p", f"127.0.0.1:{server.port}", 2 * SPEC.block_size)])
        causes: dict[str, tuple[str, str]] = {}
        while True:
            done, _, new = consumer.drain()
            causes.update(new)
            if "d" in done:
                return causes, d_kv, time.monotonic() - started, relay.accepted
            assert time.monotonic() < started + deadline_s + 10, "the pull never ended"
            time.sleep(0.01)
    finally:
        consumer.close()
        relay.close()
        producer.close()
        for e in (d_engine, p_engine):
            e.close()
        server.stop()


@pytest.mark.parametrize("secret", [None, SECRET], ids=["plain", "curve"])
def test_a_handshake_that_times_out_is_dialed_again_and_the_pull_completes(secret: bytes | None) -> None:
    causes, d_kv, _, accepted = pull_through(stall=2, secret=secret, deadline_s=30.0)
    assert causes == {}, causes
    assert (d_kv[[3, 4]] == 7.0).all()
    assert accepted >= 3  # two handshakes timed out, the third connection served the pull


def test_a_p_that_never_completes_a_handshake_is_dead_by_the_ceiling() -> None:
    causes, _, took, accepted = pull_through(stall=1_000, secret=None, deadline_s=60.0)
    assert causes["d"][0] == "peer_dead", causes
    assert accepted >= 2
    assert took < 10.0 + 3.0, took  # the default ceiling (10 s) and a heartbeat, far before the deadline
