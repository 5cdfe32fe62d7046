"""train-digits results: each method beside its dense baseline, written as files."""

from __future__ import annotations

import csv
import dataclasses
import json
import os
from pathlib import Path

from bitcomm.experiments.digits.config import BASELINES
from bitcomm.experiments.digits.results import MethodResult

__all__ = ["summarise", "write_report"]


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
             "less than fp32 | wall s |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        gap = "" if r.gap_points is None else f"{-r.gap_points:+.1f} ({r.baseline})"
        lines.append(f"| {r.transport} | {r.method} | {r.accuracy:.3f} | {gap} | "
                     f"{r.bytes_per_step:.0f} | {r.compression:.1f}x | {r.seconds:.1f} |")
    table = "\n".join(lines) + "\n"
    (out / "table.md").write_text(table)
    transports = sorted({r.transport for r in rows})
    fig, axes = plt.subplots(1, len(transports), figsize=(6 * len(transports), 4), squeeze=False)
    for ax, t in zip(axes[0], transports, strict=True):
        for r in rows:
            if r.transport == t:
                steps, acc = zip(*r.curve, strict=True)
                ax.plot(steps, acc, label=r.method, marker=".")
        ax.set(title=f"digits, {rows[0].workers} workers, {t}", xlabel="step",
               ylabel="test accuracy", ylim=(0.5, 1.0))
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "accuracy.png", dpi=100)
    plt.close(fig)
    return [str(out / n) for n in ("results.json", "results.csv", "table.md", "accuracy.png")]
