"""Progressive push in vLLM: P writes a long prompt's blocks to D while vLLM's chunked prefill computes
them (the harness's max_num_batched_tokens of 256 cuts a 600-token prompt into 3 steps), and D's pull,
sent when the proxy sent P the request, is served part by part. Real `Scheduler`s and kvferry's real
data and control planes, as in test_vllm_connector.py.

Each test holds what the push must never cost: D's answer equals the colocated one, a preempted prefill
(vLLM frees and reuses its blocks) never has a write read them afterwards, a P killed mid-prefill ends
D's request with a typed cause (or a recomputation under `recompute`), and both pools end full.

Runs in the optional environment (`bash .ci/vllm-env.sh`); skips where vLLM is not installed.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from test_vllm_connector import HAVE_VLLM

if not HAVE_VLLM:  # the harness imports vLLM: skip before importing it
    pytest.skip("vLLM is not installed (see .ci/vllm-env.sh)", allow_module_level=True)

from test_vllm_connector import PD, decode_to_end, make_pd, model_dir
from test_vllm_prefix_hit import LAYER_BLOCK, bytes_received, reference
from vllm.v1.engine import FinishReason
from vllm.v1.request import Request
from vllm_harness import BLOCK_SIZE, LAYER_NAMES

from kvferry.integrations.vllm import progress as vllm_progress

__all__ = ["make_pd", "model_dir"]  # fixtures

LONG = [(17 * i + 29) % 50000 + 3 for i in range(600)]  # 38 blocks: 3 steps of P's chunked prefill
BLOCK_BYTES = len(LAYER_NAMES) * LAYER_BLOCK  # one block, every layer


def progressive_writes(pd: PD) -> float:
    return float(pd.p.worker.pd["prefill"].metrics.progressive_writes._value.get())


def start(pd: PD, prompt: list[int], max_tokens: int = 5) -> tuple[Request, Request]:
    """What kvferry's proxy does: the request to P and D at once, under one transfer id."""
    transfer_id = f"xfer-{uuid.uuid4()}"
    p_req = pd.p.add(prompt, 1, {"do_remote_decode": True, "transfer_id": transfer_id})
    d_req = pd.d.add(prompt, max_tokens, pd.d_params(transfer_id))
    return p_req, d_req


