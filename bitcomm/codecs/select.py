"""Communication-set selectors: which k elements of a residual to send.

Three methods from RedSync (Section 5.2), all taking non-negative
*scores* (``|x|`` for top-k by magnitude, ``x.clamp(min=0)`` for the k largest positive values)
and returning int64 indices in ascending order:

* :func:`topk`: the exact k largest scores. Ties at the k-th value are broken towards lower
  indices, so every device returns the same set (``torch.topk`` alone breaks ties differently
  on CPU and CUDA). On the Triton path it is a radix selection (``_kernels.top_indices``):
  ``torch.topk`` on a GPU sorts a whole vector of 100000 or more elements.
* :func:`trimmed_topk` (Algorithm 2): start from ``threshold = mean + 0.8 * (max - mean)`` and
  lower it in steps of ``eps * (max - mean)`` until at least k scores exceed it, then run the exact
  top-k on those survivors only. Exactly ``min(k, n)`` indices, the same set as :func:`topk`.
  The paper's loop condition reads ``while nnz > k``; its text (and termination) need
  ``while nnz < k``. The first step that keeps k scores is found by bisection over the steps
  (the count only grows as the threshold falls, and any step that keeps k gives the same top-k),
  so a fine ``eps`` costs ``log2(1 / eps)`` passes over the scores, not ``1 / eps``.
* :func:`threshold_search` (Algorithm 3): binary search of ``ratio`` in [0, 1] for a threshold
  ``mean + ratio * (max - mean)`` that between k and 2k scores exceed, stopping when the interval
  is narrower than ``eps``. Avoids any sort, returns *at least* k indices (at most 2k when the
  window is found). Algorithm 3 as printed assigns the threshold itself to the bounds and moves
  the wrong bound when ``k/2 < nnz <= k``; here ``nnz < k`` lowers the upper bound and
  ``nnz > 2k`` raises the lower bound. When fewer than k scores exceed the mean (k is a large
  fraction of n, outside the paper's regime), it falls back to :func:`topk`.

and, from SIDCo (:mod:`bitcomm.codecs.sidco`), threshold fits that select about k in one pass per
stage: ``"sidco-e"`` (exponential), ``"sidco-p"`` (generalized Pareto) and ``"sidco-gp"``
(gamma, then Pareto), with options ``stages`` and ``first``.

:func:`select_side` runs any of them on one side of a signed vector, the scores ``max(v, 0)``
or ``max(-v, 0)`` (RedSync's sign-uniform frames), and :func:`select_abs` on ``|v|``; on the
Triton path the exact top-k and the two threshold searches compute those scores inside their
passes over ``v`` and never write them.

The RedSync threshold selectors refuse ``eps`` below :data:`MIN_EPS`: finer steps than that
cannot change which float32 scores exceed the threshold, and a bisection below double
precision's resolution never ends.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TypeVar

import numpy as np
import torch

from bitcomm.codecs import _bracket, _frame, sidco

_T = TypeVar("_T")

__all__ = ["topk", "trimmed_topk", "threshold_search", "select", "select_side", "select_abs",
           "METHODS", "SIDCO", "MIN_EPS"]

SIDCO = {"sidco-e": "exponential", "sidco-p": "pareto", "sidco-gp": "gamma-pareto"}
"""SIDCo's selectors by name, and the distribution each fits."""
METHODS = ("topk", "trimmed", "threshold", *SIDCO)
"""Selector names accepted by :func:`select`."""
MIN_EPS = 1e-12
"""The finest ``eps`` the threshold selectors accept."""


def _check_eps(eps: object, upper_open: bool) -> float:
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise TypeError(f"expected eps to be a number, got {type(eps).__name__}")
    top_ok = eps < 1 if upper_open else eps <= 1
    if not (MIN_EPS <= eps and top_ok):
        bound = "< 1" if upper_open else "<= 1"
        raise ValueError(f"expected eps >= {MIN_EPS:g} and {bound}, got {eps}")
    return float(eps)


def _prepare(scores: torch.Tensor, k: int, check: bool) -> tuple[torch.Tensor, int]:
    s = _frame.check_float(scores, "scores")
    k = _frame.check_count(k, "k")
    if check and s.numel() and not _frame.all_finite(s):
        raise ValueError("expected finite scores, got NaN or inf")
    return s, min(k, s.numel())


_ABS = 2
"""The ``side`` whose scores are ``|v|`` (:func:`select_abs`), as the kernels number it."""


