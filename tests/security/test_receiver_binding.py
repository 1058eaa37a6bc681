"""Control MACs bind the receiver (issue 31.4): a message sealed for P rank 0 is refused by P rank 1 even
over a CurveZMQ connection that holds the secret, and a reply sealed for one D socket is refused by
another. Real P (TP 2) and D with KVFERRY_SECRET for the attack; Sealer/Opener for the envelope rules."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest
import zmq

from kvferry.connector.auth import (
    HEAD,
    TO_DECODE,
    TO_PREFILL,
    AuthError,
    OldEnvelope,
    Opener,
    Sealer,
    WrongReceiver,
    boot_id,
    curve_client,
    prefill_receiver,
)
from kvferry.connector.messages import Heartbeat, HeartbeatAck, NotMe, PullRequest, decode_response, encode
from kvferry.harness.processes import HARNESS_SECRET
from kvferry.harness.sampler import wait_drained
from kvferry.transfer.base import ByteRange
from kvferry.transfer.tcp.engine import TcpTransferEngine
from procs import Proc, pd_system, wait_until

SECRET = HARNESS_SECRET.encode()
PROMPT_IDS = [(7 * i) % 250 + 3 for i in range(64)]  # 4 blocks of 16


def dropped(url: str, reason: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=5).text
    found = re.search(rf'^kvferry_control_dropped_total{{reason="{reason}"}} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


def completion(proc: Proc, max_tokens: int, params: dict[str, Any] | None) -> dict[str, Any]:
    body: dict[str, Any] = {"prompt": PROMPT_IDS, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    if params is not None:
        body["kv_transfer_params"] = params
    r = httpx.post(f"{proc.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    result: dict[str, Any] = r.json()
    return result


RANK0, RANK1, OTHER_P = "tcp://10.0.0.1:5600", "tcp://10.0.0.1:5601", "tcp://10.0.0.2:5600"
BOOT = bytes(range(16))  # a P rank's boot id (`auth.boot_id`)


def test_a_pull_sealed_for_one_p_rank_opens_there_alone() -> None:
    sealed = Sealer(SECRET, TO_PREFILL, prefill_receiver(RANK0, BOOT)).seal(b"pull")
    assert Opener(SECRET, TO_PREFILL, prefill_receiver(RANK0, BOOT)).open(sealed) == b"pull"
    for elsewhere in (RANK1, OTHER_P):  # another rank, another P process holding the same secret
        with pytest.raises(WrongReceiver, match="sealed for another receiver") as refused:
            Opener(SECRET, TO_PREFILL, prefill_receiver(elsewhere, BOOT)).open(sealed)
        assert refused.value.reason == "receiver"


def test_a_pull_sealed_for_one_p_process_is_refused_by_its_restart_at_the_same_address() -> None:
    """A fixed control port: the new process has the old one's address and no sequence numbers yet."""
    sealed = Sealer(SECRET, TO_PREFILL, prefill_receiver(RANK0, BOOT)).seal(b"pull")
    with pytest.raises(WrongReceiver, match="sealed for another receiver"):
        Opener(SECRET, TO_PREFILL, prefill_receiver(RANK0, boot_id())).open(sealed)
    with pytest.raises(ValueError, match="boot id is 16 bytes"):
        prefill_receiver(RANK0, b"")


def test_a_reply_sealed_for_one_d_socket_is_refused_by_another() -> None:
    a, b = Sealer(SECRET, TO_PREFILL, prefill_receiver(RANK0, BOOT)), Sealer(SECRET, TO_PREFILL, prefill_receiver(RANK0, BOOT))
    p = Sealer(SECRET, TO_DECODE)
    ask = Opener(SECRET, TO_PREFILL, prefill_receiver(RANK0, BOOT))
    session, _ = ask.unseal(a.seal(b"heartbeat"))
    assert session == a.session != b.session
    reply = p.seal(b"ack", session)  # P answers the session it heard from
    assert Opener(SECRET, TO_DECODE, a.session).open(reply) == b"ack"
    with pytest.raises(WrongReceiver, match="sealed for another receiver"):
        Opener(SECRET, TO_DECODE, b.session).open(reply)


def test_the_receiver_is_under_the_mac() -> None:
    sealed = bytearray(Sealer(SECRET, TO_PREFILL, prefill_receiver(RANK0, BOOT)).seal(b"pull"))
    at = HEAD.size - 8 - 16  # the receiver field, before the sequence number
    sealed[at : at + 16] = prefill_receiver(RANK1, BOOT)  # readdressed on the wire: the MAC no longer fits
    with pytest.raises(AuthError, match="bad MAC"):
        Opener(SECRET, TO_PREFILL, prefill_receiver(RANK1, BOOT)).open(bytes(sealed))


def test_an_authenticated_message_must_name_its_receiver() -> None:
    with pytest.raises(ValueError, match="must name its receiver"):
        Sealer(SECRET, TO_DECODE).seal(b"ack")
    with pytest.raises(ValueError, match="own receiver identity"):
        Opener(SECRET, TO_PREFILL)


@pytest.mark.parametrize("secret", [SECRET, None])
def test_an_older_envelope_gets_a_clear_refusal(secret: bytes | None) -> None:
    sealed = Sealer(secret, TO_PREFILL, prefill_receiver(RANK0, BOOT)).seal(b"pull")
    with pytest.raises(OldEnvelope, match="'KVC2', this side speaks 'KVC3': P and D run different kvferry"):
        Opener(secret, TO_PREFILL, prefill_receiver(RANK0, BOOT)).open(b"KVC2" + sealed[4:48])


