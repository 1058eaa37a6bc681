"""Run a whole P/D system and drive it: shared by `kvferry demo` (and meant for `chaos` and `bench e2e`).

- `ManagedProcess` / `PDSystem`: start `python -m kvferry serve|proxy` on free loopback ports, wait for
  `/health`, and always stop every process by its pid (SIGTERM, then SIGKILL).
- `make_workload`: a deterministic mix of prompt lengths (byte token ids) and output lengths.
- `run_workload`: OpenAI-style completions with bounded concurrency; streaming, so TTFT is measured
  (the instance sends its response headers only once the first token exists, so TTFT is the time to
  the response headers); every outcome is classified (ok, failed with a cause, stuck, error).
- `parse_metrics` / `MetricSnapshot`: read Prometheus text.
- the colocated reference lives in `kvferry.reference` (`ReferenceWorker`), computed in a side process
  at low CPU priority while the system runs, with the same
  BLAS thread count as the instances (greedy outputs are bit-identical only for one thread count).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import IO, Any

import httpx

LOOPBACK = "127.0.0.1"
BLAS_ENV_VARS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")


# Ports handed to children are picked below Linux's ephemeral range (32768-60999 by default): a port the
# kernel gives to some bind(0) or outgoing connection meanwhile can then never collide with them.
_PORT_RANGE = (20000, 32000)
_port_rng = random.Random()


def free_port() -> int:
    """A loopback port that is free now, for a process about to be started with it."""
    for _ in range(200):
        port = _port_rng.randrange(*_PORT_RANGE)
        with socket.socket() as s:
            try:
                s.bind((LOOPBACK, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # the range is crowded: let the kernel choose
        s.bind((LOOPBACK, 0))
        return int(s.getsockname()[1])


def blas_env(threads: int) -> dict[str, str]:
    """The environment that pins every BLAS library to `threads` threads."""
    return {name: str(threads) for name in BLAS_ENV_VARS}


def default_blas_threads() -> int:
    """OPENBLAS_NUM_THREADS if the user set it, else 1 (several numpy processes share few cores)."""
    try:
        return max(1, int(os.environ.get("OPENBLAS_NUM_THREADS", "1")))
    except ValueError:
        return 1


# ---- processes ----------------------------------------------------------------------------------------
class ManagedProcess:
    """One `python -m kvferry ...` child; output goes to a temporary log file, stop() is by pid."""

    def __init__(self, name: str, args: Sequence[str], url: str, env: dict[str, str] | None = None) -> None:
        self.name = name
        self.args = list(args)
        self.url = url
        self._log: IO[bytes] = tempfile.NamedTemporaryFile(  # noqa: SIM115 (closed in stop())
            prefix=f"kvferry-{name}-", suffix=".log", delete=False
        )
        self.log_path = self._log.name
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "kvferry", *self.args],
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
        )

    @property
    def pid(self) -> int:
        return self.popen.pid

    def exited(self) -> int | None:
        return self.popen.poll()

    def healthy(self) -> bool:
        try:
            return httpx.get(f"{self.url}/health", timeout=1.0).status_code == 200
        except httpx.HTTPError:
            return False

    def output_tail(self, chars: int = 4000) -> str:
        with contextlib.suppress(OSError):
            self._log.flush()
            with open(self.log_path, "rb") as f:
                return f.read().decode(errors="replace")[-chars:]
        return ""

    def terminate(self) -> None:
        """Ask the process to exit (SIGTERM; SIGCONT first in case it was stopped)."""
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGCONT)
                os.kill(self.pid, signal.SIGTERM)

    def stop(self, keep_log: bool = False) -> None:
        """Terminate, wait up to 10 s, then SIGKILL; always by this process's own pid."""
        if self.popen.poll() is None:
            self.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.popen.wait(timeout=10)
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
            self.popen.wait(timeout=10)
        self._log.close()
        if not keep_log:
            with contextlib.suppress(OSError):
                os.unlink(self.log_path)


def wait_all_healthy(procs: Sequence[ManagedProcess], timeout: float) -> None:
    """Wait until every process answers /health; raise with the process's log if one exits or times out."""
    deadline = time.monotonic() + timeout
    pending = list(procs)
    while pending:
        for proc in list(pending):
            code = proc.exited()
            if code is not None:
                raise RuntimeError(
                    f"{proc.name} exited with {code} before it was healthy:\n{proc.output_tail()}"
                )
            if proc.healthy():
                pending.remove(proc)
        if not pending:
            return
        if time.monotonic() > deadline:
            names = ", ".join(p.name for p in pending)
            raise TimeoutError(f"{names} not healthy after {timeout:.0f}s:\n{pending[0].output_tail()}")
        time.sleep(0.05)


