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
* ``topkA``: RedSync's ``sparse_allgather`` (every rank's k pairs to every rank), by its formula;
* ``topkDSA``: SparCML's split-allgather on the same top-k sets, by its exact replay.

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

__all__ = ["Row", "run", "ALGORITHMS", "TAU_PRIME"]

ALGORITHMS = ("oktopk-steady", "oktopk-recompute", "oktopk-amortized", "topkA", "topkDSA")
"""The rows of each rank count."""
TAU_PRIME = 32
"""Calls between Ok-Topk's exact recomputations, for the amortized row."""


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

    def as_dict(self) -> dict:
        """Return the row as a dict (for JSON and CSV)."""
        return dataclasses.asdict(self)


def _top(x: torch.Tensor, k: int) -> torch.Tensor:
    return torch.topk(x.abs(), k, sorted=False).indices.sort().values


def _oktopk(size: int, n: int, k: int, seed: int) -> tuple[list[int], list[int], int]:
    """Every rank's bytes in a recompute call and in the steady call after it."""
    def fn(comm):  # noqa: ANN001, ANN202 - a LocalComm; (first, second, selected)
        state = OkTopkState(tau_prime=TAU_PRIME)
        oktopk_allreduce(comm, standard_input(seed, comm.rank, n), k, state, check=False)
        first = comm.counters.total_sent
        comm.counters.reset()
        oktopk_allreduce(comm, standard_input(seed + 1, comm.rank, n), k, state, check=False)
        return first, comm.counters.total_sent, state.last.selected

    out = run_local(fn, size, timeout=600)
    return [o[0] for o in out], [o[1] for o in out], out[0][2]


def run(ranks: Iterable[int], n: int, density: float, *, seed: int = 0,
        progress: Callable[[Row], None] | None = None) -> list[Row]:
    """Measure every algorithm at every rank count; return the rows."""
    k = max(1, math.ceil(density * n))
    rows: list[Row] = []
    for size in ranks:
        bound, gather = 6 * k * (size - 1) / size, 2 * k * (size - 1)
        first, steady, selected = _oktopk(size, n, k, seed)
        amortized = [(f + (TAU_PRIME - 1) * s) / TAU_PRIME for f, s in zip(first, steady,
                                                                          strict=True)]
        frame = sparse_codec.encoded_size(n, k, "fp32")
        topka = [sparse.sparse_allgather_bytes(frame, size, check=False)] * size
        sets = [_top(standard_input(seed, r, n), k) for r in range(size)]
        dsa = sparcml.ssar_split_allgather_bytes(sets, n, check=False)
        for name, sent, sel in (("oktopk-steady", steady, selected),
                                ("oktopk-recompute", first, k),
                                ("oktopk-amortized", amortized, selected),
                                ("topkA", topka, k * size),
                                ("topkDSA", dsa, int(torch.cat(sets).unique().numel()))):
            row = Row(size, n, k, name, int(max(sent)), sum(sent) / size, max(sent) / 4,
                      bound, gather, sel)
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
