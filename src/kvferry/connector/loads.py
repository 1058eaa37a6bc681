"""D's report of one finished load, one record per request: built where the consumer learns it (the
failure spine, a clean pull with P's first token, `decode/landed.py` for quarantine) and handed unchanged
through the worker (`KVConnector.take_load_reports`) to whichever scheduler acts on it: kvferry's
(`engine/scheduler.py`) or vLLM's, through `integrations/vllm/worker.py`, which flattens it to block ids
or per-request failures only where vLLM's API wants those."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kvferry.connector.messages import FirstToken


class LoadCause(enum.StrEnum):
    """Why a KV load failed. The values are the `cause` label of `kvferry_kv_load_failures_total`, the
    `code` of the HTTP error and the "cause" of vLLM's `kvferry_kv_load_failed` log line."""

    BOOTSTRAP = "bootstrap"  # P's bootstrap server did not answer, or refused
    RECV_TIMEOUT = "recv_timeout"  # no reply from P in time
    ERROR_REPLY = "error_reply"  # P answered ERROR without a cause D knows
    ERR_REQS = "err_reqs"  # P named the request among its failed ones
    TRANSPORT = "transport"  # the data plane broke (or bytes missing)
    CHECKSUM = "checksum"  # every byte arrived, and a block's digest does not match
    EXPIRED = "expired"  # P's transfer expired before its write ended
    PROMPT_MISMATCH = "prompt_mismatch"  # P computed another prompt than D's
    PEER_DEAD = "peer_dead"  # P's liveness verdict
    DEADLINE = "deadline"  # the pull outlived `kv_load_deadline_s`
    KV_LOAD_FAILED = "kv_load_failed"  # blocks lost with no cause reported (the scheduler's default)


# Causes P may name in an ERROR reply; anything else is reported as `error_reply`.
P_CAUSES = frozenset({LoadCause.ERROR_REPLY, LoadCause.TRANSPORT, LoadCause.EXPIRED, LoadCause.PROMPT_MISMATCH})


@dataclass(frozen=True)
class LoadReport:
    """What one finished load has to say: the blocks it lost and why, or P's first token, or both none
    (an abort, quarantined)."""

    request_id: str
    block_ids: tuple[int, ...] = ()  # not completely and correctly written
    cause: LoadCause | None = None
    detail: str = ""  # the cause's message (HTTP error message, log line)
    first_token: FirstToken | None = None  # what P sampled after the prompt (a clean load)
    # A posted read may still write the blocks: the host keeps them out of its pool until they come back
    # in finished_sending (`KVConnector.quarantine_loads`).
    quarantined: bool = False

    @property
    def failed(self) -> bool:
        return bool(self.block_ids) or self.cause is not None or self.quarantined
