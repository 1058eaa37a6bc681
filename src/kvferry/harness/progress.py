"""Live progress for a run in the terminal (a redrawn rich view), or a plain line every few seconds when
the output is not a terminal (CI logs, pipes)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

from rich.console import Console, RenderableType
from rich.live import Live


async def show_progress(console: Console, live: bool, view: Callable[[], RenderableType], line: Callable[[], str],
                        stop: asyncio.Event, every_s: float = 5.0) -> None:
    """Until `stop` is set: redraw `view()` 4 times a second, or print `line()` every `every_s`."""
    live_view = Live(view(), console=console, auto_refresh=False) if live else None
    last_line = time.monotonic()
    if live_view is not None:
        live_view.start()
    try:
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.25)
            if live_view is not None:
                live_view.update(view(), refresh=True)
            elif time.monotonic() - last_line >= every_s or stop.is_set():
                last_line = time.monotonic()
                console.print(line(), highlight=False)
    finally:
        if live_view is not None:
            live_view.stop()
