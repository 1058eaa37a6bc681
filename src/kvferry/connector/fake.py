"""A scripted connector for tests and benchmarks: it reports what the test planned, at the step it chose.

Both roles live in one object. Steps are counted by `get_finished` calls (once per engine step)."""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvferry.connector.base import (
    ConnectorMetadata,
    ConnectorRole,
    KVConnector,
    RequestLike,
    SchedulerOutputLike,
)
from kvferry.connector.loads import LoadCause, LoadReport
from kvferry.connector.messages import FirstToken

# Called when a planned load completes, with the request's local block ids, to fill the KV cache.
FillFn = Callable[[list[int]], None]


@dataclass
class LoadPlan:
    num_tokens: int | None  # None: tokens = whole prompt
    after_steps: int = 1
    invalid_block_indices: tuple[int, ...] = ()
    cause: tuple[str, str] | None = None  # reported with the failure; None = no cause
    fill: FillFn | None = None
    never_finish: bool = False
    first_token: FirstToken | None = None  # what P sampled, reported with the finished load
    # Reported quarantined (a read may still write the blocks), released this many steps later, when
    # `late_fill` writes them (the read that ends then).
    quarantine_steps: int | None = None
    late_fill: FillFn | None = None


@dataclass
class _Event:
    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    loads: dict[str, LoadReport] = field(default_factory=dict)
    fills: list[tuple[FillFn, list[int]]] = field(default_factory=list)


class ScriptedConnector(KVConnector):
    def __init__(self) -> None:
        super().__init__(ConnectorRole.WORKER)
        self.loads: dict[str, LoadPlan] = {}
        self.sends: dict[str, int] = {}  # request id → steps after finish until finished_sending
        self.step = 0
        self._events: defaultdict[int, _Event] = defaultdict(_Event)
        self._pending_loads: set[str] = set()
        self._current = _Event()
        self._never_finish: dict[str, bool] = {}
        self.finished_calls: list[str] = []
        self.alloc_calls: list[tuple[str, list[int], int]] = []
        self._blocks: dict[str, list[int]] = {}
        self.progressive: set[str] = set()  # request ids P pushes while they are computed
        self.progress: defaultdict[str, list[tuple[int, list[int]]]] = defaultdict(list)  # (computed, blocks)

    # ---- planning (test API) ----------------------------------------------------------------------
    def plan_load(self, request_id: str, plan: LoadPlan) -> None:
        self.loads[request_id] = plan

    def plan_send(self, request_id: str, after_steps: int = 1) -> None:
        self.sends[request_id] = after_steps

    def plan_progressive(self, request_id: str) -> None:
        """P pushes this request's KV while it is computed (`pushes_progressively`)."""
        self.progressive.add(request_id)

    def inject(self, after_steps: int, **fields: Any) -> None:
        """Report arbitrary ids (e.g. unknown ones) `after_steps` steps from now."""
        event = self._events[self.step + after_steps]
        for name, values in fields.items():
            getattr(event, name).update(values)

    # ---- scheduler role ---------------------------------------------------------------------------
    def _plan(self, request: RequestLike) -> LoadPlan | None:
        """Plans are keyed by request id, or by the transfer_id of the request's kv_transfer_params."""
        plan = self.loads.get(request.request_id)
        if plan is None and request.kv_transfer_params:
            plan = self.loads.get(str(request.kv_transfer_params.get("transfer_id")))
        return plan

    def get_num_new_matched_tokens(self, request: RequestLike, num_computed_tokens: int) -> tuple[int | None, bool]:
        plan = self._plan(request)
        if plan is None or request.request_id in self._pending_loads:
            return 0, False
        tokens = request.num_prompt_tokens if plan.num_tokens is None else plan.num_tokens
        return tokens, tokens > 0

    def pushes_progressively(self, request: RequestLike) -> bool:
        return request.request_id in self.progressive

    def prefill_progress(self, request: RequestLike, block_ids: Sequence[int], num_computed_tokens: int) -> None:
        self.progress[request.request_id].append((num_computed_tokens, list(block_ids)))

    def update_state_after_alloc(self, request: RequestLike, block_ids: Sequence[int], num_external_tokens: int) -> None:
        self.alloc_calls.append((request.request_id, list(block_ids), num_external_tokens))
        plan = self._plan(request)
        if plan is None or num_external_tokens == 0:
            return
        self._pending_loads.add(request.request_id)
        self._never_finish[request.request_id] = plan.never_finish
        self._blocks[request.request_id] = list(block_ids)
        if plan.never_finish:
            return
        event = self._events[self.step + plan.after_steps]
        event.finished_recving.add(request.request_id)
        cause, detail = plan.cause or (None, "")
        load = LoadReport(request.request_id, tuple(block_ids[i] for i in plan.invalid_block_indices),
                          None if cause is None else LoadCause(cause), detail, plan.first_token)
        if load.failed or load.first_token is not None:
            event.loads[request.request_id] = load
        self._quarantine(request.request_id, plan, plan.after_steps)
        if plan.fill is not None:
            event.fills.append((plan.fill, list(block_ids)))

    def build_connector_meta(self, scheduler_output: SchedulerOutputLike) -> ConnectorMetadata:
        # An abort of a parked load is reported back on the next step, as a real worker would.
        for request_id in scheduler_output.finished_req_ids & self._pending_loads:
            if self._never_finish.get(request_id):
                self._events[self.step + 1].finished_recving.add(request_id)
                plan = self.loads.get(request_id)
                if plan is not None:
                    self._quarantine(request_id, plan, 1)
        return ConnectorMetadata()

    def _quarantine(self, request_id: str, plan: LoadPlan, after_steps: int) -> None:
        if plan.quarantine_steps is None:
            return
        loads = self._events[self.step + after_steps].loads
        loads[request_id] = dataclasses.replace(loads.get(request_id) or LoadReport(request_id), quarantined=True)
        release = self._events[self.step + after_steps + plan.quarantine_steps]
        release.finished_sending.add(request_id)
        if plan.late_fill is not None:
            release.fills.append((plan.late_fill, self._blocks[request_id]))

    def request_finished(self, request: RequestLike, block_ids: Sequence[int]) -> tuple[bool, dict[str, Any] | None]:
        self.finished_calls.append(request.request_id)
        after = self.sends.get(request.request_id)
        if after is None or not block_ids:
            return False, None
        self._events[self.step + after].finished_sending.add(request.request_id)
        return True, {"do_remote_prefill": True, "transfer_id": f"xfer-{request.request_id}"}

    # ---- worker role ------------------------------------------------------------------------------
    def start_load_kv(self, metadata: ConnectorMetadata) -> None:
        pass

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        self.step += 1
        event = self._events.get(self.step)
        if event is None:
            self._current = _Event()
            return set(), set()
        del self._events[self.step]
        self._current = event
        for fill, block_ids in event.fills:
            fill(block_ids)
        self._pending_loads -= event.finished_recving
        return event.finished_sending, event.finished_recving

    def take_load_reports(self) -> list[LoadReport]:
        loads = list(self._current.loads.values())
        self._current.loads.clear()
        return loads

    def quarantine_loads(self) -> bool:
        return True

    def stats(self) -> dict[str, Any]:
        return {"pending_pulls": len(self._pending_loads)}
