"""kvferry as a vLLM KV connector (`KVConnectorBase_V1`, written against vLLM 0.33).

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KVFerryConnector",
        "kv_connector_module_path": "kvferry.integrations.vllm", "kv_role": "kv_producer",
        "kv_connector_extra_config": {"bootstrap_port": 8998}}'

Both roles delegate to kvferry's `PDConnector`: `kv_producer` → its prefill side, `kv_consumer` → its
decode side, `kv_both` → one of each, chosen per request by its kv_transfer_params (`do_remote_decode`
→ prefill side, `do_remote_prefill` → decode side). kvferry settings come from
`kv_connector_extra_config` (see `KVFerrySettings`). This is the only kvferry module that imports vLLM;
`import kvferry` never does.

What vLLM's scheduler requires, and how it is met here:
- each finished id is reported once per direction, and only ids vLLM still holds: the worker reports a
  sending id only for a transfer the scheduler handed it (vLLM then holds the blocks, `delay_free`), and
  a receiving id only for a pull into blocks (never for a release-only pull); anything else is dropped
  and logged;
- failed loads: the request is reported in finished_recving in the same step as its invalid blocks
  (`get_block_ids_with_load_errors`), so `kv_load_failure_policy` decides: `fail` → FINISHED_ERROR,
  `recompute` → computed tokens cut at the first invalid block. Hybrid (multi-group) KV caches are not
  declared (no `SupportsHMA`), so vLLM disables its hybrid allocator and block ids are unambiguous;
- `update_state_after_alloc` called again with 0 external tokens after an async load is ignored.

What kvferry requires of vLLM's scheduler, and where it comes from:
- P must know a transfer is coming from the moment its request is queued (`PDConnector.on_request_added`):
  only then does it keep a pull for it parked, and say "working" in D's heartbeat acks, however long
  the request waits in P's queue; otherwise D's receive timeout (and P's abort timeout on a parked pull)
  would count P's queueing time. vLLM calls `on_new_request` when a request is added (0.33), and
  `get_num_new_matched_tokens` whenever it considers a waiting request (earlier versions have only
  this one, and vLLM skips it while every run slot is taken); both report the request, once.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorMetadata,
        KVConnectorRole,
        KVConnectorWorkerMetadata,
    )
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "kvferry.integrations.vllm needs vLLM (tested with 0.33): build the optional environment with "
        "`bash .ci/vllm-env.sh`, or `pip install 'kvferry[vllm]'`"
    ) from exc

from kvferry.connector.auth import deployment_secret, is_loopback
from kvferry.connector.base import ConnectorRole
from kvferry.connector.bootstrap import LOOPBACK, PrefillAllowList
from kvferry.connector.decode.liveness import DEFAULT_CEILING_S
from kvferry.connector.faults import FaultSpec
from kvferry.connector.pd import (
    KVTransferParamsError,
    PDConfig,
    PDConnector,
    PDMetadata,
    validate_kv_transfer_params,
)
from kvferry.connector.router_params import RouterParamsError, normalize_kv_transfer_params
from kvferry.integrations.vllm_layout import VllmKVLayout
from kvferry.integrations.vllm_metrics import KVFerryPromMetrics, KVFerryStats

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

PREFILL, DECODE = "prefill", "decode"
_ROLES = {"kv_producer": (PREFILL,), "kv_consumer": (DECODE,), "kv_both": (PREFILL, DECODE)}
_MAX_REMEMBERED = 10_000  # bounded memory of per-request notes (warnings, failure causes)


@dataclass(frozen=True)
class KVFerrySettings:
    """`kv_connector_extra_config` keys (all optional). Unknown keys are rejected, so a typo fails fast."""

    engine_id: str  # default: vLLM's kv_transfer_config.engine_id
    host: str = "127.0.0.1"  # address P's bootstrap/control/transfer endpoints bind and advertise
    bootstrap_port: int = 8998
    abort_timeout_s: float = 30.0  # P frees blocks nobody pulled after this (lease)
    kv_load_deadline_s: float = 60.0  # D gives up on a pull after this (failure cause "deadline")
    transfer: str = "tcp"  # "tcp" (built in), "mooncake" or "nixl" (loopback unless insecure)
    checksums: bool = True
    faults: str = ""  # fault injection spec (tests, chaos); default: env KVFERRY_FAULTS
    # D: heartbeat period (P's lease on a pulled transfer is 7 periods) and how long P may stay silent
    heartbeat_interval_s: float = 0.25
    heartbeat_timeout_s: float = 1.5
    heartbeat_ceiling_s: float = DEFAULT_CEILING_S  # most a slow P is waited on (liveness adapts up to it)
    # Copy KV through a host mirror: "auto" when the KV cache is not in host memory (a GPU), "always"
    # (host memory too: tests), "never" (a KV cache on a device is refused)
    staging: str = "auto"
    prefill_allow: tuple[str, ...] = LOOPBACK  # D: the hosts whose bootstrap servers it may pull from
    insecure: bool = False  # a non-loopback host without KVFERRY_SECRET (as `kvferry serve --insecure`)
    control_port: int = 0  # P: the ZMQ control socket's fixed port (0: the kernel picks)
    data_port: int = 0  # the TCP data plane's fixed port (0: the kernel picks)
    advertise_host: str = ""  # the address peers dial (default: host; required when host is 0.0.0.0)

    KEYS = ("engine_id", "host", "bootstrap_port", "abort_timeout_s", "kv_load_deadline_s", "transfer",
            "checksums", "faults", "heartbeat_interval_s", "heartbeat_timeout_s", "heartbeat_ceiling_s", "staging", "prefill_allow",
            "insecure", "control_port", "data_port", "advertise_host")
    STAGING = {"auto": None, "always": True, "never": False}

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any], default_engine_id: str) -> KVFerrySettings:
        unknown = sorted(set(extra) - set(cls.KEYS))
        if unknown:
            raise ValueError(f"unknown kvferry setting(s) {unknown} in kv_connector_extra_config; known: {cls.KEYS}")
        settings = cls(
            engine_id=str(extra.get("engine_id") or default_engine_id),
            host=str(extra.get("host", os.environ.get("KVFERRY_HOST", "127.0.0.1"))),
            bootstrap_port=int(extra.get("bootstrap_port", 8998)),
            abort_timeout_s=float(extra.get("abort_timeout_s", 30.0)),
            kv_load_deadline_s=float(extra.get("kv_load_deadline_s", 60.0)),
            transfer=str(extra.get("transfer", "tcp")),
            checksums=bool(extra.get("checksums", True)),
            faults=str(extra.get("faults", os.environ.get("KVFERRY_FAULTS", ""))),
            heartbeat_interval_s=float(extra.get("heartbeat_interval_s", 0.25)),
            heartbeat_timeout_s=float(extra.get("heartbeat_timeout_s", 1.5)),
            heartbeat_ceiling_s=float(extra.get("heartbeat_ceiling_s", DEFAULT_CEILING_S)),
            staging=str(extra.get("staging", "auto")),
            prefill_allow=tuple(str(h) for h in extra.get("prefill_allow", LOOPBACK)),
            insecure=bool(extra.get("insecure", False)),
            control_port=int(extra.get("control_port", 0)),
            data_port=int(extra.get("data_port", 0)),
            advertise_host=str(extra.get("advertise_host", "")),
        )
        if settings.host in ("0.0.0.0", "::") and not settings.advertise_host:
            raise ValueError(f"host {settings.host} binds every interface: set advertise_host to the address peers dial")
        PrefillAllowList(settings.prefill_allow)  # raises on a bad entry
        if not settings.insecure and deployment_secret() is None and not is_loopback(settings.host):
            raise ValueError(f"host {settings.host} is reachable from other machines and KVFERRY_SECRET is not set: "
                             "set it on every P and D (docs/security.md), or \"insecure\": true on an isolated network")
        if settings.insecure and deployment_secret() is None:
            log.warning("kvferry: insecure: control and data planes on %s are unauthenticated", settings.host)
        if settings.staging not in cls.STAGING:
            raise ValueError(f"staging must be one of {sorted(cls.STAGING)}, not {settings.staging!r}")
        if settings.heartbeat_interval_s <= 0 or settings.heartbeat_timeout_s < 0:
            raise ValueError("heartbeat_interval_s must be > 0 and heartbeat_timeout_s >= 0")
        if settings.transfer not in ("tcp", "mooncake", "nixl"):
            raise ValueError(f"transfer must be 'tcp', 'mooncake' or 'nixl', not {settings.transfer!r}")
        if settings.transfer == "nixl":
            _check_nixl(settings.host, settings.insecure)
        FaultSpec.parse(settings.faults)  # raises on a bad spec
        return settings

    def pd_config(self, role: str, block_size: int) -> PDConfig:
        return PDConfig(
            role=role,
            engine_id=self.engine_id,
            host=self.host,
            tp_size=1,  # one vLLM worker process = one kvferry rank
            block_size=block_size,
            bootstrap_port=self.bootstrap_port,
            abort_timeout_s=self.abort_timeout_s,
            kv_load_deadline_s=self.kv_load_deadline_s,
            transfer=self.transfer,
            checksums=self.checksums,
            faults=FaultSpec.parse(self.faults),
            heartbeat_interval_s=self.heartbeat_interval_s,
            heartbeat_timeout_s=self.heartbeat_timeout_s,
            heartbeat_ceiling_s=self.heartbeat_ceiling_s,
            prefill_allow=self.prefill_allow,
            control_port=self.control_port,
            data_port=self.data_port,
            advertise_host=self.advertise_host,
        )


@dataclass
class KVFerryConnectorMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """Scheduler → worker, once per step: kvferry's `PDMetadata` per role."""

    by_role: dict[str, PDMetadata] = field(default_factory=dict)


