"""Network faults between P and D: P in a private network namespace joined to the host's by a veth pair,
so every byte between P and the others crosses the pair, where loss, partitions and rate caps apply.
Needs root, `ip`, `iptables` and `tc`."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from dataclasses import dataclass

TOOLS = ("ip", "iptables", "tc")


def unavailable_reason() -> str | None:
    """Why network faults cannot run here, or None when they can."""
    if os.geteuid() != 0:
        return "network faults need root (network namespaces, iptables, tc)"
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if missing:
        return f"network faults need {', '.join(missing)} (apt-get install -y iproute2 iptables)"
    try:
        probe = subprocess.run(["unshare", "--net", "iptables", "-L", "-n"], capture_output=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"cannot enter a network namespace: {exc!r}"
    if probe.returncode != 0:
        return f"iptables does not work in a network namespace: {probe.stderr.decode(errors='replace')[:200]}"
    return None


def _run(*cmd: str) -> None:
    result = subprocess.run(cmd, capture_output=True, timeout=20)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {result.stderr.decode(errors='replace').strip()}")


class InNamespace:
    """Runs commands inside network namespace `ns`."""

    ns: str

    @property
    def prefix(self) -> list[str]:  # `ip netns exec` keeps the pid
        return ["ip", "netns", "exec", self.ns]

    def exec(self, *cmd: str) -> None:
        _run(*self.prefix, *cmd)


@dataclass
class VethLink(InNamespace):
    """Namespace `ns` holding the `inner` end (address `inner_ip`); the host holds `outer` (`outer_ip`)."""

    ns: str
    outer: str
    inner: str
    outer_ip: str
    inner_ip: str

    @classmethod
    def create(cls, tag: int | None = None) -> VethLink:
        tag = os.getpid() % 60000 if tag is None else tag
        subnet = f"10.{213 + tag // 16384 % 40}.{tag // 64 % 256}.{tag % 64 * 4}"
        base = subnet.rsplit(".", 1)
        link = cls(f"kvferry-{tag}", f"kvfh{tag}", f"kvfp{tag}", f"{base[0]}.{int(base[1]) + 1}",
                   f"{base[0]}.{int(base[1]) + 2}")
        link.close()  # a leftover of an earlier run that was killed
        try:
            _run("ip", "netns", "add", link.ns)
            _run("ip", "link", "add", link.outer, "type", "veth", "peer", "name", link.inner)
            _run("ip", "link", "set", link.inner, "netns", link.ns)
            _run("ip", "addr", "add", f"{link.outer_ip}/30", "dev", link.outer)
            _run("ip", "link", "set", link.outer, "up")
            link.exec("ip", "addr", "add", f"{link.inner_ip}/30", "dev", link.inner)
            link.exec("ip", "link", "set", link.inner, "up")
            link.exec("ip", "link", "set", "lo", "up")
        except BaseException:
            link.close()
            raise
        return link

    def loss(self, probability: float) -> None:
        """Drop this share of packets, each way, at random."""
        for chain, flag in (("INPUT", "-i"), ("OUTPUT", "-o")):
            self.exec("iptables", "-A", chain, flag, self.inner, "-m", "statistic", "--mode", "random",
                      "--probability", f"{probability:.4f}", "-j", "DROP")

    def partition(self) -> None:
        """Every packet across the pair is dropped silently (no reset, no unreachable)."""
        for chain, flag in (("INPUT", "-i"), ("OUTPUT", "-o")):
            self.exec("iptables", "-I", chain, flag, self.inner, "-j", "DROP")

    def cap(self, bytes_per_s: int) -> None:
        """A token-bucket rate limit on both ends' egress."""
        rate = f"{bytes_per_s * 8 // 1000}kbit"
        self.exec("tc", "qdisc", "replace", "dev", self.inner, "root", "tbf", "rate", rate, "burst", "64kb",
                  "latency", "500ms")
        _run("tc", "qdisc", "replace", "dev", self.outer, "root", "tbf", "rate", rate, "burst", "64kb",
             "latency", "500ms")

    def heal(self) -> None:
        self.exec("iptables", "-F", "INPUT")
        self.exec("iptables", "-F", "OUTPUT")
        with contextlib.suppress(RuntimeError):
            self.exec("tc", "qdisc", "del", "dev", self.inner, "root")
        with contextlib.suppress(RuntimeError):
            _run("tc", "qdisc", "del", "dev", self.outer, "root")

    def close(self) -> None:
        """Delete the namespace and the host's veth end (either may be gone already)."""
        with contextlib.suppress(RuntimeError, OSError, subprocess.TimeoutExpired):
            _run("ip", "netns", "del", self.ns)
        with contextlib.suppress(RuntimeError, OSError, subprocess.TimeoutExpired):
            _run("ip", "link", "del", self.outer)