@dataclass
class PDSystemConfig:
    seed: int = 0
    policy: str = "recompute"
    faults: str = ""
    num_blocks: int = 2048
    block_size: int = 16
    p_tp: int = 1
    d_tp: int = 1
    abort_timeout: float = 10.0
    kv_load_deadline: float = 20.0
    blas_threads: int = 1
    log_level: str = "warning"
    serve_args: tuple[str, ...] = ()  # more flags for both instances
    proxy_args: tuple[str, ...] = ()  # more flags for the proxy (e.g. --retries)


def _flags(**options: object) -> list[str]:
    """`--name value` pairs; underscores in a name become dashes."""
    out: list[str] = []
    for name, value in options.items():
        out += [f"--{name.replace('_', '-')}", str(value)]
    return out


class PDSystem:
    """One prefill instance, one decode instance and the proxy, on free loopback ports.

    Use as a context manager (or call stop() in a finally): every process it started is stopped by pid,
    also when the body raises or the user presses Ctrl-C.
    """

    def __init__(self, config: PDSystemConfig) -> None:
        self.config = config
        self.procs: list[ManagedProcess] = []
        self.prefill: ManagedProcess | None = None
        self.decode: ManagedProcess | None = None
        self.proxy: ManagedProcess | None = None

    def start(self, timeout: float = 60.0) -> None:
        """Start P, D and the proxy (all at once) and wait until every one answers /health."""
        c = self.config
        env = blas_env(c.blas_threads)
        common = _flags(
            host=LOOPBACK,
            seed=c.seed,
            num_blocks=c.num_blocks,
            block_size=c.block_size,
            kv_load_failure_policy=c.policy,
            abort_timeout=c.abort_timeout,
            kv_load_deadline=c.kv_load_deadline,
            log_level=c.log_level,
        )
        if c.faults:
            common += _flags(faults=c.faults)
        common += c.serve_args
        p_port, d_port, proxy_port = free_port(), free_port(), free_port()
        p_args = _flags(role="prefill", port=p_port, tp=c.p_tp, bootstrap_port=free_port())
        self.prefill = self._spawn("prefill", ["serve", *p_args, *common], p_port, env)
        d_args = _flags(role="decode", port=d_port, tp=c.d_tp)
        self.decode = self._spawn("decode", ["serve", *d_args, *common], d_port, env)
        proxy_args = _flags(
            host=LOOPBACK,
            port=proxy_port,
            prefill=self.prefill.url,
            decode=self.decode.url,
            log_level=c.log_level,
        )
        self.proxy = self._spawn("proxy", ["proxy", *proxy_args, *c.proxy_args], proxy_port, env)
        wait_all_healthy(self.procs, timeout)

    def _spawn(self, name: str, args: list[str], port: int, env: dict[str, str]) -> ManagedProcess:
        proc = ManagedProcess(name, args, f"http://{LOOPBACK}:{port}", env)
        self.procs.append(proc)
        return proc

    def dead(self) -> list[str]:
        """Names (and exit codes) of processes that exited on their own."""
        return [f"{p.name} (exit {code})" for p in self.procs if (code := p.exited()) is not None]

    def stop(self, keep_logs: bool = False) -> None:
        for proc in reversed(self.procs):  # all at once, then wait for each
            with contextlib.suppress(Exception):
                proc.terminate()
        for proc in reversed(self.procs):
            with contextlib.suppress(Exception):
                proc.stop(keep_log=keep_logs)

    def __enter__(self) -> PDSystem:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


# ---- workload -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class WorkItem:
    index: int
    prompt: list[int]
    max_tokens: int


def make_workload(
    n: int, seed: int, max_prompt: int = 2000, max_tokens: tuple[int, int] = (8, 32), long_share: float = 0.12
) -> list[WorkItem]:
    """n requests of byte token ids, deterministic in (n, seed, ...).

    Lengths: the block edges 1, 15, 16, 17 and one `max_prompt`, then mostly short (2..128), some medium
    (129..512) and `long_share` long ones (513..max_prompt), shuffled so long prompts are spread out.
    """
    rng = random.Random(seed)
    edges = [k for k in (1, 15, 16, 17, max_prompt) if k <= max_prompt]
    lengths = edges[:n]
    while len(lengths) < n:
        draw = rng.random()
        if draw < long_share and max_prompt > 512:
            lengths.append(rng.randint(513, max_prompt))
        elif draw < long_share + 0.3 and max_prompt > 128:
            lengths.append(rng.randint(129, min(512, max_prompt)))
        else:
            lengths.append(rng.randint(min(2, max_prompt), min(128, max_prompt)))
    rng.shuffle(lengths)
    lo, hi = max_tokens
    return [
        WorkItem(i, [rng.randrange(256) for _ in range(k)], rng.randint(lo, hi))
        for i, k in enumerate(lengths)
    ]