class _Scores:
    """The scores a selector ranks: a tensor of them, or what a signed vector's side makes.

    ``side`` 0: ``v`` holds the scores; 1 or -1: the scores are ``max(v, 0)`` or ``max(-v, 0)``
    (RedSync's top and bottom sides); :data:`_ABS`: ``|v|``. On the Triton path (float32 and
    float64 for the searches, any float for the exact top-k) each pass computes the scores as
    it reads ``v``, so they are never written; elsewhere they are materialised once, when first
    asked for.
    """

    def __init__(self, v: torch.Tensor, side: int = 0):
        self.v, self.side = v, side
        self.what = "scores" if side == 0 else "values"  # what a NaN/inf error names
        self.fused = _frame.use_triton(v) and v.dtype in (torch.float32, torch.float64)
        self._s: torch.Tensor | None = v if side == 0 else None

    @property
    def tensor(self) -> torch.Tensor:
        """The scores, materialised on first use."""
        if self._s is None:
            self._s = self._of(self.v)
        return self._s

    def _of(self, values: torch.Tensor) -> torch.Tensor:
        if self.side == _ABS:
            return values.abs()
        return values.clamp(min=0) if self.side > 0 else values.neg().clamp_(min=0)

    def numel(self) -> int:
        """How many scores."""
        return self.v.numel()

    def stats(self, check: bool) -> tuple[float, float]:
        """Return the mean and max of the scores (one host read); ``check``: refuse NaN/inf.

        RedSync's thresholds interpolate between the two. (The Triton path reads them with
        its first counts: :meth:`_Counts.start`.)
        """
        _finite(self, check)
        s = self.tensor
        if _frame.numpy_float(s):  # numpy's float64 mean: 3x torch's on a CPU
            a = s.numpy()
            return float(np.mean(a, dtype=np.float64)), float(a.max())
        mean, top = torch.stack([s.mean(dtype=torch.float64), s.max().to(torch.float64)]).tolist()
        return mean, top  # one host read

    def above(self, threshold: float, count: int, runs: torch.Tensor | None = None
              ) -> torch.Tensor:
        """Return the ascending indices of the ``count`` scores above ``threshold`` (>= 0).

        The searches know ``count`` from their counts, so the Triton path writes the indices
        without a host read (``torch.nonzero`` reads its size back), and from the ``runs``
        of the pass that counted ``threshold`` (:meth:`_Counts.runs`) without a count of its
        own.
        """
        if self.fused:
            return _frame.kernels().indices_above(self.v, threshold, count, self.side,
                                                  runs=runs)
        above = _greater(self.tensor, threshold)
        if isinstance(above, np.ndarray):
            return torch.from_numpy(np.flatnonzero(above))
        return torch.nonzero(above).reshape(-1)

    def top(self, k: int) -> torch.Tensor:
        """Return :func:`topk`'s indices of the scores (no check).

        A side's scores are not written where a kernel (Triton) or the sampled bracket (the
        numpy path) compares ``v`` itself.
        """
        if self.side and _frame.use_triton(self.v) and 0 < k < self.numel():
            return _frame.kernels().top_indices(self.v, k, self.side)
        if self.side and self._s is None and _frame.numpy_float(self.v) \
                and _bracketable(self.numel(), k):
            chosen = _bracketed(self.v.numpy(), k, self.side)
            if chosen is not None:
                return torch.from_numpy(chosen)
        return _exact(self.tensor, k)

    def at(self, idx: torch.Tensor) -> torch.Tensor:
        """Return the scores at ``idx``."""
        if self._s is None:
            return self._of(self.v[idx])
        return self._s[idx]

    def top_above(self, threshold: float, count: int, runs: torch.Tensor | None, k: int
                  ) -> torch.Tensor:
        """Return :func:`topk`'s indices (ascending) among :meth:`above`'s (no check).

        Of the ``count`` scores above ``threshold`` (>= 0), the ``k`` largest. On the Triton
        path the pass that writes the survivors' indices writes their scores beside them, and
        the kernels rank those: no gather of ``v`` at the indices, a scattered read (in
        RedSync's encode of 64M elements on an H100, most likely a torch index kernel of 92
        us).
        """
        if self.side and self.fused and 0 < k < count:
            keep, scores = _frame.kernels().indices_above(self.v, threshold, count, self.side,
                                                          runs=runs, scores=True)
            return keep[_frame.kernels().top_indices(scores, k, 0)]
        keep = self.above(threshold, count, runs)
        return keep[_exact(self.at(keep), k)]


