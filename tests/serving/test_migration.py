"""Issue 32.4: a stream survives its D. The instance resumes a stream from the tokens the client already
has (`kvferry_resume`), and the proxy does it on another D when the one it relays dies (kill -9 mid-stream):
the client's whole text equals the fault-free answer, at temperature 0 and at a seeded temperature > 0."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from procs import Proc, free_port, running, serve, wait_until

COMMON = ("--seed", "0", "--num-blocks", "1024", "--heartbeat-timeout", "3.0")
PROMPT = "resume me where I stopped: " + "kv " * 20


def _events(r: httpx.Response) -> Iterator[dict[str, Any]]:
    for line in r.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[6:])


def _stream(url: str, body: dict[str, Any]) -> tuple[list[str], list[list[int]], bool]:
    texts, ids, done = [], [], False
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                event = json.loads(line[6:])
                texts.append(event["choices"][0]["text"])
                ids.append(event.get("kvferry_token_ids", []))
    return texts, ids, done


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 0.8, "seed": 1234}])
def test_an_instance_resumes_a_stream_from_any_chunk(sampling: dict[str, Any]) -> None:
    proc = serve(None, "--role", "both", *COMMON)
    body = {"prompt": PROMPT, "max_tokens": 60, "ignore_eos": True, **sampling, "kvferry_token_ids": True}
    with running(proc, timeout=60):
        texts, ids, done = _stream(proc.url, body)
        whole = "".join(texts)
        assert done and sum(map(len, ids)) == 60
        for cut in (1, 2, len(texts) // 2, len(texts) - 1):
            sent_ids = [t for chunk in ids[:cut] for t in chunk]
            sent_text = "".join(texts[:cut])
            resume = {"token_ids": sent_ids, "text_sent": len(sent_text)}
            rest, _, done = _stream(proc.url, {**body, "kvferry_resume": resume})
            assert done and sent_text + "".join(rest) == whole, f"cut after chunk {cut}"
        bad = httpx.post(f"{proc.url}/v1/completions", timeout=30,
                         json={**body, "kvferry_resume": {"token_ids": ids[0], "text_sent": 10**6}})
        assert bad.status_code == 400 and "text_sent" in bad.text


def _serving(decodes: list[Proc]) -> Proc:
    """The D that runs the stream now."""
    def running_on() -> Proc | None:
        for d in decodes:
            with_state = httpx.get(f"{d.url}/debug/state", timeout=10).json()
            if with_state.get("requests_by_status", {}).get("RUNNING"):
                return d
        return None
    return wait_until(running_on, 30, "a D running the stream")


@pytest.mark.timeout(300)
def test_proxy_resumes_a_stream_whose_d_is_killed_mid_stream() -> None:
    p = serve(None, "--role", "prefill", "--bootstrap-port", str(free_port()), *COMMON)
    ports = [free_port(), free_port()]
    decodes = [serve(port, "--role", "decode", *COMMON) for port in ports]
    proxy_port = free_port()
    proxy = Proc(["proxy", "--port", str(proxy_port), "--prefill", p.url, "--decode", decodes[0].url,
                  "--decode", decodes[1].url], f"http://127.0.0.1:{proxy_port}")
    extra: list[Proc] = []
    try:
        with running(p, *decodes, proxy, timeout=60):
            for sampling in ({"temperature": 0}, {"temperature": 0.8, "seed": 7}):
                body = {"prompt": PROMPT, "max_tokens": 1500, "ignore_eos": True, **sampling}
                reference = httpx.post(f"{proxy.url}/v1/completions", json=body, timeout=120).json()
                expected = reference["choices"][0]["text"]
                texts, done = [], False
                with httpx.stream("POST", f"{proxy.url}/v1/completions", json={**body, "stream": True},
                                  timeout=120) as r:
                    lines = r.iter_lines()
                    for line in lines:
                        if line.startswith("data: "):
                            texts.append(json.loads(line[6:])["choices"][0]["text"])
                        if len(texts) >= 20:
                            break
                    victim = _serving(decodes)
                    os.kill(victim.pid, signal.SIGKILL)
                    for line in lines:
                        if line == "data: [DONE]":
                            done = True
                        elif line.startswith("data: "):
                            event = json.loads(line[6:])
                            assert "error" not in event, event
                            assert "kvferry_token_ids" not in event  # the proxy's own field stays with it
                            texts.append(event["choices"][0]["text"])
                assert done and "".join(texts) == expected, f"{sampling}: resumed text differs"
                victim.popen.wait(10)
                # Back at the same port for the next round (the proxy's probe brings it back).
                i = decodes.index(victim)
                decodes[i] = serve(ports[i], "--role", "decode", *COMMON)
                extra.append(decodes[i])
                decodes[i].wait_healthy(60)
                wait_until(lambda: not httpx.get(f"{proxy.url}/health", timeout=10).json()["ejected"], 30,
                           "the restarted D back in rotation")
            metrics = httpx.get(f"{proxy.url}/metrics", timeout=10).text
            assert 'kvferry_proxy_migrations_total{outcome="resumed"} 2.0' in metrics
    finally:
        for proc in extra:
            proc.stop()


@pytest.mark.timeout(180)
def test_a_stream_with_no_other_d_ends_with_an_error_event_and_done() -> None:
    """Nowhere to resume (the only D was killed): the client gets one error event and [DONE], never a
    stream that just stops; the proxy counts the migration it gave up."""
    p = serve(None, "--role", "prefill", "--bootstrap-port", str(free_port()), *COMMON)
    d = serve(None, "--role", "decode", *COMMON)
    proxy_port = free_port()
    proxy = Proc(["proxy", "--port", str(proxy_port), "--prefill", p.url, "--decode", d.url],
                 f"http://127.0.0.1:{proxy_port}")
    with running(p, d, proxy, timeout=60):
        body = {"prompt": PROMPT, "max_tokens": 1500, "ignore_eos": True, "temperature": 0, "stream": True}
        events, done = [], False
        with httpx.stream("POST", f"{proxy.url}/v1/completions", json=body, timeout=120) as r:
            lines = r.iter_lines()
            for line in lines:
                if line.startswith("data: "):
                    events.append(json.loads(line[6:]))
                if len(events) >= 20:
                    break
            _serving([d])
            os.kill(d.pid, signal.SIGKILL)
            for line in lines:
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    events.append(json.loads(line[6:]))
        assert done and events[-1]["error"]["type"] == "decode_died", events[-1]
        metrics = httpx.get(f"{proxy.url}/metrics", timeout=10).text
        assert 'kvferry_proxy_migrations_total{outcome="gave_up"} 1.0' in metrics
