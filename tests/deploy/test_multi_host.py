"""P, D and vllm-router on three "hosts": network namespaces on one Linux bridge (10.231.7.0/24, the
bridge in a namespace of its own: nothing touches the machine's own network), each with a firewall that
drops every packet in except loopback, answers to what the host dialed, and the ports docs/deploy.md's
port table opens for its role. The instances run the commands of docs/deploy.md's Kubernetes example
(`--host 0.0.0.0 --advertise-host <its address>`, fixed ports, KVFERRY_SECRET, D's --prefill-allow);
the test client runs on the router's host.

- through vllm-router (NIXL and Mooncake mode) every answer equals D's own colocated answer for the
  same prompt, and every request was pulled across hosts;
- the ports the firewall does not open are silent from the router's host;
- `kill -9` of P: a request whose pull is in flight gets D's HTTP 500 `kv_load_failed` within 1 s, a
  request in flight through the router and the next request get the router's error within 1 s;
- a P restarted at the same address and ports serves the next request, through both routers.

Root only (namespaces, iptables); skipped elsewhere with the reason, except the check that
docs/deploy.md shows exactly these commands and rules."""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvferry.harness.hosts import Allow, HostNetwork, firewall_commands, inside
from kvferry.harness.network import unavailable_reason
from kvferry.harness.processes import ManagedProcess, wait_all_healthy
from kvferry.harness.sampler import parse_metrics
from procs import wait_until
from routers.router_procs import Router, completion_text

REASON = None if (_why := unavailable_reason()) is None else f"hosts as network namespaces: {_why}"
if REASON is None and shutil.which("vllm-router") is None:
    REASON = "vllm-router is not installed (pip install -e '.[test]')"
root_only = pytest.mark.skipif(REASON is not None, reason=REASON or "")

DEPLOY_MD = Path(__file__).resolve().parents[2] / "docs" / "deploy.md"

# The addresses: one /24 on the bridge; each role's hosts in a /28 of it (what a firewall rule names).
NET = "10.231.7"
P_IP, D_IP, ROUTER_IP = f"{NET}.17", f"{NET}.33", f"{NET}.49"
P_NET, D_NET, ROUTER_NET = f"{NET}.16/28", f"{NET}.32/28", f"{NET}.48/28"
P_HTTP, BOOTSTRAP, CONTROL, DATA, D_HTTP, ROUTER_PORT, MOONCAKE_ROUTER_PORT = 8100, 8998, 8300, 8400, 8200, 8000, 8001

# docs/deploy.md's port table, as one default-DROP INPUT chain per role (tp 1: rank 0's ports only).
FIREWALL = {
    "prefill": [Allow(P_HTTP, ROUTER_NET, "the router: HTTP API"),
                Allow(BOOTSTRAP, ROUTER_NET, "the router (Mooncake mode): bootstrap /query"),
                Allow(BOOTSTRAP, D_NET, "every D: bootstrap"),
                Allow(CONTROL, D_NET, "every D: ZMQ control of rank 0")],
    "decode": [Allow(D_HTTP, ROUTER_NET, "the router: HTTP API"),
               Allow(DATA, P_NET, "every P: data plane of rank 0 (P writes into D)")],
    "router": [Allow(ROUTER_PORT, ROUTER_NET, "clients"), Allow(MOONCAKE_ROUTER_PORT, ROUTER_NET, "clients")],
}
MODEL = ["--model", "tiny", "--seed", "0", "--num-blocks", "1024"]


def prefill_args(advertise: str) -> list[str]:
    """`kvferry serve` arguments of every P (docs/deploy.md's Kubernetes example: advertise = $(POD_IP))."""
    return ["serve", "--role", "prefill", "--host", "0.0.0.0", "--advertise-host", advertise,
            "--port", str(P_HTTP), "--bootstrap-port", str(BOOTSTRAP), "--control-port", str(CONTROL),
            "--data-port", str(DATA), *MODEL]


