"""Decode migration under every cut hypothesis picks (issue 32.4): the D relaying a stream dies after k of its
events (k from 0 to all of them, right before `[DONE]` included) and after any number of bytes of the next one,
while 0, 1 or 2 other D's are healthy, refuse connections (dead), answer 503 (draining), abort the request as
vLLM's SIGTERM does (HTTP 200, no token, finish_reason "abort") or die mid-stream themselves, under a migration
budget of 0 to 3; completions and chat completions. The proxy's real `Migration` relays real kvferry instances'
streams over loopback sockets; the dying D is a relay in front of a real instance that, as kill -9 would,
drops its connection and its port at the cut.

Properties: the client's stream is events then exactly one `[DONE]`; its text is always a prefix of the
fault-free text (no token repeated or lost) and is all of it whenever a healthy D is within the budget;
otherwise exactly one error event, right before `[DONE]`; no aborted finish reaches the client; every cut
before the stream's last token event, and every abort, is counted once, as `resumed` or `gave_up`; a chat
stream's role chunk comes exactly once, as its first delta; a stream never hangs."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from fake_vllm import Counter, aborting_decode
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from inproc import ServerThread

from kvferry.engine.engine import Engine, EngineConfig
from kvferry.serving.api_server import build_app
from kvferry.serving.drain import Drain
from kvferry.serving.instances import Instance, InstancePool
from kvferry.serving.migrate import Migration, prepare
from kvferry.serving.resume import TOKEN_IDS_FIELD
from procs import free_port

PROMPT = "migrate me: " + "kv " * 6
PATHS = {False: "/v1/completions", True: "/v1/chat/completions"}
DONE = b"data: [DONE]\n\n"


@dataclass
class Servers:
    a: str  # the first D's instance
    b: str  # the other D's instance (another engine: resumed bits must match A's)
    draining: str  # an instance over B's engine whose drain has started: 503 to every completion
    aborting: str  # a vLLM D under SIGTERM (no --shutdown-timeout): HTTP 200, no token, finish_reason "abort"
    aborts: Counter  # the requests it was sent
    references: dict[str, tuple[str, list[bytes]]] = field(default_factory=dict, repr=False)


@pytest.fixture(scope="module")
def servers() -> Iterator[Servers]:
    engines = [Engine(EngineConfig(num_blocks=256, seed=0)) for _ in range(2)]
    for engine in engines:
        engine.start()
    drain = Drain(engines[1].snapshot, timeout_s=float("inf"))
    aborts = Counter()
    threads = [ServerThread.of(build_app(engines[0])), ServerThread.of(build_app(engines[1])),
               ServerThread.of(build_app(engines[1], drain=drain)), ServerThread.of(aborting_decode(aborts))]
    try:
        for t in threads:
            t.start()
        assert httpx.post(f"{threads[2].url}/drain", timeout=10).status_code == 202
        yield Servers(threads[0].url, threads[1].url, threads[2].url, threads[3].url, aborts)
    finally:
        for t in threads:
            t.stop()
        for engine in engines:
            engine.stop()


def _events(raw: bytes) -> list[bytes]:
    """An SSE body split into its events (each with its blank line)."""
    return [part + b"\n\n" for part in raw.split(b"\n\n") if part]


def _choice(event: bytes) -> dict[str, Any]:
    data = json.loads(event[6:])
    choice: dict[str, Any] = (data.get("choices") or [{}])[0]
    return choice


def _text(events: list[bytes]) -> str:
    """The text of a completion's or a chat's events."""
    return "".join(c.get("text") or (c.get("delta") or {}).get("content") or "" for c in map(_choice, events))


def _is_final(event: bytes) -> bool:
    return event != DONE and _choice(event).get("finish_reason") is not None


def _reference(servers: Servers, path: str, body: dict[str, Any]) -> tuple[str, list[bytes]]:
    """The fault-free stream of A (its events as D sends them to the proxy, with token ids) and its text."""
    key = path + json.dumps(body, sort_keys=True)
    if key not in servers.references:
        with httpx.Client(timeout=60) as client:
            r = client.post(f"{servers.a}{path}", json=body)
        assert r.status_code == 200, r.text
        events = _events(r.content)
        assert events[-1] == DONE
        servers.references[key] = (_text(events[:-1]), events)
    return servers.references[key]


class DyingD:
    """A D that dies mid-stream: relays a real instance's stream and, after `events` whole events and `partial`
    bytes of the next, drops the connection and closes its port (later connects are refused)."""

    def __init__(self, upstream: str, events: int, partial: int) -> None:
        self.upstream, self.events, self.partial = upstream, events, partial
        self.cut = False
        self.cut_after_final = False  # the stream's last token event had reached the client
        self._server: asyncio.Server | None = None
        self.url = ""

    async def start(self) -> DyingD:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            method, path = head.split(b" ")[:2]
            length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length:")), 0)
            body = await reader.readexactly(length)
            if method != b"POST":
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\n{}")
                return
            await self._relay(path.decode(), body, writer)
        finally:
            writer.close()

    async def _relay(self, path: str, body: bytes, writer: asyncio.StreamWriter) -> None:
        async with httpx.AsyncClient(timeout=60) as client, client.stream(
                "POST", f"{self.upstream}{path}", content=body, headers={"content-type": "application/json"}) as r:
            writer.write(f"HTTP/1.1 {r.status_code} OK\r\ncontent-type: {r.headers['content-type']}\r\n"
                         "transfer-encoding: chunked\r\n\r\n".encode())
            sent, buf = 0, b""
            async for data in r.aiter_bytes():
                buf += data
                while b"\n\n" in buf:
                    event, buf = buf.split(b"\n\n", 1)
                    event += b"\n\n"
                    if sent == self.events:  # kill -9 here: some bytes of this event, then nothing
                        self._die(writer, event[: self.partial % len(event)])
                        return
                    writer.write(b"%x\r\n%s\r\n" % (len(event), event))
                    self.cut_after_final = self.cut_after_final or _is_final(event)
                    sent += 1
            writer.write(b"0\r\n\r\n")

    def _die(self, writer: asyncio.StreamWriter, partial: bytes) -> None:
        if partial:
            writer.write(b"%x\r\n%s\r\n" % (len(partial), partial))
        assert self._server is not None
        self._server.close()  # the port closes with the process
        writer.transport.abort()
        self.cut = True


FATES = st.one_of(st.sampled_from(["healthy", "refused", "draining", "aborts"]),
                  st.tuples(st.just("dies"), st.integers(0, 30), st.integers(0, 400)))


@dataclass(frozen=True)
class Case:
    sampling: dict[str, Any]
    max_tokens: int
    first_cut: float  # where in its stream the first D dies: a fraction of its events
    partial: int
    others: list[Any]
    budget: int
    stop_at: int | None  # a stop string taken from the fault-free text at this index
    chat: bool = False  # /v1/chat/completions (its first delta carries the role) or /v1/completions


CASES = st.builds(
    Case,
    sampling=st.sampled_from([{"temperature": 0}, {"temperature": 0.9, "seed": 11}, {"temperature": 1.0}]),
    max_tokens=st.integers(1, 24),
    first_cut=st.floats(0, 1),
    partial=st.integers(0, 400),
    others=st.lists(FATES, max_size=2),
    budget=st.integers(0, 3),
    stop_at=st.none() | st.integers(0, 40),
    chat=st.booleans(),
)


@pytest.mark.timeout(300)
@settings(max_examples=int(os.environ.get("KVFERRY_MACHINE_EXAMPLES", "40")), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=CASES)
# The first D dies before its first chat chunk (as when a long stop string holds the text back): the resumed
# stream is the client's first, and still begins with the role.
@example(case=Case({"temperature": 0}, 8, 0.0, 0, ["healthy"], 1, None, chat=True))
def test_a_stream_whose_d_dies_anywhere_is_whole_or_ends_with_one_error(servers: Servers, case: Case) -> None:
    asyncio.run(asyncio.wait_for(_run(servers, case), 90))


async def _run(servers: Servers, case: Case) -> None:
    path = PATHS[case.chat]
    prompt = {"messages": [{"role": "user", "content": PROMPT}]} if case.chat else {"prompt": PROMPT}
    body = prepare({**prompt, "max_tokens": case.max_tokens, "ignore_eos": True, "stream": True, **case.sampling})
    text, events = _reference(servers, path, body)
    if case.stop_at is not None and text.strip():
        stop = text[case.stop_at % len(text)]
        if stop.isascii() and stop.isprintable() and stop.strip():  # not a partial character's U+FFFD
            body["stop"] = [stop]
            text, events = _reference(servers, path, body)
    # The first D dies after k of its events: k = 0 (before any token) up to all of them (before [DONE]).
    token_events = len(events) - 1
    first = await DyingD(servers.a, round(case.first_cut * token_events), case.partial).start()
    others: list[str] = []
    dying = [first]
    for fate in case.others:
        if fate == "healthy":
            others.append(servers.b)
        elif fate == "refused":
            others.append(f"http://127.0.0.1:{free_port()}")
        elif fate == "draining":
            others.append(servers.draining)
        elif fate == "aborts":
            others.append(servers.aborting)
        else:
            d = await DyingD(servers.b, fate[1], fate[2]).start()
            dying.append(d)
            others.append(d.url)
    outcomes: list[str] = []
    servers.aborts.requests = 0
    try:
        async with httpx.AsyncClient(timeout=60) as client:
            pool = InstancePool([Instance(first.url), *(Instance(u) for u in others)], client)
            try:
                r = await client.send(client.build_request("POST", f"{first.url}{path}", json=body), stream=True)
                assert r.status_code == 200
                migration = Migration(client, pool, body, path, case.budget, outcomes.append)
                got = b"".join([e async for e in migration.relay(r, pool.instances[0])])
            finally:
                await pool.close()
    finally:
        for d in dying:
            await d.close()
    assert first.cut, "the first D never died"
    _check(case, text, got, outcomes, dying, servers.aborts.requests)


def _check(case: Case, text: str, got: bytes, outcomes: list[str], dying: list[DyingD], aborts: int) -> None:
    events = _events(got)
    assert events and events[-1] == DONE and events.count(DONE) == 1, got[-300:]
    bodies = [json.loads(e[6:]) for e in events[:-1]]
    errors = [i for i, b in enumerate(bodies) if "error" in b]
    assert len(errors) <= 1 and (not errors or errors[0] == len(bodies) - 1), "error event not last"
    assert all(TOKEN_IDS_FIELD not in b for b in bodies), "the proxy's own field reached the client"
    assert len({b["id"] for b in bodies if "id" in b}) <= 1, "one stream, one id"
    deltas = [b["choices"][0]["delta"] for b in bodies if b.get("choices") and "delta" in b["choices"][0]]
    roles = [i for i, d in enumerate(deltas) if d.get("role") == "assistant"]
    assert not deltas or roles == [0], f"a chat stream's role chunk must come once, first: {deltas}"
    client_text = _text(events[:-1])
    assert text.startswith(client_text), f"text repeated or lost: {client_text!r} vs {text!r}"
    assert all(_choice(e).get("finish_reason") != "abort" for e in events[:-1]), "an aborted finish reached the client"
    # Every D death before the stream's last token event, and every abort, is one migration outcome.
    needed = sum(d.cut and not d.cut_after_final for d in dying) + aborts
    assert outcomes.count("resumed") + outcomes.count("gave_up") == needed, (outcomes, needed)
    assert outcomes.count("gave_up") == len(errors), (outcomes, errors)
    healthy = "healthy" in case.others
    failing = len(case.others)  # every other D may fail once before a healthy one is picked
    if not dying[0].cut_after_final and healthy and case.budget >= failing:
        assert not errors and client_text == text, f"a healthy D within budget, yet: {got[-300:]!r}"
    if dying[0].cut_after_final:  # the client had every token: nothing to migrate
        assert not errors and client_text == text, f"whole stream answered with an error: {got[-300:]!r}"
    can_finish = any(f == "healthy" or isinstance(f, tuple) for f in case.others)
    if not dying[0].cut_after_final and (not can_finish or case.budget == 0):
        assert len(errors) == 1, "no D could take the stream, yet no error event"
