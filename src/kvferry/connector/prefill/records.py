"""The records of P's transfer table (`transfers.py`): a transfer, a write in flight, and the table's
verdict on a pull."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from kvferry.connector.messages import FirstToken, PullRequest, PullResponse


@dataclass(eq=False)
class Write:
    """One data-plane write in flight: it reads the transfer's blocks until `write_done`."""

    transfer_id: str
    p_rank: int
    d_rank: int
    d_tp: int
    peer: str  # D rank's transfer address (where the write goes)
    token: str = ""  # D's grant for this write: cancelling it cancels nothing else


class Kind(enum.StrEnum):
    """What to do with a pull."""

    ENDED = "ended"  # the transfer already ended (`why`)
    FULL = "full"  # too many transfers tracked
    RELEASED = "released"  # a release-only pull
    DROP = "drop"  # never answered (an injected fault)
    DEAD = "dead"  # the P request ended without KV
    PARK = "park"  # the prefill is not done: wait
    SHORT = "short"  # D names more blocks than P holds
    REFUSED = "refused"  # another pull serves this transfer and D rank
    MISMATCH = "mismatch"  # not the prompt P computes
    WRITE = "write"  # the (rest of the) KV, then the final answer
    PART = "part"  # progressive push: the blocks the running prefill completed since the last part
    WAIT = "wait"  # progressive push: nothing to write now
    WRITING = "writing"  # the same pull again: its write is in flight, and answers it
    ANSWERED = "answered"  # the same pull again: `answer` is what its write answered


@dataclass(frozen=True)
class Verdict:
    """The table's answer to a pull (`TransferTable.begin_pull`, `begin_part`)."""

    kind: Kind
    why: str = ""
    write: Write | None = None
    blocks: list[int] = field(default_factory=list)
    first_token: FirstToken | None = None  # what P sampled after the prompt, for D (with the write)
    answer: PullResponse | None = None


@dataclass
class Transfer:
    transfer_id: str
    expires: float  # doomed as "expired" after this (unless P is still working on it)
    request_id: str | None = None  # the P request whose blocks the table holds (freed by `_settle`)
    owner: str | None = None  # the P request that claimed this transfer_id: no other may use it
    block_ids: list[int] | None = None  # set once the prefill is done
    num_tokens: int = 0
    prompt_digest: str = ""
    first_token: FirstToken | None = None
    d_tp: int | None = None  # D's tp size, fixed by the first pull
    dead: str | None = None  # the P request ended without KV (aborted, error)
    working: bool = False  # P has the request queued or prefilling: its KV is coming
    leased: bool = False  # a pull came: from then on D's lease (its heartbeats) decides
    writes: set[Write] = field(default_factory=set)  # in flight: never free under them
    progress: list[int] = field(default_factory=list)  # the prompt blocks the running prefill completed
    pushing: dict[tuple[int, int], str] = field(default_factory=dict)  # (P rank, D rank) → grant pushed to early
    served: set[tuple[int, int]] = field(default_factory=set)  # (p_rank, d_rank) pairs done
    doomed: str | None = None  # why it ends; freed by `_settle` once no write is in flight

    @property
    def ready(self) -> bool:
        return self.block_ids is not None


def mismatch(t: Transfer, pull: PullRequest) -> Verdict | None:
    """Whether the pull is for another prompt than the one P computes (known once the prefill is done,
    or from its first progress): refused before any byte is written, without ending the transfer (a
    router or tokenizer showed P and D different texts; D fails or recomputes, then releases)."""
    if not (t.ready or t.progress):
        return None
    if t.num_tokens != pull.num_tokens:
        return Verdict(Kind.MISMATCH, f"P computed {t.num_tokens} prompt tokens, D has {pull.num_tokens}")
    if t.prompt_digest != pull.prompt_digest:
        return Verdict(Kind.MISMATCH, "D's prompt token ids differ from those P computed")
    return None