LEVELS = 6
"""Bisection levels a device settles per host read: the ``2**LEVELS - 1`` thresholds the next
levels can probe are counted in one pass, and the search replays its steps on those counts."""


class _Counts:
    """How many scores exceed a threshold, fetched ahead for the device paths.

    On the numpy path each count is one vectorised pass, asked for when the search needs it.
    Off it (CUDA) a host read waits for the device, so each read brings the counts of every
    threshold the next :data:`LEVELS` steps of the search could ask for, from one pass
    (``bucketize`` against the sorted thresholds, then a histogram). The counts are exact
    integers and each threshold is rounded to the scores' dtype as a comparison rounds it, so
    both ways give the search the same numbers and the same result.
    """

    def __init__(self, scores: _Scores):
        self.scores = scores
        self.known: dict[float, int] = {}
        # the Triton path's per-program counts of each threshold: its fetch's, and the column
        self._runs: dict[float, tuple[object, int]] = {}
        # float32 and float64 compare with the threshold rounded to their own dtype on every
        # device; 16-bit scores may compare in float32 on a GPU, so they ask one at a time.
        v = scores.v
        self.ahead = not _frame.use_numpy(v) and v.dtype in (torch.float32, torch.float64)

    def __call__(self, threshold: float, speculate) -> int:
        """Return how many scores exceed ``threshold``; ``speculate()`` lists what may follow."""
        if threshold not in self.known:
            if not self.ahead:
                # count_nonzero: a bool sum goes through int64, several times slower on a CPU
                above = _greater(self.scores.tensor, threshold)
                self.known[threshold] = int(np.count_nonzero(above)
                                            if isinstance(above, np.ndarray)
                                            else torch.count_nonzero(above))
            else:
                # 0.0 rides along the first fetch: how many scores are positive, which tells
                # RedSync's sides how many selected values have the side's sign.
                extra = set() if 0.0 in self.known else {0.0}
                self._fetch(sorted({threshold, *extra, *speculate()}))
        return self.known[threshold]

    def start(self, check: bool, coefs: list[float]) -> tuple[float, float]:
        """Return the scores' mean and max, with the counts of a search's first thresholds.

        Those are ``0.0`` and ``mean + c * (top - mean)`` for each ``c`` of ``coefs``: on the
        Triton path the device makes them from its own statistics
        (:func:`~bitcomm.codecs._kernels.stats_and_counts`), so the statistics and the counts
        come back in one host read where reading the statistics first would take two.
        ``check``: refuse NaN/inf. The counts are kept where the device's thresholds are
        the host's, bit for bit (the same float64 operations, rounded alike); otherwise the
        search fetches them as it would have.
        """
        src = self.scores
        order = sorted(set(coefs))
        out, t, runs = _frame.kernels().stats_and_counts(src.v, order, src.side)
        got = out.tolist()  # the one host read
        total, top, bad = got[:3]
        if check and bad:
            raise ValueError(f"expected finite {src.what}, got NaN or inf")
        mean = total / src.numel()
        thresholds = [0.0] + [mean + c * (top - mean) for c in order]  # ascending
        rounded = self._compared(thresholds)
        if np.array_equal(rounded.astype(np.float64), np.asarray(got[4 + t :])):
            self._keep(thresholds, rounded, rounded, [int(c) for c in got[5 : 5 + len(rounded)]],
                       runs)
        return mean, top

    def positive(self) -> int | None:
        """How many scores are positive, if a fetch brought it along (else ``None``)."""
        return self.known.get(0.0)

    def runs(self, threshold: float) -> torch.Tensor | None:
        """Return the per-program counts above a fetched ``threshold`` (Triton path, else None).

        For :meth:`_Scores.above`: the gathering pass of the survivors starts from them.
        """
        if threshold not in self._runs:
            return None
        runs, j = self._runs[threshold]
        return runs.above(j)

    def _compared(self, thresholds: list[float]) -> np.ndarray:
        # the thresholds rounded to the scores' dtype, as a comparison rounds them
        return np.asarray(thresholds, dtype=np.float64).astype(
            np.float32 if self.scores.v.dtype == torch.float32 else np.float64)

    def _keep(self, thresholds: list[float], rounded: np.ndarray, order: np.ndarray,
              above: list[int], runs: object) -> None:
        # Each threshold's count (and runs) from `above`, the counts of the sorted bounds
        # `order`: that of its first copy among them (equal ones agree).
        for t, j in zip(thresholds, np.searchsorted(order, rounded), strict=True):
            self.known[t] = above[int(j)]
            if runs is not None:
                self._runs[t] = (runs, int(j))

    def _fetch(self, thresholds: list[float]) -> None:
        v = self.scores.v
        rounded = self._compared(thresholds)
        order = np.sort(rounded)
        runs = None
        if self.scores.fused:  # one pass over v, a histogram of positions among the bounds
            counted, runs = _frame.kernels().count_above(v, order, self.scores.side,
                                                         runs=True)
            above = counted.tolist()
        else:
            bounds = _frame.to_device(torch.from_numpy(order), v.device)
            s = self.scores.tensor
            ids = torch.bucketize(s, bounds, out_int32=True)  # how many bounds lie below
            hist = torch.bincount(ids, minlength=len(thresholds) + 1)
            above = hist.flip(0).cumsum(0).flip(0)[1:].tolist()  # the one host read
        self._keep(thresholds, rounded, order, above, runs)