@dataclass
class RequestResult:
    index: int
    prompt_tokens: int
    max_tokens: int
    # "pending" | "running" | "ok" | "failed" (HTTP 500 kv_load_failed) | "stuck" | "error"
    outcome: str = "pending"
    sent_at: float | None = None  # seconds since the run started
    first_token_at: float | None = None
    finished_at: float | None = None
    http_status: int | None = None
    text: str = ""
    error_type: str | None = None
    error_code: str | None = None
    error_message: str | None = None
    transfer_id: str | None = None  # the proxy's x-kvferry-transfer-id (its last attempt)

    @property
    def ttft(self) -> float | None:
        if self.sent_at is None or self.first_token_at is None or self.outcome != "ok":
            return None
        return self.first_token_at - self.sent_at

    @property
    def latency(self) -> float | None:
        if self.sent_at is None or self.finished_at is None:
            return None
        return self.finished_at - self.sent_at

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("text")
        d["ttft_s"], d["latency_s"] = self.ttft, self.latency
        return d


def _error_fields(content: bytes | str) -> tuple[str | None, str | None, str]:
    try:
        body = json.loads(content)
        error = body.get("error") if isinstance(body, dict) else None
    except ValueError:
        error = None
    if not isinstance(error, dict):
        text = content.decode(errors="replace") if isinstance(content, bytes) else content
        return None, None, text[:300]
    code = error.get("code")
    return error.get("type"), None if code in (None, "") else str(code), str(error.get("message", ""))[:300]


DONE: dict[str, Any] = {}  # what `sse_event` returns for the stream's final `data: [DONE]`


def sse_event(line: str) -> dict[str, Any] | None:
    """One line of an OpenAI completion stream: its JSON event, `DONE`, or None (not a data line)."""
    if not line.startswith("data: "):
        return None
    data = line[len("data: ") :]
    if data == "[DONE]":
        return DONE
    event: dict[str, Any] = json.loads(data)
    return event


async def run_request(
    client: httpx.AsyncClient, url: str, item: WorkItem, result: RequestResult, t0: float, timeout: float
) -> None:
    """One streaming completion; fills `result` (times relative to the monotonic `t0`)."""
    body = {
        "prompt": item.prompt,
        "max_tokens": item.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    result.outcome, result.sent_at = "running", time.monotonic() - t0
    try:
        async with asyncio.timeout(timeout):
            async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
                result.http_status = response.status_code
                result.transfer_id = response.headers.get("x-kvferry-transfer-id")
                if response.status_code != 200:
                    content = await response.aread()
                    result.error_type, result.error_code, result.error_message = _error_fields(content)
                    kv_failed = response.status_code == 500 and result.error_type == "kv_load_failed"
                    result.outcome = "failed" if kv_failed else "error"
                    return
                result.first_token_at = time.monotonic() - t0
                parts: list[str] = []
                done = False
                async for line in response.aiter_lines():
                    event = sse_event(line)
                    if event is None:
                        continue
                    if event is DONE:
                        done = True
                        break
                    if "error" in event:  # an error after the stream started
                        error = event["error"]
                        result.error_type, result.error_code = error.get("type"), error.get("code")
                        result.error_message = str(error.get("message", ""))[:300]
                        result.outcome = "error"
                        return
                    parts.append(event["choices"][0]["text"])
                result.text = "".join(parts)
                if done:
                    result.outcome = "ok"
                else:
                    result.outcome, result.error_message = "error", "stream ended without [DONE]"
    except TimeoutError:
        result.outcome, result.error_message = "stuck", f"no complete answer within {timeout:.0f}s"
    except (httpx.HTTPError, ValueError, KeyError) as exc:
        result.outcome, result.error_message = "error", repr(exc)[:300]
    finally:
        result.finished_at = time.monotonic() - t0


async def run_workload(
    url: str,
    items: Sequence[WorkItem],
    results: Sequence[RequestResult],
    t0: float,
    concurrency: int = 4,
    timeout: float = 90.0,
) -> None:
    """Send every item (at most `concurrency` in flight); `results[i]` is updated in place as it goes."""
    semaphore = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 2, max_keepalive_connections=concurrency + 2)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0), limits=limits) as client:

        async def one(item: WorkItem, result: RequestResult) -> None:
            async with semaphore:
                await run_request(client, url, item, result, t0, timeout)

        await asyncio.gather(*(one(item, result) for item, result in zip(items, results, strict=True)))


def new_results(items: Iterable[WorkItem]) -> list[RequestResult]:
    return [RequestResult(item.index, len(item.prompt), item.max_tokens) for item in items]


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100) by linear interpolation; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


