"""Threshold quality of the top-k selectors: how many they select against k, and how fast.

For each distribution, size and target ratio ``delta = k / n`` the scores are ``|x|`` of one
vector, and every selector picks from them:

* ``topk``: bitcomm's exact top-k (:func:`bitcomm.codecs.select.topk`: numpy's introselect
  over the scores above a sampled bound on the CPU, a radix selection on a GPU with triton);
  its time is the anchor of the ``vs_topk`` column, each selector's calls alternating with
  its calls. ``torch-topk``: ``torch.topk`` itself, unsorted, for comparison (on a GPU it
  sorts a vector of 100000 or more elements).
* ``trimmed``, ``threshold``: RedSync's trimmed top-k and threshold binary search.
* ``sidco-e``, ``sidco-p``, ``sidco-gp``: SIDCo's fits, at one stage (``stages=1``), and after
  the stage adaptation has run on the same vector for 25 calls (``stages`` is where it ended,
  the row marked ``adapted``); ``best_stages`` is the stage count whose selection is closest to
  k, which shows where the adaptation moved the wrong way.
* ``oktopk-reuse``: Ok-Topk's reused local threshold: the exact k-th largest of a first draw,
  applied to a second, independent draw of the same distribution (for ``digits``, gradients
  ``gap`` steps apart) -- what the count is between two exact recomputations.

Distributions: ``laplace``, ``gauss``, ``t3`` (Student-t with 3 degrees of freedom; SIDCo's
Figures 1 and 3 use such synthetic vectors) and ``digits``: the flattened gradient of the
64-1024-10 train-digits MLP after 50 steps of dense SGD, repeated to the size asked (needs
the ``experiments`` extra for the data).
Rows: ``ratio`` is ``k_hat / k``; ``seconds`` the median time of one selection (CUDA events
on a GPU).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable

import torch

from bitcomm._sizes import human
from bitcomm.bench import heading
from bitcomm.bench.codecs import time_against, time_call
from bitcomm.codecs import select, sidco

__all__ = ["Row", "run", "markdown", "DISTRIBUTIONS", "SELECTORS", "sample"]

DISTRIBUTIONS = ("laplace", "gauss", "t3", "digits")
"""The vectors the selectors are measured on."""
SELECTORS = ("topk", "torch-topk", "trimmed", "threshold", "sidco-e", "sidco-p", "sidco-gp",
             "oktopk-reuse")
"""Selector rows, in order."""
_ADAPT_CALLS = 25
_DIGITS_STEPS, _DIGITS_GAP = 50, 10


@dataclasses.dataclass
class Row:
    """One selector on one vector."""

    dist: str
    n: int
    delta: float
    selector: str
    mode: str  # "exact", "one-stage", "adapted", "reused"
    stages: int
    best_stages: int
    k: int
    selected: int
    ratio: float
    seconds: float
    vs_topk: float

    def as_dict(self) -> dict:
        """Return the row as a dict (for JSON and CSV)."""
        return dataclasses.asdict(self)


def sample(dist: str, n: int, draw: int = 0) -> torch.Tensor:
    """Return the float32 vector ``draw`` (0 or 1: independent) of ``dist`` with ``n`` elements."""
    if dist == "digits":
        from bitcomm.experiments.digits.run import recorded_gradients

        step = _DIGITS_STEPS + _DIGITS_GAP * draw
        g = recorded_gradients([(step, step)])[0]
        return g.repeat(-(-n // g.numel()))[:n]
    gen = torch.Generator().manual_seed(1000 * draw + n % 997)
    if dist == "laplace":
        u = torch.rand(n, generator=gen, dtype=torch.float64).clamp_(1e-300, 1)
        sign = torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0)
        return (-u.log()).float() * sign
    if dist == "gauss":
        return torch.randn(n, generator=gen)
    if dist == "t3":
        z = torch.randn(n, generator=gen, dtype=torch.float64)
        chi2 = torch.randn(3, n, generator=gen, dtype=torch.float64).pow(2).sum(0)
        return (z / (chi2 / 3).sqrt()).float()
    raise ValueError(f"expected dist in {DISTRIBUTIONS}, got {dist!r}")


def _adapt(scores: torch.Tensor, k: int, dist: str) -> int:
    control = sidco.StageControl()
    for _ in range(_ADAPT_CALLS):
        got = sidco.sidco(scores, k, dist, control.stages, check=False).numel()
        control.update(got, k, scores.numel())
    return control.stages


def _measure(dist: str, n: int, delta: float, scores: torch.Tensor,
             later_scores: torch.Tensor, repeat: int) -> list[Row]:
    """Every selector's rows on one vector's scores at one target ratio."""
    k = max(1, math.ceil(delta * n))
    device = scores.device

    def top() -> object:
        return select.topk(scores, k, check=False)

    def timed(fn: Callable[[], object]) -> tuple[float, float]:
        # the selector's and the exact top-k's medians, their calls alternating
        return time_against(fn, top, repeat, device)

    def row(selector: str, mode: str, stages: int, best: int, got: int,
            times: tuple[float, float]) -> Row:
        seconds, anchor = times
        return Row(dist, n, delta, selector, mode, stages, best, k, got, got / k, seconds,
                   anchor / seconds)

    alone = time_call(top, repeat, device)
    rows = [row("topk", "exact", 0, 0, k, (alone, alone)),
            row("torch-topk", "exact", 0, 0, k,
                timed(lambda: torch.topk(scores, k, sorted=False)))]
    for name in ("trimmed", "threshold"):
        got = select.select(scores, k, name, check=False).numel()
        times = timed(lambda name=name: select.select(scores, k, name, check=False))
        rows.append(row(name, "exact" if name == "trimmed" else "search", 0, 0, got, times))
    for name, fit in select.SIDCO.items():
        by = {m: sidco.sidco(scores, k, fit, m, check=False).numel()
              for m in range(1, sidco.max_stages(k / n) + 1)}
        best = min(by, key=lambda m: (abs(by[m] / k - 1), m))
        adapted = _adapt(scores, k, fit)
        for mode, m in (("one-stage", 1), ("adapted", adapted)):
            times = timed(lambda fit=fit, m=m: sidco.sidco(scores, k, fit, m, check=False))
            rows.append(row(name, mode, m, best, by[m], times))
    th = float(torch.topk(scores, k).values.min())
    got = int((later_scores >= th).sum())
    rows.append(row("oktopk-reuse", "reused", 0, 0, got,
                    timed(lambda: torch.nonzero(later_scores >= th))))
    return rows


def run(sizes: Iterable[int], deltas: Iterable[float], dists: Iterable[str] = DISTRIBUTIONS,
        *, repeat: int = 3, progress: Callable[[Row], None] | None = None,
        device: str = "cpu") -> list[Row]:
    """Measure every selector on every (distribution, size, delta); return the rows.

    The vectors are drawn on the CPU (the same values on every device) and moved to
    ``device``; on ``"cuda"`` the times are CUDA events (:func:`time_call`).
    """
    rows: list[Row] = []
    for dist in dists:
        for n in sizes:
            scores = sample(dist, n).abs().to(device)
            later = sample(dist, n, draw=1).abs().to(device)
            for delta in deltas:
                for r in _measure(dist, n, delta, scores, later, repeat):
                    rows.append(r)
                    if progress:
                        progress(r)
    return rows


_FITS = (("sidco-e", "SIDCo-E"), ("sidco-p", "SIDCo-P"), ("sidco-gp", "SIDCo-GP"))


def markdown(rows: list[Row], config: dict, command: str) -> str:
    """Return the rows as the docs' Markdown tables, headed by their date, machine and command.

    For each size two tables, a line a distribution and delta: how many each selector picks
    over k (a SIDCo fit at one stage and adapted, with the stage count it ended at in
    brackets and the one nearest k in parentheses), and each selector's time as a multiple
    of bitcomm's exact top-k's (one-stage fits), after that top-k's own milliseconds.
    """
    cases: dict[tuple[int, str, float], dict[tuple[str, str], Row]] = {}
    for r in rows:
        cases.setdefault((r.n, r.dist, r.delta), {})[(r.selector, r.mode)] = r
    out = heading(config, command)
    for n in dict.fromkeys(c[0] for c in cases):
        out += [f"At n = {n:,} ({human(n)}): selected / k.", "",
                "| dist | delta | RedSync threshold search | SIDCo-E 1 stage | SIDCo-E adapted [M] "
                "(best M) | SIDCo-P 1 stage / adapted [M] (best M) | SIDCo-GP 1 stage / adapted "
                "[M] (best M) | Ok-Topk reused |",
                "|---|---|---|---|---|---|---|---|"]
        times = ["", f"At n = {n:,}: bitcomm's exact top-k in ms, the others as multiples of "
                 "its time.", "",
                 "| dist | delta | top-k (ms) | torch.topk | trimmed | threshold search | "
                 "SIDCo-E | SIDCo-P | SIDCo-GP | Ok-Topk reused |",
                 "|---|---|---|---|---|---|---|---|---|---|"]
        for (size, dist, delta), got in cases.items():
            if size != n:
                continue
            cells = [f"{got['threshold', 'search'].ratio:.2f}"]
            for name, _ in _FITS:
                one, adapted = got[name, "one-stage"], got[name, "adapted"]
                ended = f"{adapted.ratio:.2f} [{adapted.stages}] ({adapted.best_stages})"
                cells += [f"{one.ratio:.2f}", ended] if name == "sidco-e" else \
                    [f"{one.ratio:.2f} / {ended}"]
            cells.append(f"{got['oktopk-reuse', 'reused'].ratio:.2f}")
            out.append(f"| {dist} | {delta:g} | " + " | ".join(cells) + " |")
            top = got["topk", "exact"].seconds
            multiples = [got[name, mode].seconds / top for name, mode in (
                ("torch-topk", "exact"), ("trimmed", "exact"), ("threshold", "search"),
                *((name, "one-stage") for name, _ in _FITS), ("oktopk-reuse", "reused"))]
            times.append(f"| {dist} | {delta:g} | {top * 1e3:.2f} | "
                         + " | ".join(f"{m:.2f}" for m in multiples) + " |")
        out += times + [""]
    return "\n".join(out)