def decode_args(advertise: str, prefill_allow: str) -> list[str]:
    return ["serve", "--role", "decode", "--host", "0.0.0.0", "--advertise-host", advertise,
            "--port", str(D_HTTP), "--data-port", str(DATA), *MODEL, "--kv-load-failure-policy", "fail",
            "--prefill-allow", prefill_allow]


def router_args(mode: str, prefill: str, decode: str) -> list[str]:
    """vllm-router's arguments. Its default health checks (every 60 s) are kept: in Kubernetes P and D
    sit behind Services, whose readiness probes take a dead pod out."""
    if mode == "nixl":
        return ["--host", "0.0.0.0", "--port", str(ROUTER_PORT), "--vllm-pd-disaggregation",
                "--policy", "round_robin", "--prefill", prefill, "--decode", decode]
    assert mode == "mooncake", mode
    # A second router on the same host: its own port and metrics port.
    return ["--host", "0.0.0.0", "--port", str(MOONCAKE_ROUTER_PORT), "--prometheus-port", "29001",
            "--vllm-pd-disaggregation", "--kv-connector", "mooncake", "--policy", "round_robin",
            "--prefill", prefill, str(BOOTSTRAP), "--decode", decode]


# ---- the hosts and the processes ---------------------------------------------------------------------


def _links() -> set[str]:
    """The interface names of this machine's own network namespace."""
    out = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, timeout=20).stdout
    return {line.split(":")[1].strip().split("@")[0] for line in out.splitlines()}


OUR_LINKS = {"br0", "eth0", "port0", "port1", "port2"}  # what HostNetwork creates, in its namespaces only


@dataclass
class Cluster:
    net: HostNetwork
    secret: str
    prefill: ManagedProcess | None = None
    decode: ManagedProcess | None = None
    routers: dict[str, Router] = field(default_factory=dict)
    stopped: list[ManagedProcess] = field(default_factory=list)

    def start_prefill(self) -> ManagedProcess:
        """P on its host, bound to 0.0.0.0 there, advertising its address (a restart reuses both)."""
        self.prefill = ManagedProcess("prefill", prefill_args(P_IP), f"http://{P_IP}:{P_HTTP}",
                                      {"KVFERRY_SECRET": self.secret}, prefix=self.net["prefill"].prefix)
        return self.prefill

    def kill_prefill(self) -> float:
        """`kill -9` of P; returns when it was sent (time.monotonic)."""
        assert self.prefill is not None
        os.kill(self.prefill.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        self.prefill.popen.wait(timeout=10)
        self.stopped.append(self.prefill)
        self.prefill = None
        return killed_at

    def stop(self) -> None:
        for r in self.routers.values():
            with contextlib.suppress(Exception):
                r.stop()
        for proc in [self.prefill, self.decode, *self.stopped]:
            if proc is not None:
                with contextlib.suppress(Exception):
                    proc.stop()


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    if REASON is not None:
        pytest.skip(REASON)
    host_links = _links()
    net = HostNetwork.create({"prefill": P_IP, "decode": D_IP, "router": ROUTER_IP}, prefix_len=24)
    c = Cluster(net, secrets.token_hex(32))
    try:
        assert not (_links() - host_links) & OUR_LINKS, "nothing may be added to this machine's own namespace"
        for name, allows in FIREWALL.items():
            net[name].firewall(allows)
        c.start_prefill()
        c.decode = ManagedProcess("decode", decode_args(D_IP, P_NET), f"http://{D_IP}:{D_HTTP}",
                                  {"KVFERRY_SECRET": c.secret}, prefix=net["decode"].prefix)
        router_bin = shutil.which("vllm-router")
        assert router_bin is not None
        with inside(net["router"].ns):
            wait_all_healthy([c.prefill, c.decode], 90)
            for mode in ("nixl", "mooncake"):
                port = ROUTER_PORT if mode == "nixl" else MOONCAKE_ROUTER_PORT
                c.routers[mode] = Router([*net["router"].prefix, router_bin,
                                          *router_args(mode, c.prefill.url, c.decode.url)],
                                         f"http://{ROUTER_IP}:{port}")
                c.routers[mode].wait_ready()
        yield c
    finally:
        c.stop()
        net.close()
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=20).stdout
    assert f"kvf{net.tag}-" not in listed
    assert not (_links() - host_links) & OUR_LINKS


