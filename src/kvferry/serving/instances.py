"""The proxy's view of its P and D instances: round-robin picks that skip ejected instances, ejection after
a failed connect or a 503 `/health` (checked actively, so a request need not find out), and a probe that
brings one back."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import httpx

log = logging.getLogger(__name__)

PROBE_INTERVAL_S = 0.5
# Every instance in rotation is asked /health this often (a draining one answers 503).
CHECK_INTERVAL_S = 1.0


@dataclass
class Instance:
    url: str
    ejected: bool = False
    ejections: int = 0

    def reset(self) -> None:
        """Called when the instance comes back (it may have restarted): nothing cached about it holds."""


@dataclass
class PrefillTarget(Instance):
    engine_id: str = ""
    bootstrap_addr: str = ""
    known: bool = False
    # A P whose /health names no engine id and bootstrap address (vLLM's) is used sequentially.
    sequential: bool = False
    pinned: bool = False  # sequential by configuration, whatever /health says

    async def refresh(self, client: httpx.AsyncClient) -> None:
        r = await client.get(f"{self.url}/health", timeout=5.0)
        r.raise_for_status()
        try:
            info = r.json()
            self.engine_id, self.bootstrap_addr = str(info["engine_id"]), str(info["kv_bootstrap_addr"])
            self.sequential = self.pinned
        except (ValueError, KeyError, TypeError):
            self.sequential = True
        self.known = True

    def forget(self) -> None:
        """P may have restarted (with another engine id): ask again next time."""
        self.known = False

    def reset(self) -> None:
        self.forget()


T = TypeVar("T", bound=Instance)


@dataclass
class InstancePool(Generic[T]):
    """Round robin over the instances that are not ejected (over all of them when every one is)."""

    instances: list[T]
    client: httpx.AsyncClient
    _next: int = 0
    _probes: dict[str, asyncio.Task[None]] = field(default_factory=dict)
    _checks: asyncio.Task[None] | None = None

    def start_checks(self, interval_s: float = CHECK_INTERVAL_S) -> None:
        """Active health checks of the instances in rotation (call on the proxy's event loop)."""
        if interval_s > 0 and self._checks is None:
            self._checks = asyncio.create_task(self._check_loop(interval_s))

    async def _check_loop(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            await asyncio.gather(*(self._check(i) for i in self.instances if not i.ejected))

    async def _check(self, instance: T) -> None:
        # Only a refused connection or a 503 ejects: a busy instance that answers late is still serving.
        try:
            r = await self.client.get(f"{instance.url}/health", timeout=2.0)
        except httpx.ConnectError as exc:
            self.eject(instance, f"/health: {exc!r}")
            return
        except httpx.HTTPError:
            return
        if r.status_code == 503:
            self.eject(instance, f"/health answered 503 {r.text[:200]}")

    def pick(self, avoid: T | None = None) -> T:
        n = len(self.instances)
        for _ in range(n):
            candidate = self.instances[self._next % n]
            self._next += 1
            if not candidate.ejected and (candidate is not avoid or n == 1):
                return candidate
        candidate = self.instances[self._next % n]  # all ejected: try anyway, a probe may be late
        self._next += 1
        return candidate

    def ejections(self) -> int:
        return sum(i.ejections for i in self.instances)

    def healthy(self) -> int:
        return sum(not i.ejected for i in self.instances)

    def eject(self, instance: T, why: str) -> None:
        if instance.ejected:
            return
        instance.ejected = True
        instance.ejections += 1
        instance.reset()
        log.warning("ejecting %s (%s); probing /health every %.1fs", instance.url, why, PROBE_INTERVAL_S)
        self._probes[instance.url] = asyncio.create_task(self._probe(instance))

    async def _probe(self, instance: T) -> None:
        try:
            while True:
                await asyncio.sleep(PROBE_INTERVAL_S)
                with contextlib.suppress(httpx.HTTPError):
                    r = await self.client.get(f"{instance.url}/health", timeout=2.0)
                    if r.status_code == 200:
                        instance.ejected = False
                        log.warning("%s is back", instance.url)
                        return
        finally:
            self._probes.pop(instance.url, None)

    async def close(self) -> None:
        if self._checks is not None:
            self._checks.cancel()
            await asyncio.gather(self._checks, return_exceptions=True)
        for task in list(self._probes.values()):
            task.cancel()
        await asyncio.gather(*self._probes.values(), return_exceptions=True)
