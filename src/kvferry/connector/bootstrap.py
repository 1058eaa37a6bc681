"""Bootstrap: an HTTP server on P where each P rank registers its control address, and the client D
uses to map `remote_engine_id` → rank addresses (cached)."""

from __future__ import annotations

import threading
import time

import httpx
import msgspec
import uvicorn
from fastapi import FastAPI, HTTPException

from kvferry.connector.faults import FaultSpec


class RankInfo(msgspec.Struct):
    tp_rank: int
    control_addr: str  # tcp://host:port of the rank's ZMQ ROUTER


class EngineInfo(msgspec.Struct):
    engine_id: str
    tp_size: int
    ranks: list[RankInfo]

    def control_addr(self, rank: int) -> str:
        return next(r.control_addr for r in self.ranks if r.tp_rank == rank)


class Registration(msgspec.Struct, forbid_unknown_fields=True):
    engine_id: str
    tp_size: int
    tp_rank: int
    control_addr: str


class BootstrapError(Exception):
    pass


class BootstrapServer:
    def __init__(self, host: str, port: int, faults: FaultSpec | None = None) -> None:
        self.host, self.port = host, port
        self.faults = faults or FaultSpec()
        self._engines: dict[str, dict[int, Registration]] = {}
        self._lock = threading.Lock()
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    def register(self, reg: Registration) -> None:
        if not 0 <= reg.tp_rank < reg.tp_size:
            raise ValueError(f"tp_rank {reg.tp_rank} out of range for tp_size {reg.tp_size}")
        with self._lock:
            self._engines.setdefault(reg.engine_id, {})[reg.tp_rank] = reg

    def lookup(self, engine_id: str) -> EngineInfo | None:
        with self._lock:
            regs = self._engines.get(engine_id)
            if not regs:
                return None
            tp_size = next(iter(regs.values())).tp_size
            if len(regs) < tp_size:
                return None  # not every rank has registered yet
            ranks = [RankInfo(r.tp_rank, r.control_addr) for r in sorted(regs.values(), key=lambda r: r.tp_rank)]
            return EngineInfo(engine_id, tp_size, ranks)

    def engines(self) -> list[EngineInfo]:
        """Every fully registered engine, in the order the first rank of each registered."""
        with self._lock:
            names = list(self._engines)
        return [info for name in names if (info := self.lookup(name)) is not None]

    def app(self) -> FastAPI:
        app = FastAPI(title="kvferry bootstrap")

        @app.post("/register")
        async def register(body: dict[str, object]) -> dict[str, str]:
            try:
                self.register(msgspec.convert(body, Registration))
            except (msgspec.ValidationError, ValueError) as exc:
                raise HTTPException(400, str(exc)) from exc
            return {"status": "ok"}

        @app.get("/query")
        async def query(engine_id: str | None = None, transfer_id: str | None = None) -> dict[str, object]:
            if transfer_id and self.faults.fault_for(transfer_id) == "bootstrap":
                raise HTTPException(503, "injected bootstrap fault")
            if engine_id is None:
                # vllm-router (Mooncake mode) and sglang's D ask without an engine: every engine
                # whose ranks have all registered, keyed by its data-parallel rank as a string.
                return {str(dp_rank): msgspec.to_builtins(info) for dp_rank, info in enumerate(self.engines())}
            info = self.lookup(engine_id)
            if info is None:
                raise HTTPException(404, f"unknown engine {engine_id!r}")
            return msgspec.to_builtins(info)  # type: ignore[no-any-return]

        @app.get("/health")
        async def health() -> dict[str, str]:
            return {"status": "ok"}

        return app

    def start(self, timeout: float = 10.0) -> None:
        config = uvicorn.Config(self.app(), host=self.host, port=self.port, log_level="warning", lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="bootstrap", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"bootstrap server could not start on {self.host}:{self.port}")
            time.sleep(0.01)

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=5)


class BootstrapClient:
    def __init__(self, timeout_s: float = 2.0) -> None:
        self._http = httpx.Client(timeout=timeout_s)
        self._cache: dict[tuple[str, str], EngineInfo] = {}
        self._lock = threading.Lock()

    def lookup(self, bootstrap_addr: str, engine_id: str, transfer_id: str | None = None, fresh: bool = False) -> EngineInfo:
        key = (bootstrap_addr, engine_id)
        if not fresh:
            with self._lock:
                cached = self._cache.get(key)
            if cached is not None:
                return cached
        params = {"engine_id": engine_id, **({"transfer_id": transfer_id} if transfer_id else {})}
        try:
            r = self._http.get(f"http://{bootstrap_addr}/query", params=params)
        except httpx.HTTPError as exc:
            raise BootstrapError(f"bootstrap server {bootstrap_addr} unreachable: {exc!r}") from exc
        if r.status_code != 200:
            raise BootstrapError(f"bootstrap server {bootstrap_addr} answered {r.status_code}: {r.text[:200]}")
        try:
            info = msgspec.convert(r.json(), EngineInfo)
        except (ValueError, msgspec.ValidationError) as exc:
            raise BootstrapError(f"bootstrap server {bootstrap_addr} sent a malformed answer: {exc}") from exc
        with self._lock:
            self._cache[key] = info
        return info

    def cached(self, bootstrap_addr: str, engine_id: str) -> EngineInfo | None:
        with self._lock:
            return self._cache.get((bootstrap_addr, engine_id))

    def forget(self, bootstrap_addr: str, engine_id: str) -> None:
        """Drop a cached answer after a failure, so a restarted P is found again at once."""
        with self._lock:
            self._cache.pop((bootstrap_addr, engine_id), None)

    def close(self) -> None:
        self._http.close()
