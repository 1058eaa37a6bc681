"""The pure part of `kvferry bench vllm --faults` (no I/O, unit-tested in tests/bench/test_vllm_faults.py):
the faults and their order, the caps on every wait, what a cell records, how an outcome ranks, which
connector did better in a cell, the client's retry rule, and the table."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvferry.serving.proxy import RETRY_BACKOFF_S

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
    ("kill_p_rank", "kill -9 of P's TP rank 1 worker alone while D reads (P at TP 2 only)"),
    ("p_restarted", "P restarted at the same address: its first request"),
    ("kill_p_answered", "kill -9 P after its answer, before D reads"),
    ("lease_out", "P's hold ends before D reads (short lease; P serves another prompt meanwhile)"),
)
FAULT_KEYS = tuple(k for k, _ in FAULTS)
QUICK_FAULTS = ("clean", "kill_p_reading", "p_restarted")
TP_FAULTS = ("kill_p_rank",)  # run only when P is at TP 2 (KVFERRY_BENCH_P_TP=2)
PAUSE_S = 10.0  # SIGSTOP and partition length
SHORT_LEASE_S = 6  # lease_out: kvferry abort_timeout_s, NIXL kv_lease_duration
LATE_D_S = 10.0  # lease_out: D's request this long after P's answer
RETRIES = 2  # KV-load failures before the first token retried per request (`kvferry proxy --retries`)


@dataclass(frozen=True)
class Caps:
    """Every wait of the matrix is bounded by one of these (seconds)."""

    answer: float = 120.0  # a client's request to D (NIXL over TCP resumes tens of seconds after a stall)
    freed: float = 150.0  # P or D back to 0 KV blocks after the fault or D's request (NIXL's lease: 30 s)
    reading: float = 60.0  # both D's waiting for remote KV
    start: float = 400.0  # a vllm serve to be healthy (on a few loaded cores)


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
    tries: int = 1  # prefill + decode rounds the client made (a retried KV-load failure adds one)


# ---- the client's retry rule (the same for both connectors) -----------------------------------------
def retryable(status: int | None, body: Any) -> bool:
    """D's answer is a KV-load failure before the first token: vLLM answers a request its scheduler finished
    with an error (under policy `fail`, a failed remote load) with HTTP 500, type `InternalServerError`."""
    if status != 500 or not isinstance(body, dict) or not isinstance(body.get("error"), dict):
        return False
    return bool(body["error"].get("type") == "InternalServerError")


def next_prefill(last: int, healthy: list[bool]) -> tuple[int, bool]:
    """Which P the retry's prefill goes to, and whether it backs off first (`kvferry proxy`'s rule): another
    healthy P at once; else, after a back-off, the same P if healthy, else another P anyway."""
    others = [i for i in range(len(healthy)) if i != last]
    for i in others:
        if healthy[i]:
            return i, False
    if healthy[last] or not others:
        return last, True
    return others[0], True


def retry_backoff_s(backoffs: int) -> float:
    """The n-th back-off (n ≥ 1): 0.25 s doubling to 2 s, as `kvferry proxy` backs off."""
    return float(min(2.0, RETRY_BACKOFF_S * 2 ** (backoffs - 1)))


# ---- outcomes and the comparison (pure) ------------------------------------------------------------
OUTCOME_RANK = {"wrong": 0, "none": 1, "dropped": 2, "error": 3, "identical": 4}


def outcome(cell: Cell) -> str:
    """identical / wrong: 200 with the colocated text or another (silent corruption); error: an HTTP error;
    dropped: the connection ended without an answer (D died); none: no answer within the cap."""
    if cell.http == 200:
        return "identical" if cell.identical else "wrong"
    if cell.http is not None:
        return "error"
    return "none" if cell.error in (None, "no answer") else "dropped"


def _freed_worst(cell: Cell) -> float:
    """The later of P's and D's return to 0 KV blocks (a killed server does not count; never is infinite)."""
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
    """(winner: `kvferry`, `nixl` or `same`, reason): the better outcome; for the same outcome the sooner
    answer (clearly `_apart`; not for a dropped connection, whose time is the kill's); then the sooner
    release of P's and D's KV blocks."""
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
    error = f"{cell.http} {','.join(sorted(cell.causes)) or (cell.error or '')[:40]}".rstrip()
    head = {"identical": "200 =", "wrong": "200 WRONG TEXT", "error": error,
            "dropped": f"dropped ({cell.error})", "none": "no answer"}[outcome(cell)]
    return f"{head} {took}" + (f" (try {cell.tries})" if cell.tries > 1 else "")


def freed_summary(cell: Cell) -> str:
    return " / ".join(f"{who} {_fmt_s(cell.freed_s.get(who)) if who in cell.freed_s else '-'}" for who in ("P", "D"))


def table_rows(cells: list[Cell]) -> list[dict[str, Any]]:
    """One row per (fault, policy): each connector's cell and blocks-freed times, and which is ahead."""
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
        rows.append({"fault": "idle 2 P's and 2 D's: cores used (5 s)", "policy": "-", "kvferry": idle.get("kvferry", "-"),
                     "NIXL": idle.get("nixl", "-")})
    return rows


def counter_deltas(before: dict[str, float], after: dict[str, float], names: tuple[str, ...]) -> dict[str, float]:
    """Failure counters that moved between two scrapes, by kvferry's `cause` or the NIXL counter's name."""
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

