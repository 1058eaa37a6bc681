"""How one cell of `kvferry bench vllm --faults` runs: P prefills, the fault lands, the D's answer, and the
cell records the answer, D's failure counters, what P and D held and when they freed their blocks."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import httpx

from kvferry.bench.vllm.client import answer_text, complete, prefill, prompt
from kvferry.bench.vllm.fault_cells import (
    CONNECTORS,
    FAILURE_COUNTERS,
    PAUSE_S,
    POLICIES,
    RETRIES,
    Caps,
    Cell,
    counter_deltas,
    freed_summary,
    next_prefill,
    retry_backoff_s,
    retryable,
    summary,
)
from kvferry.bench.vllm.fault_rig import FreedWatch, Link, Pair, held
from kvferry.bench.vllm.servers import metric_sum

MAX_TOKENS = 16


class Matrix:
    """Runs the faults against one connector's pair, both policies per fault."""

    def __init__(self, pair: Pair, link: Link, caps: Caps, log: Callable[[str], None], retries: int = RETRIES) -> None:
        self.pair, self.link, self.caps, self.log, self.retries = pair, link, caps, log, retries
        self.model = pair.model
        self.seed = 1000 * CONNECTORS.index(pair.kind)
        self.pool = ThreadPoolExecutor(4)

    def _prompts(self) -> dict[str, str]:
        self.seed += 2
        return {policy: prompt(self.seed + i) for i, policy in enumerate(POLICIES)}

    def _references(self, prompts: dict[str, str]) -> dict[str, str]:
        """The colocated answers: a P without kv_transfer_params is a plain vllm serve with the same weights."""
        return {policy: answer_text(complete(self.pair.reference().url, self.model, text, MAX_TOKENS, 300))
                for policy, text in prompts.items()}

    def _decode(self, policy: str, text: str, params: dict[str, Any]) -> Any:
        """D's answer (a response), or what stood for it: "no answer" within the cap, the error's name."""
        try:
            return complete(self.pair.d[policy].url, self.model, text, MAX_TOKENS, self.caps.answer, params)
        except httpx.TimeoutException:
            return "no answer"
        except httpx.HTTPError as exc:
            return type(exc).__name__

    def _ask_d(self, policy: str, text: str, params: dict[str, Any]) -> Future[tuple[Any, float, int]]:
        """D's answer to the request P prefilled; a KV-load failure (`retryable`) gets a new prefill on the P
        `next_prefill` picks and a new D request, up to `retries` times, for both connectors alike."""

        def call() -> tuple[Any, float, int]:
            r, tries, backoffs, last = self._decode(policy, text, params), 1, 0, 0
            while tries <= self.retries and not isinstance(r, str) and retryable(r.status_code, _json(r)):
                prefills = self.pair.prefills()
                last, backoff = next_prefill(last, [p.healthy(timeout=1.0) for p in prefills])
                if backoff:
                    backoffs += 1
                    time.sleep(retry_backoff_s(backoffs))
                tries += 1
                try:
                    fresh = prefill(prefills[last].url, self.model, text, self.caps.answer)
                except (httpx.HTTPError, RuntimeError):
                    continue  # this P failed the prefill: r stays D's failure, the next try picks again
                r = self._decode(policy, text, fresh)
            return r, time.monotonic(), tries

        return self.pool.submit(call)

    def _wait_reading(self) -> None:
        def reading(d: Any) -> bool:
            m = {k: v for k, v in d.metrics(timeout=15).items() if 'stage="in_progress"' in k}
            return metric_sum(m, "vllm:num_requests_kv_fetch_by_stage") >= 1

        deadline = time.monotonic() + self.caps.reading
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                # vLLM's scheduler: a KV load started and not reported finished, on both D's
                if all(reading(d) for d in self.pair.d.values()):
                    return
            time.sleep(0.05)
        raise TimeoutError(f"D's did not start reading remote KV within {self.caps.reading:.0f} s")

    def _watch(self, started: float, dead: set[str]) -> FreedWatch:
        """From `started` on, one thread per side polls until P (or both D's) hold 0 KV blocks."""
        return FreedWatch({"P": [self.pair.p], "D": list(self.pair.d.values())}, started, dead, self.caps.freed)

    def _cells(self, fault: str, refs: dict[str, str], futures: dict[str, Future[tuple[Any, float, int]]],
               before: dict[str, dict[str, float]], t_ref: dict[str, float], dead: set[str],
               watch: FreedWatch) -> list[Cell]:
        cells = []
        for policy, future in futures.items():
            cell = Cell(self.pair.kind, policy, fault)
            try:
                response, answered, cell.tries = future.result(timeout=(self.caps.answer + 5) * (self.retries + 1) + 30)
            except Exception as exc:  # noqa: BLE001 - recorded in the cell
                response, answered = f"{type(exc).__name__}", time.monotonic()
            cell.answer_s = round(answered - t_ref[policy], 3)
            if isinstance(response, str):
                cell.error = response
                if response == "no answer":
                    cell.answer_s = None
            else:
                cell.http = response.status_code
                if response.status_code == 200:
                    cell.identical = answer_text(response) == refs[policy]
                else:
                    with contextlib.suppress(ValueError, KeyError, TypeError):
                        cell.error = str(response.json()["error"]["message"])[:80]
            cells.append(cell)
        p_held = {"P": held(self.pair.p) if "P" not in dead else None}
        for cell in cells:
            d = self.pair.d[cell.policy]
            if "D" not in dead:
                with contextlib.suppress(httpx.HTTPError):
                    cell.causes = counter_deltas(before[cell.policy], d.metrics(timeout=15), FAILURE_COUNTERS)
            cell.held = {k: v for k, v in {**p_held, "D": held(d) if "D" not in dead else None}.items() if v is not None}
        freed = watch.result()
        for cell in cells:
            cell.freed_s = dict(freed)
            self.log(f"  {cell.connector} {fault} {cell.policy}: {summary(cell)}; held {cell.held}; freed "
                     f"{freed_summary(cell)}")
        return cells

    def _before(self) -> dict[str, dict[str, float]]:
        return {policy: d.metrics(timeout=15) for policy, d in self.pair.d.items()}

    def reading(self, fault: str, act: Callable[[], None], undo: Callable[[], None] | None = None,
                dead: frozenset[str] = frozenset()) -> list[Cell]:
        """A fault while both D's read: P prefilled both prompts, the link is capped, both D's asked."""
        prompts = self._prompts()
        refs = self._references(prompts)
        params = {policy: prefill(self.pair.p.url, self.model, text) for policy, text in prompts.items()}
        before = self._before()
        self.link.cap(160)  # 20 MB/s: two reads of ~40 MB last seconds
        try:
            futures = {policy: self._ask_d(policy, prompts[policy], params[policy]) for policy in POLICIES}
            self._wait_reading()
            fault_at = time.monotonic()
            act()
            watch = self._watch(fault_at, set(dead))
            timer = None
            if undo is not None:
                timer = threading.Timer(PAUSE_S, undo)
                timer.start()
            try:
                cells = self._cells(fault, refs, futures, before, dict.fromkeys(POLICIES, fault_at), set(dead),
                                    watch)
            finally:
                if timer is not None:
                    timer.join()
        finally:
            self.link.uncap()
        return cells

    def simple(self, fault: str, between: Callable[[], None] | None = None, dead: frozenset[str] = frozenset(),
               note: Callable[[], str] | None = None, each: Callable[[], None] | None = None) -> list[Cell]:
        """P prefills, `between` runs, then D's are asked (the time counts from D's request). With `each`,
        the D's one after the other, `each` run before each (the corrupt cell arms its rule per D)."""
        prompts = self._prompts()
        refs = self._references(prompts)
        cells: list[Cell] = []
        for group in ([[policy] for policy in POLICIES] if each is not None else [list(POLICIES)]):
            params = {policy: prefill(self.pair.p.url, self.model, prompts[policy]) for policy in group}
            before = self._before()
            if (act := each or between) is not None:
                act()
            watch = self._watch(time.monotonic(), set(dead))
            t_ref, futures = {}, {}
            for policy in group:
                t_ref[policy] = time.monotonic()
                futures[policy] = self._ask_d(policy, prompts[policy], params[policy])
            got = self._cells(fault, refs, futures, before, t_ref, set(dead), watch)
            for cell in got:  # the note after the answer (the corrupt cell's: the rule's counter)
                cell.note = note() if note is not None else ""
            cells += got
        return cells


def _json(r: httpx.Response) -> Any:
    try:
        return r.json()
    except ValueError:
        return None