def first_part_landed(pd: PD, p_req: Request) -> int:
    """P computes its first chunk; D's pull reaches P while the prefill runs and the chunk's blocks land
    on D before P computes another token. Returns how many blocks landed."""
    pd.p.step()
    computed = p_req.num_computed_tokens
    assert BLOCK_SIZE <= computed < len(LONG), computed
    pd.d.run_until(lambda: bytes_received(pd) >= BLOCK_BYTES * (computed // BLOCK_SIZE), what="the first part")
    assert p_req.num_computed_tokens == computed and not pd.p.sent  # P's prefill has not gone on
    assert progressive_writes(pd) >= 1
    return computed // BLOCK_SIZE


def test_long_prompt_goes_to_d_while_p_prefills(make_pd: Any) -> None:
    pd: PD = make_pd()
    p_req, d_req = start(pd, LONG)
    first_part_landed(pd, p_req)
    out = decode_to_end(pd, d_req.request_id)
    assert out.finish_reason == FinishReason.LENGTH and pd.d.tokens(d_req.request_id) == reference(LONG, 5)
    assert not pd.d.invalid and d_req.request_id not in pd.d.connector.failure_causes
    assert pd.p.sent == [p_req.request_id]
    # Every block crossed once: the final write sent only what the parts had not.
    assert bytes_received(pd) == BLOCK_BYTES * -(-len(LONG) // BLOCK_SIZE)
    pd.assert_empty()


def test_short_prompt_is_pushed_after_its_prefill(make_pd: Any) -> None:
    pd: PD = make_pd()
    prompt = LONG[:200]  # one step, and under the minimum size at which pushing early pays
    _, d_req = start(pd, prompt)
    out = decode_to_end(pd, d_req.request_id)
    assert out.finish_reason == FinishReason.LENGTH and pd.d.tokens(d_req.request_id) == reference(prompt, 5)
    assert progressive_writes(pd) == 0
    pd.assert_empty()


def preempt_with_a_part_in_flight(pd: PD) -> tuple[Request, Request, Request, list[tuple[int, int]]]:
    """P's pool cannot hold the long prompt beside a decoding request: vLLM admits the prefill on its
    first chunk's blocks and preempts it at its third chunk, freeing its blocks while the second chunk's
    part (slowed by the `slow` fault) still reads them. Returns P's other request, P's and D's request of
    the transfer, and per preemption the writes in flight when it came and when it returned."""
    pd.p.scheduler.scheduler_reserve_full_isl = False  # admit on the first chunk's blocks, as vLLM may be told
    table = pd.p.worker.pd["prefill"].producer.table
    rewinds: list[tuple[int, int]] = []
    rewind = table.rewind

    def spy(*args: Any, **kw: Any) -> Any:
        before = table.writes_in_flight()
        left = rewind(*args, **kw)
        rewinds.append((before, table.writes_in_flight()))
        return left

    table.rewind = spy
    other = pd.p.add([5 + i % 7 for i in range(5 * BLOCK_SIZE)], 60, None)  # decoding beside the prefill
    p_req, d_req = start(pd, LONG)
    first_part_landed(pd, p_req)
    pd.p.step()  # the second chunk: its blocks go to D in a slow part
    pd.d.run_until(lambda: table.writes_in_flight() > 0, what="a part in flight")
    pd.p.step()  # the third chunk does not fit: vLLM preempts the prefill and frees its blocks
    assert p_req.num_preemptions == 1 and p_req.num_computed_tokens == 0
    return other, p_req, d_req, rewinds


def test_preempted_prefill_is_never_read_after_its_blocks_are_freed(make_pd: Any) -> None:
    """vLLM's `handle_preemptions` waits for the part (1 s) before the next forward may reuse the blocks;
    once the other request is done, the prefill resumes and the rest goes to D. D's answer is the
    colocated one."""
    pd: PD = make_pd(faults="slow=1000", num_blocks=40)
    other, p_req, d_req, rewinds = preempt_with_a_part_in_flight(pd)
    assert rewinds == [(1, 0)], rewinds  # a write read the blocks; none did once the next forward could run
    out = decode_to_end(pd, d_req.request_id)
    assert d_req.request_id not in pd.d.connector.failure_causes, pd.d.connector.failure_causes
    assert out.finish_reason == FinishReason.LENGTH and pd.d.tokens(d_req.request_id) == reference(LONG, 5)
    assert not pd.d.invalid
    assert pd.p.sent == [p_req.request_id] and pd.p.finished(other.request_id) is not None
    pd.assert_empty()


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_preemption_cancels_a_write_that_outlasts_its_wait(make_pd: Any, monkeypatch: pytest.MonkeyPatch,
                                                           policy: str) -> None:
    """A part still running when the preemption's wait ends (0.5 s here, against a 3 s write) is
    cancelled before the next forward: the transfer ends, D's pull fails with a typed cause, and its
    policy decides (`recompute`: the colocated answer). P finishes its prefill and frees every block."""
    monkeypatch.setattr(vllm_progress, "PREEMPT_WAIT_S", 0.5)
    pd: PD = make_pd(faults="slow=3000", num_blocks=40, policy=policy)
    other, p_req, d_req, rewinds = preempt_with_a_part_in_flight(pd)
    assert rewinds[0][0] == 1 and rewinds[-1][1] == 0, rewinds  # cancelled: nothing reads the blocks now
    out = decode_to_end(pd, d_req.request_id)
    cause = pd.d.connector.failure_causes[d_req.request_id][0]
    assert cause in ("transport", "expired"), pd.d.connector.failure_causes
    if policy == "fail":
        assert out.finish_reason == FinishReason.ERROR
    else:
        assert out.finish_reason == FinishReason.LENGTH and pd.d.tokens(d_req.request_id) == reference(LONG, 5)
    pd.both_until(lambda: pd.p.finished(other.request_id) is not None and pd.p.finished(p_req.request_id) is not None,
                  what="P's requests to end")
    pd.assert_empty()


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_p_killed_mid_prefill_after_parts_landed(make_pd: Any, policy: str) -> None:
    """Blocks already on D count only with P's checksums for them: P dies before its final answer, so
    `fail` ends the request with `peer_dead`, and `recompute` computes the blocks that did not arrive
    (and any that arrived unverified) and answers as colocated."""
    pd: PD = make_pd(policy=policy)
    p_req, d_req = start(pd, LONG)
    landed = first_part_landed(pd, p_req)
    d_blocks = pd.d.block_ids(d_req.request_id)[: -(-len(LONG) // BLOCK_SIZE)]
    pd.kill_p()
    out = decode_to_end(pd, d_req.request_id)
    cause = pd.d.connector.failure_causes[d_req.request_id][0]
    assert cause == "peer_dead", pd.d.connector.failure_causes
    if policy == "fail":
        assert out.finish_reason == FinishReason.ERROR
    else:
        assert out.finish_reason == FinishReason.LENGTH and pd.d.tokens(d_req.request_id) == reference(LONG, 5)
        # Every block that did not arrive is recomputed (and one that arrived only when P's checksum for it
        # came), from the first such block on.
        invalid = set(pd.d.invalid)
        assert set(d_blocks[landed:]) <= invalid <= set(d_blocks), (landed, sorted(invalid))
    pd.assert_empty()  # D only: P's blocks went with its process


def test_p_aborted_mid_prefill_after_parts_landed(make_pd: Any) -> None:
    """P's request ends mid-prefill (a client gone, P's abort) after a part reached D: its blocks were
    lent to the producer, which hands them back to vLLM once no write reads them; D's pull fails with
    P's answer (the prefill ended without KV) and nothing is held on either side."""
    pd: PD = make_pd()
    p_req, d_req = start(pd, LONG)
    first_part_landed(pd, p_req)
    pd.p.abort(p_req.request_id)
    out = decode_to_end(pd, d_req.request_id)
    assert out.finish_reason == FinishReason.ERROR and d_req.request_id in pd.d.connector.failure_causes
    pd.both_until(lambda: p_req.request_id in pd.p.sent, what="P's lent blocks back in vLLM's pool")
    pd.assert_empty()
