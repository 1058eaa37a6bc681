"""KVFerryConnector's settings: vLLM's `kv_connector_extra_config`, checked once at start so a mistake fails
fast, and the `PDConfig` each role's `PDConnector` gets."""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from typing import Any

from kvferry.connector.auth import deployment_secret, is_loopback
from kvferry.connector.bootstrap import PrefillAllowList
from kvferry.connector.config import PDConfig
from kvferry.connector.faults import FaultSpec

log = logging.getLogger("kvferry.integrations.vllm.settings")

PREFILL, DECODE = "prefill", "decode"
# `kv_connector_extra_config` values come from JSON: each is cast to its field's type.
_CASTS: dict[str, Any] = {"str": str, "int": int, "float": float, "bool": bool,
                          "tuple[str, ...]": lambda hosts: tuple(str(h) for h in hosts)}
ROLES = {"kv_producer": (PREFILL,), "kv_consumer": (DECODE,), "kv_both": (PREFILL, DECODE)}


def kvferry_roles(vllm_config: Any, kv_role: str) -> tuple[str, ...]:
    """The kvferry sides this vLLM instance runs, or ValueError for a setup kvferry does not support."""
    parallel = vllm_config.parallel_config
    if parallel.pipeline_parallel_size != 1:
        raise ValueError("KVFerryConnector does not support pipeline parallelism yet (pipeline_parallel_size "
                         f"{parallel.pipeline_parallel_size}): each stage would hold only its own layers' KV")
    model = vllm_config.model_config
    tp = int(parallel.tensor_parallel_size)
    heads = int(model.get_total_num_kv_heads())
    # MLA's one latent KV is the same on every rank (not split by heads): P rank 0 sends it (is_mla).
    if heads % tp and not is_mla(vllm_config):
        raise ValueError(f"KVFerryConnector: tensor_parallel_size {tp} does not divide the model's {heads} KV "
                         "heads (vLLM then replicates heads across ranks, which kvferry does not map yet)")
    if kv_role not in ROLES:
        raise ValueError(f"unsupported kv_role {kv_role!r}")
    return ROLES[kv_role]


def is_mla(vllm_config: Any) -> bool:
    """Whether the model keeps one latent KV per token, whole on every tensor parallel rank (MLA)."""
    return bool(getattr(vllm_config.model_config, "use_mla", False))


