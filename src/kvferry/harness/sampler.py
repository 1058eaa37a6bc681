"""Live state of a running system: Prometheus text from /metrics and JSON from /debug/state."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvferry.harness.metrics_text import parse_samples


@dataclass
class MetricSnapshot:
    """Samples of one /metrics page: name → list of (labels, value)."""

    samples: dict[str, list[tuple[dict[str, str], float]]] = field(default_factory=dict)

    def value(self, name: str, **labels: str) -> float:
        """Sum of the samples of `name` whose labels include `labels` (0 when absent)."""
        return sum(v for got, v in self.samples.get(name, []) if labels.items() <= got.items())

    def by_label(self, name: str, label: str) -> dict[str, float]:
        out: dict[str, float] = {}
        for lab, v in self.samples.get(name, []):
            if label in lab:
                out[lab[label]] = out.get(lab[label], 0.0) + v
        return out


def parse_metrics(text: str) -> MetricSnapshot:
    snap = MetricSnapshot()
    for name, labels, value in parse_samples(text):
        snap.samples.setdefault(name, []).append((labels, value))
    return snap


def get_metrics(client: httpx.Client, url: str) -> MetricSnapshot:
    response = client.get(f"{url}/metrics", timeout=10.0)
    response.raise_for_status()
    return parse_metrics(response.text)


async def fetch_metrics(client: httpx.AsyncClient, url: str) -> MetricSnapshot:
    response = await client.get(f"{url}/metrics", timeout=5.0)
    response.raise_for_status()
    return parse_metrics(response.text)


async def fetch_state(client: httpx.AsyncClient, url: str) -> dict[str, Any]:
    response = await client.get(f"{url}/debug/state", timeout=10.0)
    response.raise_for_status()
    return dict(response.json())


def wait_drained(urls: Sequence[str], timeout: float) -> list[dict[str, Any] | None]:
    """Poll /debug/state until every instance is idle (all blocks free, no pending transfers, no requests)
    or `timeout` passes; return the last states (None where an instance did not answer)."""
    deadline = time.monotonic() + timeout
    states: list[dict[str, Any] | None] = [None] * len(urls)
    while True:
        for i, url in enumerate(urls):
            try:
                states[i] = httpx.get(f"{url}/debug/state", timeout=5.0).json()
            except (httpx.HTTPError, ValueError):
                states[i] = None
        if all(s is not None and is_drained(s) for s in states) or time.monotonic() > deadline:
            return states
        time.sleep(0.2)


def is_drained(state: dict[str, Any]) -> bool:
    return bool(not state.get("stale")  # a stale state predates the step in progress
                and state.get("blocks_free") == state.get("blocks_total") and not state.get("pending_pulls")
                and not state.get("pending_sends") and not state.get("requests_by_status"))


def blocks_held(state: dict[str, Any]) -> int:
    """KV blocks an instance holds, from its /debug/state."""
    return int(state["blocks_total"]) - int(state["blocks_free"])


class Periodic:
    """`sample()` now and every `interval` s on a thread, into `samples`, until `stop()`."""

    def __init__(self, sample: Callable[[], float], interval: float, name: str) -> None:
        self.samples, self._sample, self._interval = [sample()], sample, interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self.samples.append(self._sample())

    def stop(self, timeout: float | None = None, last: bool = False) -> list[float]:
        """The samples; with `last`, one more taken now."""
        self._stop.set()
        self._thread.join(timeout)
        if last:
            self.samples.append(self._sample())
        return self.samples


class SystemSampler:
    """Polls /metrics and /debug/state of each instance every `interval` s into (seconds since `t0`, value)
    series, each on its own loop: one waiting on a busy engine (/debug/state runs there) delays only it."""

    def __init__(self, urls: dict[str, str], t0: float, interval: float = 0.25) -> None:
        self.urls, self.t0, self.interval = dict(urls), t0, interval
        self.metrics: dict[str, list[tuple[float, MetricSnapshot]]] = {name: [] for name in urls}
        self.states: dict[str, list[tuple[float, dict[str, Any]]]] = {name: [] for name in urls}

    def now(self) -> float:
        return time.monotonic() - self.t0

    def latest_state(self, name: str) -> tuple[float, dict[str, Any]] | None:
        series = self.states[name]
        return series[-1] if series else None

    async def poll(self, client: httpx.AsyncClient, name: str, state: bool = False) -> bool:
        """One answer of `name`'s /metrics (or /debug/state) into its series; False where none came."""
        asked = self.now()  # a state is stamped when asked: it is at least this fresh
        try:
            if state:
                self.states[name].append((asked, await fetch_state(client, self.urls[name])))
            else:
                snapshot = await fetch_metrics(client, self.urls[name])
                self.metrics[name].append((self.now(), snapshot))
        except (httpx.HTTPError, ValueError):
            return False
        return True

    async def run(self, stop: asyncio.Event) -> None:
        """Poll until `stop` is set; every loop polls once more after that, so the end is seen."""

        async def loop(client: httpx.AsyncClient, name: str, state: bool) -> None:
            while True:
                started = time.monotonic()
                await self.poll(client, name, state)
                if stop.is_set():
                    return
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(),
                                           max(0.0, self.interval - (time.monotonic() - started)))

        async with httpx.AsyncClient(timeout=httpx.Timeout(10.0)) as client:
            await asyncio.gather(*(loop(client, name, state) for state in (False, True) for name in self.urls))


def require_drained(named: dict[str, str], timeout: float) -> None:
    """`wait_drained` for {name: url}; RuntimeError naming the first instance that still holds anything."""
    states = wait_drained(list(named.values()), timeout)
    for name, state in zip(named, states, strict=True):
        if state is None or not is_drained(state):
            raise RuntimeError(f"{name} still holds KV blocks or requests after the run: {state}")
