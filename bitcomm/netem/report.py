"""Tables and plots of experiment cells (:class:`bitcomm.netem.results.Cell`)."""

from __future__ import annotations

from pathlib import Path

from bitcomm import _sizes
from bitcomm.netem.results import Cell

__all__ = ["table", "markdown", "plots"]


def _mb(x: float) -> str:
    return f"{x / 1e6:.3f}"


def table(cells: list[Cell]) -> str:
    """Return a text table: per topology and size, time and model per algorithm, slow-link MB.

    ``cpu%`` is the cell's ``cpu_share``: how busy the ranks kept this machine's cores;
    ``resent`` the TCP segments all ranks retransmitted per call.
    """
    head = (f"{'topology':<11} {'size':>6} {'algorithm':<20} {'time(s)':>8} {'model(s)':>8} "
            f"{'speedup':>7} {'model':>6} {'slowMB':>8} {'modelMB':>8} {'vs bound':>8} "
            f"{'cpu%':>5} {'resent':>6} {'#wrong':>6}")
    lines = [head]
    for c in cells:
        speed = f"{c.speedup:.2f}" if c.speedup is not None else ""
        mspeed = f"{c.model_speedup:.2f}" if c.model_speedup is not None else ""
        lines.append(f"{c.topology:<11} {_sizes.human(c.n):>6} {c.algorithm:<20} "
                     f"{c.seconds:>8.3f} {c.model_seconds:>8.3f} {speed:>7} {mspeed:>6} "
                     f"{_mb(c.slow_link_payload):>8} {_mb(c.model_slow_link_payload):>8} "
                     f"{c.time_vs_bound:>8.2f} {100 * c.cpu_share:>5.0f} "
                     f"{_count(c.tcp_retrans):>6} {c.wrong:>6}")
    return "\n".join(lines)


def markdown(cells: list[Cell]) -> str:
    """Return the paper-shaped table in Markdown: one row per topology and size."""
    algs = list(dict.fromkeys(c.algorithm for c in cells))
    keys = list(dict.fromkeys((c.topology, c.n) for c in cells))
    by = {(c.topology, c.n, c.algorithm): c for c in cells}
    head = ["topology", "size"] + [f"{a} s (model)" for a in algs]
    head += ["ring speedup (model)", "slow-link MB ring / a2a (model)", "CPU busy (max)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for topo, n in keys:
        row = [topo, _sizes.human(n)]
        for a in algs:
            c = by.get((topo, n, a))
            row.append(f"{c.seconds:.2f} ({c.model_seconds:.2f})" if c else "")
        ring, a2a = by.get((topo, n, "ring-majority")), by.get((topo, n, "alltoall-majority"))
        row.append(f"{ring.speedup:.2f} ({ring.model_speedup:.2f})"
                   if ring and ring.speedup is not None else "")
        row.append(f"{_mb(ring.slow_link_payload)} / {_mb(a2a.slow_link_payload)} "
                   f"({_mb(ring.model_slow_link_payload)} / "
                   f"{_mb(a2a.model_slow_link_payload)})" if ring and a2a else "")
        row.append(f"{max(by[(topo, n, a)].cpu_share for a in algs if (topo, n, a) in by):.0%}")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def plots(cells: list[Cell], out: Path) -> list[Path]:
    """Write time-vs-size, speedup-vs-N and slow-link-bytes PNGs; return their paths.

    Raises:
        ImportError: matplotlib is not installed (the message names the extra).

    """
    try:
        import matplotlib
    except ImportError:
        raise ImportError("plots need matplotlib: pip install 'bitcomm[plots]'") from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    written = []
    topologies = list(dict.fromkeys(c.topology for c in cells))
    algs = list(dict.fromkeys(c.algorithm for c in cells))

    fig, axes = plt.subplots(1, len(topologies), figsize=(4.5 * len(topologies), 3.6),
                             squeeze=False)
    for ax, topo in zip(axes[0], topologies, strict=True):
        for a in algs:
            pts = sorted((c.n, c.seconds, c.model_seconds) for c in cells
                         if c.topology == topo and c.algorithm == a)
            if not pts:
                continue
            line, = ax.plot([p[0] * 4 / 1e6 for p in pts], [p[1] for p in pts], "o-", label=a)
            ax.plot([p[0] * 4 / 1e6 for p in pts], [p[2] for p in pts], "--",
                    color=line.get_color(), alpha=0.6)
        ax.set_title(f"{topo} (dashed: model)")
        ax.set_xlabel("tensor MB (fp32)")
        ax.set_ylabel("seconds")
        ax.legend(fontsize=7)
    fig.tight_layout()
    written.append(out / "time_vs_size.png")
    fig.savefig(written[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(5, 3.6))
    families = sorted({t.rsplit("-", 1)[0] for t in topologies})
    for fam in families:
        pts = sorted((c.ranks, c.speedup, c.model_speedup) for c in cells
                     if c.topology.rsplit("-", 1)[0] == fam and c.algorithm ==
                     "ring-majority" and c.speedup is not None
                     and c.n == max(d.n for d in cells if d.topology == c.topology))
        if pts:
            line, = ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=fam)
            ax.plot([p[0] for p in pts], [p[2] for p in pts], "--", color=line.get_color(),
                    alpha=0.6)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xlabel("ranks N")
    ax.set_ylabel("ring speedup over all-to-all")
    ax.set_title("largest size (dashed: model)")
    if ax.get_legend_handles_labels()[0]:  # no lines without an all-to-all to compare with
        ax.legend(fontsize=7)
    fig.tight_layout()
    written.append(out / "speedup_vs_n.png")
    fig.savefig(written[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(max(5, 1.2 * len(topologies) * len(algs)), 3.6))
    labels, measured, modelled = [], [], []
    for topo in topologies:
        n = max(c.n for c in cells if c.topology == topo)
        for a in algs:
            c = next((c for c in cells if (c.topology, c.n, c.algorithm) ==
                      (topo, n, a)), None)
            if c:
                labels.append(f"{topo}\n{a}")
                measured.append(c.slow_link_payload / 1e6)
                modelled.append(c.model_slow_link_payload / 1e6)
    xs = range(len(labels))
    ax.bar([x - 0.2 for x in xs], measured, width=0.4, label="measured")
    ax.bar([x + 0.2 for x in xs], modelled, width=0.4, label="model")
    ax.set_xticks(list(xs))
    ax.set_xticklabels(labels, fontsize=6, rotation=45, ha="right")
    ax.set_ylabel("MB per call on the slowest link")
    ax.legend(fontsize=7)
    fig.tight_layout()
    written.append(out / "slow_link_bytes.png")
    fig.savefig(written[-1], dpi=110)
    plt.close(fig)
    return written


def _count(x: float | None) -> str:
    return "" if x is None else f"{x:.0f}"
