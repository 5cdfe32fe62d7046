"""Bytes per rank of the sparse allreduces as the ranks grow: Ok-Topk's O(k) against O(kP).

At a fixed vector length ``n`` and ``k = ceil(density * n)`` per rank, for each rank count
``P``, every rank takes the top k of its standard input (:func:`bitcomm.collectives.registry.
standard_input`) and the row says the bytes the busiest rank sends, in 4-byte words:

* ``oktopk-steady``: an Ok-Topk call that reuses its thresholds and regions (the second call,
  on the next inputs, after one that computed them: what ``tau_prime - 1`` of every
  ``tau_prime`` calls cost), run on :class:`~bitcomm.comm.local.LocalComm` threads and counted
  by the transport;
* ``oktopk-recompute``: the first call, which also repartitions and computes both thresholds
  exactly (an allgather of the reduced values);
* ``oktopk-amortized``: one recompute call and ``tau_prime - 1 = 31`` steady ones, per call;
* ``oktopk-even``, ``oktopk-direct``, ``oktopk-always``: steady calls with the paper's naive
  variants and the other balancing rule: regions cut evenly and no balancing (``even``),
  regions from the selected indices and no balancing (``direct``), or balancing every call
  (``always``; ``steady`` balances when the largest block exceeds 4x the mean). Their
  ``received_max`` (the most entries a rank receives to reduce) and ``block_max`` (the largest
  block a rank sends to every other in the allgatherv) are what the paper's Figure 7 compares;
* ``topkA``: RedSync's ``sparse_allgather`` (every rank's k pairs to every rank), by its formula;
* ``topkDSA``: SparCML's split-allgather on the same top-k sets, by its exact replay.

``inputs="digits"`` replaces the standard inputs by real gradients: rank r's is the gradient of
the 64-1024-10 train-digits MLP after 50 steps of dense SGD on its own batch (n = 76,810; the
index sets are skewed, as the paper's are, where the standard inputs' are uniform); the steady
call gets the next step's.

``bound_words`` is Section 3.1's ``6k(P-1)/P``; ``allgather_words`` is ``2k(P-1)``. Words are
4 bytes: an int32 index or a float32 value (int64 indices above ``2**31`` elements would make
an index two words). Counts, lengths and the call agreement are included in the measured
bytes (the agreement is off, ``check=False``, as the papers' algorithms have none).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable

import torch

from bitcomm.codecs import sparse as sparse_codec
from bitcomm.collectives import sparcml, sparse
from bitcomm.collectives.oktopk import OkTopkState, oktopk_allreduce
from bitcomm.collectives.registry import standard_input
from bitcomm.comm import run_local

__all__ = ["Row", "run", "ALGORITHMS", "INPUTS", "TAU_PRIME"]

ALGORITHMS = ("oktopk-steady", "oktopk-recompute", "oktopk-amortized", "oktopk-even",
              "oktopk-direct", "oktopk-always", "topkA", "topkDSA")
"""The rows of each rank count."""
TAU_PRIME = 32
"""Calls between Ok-Topk's exact recomputations, for the amortized row."""
INPUTS = ("standard", "digits")
"""The vectors the ranks hold."""
_VARIANTS = {"oktopk-even": {"regions": "even", "balance": "never"},
             "oktopk-direct": {"balance": "never"}, "oktopk-always": {"balance": "always"}}


@dataclasses.dataclass
class Row:
    """The bytes of one algorithm at one rank count."""

    ranks: int
    n: int
    k: int
    algorithm: str
    max_bytes: int
    mean_bytes: float
    words: float
    bound_words: float
    allgather_words: float
    selected: int  # entries of the result on every rank
    received_max: int = 0  # Ok-Topk: the most entries a rank received to reduce
    block_max: int = 0  # Ok-Topk: the largest allgatherv block

    def as_dict(self) -> dict:
        """Return the row as a dict (for JSON and CSV)."""
        return dataclasses.asdict(self)


def _top(x: torch.Tensor, k: int) -> torch.Tensor:
    return torch.topk(x.abs(), k, sorted=False).indices.sort().values


