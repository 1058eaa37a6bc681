"""The watchdog of `kvferry bench vllm --soak`: a request with no answer for STALL_S while P's and D's
/health answer is a stall, and its evidence is taken while it lasts: threads and wait channels, /metrics,
a direct probe of P, a stack dump (SIGUSR1 via the sitecustomize the bench installs: vLLM has no handler
and the default action would kill the server) and the logs' tails."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from kvferry.bench.vllm.client import complete
from kvferry.bench.vllm.servers import ServerGroup, group_pids

STALL_S = 60.0
CHECK_EVERY_S = 5.0
# Many requests pass STALL_S at once on a loaded box and a capture costs CPU: later ones share the latest.
EVIDENCE_EVERY_S = 120.0
LOG_TAIL = 60
METRICS = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
           "vllm:num_preemptions", "kvferry_")
SITECUSTOMIZE = "import faulthandler, signal\nfaulthandler.register(signal.SIGUSR1, all_threads=True)\n"


def write_sitecustomize(directory: Path) -> Path:
    """A directory for the servers' PYTHONPATH: their processes dump every thread's stack on SIGUSR1."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "sitecustomize.py").write_text(SITECUSTOMIZE)
    return directory


@dataclass
class InFlight:
    number: int
    began: float
    prompt: str
    flagged: bool = False


@dataclass
class Stall:
    """One request past STALL_S with both servers healthy, and what was seen then."""

    number: int
    seen_after_s: float
    evidence: str  # the file holding the evidence
    summary: str  # a line of it for the table
    outcome: str = "still waiting at the end"
    latency_s: float | None = None


def _read(path: str) -> str:
    try:
        return Path(path).read_text(errors="replace").strip()
    except OSError:
        return "?"


def threads_of(leader: int) -> list[str]:
    """Each process of the group, and its threads by (name, state, kernel wait channel)."""
    lines = []
    for pid in group_pids(leader):
        cmd = _read(f"/proc/{pid}/cmdline").replace("\0", " ")[:120]
        kinds: Counter[str] = Counter()
        with contextlib.suppress(OSError):
            for tid in os.listdir(f"/proc/{pid}/task"):
                stat = _read(f"/proc/{pid}/task/{tid}/stat")
                comm = stat[stat.find("(") + 1:stat.rfind(")")]
                state = stat.rsplit(")", 1)[-1].split()[0] if ")" in stat else "?"
                kinds[f"{comm} {state} {_read(f'/proc/{pid}/task/{tid}/wchan') or '-'}"] += 1
        lines.append(f"  pid {pid} {cmd}")
        lines += [f"    {n} x {kind}" for kind, n in sorted(kinds.items())]
    return lines


def _python_pids(leader: int) -> list[int]:
    pids = []
    for pid in group_pids(leader):
        with contextlib.suppress(OSError):
            if "python" in os.path.basename(os.readlink(f"/proc/{pid}/exe")):
                pids.append(pid)
    return pids


def metrics_of(server: ServerGroup) -> dict[str, float]:
    try:
        every = server.metrics(timeout=10)
    except httpx.HTTPError as exc:
        return {f"/metrics failed: {type(exc).__name__}": 0.0}
    return {k: v for k, v in every.items() if k.startswith(METRICS)}


