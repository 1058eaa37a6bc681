"""Live progress: a redrawn rich view in a terminal, a plain line every few seconds elsewhere."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from rich.console import Console, RenderableType
from rich.live import Live

T = TypeVar("T")


async def show_progress(console: Console, live: bool, view: Callable[[], RenderableType], line: Callable[[], str],
                        body: Awaitable[T], every_s: float = 5.0) -> T:
    """Await `body`, meanwhile redrawing `view()` 4 times a second, or printing `line()` every `every_s`
    and once more when it ends."""
    task = asyncio.ensure_future(body)
    live_view = Live(view(), console=console, auto_refresh=False) if live else None
    last_line = time.monotonic()
    if live_view is not None:
        live_view.start()
    try:
        while not task.done():
            await asyncio.wait([task], timeout=0.25)
            if live_view is not None:
                live_view.update(view(), refresh=True)
            elif time.monotonic() - last_line >= every_s or task.done():
                last_line = time.monotonic()
                console.print(line(), highlight=False)
    finally:
        task.cancel()  # only when this wait itself was cancelled: the body is done otherwise
        if live_view is not None:
            live_view.stop()
    return task.result()
