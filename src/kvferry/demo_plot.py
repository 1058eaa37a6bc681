"""`kvferry demo --plot`: per-request latency with fault markers, transfer throughput, blocks held."""

from __future__ import annotations

from typing import Any

# ---- plot -------------------------------------------------------------------------------------------------
_CAUSE_COLORS = {
    "transport": "tab:red",
    "checksum": "tab:purple",
    "error_reply": "tab:orange",
    "err_reqs": "tab:brown",
    "recv_timeout": "tab:pink",
    "bootstrap": "tab:olive",
    "deadline": "tab:cyan",
    "peer_dead": "black",
}


def write_plot(report: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    per, timeline = report["per_request"], report["timeline"]
    fig, (ax1, ax2, ax3) = plt.subplots(
        3, 1, figsize=(11, 10), sharex=True, gridspec_kw={"height_ratios": [3, 2, 2]}, layout="constrained"
    )
    cfg = report["config"]
    verdict = "PASS" if report["ok"] else "FAIL"
    fig.suptitle(
        f"kvferry demo: {cfg['requests']} requests, policy {cfg['policy']}, "
        f"faults {cfg['faults'] or 'none'}  [{verdict}]",
        fontsize=11,
    )

    # Fault events: where D's failure counters went up between two samples.
    events: list[tuple[float, str]] = []
    prev: dict[str, float] | None = None
    for row in timeline["d_metrics"]:
        cur = row["failures"]
        if prev is not None:
            for cause, value in cur.items():
                events += [(row["t"], cause)] * int(value - prev.get(cause, 0.0))
        prev = cur

    ok = [r for r in per if r["outcome"] == "ok"]
    if ok:
        sc = ax1.scatter(
            [r["sent_at"] for r in ok],
            [r["ttft_s"] * 1000 for r in ok],
            c=[r["prompt_tokens"] for r in ok],
            cmap="viridis",
            s=28,
            zorder=3,
            label="TTFT (colour: prompt tokens)",
        )
        fig.colorbar(sc, ax=[ax1, ax2, ax3], pad=0.01, shrink=0.4, anchor=(0.0, 1.0), label="prompt tokens")
        ax1.scatter(
            [r["sent_at"] for r in ok],
            [r["latency_s"] * 1000 for r in ok],
            marker="_",
            color="0.45",
            s=60,
            zorder=2,
            label="end-to-end latency",
        )
    bad = [r for r in per if r["outcome"] in ("failed", "error", "stuck") and r["latency_s"] is not None]
    if bad:
        ax1.scatter(
            [r["sent_at"] for r in bad],
            [r["latency_s"] * 1000 for r in bad],
            marker="x",
            color="red",
            s=60,
            zorder=4,
            label="failed / stuck (HTTP 500 or no answer)",
        )
    mismatched = [r for r in per if r["matched"] is False]
    if mismatched:
        ax1.scatter(
            [r["sent_at"] for r in mismatched],
            [r["latency_s"] * 1000 for r in mismatched],
            marker="o",
            facecolors="none",
            edgecolors="red",
            s=120,
            zorder=5,
            label="output mismatch",
        )
    ax1.set_yscale("log")
    ax1.set_ylabel("ms (by send time)")
    ax1.set_title("per-request latency; ▼ = a failed KV load on D (colour: cause)", fontsize=9)

    seen: set[str] = set()
    for t, cause in events:
        color = _CAUSE_COLORS.get(cause, "gray")
        label = None if cause in seen else f"KV load failure: {cause}"
        seen.add(cause)
        ax1.plot(
            [t],
            [0.97],
            marker="v",
            color=color,
            transform=ax1.get_xaxis_transform(),
            ms=8,
            linestyle="none",
            label=label,
            clip_on=False,
        )
        for ax in (ax2, ax3):
            ax.axvline(t, color=color, alpha=0.35, lw=1)
    ax1.legend(fontsize=7, loc="lower right", ncol=2)
    ax1.grid(True, which="both", alpha=0.25)

    ts, rates = [], []
    points = [(row["t"], row["bytes"]) for row in timeline["p_metrics"]]
    for (t0, b0), (t1, b1) in zip(points, points[1:], strict=False):
        if t1 > t0:
            ts.append(t1)
            rates.append((b1 - b0) / (t1 - t0) / 1e6)
    if ts:
        ax2.step(ts, rates, where="pre", color="tab:blue")
        ax2.fill_between(ts, rates, step="pre", alpha=0.25, color="tab:blue")
    gbps = report["transfer"]["gbps"]
    note = "" if gbps is None else f" (while transferring: {gbps:.2f} GB/s)"
    ax2.set_ylabel("MB/s")
    ax2.set_title(f"KV transfer throughput P → D, per sampling interval{note}", fontsize=9)
    ax2.grid(True, alpha=0.25)

    for key, label, color in (
        ("p_state", "P (prefill) blocks held", "tab:green"),
        ("d_state", "D (decode) blocks held", "tab:orange"),
    ):
        pts = [(row["t"], row["blocks_held"]) for row in timeline[key]]
        if pts:
            ax3.step([p[0] for p in pts], [p[1] for p in pts], where="post", label=label, color=color)
    expiries = [
        (row["t"], int(row["expired"] - prev_row["expired"]))
        for prev_row, row in zip(timeline["p_metrics"], timeline["p_metrics"][1:], strict=False)
        if row["expired"] > prev_row["expired"]
    ]
    for i, (t, n) in enumerate(expiries):
        label = "P lease expired (blocks freed by timeout)" if i == 0 else None
        ax3.plot(
            [t],
            [0.03],
            marker="^",
            color="tab:green",
            transform=ax3.get_xaxis_transform(),
            ms=9,
            linestyle="none",
            label=label,
            clip_on=False,
        )
        if n > 1:
            ax3.annotate(
                f"×{n}", (t, 0.08), xycoords=("data", "axes fraction"), fontsize=7, color="tab:green"
            )
    for ax in (ax1, ax2, ax3):
        ax.axvline(report["workload_end_t"], color="0.3", linestyle="--", lw=1)
    ax3.annotate(
        "all requests answered → drain ",
        (report["workload_end_t"], 0.97),
        xycoords=("data", "axes fraction"),
        ha="right",
        va="top",
        fontsize=8,
        color="0.3",
        annotation_clip=True,
    )
    leaked = report["leaked_blocks"]
    ax3.set_title(
        f"KV blocks held (leaked after the run: P {leaked['prefill']}, D {leaked['decode']})", fontsize=9
    )
    ax3.set_ylabel("blocks")
    ax3.set_xlabel("seconds since the workload started")
    ax3.legend(fontsize=8, loc="upper left", framealpha=0.9)
    ax3.grid(True, alpha=0.25)
    ax3.set_xlim(left=min(0.0, ax3.get_xlim()[0]), right=report["drain_end_t"] + 0.5)
    fig.savefig(path, dpi=110)
    plt.close(fig)
