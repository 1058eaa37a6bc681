"""`kvferry demo --plot`: per-request latency with fault markers, transfer throughput, blocks held."""

from __future__ import annotations

from typing import Any

_CAUSE_COLORS = {"transport": "tab:red", "checksum": "tab:purple", "error_reply": "tab:orange",
                 "err_reqs": "tab:brown", "recv_timeout": "tab:pink", "bootstrap": "tab:olive",
                 "deadline": "tab:cyan", "peer_dead": "black", "expired": "tab:gray"}


def fault_events(timeline: dict[str, Any]) -> list[tuple[float, str]]:
    """(time, cause) for every step of D's failure counters between two samples."""
    events: list[tuple[float, str]] = []
    prev: dict[str, float] | None = None
    for row in timeline["d_metrics"]:
        cur = row["failures"]
        if prev is not None:
            for cause, value in cur.items():
                events += [(row["t"], cause)] * int(value - prev.get(cause, 0.0))
        prev = cur
    return events


def _scatter(ax: Any, rows: list[dict[str, Any]], key: str, **style: Any) -> Any:
    return ax.scatter([r["sent_at"] for r in rows], [r[key] * 1000 for r in rows], **style)


def latency_panel(fig: Any, ax: Any, axes: list[Any], per: list[dict[str, Any]]) -> None:
    ok = [r for r in per if r["outcome"] == "ok"]
    if ok:
        sc = _scatter(ax, ok, "ttft_s", c=[r["prompt_tokens"] for r in ok], cmap="viridis", s=28, zorder=3,
                      label="TTFT (colour: prompt tokens)")
        fig.colorbar(sc, ax=axes, pad=0.01, shrink=0.4, anchor=(0.0, 1.0), label="prompt tokens")
        _scatter(ax, ok, "latency_s", marker="_", color="0.45", s=60, zorder=2, label="end-to-end latency")
    bad = [r for r in per if r["outcome"] in ("failed", "error", "stuck") and r["latency_s"] is not None]
    if bad:
        _scatter(ax, bad, "latency_s", marker="x", color="red", s=60, zorder=4,
                 label="failed / stuck (HTTP 500 or no answer)")
    mismatched = [r for r in per if r["matched"] is False]
    if mismatched:
        _scatter(ax, mismatched, "latency_s", marker="o", facecolors="none", edgecolors="red", s=120, zorder=5,
                 label="output mismatch")
    ax.set_yscale("log")
    ax.set_ylabel("ms (by send time)")
    ax.set_title("per-request latency; ▼ = a failed KV load on D (colour: cause)", fontsize=9)


def fault_markers(ax: Any, others: list[Any], events: list[tuple[float, str]]) -> None:
    """A ▼ on the latency panel per failed load, and a faint line through the other panels."""
    seen: set[str] = set()
    for t, cause in events:
        color = _CAUSE_COLORS.get(cause, "gray")
        label = None if cause in seen else f"KV load failure: {cause}"
        seen.add(cause)
        ax.plot([t], [0.97], marker="v", color=color, transform=ax.get_xaxis_transform(), ms=8,
                linestyle="none", label=label, clip_on=False)
        for other in others:
            other.axvline(t, color=color, alpha=0.35, lw=1)
    ax.legend(fontsize=7, loc="lower right", ncol=2)
    ax.grid(True, which="both", alpha=0.25)


def throughput_panel(ax: Any, timeline: dict[str, Any], gbps: float | None) -> None:
    ts, rates = [], []
    points = [(row["t"], row["bytes"]) for row in timeline["p_metrics"]]
    for (t0, b0), (t1, b1) in zip(points, points[1:], strict=False):
        if t1 > t0:
            ts.append(t1)
            rates.append((b1 - b0) / (t1 - t0) / 1e6)
    if ts:
        ax.step(ts, rates, where="pre", color="tab:blue")
        ax.fill_between(ts, rates, step="pre", alpha=0.25, color="tab:blue")
    note = "" if gbps is None else f" (while transferring: {gbps:.2f} GB/s)"
    ax.set_ylabel("MB/s")
    ax.set_title(f"KV transfer throughput P → D, per sampling interval{note}", fontsize=9)
    ax.grid(True, alpha=0.25)


def blocks_panel(ax: Any, timeline: dict[str, Any], leaked: dict[str, int]) -> None:
    for key, label, color in (("p_state", "P (prefill) blocks held", "tab:green"),
                              ("d_state", "D (decode) blocks held", "tab:orange")):
        pts = [(row["t"], row["blocks_held"]) for row in timeline[key]]
        if pts:
            ax.step([p[0] for p in pts], [p[1] for p in pts], where="post", label=label, color=color)
    metrics = timeline["p_metrics"]
    expiries = [(row["t"], int(row["expired"] - prev["expired"]))
                for prev, row in zip(metrics, metrics[1:], strict=False) if row["expired"] > prev["expired"]]
    for i, (t, n) in enumerate(expiries):
        expiry_label = "P lease expired (blocks freed by timeout)" if i == 0 else None
        ax.plot([t], [0.03], marker="^", color="tab:green", transform=ax.get_xaxis_transform(), ms=9,
                linestyle="none", label=expiry_label, clip_on=False)
        if n > 1:
            ax.annotate(f"×{n}", (t, 0.08), xycoords=("data", "axes fraction"), fontsize=7, color="tab:green")
    ax.set_title(f"KV blocks held (leaked after the run: P {leaked['prefill']}, D {leaked['decode']})",
                 fontsize=9)
    ax.set_ylabel("blocks")
    ax.set_xlabel("seconds since the workload started")
    ax.grid(True, alpha=0.25)


def workload_end(axes: list[Any], report: dict[str, Any]) -> None:
    end = report["workload_end_t"]
    for ax in axes:
        ax.axvline(end, color="0.3", linestyle="--", lw=1)
    last = axes[-1]
    last.annotate("all requests answered → drain ", (end, 0.97), xycoords=("data", "axes fraction"),
                  ha="right", va="top", fontsize=8, color="0.3", annotation_clip=True)
    last.legend(fontsize=8, loc="upper left", framealpha=0.9)
    last.set_xlim(left=min(0.0, last.get_xlim()[0]), right=report["drain_end_t"] + 0.5)


def write_plot(report: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timeline = report["timeline"]
    fig, axes = plt.subplots(3, 1, figsize=(11, 10), sharex=True, gridspec_kw={"height_ratios": [3, 2, 2]},
                             layout="constrained")
    ax1, ax2, ax3 = axes
    cfg, verdict = report["config"], "PASS" if report["ok"] else "FAIL"
    fig.suptitle(f"kvferry demo: {cfg['requests']} requests, policy {cfg['policy']}, "
                 f"faults {cfg['faults'] or 'none'}  [{verdict}]", fontsize=11)
    latency_panel(fig, ax1, list(axes), report["per_request"])
    fault_markers(ax1, [ax2, ax3], fault_events(timeline))
    throughput_panel(ax2, timeline, report["transfer"]["gbps"])
    blocks_panel(ax3, timeline, report["leaked_blocks"])
    workload_end([ax1, ax2, ax3], report)
    fig.savefig(path, dpi=110)
    plt.close(fig)