@dataclass
class KVFerryWorkerMetadata(KVConnectorWorkerMetadata):  # type: ignore[misc]
    """Worker → scheduler, once per step: why loads failed (request id → (cause, message))."""

    causes: dict[str, tuple[str, str]] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        causes = dict(self.causes)
        if isinstance(other, KVFerryWorkerMetadata):
            causes.update(other.causes)
        return KVFerryWorkerMetadata(causes)


class _RequestView:
    """A vLLM `Request` as kvferry's `RequestLike`; kv_transfer_params that can never work read as None."""

    __slots__ = ("_request", "_params")

    def __init__(self, request: Any, params: dict[str, Any] | None) -> None:
        self._request, self._params = request, params

    @property
    def request_id(self) -> str:
        return str(self._request.request_id)

    @property
    def prompt_token_ids(self) -> list[int]:
        return list(self._request.prompt_token_ids or ())

    @property
    def kv_transfer_params(self) -> dict[str, Any] | None:
        return self._params

    @property
    def num_prompt_tokens(self) -> int:
        return int(self._request.num_prompt_tokens)

    @property
    def finish_reason(self) -> str | None:
        reason = self._request.get_finished_reason()
        return None if reason is None else str(reason)  # vLLM's FinishReason prints "stop", "length", ...


@dataclass(frozen=True)
class _StepView:
    """A vLLM `SchedulerOutput` as kvferry's `SchedulerOutputLike`."""

    step: int
    finished_req_ids: set[str]


