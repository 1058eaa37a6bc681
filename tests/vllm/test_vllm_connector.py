"""kvferry's vLLM connector against vLLM 0.33's real Scheduler: a producer and a consumer in one process,
worker sides on CPU tensors over kvferry's real TCP data plane, ZMQ control plane and HTTP bootstrap.

Runs in the optional environment (`bash .ci/vllm-env.sh`, then `.venv-vllm/bin/pytest tests/vllm`);
skips where vLLM is not installed.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from kvferry.connector.faults import FaultSpec

try:  # `tests/` is on sys.path, so a bare `import vllm` would find this directory as a namespace package
    import vllm.v1.core.sched.scheduler  # noqa: F401
except ImportError:
    HAVE_VLLM = False
else:
    HAVE_VLLM = True

# Collected and skipped (not a module-level skip), so `pytest tests/vllm` without vLLM exits 0.
pytestmark = pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed (see .ci/vllm-env.sh)")

if HAVE_VLLM:
    import torch
    from vllm.v1.engine import FinishReason
    from vllm.v1.request import RequestStatus
    from vllm_harness import BLOCK_SIZE, Instance, write_model_dir

    from procs import free_port
else:
    BLOCK_SIZE = 16

PROMPT = [(7 * i + 11) % 50000 + 3 for i in range(5 * BLOCK_SIZE + 3)]  # 6 blocks, the last partial


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_model_dir(Path(tmp_path_factory.mktemp("opt-125m")))


class PD:
    """A producer and a consumer vLLM instance wired to each other."""

    instance: Any = Instance if HAVE_VLLM else None  # the fake engine each side runs

    def __init__(self, model_dir: str, policy: str = "fail", faults: str = "", layout: str = "LBNHC",
                 num_blocks: int = 64, abort_timeout_s: float = 10.0,
                 roles: tuple[str, str] = ("kv_producer", "kv_consumer"), staging: str = "auto",
                 p_tp: int = 1, d_tp: int = 1, extra: dict[str, Any] | None = None) -> None:
        common: dict[str, Any] = {"faults": faults, "abort_timeout_s": abort_timeout_s, "kv_load_deadline_s": 15.0,
                                  "staging": staging, **(extra or {})}
        self.faults = FaultSpec.parse(faults)
        self.p = self.instance("P", model_dir, roles[0], {**common, "bootstrap_port": free_port()},
                          layout=layout, num_blocks=num_blocks, tp_size=p_tp)
        try:
            self.d = self.instance("D", model_dir, roles[1], {**common, "bootstrap_port": free_port()},
                              policy=policy, layout=layout, num_blocks=num_blocks, tp_size=d_tp)
        except BaseException:
            self.p.close()
            raise
        self.p_alive = True

    def prefill(self, prompt: list[int], transfer_id: str | None = None) -> tuple[str, dict[str, Any]]:
        """Run the prompt on P (max_tokens=1, as the proxy does); the kv_transfer_params P answers with."""
        transfer_id = transfer_id or f"xfer-{uuid.uuid4()}"
        req = self.p.add(prompt, 1, {"do_remote_decode": True, "transfer_id": transfer_id})
        self.p.run_until(lambda: self.p.finished(req.request_id) is not None, what="prefill")
        out = self.p.finished(req.request_id)
        assert out is not None and out.finish_reason == FinishReason.LENGTH
        assert out.kv_transfer_params is not None
        return req.request_id, out.kv_transfer_params

    def d_params(self, transfer_id: str) -> dict[str, Any]:
        """What a proxy that sends to P and D at the same time gives D."""
        return {"do_remote_prefill": True, "transfer_id": transfer_id, "remote_engine_id": self.p.engine_id,
                "remote_bootstrap_addr": self.p.bootstrap_addr}

    def both_until(self, done: Any, timeout: float = 20.0, what: str = "condition") -> None:
        def step_both() -> bool:
            if self.p_alive:
                self.p.step()
            return bool(done())

        self.d.run_until(step_both, timeout, what)

    def kill_p(self) -> None:
        """P's process is gone: its control, transfer and bootstrap endpoints close."""
        self.p.worker.shutdown(timeout_s=2.0)
        self.p_alive = False

    def assert_empty(self) -> None:
        """Both schedulers end empty: no request left, every block free; each id reported once."""
        def idle(instance: Instance) -> bool:
            pending = instance.worker.stats().values()
            return not instance.scheduler.requests and not any(v["pending_pulls"] or v["pending_sends"] for v in pending)

        def drained() -> bool:
            return idle(self.d) and (not self.p_alive or idle(self.p))

        self.both_until(drained, what="both schedulers to drain")
        self.d.assert_empty()
        assert len(self.d.received) == len(set(self.d.received))
        if self.p_alive:
            self.p.assert_empty()
            assert len(self.p.sent) == len(set(self.p.sent))
            prefill = self.p.connector.pd.get("prefill")
            assert prefill is None or not prefill._claims, f"transfer ids still claimed: {prefill._claims}"

    def close(self) -> None:
        self.d.close()
        self.p.close()


