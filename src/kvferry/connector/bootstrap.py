"""Bootstrap: an HTTP server on P that maps `remote_engine_id` → its ranks' control addresses, and the
client D uses to ask it (cached).

P's ranks register in-process: no HTTP route changes what the server answers. With a deployment
secret every answer carries a MAC over D's nonce and the answer, so D cannot be pointed at a fake P,
nor handed an old answer. D asks only bootstrap servers its allow-list names (`PrefillAllowList`) and
never repeats what a server said in its own errors."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import ipaddress
import logging
import os
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Annotated, TypeVar

import httpx
import msgspec
import uvicorn
from fastapi import FastAPI, HTTPException

from kvferry.connector.auth import derive, prefill_receiver
from kvferry.connector.faults import FaultSpec
from kvferry.transfer.addr import split_addr

log = logging.getLogger(__name__)

# Every refused or failed bootstrap target gets this answer, at the same time (below): an HTTP client of
# D must not learn which ports are open, closed or filtered, nor what the allow-list holds.
REFUSED = ("KV bootstrap failed: no kvferry prefill answered at remote_bootstrap_addr (not allowed by "
           "--prefill-allow, not reachable, or not proving the secret)")
FAIL_AFTER_S = 2.0  # the default of `bootstrap_timeout_s`: a failure is reported this long after the lookup began

T = TypeVar("T")


# The random id a P rank drew at start (`auth.boot_id`, hex): D seals for it and the address together.
BootId = Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{32}$")]


class RankInfo(msgspec.Struct):
    tp_rank: int
    control_addr: str  # tcp://host:port of the rank's ZMQ ROUTER
    boot: BootId

    def receiver(self) -> bytes:
        """What D seals its messages to this rank for (`auth.prefill_receiver`)."""
        return prefill_receiver(self.control_addr, bytes.fromhex(self.boot))


class EngineInfo(msgspec.Struct):
    engine_id: str
    tp_size: int
    ranks: list[RankInfo]

    def rank(self, rank: int) -> RankInfo:
        return next(r for r in self.ranks if r.tp_rank == rank)


class Registration(msgspec.Struct, forbid_unknown_fields=True):
    engine_id: str
    tp_size: int
    tp_rank: int
    control_addr: str
    boot: BootId


class BootstrapError(Exception):
    pass


class BootstrapSlow(BootstrapError):
    """A server that answered before has not answered in time: slow, not gone (a refused connection is
    a BootstrapError)."""


def answer_mac(secret: bytes, nonce: str, info: EngineInfo) -> str:
    """Binds an answer to D's question (its nonce) and to the engine's ranks, under the secret."""
    body = nonce.encode() + b"\0" + msgspec.msgpack.encode(info)
    return hmac.new(derive(secret, "bootstrap"), body, hashlib.sha256).hexdigest()


class BootstrapServer:
    def __init__(self, host: str, port: int, faults: FaultSpec | None = None, secret: bytes | None = None) -> None:
        self.host, self.port = host, port
        self.faults = faults or FaultSpec()
        self._secret = secret
        self._engines: dict[str, dict[int, Registration]] = {}
        self._lock = threading.Lock()
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    def register(self, reg: Registration) -> None:
        if not 0 <= reg.tp_rank < reg.tp_size:
            raise ValueError(f"tp_rank {reg.tp_rank} out of range for tp_size {reg.tp_size}")
        try:  # a constructor checks no pattern (the boot id's)
            msgspec.convert(msgspec.structs.asdict(reg), Registration)
        except msgspec.ValidationError as exc:
            raise ValueError(f"registration of rank {reg.tp_rank}: {exc}") from None
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
            ranks = [RankInfo(r.tp_rank, r.control_addr, r.boot) for r in sorted(regs.values(), key=lambda r: r.tp_rank)]
            return EngineInfo(engine_id, tp_size, ranks)

    def engines(self) -> list[EngineInfo]:
        """Every fully registered engine, in the order the first rank of each registered."""
        with self._lock:
            names = list(self._engines)
        return [info for name in names if (info := self.lookup(name)) is not None]

    def app(self) -> FastAPI:
        app = FastAPI(title="kvferry bootstrap")

        @app.get("/query")
        async def query(engine_id: str | None = None, transfer_id: str | None = None,
                        nonce: str = "") -> dict[str, object]:
            if transfer_id and self.faults.fault_for(transfer_id) == "bootstrap":
                raise HTTPException(503, "injected bootstrap fault")
            if engine_id is None:
                # vllm-router (Mooncake mode) and sglang's D ask without an engine: every engine
                # whose ranks have all registered, keyed by its data-parallel rank as a string.
                return {str(dp_rank): msgspec.to_builtins(info) for dp_rank, info in enumerate(self.engines())}
            info = self.lookup(engine_id)
            if info is None:
                raise HTTPException(404, "unknown engine")
            answer: dict[str, object] = msgspec.to_builtins(info)
            if self._secret is not None:
                answer["mac"] = answer_mac(self._secret, nonce[:64], info)
            return answer

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
    def __init__(self, timeout_s: float = FAIL_AFTER_S, secret: bytes | None = None) -> None:
        self.timeout_s = timeout_s  # every lookup, and every refusal, takes at most this (`refused_alike`)
        self._secret = secret
        self._http = httpx.Client(timeout=timeout_s)
        self._cache: dict[tuple[str, str], EngineInfo] = {}
        self._answered: set[str] = set()  # servers that once gave a valid answer (with the secret: MAC'd)
        self._lock = threading.Lock()

    def lookup(self, bootstrap_addr: str, engine_id: str, transfer_id: str | None = None, fresh: bool = False) -> EngineInfo:
        key = (bootstrap_addr, engine_id)
        if not fresh:
            with self._lock:
                cached = self._cache.get(key)
            if cached is not None:
                return cached
        nonce = os.urandom(16).hex()
        params = {"engine_id": engine_id, "nonce": nonce, **({"transfer_id": transfer_id} if transfer_id else {})}
        try:
            r = self._http.get(f"http://{bootstrap_addr}/query", params=params)
        except httpx.TimeoutException as exc:
            raise BootstrapSlow(f"bootstrap server {bootstrap_addr}: no answer in time ({type(exc).__name__})") from exc
        except httpx.HTTPError as exc:
            raise BootstrapError(f"bootstrap server {bootstrap_addr} unreachable: {type(exc).__name__}") from exc
        # Never the body: whatever answers at that address must not get its words into our errors.
        if r.status_code == 404:
            raise BootstrapError(f"bootstrap server {bootstrap_addr}: unknown engine {engine_id[:100]!r} (HTTP 404)")
        if r.status_code != 200:
            raise BootstrapError(f"bootstrap server {bootstrap_addr} answered HTTP {r.status_code}")
        try:
            body = r.json()
            mac = body.pop("mac", "") if isinstance(body, dict) else ""
            info = msgspec.convert(body, EngineInfo)
        except (ValueError, msgspec.ValidationError) as exc:
            raise BootstrapError(f"bootstrap server {bootstrap_addr} sent a malformed answer") from exc
        if info.engine_id != engine_id:
            raise BootstrapError(f"bootstrap server {bootstrap_addr} answered for another engine")
        if self._secret is not None and not (
            isinstance(mac, str) and hmac.compare_digest(mac, answer_mac(self._secret, nonce, info))
        ):
            raise BootstrapError(f"bootstrap server {bootstrap_addr} did not prove it knows the secret")
        with self._lock:
            self._cache[key] = info
            self._answered.add(bootstrap_addr)
        return info

    def answered_before(self, bootstrap_addr: str) -> bool:
        with self._lock:
            return bootstrap_addr in self._answered

    def cached(self, bootstrap_addr: str, engine_id: str) -> EngineInfo | None:
        with self._lock:
            return self._cache.get((bootstrap_addr, engine_id))

    def forget(self, bootstrap_addr: str, engine_id: str) -> None:
        """Drop a cached answer after a failure, so a restarted P is found again at once."""
        with self._lock:
            self._cache.pop((bootstrap_addr, engine_id), None)

    def close(self) -> None:
        self._http.close()


LOOPBACK = ("127.0.0.0/8", "::1/128", "localhost")

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def _parse_entry(entry: str) -> tuple[Network | str, int | None]:
    """HOST, CIDR, HOST:PORT, CIDR:PORT, [IPv6]:PORT or [IPv6 CIDR]:PORT; a bare IPv6 has no port."""
    host, port = entry, ""
    if entry.startswith("["):
        host, sep, rest = entry[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            raise ValueError(f"--prefill-allow: {entry!r}: expected [IPv6]:PORT")
        port = rest[1:] if rest else ""
    elif entry.count(":") == 1:
        host, _, port = entry.partition(":")
    if port and (not port.isdigit() or not 0 < int(port) < 65536):
        raise ValueError(f"--prefill-allow: {entry!r}: the port must be 1-65535")
    try:
        return ipaddress.ip_network(host, strict=False), int(port) if port else None
    except ValueError:
        if not host or not all(c.isalnum() or c in "-." for c in host):
            raise ValueError(f"--prefill-allow: {entry!r} is neither a host name nor an IP network") from None
        return host.lower(), int(port) if port else None


class PrefillAllowList:
    """The bootstrap servers D may ask, so the prefill instances it may pull from: each entry a host name
    or an IP network (CIDR), with an optional port (`10.0.0.5:8998`, `10.0.0.0/24:8998`,
    `[fd00::/64]:8998`). A bare entry allows every port of those hosts, as before ports could be named:
    pin the bootstrap port where it is fixed. Any other target is refused before D asks it anything."""

    def __init__(self, entries: Sequence[str] = LOOPBACK) -> None:
        self.entries = list(entries)
        self._rules = [_parse_entry(entry) for entry in entries]

    def allows(self, host: str, port: int | None = None) -> bool:
        host = host.strip("[]")
        try:
            ip: ipaddress.IPv4Address | ipaddress.IPv6Address | None = ipaddress.ip_address(host)
        except ValueError:
            ip = None
        for where, rule_port in self._rules:
            if rule_port is not None and rule_port != port:
                continue
            if isinstance(where, str) and ip is None and where == host.lower():
                return True
            if not isinstance(where, str) and ip is not None and ip in where:
                return True
        return False

    def check(self, bootstrap_addr: str) -> None:
        host, port = split_addr(bootstrap_addr)
        if not port.isdigit() or not self.allows(host, int(port)):
            raise ValueError(
                f"remote_bootstrap_addr {bootstrap_addr[:100]!r} is not an allowed prefill host (--prefill-allow)"
            )


async def refused_alike(allow: PrefillAllowList, bootstrap_addr: str, ask: Callable[[], Awaitable[T]],
                        answered_before: Callable[[str], bool], timeout_s: float = FAIL_AFTER_S) -> T:
    """`ask()` only for an allowed target (host and port), bounded by `timeout_s`; any failure raises
    BootstrapError(REFUSED), `timeout_s` after the call began, whatever the cause (refused by the
    allow-list, closed, open but not kvferry, filtered, no MAC). Only a server that answered validly
    before fails at once and with its reason: a killed P is left as fast as before, and it told D
    nothing new about the host. Every question D asks a client-named bootstrap address goes through here."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    try:
        allow.check(bootstrap_addr)
        return await asyncio.wait_for(ask(), timeout_s)
    except (ValueError, BootstrapError, TimeoutError) as exc:
        reason = str(exc) if not isinstance(exc, TimeoutError) else "no answer in time"
        if answered_before(bootstrap_addr):
            raise (BootstrapSlow if isinstance(exc, TimeoutError | BootstrapSlow) else BootstrapError)(reason) from None
        log.info("bootstrap target %.100r refused or failed: %s", bootstrap_addr, reason[:200])
        await asyncio.sleep(max(0.0, started + timeout_s - loop.time()))
        raise BootstrapError(REFUSED) from None


async def lookup_uniform(client: BootstrapClient, allow: PrefillAllowList, bootstrap_addr: str,
                         engine_id: str, transfer_id: str | None, fresh: bool) -> EngineInfo:
    """`client.lookup`, off the loop, under `refused_alike`'s rule and the client's bound."""
    loop = asyncio.get_running_loop()
    return await refused_alike(
        allow, bootstrap_addr,
        lambda: loop.run_in_executor(None, client.lookup, bootstrap_addr, engine_id, transfer_id, fresh),
        client.answered_before, client.timeout_s,
    )