def _greater(s: torch.Tensor, threshold: float) -> torch.Tensor | np.ndarray:
    """Return the mask of the scores above ``threshold``: a numpy array on the numpy path.

    numpy compares about 2.5x faster than torch on a CPU; the threshold is rounded to the
    scores' dtype first, as torch's comparison with a Python float rounds it.
    """
    if not _frame.numpy_float(s):
        return s > threshold
    a = s.numpy()
    return np.greater(a, _frame.rounded(threshold, a))


def _halvings(lo, hi, mid, levels: int) -> list:
    """Return the midpoints ``mid(a, b)`` that ``levels`` steps of bisection of (lo, hi) visit."""
    out, spans = [], [(lo, hi)]
    for _ in range(levels):
        nxt = []
        for a, b in spans:
            m = mid(a, b)
            if a < m < b:
                out.append(m)
                nxt += [(a, m), (m, b)]
        spans = nxt
    return out


def _halve_steps(a: int, b: int) -> int:
    return (a + b) // 2


def _halve_ratios(a: float, b: float) -> float:
    return a + (b - a) / 2


def _step_coef(eps: float, step: int) -> float:
    # Where the trimmed search's threshold of a step lies between the mean (0) and the max (1).
    return 1.0 - eps * step


def _first_coefs(method: str, eps: float) -> list[float]:
    """Return the ``c`` of the thresholds ``mean + c * (top - mean)`` a search counts first.

    Its first step's, and those of the :data:`LEVELS` bisection steps after it.
    """
    if method == "trimmed":
        last = math.floor(1 / eps)
        return [_step_coef(eps, s) for s in (last, *_halvings(0, last, _halve_steps, LEVELS))]
    return [0.0, *_halvings(0.0, 1.0, _halve_ratios, LEVELS)]


def _all(s: torch.Tensor) -> torch.Tensor:
    return torch.arange(s.numel(), device=s.device)


def _exact(s: torch.Tensor, k: int) -> torch.Tensor:
    """Exact top-k indices (ascending), ties at the k-th value towards lower indices."""
    n = s.numel()
    if k == 0:
        return torch.empty(0, dtype=torch.int64, device=s.device)
    if k >= n:
        return _all(s)
    if _frame.use_triton(s):  # radix selection: no sort, no host read
        return _frame.kernels().top_indices(s, k)
    if _frame.numpy_float(s):
        a = s.numpy()
        if _bracketable(n, k):
            chosen = _bracketed(a, k)
            if chosen is not None:
                return torch.from_numpy(chosen)
        return torch.from_numpy(_top_positions(a, k).astype(np.int64))
    # NaN ranks above every score (torch.topk puts it first), NaN ties to the lower index:
    # the first k NaN, then the scores above the k-th value of the rest (the least of the
    # top k that is not NaN; inf when they all are), then the ties at it that fit, in index
    # order.
    top = torch.topk(s, k, sorted=False).values
    kth = torch.where(torch.isnan(top), math.inf, top).min()
    nan = torch.isnan(s)
    above, equal = s > kth, s == kth
    need = k - nan.sum().clamp(max=k) - above.sum()
    chosen = (nan & (torch.cumsum(nan, 0) <= k)) | above | (
        equal & (torch.cumsum(equal, 0) <= need))
    if _frame.use_numpy(s):
        return torch.nonzero(chosen).reshape(-1)
    # On a device nonzero's size is a host read, which waits for the device. The same set
    # without one: every chosen index written to its rank among the chosen (the others to a
    # spare slot past k).
    slot = torch.where(chosen, torch.cumsum(chosen, 0) - 1, k)
    out = torch.zeros(k + 1, dtype=torch.int64, device=s.device)
    return out.scatter_(0, slot, torch.arange(n, device=s.device))[:k]


