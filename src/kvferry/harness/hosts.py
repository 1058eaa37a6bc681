"""Several "hosts" on one machine: network namespaces on a Linux bridge, each with its own firewall. The
bridge lives in a namespace of its own, so the machine's own network is untouched. Needs root, `ip` and
`iptables`."""

from __future__ import annotations

import contextlib
import ctypes
import os
import subprocess
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from kvferry.harness.network import InNamespace, _run

_CLONE_NEWNET = 0x40000000


def _setns(fd: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, _CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


@contextlib.contextmanager
def inside(ns: str) -> Iterator[None]:
    """The calling thread in network namespace `ns` until the block ends: sockets it (or threads it starts)
    opens meanwhile live there; other threads are unaffected."""
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        target = os.open(f"/run/netns/{ns}", os.O_RDONLY)
        try:
            _setns(target)
        finally:
            os.close(target)
        try:
            yield
        finally:
            _setns(own)
    finally:
        os.close(own)


@dataclass(frozen=True)
class Allow:
    """One opening in a host's firewall: TCP to `port` from the addresses in `source` (a CIDR)."""

    port: int
    source: str
    why: str = ""


def firewall_commands(allows: Sequence[Allow]) -> list[list[str]]:
    """The iptables commands of one host: loopback, answers to what it dialed, each opening, then the
    default DROP (last, so that a remote shell applying them keeps its session)."""
    commands = [
        ["iptables", "-A", "INPUT", "-i", "lo", "-j", "ACCEPT"],
        ["iptables", "-A", "INPUT", "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT"],
    ]
    commands += [["iptables", "-A", "INPUT", "-p", "tcp", "-s", a.source, "--dport", str(a.port), "-j", "ACCEPT"]
                 for a in allows]
    commands.append(["iptables", "-P", "INPUT", "DROP"])
    return commands


@dataclass(frozen=True)
class Host(InNamespace):
    """One network namespace with address `ip` on the bridge."""

    name: str
    ns: str
    ip: str

    def output(self, *cmd: str) -> str:
        result = subprocess.run([*self.prefix, *cmd], capture_output=True, text=True, timeout=20)
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} on {self.name}: {result.stderr.strip()}")
        return result.stdout

    def firewall(self, allows: Sequence[Allow]) -> None:
        for command in firewall_commands(allows):
            self.exec(*command)


@dataclass
class HostNetwork:
    """Hosts on one bridge; `close` deletes every namespace (with every veth and the bridge), after killing
    any process still inside one (only ours can be)."""

    tag: str
    prefix_len: int
    bridge_ns: str
    hosts: dict[str, Host] = field(default_factory=dict)

    @classmethod
    def create(cls, addresses: Mapping[str, str], prefix_len: int = 24, tag: str | None = None) -> HostNetwork:
        """One host per `name: address` (all in one /`prefix_len`); namespaces `kvf<tag>-<name>`."""
        tag = tag or str(os.getpid())
        net = cls(tag, prefix_len, f"kvf{tag}-bridge")
        for name, ip in addresses.items():
            net.hosts[name] = Host(name, f"kvf{tag}-{name}", ip)
        net.close()  # a leftover of an earlier run with the same tag that was killed
        try:
            _run("ip", "netns", "add", net.bridge_ns)
            bridge = Host("bridge", net.bridge_ns, "")
            bridge.exec("ip", "link", "add", "br0", "type", "bridge")
            bridge.exec("ip", "link", "set", "br0", "up")
            for i, host in enumerate(net.hosts.values()):
                _run("ip", "netns", "add", host.ns)
                port = f"port{i}"
                bridge.exec("ip", "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", host.ns)
                bridge.exec("ip", "link", "set", port, "master", "br0")
                bridge.exec("ip", "link", "set", port, "up")
                host.exec("ip", "addr", "add", f"{host.ip}/{prefix_len}", "dev", "eth0")
                host.exec("ip", "link", "set", "eth0", "up")
                host.exec("ip", "link", "set", "lo", "up")
        except BaseException:
            net.close()
            raise
        return net

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    def close(self) -> None:
        for ns in [h.ns for h in self.hosts.values()] + [self.bridge_ns]:
            with contextlib.suppress(RuntimeError, OSError, subprocess.TimeoutExpired):
                pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True,
                                      timeout=20).stdout.split()
                for pid in pids:
                    with contextlib.suppress(ProcessLookupError, ValueError):
                        os.kill(int(pid), 9)
            with contextlib.suppress(RuntimeError, OSError, subprocess.TimeoutExpired):
                _run("ip", "netns", "del", ns)