@pytest.fixture()
def on_router_host(cluster: Cluster) -> Iterator[Cluster]:
    """The test body runs on the router's host: every connection it opens starts there."""
    with inside(cluster.net["router"].ns):
        yield cluster


# ---- the client ----------------------------------------------------------------------------------------

PROMPTS = ["Hello world, this is", "a", "The quick brown fox jumps over the lazy dog. " * 4, "kv" * 150]
MAX_TOKENS = 12


def complete(url: str, prompt: str, stream: bool = False, params: dict[str, Any] | None = None,
             max_tokens: int = MAX_TOKENS) -> httpx.Response:
    body: dict[str, Any] = {"model": "kvferry-tiny-llama", "prompt": prompt, "max_tokens": max_tokens,
                            "temperature": 0, "stream": stream}
    if params is not None:
        body["kv_transfer_params"] = params
    return httpx.post(f"{url}/v1/completions", json=body, timeout=60)


def chat(url: str, message: str) -> str:
    body = {"model": "kvferry-tiny-llama", "messages": [{"role": "user", "content": message}],
            "max_tokens": MAX_TOKENS, "temperature": 0}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["message"]["content"])


def metric(url: str, name: str) -> float:
    return parse_metrics(httpx.get(f"{url}/metrics", timeout=5).text).value(name)


def state(url: str) -> dict[str, Any]:
    body: dict[str, Any] = httpx.get(f"{url}/debug/state", timeout=5).json()
    return body


def colocated(decode: ManagedProcess) -> tuple[dict[str, str], dict[str, str]]:
    """D's own answers (no kv_transfer_params: D computes the prompt itself, as a colocated instance)."""
    texts = {p: completion_text(complete(decode.url, p), False) for p in PROMPTS}
    chats = {p: chat(decode.url, p) for p in PROMPTS[:2]}
    return texts, chats


def silent(host: str, port: int) -> bool:
    """No answer at all within 0.5 s (a DROP): neither a connection nor a reset."""
    with socket.socket() as s:
        s.settimeout(0.5)
        try:
            s.connect((host, port))
        except TimeoutError:
            return True
        except OSError:
            return False
    return False


class InFlight:
    """One request on a thread; `answered_at` is when its answer (or error) arrived."""

    def __init__(self, send: Callable[[], httpx.Response]) -> None:
        self.response: httpx.Response | None = None
        self.error: BaseException | None = None
        self.answered_at = 0.0
        self._send = send
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()  # started on the router's host: the thread's sockets are there too

    def _run(self) -> None:
        try:
            self.response = self._send()
        except BaseException as exc:  # reported by result()
            self.error = exc
        self.answered_at = time.monotonic()

    def result(self, timeout: float = 60) -> httpx.Response:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "the request hung"
        if self.error is not None:
            raise self.error
        assert self.response is not None
        return self.response


# Seconds of prefill on P (more than 5 s on the 2-core dev box): P is killed in the middle of it, so its
# length costs no time.
LONG_PROMPT = "y" * 10000


# ---- the tests -----------------------------------------------------------------------------------------