def _bracketable(n: int, k: int) -> bool:
    """Whether the numpy path's top-k of ``n`` scores starts from a sampled bound."""
    return n >= _bracket.MIN_N and 0 < k <= n // 8


def _numpy_scores(a: np.ndarray, side: int) -> np.ndarray:
    """Return the scores of ``a`` on a side (:class:`_Scores`), as numpy computes them."""
    if side == 0:
        return a
    if side == _ABS:
        return np.abs(a)
    return np.maximum(a if side > 0 else np.negative(a), a.dtype.type(0))


def _bracketed(a: np.ndarray, k: int, side: int = 0) -> np.ndarray | None:
    """Return :func:`_exact`'s indices of ``a``'s scores from those at or above a sampled bound.

    Scores as :class:`_Scores` makes them of ``a`` on ``side``. The bound is
    :mod:`~bitcomm.codecs._bracket`'s: the ``rank(n, k)``-th largest score of its stratified
    sample (8M scores, k = 1%: about 1.5k scores at or above it). When k or more scores lie
    strictly above the bound (NaN, which ranks above every score as in ``np.partition``, among
    them), their top k is the top k of ``a``: one comparison and one index scan of ``a``,
    where partitioning it copies and reorders every score (8M, k = 1%: 18 -> 6.5 ms). When
    fewer do but k reach it, the k-th largest is the bound itself: every score above it, then
    the first ties at it in index order, and nothing is partitioned. numpy's introselect slows
    down more than 10x on a mass of equal scores, such as the exact zeros of a ReLU network's
    gradient, wherever the k-th largest lies, and the mass then sits at or below the bound. A
    side's scores are compared through ``a`` (above ``b > 0``: ``a > b``, ``a < -b`` or
    either) and only the candidates' are written. ``None`` when the sample misjudged (fewer
    than k scores reach the bound), its bound is NaN (it holds that many NaN) or, on a side,
    its bound is a zero score (whose ties are most of the vector): the caller then ranks the
    scores whole.
    """
    n = a.size
    sample = _numpy_scores(a[_bracket.positions(n)], side)
    r = _bracket.rank(n, k)
    bound = np.partition(sample, sample.size - r)[sample.size - r]
    if np.isnan(bound) or (side and not bound > 0):
        return None
    # at most the bound, so that NaN counts above it
    if side == _ABS:
        over = np.less_equal(a, bound)
        np.logical_and(over, np.greater_equal(a, -bound), out=over)
    elif side < 0:
        over = np.greater_equal(a, -bound)
    else:
        over = np.less_equal(a, bound)
    np.logical_not(over, out=over)  # above the bound, or NaN
    above = np.flatnonzero(over)
    if above.size >= k:  # above is ascending, so the result is too
        return above[_top_positions(_numpy_scores(a[above], side), k)]
    ties = _first_equal(a, bound, k - above.size, side)
    if ties is None:
        return None
    return np.sort(np.concatenate([above, ties]))


_TIE_SLICE = 1 << 20
"""Scores a search for the first ties compares at a time."""


def _first_equal(a: np.ndarray, value: float, count: int, side: int = 0) -> np.ndarray | None:
    """Return the first ``count`` positions whose score equals ``value``, or ``None``.

    ``None`` if fewer do; scores as ``side`` of ``a`` makes them. A slice at a time, so that a
    mass of ties (most of ``a``) costs a slice, not an index of every one of them.
    """
    found, got = [], 0
    for start in range(0, a.size, _TIE_SLICE):
        part = _numpy_scores(a[start : start + _TIE_SLICE], side)
        pos = np.flatnonzero(part == value)[: count - got]
        found.append(pos + start)
        got += pos.size
        if got == count:
            return np.concatenate(found)
    return None


