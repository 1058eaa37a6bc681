"""The network rig of `kvferry bench vllm --faults`: one connector's P's and D's on `harness.hosts`, the
faults on P's link, and what the servers hold and use."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from kvferry.bench.vllm.fault_cells import POLICIES, SHORT_LEASE_S
from kvferry.bench.vllm.servers import (
    COMMON,
    NIXL_CONFIG,
    ServerGroup,
    group_pids,
    kvferry_kv,
    metric_sum,
    nixl_env,
)
from kvferry.bench.vllm.systems import TP2_ARGS, TP2_ENV
from kvferry.harness.processes import free_port


class Pair:
    """One connector's servers on the host network: P in namespace p, a second P in p2 (no fault acts on
    it, so a retry has somewhere to go), the fail and recompute D's in d; with `p_tp` 2, P alone at TP 2."""

    def __init__(self, kind: str, net: Any, vllm: str, model: str, tmp: Path, p_tp: int = 1) -> None:
        self.kind, self.net, self.vllm, self.model, self.tmp, self.p_tp = kind, net, vllm, model, tmp, p_tp
        self.p_port, self.bootstrap = free_port(), free_port()
        self.p: Any = None
        self.p2: Any = None
        self.d: dict[str, Any] = {}
        self.p_short = False
        self.data_ports = {policy: free_port() for policy in POLICIES}  # kvferry D's: the corrupt cell's match

    def _serve(self, name: str, host: Any, port: int, config: dict[str, Any], env: dict[str, str],
               blocks: int, tp: int = 1) -> Any:
        common = [host.ip if a == "127.0.0.1" else a for a in COMMON]
        argv = [*host.prefix, self.vllm, "serve", self.model, "--port", str(port), *common,
                *(TP2_ARGS if tp == 2 else ()), "--num-gpu-blocks-override", str(blocks),
                "--kv-transfer-config", json.dumps(config)]
        return ServerGroup(f"{self.kind}-{name}", argv, port, {**env, **(TP2_ENV if tp == 2 else {})}, host=host.ip)

    def data_plane(self) -> list[str]:
        """nft match for the KV bytes P sends D: to kvferry D's data ports; from UCX's ports on P (D's
        UCX endpoint connects to P's listener, P answers D's reads on that connection)."""
        if self.kind == "kvferry":
            return ["tcp", "dport", "{ " + ", ".join(str(p) for p in self.data_ports.values()) + " }"]
        return ["tcp", "sport", "21000-21999"]

    def _nixl_env(self, host: Any, ports: str) -> dict[str, str]:
        return {**nixl_env(host.ip, "eth0", ports), "UCX_TLS": "tcp"}

    def _prefill(self, name: str, host: Any, port: int, short: bool) -> Any:
        """A P (24 blocks, so that the lease_out filler reuses freed ones); `short`: a 6 s lease."""
        if self.kind == "kvferry":
            extra: dict[str, Any] = {"engine_id": f"bench-{name}", "host": host.ip, "bootstrap_port": self.bootstrap}
            if short:
                extra["abort_timeout_s"] = SHORT_LEASE_S
            config = kvferry_kv("kv_producer", None, **extra)
            env: dict[str, str] = {}
        else:
            lease = {"kv_lease_duration": SHORT_LEASE_S} if short else {}
            config = {**NIXL_CONFIG, "kv_connector_extra_config": lease}
            env = self._nixl_env(host, "21000-21999")
        return self._serve(name, host, port, config, env, 24, self.p_tp if name == "prefill" else 1)

    def start_p(self, short: bool = False) -> Any:
        self.p, self.p_short = self._prefill("prefill", self.net["p"], self.p_port, short), short
        return self.p

    def start_p2(self) -> Any:
        self.p2 = self._prefill("prefill2", self.net["p2"], free_port(), False)
        return self.p2

    def reference(self) -> Any:
        """The server whose plain answers are the reference: one at D's TP (TP changes float32 sums)."""
        return self.p2 if self.p_tp == 2 else self.p

    def prefills(self) -> list[Any]:  # the faulted one first
        return [p for p in (self.p, self.p2) if p is not None]

    def start_d(self, policy: str) -> Any:
        host = self.net["d"]
        if self.kind == "kvferry":
            config = kvferry_kv("kv_consumer", policy, host=host.ip, data_port=self.data_ports[policy],
                                prefill_allow=[self.net["p"].ip, self.net["p2"].ip])
            env: dict[str, str] = {}
        else:
            config = {**NIXL_CONFIG, "kv_load_failure_policy": policy}
            env = self._nixl_env(host, "22000-22499" if policy == "fail" else "22500-22999")
        d = self._serve(f"decode-{policy}", host, free_port(), config, env, 64)
        self.d[policy] = d
        return d

    def servers(self) -> list[Any]:
        return [s for s in (self.p, self.p2, *self.d.values()) if s is not None]

    def stop(self) -> None:
        for server in self.servers():
            with contextlib.suppress(Exception):
                server.stop()


