"""The scheduler's side of progressive push: a request the connector pushes while it computes holds every
block it can need from admission, reports its progress after each step (whole blocks only, never the
last step's), is never the victim of a preemption, and its blocks go back only through the connector,
also when it is aborted mid-prefill. Outputs stay bit-identical and the pool ends full."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvferry.connector.base import RequestLike
from kvferry.connector.fake import ScriptedConnector
from kvferry.engine.engine import Engine, EngineConfig, RequestOutput
from kvferry.engine.model import ModelConfig, TinyLlama
from kvferry.engine.request import Request, SamplingParams

BS = 16
MODEL = ModelConfig(seed=3)


class Pushing(ScriptedConnector):
    """Pushes the requests named in `pushed` progressively; a finished one's blocks come back after
    `hold` steps (a partial write may still read them)."""

    def __init__(self, pushed: set[str], hold: int = 3) -> None:
        super().__init__()
        self.pushed, self.hold = pushed, hold
        self.progress: list[tuple[str, int, list[int]]] = []

    def pushes_progressively(self, request: RequestLike) -> bool:
        return request.request_id in self.pushed

    def prefill_progress(self, request: RequestLike, block_ids: Sequence[int], num_computed_tokens: int) -> None:
        self.progress.append((request.request_id, num_computed_tokens, list(block_ids)))

    def request_finished(self, request: RequestLike, block_ids: Sequence[int]) -> tuple[bool, dict[str, Any] | None]:
        if request.request_id in self.pushed and any(p[0] == request.request_id for p in self.progress):
            self.plan_send(request.request_id, self.hold)  # lent: back in finished_sending, dead or not
        return super().request_finished(request, block_ids)


def prompt(n: int, salt: int = 0) -> list[int]:
    return [(i * 7 + salt * 13 + 5) % 256 for i in range(n)]


def engine_with(connector: Pushing, num_blocks: int = 64, chunk: int = 32) -> Engine:
    return Engine(EngineConfig(num_blocks=num_blocks, block_size=BS, max_prefill_chunk=chunk, model=MODEL), connector)


def submit(engine: Engine, out: dict[str, list[int]], rid: str, ids: list[int], max_tokens: int) -> Request:
    request = Request(rid, ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    out[rid] = []

    def sink(o: RequestOutput) -> None:
        out[rid] += o.new_token_ids

    engine.submit(request, sink)
    return request


def full(engine: Engine) -> bool:
    engine.scheduler.check_integrity()
    return engine.pool.num_free == engine.pool.num_total


def test_pushed_request_holds_its_blocks_from_admission_and_reports_each_step() -> None:
    connector = Pushing({"p"})
    engine = engine_with(connector)
    out: dict[str, list[int]] = {}
    ids = prompt(150)
    submit(engine, out, "p", ids, max_tokens=1)
    engine._drain_commands()
    engine.step()
    assert len(engine.scheduler.block_tables["p"]) == -(-150 // BS)  # every block at once, not one chunk's
    engine.run_until_idle()
    # After each step but the last: what it computed, with the whole table (its first blocks are final).
    assert [n for _, n, _ in connector.progress] == [32, 64, 96, 128]
    assert all(len(blocks) == 10 for _, _, blocks in connector.progress)
    assert out["p"] == TinyLlama(MODEL).generate_greedy(ids, 1, stop_at_eos=False)
    assert full(engine)


def test_a_pushed_request_is_never_preempted_and_outputs_stay_identical() -> None:
    connector = Pushing({"p"})
    engine = engine_with(connector, num_blocks=40, chunk=16)
    out: dict[str, list[int]] = {}
    model = TinyLlama(MODEL)
    # Six decoding requests of 3 blocks each grow to 5 while the pushed one (19 blocks, taken at once,
    # admitted last: the victim a plain preemption picks first) is still prefilling.
    others = [submit(engine, out, f"o{i}", prompt(40, 2 + i), max_tokens=40) for i in range(6)]
    pushed = submit(engine, out, "p", prompt(300, 1), max_tokens=1)
    engine.run_until_idle()
    assert pushed.num_preemptions == 0
    assert sum(r.num_preemptions for r in others) > 0  # the pool was tight: others made room
    assert out["p"] == model.generate_greedy(prompt(300, 1), 1, stop_at_eos=False)
    for i, r in enumerate(others):
        assert out[r.request_id] == model.generate_greedy(prompt(40, 2 + i), 40, stop_at_eos=False)
    assert full(engine)


def test_an_aborted_pushed_request_lends_its_blocks_until_the_connector_hands_them_back() -> None:
    connector = Pushing({"p"}, hold=4)
    engine = engine_with(connector)
    out: dict[str, list[int]] = {}
    submit(engine, out, "p", prompt(150, 3), max_tokens=1)
    engine._drain_commands()
    engine.step()
    engine.step()  # progress reported: a partial write may read its first blocks
    engine.abort("p")
    engine._drain_commands()
    assert "p" in engine.scheduler.sending and engine.pool.num_free == engine.pool.num_total - 10
    engine.run_until_idle()
    assert full(engine)