# ---- metrics ------------------------------------------------------------------------------------------
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


@dataclass
class MetricSnapshot:
    """Samples of one /metrics page: name → list of (labels, value)."""

    samples: dict[str, list[tuple[dict[str, str], float]]] = field(default_factory=dict)

    def value(self, name: str, **labels: str) -> float:
        """Sum of the samples of `name` whose labels include `labels` (0 when absent)."""
        return sum(
            v
            for lab, v in self.samples.get(name, [])
            if all(lab.get(k) == want for k, want in labels.items())
        )

    def by_label(self, name: str, label: str) -> dict[str, float]:
        out: dict[str, float] = {}
        for lab, v in self.samples.get(name, []):
            if label in lab:
                out[lab[label]] = out.get(lab[label], 0.0) + v
        return out


def parse_metrics(text: str) -> MetricSnapshot:
    snap = MetricSnapshot()
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if not m:
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        labels = dict(_LABEL.findall(m.group(2) or ""))
        snap.samples.setdefault(m.group(1), []).append((labels, value))
    return snap


async def fetch_metrics(client: httpx.AsyncClient, url: str) -> MetricSnapshot:
    response = await client.get(f"{url}/metrics", timeout=5.0)
    response.raise_for_status()
    return parse_metrics(response.text)


async def fetch_state(client: httpx.AsyncClient, url: str) -> dict[str, Any]:
    response = await client.get(f"{url}/debug/state", timeout=10.0)
    response.raise_for_status()
    state: dict[str, Any] = response.json()
    return state


def wait_drained(urls: Sequence[str], timeout: float) -> list[dict[str, Any] | None]:
    """Poll /debug/state until every instance is idle (all blocks free, no pending transfers, no requests)
    or `timeout` passes; return the last states (None where an instance did not answer)."""
    deadline = time.monotonic() + timeout
    states: list[dict[str, Any] | None] = [None] * len(urls)
    while True:
        for i, url in enumerate(urls):
            try:
                states[i] = httpx.get(f"{url}/debug/state", timeout=5.0).json()
            except (httpx.HTTPError, ValueError):
                states[i] = None
        if all(s is not None and is_drained(s) for s in states) or time.monotonic() > deadline:
            return states
        time.sleep(0.2)


def is_drained(state: dict[str, Any]) -> bool:
    return bool(
        state.get("blocks_free") == state.get("blocks_total")
        and not state.get("pending_pulls")
        and not state.get("pending_sends")
        and not state.get("requests_by_status")
    )


class SystemSampler:
    """Polls /metrics and /debug/state of each instance, each on its own loop, every `interval` seconds.

    `metrics[name]` and `states[name]` are lists of (seconds since `t0`, value) of the answers that came
    back; a loop waiting on a busy engine (/debug/state runs on the engine thread) delays only itself.
    """

    def __init__(self, urls: dict[str, str], t0: float, interval: float = 0.25) -> None:
        self.urls = dict(urls)
        self.t0 = t0
        self.interval = interval
        self.metrics: dict[str, list[tuple[float, MetricSnapshot]]] = {name: [] for name in urls}
        self.states: dict[str, list[tuple[float, dict[str, Any]]]] = {name: [] for name in urls}

    def now(self) -> float:
        return time.monotonic() - self.t0

    def latest_state(self, name: str) -> tuple[float, dict[str, Any]] | None:
        series = self.states[name]
        return series[-1] if series else None

    async def poll_metrics(self, client: httpx.AsyncClient, name: str) -> bool:
        try:
            snapshot = await fetch_metrics(client, self.urls[name])
        except (httpx.HTTPError, ValueError):
            return False
        self.metrics[name].append((self.now(), snapshot))
        return True

    async def poll_state(self, client: httpx.AsyncClient, name: str) -> bool:
        asked = self.now()  # stamped when asked: the state is at least this fresh
        try:
            state = await fetch_state(client, self.urls[name])
        except (httpx.HTTPError, ValueError):
            return False
        self.states[name].append((asked, state))
        return True

    async def run(self, stop: asyncio.Event) -> None:
        """Poll until `stop` is set; every loop polls once more after that, so the end is seen."""

        async def loop(
            poll: Callable[[httpx.AsyncClient, str], Any], client: httpx.AsyncClient, name: str
        ) -> None:
            while True:
                started = time.monotonic()
                await poll(client, name)
                if stop.is_set():
                    return
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(
                        stop.wait(), max(0.0, self.interval - (time.monotonic() - started))
                    )

        async with httpx.AsyncClient(timeout=httpx.Timeout(10.0)) as client:
            await asyncio.gather(
                *(loop(self.poll_metrics, client, name) for name in self.urls),
                *(loop(self.poll_state, client, name) for name in self.urls),
            )
