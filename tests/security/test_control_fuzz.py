"""Every control-message field a stranger controls, fuzzed against a P that holds the secret: whatever
arrives unsealed, sealed with another key, replayed or mangled is dropped and counted, gets no answer,
and the next honest pull is served (issue 19.7)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from connector.test_hostile_input import Rig
from kvferry.connector.auth import HEADER_BYTES, MAGIC, TO_PREFILL, Sealer
from kvferry.connector.messages import Heartbeat, PullRequest, Release, encode
from sealed import Sealed

SECRET = b"a6c67a38c08fcd1aed56ab8e3500845c"  # a fixed random secret (128 bits)

fields = st.fixed_dictionaries({
    "transfer_id": st.text(max_size=40), "d_request_id": st.text(max_size=20),
    "d_transfer_addr": st.text(max_size=30), "grant_token": st.text(max_size=40),
    "block_ids": st.lists(st.integers(-2**63, 2**63 - 1), max_size=8),
    "d_num_blocks": st.integers(-2**63, 2**63 - 1), "d_tp_size": st.integers(-5, 5), "d_tp_rank": st.integers(-5, 5),
    "num_tokens": st.integers(-2**31, 2**31), "lease_s": st.floats(allow_nan=True),
})
messages = st.one_of(
    fields.map(lambda f: encode(PullRequest(**f))),
    st.lists(st.text(max_size=30), max_size=5).map(lambda ids: encode(Heartbeat(ids, lease_s=1e9))),
    st.lists(st.text(max_size=30), max_size=5).map(lambda ids: encode(Release(ids))),
    st.binary(max_size=200),
)


@pytest.fixture(scope="module")
def rig() -> Iterator[Rig]:
    r = Rig(abort_timeout_s=5.0, secret=SECRET)
    yield r
    r.close()


def failures(rig: Rig) -> float:
    value: float = rig.producer.metrics.control_auth_failures.labels(side="prefill")._value.get()
    return value


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(payload=messages, how=st.sampled_from(["unsealed", "other key", "no key", "mangled", "bad header"]))
def test_forged_control_messages_are_dropped(rig: Rig, payload: bytes, how: str, ) -> None:
    if how == "unsealed":
        data = payload
    elif how == "bad header":
        data = MAGIC + bytes(HEADER_BYTES - len(MAGIC)) + payload
    else:
        to_p = rig.sock.sealer.receiver  # sealed for the rank it reaches: only the key is wrong
        data = Sealer(b"9c8ccd78de4f194cad96e4b1226d305c" if how == "other key" else None, TO_PREFILL, to_p).seal(payload)
        if how == "mangled":  # our own key, one bit flipped after sealing
            sealed = Sealer(SECRET, TO_PREFILL, to_p).seal(payload)
            data = sealed[:-1] + bytes([sealed[-1] ^ 1]) if payload else sealed[:20] + bytes([sealed[20] ^ 1]) + sealed[21:]
    before = failures(rig)
    rig.sock.raw.send(data)
    deadline = time.monotonic() + 5
    while failures(rig) < before + 1:
        assert time.monotonic() < deadline, "P neither dropped nor counted a forged message"
        time.sleep(0.002)
    assert not rig.sock.poll(0), "P answered a forged message"
    assert len(rig.producer.table) == 0, "a forged message touched the transfer table"


def test_replayed_message_is_dropped_and_honest_pulls_still_served(rig: Rig) -> None:
    rig.producer.add_ready("replayed", "p-replayed", [1, 2], 8)
    release = rig.sock.sealer.seal(encode(Release(["nothing-live"])))
    rig.sock.raw.send(release)
    before = failures(rig)
    rig.sock.raw.send(release)  # the same bytes again: an on-path observer's replay
    deadline = time.monotonic() + 5
    while failures(rig) < before + 1:
        assert time.monotonic() < deadline
        time.sleep(0.002)
    reply = rig.ask(rig.pull("replayed", [3, 4], num_tokens=8))
    assert reply.status == 0 and reply.d_request_id == "d-replayed", reply  # FINISH
    rig.check_still_serving()


def test_an_honest_peer_without_the_secret_gets_nothing(rig: Rig) -> None:
    ctx: zmq.Context[Any] = zmq.Context()
    raw = ctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(rig.producer.control_addrs[0])
    stranger = Sealed(raw, None)
    before = failures(rig)
    stranger.send(msgspec.msgpack.encode({"type": "hb", "transfer_ids": ["x"]}))
    deadline = time.monotonic() + 5
    while failures(rig) < before + 1:
        assert time.monotonic() < deadline
        time.sleep(0.002)
    assert not raw.poll(100)
    raw.close(0)
    ctx.destroy(linger=0)


def test_many_spellings_of_one_peer_get_one_pull() -> None:
    """Row 7 of issue 19 (no secret needed to see it): 1,000 pulls on one transfer naming 1,000 spellings
    of an address held 1,000 send threads and fds. One address is one peer, and one pull per transfer
    and D rank may be live: the rest are refused without touching the transfer."""
    rig = Rig(abort_timeout_s=5.0)
    try:
        rig.producer.add_ready("popular", "p-popular", [1, 2], 8)
        port = rig.d_engine.address.rpartition(":")[2]
        spellings = [f"127.0.0.1:{'0' * i}{port}" for i in range(40)]
        replies = [rig.ask(rig.pull("popular", [3, 4], num_tokens=8, d_transfer_addr=a)) for a in spellings]
        assert sum(r.status == 0 for r in replies) == 1, [r.err_msg for r in replies]  # one FINISH
        assert all(r.status == 2 for r in replies[1:])  # the others ERROR
        assert rig.producer.senders.threads() <= 1
    finally:
        rig.close()
