"""train-digits results: each method beside its dense baseline, written as files."""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import os
from pathlib import Path

from bitcomm.experiments.digits.config import BASELINES
from bitcomm.experiments.digits.results import MethodResult

__all__ = ["summarise", "write_report", "plot", "accuracy_range"]


def summarise(rows: list[MethodResult]) -> list[MethodResult]:
    """Set each row's dense counterpart and the gap to its accuracy in points."""
    by = {(r.transport, r.method): r for r in rows}
    for r in rows:
        base = by.get((r.transport, BASELINES.get(r.method, "")))
        r.baseline = base.method if base else None
        r.gap_points = 100 * (base.accuracy - r.accuracy) if base else None
    return rows


def write_report(rows: list[MethodResult], config: dict, out: os.PathLike) -> list[str]:
    """Write results.json, results.csv, table.md and accuracy.png under ``out``; return paths."""
    import matplotlib  # heavy to import: only when a report is written

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(
        {"config": config, "rows": [r.as_dict() for r in rows]}, indent=1))
    keys = [f.name for f in dataclasses.fields(MethodResult) if f.name != "curve"]
    with open(out / "results.csv", "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(keys)
        for r in rows:
            w.writerow([getattr(r, k) for k in keys])
    lines = ["| transport | method | test accuracy | vs dense (points) | bytes/step/worker | "
             "less than fp32 | selected / k (mean, mean abs. deviation) | wall s |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        gap = "" if r.gap_points is None else f"{-r.gap_points:+.1f} ({r.baseline})"
        sel = ("" if r.selected_ratio is None else
               f"{r.selected_ratio:.2f}, {r.selected_deviation:.2f}")
        lines.append(f"| {r.transport} | {r.method} | {r.accuracy:.3f} | {gap} | "
                     f"{r.bytes_per_step:.0f} | {r.compression:.1f}x | {sel} | "
                     f"{r.seconds:.1f} |")
    table = "\n".join(lines) + "\n"
    (out / "table.md").write_text(table)
    fig = plot(rows)
    fig.savefig(out / "accuracy.png", dpi=100, bbox_inches="tight")
    plt.close(fig)
    return [str(out / n) for n in ("results.json", "results.csv", "table.md", "accuracy.png")]


def accuracy_range(rows: list[MethodResult]) -> tuple[float, float]:
    """Return the y-range that shows where the curves end up.

    From just below the lowest accuracy any method has in the second half of its run (early
    points below it are cut off) to just above the highest, on a 0.05 grid, so the differences
    between methods fill the height instead of the climb from chance.
    """
    late = [a for r in rows for s, a in r.curve if s >= r.steps / 2] or [0.0, 1.0]
    lo = max(0.0, math.floor((min(late) - 0.02) * 20) / 20)
    hi = min(1.0, math.ceil((max(late) + 0.01) * 20) / 20)
    return lo, max(hi, lo + 0.05)


def plot(rows: list[MethodResult]):  # noqa: ANN201 - a matplotlib Figure
    """Return the figure of test accuracy against steps and against bytes sent, per transport.

    One row of two panels per transport. Dense baselines are dashed and grey, compressed methods
    solid in colour with a marker of their own, so curves that coincide (the same method over
    two collectives) stay visible; one legend beside the panels covers no line. The right panel
    puts each method at the bytes one worker has sent by then (step x bytes per step, log x).
    """
    import matplotlib.pyplot as plt

    dense = set(BASELINES.values())
    methods = list(dict.fromkeys(r.method for r in rows))
    compressed = [m for m in methods if m not in dense]
    colours = plt.get_cmap("tab10").colors
    markers = "osD^vP*Xh<>"
    style = {}
    for i, m in enumerate(m for m in methods if m in dense):
        style[m] = {"color": ("0.2", "0.55", "0.75")[i % 3], "linestyle": "--", "marker": None,
                    "linewidth": 2.0, "zorder": 1}
    for i, m in enumerate(compressed):
        style[m] = {"color": colours[i % len(colours)], "linestyle": "-",
                    "marker": markers[i % len(markers)], "markersize": 4, "linewidth": 1.2,
                    "zorder": 2}
    transports = sorted({r.transport for r in rows})
    fig, axes = plt.subplots(len(transports), 2, figsize=(11, 3.6 * len(transports)),
                             squeeze=False)
    lo, hi = accuracy_range(rows)
    workers = rows[0].workers if rows else 0
    for (by_step, by_bytes), t in zip(axes, transports, strict=True):
        for r in rows:
            if r.transport != t:
                continue
            steps, acc = zip(*r.curve, strict=True)
            label = f"{r.method} (dense)" if r.method in dense else r.method
            by_step.plot(steps, acc, label=label, **style[r.method])
            sent = [max(s, 1) * r.bytes_per_step for s in steps]  # step 0 sits at one step
            by_bytes.plot(sent, acc, **style[r.method])
        by_step.set(title=f"digits, {workers} workers, {t}", xlabel="step",
                    ylabel="test accuracy", ylim=(lo, hi))
        by_bytes.set(title=f"accuracy against bytes sent, {t}",
                     xlabel="bytes sent per worker (log)", ylim=(lo, hi), xscale="log")
        for ax in (by_step, by_bytes):
            ax.grid(alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8)
    fig.tight_layout()
    return fig
