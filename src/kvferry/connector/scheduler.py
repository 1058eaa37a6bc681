"""The P/D connector's scheduler half: what to send (P) or pull (D), and which transfer ids are live on P.

As in vLLM, the two halves only talk through the per-step `PDMetadata` (metadata.py), so they could live
in different processes (the worker half is `worker.py`, the `KVConnector` facade `facade.py`, the
configuration `config.py`). kv_transfer_params use the names of vLLM's Mooncake proxy (docs/design.md)."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence
from typing import Any

from kvferry.connector.auth import prompt_digest
from kvferry.connector.base import AdmissionError, ConnectorMetadata, RequestLike, SchedulerOutputLike
from kvferry.connector.bootstrap import PrefillAllowList
from kvferry.connector.config import PDConfig
from kvferry.connector.decode.pulls import PullSpec
from kvferry.connector.metadata import Dead, PDMetadata, Progress, SendSpec
from kvferry.connector.metrics import Metrics
from kvferry.transfer.addr import join_addr


class PDScheduler:
    """The scheduler half (the engine's scheduler thread; P's HTTP handlers also claim and unclaim)."""

    def __init__(self, config: PDConfig, metrics: Metrics) -> None:
        self.config = config
        self.metrics = metrics
        self._working: list[tuple[str, str]] = []
        self._progress: list[Progress] = []
        self._to_send: list[SendSpec] = []
        self._dead: list[Dead] = []
        self._to_pull: list[PullSpec] = []
        self._pulling: set[str] = set()
        PrefillAllowList(config.prefill_allow)  # a bad entry fails here, at start
        # P: transfer_id → the request that owns it, from admission until its blocks are freed; HTTP
        # handlers claim, the engine thread releases.
        self.claims: dict[str, str] = {}
        self._claims_lock = threading.Lock()
        self._lent: dict[str, str] = {}  # P request id → transfer id, while its blocks wait for D
        self._duplicates: set[str] = set()  # P requests that came under a live transfer_id
        self._pushing: dict[str, Progress] = {}  # P request id → its last progress, while it prefills

    @property
    def is_decode(self) -> bool:
        return self.config.role == "decode"

    # ---- scheduler role ---------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: RequestLike, num_computed_tokens: int) -> tuple[int | None, bool]:
        params = request.kv_transfer_params or {}
        if not self.is_decode or not params.get("do_remote_prefill") or request.request_id in self._pulling:
            return 0, False
        remaining = request.num_prompt_tokens - num_computed_tokens
        return remaining, remaining > 0

    def update_state_after_alloc(self, request: RequestLike, block_ids: Sequence[int], num_external_tokens: int) -> None:
        params = request.kv_transfer_params or {}
        if num_external_tokens == 0 or not self.is_decode or not params.get("do_remote_prefill"):
            return
        first = self.first_block(request, num_external_tokens)
        num_prompt_blocks = -(-request.num_prompt_tokens // self.config.block_size)
        self.pull(request, list(block_ids[first:num_prompt_blocks]), first)

    def first_block(self, request: RequestLike, num_external_tokens: int) -> int:
        """The prompt blocks the request holds already (a prefix-cache hit): those before the
        `num_external_tokens` it loads. Rounded down, so a scheduler that loads less than it was
        offered (vLLM trims a load to whole blocks for some models) never has its own blocks written."""
        return max(0, request.num_prompt_tokens - num_external_tokens) // self.config.block_size

    def pull(self, request: RequestLike, block_ids: list[int], first_block: int = 0) -> None:
        """Pull the prompt's KV from prompt block `first_block` on into exactly `block_ids` (vLLM's
        hybrid KV cache: each group's blocks)."""
        self._pulling.add(request.request_id)
        self._to_pull.append(self._pull_spec(request, block_ids, first_block))

    def _pull_spec(self, request: RequestLike, block_ids: list[int], first_block: int = 0) -> PullSpec:
        params = request.kv_transfer_params or {}
        digest = self._digest(request) if block_ids else ""  # of the whole prompt, whatever D holds
        return PullSpec(request.request_id, str(params["transfer_id"]), block_ids,
                        str(params["remote_engine_id"]), str(params["remote_bootstrap_addr"]),
                        request.num_prompt_tokens, digest, first_block)

    def _digest(self, request: RequestLike) -> str:
        return prompt_digest(list(request.prompt_token_ids), self.config.block_size, self.config.secret)

    def claim(self, request_id: str, kv_transfer_params: dict[str, Any] | None) -> None:
        params = kv_transfer_params or {}
        if self.is_decode:  # a bootstrap target outside --prefill-allow fails in the consumer, as every
            return  # failed target does: one answer at one time, no port oracle
        transfer_id = params.get("transfer_id")
        if params.get("do_remote_decode") and isinstance(transfer_id, str):
            with self._claims_lock:
                owner = self.claims.setdefault(transfer_id, request_id)
            if owner != request_id:
                self.metrics.duplicate_transfer_ids.inc()
                raise AdmissionError(f"transfer_id in use: {transfer_id[:100]!r} is live on this prefill instance")

    def unclaim(self, request_id: str, kv_transfer_params: dict[str, Any] | None) -> None:
        transfer_id = (kv_transfer_params or {}).get("transfer_id")
        if isinstance(transfer_id, str):
            self._release_claim(transfer_id, request_id)

    def _release_claim(self, transfer_id: str, request_id: str) -> None:
        with self._claims_lock:
            if self.claims.get(transfer_id) == request_id:
                del self.claims[transfer_id]

    def transfers_ended(self, request_ids: set[str]) -> None:
        for request_id in request_ids:
            transfer_id = self._lent.pop(request_id, None)
            if transfer_id is not None:
                self._release_claim(transfer_id, request_id)

    def on_request_added(self, request: RequestLike) -> None:
        params = request.kv_transfer_params or {}
        transfer_id = params.get("transfer_id")
        if self.is_decode or not params.get("do_remote_decode") or not isinstance(transfer_id, str):
            return
        try:
            self.claim(request.request_id, params)  # already claimed at admission on the HTTP path
        except AdmissionError:
            self._duplicates.add(request.request_id)  # served, but never in the first one's place
            return
        self._working.append((transfer_id, request.request_id))

    def pushes_progressively(self, request: RequestLike) -> bool:
        """P: whether this request's KV goes to D while it is computed (side-effect free)."""
        params = request.kv_transfer_params or {}
        transfer_id = params.get("transfer_id")
        return (not self.is_decode and self.config.progressive_push and bool(params.get("do_remote_decode"))
                and isinstance(transfer_id, str) and request.request_id not in self._duplicates
                and request.num_prompt_tokens >= self.config.progressive_min_tokens)

    def prefill_progress(self, request: RequestLike, block_ids: Sequence[int], num_computed_tokens: int) -> None:
        """P: the request (`pushes_progressively`) computed this much of its prompt after a step."""
        complete = min(num_computed_tokens, request.num_prompt_tokens) // self.config.block_size
        last = self._pushing.get(request.request_id)
        if complete == 0 or (last is not None and complete <= len(last.block_ids)):
            return
        if last is None:
            transfer_id = str((request.kv_transfer_params or {})["transfer_id"])
            last = Progress(transfer_id, request.request_id, [], request.num_prompt_tokens, self._digest(request))
        self._pushing[request.request_id] = progress = dataclasses.replace(last, block_ids=list(block_ids[:complete]))
        self._progress.append(progress)

    def build_connector_meta(self, scheduler_output: SchedulerOutputLike) -> ConnectorMetadata:
        meta = PDMetadata(self._working, self._progress, self._to_send, self._dead, self._to_pull,
                          set(scheduler_output.finished_req_ids))
        self._working, self._progress, self._to_send, self._dead, self._to_pull = [], [], [], [], []
        return meta

    def request_finished(self, request: RequestLike, block_ids: Sequence[int]) -> tuple[bool, dict[str, Any] | None]:
        params = request.kv_transfer_params or {}
        if self.is_decode:
            if params.get("do_remote_prefill") and request.request_id not in self._pulling:
                # Ended before it was admitted: a release-only pull lets P free its blocks now.
                self._to_pull.append(self._pull_spec(request, []))
            self._pulling.discard(request.request_id)
            return False, None
        if not params.get("do_remote_decode"):
            return False, None
        transfer_id = str(params["transfer_id"])
        if request.request_id in self._duplicates:
            self._duplicates.discard(request.request_id)
            return False, None
        # Blocks a partial write may be reading stay out of the pool until the producer hands them back.
        pushed = self._pushing.pop(request.request_id, None)
        lent = pushed is not None and bool(block_ids)
        if request.finish_reason not in ("stop", "length") or not block_ids:
            self._dead.append(Dead(transfer_id, request.request_id, lent))
            self._release_claim(transfer_id, request.request_id)
            return lent, None
        self._lent[request.request_id] = transfer_id
        self._to_send.append(SendSpec(transfer_id, request.request_id, list(block_ids), request.num_prompt_tokens,
                                      pushed.prompt_digest if pushed else self._digest(request), request.first_token))
        return True, {
            "do_remote_prefill": True,
            "transfer_id": transfer_id,
            "remote_engine_id": self.config.engine_id,
            "remote_bootstrap_addr": join_addr(self.config.advertised_host, self.config.bootstrap_port),
        }