def test_without_a_secret_no_receiver_is_checked() -> None:
    """The loopback default: no MAC, so nothing to bind; a receiver is neither needed nor checked."""
    sealed = Sealer(None, TO_PREFILL).seal(b"pull")
    assert Opener(None, TO_PREFILL, prefill_receiver(RANK1, BOOT)).open(sealed) == b"pull"
    assert Opener(None, TO_PREFILL).open(sealed) == b"pull"


@pytest.fixture(scope="module")
def system() -> Iterator[tuple[Proc, Proc, Proc]]:
    with pd_system(p_tp=2, p_args=("--abort-timeout", "30")) as procs:
        yield procs


class Insider:
    """A DEALER that completes CurveZMQ's handshake (it holds the secret) and sends bytes as given."""

    def __init__(self, ctx: zmq.Context[Any], addr: str, boot: str) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        curve_client(self.sock, SECRET)
        self.sock.connect(addr)
        self.sealer = Sealer(SECRET, TO_PREFILL, prefill_receiver(addr, bytes.fromhex(boot)))
        self.opener = Opener(SECRET, TO_DECODE, self.sealer.session)

    def replies_until_ack(self, timeout_s: float = 10.0) -> list[object]:
        """P answers one connection in order: everything it said up to the ack of our own heartbeat (a
        reply sealed for another session as the bytes of its receiver field)."""
        got: list[object] = []
        while not got or not isinstance(got[-1], HeartbeatAck):
            assert self.sock.poll(int(timeout_s * 1000)), f"no answer from P; so far {got}"
            frame = self.sock.recv()
            try:
                got.append(decode_response(self.opener.open(frame)))
            except WrongReceiver:
                got.append(frame)
        return got


def test_a_message_sealed_for_p_rank_0_is_refused_at_rank_1(system: tuple[Proc, Proc, Proc]) -> None:
    p, d, _ = system
    params = completion(p, 1, {"do_remote_decode": True, "transfer_id": "victim-r0"})["kv_transfer_params"]
    connector = httpx.get(f"{p.url}/debug/state", timeout=5).json()["connector"]
    (rank0, rank1), (boot0, boot1) = connector["control_addrs"], connector["control_boots"]
    insider_kv = np.zeros(1 << 20, dtype=np.uint8)
    insider = TcpTransferEngine(secret=SECRET)  # holds the secret: P would write to it if it obeyed
    insider.register("kv", insider_kv)
    grant = insider.open_grant([ByteRange("kv", 0, insider_kv.nbytes)])
    ctx: zmq.Context[Any] = zmq.Context()
    try:
        # Exactly what D's socket to rank 0 seals: a pull for the victim's blocks and a heartbeat.
        d_socket = Sealer(SECRET, TO_PREFILL, prefill_receiver(rank0, bytes.fromhex(boot0)))
        pull = d_socket.seal(encode(PullRequest("victim-r0", "thief", insider.address, grant, [0, 1, 2, 3], 1024,
                                                1, 0, len(PROMPT_IDS))))
        ping = d_socket.seal(encode(Heartbeat(["victim-r0"])))
        before = dropped(p.url, "receiver")
        at_rank1 = Insider(ctx, rank1, boot1)
        for data in (pull, ping, at_rank1.sealer.seal(encode(Heartbeat([])))):
            at_rank1.sock.send(data)
        replies = at_rank1.replies_until_ack()
        assert [type(m) for m in replies] == [bytes, bytes, HeartbeatAck], "rank 1 obeyed rank 0's message"
        for frame in replies[:2]:  # all it says to D's socket: "not me", naming the receiver D sealed for
            assert isinstance(frame, bytes)
            said = decode_response(Opener(SECRET, TO_DECODE, d_socket.session).open(frame))
            assert said == NotMe(d_socket.receiver or b""), said
        wait_until(lambda: dropped(p.url, "receiver") >= before + 2, 10, "rank 1 to count both refusals")
        assert insider.written(grant) == [], "P wrote KV for a message sealed for another rank"
        # The captured bytes are D's own: rank 0, their receiver, accepts them, and seals its ack for the
        # session that sent them (D's socket), which this connection's own session cannot open.
        at_rank0 = Insider(ctx, rank0, boot0)
        at_rank0.sock.send(ping)
        assert at_rank0.sock.poll(10_000), "rank 0 did not answer D's heartbeat"
        ack = at_rank0.sock.recv()
        with pytest.raises(WrongReceiver):
            at_rank0.opener.open(ack)
        assert isinstance(decode_response(Opener(SECRET, TO_DECODE, d_socket.session).open(ack)), HeartbeatAck)
        assert dropped(p.url, "receiver") == before + 2
    finally:
        ctx.destroy(linger=0)
        insider.close()
    # The legitimate transfer is untouched: D pulls both ranks and decodes exactly the colocated answer.
    pulled = completion(d, 8, params)["choices"][0]["text"]
    assert pulled == completion(d, 8, None)["choices"][0]["text"]
    assert all(s is not None and s["blocks_free"] == s["blocks_total"] for s in wait_drained([p.url, d.url], 30))