class Watchdog:

    def __init__(self, p: ServerGroup, d: ServerGroup, proxy: ServerGroup, model: str, evidence_dir: Path) -> None:
        self.p, self.d, self.proxy, self.model = p, d, proxy, model
        self.evidence_dir = evidence_dir
        self.in_flight: dict[int, InFlight] = {}
        self.stalls: dict[int, Stall] = {}
        self.ended: dict[int, tuple[str, float]] = {}  # request → (outcome, seconds), once it is answered
        self.unhealthy: list[str] = []  # requests past STALL_S while a server's /health failed
        self.lock = threading.Lock()
        self._last: tuple[float, Path, str] | None = None  # the latest capture: when, its file, its summary
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="soak-watchdog", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=120)

    def begin(self, number: int, text: str) -> None:
        with self.lock:
            self.in_flight[number] = InFlight(number, time.monotonic(), text)

    def end(self, number: int, outcome: str, latency_s: float) -> None:
        with self.lock:
            if self.in_flight.pop(number).flagged:  # a capture may still be running: its stall joins later
                self.ended[number] = (outcome, latency_s)

    def _loop(self) -> None:
        while not self._stop.wait(CHECK_EVERY_S):
            now = time.monotonic()
            with self.lock:
                late = [r for r in self.in_flight.values() if not r.flagged and now - r.began > STALL_S]
                for r in late:
                    r.flagged = True
            if not late:
                continue
            up = {s.name: s.healthy() for s in (self.p, self.d)}
            if not all(up.values()):
                self.unhealthy += [f"#{r.number} ({', '.join(n for n, ok in up.items() if not ok)} unhealthy)"
                                   for r in late]
                continue
            if self._last is None or now - self._last[0] > EVIDENCE_EVERY_S:
                self._last = (now, *self._evidence(late, now))
            _, path, summary = self._last
            with self.lock:
                for r in late:
                    self.stalls[r.number] = Stall(r.number, now - r.began, str(path), summary)

    def outcomes(self) -> list[Stall]:
        """The stalls, each with how it ended (after the load: every request answered or timed out)."""
        with self.lock:
            for number, stall in self.stalls.items():
                if number in self.ended:
                    stall.outcome, stall.latency_s = self.ended[number]
            return list(self.stalls.values())

    def _evidence(self, late: list[InFlight], now: float) -> tuple[Path, str]:
        """Everything seen while the stall lasts, in one file, and a one-line summary."""
        out = [f"stalled requests: {', '.join(f'#{r.number} ({now - r.began:.0f}s)' for r in late)}",
               f"in flight: {len(self.in_flight)}; load average: {_read('/proc/loadavg')}"]
        got: dict[str, dict[str, float]] = {}
        for server in (self.p, self.d):
            got[server.name] = metrics_of(server)
            out.append(f"{server.name} /metrics:")
            out += [f"  {k} {v:g}" for k, v in sorted(got[server.name].items())]
        began = time.monotonic()
        try:
            r = complete(self.p.url, self.model, "Direct probe: " + late[0].prompt[:200], 1, 30.0)
            direct = f"P direct 1-token completion: HTTP {r.status_code} in {time.monotonic() - began:.1f}s"
        except httpx.HTTPError as exc:
            direct = f"P direct 1-token completion: {type(exc).__name__} after {time.monotonic() - began:.1f}s"
        out.append(direct)
        for server in (self.p, self.d, self.proxy):
            out.append(f"{server.name} threads (name state wchan):")
            out += threads_of(server.pid)
        marks = {s.name: s.log.stat().st_size for s in (self.p, self.d)}
        for server in (self.p, self.d):
            for pid in _python_pids(server.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGUSR1)
        time.sleep(3)
        for server in (self.p, self.d, self.proxy):
            data = server.log.read_bytes()  # split at the byte offset taken before the signal
            mark = marks.get(server.name, len(data))
            tail = data[:mark].decode(errors="replace").splitlines()[-LOG_TAIL:]
            out += [f"{server.name} log, last {len(tail)} lines before the dump:", *(f"  {x}" for x in tail)]
            if server.name in marks:
                out += [f"{server.name} stack dump (SIGUSR1):", data[mark:].decode(errors="replace")]
        path = self.evidence_dir / f"stall-{late[0].number}.txt"
        path.write_text("\n".join(out) + "\n")
        queues = "; ".join(f"{name} running {_first(m, 'vllm:num_requests_running')} waiting "
                           f"{_first(m, 'vllm:num_requests_waiting')} kv {_first(m, 'vllm:kv_cache_usage_perc')}"
                           for name, m in got.items())
        return path, f"{queues}; {direct}"


def _first(metrics: dict[str, Any], name: str) -> str:
    values = [v for k, v in metrics.items() if k.split("{", 1)[0] == name]
    return f"{sum(values):g}" if values else "?"
