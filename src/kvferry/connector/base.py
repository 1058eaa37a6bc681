"""The connector interface, shaped like vLLM's `KVConnectorBase_V1`, split by role.

The scheduler role runs inside the engine-core thread and decides *what* to transfer; the worker role
moves the bytes and reports, once per step, which requests finished sending or receiving and what each
finished load lost (`LoadReport`). The connector never imports the scheduler: what it needs of a request and of a
scheduler step is stated here as Protocols that the engine's types satisfy."""

from __future__ import annotations

import abc
import enum
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from kvferry.connector.layout import KVCacheSpec

if TYPE_CHECKING:
    from kvferry.connector.loads import LoadReport
    from kvferry.connector.messages import FirstToken


class ConnectorRole(enum.Enum):
    SCHEDULER = "scheduler"
    WORKER = "worker"


class RequestLike(Protocol):
    """What the connector reads of a request."""

    @property
    def request_id(self) -> str: ...

    @property
    def prompt_token_ids(self) -> list[int]: ...

    @property
    def kv_transfer_params(self) -> dict[str, Any] | None: ...

    @property
    def num_prompt_tokens(self) -> int: ...

    @property
    def finish_reason(self) -> str | None:
        """"stop" / "length" once finished normally; "abort" / "error" otherwise; None while live."""

    @property
    def first_token(self) -> FirstToken | None:
        """The token sampled after the prompt, and how (None before it, or where the host keeps no such record)."""


class SchedulerOutputLike(Protocol):
    """What the connector reads of one scheduler step."""

    @property
    def step(self) -> int: ...

    @property
    def finished_req_ids(self) -> set[str]: ...


class AdmissionError(ValueError):
    """A request this instance refuses at admission (the API answers 400 with the message)."""


class ConnectorMetadata:
    """Scheduler → worker message built once per step; each connector subclasses it."""


class KVConnector(abc.ABC):
    """Both roles in one class (as vLLM does); an instance is constructed for one role."""

    def __init__(self, role: ConnectorRole) -> None:
        self.role = role

    # ---- scheduler role -------------------------------------------------------------------------
    @abc.abstractmethod
    def get_num_new_matched_tokens(self, request: RequestLike, num_computed_tokens: int) -> tuple[int | None, bool]:
        """(tokens that can be loaded from outside, whether the load is asynchronous).

        None means "ask again later". Must not change any state."""

    @abc.abstractmethod
    def update_state_after_alloc(self, request: RequestLike, block_ids: Sequence[int], num_external_tokens: int) -> None:
        """Blocks were allocated for `request`; may be called twice for one async load (0 tokens the 2nd time)."""

    def on_request_added(self, request: RequestLike) -> None:  # noqa: B027 - optional
        """A request entered the scheduler (queued). P uses it to know which transfers are coming."""

    def claim(self, request_id: str, kv_transfer_params: dict[str, Any] | None) -> None:  # noqa: B027
        """At admission, before the engine sees the request (any thread): raise AdmissionError when this
        instance must refuse it (a transfer_id in use, a prefill host D may not pull from)."""

    def unclaim(self, request_id: str, kv_transfer_params: dict[str, Any] | None) -> None:  # noqa: B027
        """A claimed request never reached the engine."""

    def transfers_ended(self, request_ids: set[str]) -> None:  # noqa: B027 - optional
        """The worker reported these requests' delayed frees done (`finished_sending`)."""

    def pushes_progressively(self, request: RequestLike) -> bool:
        """P, at admission: the connector sends this request's KV while it is computed (no state change).
        The host then gives it every block it can need at once, never preempts it, reports its progress
        after each step (`prefill_progress`) and frees its blocks only through `request_finished`."""
        return False

    def prefill_progress(self, request: RequestLike, block_ids: Sequence[int], num_computed_tokens: int) -> None:  # noqa: B027
        """P, after a step: a `pushes_progressively` request holds `block_ids` and computed this many
        tokens of its prompt (whole blocks of them are final: the connector may read them now)."""

    @abc.abstractmethod
    def build_connector_meta(self, scheduler_output: SchedulerOutputLike) -> ConnectorMetadata: ...

    @abc.abstractmethod
    def request_finished(self, request: RequestLike, block_ids: Sequence[int]) -> tuple[bool, dict[str, Any] | None]:
        """Called once when a request finishes. (delay_free, kv_transfer_params for the client)."""

    # ---- worker role ----------------------------------------------------------------------------
    def register_kv_cache(self, spec: KVCacheSpec, kv_cache: np.ndarray) -> None:  # noqa: B027 - optional
        """Hand the worker the KV cache array so the transfer layer can register it."""

    @abc.abstractmethod
    def start_load_kv(self, metadata: ConnectorMetadata) -> None: ...

    @abc.abstractmethod
    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """(finished_sending, finished_recving) since the last call."""

    def take_load_reports(self) -> list[LoadReport]:
        """Drain the reports of the loads in the last `get_finished`'s finished_recving that have something
        to say: the blocks lost and why, P's first token (the scheduler may emit it instead of computing
        the last prompt position again), quarantine. At most one per request, never after its
        finished_recving."""
        return []

    def quarantine_loads(self) -> bool:
        """The host can quarantine: for a `LoadReport.quarantined` request it keeps the blocks out of its
        pool, owned by no request, until the id comes back in finished_sending, and never computes into them
        meanwhile. A worker whose reads may outlive a failed load (a frozen peer holds them) then reports
        the failure at once and returns True; by default, and towards a host that never calls this, it
        reports such a failure only once its reads ended."""
        return False

    def set_waker(self, wake: Callable[[], None]) -> bool:
        """The engine's wake-up: a worker that calls it whenever it has something for the engine to
        report (finished loads or sends, failures) returns True, and the engine then stops polling it."""
        return False

    def stats(self) -> dict[str, Any]:
        """Counters for /debug/state (pending_pulls, pending_sends, ...)."""
        return {}

    def close(self) -> None:  # noqa: B027 - optional
        pass


class NoOpConnector(KVConnector):
    """Colocated serving: nothing is ever loaded or sent."""

    def __init__(self, role: ConnectorRole = ConnectorRole.SCHEDULER) -> None:
        super().__init__(role)

    def get_num_new_matched_tokens(self, request: RequestLike, num_computed_tokens: int) -> tuple[int | None, bool]:
        return 0, False

    def update_state_after_alloc(self, request: RequestLike, block_ids: Sequence[int], num_external_tokens: int) -> None:
        pass

    def build_connector_meta(self, scheduler_output: SchedulerOutputLike) -> ConnectorMetadata:
        return ConnectorMetadata()

    def request_finished(self, request: RequestLike, block_ids: Sequence[int]) -> tuple[bool, dict[str, Any] | None]:
        return False, None

    def start_load_kv(self, metadata: ConnectorMetadata) -> None:
        pass

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        return set(), set()