class KVFerryConnector(KVConnectorBase_V1):  # type: ignore[misc]
    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        kv_config = self._kv_transfer_config
        parallel = vllm_config.parallel_config
        if (parallel.tensor_parallel_size, parallel.pipeline_parallel_size, parallel.data_parallel_size) != (1, 1, 1):
            raise ValueError("KVFerryConnector supports one worker per engine (tensor, pipeline and data parallel "
                             "size 1); run one vLLM instance per GPU instead")
        if kv_cache_config is not None and len(kv_cache_config.kv_cache_groups) > 1:
            raise ValueError("KVFerryConnector supports a single KV cache group (no hybrid allocator)")
        if kv_config.kv_role not in _ROLES:
            raise ValueError(f"unsupported kv_role {kv_config.kv_role!r}")
        self.settings = KVFerrySettings.from_extra_config(
            dict(kv_config.kv_connector_extra_config or {}), str(kv_config.engine_id)
        )
        self.block_size = int(vllm_config.cache_config.block_size)
        pd_role = ConnectorRole.SCHEDULER if role == KVConnectorRole.SCHEDULER else ConnectorRole.WORKER
        self.pd: dict[str, PDConnector] = {
            r: PDConnector(pd_role, self.settings.pd_config(r, self.block_size)) for r in _ROLES[kv_config.kv_role]
        }
        self.layout: VllmKVLayout | None = None
        self.connector_cpus: set[int] = set()
        self._step = 0
        self._bad_params: OrderedDict[str, None] = OrderedDict()
        self.failure_causes: OrderedDict[str, tuple[str, str]] = OrderedDict()  # scheduler side, for logs/tests
        self._failures = KVFerryStats()  # scheduler side: failures by cause since the last stats report
        self._transfer_ids: OrderedDict[str, str] = OrderedDict()  # request id → transfer id (for logs)
        # Requests already told to the prefill side as queued (reported once; forgotten when they finish).
        self._queued: OrderedDict[str, None] = OrderedDict()
        # worker side: ids the scheduler may be told about (each once)
        self._expect_send: set[str] = set()
        self._expect_recv: set[str] = set()
        self._causes: dict[str, tuple[str, str]] = {}
        self._warned_local = False

    # ---- helpers ----------------------------------------------------------------------------------
    def _view(self, request: Any) -> _RequestView:
        params = request.kv_transfer_params
        try:
            # vllm-router's shapes (NIXL: no transfer_id; Mooncake: http:// bootstrap address) → kvferry's.
            params = normalize_kv_transfer_params(params, str(request.request_id))
            validate_kv_transfer_params(params)
        except (KVTransferParamsError, RouterParamsError) as exc:
            if request.request_id not in self._bad_params:
                _remember(self._bad_params, request.request_id, None)
                log.warning("request %s: kv_transfer_params ignored (%s): %s", request.request_id, exc, params)
            params = None
        return _RequestView(request, params)

    # ---- scheduler role ---------------------------------------------------------------------------
    def on_new_request(self, request: Any) -> None:
        """vLLM (0.33) added a request to its waiting queue."""
        self._note_queued(request)

    def _note_queued(self, request: Any) -> None:
        """P: tell the prefill side that a `do_remote_decode` request is queued (once per request), so
        its transfer is `working` from now on: a pull for it waits for the prefill and D's heartbeat acks
        list it, however long P's queue is."""
        prefill = self.pd.get(PREFILL)
        if prefill is None or request.request_id in self._queued:
            return
        _remember(self._queued, request.request_id, None)  # also for requests without a transfer: looked at once
        view = self._view(request)
        if (view.kv_transfer_params or {}).get("do_remote_decode"):
            prefill.on_request_added(view)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        # The first time vLLM looks at a waiting request: where `on_new_request` does not exist (older vLLM),
        # this is where P learns its request is queued. Idempotent, as vLLM may call it every step.
        self._note_queued(request)
        decode = self.pd.get(DECODE)
        if decode is None:
            return 0, False
        view = self._view(request)
        if num_computed_tokens > 0 and (view.kv_transfer_params or {}).get("do_remote_prefill"):
            # kvferry pulls a prompt's blocks from its first block on: with a local prefix-cache hit the
            # request computes the rest locally, and P's blocks are released when it finishes.
            return 0, False
        return decode.get_num_new_matched_tokens(view, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        decode = self.pd.get(DECODE)
        if decode is None or num_external_tokens == 0:
            return  # the 2nd call after an async load (0 tokens) and every non-load call
        (block_ids,) = blocks.get_block_ids()
        _remember(self._transfer_ids, request.request_id, str((request.kv_transfer_params or {}).get("transfer_id", "")))
        decode.update_state_after_alloc(self._view(request), block_ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVFerryConnectorMetadata:
        self._step += 1
        step = _StepView(self._step, set(scheduler_output.finished_req_ids))
        by_role = {}
        for r, pd in self.pd.items():
            meta = pd.build_connector_meta(step)
            assert isinstance(meta, PDMetadata)
            # A request that ended before admission is in this step's finished ids AND has a release-only
            # pull here; PDConnector's worker would start the pull and abort it at once, so P would never
            # hear of it and keep the blocks until its lease expires. The release IS the abort.
            meta.finished_req_ids -= {p.request_id for p in meta.to_pull if not p.block_ids}
            by_role[r] = meta
        return KVFerryConnectorMetadata(by_role)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._queued.pop(request.request_id, None)  # vLLM calls this once per request: nothing left to report
        view = self._view(request)
        params = view.kv_transfer_params or {}
        if params.get("do_remote_decode") and PREFILL in self.pd:
            return self.pd[PREFILL].request_finished(view, block_ids)
        if params.get("do_remote_prefill") and DECODE in self.pd:
            return self.pd[DECODE].request_finished(view, block_ids)
        if len(self.pd) == 1 and not self._warned_local:
            # A P or D that computes whole requests itself is legal, but usually means a router sent P/D
            # fields vLLM's OpenAI server drops (sglang-router's bootstrap_*): both sides compute everything.
            self._warned_local = True
            log.warning("request %s on this %s carried no kv_transfer_params for it: served locally, no KV "
                        "transfer (a router whose P/D fields vLLM drops, e.g. sglang-router, makes every "
                        "request do this; logged once)", request.request_id, next(iter(self.pd)))
        return False, None

    def update_connector_output(self, connector_output: Any) -> None:
        prefill = self.pd.get(PREFILL)
        sent = getattr(connector_output, "finished_sending", None)
        if prefill is not None and sent:
            prefill.transfers_ended(set(sent))  # their transfer_ids are free for another request again
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(meta, KVFerryWorkerMetadata):
            for request_id, (cause, message) in meta.causes.items():
                _remember(self.failure_causes, request_id, (cause, message))
                self._failures.add(cause)
                # One structured line per failure (grep "kvferry_kv_load_failed"), in the engine core's log.
                log.warning("kvferry_kv_load_failed %s", json.dumps(
                    {"request_id": request_id, "transfer_id": self._transfer_ids.get(request_id, ""),
                     "cause": cause, "message": message}, sort_keys=True))

    def get_kv_connector_stats(self) -> KVFerryStats | None:
        """Failures since the last call (scheduler side): vLLM carries them to its /metrics."""
        if self._failures.is_empty():
            return None
        stats, self._failures = self._failures, KVFerryStats()
        return stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVFerryStats:
        return KVFerryStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: dict[Any, Any], labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KVFerryPromMetrics:
        return KVFerryPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # ---- worker role ------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        num_blocks = int(self._kv_cache_config.num_blocks)
        self.layout = VllmKVLayout(kv_caches, num_blocks, self.block_size, KVFerrySettings.STAGING[self.settings.staging])
        # Threads inherit the creating thread's CPU affinity: started under vLLM's compute binding (the
        # CPU worker pins itself to its OMP cores), they would starve behind the model.
        with connector_affinity() as cpus:
            for pd in self.pd.values():
                pd.register_kv_layout(self.layout)
        self.connector_cpus = cpus
        log.info("kvferry connector threads run on CPUs %s", _cpu_list(cpus))

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVFerryConnectorMetadata)
        for r, pd_meta in meta.by_role.items():
            if r == PREFILL:
                self._expect_send.update(s.request_id for s in pd_meta.to_send)
            else:
                self._expect_recv.update(p.request_id for p in pd_meta.to_pull if p.block_ids)
            self.pd[r].start_load_kv(pd_meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are asynchronous, between steps

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return  # P serves pulls from its blocks after the request finished; nothing to save per layer

    def wait_for_save(self) -> None:
        return

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending: set[str] = set()
        recving: set[str] = set()
        for pd in self.pd.values():
            s, r = pd.get_finished(finished_req_ids)
            sending |= s
            recving |= r
            self._causes.update(pd.get_failure_causes())
        return _once(sending, self._expect_send, "sending"), _once(recving, self._expect_recv, "receiving")

    def get_block_ids_with_load_errors(self) -> set[int]:
        invalid: set[int] = set()
        for pd in self.pd.values():
            invalid |= pd.get_block_ids_with_load_errors()
        return invalid

    def build_connector_worker_meta(self) -> KVFerryWorkerMetadata | None:
        if not self._causes:
            return None
        causes, self._causes = self._causes, {}
        return KVFerryWorkerMetadata(causes)

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Close kvferry's endpoints; bounded, so a stuck socket never hangs vLLM's exit."""

        def close_all() -> None:
            for pd in self.pd.values():
                pd.close()

        closer = threading.Thread(target=close_all, name="kvferry-shutdown", daemon=True)
        closer.start()
        closer.join(timeout_s)
        if closer.is_alive():
            log.error("kvferry connector did not shut down within %.0fs; leaving it to process exit", timeout_s)

    def stats(self) -> dict[str, Any]:
        """kvferry counters per role (pending_pulls, pending_sends, addresses)."""
        return {r: pd.stats() for r, pd in self.pd.items()}


def engine_cpus() -> set[int]:
    """The CPUs this vLLM engine may use before its worker bound itself for compute: the engine core's
    (our parent's) affinity, else every CPU this process could be allowed."""
    with contextlib.suppress(OSError):
        return os.sched_getaffinity(os.getppid())
    return set(range(os.cpu_count() or 1))


@contextlib.contextmanager
def connector_affinity(cpus: set[int] | None = None) -> Iterator[set[int]]:
    """Run the block with the calling thread on `cpus` (default: `engine_cpus()`), so that every thread
    it starts (ZMQ I/O threads included) inherits them; the calling thread's binding is restored after.
    `KVFERRY_CPUS` (e.g. "2-3,6") overrides the set."""
    env = os.environ.get("KVFERRY_CPUS", "")
    wanted = _parse_cpus(env) if env else (cpus or engine_cpus())
    saved = os.sched_getaffinity(0)
    os.sched_setaffinity(0, wanted)  # pid 0: the calling thread only
    try:
        yield wanted
    finally:
        os.sched_setaffinity(0, saved)


def _parse_cpus(spec: str) -> set[int]:
    out: set[int] = set()
    for part in spec.split(","):
        lo, _, hi = part.strip().partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    if not out:
        raise ValueError(f"KVFERRY_CPUS={spec!r} names no CPU")
    return out


def _cpu_list(cpus: set[int]) -> str:
    return ",".join(str(c) for c in sorted(cpus))


def _once(ids: set[str], expected: set[str], direction: str) -> set[str]:
    """The ids vLLM may be told about, each once; anything else would trip the scheduler's assert."""
    stale = ids - expected
    if stale:
        log.error("kvferry reported finished %s for unknown or already reported request(s) %s: dropped",
                  direction, sorted(stale))
    ok = ids & expected
    expected -= ok
    return ok


def _remember(store: OrderedDict[str, Any], key: str, value: Any) -> None:
    store[key] = value
    store.move_to_end(key)
    while len(store) > _MAX_REMEMBERED:
        store.popitem(last=False)


def _check_nixl(host: str, insecure: bool) -> None:
    """As `kvferry serve --transfer nixl`: installed, and loopback unless insecure (docs/security.md)."""
    from kvferry.transfer.nixl import api as nixl_api

    if not nixl_api.available():
        raise ValueError(f"transfer 'nixl': nixl is not installed ({nixl_api.INSTALL_HINT}): {nixl_api.IMPORT_ERROR}")
    if not insecure and not is_loopback(host):
        raise ValueError(f"transfer 'nixl' on host {host}: UCX's listener accepts anyone who reaches it and a UCX peer "
                         "can write anywhere in the process; use 'tcp', or \"insecure\": true on a trusted network")


__all__ = ["KVFerryConnector", "KVFerryConnectorMetadata", "KVFerrySettings", "KVFerryWorkerMetadata"]

