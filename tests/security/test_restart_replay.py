"""A P restarted at the same control address (a fixed `--control-port`) is a new receiver (issue 31): what
D sealed for the old P process, recorded by a tap between them, is refused by the new one and counted,
even where the new P holds a transfer under the same id; D re-asks the bootstrap and pulls from the new
P at once. Real P and D with KVFERRY_SECRET; the tap holds the secret (the only place D's envelopes can
be read: the connection is CurveZMQ)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import zmq
from test_receiver_binding import SECRET, completion, dropped

from kvferry.connector.auth import (
    TO_DECODE,
    TO_PREFILL,
    Opener,
    Sealer,
    curve_client,
    curve_server_keys,
    prefill_receiver,
)
from kvferry.connector.messages import Heartbeat, HeartbeatAck, NotMe, decode_response, encode
from kvferry.harness.sampler import wait_drained
from procs import Proc, free_port, running, serve, wait_until

TAP_HOST = "127.0.0.2"  # P advertises the tap's address; the tap relays to where P is bound
TID = "reused-id"  # the id of a transfer on the old P, and again of one on the new P


class Tap(threading.Thread):
    """Relays one D's DEALER to a P rank (CurveZMQ on both sides: it holds the secret) and records every
    sealed message D sent. Sockets live in this thread alone."""

    def __init__(self, listen: str, upstream: str) -> None:
        super().__init__(name="tap", daemon=True)
        self.listen, self.upstream = listen, upstream
        self.recorded: list[bytes] = []
        self.ready, self.stop = threading.Event(), threading.Event()
        self.start()
        assert self.ready.wait(10), "tap did not start"

    def run(self) -> None:
        ctx: zmq.Context[Any] = zmq.Context()
        front, back = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
        try:
            front.curve_server = True
            front.curve_secretkey = curve_server_keys(SECRET)[1]
            curve_client(back, SECRET)
            front.bind(self.listen)
            back.connect(self.upstream)
            self.ready.set()
            poller = zmq.Poller()
            poller.register(front, zmq.POLLIN)
            poller.register(back, zmq.POLLIN)
            peer = b""
            while not self.stop.is_set():
                events = dict(poller.poll(20))
                if front in events:
                    peer, sealed = front.recv_multipart()
                    self.recorded.append(sealed)
                    back.send(sealed)
                if back in events:
                    front.send_multipart([peer, back.recv()])
        finally:
            ctx.destroy(linger=0)


@contextmanager
def prefill_behind_tap(port: int, bootstrap: int, control: int) -> Iterator[tuple[Proc, Tap]]:
    """P at fixed ports (the same on every start), advertising the tap, and the tap in front of it."""
    p = serve(port, "--role", "prefill", "--bootstrap-port", str(bootstrap), "--control-port", str(control),
              "--advertise-host", TAP_HOST, "--num-blocks", "1024", "--seed", "0", "--abort-timeout", "30")
    with running(p):
        tap = Tap(f"tcp://{TAP_HOST}:{control}", f"tcp://127.0.0.1:{control}")
        try:
            yield p, tap
        finally:
            tap.stop.set()
            tap.join(10)


def receiver_of(bootstrap: int, engine_id: str) -> bytes:
    """The receiver P's rank 0 opens as, from what its bootstrap server answers (any client may ask)."""
    rank = httpx.get(f"http://127.0.0.1:{bootstrap}/query", params={"engine_id": engine_id}, timeout=5).json()
    return prefill_receiver(rank["ranks"][0]["control_addr"], bytes.fromhex(rank["ranks"][0]["boot"]))


def prefill(p: Proc, bootstrap: int) -> dict[str, Any]:
    params: dict[str, Any] = completion(p, 1, {"do_remote_decode": True, "transfer_id": TID})["kv_transfer_params"]
    params["remote_bootstrap_addr"] = f"127.0.0.1:{bootstrap}"  # the bootstrap server is not behind the tap
    return params


def test_messages_sealed_for_a_p_are_refused_by_its_restart_at_the_same_address() -> None:
    port, bootstrap, control = free_port(), free_port(), free_port()
    d = serve(None, "--role", "decode", "--num-blocks", "1024", "--seed", "0")
    with running(d):
        colocated = completion(d, 8, None)["choices"][0]["text"]
        with prefill_behind_tap(port, bootstrap, control) as (p, tap):
            params = prefill(p, bootstrap)
            assert completion(d, 8, params)["choices"][0]["text"] == colocated
            recorded = list(tap.recorded)  # D's pull of TID (and any heartbeat), sealed for this P
            assert recorded, "the tap saw nothing of D's pull"
        with prefill_behind_tap(port, bootstrap, control) as (p, tap):
            params = prefill(p, bootstrap)  # the new P holds a transfer under the old one's id
            before = dropped(p.url, "receiver")
            ctx: zmq.Context[Any] = zmq.Context()
            try:
                insider = ctx.socket(zmq.DEALER)
                insider.setsockopt(zmq.LINGER, 0)
                curve_client(insider, SECRET)
                insider.connect(f"tcp://127.0.0.1:{control}")
                own = Sealer(SECRET, TO_PREFILL, receiver_of(bootstrap, params["remote_engine_id"]))
                receivers = {sealed[24:40] for sealed in recorded}  # the envelope's receiver field
                for sealed in recorded:
                    insider.send(sealed)
                insider.send(own.seal(encode(Heartbeat([]))))
                answers = []  # P answers one connection in order: up to the ack of our own heartbeat
                while not answers or answers[-1][:4] != b"ours":
                    assert insider.poll(10_000), f"no answer from P; so far {len(answers)} frames"
                    frame = insider.recv()
                    try:
                        assert isinstance(decode_response(Opener(SECRET, TO_DECODE, own.session).open(frame)),
                                          HeartbeatAck)
                        answers.append(b"ours")
                    except ValueError:  # sealed for the old D socket: P acted on the replay, or said NotMe
                        old = decode_response(Opener(SECRET, TO_DECODE, frame[24:40]).open(frame))
                        answers.append(b"not me" if isinstance(old, NotMe) and old.receiver in receivers
                                       else repr(old)[:120].encode())
                # Each replayed message gets at most NotMe (the receiver it named is not this process), which
                # only D's old socket can open; nothing of the old P's transfers is acted on.
                assert set(answers[:-1]) <= {b"not me"} and answers[-1] == b"ours", \
                    f"the restarted P answered replayed messages: {answers[:-1]}"
                wait_until(lambda: dropped(p.url, "receiver") >= before + len(recorded), 10,
                           "the restarted P to count every replayed message")
            finally:
                ctx.destroy(linger=0)
            # D's cached answer names the old P: D asks again and pulls the new transfer at once.
            assert completion(d, 8, params)["choices"][0]["text"] == colocated
            assert dropped(p.url, "receiver") == before + len(recorded)
            drained = wait_drained([p.url, d.url], 30)
            assert all(s is not None and s["blocks_free"] == s["blocks_total"] for s in drained)