def _inputs(kind: str, size: int, n: int, seed: int) -> tuple[list[torch.Tensor], ...]:
    """Return every rank's vector for the first call and for the steady call after it."""
    if kind == "digits":
        from bitcomm.experiments.digits.run import recorded_gradients

        first = recorded_gradients([(50, 1000 * (seed + 1) + r) for r in range(size)])
        second = recorded_gradients([(51, 1000 * (seed + 1) + r) for r in range(size)])
        return first, second
    if kind != "standard":
        raise ValueError(f"expected inputs in {INPUTS}, got {kind!r}")
    return ([standard_input(seed, r, n) for r in range(size)],
            [standard_input(seed + 1, r, n) for r in range(size)])


def _oktopk(first: list[torch.Tensor], second: list[torch.Tensor], k: int, **options: str
            ) -> tuple[list[int], list[int], list]:
    """Return every rank's bytes in a first call and in the steady call after it, and stats.

    The stats are every rank's :class:`OkTopkStats` of the steady call.
    """
    def fn(comm):  # noqa: ANN001, ANN202 - a LocalComm; (first, second, stats)
        state = OkTopkState(tau_prime=TAU_PRIME, **options)
        oktopk_allreduce(comm, first[comm.rank], k, state, check=False)
        sent = comm.counters.total_sent
        comm.counters.reset()
        oktopk_allreduce(comm, second[comm.rank], k, state, check=False)
        return sent, comm.counters.total_sent, state.last

    out = run_local(fn, len(first), timeout=600)
    return [o[0] for o in out], [o[1] for o in out], [o[2] for o in out]


def run(ranks: Iterable[int], n: int, density: float, *, seed: int = 0,
        inputs: str = "standard", progress: Callable[[Row], None] | None = None) -> list[Row]:
    """Measure every algorithm at every rank count; return the rows."""
    rows: list[Row] = []
    for size in ranks:
        first, second = _inputs(inputs, size, n, seed)
        n = first[0].numel()
        k = max(1, math.ceil(density * n))
        bound, gather = 6 * k * (size - 1) / size, 2 * k * (size - 1)
        recompute, steady, stats = _oktopk(first, second, k)
        amortized = [(f + (TAU_PRIME - 1) * s) / TAU_PRIME for f, s in zip(recompute, steady,
                                                                          strict=True)]
        frame = sparse_codec.encoded_size(n, k, "fp32")
        topka = [sparse.sparse_allgather_bytes(frame, size, check=False)] * size
        sets = [_top(x, k) for x in first]
        dsa = sparcml.ssar_split_allgather_bytes(sets, n, check=False)
        found = [("oktopk-steady", steady, stats), ("oktopk-recompute", recompute, k),
                 ("oktopk-amortized", amortized, stats)]
        for name, options in _VARIANTS.items():
            found.append((name, *_oktopk(first, second, k, **options)[1:]))
        found += [("topkA", topka, k * size),
                  ("topkDSA", dsa, int(torch.cat(sets).unique().numel()))]
        for name, sent, st in found:
            extra = ((st[0].selected, max(s.received for s in st), max(s.block for s in st))
                     if isinstance(st, list) else (st, 0, 0))
            row = Row(size, n, k, name, int(max(sent)), sum(sent) / size, max(sent) / 4,
                      bound, gather, *extra)
            rows.append(row)
            if progress:
                progress(row)
    return rows


def plot(rows: list[Row]):  # noqa: ANN201 - a matplotlib Figure
    """Return words per rank against the rank count, with the 6k(P-1)/P and 2k(P-1) lines."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ranks = sorted({r.ranks for r in rows})
    for name in ALGORITHMS:
        pts = [(r.ranks, r.words) for r in rows if r.algorithm == name]
        ax.plot(*zip(*pts, strict=True), marker="o", label=name)
    by = {r.ranks: r for r in rows}
    ax.plot(ranks, [by[p].bound_words for p in ranks], "k--", label="6k(P-1)/P")
    ax.plot(ranks, [by[p].allgather_words for p in ranks], "k:", label="2k(P-1)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("ranks P")
    ax.set_ylabel("4-byte words sent by the busiest rank")
    ax.set_title(f"n = {rows[0].n}, k = {rows[0].k} per rank")
    ax.legend(fontsize=7)
    return fig