def _top_positions(a: np.ndarray, k: int) -> np.ndarray:
    """Return the positions (ascending) of the ``0 < k <= a.size`` largest of ``a``.

    numpy's introselect finds the k-th value about 10x faster than torch.topk on a CPU (8M
    scores, k = 1%: 14 against 139 ms), and its index scans 7x faster than nonzero. Ties at the
    k-th value go to the lowest positions. NaN ranks above every score (``np.partition`` puts
    it last, torch.topk first), NaN ties to the lowest positions too; when fewer than k are
    NaN the top slice holds them all, and its least other value is the k-th of the rest.
    """
    top = np.partition(a, a.size - k)[a.size - k :]
    kth = top.min()
    if np.isnan(kth):
        nan = np.flatnonzero(np.isnan(a))
        if nan.size >= k:
            return nan[:k]
        kth = np.nanmin(top)
        k -= nan.size
    else:
        nan = np.empty(0, dtype=np.int64)
    above = np.flatnonzero(a > kth)
    equal = np.flatnonzero(a == kth)[: k - above.size]
    return np.sort(np.concatenate([nan, above, equal]))


def topk(scores: torch.Tensor, k: int, *, check: bool = True) -> torch.Tensor:
    """Return the indices of the k largest scores in ascending order (ties: lower index first).

    Args:
        scores: non-negative float tensor (flattened).
        k: how many to select; more than ``n`` selects everything.
        check: raise ``ValueError`` on NaN or inf scores (skip if the caller checked).

    """
    s, k = _prepare(scores, k, check)
    return _exact(s, k)


def trimmed_topk(scores: torch.Tensor, k: int, *, eps: float = 0.2, check: bool = True
                 ) -> torch.Tensor:
    """Return the same indices as :func:`topk`, sorting only scores above a trimmed threshold.

    Args:
        scores: non-negative float tensor.
        k: how many to select.
        eps: step by which the threshold ratio decreases (RedSync Algorithm 2 uses 0.2).
        check: raise ``ValueError`` on NaN or inf scores.

    """
    s, k = _prepare(scores, k, check=False)
    return _search(_Scores(s), k, "trimmed", eps, check)[0]


def _finite(src: _Scores, check: bool, count: bool = False) -> int | None:
    """Check the scores' vector on the paths that skip the statistics (whose read carries it).

    With ``count``, a check on the Triton path of a side's scores brings back, in its one
    read, how many scores are positive; otherwise the result is ``None``.
    """
    if count and check and src.fused and src.side in (1, -1) and src.numel():
        _, _, bad, positive = _frame.kernels().score_stats(src.v, src.side).tolist()
        if bad:
            raise ValueError(f"expected finite {src.what}, got NaN or inf")
        return int(positive)
    if check and src.numel() and not _frame.all_finite(src.v):
        raise ValueError(f"expected finite {src.what}, got NaN or inf")
    return None


def _search(src: _Scores, k: int, method: str, eps: object, check: bool, count: bool = False
            ) -> tuple[torch.Tensor, int | None]:
    """Run RedSync's ``"trimmed"`` or ``"threshold"`` search; their common start.

    Returns the indices and how many of them have a positive score, where the reads the
    search made tell it (else ``None``); ``count``: its check may bring that number back.
    """
    eps = _check_eps(eps, upper_open=method == "threshold")
    if k == 0 or k >= src.numel():
        return _top_counted(src, k, _finite(src, check, count))
    counts = _Counts(src)
    if src.fused:  # the statistics with the first counts, in one read
        mean, top = counts.start(check, _first_coefs(method, eps))
    else:
        mean, top = src.stats(check)
    search = _trimmed if method == "trimmed" else _threshold
    return search(src, k, eps, mean, top, counts)


def _top_counted(src: _Scores, k: int, positive: int | None
                 ) -> tuple[torch.Tensor, int | None]:
    """Return the exact top-k and how many of them are positive.

    Given the ``positive`` count of all the scores: every one of the k, unless fewer are.
    """
    return src.top(k), None if positive is None else min(k, positive)


def _checks_top(src: _Scores, k: int) -> bool:
    """Whether :func:`_census_top` selects: a checked top-k of ``max(+-v, 0)`` or ``|v|``."""
    return src.fused and src.side != 0 and 0 < k < src.numel()


