"""What the P/D connector's scheduler half hands its worker half each step (`PDMetadata`) and its
records: the sends (`SendSpec`), a running prefill's progress (`Progress`) and the requests that ended
without KV (`Dead`).

As in vLLM, the two halves only talk through the per-step `PDMetadata`, so they could live in
different processes (the scheduler half is `scheduler.py`, the worker half `worker.py`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvferry.connector.base import ConnectorMetadata
from kvferry.connector.decode.pulls import PullSpec
from kvferry.connector.messages import FirstToken


@dataclass(frozen=True)
class SendSpec:
    transfer_id: str
    request_id: str
    block_ids: list[int]
    num_tokens: int
    prompt_digest: str = ""
    first_token: FirstToken | None = None


@dataclass(frozen=True)
class Progress:
    """P: the prompt blocks a running prefill completed so far (whole blocks, in order), and the prompt
    they belong to, so P checks a pull against it before writing any of them."""

    transfer_id: str
    request_id: str
    block_ids: list[int]
    num_tokens: int
    prompt_digest: str


@dataclass(frozen=True)
class Dead:
    """P: a request that ended without KV; `lent`: its blocks go to the producer (a partial write may read
    them), which hands them back in finished_sending."""

    transfer_id: str
    request_id: str
    lent: bool = False


@dataclass
class PDMetadata(ConnectorMetadata):
    # (transfer_id, P request id) of requests P queued: their KV is coming
    working: list[tuple[str, str]] = field(default_factory=list)
    progress: list[Progress] = field(default_factory=list)
    to_send: list[SendSpec] = field(default_factory=list)
    dead_transfers: list[Dead] = field(default_factory=list)
    to_pull: list[PullSpec] = field(default_factory=list)
    finished_req_ids: set[str] = field(default_factory=set)