@dataclass(frozen=True)
class KVFerrySettings:
    """`kv_connector_extra_config` keys (all optional; unknown keys are rejected). Defaults are `PDConfig`'s."""

    engine_id: str  # default: vLLM's kv_transfer_config.engine_id
    host: str = PDConfig.host  # address P's bootstrap/control/transfer endpoints bind and advertise; env KVFERRY_HOST
    bootstrap_port: int = PDConfig.bootstrap_port
    abort_timeout_s: float = PDConfig.abort_timeout_s  # P frees blocks nobody pulled after this (lease)
    kv_load_deadline_s: float = PDConfig.kv_load_deadline_s  # D gives up on a pull after this (cause "deadline")
    transfer: str = PDConfig.transfer  # "tcp" (built in), "mooncake" or "nixl" (loopback unless insecure)
    checksums: bool = PDConfig.checksums
    faults: str = ""  # fault injection spec (tests, chaos); default: env KVFERRY_FAULTS
    # D: heartbeat period (P's lease on a pulled transfer is 7 periods) and how long P may stay silent
    heartbeat_interval_s: float = PDConfig.heartbeat_interval_s
    heartbeat_timeout_s: float = PDConfig.heartbeat_timeout_s
    heartbeat_ceiling_s: float = PDConfig.heartbeat_ceiling_s  # most a slow P is waited on (liveness adapts up to it)
    # Copy KV through a host mirror: "auto" (a device KV cache), "always", "never" (a device one is refused)
    staging: str = "auto"
    prefill_allow: tuple[str, ...] = PDConfig.prefill_allow  # D: the hosts whose bootstrap servers it may pull from
    bootstrap_timeout_s: float = PDConfig.bootstrap_timeout_s  # D: a bootstrap lookup fails after this (a refused one too)
    insecure: bool = False  # a non-loopback host without KVFERRY_SECRET (as `kvferry serve --insecure`)
    control_port: int = PDConfig.control_port  # P: the ZMQ control socket's fixed port (0: the kernel picks)
    data_port: int = PDConfig.data_port  # the TCP data plane's fixed port (0: the kernel picks)
    advertise_host: str = PDConfig.advertise_host  # the address peers dial (default: host; required when host is 0.0.0.0)
    # P: a prompt of at least progressive_min_tokens goes to D while vLLM's chunked prefill computes it
    progressive_push: bool = PDConfig.progressive_push
    progressive_min_tokens: int = PDConfig.progressive_min_tokens

    STAGING = {"auto": None, "always": True, "never": False}

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any], default_engine_id: str) -> KVFerrySettings:
        keys = tuple(f.name for f in dataclasses.fields(cls))
        unknown = sorted(set(extra) - set(keys))
        if unknown:
            raise ValueError(f"unknown kvferry setting(s) {unknown} in kv_connector_extra_config; known: {keys}")
        given = {**extra, "engine_id": extra.get("engine_id") or default_engine_id}
        given.setdefault("host", os.environ.get("KVFERRY_HOST", cls.host))
        given.setdefault("faults", os.environ.get("KVFERRY_FAULTS", cls.faults))
        settings = cls(**{f.name: _CASTS[str(f.type)](given[f.name]) for f in dataclasses.fields(cls) if f.name in given})
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
        if settings.heartbeat_interval_s <= 0 or settings.heartbeat_timeout_s < 0 or settings.bootstrap_timeout_s <= 0:
            raise ValueError("heartbeat_interval_s and bootstrap_timeout_s must be > 0, heartbeat_timeout_s >= 0")
        if settings.transfer not in ("tcp", "mooncake", "nixl"):
            raise ValueError(f"transfer must be 'tcp', 'mooncake' or 'nixl', not {settings.transfer!r}")
        if settings.transfer == "nixl":
            check_nixl(settings.host, settings.insecure)
        FaultSpec.parse(settings.faults)  # raises on a bad spec
        return settings

    def for_data_parallel(self, dp_rank: int, dp_size: int, tp_size: int, engine_id_given: bool) -> KVFerrySettings:
        """Each data parallel rank is its own engine: engine id `_dp<rank>` (as vLLM suffixes its own),
        bootstrap port + dp_rank, fixed ports shifted past the lower ranks'."""
        if dp_size <= 1:
            return self
        return dataclasses.replace(
            self,
            engine_id=f"{self.engine_id}_dp{dp_rank}" if engine_id_given else self.engine_id,
            bootstrap_port=self.bootstrap_port + dp_rank,
            control_port=self.control_port and self.control_port + dp_rank * tp_size,
            data_port=self.data_port and self.data_port + dp_rank * tp_size,
        )

    def pd_config(self, role: str, block_size: int, tp_size: int = 1, tp_rank: int = 0) -> PDConfig:
        """One vLLM worker process is one kvferry rank of `tp_size`; every setting `PDConfig` shares carries over."""
        shared = {f.name for f in dataclasses.fields(PDConfig)} & {f.name for f in dataclasses.fields(self)}
        return PDConfig(role=role, tp_size=tp_size, tp_rank=tp_rank, block_size=block_size,
                        faults=FaultSpec.parse(self.faults),
                        **{name: getattr(self, name) for name in shared - {"faults"}})


def check_nixl(host: str, insecure: bool) -> None:
    """As `kvferry serve --transfer nixl`: installed, and loopback unless insecure (docs/security.md)."""
    # Only when asked for: importing nixl loads UCX, and which build it picks depends on torch being loaded.
    from kvferry.transfer.nixl import api as nixl_api

    if not nixl_api.available():
        raise ValueError(f"transfer 'nixl': nixl is not installed ({nixl_api.INSTALL_HINT}): {nixl_api.IMPORT_ERROR}")
    if not insecure and not is_loopback(host):
        raise ValueError(f"transfer 'nixl' on host {host}: UCX's listener accepts anyone who reaches it and a UCX peer "
                         "can write anywhere in the process; use 'tcp', or \"insecure\": true on a trusted network")
