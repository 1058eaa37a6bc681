"""`kvferry bench progressive`: what progressive push buys in TTFT.

Two P/D systems, the same but for P's progressive push, beside one colocated instance; the same prompts
go to the three in turn and the outputs must be identical. `over_*_ms` is what P/D adds to TTFT over
colocated, taken per request as the client's TTFT minus P's own (two processes' prefills of one prompt
differ by more than a loopback transfer). With root, `ip` and `tc`, a second pass puts P behind a veth
pair shaped so that the reference prompt's KV takes as long to move as its prefill."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvferry.bench.e2e import prompts, stream_completion
from kvferry.bench.report import report
from kvferry.harness.client import percentile
from kvferry.harness.network import VethLink
from kvferry.harness.processes import LOOPBACK
from kvferry.harness.sampler import get_metrics, require_drained
from kvferry.harness.system import PDSystem, PDSystemConfig, Role

OUTPUT_TOKENS = 4
SEED = 0
NUM_BLOCKS = 1200  # an 8k prompt (512 blocks of 16) and its output, with room
REQUEST_TIMEOUT_S = 900.0  # an 8k prefill of SmolLM2 on one loaded core takes minutes
# (prompt tokens, repetitions); SmolLM2's context is 8192 tokens.
FULL_PLAN = ((256, 5), (512, 3), (1024, 3), (2048, 3), (4096, 2), (8000, 1))
QUICK_PLAN = ((256, 2), (1024, 1))
SHAPED_PLAN = ((2048, 2), (4096, 1))
REFERENCE_TOKENS = 2048  # the shaped link's rate: this prompt's KV takes its colocated prefill to move

_SECONDS_SUM = "kvferry_kv_transfer_seconds_sum"
_BYTES = "kvferry_kv_transfer_bytes_total"
_PARTS = "kvferry_progressive_writes_total"
_TTFT_SUM = "kvferry_time_to_first_token_seconds_sum"


@dataclass
class Series:
    colocated: list[float] = field(default_factory=list)
    on: list[float] = field(default_factory=list)
    off: list[float] = field(default_factory=list)
    prefill: list[float] = field(default_factory=list)  # P's own TTFT (with progressive push)
    over_on: list[float] = field(default_factory=list)
    over_off: list[float] = field(default_factory=list)
    transfer: list[float] = field(default_factory=list)
    parts: list[float] = field(default_factory=list)
    kv_bytes: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class Sample:
    """One request: the client's TTFT, and /metrics deltas: the serving instance's own TTFT (P's for P/D),
    D's transfer seconds, P's partial writes, the KV bytes D received."""

    ttft: float
    own_ttft: float
    text: str
    transfer: float = 0.0
    parts: float = 0.0
    kv_bytes: float = 0.0


@dataclass(frozen=True)
class Systems:
    colocated: str
    on: tuple[str, str, str]  # proxy, P, D
    off: tuple[str, str, str]


def _one(client: httpx.Client, urls: tuple[str, ...], prompt: list[int]) -> Sample:
    """One request through `urls` (proxy, P, D; or the colocated instance alone)."""
    own, d = urls[1 if len(urls) > 1 else 0], urls[-1]
    o0, d0 = get_metrics(client, own), get_metrics(client, d)
    measured = stream_completion(client, urls[0], prompt, OUTPUT_TOKENS)
    o1, d1 = get_metrics(client, own), get_metrics(client, d)
    if len(urls) == 1:
        return Sample(measured.ttft_s, o1.value(_TTFT_SUM) - o0.value(_TTFT_SUM), measured.text)
    return Sample(measured.ttft_s, o1.value(_TTFT_SUM) - o0.value(_TTFT_SUM), measured.text,
                  d1.value(_SECONDS_SUM) - d0.value(_SECONDS_SUM), o1.value(_PARTS) - o0.value(_PARTS),
                  d1.value(_BYTES) - d0.value(_BYTES))


def measure(systems: Systems, plan: Sequence[tuple[int, int]], link: str) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    with httpx.Client(timeout=httpx.Timeout(REQUEST_TIMEOUT_S, connect=10.0)) as client:
        for url in (systems.colocated, systems.on[0], systems.off[0]):  # warm-up, not measured
            stream_completion(client, url, prompts(64, 1, SEED, "progressive")[0], OUTPUT_TOKENS)
        for length, reps in plan:
            s = Series()
            for i, prompt in enumerate(prompts(length, reps, SEED, "progressive")):
                base = _one(client, (systems.colocated,), prompt)
                on, off = _one(client, systems.on, prompt), _one(client, systems.off, prompt)
                if not base.text == on.text == off.text:
                    raise RuntimeError(f"outputs differ for prompt {i} of {length} tokens: colocated {base.text!r}, "
                                       f"progressive {on.text!r}, after the prefill {off.text!r}")
                http = base.ttft - base.own_ttft  # what a colocated answer adds to the instance's own TTFT
                s.colocated.append(base.ttft)
                s.on.append(on.ttft)
                s.off.append(off.ttft)
                s.prefill.append(on.own_ttft)
                s.over_on.append(on.ttft - on.own_ttft - http)
                s.over_off.append(off.ttft - off.own_ttft - http)
                s.transfer.append(off.transfer)
                s.parts.append(on.parts)
                s.kv_bytes.append(on.kv_bytes)
            rows.append(_row(link, length, reps, s))
    return rows


def _row(link: str, length: int, reps: int, s: Series) -> dict[str, Any]:
    ms = {name: 1000.0 * (percentile(values, 50) or 0.0) for name, values in (
        ("colocated", s.colocated), ("on", s.on), ("off", s.off), ("prefill", s.prefill), ("transfer", s.transfer),
        ("over_on", s.over_on), ("over_off", s.over_off))}
    return {"link": link, "prompt_tokens": length, "reps": reps,
            "ttft_colocated_ms": ms["colocated"], "ttft_progressive_ms": ms["on"],
            "ttft_after_prefill_ms": ms["off"], "prefill_ms": ms["prefill"], "transfer_ms": ms["transfer"],
            "over_on_ms": ms["over_on"], "over_off_ms": ms["over_off"],
            "over_on_vs_transfer": ms["over_on"] / ms["transfer"] if ms["transfer"] else None,
            "parts": percentile(s.parts, 50), "kv_mib": (percentile(s.kv_bytes, 50) or 0.0) / 2**20}


@contextlib.contextmanager
def _systems(model: str, link: VethLink | None = None) -> Iterator[Systems]:
    """The colocated instance, and the P/D systems with and without progressive push (P behind `link`)."""
    host, prefix = (LOOPBACK, ()) if link is None else (link.inner_ip, tuple(link.prefix))
    d_role = Role() if link is None else Role(host=link.outer_ip, args=("--prefill-allow", link.inner_ip))
    common = PDSystemConfig(seed=SEED, policy="fail", num_blocks=NUM_BLOCKS, abort_timeout=REQUEST_TIMEOUT_S,
                            kv_load_deadline=REQUEST_TIMEOUT_S, serve_args=("--model", model), health_timeout=180.0,
                            decode=d_role)
    on = dataclasses.replace(common, colocated=True,
                             prefill=Role(args=("--progressive-min-tokens", "0"), host=host, prefix=prefix))
    off = dataclasses.replace(common, prefill=Role(args=("--no-progressive-push",), host=host, prefix=prefix))
    with PDSystem(on) as a, PDSystem(off) as b:
        yield Systems(a.colocated.url, (a.proxy.url, a.prefill.url, a.decode.url),
                      (b.proxy.url, b.prefill.url, b.decode.url))
        require_drained({"colocated": a.colocated.url, "P": a.prefill.url, "D": a.decode.url,
                         "P (after prefill)": b.prefill.url, "D (after prefill)": b.decode.url}, 30)


def _shaped_rate(rows: Sequence[dict[str, Any]]) -> int:
    """Bytes/s at which the reference prompt's KV takes as long to move as its prefill."""
    ref = min(rows, key=lambda r: abs(r["prompt_tokens"] - REFERENCE_TOKENS))
    return max(1, int(ref["kv_mib"] * 2**20 / (ref["prefill_ms"] / 1000.0)))


def run(json_path: str | None = None, quick: bool = False, model: str = "smollm2", *,
        plan: Sequence[tuple[int, int]] | None = None, shaped: bool | None = None) -> list[dict[str, Any]]:
    """Loopback, then (unless `shaped` is False or there is no root) the shaped link; `plan` overrides the
    loopback plan (tests use a tiny one)."""
    plan = plan or (QUICK_PLAN if quick else FULL_PLAN)
    with _systems(model) as systems:
        rows = measure(systems, plan, "loopback")
    if shaped is None:
        shaped = not quick and os.geteuid() == 0 and all(shutil.which(tool) for tool in ("ip", "tc"))
    if shaped:
        rate = _shaped_rate(rows)
        link = VethLink.create()
        try:
            link.cap(rate)
            with _systems(model, link) as systems:
                rows += measure(systems, SHAPED_PLAN, f"tbf {rate * 8 / 1e6:.0f} Mbit/s")
        finally:
            link.close()
    report(f"kvferry bench progressive ({model}): TTFT with progressive push, after the prefill, colocated",
           rows, json_path)
    return rows