@pytest.fixture
def make_pd(model_dir: str) -> Iterator[Any]:
    made: list[PD] = []

    def make(pd_class: type[PD] = PD, model: str = model_dir, **kw: Any) -> PD:
        pd = pd_class(model, **kw)
        made.append(pd)
        return pd

    yield make
    for pd in made:
        pd.close()


def p_prompt_bytes(pd: PD, p_req: str, prompt: list[int]) -> list[list[torch.Tensor]]:
    return [pd.p.block_bytes(b) for b in pd.p.block_ids(p_req)[: -(-len(prompt) // BLOCK_SIZE)]]


def assert_blocks_equal(pd: PD, d_req: str, expected: list[list[torch.Tensor]], upto: int | None = None) -> None:
    d_blocks = pd.d.block_ids(d_req)[: len(expected)]
    for i, (want, block) in enumerate(zip(expected, d_blocks, strict=True)):
        if upto is not None and i >= upto:
            break
        got = pd.d.block_bytes(block)
        assert all(torch.equal(w, g) for w, g in zip(want, got, strict=True)), f"block {i} differs"


def decode_to_end(pd: PD, d_req: str) -> Any:
    pd.both_until(lambda: pd.d.finished(d_req) is not None, what=f"{d_req} to finish")
    return pd.d.finished(d_req)


# ---- the happy path -------------------------------------------------------------------------------------
@pytest.mark.parametrize(("layout", "roles", "staging"), [
    ("LBNHC", ("kv_producer", "kv_consumer"), "auto"),
    ("BLHNC", ("kv_producer", "kv_consumer"), "auto"),  # block-outermost: layers interleave in one region
    ("LBNHC", ("kv_both", "kv_both"), "auto"),
    # Through host mirrors, as for a KV cache on a GPU: D's KV cache gets the bytes only by staging.
    ("LBNHC", ("kv_producer", "kv_consumer"), "always"),
    ("BLHNC", ("kv_producer", "kv_consumer"), "always"),
])
def test_request_runs_p_to_d(make_pd: Any, layout: str, roles: tuple[str, str], staging: str) -> None:
    pd = make_pd(layout=layout, roles=roles, staging=staging)
    assert pd.p.worker.layout.staged == pd.d.worker.layout.staged == (staging == "always")
    p_req, params = pd.prefill(PROMPT)
    assert params["do_remote_prefill"] is True and params["remote_engine_id"] == pd.p.engine_id
    assert params["remote_bootstrap_addr"] == pd.p.bootstrap_addr
    expected = p_prompt_bytes(pd, p_req, PROMPT)
    assert p_req in pd.p.scheduler.requests  # delay_free: P's blocks wait for D's pull

    d_req = pd.d.add(PROMPT, 5, params)
    pd.d.step()
    assert d_req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert (d_req.request_id, len(PROMPT)) in pd.d.alloc_calls
    pd.both_until(lambda: d_req.request_id in pd.d.scheduler.finished_recving_kv_req_ids, what="KV arrival")
    assert_blocks_equal(pd, d_req.request_id, expected)  # the bytes P's model wrote, exactly

    out = decode_to_end(pd, d_req.request_id)
    assert out.finish_reason == FinishReason.LENGTH and len(pd.d.tokens(d_req.request_id)) == 5
    # The second update_state_after_alloc after the async load comes with 0 tokens and is ignored.
    assert [n for r, n in pd.d.alloc_calls if r == d_req.request_id] == [len(PROMPT), 0]
    assert pd.d.received == [d_req.request_id] and pd.p.sent == [p_req]
    assert not pd.d.invalid
    pd.assert_empty()


class LateCopies:
    """Staging copies that complete as a GPU's do: `launch` returns at once and the copies land later
    (on a thread, after `delay_s`), unless the caller waits for them."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self.launched = 0

    def launch(self, copies: Sequence[Callable[[], object]]) -> Callable[[], None]:
        done = threading.Event()

        def run() -> None:
            time.sleep(self.delay_s)
            for copy in copies:
                copy()
            done.set()

        self.launched += 1
        threading.Thread(target=run, name="late-copies", daemon=True).start()
        return lambda: None if done.wait(10.0) else pytest.fail("staging copies never completed")


@pytest.mark.parametrize("faults", ["", "transport=1,seed=0"], ids=["clean", "transport"])
def test_staged_blocks_are_in_place_when_reported(make_pd: Any, faults: str) -> None:
    """With copies that complete late (as on a GPU, where a copy is only launched), P's data plane reads
    the mirror only once `stage_out` completed, and D reports the request in finished_recving only once
    `stage_in` completed: the blocks hold P's bytes the moment vLLM's scheduler hears of them. Also for
    the blocks a failed load keeps under `recompute` (the data plane breaks after half the blocks)."""
    pd = make_pd(policy="recompute", faults=faults, abort_timeout_s=1.5, staging="always")
    p_copies, d_copies = LateCopies(0.3), LateCopies(0.3)
    pd.p.worker.layout.copies, pd.d.worker.layout.copies = p_copies, d_copies
    p_req, params = pd.prefill(PROMPT)
    expected = p_prompt_bytes(pd, p_req, PROMPT)
    d_req = pd.d.add(PROMPT, 5, params)
    pd.d.step()
    blocks = pd.d.block_ids(d_req.request_id)
    pd.both_until(lambda: d_req.request_id in pd.d.received, what="the load to be reported")
    # Checked before D runs another step: what vLLM's next forward would read.
    kept = min((blocks.index(b) for b in pd.d.invalid), default=len(expected))
    assert kept == (len(expected) if not faults else d_req.num_computed_tokens // BLOCK_SIZE)
    assert kept > 0 and p_copies.launched and d_copies.launched
    assert_blocks_equal(pd, d_req.request_id, expected, upto=kept)
    out = decode_to_end(pd, d_req.request_id)
    assert out.finish_reason == FinishReason.LENGTH and len(pd.d.tokens(d_req.request_id)) == 5
    pd.assert_empty()


def test_same_prompt_again_pulls_only_the_block_past_ds_hit(make_pd: Any) -> None:
    pd = make_pd()
    _, params = pd.prefill(PROMPT)
    first = pd.d.add(PROMPT, 2, params)
    decode_to_end(pd, first.request_id)
    # Same prompt again: D's prefix cache holds its 5 whole blocks, so D pulls only the last one
    # (test_vllm_prefix_hit.py: multi-turn prompts, failures, groups).
    p_req, params = pd.prefill(PROMPT)
    second = pd.d.add(PROMPT, 2, params)
    out = decode_to_end(pd, second.request_id)
    assert out.finish_reason == FinishReason.LENGTH
    assert pd.d.tokens(second.request_id) == pd.d.tokens(first.request_id)
    assert (second.request_id, len(PROMPT) - 5 * BLOCK_SIZE) in pd.d.alloc_calls
    assert pd.d.received == [first.request_id, second.request_id]
    pd.assert_empty()
    assert p_req in pd.p.sent


def test_unusable_kv_transfer_params_are_ignored(make_pd: Any) -> None:
    pd = make_pd()
    both = {"do_remote_decode": True, "do_remote_prefill": True, "transfer_id": "xfer-0"}  # contradictory
    p_req = pd.p.add(PROMPT, 1, both)
    d_req = pd.d.add(PROMPT, 3, {"do_remote_prefill": True, "transfer_id": "xfer-1"})  # no P to pull from
    pd.both_until(lambda: pd.p.finished(p_req.request_id) and pd.d.finished(d_req.request_id), what="both")
    assert pd.p.finished(p_req.request_id).kv_transfer_params is None
    assert pd.d.finished(d_req.request_id).finish_reason == FinishReason.LENGTH
    assert pd.p.sent == [] and pd.d.received == [] and not any(n for _, n in pd.d.alloc_calls)
    pd.assert_empty()


def test_requests_without_params_on_p_are_served_locally_and_said_once(make_pd: Any,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    # What a vLLM P behind sglang-router sees: vLLM's OpenAI server drops the bootstrap_* fields.
    pd = make_pd()
    with caplog.at_level(logging.WARNING, logger="kvferry.integrations.vllm"):
        for _ in range(2):
            req = pd.p.add(PROMPT, 2, None)
            pd.p.run_until(lambda r=req: pd.p.finished(r.request_id) is not None, what="a local request")
            assert pd.p.finished(req.request_id).kv_transfer_params is None
    said = [r for r in caplog.records if "served locally" in r.getMessage()]
    assert len(said) == 1 and "prefill" in said[0].getMessage()
    assert pd.p.sent == []
    pd.assert_empty()


def test_vllm_router_nixl_shape_names_the_transfer_on_p(make_pd: Any) -> None:
    # vllm-router (NIXL mode) sends P `do_remote_decode` with null remote_* keys and no transfer_id.
    pd = make_pd()
    nulls = {k: None for k in ("remote_engine_id", "remote_block_ids", "remote_host", "remote_port")}
    p_req = pd.p.add(PROMPT, 1, {"do_remote_decode": True, **nulls})
    pd.p.run_until(lambda: pd.p.finished(p_req.request_id) is not None, what="prefill")
    params = pd.p.finished(p_req.request_id).kv_transfer_params
    assert params["transfer_id"] == f"xfer-{p_req.request_id}" and params["do_remote_prefill"] is True
    d_req = pd.d.add(PROMPT, 3, params)
    out = decode_to_end(pd, d_req.request_id)
    assert out.finish_reason == FinishReason.LENGTH and pd.d.received == [d_req.request_id]
    pd.assert_empty()


def test_unknown_setting_is_rejected(model_dir: str) -> None:
    with pytest.raises(ValueError, match="bootstrap_prot"):
        Instance("X", model_dir, "kv_consumer", {"bootstrap_prot": 1})


# ---- a request queued on a busy P -------------------------------------------------------------------------
def d_heard_working(pd: PD, transfer_id: str) -> bool:
    """Whether a heartbeat ack from P listed `transfer_id` as working (queued or prefilling) on D's side.
    Reads D's dealers, which the consumer's thread updates: a snapshot of them is enough here."""
    consumer = pd.d.worker.pd["decode"].consumer
    assert consumer is not None
    return any(transfer_id in dealer.working_seen for dealer in list(consumer._dealers.values()))


def test_request_queued_on_a_busy_p_outlives_ds_receive_timeout(make_pd: Any) -> None:
    """The proxy sends to P and D at once, and P's engine is busy: its run slots are full and each step
    takes 100 ms, so the request waits in P's queue longer than D's receive timeout (abort timeout + 5 s).
    P reports the transfer as working from the moment vLLM's scheduler takes the request in (while the
    slots are full vLLM does not even look at the waiting queue, so `get_num_new_matched_tokens` alone
    would come too late), D's heartbeat acks say so before the prefill starts, and D waits for the KV
    instead of failing with `recv_timeout` (or P answering "not ready" after its abort timeout)."""
    pd = make_pd(abort_timeout_s=0.5)
    recv_timeout = pd.d.worker.pd["decode"].config.recv_timeout_s
    hogs = [pd.p.add([3 + i] * 4, 1000, None) for i in range(8)]  # the harness's max_num_seqs
    pd.p.step()
    assert all(h.status == RequestStatus.RUNNING for h in hogs)
    forward = pd.p._forward

    def busy_forward(num_scheduled: dict[str, int], rank: int = 0) -> None:
        time.sleep(0.1)  # a long model step: P's engine spends most of its time inside steps
        forward(num_scheduled, rank)

    pd.p._forward = busy_forward  # type: ignore[method-assign]
    transfer_id = f"xfer-{uuid.uuid4()}"
    p_req = pd.p.add(PROMPT, 1, {"do_remote_decode": True, "transfer_id": transfer_id})
    d_req = pd.d.add(PROMPT, 5, pd.d_params(transfer_id))
    queued_until = time.monotonic() + recv_timeout + 1.0
    heard = False

    def queued_long_enough() -> bool:
        nonlocal heard
        assert p_req.status == RequestStatus.WAITING, "P's prefill started: its queue was not long enough"
        heard = heard or d_heard_working(pd, transfer_id)
        return time.monotonic() > queued_until or pd.d.finished(d_req.request_id) is not None

    pd.both_until(queued_long_enough, timeout=recv_timeout + 10.0, what="P's queue to be held")
    cause = pd.d.connector.failure_causes.get(d_req.request_id)
    assert pd.d.finished(d_req.request_id) is None, f"D gave up on a request P had queued: {cause}"
    assert heard, "no heartbeat ack from P listed the queued transfer as working"
    pd.p._forward = forward  # type: ignore[method-assign]
    for hog in hogs:
        pd.p.abort(hog.request_id)
    out = decode_to_end(pd, d_req.request_id)
    assert out.finish_reason == FinishReason.LENGTH and len(pd.d.tokens(d_req.request_id)) == 5
    assert d_req.request_id not in pd.d.connector.failure_causes and not pd.d.invalid
    assert pd.d.received == [d_req.request_id] and pd.p.sent == [p_req.request_id]
    pd.assert_empty()


def test_p_reports_each_queued_request_once(make_pd: Any) -> None:
    """vLLM calls `on_new_request` once and `get_num_new_matched_tokens` whenever it looks at a waiting
    request; P's worker hears of each queued transfer once. Where `on_new_request` is not called (vLLM
    before 0.33), the first `get_num_new_matched_tokens` reports it."""
    pd = make_pd(abort_timeout_s=0.5)  # nobody pulls: P lets the transfers go after this
    working: list[str] = []
    start_load_kv = pd.p.worker.pd["prefill"].start_load_kv

    def spy(meta: Any) -> None:  # the transfer ids of `working` (entries may also name the request)
        working.extend(w if isinstance(w, str) else w[0] for w in meta.working)
        start_load_kv(meta)

    pd.p.worker.pd["prefill"].start_load_kv = spy
    first = pd.p.add(PROMPT, 1, {"do_remote_decode": True, "transfer_id": "xfer-first"})
    for _ in range(3):  # vLLM looks at a waiting request again each step it cannot admit it
        assert pd.p.connector.get_num_new_matched_tokens(first, 0) == (0, False)
    pd.p.connector.on_new_request = lambda request: None  # type: ignore[method-assign]  # an older vLLM
    second = pd.p.add(PROMPT[::-1], 1, {"do_remote_decode": True, "transfer_id": "xfer-second"})
    local = pd.p.add(PROMPT[1:], 1, None)
    pd.p.run_until(lambda: all(pd.p.finished(r.request_id) for r in (first, second, local)), what="prefills")
    assert working == ["xfer-first", "xfer-second"]
    assert not pd.p.connector._queued  # a finished request is forgotten: the memory holds live ones only
    pd.assert_empty()


# ---- failures ---------------------------------------------------------------------------------------------
FAULTS = ["error_reply=1,seed=0", "bootstrap=1,seed=0", "transport=1,seed=0"]


@pytest.mark.parametrize("faults", FAULTS)
def test_failed_load_under_fail_ends_in_error(make_pd: Any, faults: str) -> None:
    # P frees blocks that D never reached (bootstrap) when its lease runs out: keep that short.
    pd = make_pd(policy="fail", faults=faults, abort_timeout_s=1.5)
    _, params = pd.prefill(PROMPT)
    d_req = pd.d.add(PROMPT, 5, params)
    out = decode_to_end(pd, d_req.request_id)
    assert out.finish_reason == FinishReason.ERROR and d_req.status == RequestStatus.FINISHED_ERROR
    assert pd.d.tokens(d_req.request_id) == []
    assert pd.d.connector.failure_causes[d_req.request_id][0] == pd.faults.expected_cause(params["transfer_id"])
    assert pd.d.invalid  # reported with the request, in the same step
    pd.assert_empty()


@pytest.mark.parametrize("staging", ["auto", "always"])
@pytest.mark.parametrize("faults", FAULTS)
def test_failed_load_under_recompute_cuts_at_first_invalid_block(make_pd: Any, faults: str, staging: str) -> None:
    pd = make_pd(policy="recompute", faults=faults, abort_timeout_s=1.5, staging=staging)
    p_req, params = pd.prefill(PROMPT)
    expected = p_prompt_bytes(pd, p_req, PROMPT)
    d_req = pd.d.add(PROMPT, 5, params)
    pd.d.step()
    blocks = pd.d.block_ids(d_req.request_id)
    pd.both_until(lambda: d_req.request_id in pd.d.received, what="the failed load to be reported")
    first_bad = min(blocks.index(b) for b in pd.d.invalid)
    assert d_req.num_computed_tokens == first_bad * BLOCK_SIZE  # cut at the first invalid block
    if faults.startswith("transport"):
        assert 0 < first_bad < len(expected)  # the blocks written before the break are kept
        assert_blocks_equal(pd, d_req.request_id, expected, upto=first_bad)
    else:
        assert first_bad == 0
    # Recomputed locally, the request finishes normally, with the KV and tokens of a clean run.
    pd.both_until(lambda: d_req.num_computed_tokens >= len(PROMPT), what="local recompute")
    assert_blocks_equal(pd, d_req.request_id, expected)
    out = decode_to_end(pd, d_req.request_id)
    assert out.finish_reason == FinishReason.LENGTH and len(pd.d.tokens(d_req.request_id)) == 5
    assert pd.d.received == [d_req.request_id]
    pd.assert_empty()


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_prefill_instance_gone(make_pd: Any, policy: str) -> None:
    pd = make_pd(policy=policy)
    _, params = pd.prefill(PROMPT)
    warm = pd.d.add(PROMPT, 1, params)  # D now knows P's endpoints
    decode_to_end(pd, warm.request_id)
    prompt = PROMPT[::-1]
    _, params = pd.prefill(prompt)
    pd.kill_p()
    d_req = pd.d.add(prompt, 3, params)
    out = decode_to_end(pd, d_req.request_id)
    cause = pd.d.connector.failure_causes[d_req.request_id][0]
    assert cause in ("peer_dead", "bootstrap", "transport", "recv_timeout"), cause
    if policy == "fail":
        assert out.finish_reason == FinishReason.ERROR
    else:
        assert out.finish_reason == FinishReason.LENGTH and len(pd.d.tokens(d_req.request_id)) == 3
    pd.assert_empty()  # D only: P's blocks went with its process


# ---- requests that end on D before (or during) their load ----------------------------------------------
def test_abort_on_d_before_admission_releases_p(make_pd: Any) -> None:
    pd = make_pd(abort_timeout_s=30.0)  # P's blocks must come back long before the lease would expire
    p_req, params = pd.prefill(PROMPT)
    d_req = pd.d.add(PROMPT, 5, params)
    pd.d.abort(d_req.request_id)  # before D's scheduler ever admitted it
    pd.both_until(lambda: p_req in pd.p.sent, timeout=5.0, what="P to free its blocks")
    assert pd.d.received == []  # a release-only pull is never reported to D's scheduler
    pd.assert_empty()


def test_rejected_for_capacity_then_aborted_releases_p(make_pd: Any) -> None:
    pd = make_pd(num_blocks=10, abort_timeout_s=30.0)
    hog = pd.d.add(list(range(3, 3 + 7 * BLOCK_SIZE)), 50, None)  # fills D's KV cache
    pd.d.step()
    p_req, params = pd.prefill(PROMPT)
    d_req = pd.d.add(PROMPT, 5, params)
    for _ in range(3):
        pd.d.step()
    assert d_req.status == RequestStatus.WAITING  # not admitted: no room for its blocks
    pd.d.abort(d_req.request_id)
    pd.d.abort(hog.request_id)
    pd.both_until(lambda: p_req in pd.p.sent, timeout=5.0, what="P to free its blocks")
    pd.assert_empty()


def test_abort_on_d_during_load(make_pd: Any) -> None:
    pd = make_pd(faults="slow=400,seed=0", abort_timeout_s=30.0)  # each write waits 400 ms before it starts
    p_req, params = pd.prefill(PROMPT)
    d_req = pd.d.add(PROMPT, 5, params)
    pd.d.step()
    assert d_req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    deadline = time.monotonic() + 0.2
    while time.monotonic() < deadline:  # the pull reaches P, whose write is still waiting
        pd.p.step()
        pd.d.step()
    pd.d.abort(d_req.request_id)
    assert d_req.request_id in pd.d.scheduler.requests  # vLLM keeps the blocks until the load is over
    pd.both_until(lambda: p_req in pd.p.sent and d_req.request_id in pd.d.received, timeout=5.0,
                  what="both sides to release")
    pd.assert_empty()
    assert pd.d.received == [d_req.request_id] and pd.p.sent == [p_req]


def test_abort_on_d_right_after_admission_releases_p(make_pd: Any) -> None:
    # The abort may land while D is still looking P up; then P frees the blocks when its lease runs out.
    pd = make_pd(faults="slow=400,seed=0", abort_timeout_s=1.5)
    p_req, params = pd.prefill(PROMPT)
    d_req = pd.d.add(PROMPT, 5, params)
    pd.d.step()
    pd.d.abort(d_req.request_id)
    pd.both_until(lambda: p_req in pd.p.sent, timeout=5.0, what="P to free its blocks")
    pd.assert_empty()
    assert pd.d.received == [d_req.request_id]


def test_d_released_before_p_finished_prefill(make_pd: Any) -> None:
    """The proxy sends to P and D at the same time; D's request is aborted before P's prefill ends.
    P frees the blocks at once or, at the latest, when its lease runs out."""
    pd = make_pd(abort_timeout_s=1.5)
    transfer_id = f"xfer-{uuid.uuid4()}"
    d_req = pd.d.add(PROMPT, 5, pd.d_params(transfer_id))
    pd.d.abort(d_req.request_id)
    pd.both_until(lambda: not pd.d.scheduler.requests and not pd.d.worker.stats()["decode"]["pending_pulls"],
                  what="D's release-only pull")  # it reaches P before P has the KV
    p_req, _ = pd.prefill(PROMPT, transfer_id)
    pd.both_until(lambda: p_req in pd.p.sent, timeout=5.0, what="P to free its blocks")
    pd.assert_empty()
    assert pd.d.received == []


def test_no_secret_no_network_and_the_allow_list(monkeypatch: pytest.MonkeyPatch) -> None:
    """The adapter follows `kvferry serve`'s rules (docs/security.md): a non-loopback host needs
    KVFERRY_SECRET or "insecure"; D's prefill allow-list comes from the extra config."""
    from kvferry.integrations.vllm.settings import KVFerrySettings

    monkeypatch.delenv("KVFERRY_SECRET", raising=False)
    with pytest.raises(ValueError, match="KVFERRY_SECRET"):
        KVFerrySettings.from_extra_config({"host": "10.1.2.3"}, "e")
    assert KVFerrySettings.from_extra_config({"host": "10.1.2.3", "insecure": True}, "e").insecure
    monkeypatch.setenv("KVFERRY_SECRET", "c2VjcmV0LW9mLWF0LWxlYXN0LTEyOC1iaXRz")
    settings = KVFerrySettings.from_extra_config({"host": "10.1.2.3", "prefill_allow": ["10.1.2.0/24"]}, "e")
    assert settings.pd_config("decode", 16).prefill_allow == ("10.1.2.0/24",)
    with pytest.raises(ValueError, match="prefill-allow"):
        KVFerrySettings.from_extra_config({"prefill_allow": ["not a host!"]}, "e")


def test_transfer_nixl_follows_serves_rules(monkeypatch: pytest.MonkeyPatch) -> None:
    """"transfer": "nixl" as `kvferry serve --transfer nixl`: a clear error without nixl, and loopback
    unless "insecure" (docs/security.md), whatever the secret."""
    from kvferry.integrations.vllm.settings import KVFerrySettings
    from kvferry.transfer.nixl import api as nixl_api

    monkeypatch.setenv("KVFERRY_SECRET", "c2VjcmV0LW9mLWF0LWxlYXN0LTEyOC1iaXRz")
    if not nixl_api.available():
        with pytest.raises(ValueError, match="nixl is not installed"):
            KVFerrySettings.from_extra_config({"transfer": "nixl"}, "e")
        return
    assert KVFerrySettings.from_extra_config({"transfer": "nixl"}, "e").pd_config("decode", 16).transfer == "nixl"
    with pytest.raises(ValueError, match="UCX"):
        KVFerrySettings.from_extra_config({"transfer": "nixl", "host": "10.1.2.3"}, "e")
    assert KVFerrySettings.from_extra_config({"transfer": "nixl", "host": "10.1.2.3", "insecure": True}, "e").insecure