def _census_top(src: _Scores, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Return the exact top-k of ``src``'s scores (:func:`_checks_top`) and its census, unread.

    The selection's own first read of ``v`` (from a sampled bound) also finds any NaN or inf
    in ``v``, and its writing pass counts the positive scores chosen (:func:`_read_census`):
    no read of ``v`` for the check.
    """
    return _frame.kernels().top_indices(src.v, k, src.side, census=True)


def _read_census(src: _Scores, census: torch.Tensor) -> int:
    """Raise ``ValueError`` if the census found NaN or inf; return how many chosen are positive.

    One host read.
    """
    bad, positive = census.tolist()
    if bad:
        raise ValueError(f"expected finite {src.what}, got NaN or inf")
    return positive


def _fallback(src: _Scores, k: int, counts: _Counts) -> tuple[torch.Tensor, int | None]:
    """Return the searches' exact top-k with the count of positive scores the counts brought."""
    return _top_counted(src, k, counts.positive())


def _trimmed(src: _Scores, k: int, eps: float, mean: float, top: float, counts: _Counts
             ) -> tuple[torch.Tensor, int | None]:
    def threshold(step: int) -> float:
        return mean + _step_coef(eps, step) * (top - mean)

    halve = _halve_steps

    def kept(step: int, lo: int, hi: int) -> int:
        # what the search may ask next: the steps of the bisection of (lo, hi)
        return counts(threshold(step), lambda: [threshold(m) for m in
                                                _halvings(lo, hi, halve, LEVELS)])

    # Steps 1..last keep the threshold at or above the mean; below it the survivors would be
    # most of the tensor anyway, so the exact top-k runs on all of it.
    last = math.floor(1 / eps)
    if last < 1 or kept(last, 0, last) < k:
        return _fallback(src, k, counts)
    lo, hi = 0, last  # kept(lo) < k (step 0 is the max itself), kept(hi) >= k
    while hi - lo > 1:  # at most log2(1 / eps) + 1 passes
        mid = halve(lo, hi)
        if kept(mid, lo, hi) >= k:
            hi = mid
        else:
            lo = mid
    # a count already fetched
    # above a threshold at or above the mean (>= 0): every one is positive
    return src.top_above(threshold(hi), kept(hi, lo, hi), counts.runs(threshold(hi)), k), k


def threshold_search(scores: torch.Tensor, k: int, *, eps: float = 1e-3, check: bool = True
                     ) -> torch.Tensor:
    """Return at least k indices (ascending) whose scores exceed a binary-searched threshold.

    Args:
        scores: non-negative float tensor.
        k: the least number to select; the search aims for k to 2k.
        eps: stop when the ratio interval is narrower than this.
        check: raise ``ValueError`` on NaN or inf scores.

    """
    s, k = _prepare(scores, k, check=False)
    return _search(_Scores(s), k, "threshold", eps, check)[0]


def _threshold(src: _Scores, k: int, eps: float, mean: float, top: float, counts: _Counts
               ) -> tuple[torch.Tensor, int | None]:
    def threshold(ratio: float) -> float:
        return mean + ratio * (top - mean)

    halve = _halve_ratios

    def above(ratio: float, lo: float, hi: float) -> int:
        # what the search may ask next: the ratios of the bisection of (lo, hi)
        return counts(threshold(ratio), lambda: [threshold(r) for r in
                                                 _halvings(lo, hi, halve, LEVELS)])

    if above(0.0, 0.0, 1.0) < k:
        return _fallback(src, k, counts)
    lo, hi = 0.0, 1.0  # invariant: at least k scores exceed the threshold at ratio lo
    for _ in range(math.ceil(math.log2(1 / eps)) + 1):  # each round halves hi - lo
        if hi - lo <= eps:
            break
        mid = halve(lo, hi)
        nnz = above(mid, lo, hi)
        if k <= nnz <= 2 * k:
            lo = mid
            break
        if nnz < k:
            hi = mid
        else:
            lo = mid
    count = above(lo, lo, hi)  # already fetched; above the mean (>= 0), so all positive
    return src.above(threshold(lo), count, counts.runs(threshold(lo))), count


def select_side(v: torch.Tensor, k: int, side: int, method: str = "topk", *,
                check: bool = True, positive: bool = False,
                then: Callable[[torch.Tensor], _T] | None = None, **options: float
                ) -> torch.Tensor | _T:
    """Select among the scores ``max(v, 0)`` (``side=1``) or ``max(-v, 0)`` (``side=-1``).

    The same indices as ``select(scores, k, method, **options)`` on those scores, for
    RedSync's sides. On the Triton path ``"topk"`` and the threshold searches (``"trimmed"``,
    ``"threshold"``) compute the scores inside their passes over ``v`` instead of writing them,
    and ``check`` (NaN or inf anywhere in ``v``: ``ValueError``) rides on the searches' first
    read, and on the exact top-k's when it starts from a sampled bound
    (:func:`~bitcomm.codecs._kernels.top_indices`).

    With ``positive`` only the selected indices whose score is positive are kept: the values
    of the side's sign, without zeros (what RedSync sends). Their number takes a host read
    unless a read the selection makes anyway brings it. Off the numpy path a search's
    selection above its threshold is all positive, and its first fetch of counts brings the
    number of positive scores for when it falls back to the exact top-k; on the Triton path
    the check of ``"topk"`` (with ``check``) brings that number too.

    ``then``: a function of the indices whose result is returned in their place (RedSync's
    frame). With ``positive``, ``check`` and ``"topk"`` on the Triton path the check's host
    read, which says how many are positive, then waits behind ``then``'s launches too:
    ``then`` runs on the k indices as if all were positive, and again on the positive ones
    where fewer are (or raises the check's error).
    """
    if side not in (1, -1):
        raise ValueError(f"expected side 1 or -1, got {side!r}")
    if not isinstance(positive, bool):
        raise TypeError(f"expected positive to be a bool, got {type(positive).__name__}")
    v = _frame.check_float(v, "v")
    src = _Scores(v, side)
    if then is None:
        then = _same
    k = min(_frame.check_count(k, "k"), src.numel())
    if positive and check and method == "topk" and not options and _checks_top(src, k):
        idx, census = _census_top(src, k)
        out = then(idx)  # as if all k were positive: they are where k or more scores are
        count = _read_census(src, census)
        return out if count == k else then(_positive(src, idx, count))
    idx, count = _select_of(src, k, method, check, options, positive)
    if not positive or count == idx.numel():
        return then(idx)
    return then(_positive(src, idx, count))


def _same(idx: torch.Tensor) -> torch.Tensor:
    return idx


def _positive(src: _Scores, idx: torch.Tensor, count: int | None) -> torch.Tensor:
    # The selected indices whose score is positive; `count`: their number, or None (a host
    # read then finds it).
    keep = src.at(idx) > 0
    if count is None:
        return idx[torch.nonzero(keep).reshape(-1)]  # one host read: their number
    return idx[_frame.indices_of(keep, count)]


def select_abs(v: torch.Tensor, k: int, method: str = "topk", *, check: bool = True,
               **options: float) -> torch.Tensor:
    """Select among the scores ``|v|``: top-k by magnitude, as sparse frames send.

    The same indices as ``select(v.abs(), k, method, **options)``. On the Triton path
    ``"topk"`` and the threshold searches read ``v`` and never write ``|v|``; ``check``
    (NaN or inf in ``v``: ``ValueError``) rides on the searches' first read, and on the exact
    top-k's from a sampled bound.
    """
    return _select_of(_Scores(_frame.check_float(v, "v"), _ABS), k, method, check, options)[0]


def _select_of(src: _Scores, k: int, method: str, check: bool, options: dict,
               count: bool = False) -> tuple[torch.Tensor, int | None]:
    """Return the selection of ``src``'s scores and, where known, how many are positive.

    ``count``: the caller wants that number, so the finiteness check of ``"topk"`` and the
    searches' shortcuts brings it back where it can in its read.
    """
    k = min(_frame.check_count(k, "k"), src.numel())
    if method in ("trimmed", "threshold"):
        eps = options.pop("eps", 0.2 if method == "trimmed" else 1e-3)
        if options:
            raise TypeError(f"{method} takes only eps, got {sorted(options)}")
        return _search(src, k, method, eps, check, count)
    if method == "topk":
        if options:
            raise TypeError(f"topk takes no options, got {sorted(options)}")
        if check and _checks_top(src, k):
            idx, census = _census_top(src, k)
            return idx, _read_census(src, census)
        return _top_counted(src, k, _finite(src, check, count))
    _finite(src, check)
    return select(src.tensor, k, method, check=False, **options), None


def select(scores: torch.Tensor, k: int, method: str = "topk", *, check: bool = True,
           **options: float) -> torch.Tensor:
    """Dispatch to a selector by name (one of :data:`METHODS`) with its options."""
    if method == "topk":
        if options:
            raise TypeError(f"topk takes no options, got {sorted(options)}")
        return topk(scores, k, check=check)
    if method == "trimmed":
        return trimmed_topk(scores, k, check=check, **options)
    if method == "threshold":
        return threshold_search(scores, k, check=check, **options)
    if method in SIDCO:
        return sidco.sidco(scores, k, SIDCO[method], check=check, **options)
    raise ValueError(f"expected method in {METHODS}, got {method!r}")
