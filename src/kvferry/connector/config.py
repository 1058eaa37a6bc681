"""The P/D connector's configuration: `PDConfig`, the home of each P/D default."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvferry.connector.auth import deployment_secret
from kvferry.connector.decode.pulls import ConsumerConfig
from kvferry.connector.faults import FaultSpec


@dataclass(frozen=True)
class PDConfig:
    """The home of each P/D default: `kvferry serve`'s flags and vLLM's `KVFerrySettings` read them
    from here, and the decode side's come from `ConsumerConfig`."""

    role: str  # "prefill" | "decode"
    engine_id: str
    host: str = "127.0.0.1"
    tp_size: int = ConsumerConfig.tp_size
    # None: this process serves every rank (kvferry's engine); r: only rank r (a vLLM worker), and its
    # bootstrap registration is handed to whoever runs the bootstrap server (`PDWorker.registrations`).
    tp_rank: int | None = None
    block_size: int = 16
    bootstrap_port: int = 8998
    abort_timeout_s: float = 30.0
    kv_load_deadline_s: float = ConsumerConfig.kv_load_deadline_s
    transfer: str = "tcp"
    checksums: bool = ConsumerConfig.checksums
    faults: FaultSpec = field(default_factory=FaultSpec)
    heartbeat_interval_s: float = ConsumerConfig.heartbeat_interval_s
    # 0: no heartbeats and no connection watch (timeouts only)
    heartbeat_timeout_s: float = ConsumerConfig.heartbeat_timeout_s
    # A slow P is waited on (and a lagging D's lease asked for) up to this; ≤ timeout: fixed thresholds.
    heartbeat_ceiling_s: float = ConsumerConfig.heartbeat_ceiling_s
    # Seals control messages and bootstrap answers, keys the data plane (docs/security.md).
    secret: bytes | None = field(default_factory=deployment_secret, repr=False, compare=False)
    # decode: the hosts whose bootstrap servers D may ask; a bootstrap lookup fails after the timeout
    prefill_allow: tuple[str, ...] = ConsumerConfig.prefill_allow
    bootstrap_timeout_s: float = ConsumerConfig.bootstrap_timeout_s
    # Fixed ports for firewalls (rank r uses base + r; 0: the kernel picks) and the host peers are told
    # to dial when it is not `host` (a 0.0.0.0 bind, NAT, a Kubernetes Service).
    control_port: int = 0
    data_port: int = 0
    advertise_host: str = ""
    # P: a prompt of at least this many tokens goes to D while its prefill runs, its blocks as each
    # engine step completes them (`Progress`); a shorter one, or any with it off, once its prefill ended.
    # Below 512 tokens it gains nothing (docs/results.md: the prompts one step computes at the default
    # --max-prefill-chunk).
    progressive_push: bool = True
    progressive_min_tokens: int = 512

    @property
    def advertised_host(self) -> str:
        return self.advertise_host or self.host

    @property
    def recv_timeout_s(self) -> float:
        # Longer than P's abort timeout, so P's own "not ready" answer arrives first.
        return self.abort_timeout_s + 5.0