@root_only
def test_firewall_opens_only_the_port_table(on_router_host: Cluster) -> None:
    net = on_router_host.net
    for name, allows in FIREWALL.items():
        rules = net[name].output("iptables", "-S", "INPUT").splitlines()
        expected = ["-P INPUT DROP", "-A INPUT -i lo -j ACCEPT",
                    "-A INPUT -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT",
                    *(f"-A INPUT -s {a.source} -p tcp -m tcp --dport {a.port} -j ACCEPT" for a in allows)]
        assert rules == expected, (name, rules)
    # From the router's host: the HTTP APIs answer; P's control and D's data plane are dropped.
    assert httpx.get(f"http://{P_IP}:{P_HTTP}/health", timeout=5).status_code == 200
    assert httpx.get(f"http://{D_IP}:{D_HTTP}/health", timeout=5).status_code == 200
    assert silent(P_IP, CONTROL) and silent(D_IP, DATA) and silent(P_IP, DATA)
    # What each instance binds and advertises.
    for url, control, data in ((f"http://{P_IP}:{P_HTTP}", [f"tcp://{P_IP}:{CONTROL}"], [f"{P_IP}:{DATA}"]),
                               (f"http://{D_IP}:{D_HTTP}", [], [f"{D_IP}:{DATA}"])):
        s = state(url)["connector"]
        assert s["control_addrs"] == control and s["transfer_addrs"] == data, s


@root_only
@pytest.mark.parametrize("mode", ["nixl", "mooncake"])
def test_router_answers_equal_colocated_across_hosts(on_router_host: Cluster, mode: str) -> None:
    c = on_router_host
    assert c.prefill is not None and c.decode is not None
    texts, chats = colocated(c.decode)
    router = c.routers[mode]
    before = metric(c.decode.url, "kvferry_kv_transfers_total")
    sent = 0
    for stream in (False, True):
        for prompt in PROMPTS:
            assert completion_text(complete(router.url, prompt, stream), stream) == texts[prompt], (mode, prompt, stream)
            sent += 1
    for message, answer in chats.items():
        assert chat(router.url, message) == answer, (mode, message)
        sent += 1
    # Every request was pulled by D from P, across the bridge (none computed in full on D).
    assert metric(c.decode.url, "kvferry_kv_transfers_total") - before == sent


