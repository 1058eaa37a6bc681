"""The pipeline under `kvferry demo` and `kvferry chaos`: a workload, its colocated reference computing in
a side process meanwhile, and the judge of every answer against it."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import FrameType
from typing import Any

from rich.console import Console

from kvferry.engine.loader import load_codec
from kvferry.harness.client import RequestResult, WorkItem, make_workload, new_results
from kvferry.harness.questions import chat_workload
from kvferry.harness.reference import ReferenceWorker
from kvferry.harness.system import PDSystem, PDSystemConfig

_Handler = Callable[[int, FrameType | None], Any] | int | None


def workload(model: str, requests: int, seed: int, max_tokens: tuple[int, int], **byte_prompts: Any) -> list[WorkItem]:
    """Chat questions for a real model; for `tiny`, byte prompts (`byte_prompts`: make_workload's options).
    Raises ModelLoadError (a ValueError) for a model that does not load."""
    if model == "tiny":
        return make_workload(requests, seed, max_tokens=max_tokens, **byte_prompts)
    return chat_workload(load_codec(model), requests, seed, max_tokens)


def against_reference(results: list[RequestResult], references: dict[int, str]) -> tuple[list[int], list[int]]:
    """The ok answers that differ from their reference, and those with no reference yet (request indexes)."""
    ok = [r for r in results if r.outcome == "ok"]
    return ([r.index for r in ok if r.index in references and references[r.index] != r.text],
            [r.index for r in ok if r.index not in references])


@dataclass
class Trial:
    system: PDSystem  # not started: the caller starts it (under its own status line)
    items: list[WorkItem]
    results: list[RequestResult]
    ref: ReferenceWorker


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def _on_signals(handler: _Handler) -> dict[int, _Handler]:
    """Install `handler` for SIGINT and SIGTERM (main thread only); return the previous handlers."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}


@contextmanager
def trial(config: PDSystemConfig, items: list[WorkItem], model: str, console: Console,
          keep_logs: bool = False) -> Iterator[Trial]:
    """`items` for the P/D system of `config`, their reference computing from now on. Inside, SIGTERM
    interrupts as Ctrl-C does; on leaving, the reference and every process stop, by pid, however the
    body ended, and a second Ctrl-C cannot cut that short."""
    handlers = _on_signals(_interrupt)
    system, ref = PDSystem(config), None
    try:
        ref = ReferenceWorker(config.seed, config.blas_threads, model)
        ref.submit(items)
        yield Trial(system, items, new_results(items), ref)
    finally:
        _on_signals(signal.SIG_IGN)
        try:
            system.stop(keep_logs=keep_logs)
            if ref is not None:
                ref.stop()
        finally:
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
        if keep_logs:
            for proc in system.procs.values():
                console.print(f"log of {proc.name}: {proc.log_path}", style="dim")
