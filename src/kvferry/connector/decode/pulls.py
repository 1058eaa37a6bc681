"""The decode side's data: what the scheduler asks to pull, one pull's state per request and per
(D rank, P rank) pair, and the outbox the receiver loop fills for the engine thread."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from kvferry.connector.bootstrap import FAIL_AFTER_S, LOOPBACK
from kvferry.connector.faults import FaultSpec
from kvferry.connector.loads import LoadReport
from kvferry.connector.messages import FirstToken, PullResponse
from kvferry.transfer.base import ByteRange

LEASE_HEARTBEATS = 7


@dataclass(frozen=True)
class PullSpec:
    """What the scheduler role hands the worker for one request (via the connector metadata)."""

    request_id: str
    transfer_id: str
    block_ids: list[int]  # empty: release-only pull (P just frees its blocks)
    engine_id: str
    bootstrap_addr: str
    num_tokens: int  # the whole prompt's
    prompt_digest: str = ""  # auth.prompt_digest of D's prompt: P checks it names what it computed
    first_block: int = 0  # the prompt blocks D holds already (prefix cache): `block_ids` start after them


@dataclass(frozen=True)
class ConsumerConfig:
    """D's settings, and the home of each decode-side default: `PDConfig`, `kvferry serve`'s flags and
    vLLM's `KVFerrySettings` read them from here."""

    tp_size: int = 1
    recv_timeout_s: float = 35.0  # PDConfig sets P's abort timeout + 5 s, so P's own "not ready" arrives first
    kv_load_deadline_s: float = 60.0
    checksums: bool = True
    faults: FaultSpec = field(default_factory=FaultSpec)
    # Liveness of P: heartbeats every interval; P is dead after a silence longer than its recent ack
    # round trips allow (liveness.py): at least timeout, at most ceiling (≤ timeout: fixed at timeout).
    # Timeout 0 turns liveness off (heartbeats and connection-close events), leaving only the timeouts,
    # as in vLLM's connectors. The ceiling also caps the lease D asks for.
    heartbeat_interval_s: float = 0.25
    heartbeat_timeout_s: float = 1.5
    heartbeat_ceiling_s: float = 10.0
    # A DEALER no pull uses is closed after this (at once when its connection is gone), so D holds
    # sockets only for live P ranks however often P restarts on new ports.
    dealer_idle_s: float = 10.0
    secret: bytes | None = field(default=None, repr=False)  # seals control messages (auth.py)
    prefill_allow: tuple[str, ...] = LOOPBACK  # the bootstrap hosts D may ask (and so pull from)
    # A bootstrap lookup (P's answer, or the uniform refusal) takes at most this: a P too starved to
    # answer its bootstrap server in time fails D's first pull of it.
    bootstrap_timeout_s: float = FAIL_AFTER_S

    @property
    def liveness(self) -> bool:
        return self.heartbeat_timeout_s > 0

    @property
    def lease_s(self) -> float:
        """The least lease D asks for: how long P holds a transfer without hearing from us (0: P's own
        abort timeout). Seven missed heartbeats: P frees within 2 s of the last one, counting its sweep
        and the write it cancels. A lagging D asks for more (`Consumer.lease_s`)."""
        return LEASE_HEARTBEATS * self.heartbeat_interval_s if self.liveness else 0.0


@dataclass
class PullTask:
    """One (D rank, P rank) pair of a pull."""

    d_rank: int
    p_rank: int
    heads: tuple[int, int]
    control_addr: str
    receiver: bytes  # the P process its messages are sealed for (`RankInfo.receiver`)
    grant: str | None = None
    written: list[ByteRange] | None = None  # final, once the grant is closed
    fenced: str = ""  # the closed grant, when bytes may still land in it (`TransferEngine.draining`)
    checksums: list[int] = field(default_factory=list)
    digest_key: bytes | None = field(default=None, repr=False)  # with a secret: `digest.block_key`
    future: asyncio.Future[PullResponse] | None = None
    done: bool = False
    first_token: FirstToken | None = None  # from P's FINISH


@dataclass
class PullMeta:
    spec: PullSpec
    started: float
    deadline: float
    tasks: list[PullTask] = field(default_factory=list)
    pull_tasks_count: int = 0
    failed: bool = False
    asked_again: int = 0  # times the pull went again to a live P that had not answered it in time
    coroutine: asyncio.Task[None] | None = None

    @property
    def request_id(self) -> str:
        return self.spec.request_id

    @property
    def block_ids(self) -> list[int]:
        return self.spec.block_ids


@dataclass
class Report:
    """One drain of the outbox: everything the loop reported since the last one."""

    finished: set[str] = field(default_factory=set)
    loads: dict[str, LoadReport] = field(default_factory=dict)  # of `finished`: those with something to say
    released: set[str] = field(default_factory=set)  # quarantined earlier, and no read can write them now

    @property
    def invalid(self) -> set[int]:
        return {b for load in self.loads.values() for b in load.block_ids}

    @property
    def causes(self) -> dict[str, tuple[str, str]]:
        return {r: (load.cause.value, load.detail) for r, load in self.loads.items() if load.cause is not None}


class Outbox:
    """Loop thread → engine thread: finished requests with their load reports (lost blocks and cause,
    P's first token, quarantine), and the release of quarantined blocks. Every report wakes the engine
    thread (`waker`), so it need not poll for them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._report = Report()
        self.waker: Callable[[], None] = _nothing
        # The host quarantines (`KVConnector.quarantine_loads`): a failed pull whose reads may still land
        # is reported at once, its blocks' release later (`release`).
        self.quarantine = False

    def report(self, request_id: str, load: LoadReport | None = None) -> None:
        """The request finished loading; `load` says what of it (one record, so a drain never sees the
        request without its blocks, cause or token)."""
        with self._lock:
            if load is not None:
                self._report.loads[request_id] = load
            self._report.finished.add(request_id)
        self.waker()

    def release(self, request_id: str) -> None:
        """A quarantined request's blocks are safe to reuse. Always after its report, so a drain never
        holds the release of a request the host has not yet been told is quarantined."""
        with self._lock:
            self._report.released.add(request_id)
        self.waker()

    def drain(self) -> tuple[set[str], set[int], dict[str, tuple[str, str]]]:
        """finished, lost blocks, request → (cause, message): the flat view of `drain_report`."""
        r = self.drain_report()
        return r.finished, r.invalid, r.causes

    def drain_report(self) -> Report:
        with self._lock:
            report, self._report = self._report, Report()
        return report


def _nothing() -> None:
    pass
