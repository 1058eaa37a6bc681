"""The P/D connector: scheduler role (what to send / pull) and worker role (producer or consumer).

As in vLLM, the two roles only talk through the per-step `PDMetadata`, so they could live in
different processes. kv_transfer_params use the names of vLLM's Mooncake proxy (docs/design.md).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvferry.connector.auth import deployment_secret, prompt_digest
from kvferry.connector.base import (
    AdmissionError,
    ConnectorMetadata,
    ConnectorRole,
    KVConnector,
    RequestLike,
    SchedulerOutputLike,
)
from kvferry.connector.bootstrap import (
    LOOPBACK,
    BootstrapClient,
    BootstrapServer,
    PrefillAllowList,
    Registration,
)
from kvferry.connector.decode.consumer import Consumer
from kvferry.connector.decode.liveness import DEFAULT_CEILING_S
from kvferry.connector.decode.pulls import ConsumerConfig, PullSpec
from kvferry.connector.faults import FaultSpec
from kvferry.connector.layout import KVCacheSpec, KVLayout, PagedKVLayout
from kvferry.connector.messages import FirstToken
from kvferry.connector.metrics import Metrics
from kvferry.connector.prefill.producer import Producer
from kvferry.transfer.addr import join_addr
from kvferry.transfer.base import TransferEngine
from kvferry.transfer.engines import new_engine


@dataclass(frozen=True)
class PDConfig:
    role: str  # "prefill" | "decode"
    engine_id: str
    host: str = "127.0.0.1"
    tp_size: int = 1
    block_size: int = 16
    bootstrap_port: int = 8998
    abort_timeout_s: float = 30.0
    kv_load_deadline_s: float = 60.0
    transfer: str = "tcp"
    checksums: bool = True
    faults: FaultSpec = field(default_factory=FaultSpec)
    heartbeat_interval_s: float = 0.25
    heartbeat_timeout_s: float = 1.5  # 0: no heartbeats and no connection watch (timeouts only)
    # A slow P is waited on (and a lagging D's lease asked for) up to this; ≤ timeout: fixed thresholds.
    heartbeat_ceiling_s: float = DEFAULT_CEILING_S
    # Seals control messages and bootstrap answers, keys the data plane (docs/security.md).
    secret: bytes | None = field(default_factory=deployment_secret, repr=False, compare=False)
    prefill_allow: tuple[str, ...] = LOOPBACK  # decode: the hosts whose bootstrap servers D may ask
    # Fixed ports for firewalls (rank r uses base + r; 0: the kernel picks) and the host peers are told
    # to dial when it is not `host` (a 0.0.0.0 bind, NAT, a Kubernetes Service).
    control_port: int = 0
    data_port: int = 0
    advertise_host: str = ""

    @property
    def advertised_host(self) -> str:
        return self.advertise_host or self.host

    @property
    def recv_timeout_s(self) -> float:
        # Longer than P's abort timeout, so P's own "not ready" answer arrives first.
        return self.abort_timeout_s + 5.0


@dataclass(frozen=True)
class SendSpec:
    transfer_id: str
    request_id: str
    block_ids: list[int]
    num_tokens: int
    prompt_digest: str = ""
    first_token: FirstToken | None = None


@dataclass
class PDMetadata(ConnectorMetadata):
    # (transfer_id, P request id) of requests P queued: their KV is coming
    working: list[tuple[str, str]] = field(default_factory=list)
    to_send: list[SendSpec] = field(default_factory=list)
    dead_transfers: list[tuple[str, str]] = field(default_factory=list)
    to_pull: list[PullSpec] = field(default_factory=list)
    finished_req_ids: set[str] = field(default_factory=set)


class KVTransferParamsError(ValueError):
    pass


def validate_kv_transfer_params(params: dict[str, Any] | None) -> None:
    """Raise a clear error for kv_transfer_params that can never work (the API answers 400)."""
    if not params:
        return
    if params.get("do_remote_decode") and not isinstance(params.get("transfer_id"), str):
        raise KVTransferParamsError("do_remote_decode needs a string transfer_id")
    if params.get("do_remote_prefill"):
        for key in ("transfer_id", "remote_engine_id", "remote_bootstrap_addr"):
            if not isinstance(params.get(key), str) or not params[key]:
                raise KVTransferParamsError(f"do_remote_prefill needs a non-empty string {key}")
        host, sep, port = str(params["remote_bootstrap_addr"]).rpartition(":")
        if not sep or not host or not port.isdigit():
            raise KVTransferParamsError("remote_bootstrap_addr must be host:port")


class PDConnector(KVConnector):
    def __init__(self, role: ConnectorRole, config: PDConfig, metrics: Metrics | None = None) -> None:
        super().__init__(role)
        self.config = config
        self.metrics = metrics or Metrics()
        # scheduler role
        self._working: list[tuple[str, str]] = []
        self._to_send: list[SendSpec] = []
        self._dead: list[tuple[str, str]] = []
        self._to_pull: list[PullSpec] = []
        self._pulling: set[str] = set()
        self._allow = PrefillAllowList(config.prefill_allow)
        # P: transfer_id → the request that owns it, from admission until its blocks are freed; HTTP
        # handlers claim, the engine thread releases.
        self._claims: dict[str, str] = {}
        self._claims_lock = threading.Lock()
        self._lent: dict[str, str] = {}  # P request id → transfer id, while its blocks wait for D
        self._duplicates: set[str] = set()  # P requests that came under a live transfer_id
        # worker role
        self.producer: Producer | None = None
        self.consumer: Consumer | None = None
        self.bootstrap_server: BootstrapServer | None = None
        self.transfer_engines: list[TransferEngine] = []
        self._invalid: set[int] = set()
        self._causes: dict[str, tuple[str, str]] = {}
        self._first_tokens: dict[str, FirstToken] = {}
        self._waker: Callable[[], None] | None = None

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
        self._pulling.add(request.request_id)
        num_prompt_blocks = -(-request.num_prompt_tokens // self.config.block_size)
        self._to_pull.append(self._pull_spec(request, list(block_ids[:num_prompt_blocks])))

    def _pull_spec(self, request: RequestLike, block_ids: list[int]) -> PullSpec:
        params = request.kv_transfer_params or {}
        digest = self._digest(request) if block_ids else ""
        return PullSpec(
            request.request_id,
            str(params["transfer_id"]),
            block_ids,
            str(params["remote_engine_id"]),
            str(params["remote_bootstrap_addr"]),
            request.num_prompt_tokens,
            digest,
        )

    def _digest(self, request: RequestLike) -> str:
        return prompt_digest(list(request.prompt_token_ids), self.config.block_size, self.config.secret)

    def claim(self, request_id: str, kv_transfer_params: dict[str, Any] | None) -> None:
        params = kv_transfer_params or {}
        if self.is_decode:
            if params.get("do_remote_prefill"):
                try:
                    self._allow.check(str(params.get("remote_bootstrap_addr", "")))
                except ValueError as exc:
                    raise AdmissionError(str(exc)) from None
            return
        transfer_id = params.get("transfer_id")
        if params.get("do_remote_decode") and isinstance(transfer_id, str):
            with self._claims_lock:
                owner = self._claims.setdefault(transfer_id, request_id)
            if owner != request_id:
                self.metrics.duplicate_transfer_ids.inc()
                raise AdmissionError(f"transfer_id in use: {transfer_id[:100]!r} is live on this prefill instance")

    def unclaim(self, request_id: str, kv_transfer_params: dict[str, Any] | None) -> None:
        transfer_id = (kv_transfer_params or {}).get("transfer_id")
        if isinstance(transfer_id, str):
            self._release_claim(transfer_id, request_id)

    def _release_claim(self, transfer_id: str, request_id: str) -> None:
        with self._claims_lock:
            if self._claims.get(transfer_id) == request_id:
                del self._claims[transfer_id]

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

    def build_connector_meta(self, scheduler_output: SchedulerOutputLike) -> ConnectorMetadata:
        meta = PDMetadata(self._working, self._to_send, self._dead, self._to_pull,
                          set(scheduler_output.finished_req_ids))
        self._working, self._to_send, self._dead, self._to_pull = [], [], [], []
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
        if request.finish_reason not in ("stop", "length") or not block_ids:
            self._dead.append((transfer_id, request.request_id))
            self._release_claim(transfer_id, request.request_id)
            return False, None
        self._lent[request.request_id] = transfer_id
        self._to_send.append(SendSpec(transfer_id, request.request_id, list(block_ids), request.num_prompt_tokens,
                                      self._digest(request), request.first_token))
        return True, {
            "do_remote_prefill": True,
            "transfer_id": transfer_id,
            "remote_engine_id": self.config.engine_id,
            "remote_bootstrap_addr": join_addr(self.config.advertised_host, self.config.bootstrap_port),
        }

    # ---- worker role ------------------------------------------------------------------------------
    def register_kv_cache(self, spec: KVCacheSpec, kv_cache: np.ndarray) -> None:
        self.register_kv_layout(PagedKVLayout(spec, kv_cache))

    def register_kv_layout(self, layout: KVLayout) -> None:
        """Any memory layout (vLLM's per-layer tensors, say) that can name a block's byte runs."""
        self.transfer_engines = [self._new_transfer_engine(rank) for rank in range(self.config.tp_size)]
        if self.is_decode:
            consumer_config = ConsumerConfig(
                self.config.tp_size,
                self.config.recv_timeout_s,
                self.config.kv_load_deadline_s,
                self.config.checksums,
                self.config.faults,
                self.config.heartbeat_interval_s,
                self.config.heartbeat_timeout_s,
                self.config.heartbeat_ceiling_s,
                secret=self.config.secret,
                prefill_allow=self.config.prefill_allow,
            )
            bootstrap = BootstrapClient(secret=self.config.secret)
            self.consumer = Consumer(layout, self.transfer_engines, consumer_config, self.metrics, bootstrap)
            self._install_waker()
            return
        self.producer = Producer(
            layout, self.transfer_engines, self.config.host, self.config.abort_timeout_s,
            self.config.faults, self.metrics, self.config.secret,
            control_port=self.config.control_port, advertise_host=self.config.advertised_host,
        )
        self.bootstrap_server = BootstrapServer(self.config.host, self.config.bootstrap_port, self.config.faults,
                                                self.config.secret)
        for rank, addr in enumerate(self.producer.control_addrs):
            self.bootstrap_server.register(Registration(self.config.engine_id, self.config.tp_size, rank, addr))
        self.bootstrap_server.start()
        self._install_waker()

    def _new_transfer_engine(self, rank: int) -> TransferEngine:
        port = self.config.data_port and self.config.data_port + rank
        return new_engine(self.config.transfer, self.config.host, port, self.config.secret or b"",
                          join_addr(self.config.advertised_host, port))

    def start_load_kv(self, metadata: ConnectorMetadata) -> None:
        assert isinstance(metadata, PDMetadata)
        if self.producer is not None:
            self.producer.step_started()
            for transfer_id, request_id in metadata.working:  # before to_send: it may end in its first step
                self.producer.add_working(transfer_id, request_id)
            for send in metadata.to_send:
                self.producer.add_ready(send.transfer_id, send.request_id, send.block_ids, send.num_tokens,
                                        send.prompt_digest, send.first_token)
            for transfer_id, request_id in metadata.dead_transfers:
                self.producer.add_dead(transfer_id, request_id)
        if self.consumer is not None:
            self.consumer.start_pulls(metadata.to_pull)
            # A request that ended before admission shows up here too, with its release-only pull.
            releasing = {p.request_id for p in metadata.to_pull if not p.block_ids}
            self.consumer.abort(metadata.finished_req_ids - releasing)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        if self.producer is not None:
            self.producer.step_ended()
            return self.producer.drain_finished(), set()
        if self.consumer is not None:
            finished, invalid, causes, first_tokens = self.consumer.drain_all()
            self._invalid, self._causes, self._first_tokens = invalid, causes, first_tokens
            return set(), finished
        return set(), set()

    def get_block_ids_with_load_errors(self) -> set[int]:
        invalid, self._invalid = self._invalid, set()
        return invalid

    def get_failure_causes(self) -> dict[str, tuple[str, str]]:
        causes, self._causes = self._causes, {}
        return causes

    def get_first_tokens(self) -> dict[str, FirstToken]:
        tokens, self._first_tokens = self._first_tokens, {}
        return tokens

    def set_waker(self, wake: Callable[[], None]) -> bool:
        self._waker = wake
        self._install_waker()
        return True

    def _install_waker(self) -> None:
        if self._waker is None:
            return
        if self.consumer is not None:
            self.consumer.outbox.waker = self._waker
        if self.producer is not None:
            self.producer.table.waker = self._waker

    def stats(self) -> dict[str, Any]:
        return {
            "pending_pulls": self.consumer.pending_pulls if self.consumer else 0,
            "pending_sends": self.producer.table.pending_sends() if self.producer else 0,
            "writes_in_flight": self.producer.table.writes_in_flight() if self.producer else 0,
            "transfer_addrs": [e.address for e in self.transfer_engines],  # advertised
            "transfer_bound": [getattr(e, "bound_address", e.address) for e in self.transfer_engines],
            "control_addrs": self.producer.control_addrs if self.producer else [],  # advertised
            "control_bound": self.producer.control_bound if self.producer else [],
        }

    def close(self) -> None:
        if self.bootstrap_server is not None:
            self.bootstrap_server.stop()
        if self.producer is not None:
            self.producer.close()
        if self.consumer is not None:
            self.consumer.close()
        for engine in self.transfer_engines:
            engine.close()