def worker_pid(server: Any, rank: int) -> int:
    """The pid of a TP server's worker `rank` (vLLM titles it `VLLM::Worker_TP<rank>`) in its process group."""
    for pid in group_pids(server.pid):
        with contextlib.suppress(OSError):
            if Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0] == f"VLLM::Worker_TP{rank}".encode():
                return pid
    raise RuntimeError(f"{server.name} has no TP worker {rank}")


def group_cpu_seconds(pgid: int) -> float:
    """CPU seconds (user + system) of every live process in a process group."""
    total = 0
    for pid in group_pids(pgid):
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # fields after the name: ... utime(11) stime(12)
    return total / os.sysconf("SC_CLK_TCK")


def idle_cpu(servers: list[Any], seconds: float = 5.0) -> float:
    """Cores the servers use together while idle (busy polling shows here), over the wall time of both /proc
    scans too: on a loaded box a scan takes seconds."""
    began = time.monotonic()
    before = sum(group_cpu_seconds(s.popen.pid) for s in servers)
    time.sleep(seconds)
    after = sum(group_cpu_seconds(s.popen.pid) for s in servers)
    return (after - before) / (time.monotonic() - began)


def wait_healthy(servers: list[Any], timeout: float) -> None:
    for server in servers:
        server.wait_healthy(timeout)


def held(server: Any) -> dict[str, float] | None:
    try:
        m = server.metrics(timeout=3)
    except httpx.HTTPError:
        return None
    return {"running": metric_sum(m, "vllm:num_requests_running"), "waiting": metric_sum(m, "vllm:num_requests_waiting"),
            "kv_usage": round(metric_sum(m, "vllm:kv_cache_usage_perc"), 4)}


# Undoing a fault is best effort: on an overloaded box even `ip netns exec iptables` can time out.
_UNDO_ERRORS = (RuntimeError, subprocess.TimeoutExpired)


class Link:
    """Faults on P's side of the bridge: rate cap, partition from D, a mangled packet."""

    def __init__(self, p_host: Any, d_ip: str) -> None:
        self.p, self.d_ip = p_host, d_ip

    def cap(self, mbit: int) -> None:
        # A short queue (20 ms): a long one holds a whole read before the fault lands, and a SIGSTOP or a
        # DROP rule (OUTPUT runs before the qdisc) then pauses nothing.
        self.p.exec("tc", "qdisc", "replace", "dev", "eth0", "root", "tbf", "rate", f"{mbit}mbit", "burst", "256kb",
                    "latency", "20ms")

    def uncap(self) -> None:
        with contextlib.suppress(*_UNDO_ERRORS):
            self.p.exec("tc", "qdisc", "del", "dev", "eth0", "root")

    def partition(self) -> None:
        """Every packet between P and D dropped silently; the client still reaches both."""
        self.p.exec("iptables", "-I", "INPUT", "-s", self.d_ip, "-j", "DROP")
        self.p.exec("iptables", "-I", "OUTPUT", "-d", self.d_ip, "-j", "DROP")

    def heal(self) -> None:
        with contextlib.suppress(*_UNDO_ERRORS):
            self.p.exec("iptables", "-D", "INPUT", "-s", self.d_ip, "-j", "DROP")
        with contextlib.suppress(*_UNDO_ERRORS):
            self.p.exec("iptables", "-D", "OUTPUT", "-d", self.d_ip, "-j", "DROP")

    def corrupt_next(self, data_plane: list[str]) -> None:
        """nftables rewrites 4 bytes 2,000 bytes into the next KV packet over 4,000 bytes P sends D, once,
        with TCP's checksum fixed: what a flipped bit in a switch's or host's memory looks like to D."""
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
        with contextlib.suppress(*_UNDO_ERRORS):
            self.p.exec("nft", "delete", "table", "inet", "kvferry_fault")


class FreedWatch:
    """Seconds from `started` until each side holds 0 KV blocks, a thread per side so that a stopped P does
    not delay D's reading; None: not within `cap`."""

    def __init__(self, sides: dict[str, list[Any]], started: float, dead: set[str], cap: float) -> None:
        self.started, self.deadline = started, started + cap
        self.out: dict[str, float | str | None] = {who: "killed" for who in dead}
        self.threads = [threading.Thread(target=self._poll, args=(who, servers), daemon=True)
                        for who, servers in sides.items() if who not in dead]
        for thread in self.threads:
            thread.start()

    def _poll(self, who: str, servers: list[Any]) -> None:
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