@root_only
def test_kill_prefill_errors_within_a_second_and_a_restarted_prefill_serves(on_router_host: Cluster) -> None:
    c = on_router_host
    assert c.prefill is not None and c.decode is not None
    p_url, d_url = c.prefill.url, c.decode.url
    texts, _ = colocated(c.decode)
    nixl, mooncake = c.routers["nixl"].url, c.routers["mooncake"].url
    figures: dict[str, float] = {}

    # 1. A pull in flight: P and D asked at once (kvferry's own protocol, as `kvferry proxy` does); D's pull
    #    waits at P for a long prefill. kill -9 P: D answers 500 kv_load_failed within 1 s.
    engine_id = httpx.get(f"{p_url}/health", timeout=5).json()["engine_id"]
    tid = f"xfer-kill-{secrets.token_hex(4)}"
    beats = metric(d_url, "kvferry_heartbeat_rtt_seconds_count")
    on_p = InFlight(lambda: complete(p_url, LONG_PROMPT, params={"do_remote_decode": True, "transfer_id": tid},
                                     max_tokens=1))
    on_d = InFlight(lambda: complete(d_url, LONG_PROMPT, max_tokens=4, params={
        "do_remote_prefill": True, "transfer_id": tid, "remote_engine_id": engine_id,
        "remote_bootstrap_addr": f"{P_IP}:{BOOTSTRAP}"}))
    # D's pull is at P once P acked one of D's heartbeats for it; P is still prefilling.
    wait_until(lambda: state(d_url)["connector"]["pending_pulls"] >= 1
               and metric(d_url, "kvferry_heartbeat_rtt_seconds_count") > beats, 30, "D's pull to reach P")
    assert state(p_url)["requests_by_status"].get("RUNNING") == 1, "P finished its prefill before the kill"
    killed_at = c.kill_prefill()
    r = on_d.result()
    figures["in-flight pull: kill -9 → D's 500"] = on_d.answered_at - killed_at
    assert r.status_code == 500, r.text
    error = r.json()["error"]
    assert error["type"] == "kv_load_failed", error
    assert on_d.answered_at - killed_at < 1.0, figures
    cause = str(error["code"])
    assert cause == "peer_dead", error  # the connection to P closed: seen at once, no timeout involved
    with contextlib.suppress(httpx.HTTPError):
        on_p.result()

    # 2. The next request through each router, P dead: the router's error within 1 s.
    for mode, url in (("nixl", nixl), ("mooncake", mooncake)):
        t0 = time.monotonic()
        r = complete(url, PROMPTS[0])
        figures[f"next request, {mode}: sent → router's error"] = time.monotonic() - t0
        assert r.status_code >= 500, r.text
        assert time.monotonic() - t0 < 1.0, figures

    # 3. P restarted at the same address and ports: the next request through each router is served.
    c.start_prefill()
    wait_all_healthy([c.prefill], 90)
    for url in (nixl, mooncake):
        assert completion_text(complete(url, PROMPTS[2]), False) == texts[PROMPTS[2]]

    # 4. A request in flight through vllm-router (NIXL: P first, then D), P killed in its prefill: the
    #    router's error within 1 s; the next P at the same address serves again.
    assert c.prefill is not None
    p_url = c.prefill.url
    through = InFlight(lambda: complete(nixl, LONG_PROMPT, max_tokens=2))
    wait_until(lambda: state(p_url)["requests_by_status"].get("RUNNING") == 1, 30, "P to prefill the request")
    killed_at = c.kill_prefill()
    r = through.result()
    figures["in flight through vllm-router: kill -9 → router's error"] = through.answered_at - killed_at
    assert r.status_code >= 500, r.text
    assert through.answered_at - killed_at < 1.0, figures
    c.start_prefill()
    wait_all_healthy([c.prefill], 90)
    for url in (nixl, mooncake):
        for prompt in PROMPTS[:2]:
            assert completion_text(complete(url, prompt), False) == texts[prompt]

    # Nothing left behind: neither side holds a block or a request.
    def idle() -> bool:
        states = [state(u) for u in (c.prefill.url, d_url)] if c.prefill else []
        return bool(states) and all(s["blocks_free"] == s["blocks_total"] and not s["requests_by_status"]
                                    for s in states)

    wait_until(idle, 20, "P and D to hold nothing")
    print(f"\nmulti-host kill -9 of P (D's cause: {cause}): "
          + "; ".join(f"{k} {v * 1000:.0f} ms" for k, v in figures.items()))


# ---- docs/deploy.md shows exactly these commands -------------------------------------------------------


def _yaml_documents() -> list[dict[str, Any]]:
    yaml = pytest.importorskip("yaml")
    blocks = re.findall(r"```yaml\n(.*?)```", DEPLOY_MD.read_text(), re.S)
    assert blocks, "docs/deploy.md has no yaml block"
    return [doc for block in blocks for doc in yaml.safe_load_all(block) if doc]


def _containers(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out = {}
    for doc in docs:
        if doc.get("kind") == "Deployment":
            for container in doc["spec"]["template"]["spec"]["containers"]:
                out[doc["metadata"]["name"]] = container
    return out


def test_deploy_md_shows_the_tested_commands_and_rules() -> None:
    text = DEPLOY_MD.read_text()
    for allows in FIREWALL.values():
        for command in firewall_commands(allows):
            assert " ".join(command) in text, " ".join(command)
    containers = _containers(_yaml_documents())
    p, d, router = containers["kvferry-prefill"], containers["kvferry-decode"], containers["vllm-router"]
    assert [*p["command"], *p["args"]] == ["kvferry", *prefill_args("$(POD_IP)")]
    assert [*d["command"], *d["args"]][:-1] == ["kvferry", *decode_args("$(POD_IP)", "")][:-1]
    assert [*router["command"], *router["args"]] == [
        "vllm-router", *router_args("nixl", f"http://kvferry-prefill:{P_HTTP}", f"http://kvferry-decode:{D_HTTP}")]
    for container in (p, d):
        env = {e["name"]: e["valueFrom"] for e in container["env"]}
        assert env["POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
        assert "secretKeyRef" in env["KVFERRY_SECRET"]
