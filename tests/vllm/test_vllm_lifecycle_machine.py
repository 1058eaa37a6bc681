"""A hypothesis state machine over KVFerryConnector's request lifecycle in vLLM 0.33 (#30; house rule:
for every state machine, let hypothesis look for the hang or the leak instead of trusting our workloads).

A P/D pair as in test_vllm_connector.py (real `Scheduler`s and `KVCacheManager`s, kvferry's real data
plane, control plane and bootstrap), in four shapes: one KV cache group at TP 1 → 1, two groups (full
attention + sliding window, HMA), P TP 1 → D TP 2, and MLA at P TP 2 → D TP 1. Per example: D's
`kv_load_failure_policy` (fail / recompute) and both pools' size (64, 24, or the largest request's
blocks). Rules: start a transfer (random prompt length, block edges included; prompts that share
prefixes; a chosen injected fault; now and then a reused transfer id) on P, on D or on both at once, give
it its other side later, abort it on P or on D at any point (also while D loads it), kill P, step the
engines.

Checked: the prompt's KV each instance's model reads when it samples a request's first token is the fake
model's KV (loaded, recomputed or computed); a request that ends well has the reference tokens (the
colocated output); under `recompute` nothing ends in an error; a multi-group D never reports block ids;
each id is reported once. At the end both sides drain within a bound well below D's load deadline (no
request waits for that safety net), every KV block is back in both pools, and kvferry's tables (P's
transfers, claims and lent requests; D's pulls) are empty. A transfer no fault, abort, kill or reused id
touched succeeds, an injected fault fails with its own cause; either may also fail with a cause that a
loaded box alone gives (TIMING_CAUSES), so CI on a busy machine does not flake; a transfer past D's
prefix-cache hit (prompts that share prefixes) is held to the same, and a request that pulls nothing never fails.
"""

from __future__ import annotations

import itertools
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from test_vllm_connector import HAVE_VLLM

if not HAVE_VLLM:  # the classes below derive from the vLLM harness: skip before defining them
    pytest.skip("vLLM is not installed (see .ci/vllm-env.sh)", allow_module_level=True)

import hypothesis.strategies as st
import torch
from hypothesis import HealthCheck, event, settings
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from test_vllm_connector import PD, model_dir
from test_vllm_hma import NULL, HybridInstance, group_of
from test_vllm_mla import DEEPSEEK_V2_TINY, MLAInstance, latent_of
from vllm.platforms import current_platform
from vllm.v1.engine import FinishReason
from vllm.v1.request import RequestStatus
from vllm_harness import BLOCK_SIZE, LAYER_NAMES, NUM_KV_HEADS, Instance, kv_of, token_after

from kvferry.connector.faults import CAUSE_OF_FAULT, FaultSpec

__all__ = ["model_dir"]  # fixture

# Each fault fires for 10% of transfer ids; the machine picks ids by the fault it wants (drop_reply is left
# out: it costs D's receive timeout, abort timeout + 5 s, per example that draws it).
FAULTS = ("bootstrap", "p_not_ready", "error_reply", "err_reqs", "transport", "corrupt")
SPEC = FaultSpec.parse(",".join(f"{f}=0.1" for f in FAULTS) + ",seed=30")
ABORT_TIMEOUT_S = 1.0  # P's lease: what an unpulled transfer or an unanswered pull costs
DRAIN_S = 12.0  # every request ends and every table empties within this: below D's load deadline (15 s)
MAX_TRANSFERS = 5
# A transfer: its prompt (whole blocks, one token short or over, or mid-block; variants share prefixes), its
# fault, D's output length, and where it starts (both at once as a proxy sends, P first, or D first).
MAX_BLOCKS, EDGES, MAX_NEW_TOKENS = 5, (-1, 0, 1, 7), 4
TRANSFER_ARGS: dict[str, Any] = dict(
    blocks=st.integers(0, MAX_BLOCKS), edge=st.sampled_from(EDGES), variant=st.integers(0, 2),
    fault=st.sampled_from([None, None, None, *FAULTS]), max_tokens=st.integers(1, MAX_NEW_TOKENS),
    where=st.sampled_from(["both", "p", "d"]))
