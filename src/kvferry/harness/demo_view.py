"""`kvferry demo`'s live view (`render`) and the one-line progress of a non-terminal (`plain_line`)."""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

from rich.console import Group
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from kvferry.harness.report import BYTES, RECOMPUTED, TRANSFERS, DemoRun
from kvferry.harness.sampler import blocks_held


def _status_counts(state: dict[str, Any] | None) -> dict[str, str]:
    if state is None:
        return {"waiting": "-", "remote": "-", "running": "-"}
    by = state.get("requests_by_status") or {}
    return {"waiting": str(int(by.get("WAITING", 0)) + int(by.get("PREEMPTED", 0))),
            "remote": str(int(by.get("WAITING_FOR_REMOTE_KVS", 0))),
            "running": str(int(by.get("RUNNING", 0)))}


def _held(state: dict[str, Any] | None) -> str:
    return "-" if state is None else f"{blocks_held(state)} / {state['blocks_total']}"


def _field(state: dict[str, Any] | None, key: str) -> str:
    return "-" if state is None else str(state.get(key, "-"))


def render(run: DemoRun, width: int = 120) -> Group:
    a = run.args
    outcomes = Counter(r.outcome for r in run.results)
    done = sum(outcomes[k] for k in ("ok", "failed", "stuck", "error"))
    p_state, d_state = run.state("p"), run.state("d")
    p, d = _status_counts(p_state), _status_counts(d_state)

    header = Text.assemble(("kvferry demo", "bold cyan"), "  prefill + decode + proxy on loopback   ",
                           (run.phase, "bold"), f"  {time.monotonic() - run.started:5.1f}s")
    setup = Text.assemble(("policy ", "dim"), (a.policy, "yellow"), ("   faults ", "dim"),
                          (a.faults or "none", "magenta"))
    bar = Table.grid(padding=(0, 1))
    bar.add_row(ProgressBar(total=len(run.results), completed=done, width=48),
                f"{done}/{len(run.results)} answered")

    requests = Table(title="requests", title_style="bold", header_style="dim")
    requests.add_column("state", no_wrap=True)
    for col in ("client", "P", "D"):
        requests.add_column(col, justify="right", no_wrap=True)
    requests.add_row("queued", str(outcomes["pending"]), "", "")
    requests.add_row("waiting", "", p["waiting"], d["waiting"])
    requests.add_row("wait remote KV", "", "", d["remote"])
    requests.add_row("running", str(outcomes["running"]), p["running"], d["running"])
    requests.add_row(Text("ok", "green"), str(outcomes["ok"]), "", "")
    requests.add_row(Text("failed (500)", "red"), str(outcomes["failed"]), "", "")
    requests.add_row(Text("stuck / error", "red"), f"{outcomes['stuck']} / {outcomes['error']}", "", "")

    transfer = Table(title="KV transfer", title_style="bold", show_header=False)
    transfer.add_column("what", no_wrap=True)
    transfer.add_column("value", justify="right", no_wrap=True)
    transfer.add_row("transfers", f"{run.delta('p', TRANSFERS):.0f}")
    transfer.add_row("moved", f"{run.delta('p', BYTES) / 1e6:.1f} MB")
    transfer.add_row("now (1 s)", f"{run.recent_gbps():.3f} GB/s")
    transfer.add_row("recomputed", f"{run.delta('d', RECOMPUTED):.0f} tok")
    causes = run.failures_by_cause()
    transfer.add_row(Text("load failures", "red" if causes else ""), str(sum(causes.values())))
    for cause, n in causes.items():
        transfer.add_row(Text(f"  {cause}", "red"), str(n))

    blocks = Table(title="KV blocks", title_style="bold", header_style="dim")
    blocks.add_column("", no_wrap=True)
    for col in ("P", "D"):
        blocks.add_column(col, justify="right", no_wrap=True)
    blocks.add_row("held", _held(p_state), _held(d_state))
    blocks.add_row("leases", _field(p_state, "pending_sends"), "")
    blocks.add_row("pulls", "", _field(d_state, "pending_pulls"))

    tables = Table.grid(padding=(0, 2))
    if width >= 112:
        tables.add_row(requests, transfer, blocks)
    else:
        tables.add_row(requests, transfer)
        tables.add_row(blocks, "")
    lines: list[Any] = [header, setup, bar, tables]
    answered = [(i, r) for i, r in zip(run.items, run.results, strict=True) if i.question and r.outcome == "ok"]
    for item, result in answered[-3:]:  # a real model's latest answers
        answer = " ".join(result.text.split())
        lines.append(Text.assemble(("Q ", "bold"), item.question[-60:], ("  A ", "bold"), answer[: width - 70]))
    if run.phase == "checking outputs":
        lines.append(Text(f"colocated reference outputs: {len(run.ref.results)}/{run.ref.expected}", "dim"))
    return Group(*lines)


def plain_line(run: DemoRun) -> str:
    o = Counter(r.outcome for r in run.results)
    p_state, d_state = run.state("p"), run.state("d")
    return (f"[{time.monotonic() - run.started:5.1f}s] {run.phase}: ok {o['ok']}  failed {o['failed']}  "
            f"in flight {o['running']}  queued {o['pending']}  stuck {o['stuck']}  error {o['error']}  "
            f"transfers {run.delta('p', TRANSFERS):.0f}  "
            f"load failures {sum(run.failures_by_cause().values())}  "
            f"blocks held P {_held(p_state)} D {_held(d_state)}")
