"""A D that stops heartbeating loses its lease: P cancels its writes and frees the blocks long before
the abort timeout, and writes to one D never wait behind writes to a hung D (issue 13.4)."""

from __future__ import annotations

import socket
import time

from test_hostile_input import SPEC, Rig

from kvferry.connector.messages import HeartbeatAck, Status, decode_response

HUNG_PULLS = 6  # more than the old shared pool had threads


def test_hung_d_loses_its_lease_and_stalls_no_other_d() -> None:
    rig = Rig(abort_timeout_s=20.0)
    hung = socket.socket()  # the kernel accepts connections; nobody ever answers the handshake
    hung.bind(("127.0.0.1", 0))
    hung.listen(64)
    hung_addr = f"127.0.0.1:{hung.getsockname()[1]}"
    try:
        for i in range(HUNG_PULLS):
            rig.producer.add_ready(f"h{i}", f"p-h{i}", [1, 2], 2 * SPEC.block_size)
            rig.sock.send(rig.pull(f"h{i}", [5, 6], d_transfer_addr=hung_addr, lease_s=0.5))
        continues = 0
        while continues < HUNG_PULLS:
            assert rig.sock.poll(5000), "P did not start the writes"
            message = decode_response(rig.sock.recv())
            assert not isinstance(message, HeartbeatAck) and message.status == Status.CONTINUE, message
            continues += 1
        started = time.monotonic()
        rig.check_still_serving()  # a healthy D's pull meanwhile
        assert time.monotonic() - started < 2.0, "a healthy D waited behind a hung one"

        # Nobody heartbeats for the hung D's transfers: their 0.5 s lease ends, P cancels and frees.
        freed: set[str] = set()
        deadline = time.monotonic() + 3.0  # the abort timeout is 20 s
        while not {f"p-h{i}" for i in range(HUNG_PULLS)} <= freed:
            assert time.monotonic() < deadline, f"freed only {sorted(freed)}: {rig.producer.table.ids()}"
            freed |= rig.producer.drain_finished()
            time.sleep(0.02)
        errors = 0
        while errors < HUNG_PULLS:
            assert rig.sock.poll(5000), "the cancelled pulls were not answered"
            message = decode_response(rig.sock.recv())
            assert not isinstance(message, HeartbeatAck) and message.status == Status.ERROR
            errors += 1
        rig.wait_no_transfers()
        assert rig.producer.table.writes_in_flight() == 0
    finally:
        hung.close()
        rig.close()