# The largest request's blocks (prompt and new tokens): the `tight` pool holds just one of them.
LARGEST_BLOCKS = -(-(MAX_BLOCKS * BLOCK_SIZE + max(EDGES) + MAX_NEW_TOKENS) // BLOCK_SIZE)
TRANSFER = st.fixed_dictionaries(TRANSFER_ARGS)
# What a loaded box alone can make of any transfer: a bootstrap answer later than the client's 2 s, a P
# that answers later than D's receive timeout or heartbeat bound, a lease or "not ready" wait run out.
TIMING_CAUSES = {"bootstrap", "recv_timeout", "peer_dead", "expired", "err_reqs", "deadline"}


def ids_by_fault(per: int = 40) -> dict[str | None, list[str]]:
    pools: dict[str | None, list[str]] = {f: [] for f in (None, *FAULTS)}
    for n in itertools.count():
        tid = f"xfer-m{n}"
        pool = pools[SPEC.fault_for(tid)]
        if len(pool) < per:
            pool.append(tid)
        if all(len(p) >= per for p in pools.values()):
            return pools


IDS = ids_by_fault()


def prompt_of(variant: int, length: int) -> list[int]:
    """Prompts of one variant share prefixes: D's prefix cache hits part of a later one."""
    return [(7919 * variant + 13 * i) % 50000 + 3 for i in range(length)]


def reference(prompt: list[int], n: int) -> list[int]:
    """The colocated output: the fake model's tokens after the prompt."""
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(token_after(tokens))
    return tokens[len(prompt):]


class Checked:
    """Checks, when a request samples its first token, that every prompt position the model reads (in
    every KV cache group, on this rank) holds the fake model's KV."""

    kv_errors: list[str]
    _kv_checked: set[tuple[str, int]]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.kv_errors, self._kv_checked = [], set()
        super().__init__(*args, **kwargs)

    def expected_kv(self, prefix: list[int], rank: int) -> torch.Tensor:  # [layers, heads, content]
        per = NUM_KV_HEADS // self.tp_size  # type: ignore[attr-defined]
        return kv_of(prefix)[:, rank * per:(rank + 1) * per]

    def layer_group(self, layer: int, groups: int) -> int:
        return 0

    def _forward(self, num_scheduled: dict[str, int], rank: int = 0) -> None:
        super()._forward(num_scheduled, rank)  # type: ignore[misc]
        for req_id in num_scheduled:
            request = self.scheduler.requests[req_id]  # type: ignore[attr-defined]
            if request.num_computed_tokens >= request.num_tokens and (req_id, rank) not in self._kv_checked:
                self._kv_checked.add((req_id, rank))
                self.kv_errors += self._prompt_kv_errors(request, rank)

    def _prompt_kv_errors(self, request: Any, rank: int) -> list[str]:
        groups = self.scheduler.kv_cache_manager.get_block_ids(request.request_id)  # type: ignore[attr-defined]
        caches = self.worker_caches[rank]  # type: ignore[attr-defined]
        tokens = list(request.all_token_ids)
        for pos in range(request.num_prompt_tokens):
            want = self.expected_kv(tokens[: pos + 1], rank)
            for layer, name in enumerate(LAYER_NAMES):
                block = groups[self.layer_group(layer, len(groups))][pos // BLOCK_SIZE]
                if block != NULL and not torch.equal(caches[name][block, :, pos % BLOCK_SIZE, :], want[layer]):
                    return [f"{request.request_id} rank {rank}: wrong KV at layer {layer} position {pos}"]
        return []


class CheckedInstance(Checked, Instance):
    pass


class CheckedHybrid(Checked, HybridInstance):
    def layer_group(self, layer: int, groups: int) -> int:
        return min(group_of(layer), groups - 1)


class CheckedMLA(Checked, MLAInstance):
    def expected_kv(self, prefix: list[int], rank: int) -> torch.Tensor:
        return latent_of(prefix)  # the whole latent on every rank


@dataclass(frozen=True)
class Shape:
    name: str
    instance: type
    p_tp: int = 1
    d_tp: int = 1
    mla: bool = False

    @property
    def multi_group(self) -> bool:
        return self.instance is CheckedHybrid

    @property
    def tight_blocks(self) -> int:
        """The smallest pool that holds the largest request and vLLM's null block: every other request
        waits for it, each side's lent or loading blocks included. A two-group model needs the blocks in
        both groups (the window's skipped ones are freed only later)."""
        return LARGEST_BLOCKS * (2 if self.multi_group else 1) + 1


SHAPES = [
    Shape("one-group", CheckedInstance),
    Shape("hma-two-groups", CheckedHybrid),
    Shape("p-tp1-d-tp2", CheckedInstance, d_tp=2),
    Shape("mla-p-tp2-d-tp1", CheckedMLA, p_tp=2, mla=True),
]


@dataclass
class Transfer:
    tid: str
    prompt: list[int]
    fault: str | None
    max_tokens: int
    p_req: str | None = None
    d_req: str | None = None
    p_added: float = 0.0
    d_added: float = 0.0
    p_aborted: bool = False
    d_aborted: bool = False
    shared: bool = False  # its transfer id is another transfer's too (a proxy that reused one)


class LifecycleMachine(RuleBasedStateMachine):
    shape: Shape
    model_dirs: dict[str, str]

    def __init__(self) -> None:
        super().__init__()
        self.pd: PD | None = None
        self.transfers: list[Transfer] = []
        self.next_id = {f: iter(ids) for f, ids in IDS.items()}
        self.killed = False
        self.log: list[str] = []

    @initialize(policy=st.sampled_from(["fail", "recompute"]), pool=st.sampled_from(["roomy", "small", "tight"]),
                first=TRANSFER, push=st.sampled_from(["after", "progressive"]))
    def start(self, policy: str, pool: str, first: dict[str, Any], push: str) -> None:
        """The pair, with D's policy and both pools' size (64 blocks; 24: requests wait for room on P and D,
        P's lent blocks among them; `Shape.tight_blocks`: one request at a time), P's push (`progressive`:
        P's prefill chunks of 2 blocks, each prompt of a block or more goes to D as they complete, and vLLM
        admits a prefill on its first chunk's blocks, so it may preempt one mid-prefill), and a first
        transfer (an example without one tests nothing)."""
        num_blocks = {"roomy": 64, "small": 24, "tight": self.shape.tight_blocks}[pool]
        event(f"pool: {pool}")
        event(f"push: {push}")
        class MachinePD(PD):
            instance = self.shape.instance

        self.policy = policy
        model = self.model_dirs["mla" if self.shape.mla else "opt"]
        self.pd = MachinePD(model, policy=policy, faults=SPEC.to_spec(), abort_timeout_s=ABORT_TIMEOUT_S,
                            num_blocks=num_blocks, p_tp=self.shape.p_tp, d_tp=self.shape.d_tp,
                            extra={"progressive_min_tokens": BLOCK_SIZE} if push == "progressive" else None)
        if push == "progressive":
            self.pd.p.scheduler.max_num_scheduled_tokens = 2 * BLOCK_SIZE
            self.pd.p.scheduler.scheduler_reserve_full_isl = False
        self.new_transfer(**first)

    @property
    def p(self) -> Any:
        assert self.pd is not None
        return self.pd.p

    @property
    def d(self) -> Any:
        assert self.pd is not None
        return self.pd.d

    def pick(self, which: int, side: str) -> Transfer | None:
        """The `which`th transfer with a request on `side` ("p_req" or "d_req")."""
        found = [t for t in self.transfers if getattr(t, side) is not None]
        return found[which % len(found)] if found else None

    # ---- rules --------------------------------------------------------------------------------------
    def _add_p(self, t: Transfer) -> None:
        t.p_req = self.p.add(t.prompt, 1, {"do_remote_decode": True, "transfer_id": t.tid}).request_id
        t.p_added = time.monotonic()

    def _add_d(self, t: Transfer) -> None:
        assert self.pd is not None
        out = self.p.finished(t.p_req) if t.p_req else None
        params = out.kv_transfer_params if out is not None and out.kv_transfer_params else self.pd.d_params(t.tid)
        t.d_req = self.d.add(t.prompt, t.max_tokens, params).request_id
        t.d_added = time.monotonic()

    @precondition(lambda self: self.pd is not None and len(self.transfers) < MAX_TRANSFERS)
    @rule(**TRANSFER_ARGS)
    def new_transfer(self, blocks: int, edge: int, variant: int, fault: str | None, max_tokens: int,
                     where: str, reuse: int | None = None) -> None:
        length = max(1, blocks * BLOCK_SIZE + edge)
        tid = next(self.next_id[fault]) if reuse is None else self.transfers[reuse % len(self.transfers)].tid
        t = Transfer(tid, prompt_of(variant, length), SPEC.fault_for(tid), max_tokens)
        for other in self.transfers:
            if other.tid == tid:
                t.shared = other.shared = True
        self.transfers.append(t)
        if where in ("both", "p") and not self.killed:
            self._add_p(t)
        if where in ("both", "d") or self.killed:
            self._add_d(t)
        self.log.append(f"new {t.tid}{' (reused)' if t.shared else ''} len={length} v={variant} fault={fault} max={max_tokens} on {where}")

    @precondition(lambda self: len(self.transfers) < MAX_TRANSFERS)
    @rule(**TRANSFER_ARGS, reuse=st.integers(0, 7))
    def reuse_transfer_id(self, reuse: int, **args: Any) -> None:
        """A transfer under a live or ended transfer's id: P serves a live id's second request locally,
        never in the first one's place; D pulling it gets the first one's KV only for the same prompt."""
        self.new_transfer(**args, reuse=reuse)

    def _one_sided(self) -> list[Transfer]:
        return [t for t in self.transfers if t.d_req is None or (t.p_req is None and not self.killed)]

    @precondition(lambda self: bool(self._one_sided()))
    @rule(which=st.integers(0, 7))
    def add_other_side(self, which: int) -> None:
        """The side a transfer still lacks: D after P (a proxy that waits for P's answer), P after D."""
        one_sided = self._one_sided()
        t = one_sided[which % len(one_sided)]
        if t.d_req is None:
            self._add_d(t)
        else:
            self._add_p(t)
        self.log.append(f"{'P' if t.d_req and t.p_req and t.p_added > t.d_added else 'D'} side of {t.tid}")

    def _abort(self, t: Transfer, side: str) -> None:
        """Abort `t`'s request on P or D unless it already ended (vLLM ignores those anyway)."""
        instance, req = (self.p, t.p_req) if side == "P" else (self.d, t.d_req)
        aborted = t.p_aborted if side == "P" else t.d_aborted
        if req is not None and instance.finished(req) is None and not aborted:
            instance.abort(req)
            t.p_aborted, t.d_aborted = (True, t.d_aborted) if side == "P" else (t.p_aborted, True)
            self.log.append(f"abort {t.tid} on {side}")

    @precondition(lambda self: any(t.d_req for t in self.transfers))
    @rule(which=st.integers(0, 7))
    def abort_on_d(self, which: int) -> None:
        t = self.pick(which, "d_req")
        assert t is not None
        self._abort(t, "D")

    @precondition(lambda self: not self.killed and any(t.p_req for t in self.transfers))
    @rule(which=st.integers(0, 7))
    def abort_on_p(self, which: int) -> None:
        t = self.pick(which, "p_req")
        assert t is not None
        self._abort(t, "P")

    @precondition(lambda self: self.pd is not None and not self.killed)
    @rule(now=st.integers(0, 3))
    def kill_p(self, now: int) -> None:
        """P's engine is gone: every worker's control socket and data plane, and its bootstrap server
        (one P rank alone dying, its engine still up, is test_vllm_tp.py's and test_vllm_mla.py's).
        Only when `now` is 3: a kill ends what an example can still explore, so it comes rarely."""
        assert self.pd is not None
        if now != 3:
            return
        for worker in self.p.workers:
            worker.shutdown(timeout_s=2.0)
        self.p.connector.shutdown()
        self.pd.p_alive, self.killed = False, True
        self.log.append("kill P")

    @precondition(lambda self: any(t.d_req for t in self.transfers))
    @rule(which=st.integers(0, 7))
    def step_until_loading(self, which: int) -> None:
        """Step both sides until a D request waits for its KV (or ended): where an abort or a kill is
        most likely to find a hang or a leak. Bounded: a request that never pulls just ends."""
        t = self.pick(which, "d_req")
        assert t is not None and t.d_req is not None
        deadline = time.monotonic() + 2.0
        request = self.d.scheduler.requests.get(t.d_req)
        while request is not None and request.status != RequestStatus.WAITING_FOR_REMOTE_KVS:
            if time.monotonic() > deadline or self.d.finished(t.d_req) is not None:
                break
            if not self.killed:
                self.p.step()
            self.d.step()
            time.sleep(0.002)
        self.log.append(f"step until {t.tid} loads on D")

    @precondition(lambda self: self.pd is not None)
    @rule(p_steps=st.integers(0, 4), d_steps=st.integers(0, 4), settle_ms=st.sampled_from([0, 0, 10, 50]))
    def step(self, p_steps: int, d_steps: int, settle_ms: int) -> None:
        # settle_ms is an interleaving choice: how far kvferry's threads get between two engine steps.
        for i in range(max(p_steps, d_steps)):
            if i < p_steps and not self.killed:
                self.p.step()
            if i < d_steps:
                self.d.step()
        time.sleep(settle_ms / 1000)
        self.log.append(f"step P {0 if self.killed else p_steps} D {d_steps} +{settle_ms} ms")

    # ---- invariants ---------------------------------------------------------------------------------
    @invariant()
    def reported_as_vllm_expects(self) -> None:
        if self.pd is None:
            return
        assert not self.d.kv_errors and not (self.pd.p_alive and self.p.kv_errors), self.d.kv_errors + self.p.kv_errors
        if self.shape.multi_group:
            assert not self.d.invalid, "block ids reported on a multi-group D (vLLM raises on them)"
        assert len(self.d.received) == len(set(self.d.received)), self.d.received
        assert len(self.p.sent) == len(set(self.p.sent)), self.p.sent
        for t in self.transfers:
            out = self.d.finished(t.d_req) if t.d_req else None
            if out is not None:
                self.check_outcome(t, out)
            p_out = self.p.finished(t.p_req) if t.p_req else None
            if p_out is not None and p_out.finish_reason == FinishReason.LENGTH:
                assert self.p.tokens(t.p_req) == reference(t.prompt, 1), f"P's token of {t.tid}"

    def check_outcome(self, t: Transfer, out: Any) -> None:
        assert t.d_req is not None
        tokens, cause = self.d.tokens(t.d_req), self.d.connector.failure_causes.get(t.d_req)
        what = f"{t.tid} ({t.fault}): {out.finish_reason}, cause {cause}"
        assert out.finish_reason != FinishReason.ERROR or self.policy == "fail", f"error under recompute: {what}"
        assert cause is None or cause[0] != "deadline", f"waited for D's load deadline: {what}"
        if out.finish_reason == FinishReason.ERROR:
            assert tokens == [] and cause is not None, what
        elif out.finish_reason == FinishReason.LENGTH:
            assert tokens == reference(t.prompt, t.max_tokens), f"wrong tokens: {what}"
        else:
            assert out.finish_reason == FinishReason.ABORT and t.d_aborted, what
            assert tokens == reference(t.prompt, len(tokens)), f"wrong tokens: {what}"

    # ---- the end ------------------------------------------------------------------------------------
    def teardown(self) -> None:
        if self.pd is None:
            return
        try:
            self.drain()
            self.reported_as_vllm_expects()
            self.check_expected_outcomes()
            for t in self.transfers:  # what the examples reached (pytest --hypothesis-show-statistics)
                out = self.d.finished(t.d_req) if t.d_req else None
                cause = self.d.connector.failure_causes.get(t.d_req or "")
                pulled = any(n for r, n in self.d.alloc_calls if r == t.d_req)
                event(f"D {'aborted' if t.d_aborted else out and out.finish_reason.name}, pulled {pulled}, "
                      f"cause {cause and cause[0]}")
            parts = sum(w.pd["prefill"].metrics.progressive_writes._value.get() for w in self.p.workers)
            event(f"progressive writes: {'some' if parts else 'none'}")
        finally:
            self.pd.close()

    def idle(self) -> bool:
        d_pd = self.d.connector.pd["decode"]
        if self.d.scheduler.requests or any(w.pd["decode"].consumer.pending_pulls for w in self.d.workers):
            return False
        if d_pd.scheduler._pulling or d_pd.scheduler._to_pull:
            return False
        if self.killed:
            return True
        p_pd = self.p.connector.pd["prefill"].scheduler
        return not (self.p.scheduler.requests or p_pd.claims or p_pd._lent or p_pd._duplicates
                    or self.p.connector._queued
                    or any(w.pd["prefill"].producer.table._transfers for w in self.p.workers))

    def drain(self) -> None:
        """Step both sides until every request ended and every table is empty, within DRAIN_S."""
        deadline = time.monotonic() + DRAIN_S
        while not self.idle():
            assert time.monotonic() < deadline, f"no drain within {DRAIN_S}s: {self.state()}"
            if not self.killed:
                self.p.step()
            self.d.step()
            time.sleep(0.002)
        self.d.assert_empty()
        if not self.killed:
            self.p.assert_empty()

    def state(self) -> str:
        d_pd = self.d.connector.pd["decode"].scheduler
        state = {"log": self.log, "d_requests": {r: str(q.status) for r, q in self.d.scheduler.requests.items()},
                 "d_pulls": [sorted(w.pd["decode"].consumer._pulls) for w in self.d.workers],
                 "d_pulling": sorted(d_pd._pulling)}
        if not self.killed:
            p_pd = self.p.connector.pd["prefill"].scheduler
            state |= {"p_requests": {r: str(q.status) for r, q in self.p.scheduler.requests.items()},
                      "p_transfers": [sorted(w.pd["prefill"].producer.table._transfers) for w in self.p.workers],
                      "p_claims": dict(p_pd.claims), "p_lent": dict(p_pd._lent)}
        return json.dumps(state, indent=1)

    def check_expected_outcomes(self) -> None:
        """Without abort or kill, a transfer whose both sides came in time succeeds, or fails with its
        injected fault's cause, or with a cause only timing gives (TIMING_CAUSES), also when it pulls only
        the blocks past D's prefix-cache hit; a request that pulls nothing never fails."""
        if self.killed:
            return
        for t in self.transfers:
            if t.d_req is None or t.p_req is None or t.p_aborted or t.d_aborted or t.shared:
                continue
            if abs(t.d_added - t.p_added) > ABORT_TIMEOUT_S / 2:
                continue  # P's lease or its "not ready" answer may have come first: either ending is right
            out = self.d.finished(t.d_req)
            pulled = any(n for r, n in self.d.alloc_calls if r == t.d_req)
            cause = self.d.connector.failure_causes.get(t.d_req)
            what = f"{t.tid} ({t.fault}, pulled {pulled}): {out.finish_reason}, cause {cause}\n{self.state()}"
            if not pulled:
                assert out.finish_reason == FinishReason.LENGTH and cause is None, what
            elif t.fault is None:
                assert cause is None or cause[0] in TIMING_CAUSES, what
            else:
                assert cause is not None and cause[0] in {CAUSE_OF_FAULT[t.fault], *TIMING_CAUSES}, what


@pytest.fixture(scope="module")
def mla_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = Path(tmp_path_factory.mktemp("deepseek-v2-tiny"))
    (path / "config.json").write_text(json.dumps(DEEPSEEK_V2_TINY))
    return str(path)


# CI: a fixed, small set of examples per shape (derandomized: the same every run). KVFERRY_MACHINE_EXAMPLES=N
# hunts instead: N random examples per shape (a failure prints the rule sequence that reproduces it).
HUNT = int(os.environ.get("KVFERRY_MACHINE_EXAMPLES", "0"))


@pytest.mark.timeout(600 if HUNT else 300)  # ~15 examples, each up to a few lease and bootstrap waits
@pytest.mark.parametrize("shape", SHAPES, ids=[s.name for s in SHAPES])
def test_lifecycle_machine(shape: Shape, model_dir: str, mla_model_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # vLLM keeps the hybrid allocator off on CPU platforms whatever the connector (as test_vllm_hma.py).
    monkeypatch.setattr(type(current_platform), "support_hybrid_kv_cache", classmethod(lambda cls: True))
    machine = type(f"Lifecycle_{shape.name}", (LifecycleMachine,),
                   {"shape": shape, "model_dirs": {"opt": model_dir, "mla": mla_model_dir}})
    run_state_machine_as_test(machine, settings=settings(
        max_examples=HUNT or 15, stateful_step_count=10, deadline=None, derandomize=not HUNT, database=None,
        suppress_health_check=list(HealthCheck), report_multiple_bugs=False))
