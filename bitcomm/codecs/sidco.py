"""SIDCo's statistical thresholds: fit a sparsity-inducing distribution, read off its quantile.

SIDCo (Abdelmoniem et al., Sections 2.3-3 and Appendix B.3) models the scores (``|g|`` for
gradients) as draws from a distribution with a heavy mass near zero and picks the threshold
``eta`` that a fraction ``delta = k / n`` of draws exceed: ``eta = F^-1(1 - delta)`` of the
fitted distribution. One linear pass per stage, no sort. Three fits:

* ``"exponential"`` (SIDCo-E): ``|g| ~ Exp(beta)``, ``beta`` the mean (its maximum-likelihood
  estimate), ``eta = beta * ln(1 / delta)``.
* ``"pareto"`` (SIDCo-P): a generalized Pareto of location 0 by moments, ``mu`` and ``s2`` the
  mean and variance: ``xi = (1 - mu**2 / s2) / 2``, ``beta = mu * (mu**2 / s2 + 1) / 2``,
  ``eta = beta / xi * (delta**-xi - 1)`` (``beta * ln(1 / delta)`` as ``xi -> 0``).
* ``"gamma-pareto"`` (SIDCo-GP): a gamma first, shape by the closed form of Appendix B.3
  (``s = ln(mean) - mean(ln |g|)``, ``alpha = (3 - s + sqrt((s - 3)**2 + 24 s)) / (12 s)``,
  ``beta = mean / alpha``), threshold by the exact inverse of the regularized incomplete gamma
  function (``eta = beta * P^-1(alpha, 1 - delta)``, by bisection here: the paper's closed-form
  bound is loose for ``alpha`` near 1); later stages fit generalized Paretos.

Multi-stage (Section 2.4). With ``stages = M > 1`` the first stage targets ``first`` (the
paper's ``delta_1 = 0.25``); each later stage fits the exceedances over the last threshold,
shifted by it (peaks over threshold: a generalized Pareto, or an exponential again for
SIDCo-E), with the ratio ``(delta / first) ** (1 / (M - 1))``, so the ratios multiply to
``delta``. A target at or above ``first`` runs one stage.

:class:`StageControl` is Algorithm 1's ``Adapt_Stages``: every ``period`` calls it compares the
mean of ``k_hat / k`` with ``1 +- tolerance`` and takes one stage off when too many were
selected, adds one when too few, within ``[1, ceil(log2(1 / delta))]``. Algorithm 1 as printed
sums ``k_hat`` over ``Q - 1`` calls but divides by ``Q``, and writes ``sigma`` where the Pareto
scale (its Lemma 2) needs ``sigma**2``; here the mean is over all ``period`` calls and the
equations' ``sigma**2`` is used.

Choices where the paper is silent, each a guard:

* Scores are divided by their largest value before fitting, so squares cannot overflow; the
  threshold is scaled back. The fit runs in float64.
* All-zero scores select nothing (no threshold separates equal values from nothing).
* The gamma fit needs ``ln |g|``: it fits the positive scores only and targets
  ``delta * n / n_positive`` of them (the zeros are below any threshold anyway).
* Zero variance (every remaining score equal) or no exceedance ends the stages early with the
  last threshold: no fit can split equal values, and an empty stage has nothing to fit.
* ``k_hat = 0`` is a ratio of 0 to the adaptation, which adds a stage.

Selection keeps every score ``>= eta`` (Algorithm 1's last line); the count ``k_hat`` is near
``k``, not equal to it.

Cost: the point of a fitted threshold is that it is cheaper than ranking the scores, so the fit
writes nothing the size of the vector where it can help it. On a CPU (numpy's float dtypes) the
range is numpy's min and max, the first stage's moments are summed in float64 a chunk of 64K
scores at a time (the chunks' variances combined pairwise, as exact as a two-pass variance), and
a later stage keeps the exceedances, compared in the scores' own dtype, as scaled float64 values. On
a GPU (the Triton path) each stage is one kernel that reads the scores, divides each by the
largest in float64 as the numpy path does, and sums a tile at a time, taking a later stage's
exceedances as it reads: one read of the scores a stage (and one reduction for the first
stage's range), nothing the size of the vector written, one host read a stage, which also
carries the range, so the checks cost no read of their own. Without triton, each stage is torch
ops over a scaled float64 copy, with one host read a stage (and one for the exceedances' mask).
The paths' thresholds agree to rounding, and their selections are the same.

Example: scores ``[4, 3, 2, 1, 0, 0, 0, 0]`` with ``k = 2`` (``delta = 0.25``), exponential
stage: scaled scores have mean ``10 / 32 = 0.3125`` of the largest (4), ``eta = 4 * 0.3125 *
ln 4 = 1.733``, so indices ``[0, 1, 2]`` are kept (``k_hat = 3``).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch

from bitcomm.codecs import _frame

__all__ = ["threshold", "sidco", "StageControl", "DISTRIBUTIONS", "FIRST", "max_stages"]

DISTRIBUTIONS = ("exponential", "pareto", "gamma-pareto")
"""The fits: SIDCo-E, SIDCo-P and SIDCo-GP."""
FIRST = 0.25
"""The first stage's target ratio in a multi-stage fit (the paper's ``delta_1``)."""
_BISECT = 200  # bisection steps for the inverse incomplete gamma (float64 needs < 100)


def max_stages(delta: float) -> int:
    """Return the most stages the adaptation uses at target ratio ``delta``."""
    return max(1, math.ceil(math.log2(1 / delta))) if delta < 1 else 1


def _check_delta(delta: object) -> float:
    if isinstance(delta, bool) or not isinstance(delta, (int, float)):
        raise TypeError(f"expected delta to be a number, got {type(delta).__name__}")
    if not 0 < delta <= 1:
        raise ValueError(f"expected delta in (0, 1], got {delta}")
    return float(delta)


def _check_stages(stages: object) -> int:
    stages = _frame.check_count(stages, "stages")
    if stages < 1:
        raise ValueError(f"expected stages >= 1, got {stages}")
    return stages


def _exponential(mu: float, delta: float) -> float:
    """Exponential by its mean ``mu``: the threshold a fraction ``delta`` exceeds."""
    return mu * math.log(1 / delta)


def _pareto(mu: float, var: float, delta: float) -> float | None:
    """Generalized Pareto (location 0) by moments; ``None`` when the values are all equal."""
    if var <= 0 or mu <= 0:
        return None
    r = mu * mu / var
    xi = 0.5 * (1 - r)
    beta = 0.5 * mu * (r + 1)
    if abs(xi) < 1e-12:
        return beta * math.log(1 / delta)
    return beta / xi * math.expm1(-xi * math.log(delta))


def _gamma_inverse(alpha: float, q: float) -> float:
    """Return ``x`` with ``Q(alpha, x) = q`` (upper regularized incomplete gamma), bisecting."""
    a = torch.tensor(alpha, dtype=torch.float64)

    def upper(x: float) -> float:
        return float(torch.special.gammaincc(a, torch.tensor(x, dtype=torch.float64)))

    lo, hi = 0.0, max(1.0, alpha)
    for _ in range(2100):  # Q falls below any q > 0 long before x overflows float64
        if upper(hi) <= q:
            break
        lo, hi = hi, 2 * hi
    for _ in range(_BISECT):
        mid = 0.5 * (lo + hi)
        if mid in (lo, hi):
            break
        if upper(mid) > q:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def _gamma(mu: float, log_mean: float, delta: float) -> float | None:
    """Gamma by the closed-form shape, threshold by the exact inverse; ``None`` if all equal.

    ``mu`` and ``log_mean`` are the mean and the mean log of the positive values, ``delta``
    the fraction of them to exceed.
    """
    s = math.log(mu) - log_mean
    if s <= 1e-12:  # every positive value equal (s >= 0 by Jensen)
        return None
    alpha = (3 - s + math.sqrt((s - 3) ** 2 + 24 * s)) / (12 * s)
    beta = mu / alpha
    return beta * _gamma_inverse(alpha, delta)


_CHUNK = 1 << 16
"""Scores the numpy path converts to float64 at a time (512 KB: the conversion stays in cache)."""


@dataclasses.dataclass(frozen=True)
class _Stage:
    """What one stage's fit reads of its scores ``y`` (scaled by the largest score).

    ``moments``, of ``z = y - eta`` (``eta`` the last stage's threshold): ``(mean,)`` for an
    exponential, ``(mean, variance)`` for a Pareto, ``(how many are positive, their mean,
    their mean log)`` of ``y`` for a gamma.
    """

    size: int
    low: float
    high: float
    moments: tuple[float, ...]


class _TorchStages:
    """The stages' scores on the torch path (any device): one host read a stage.

    The first stage reads the range with the moments (and so checks the scores without a read
    of its own); each later one keeps the exceedances of the last threshold, a mask whose
    size is one more read.
    """

    def __init__(self, s: torch.Tensor, check: bool):
        self.s, self.check = s, check
        self.y: torch.Tensor | None = None  # the stage's scores, float64, scaled
        self.top = math.nan

    def stage(self, eta: float, kind: str) -> _Stage | None:
        """Return the next stage's reading (``None``: no exceedance of ``eta``)."""
        if self.y is None:
            low, top = (v.to(torch.float64) for v in torch.aminmax(self.s))
            # scaled by a tensor: the quotient is correctly rounded on every device; in place,
            # so one float64 copy of the vector is alive, a copy even of float64 scores (they
            # are the caller's)
            y = self.s.to(torch.float64, copy=True)
            y /= top
            ends = [low, top]
        else:
            y = self.y[self.y >= eta]
            if y.numel() == 0:
                return None
            ends = list(torch.aminmax(y))
        z = y - eta if eta else y
        if kind == "gamma":
            pos = y > 0
            fitted = [pos.sum(), torch.where(pos, y, 0.0).sum(),
                      torch.where(pos, y, 1.0).log().sum()]
        elif kind == "exponential":
            fitted = [z.mean()]
        else:
            fitted = [z.mean(), z.var(correction=0)]
        low, high, *moments = torch.stack([*ends, *(f.to(torch.float64) for f in fitted)]
                                          ).tolist()  # the stage's one read
        if self.y is None:
            _check_range(low, high, self.check)
            self.top = high
            if not high > 0:
                return None
            low, high = low / high, 1.0
        self.y = y
        return _Stage(y.numel(), low, high, _fitted(kind, moments))

    def least(self) -> float:
        """Return the least positive score of the last stage (scaled)."""
        return float(torch.where(self.y > 0, self.y, math.inf).min())


class _TritonStages:
    """The stages' sums on the Triton path (a GPU's): one read of the scores a stage.

    Each stage is one kernel over the scores (:func:`bitcomm.codecs._kernels.sidco_stage`)
    that divides each by the largest in float64, as the numpy path does, and sums what the
    fit needs per tile; the first stage's range comes from one reduction before it, whose
    largest score the kernel reads on the device. A later stage takes the exceedances of the
    last threshold as it reads, so nothing the size of the vector is written and no mask's
    size is read: one host read a stage.
    """

    def __init__(self, s: torch.Tensor, check: bool):
        self.s, self.check = s.contiguous(), check
        self.top = math.nan
        self.taken: float | None = None  # the last stage's eta (None: it took every score)
        self.first = True

    def stage(self, eta: float, kind: str) -> _Stage | None:
        """Return the next stage's reading (``None``: no exceedance of ``eta``)."""
        k = _frame.kernels()
        if self.first:
            self.first = False
            low, top = torch.aminmax(self.s)
            sums = k.sidco_stage(self.s, kind, top)
            low, high, count, _, _, *moments = torch.cat(
                [torch.stack([low, top]).to(torch.float64), sums]).tolist()  # the stage's read
            _check_range(low, high, self.check)
            self.top = high
            if not high > 0:
                return None
            low, high = low / high, 1.0
        else:
            count, low, high, *moments = k.sidco_stage(self.s, kind, self.top, eta).tolist()
            if count == 0:
                return None
            self.taken = eta
        if kind == "exponential":
            moments = [moments[0] / count]
        elif kind == "pareto":
            moments = [moments[0], moments[1] / count]
        return _Stage(int(count), low, high, _fitted(kind, moments))

    def least(self) -> float:
        """Return the least positive score of the last stage (scaled)."""
        y = self.s.to(torch.float64)
        y /= torch.full((), self.top, dtype=torch.float64, device=y.device)  # correctly rounded
        taken = y > 0 if self.taken is None else (y > 0) & (y >= self.taken)
        return float(torch.where(taken, y, math.inf).min())


class _NumpyStages:
    """The stages' scores on the numpy path (CPU tensors of numpy's float dtypes).

    Nothing the size of the vector is written: the first stage's range is numpy's, its
    moments are summed in float64 a chunk of :data:`_CHUNK` scores at a time, and later stages
    keep the exceedances (scaled, float64) as the torch path does.
    """

    def __init__(self, s: torch.Tensor, check: bool):
        a = s.numpy()
        self.low, self.top = float(a.min()), float(a.max())
        _check_range(self.low, self.top, check)
        # the stage's scores are src / scale: the vector and its largest score at first, the
        # kept exceedances (scaled already) later
        self.src, self.scale, self.first = a, self.top, True

    def stage(self, eta: float, kind: str) -> _Stage | None:
        """Return the next stage's reading (``None``: no exceedance of ``eta``)."""
        if not self.top > 0:
            return None
        if self.first:
            low, high = self.low / self.top, 1.0
            self.first = False
        else:
            self.src, self.scale = _kept(self.src, self.scale, eta), 1.0
            if self.src.size == 0:
                return None
            low, high = float(self.src.min()), float(self.src.max())
        moments = _moments(self.src, self.scale, eta, kind)
        return _Stage(self.src.size, low, high, _fitted(kind, moments))

    def least(self) -> float:
        """Return the least positive score of the last stage (scaled)."""
        return float(self.src[self.src > 0].min()) / self.scale


def _check_range(low: float, high: float, check: bool) -> None:
    # The least and largest score tell both checks: NaN makes both NaN, inf is one of them.
    if not check:
        return
    if not (math.isfinite(low) and math.isfinite(high)):
        raise ValueError("expected finite scores, got NaN or inf")
    if low < 0:
        raise ValueError("expected non-negative scores (|g| or a clamp of it)")


def _fitted(kind: str, sums: list[float]) -> tuple[float, ...]:
    # A gamma stage's sums (positive count, sum and sum of logs of the positive) as the count
    # and the two means; the other fits' moments as they are.
    if kind != "gamma":
        return tuple(sums)
    positive, total, logs = sums
    return positive, total / positive, logs / positive


def _kept(src: np.ndarray, scale: float, eta: float) -> np.ndarray:
    # The scores src / scale (float64) at or above eta. They are picked in src's own dtype, a
    # chunk at a time (np.flatnonzero then a gather: a boolean index is twice as slow on a
    # mask without pattern), and only the kept ones are divided.
    floor = _floor(eta, scale, src.dtype.type)
    parts = []
    for lo in range(0, src.size, _CHUNK):
        part = src[lo : lo + _CHUNK]
        if floor is None:  # compared as quotients
            with np.errstate(invalid="ignore"):
                picked = np.divide(part, scale, dtype=np.float64) >= eta
        else:
            picked = part >= floor
        parts.append(part[np.flatnonzero(picked)])
    kept = np.concatenate(parts) if parts else src[:0]
    with np.errstate(invalid="ignore"):  # unchecked inf / inf is NaN, as on torch's path
        return np.divide(kept, scale, dtype=np.float64)


def _floor(eta: float, scale: float, dtype: type) -> np.floating | None:
    # The least value v of dtype whose quotient v / scale (in float64) reaches eta, or None
    # where no value is (eta NaN or beyond every quotient) or a few steps do not find it. The
    # quotient is monotone in v, and eta * scale rounded to dtype is within an ulp of dtype of
    # v, so a few steps from it find v; the last check keeps the steps' bound from deciding.
    def reaches(value: np.floating) -> bool:
        return bool(np.float64(value) / scale >= eta)

    with np.errstate(over="ignore", invalid="ignore"):
        v = dtype(eta * scale)
        for _ in range(4):
            below = np.nextafter(v, dtype(-np.inf))
            if not reaches(below):
                break
            v = below
        for _ in range(4):
            if reaches(v):
                break
            v = np.nextafter(v, dtype(np.inf))
        if reaches(v) and not reaches(np.nextafter(v, dtype(-np.inf))):
            return v
    return None


def _moments(src: np.ndarray, scale: float, eta: float, kind: str) -> list[float]:
    # What _TorchStages sums for the fit of kind, of y = src / scale in float64 (z = y - eta),
    # a chunk at a time: the chunks' means and squared deviations combine as Chan, Golub and
    # LeVeque's pairwise update does, which keeps the variance as exact as a two-pass one.
    buf = np.empty(min(src.size, _CHUNK), dtype=np.float64)
    count, total, logs, mean, m2 = 0, 0.0, 0.0, 0.0, 0.0
    for lo in range(0, src.size, _CHUNK):
        part = src[lo : lo + _CHUNK]
        y = buf[: part.size]
        with np.errstate(invalid="ignore"):  # unchecked inf / inf is NaN, as on torch's path
            np.divide(part, scale, out=y, dtype=np.float64)
        if kind == "gamma":
            pos = y > 0
            count += int(np.count_nonzero(pos))
            np.multiply(y, pos, out=y)  # negative scores (unchecked) weigh nothing
            total += float(y.sum())
            np.log(y, out=y, where=pos)  # log 1 nowhere: zeros stay zero
            logs += float(y.sum())
            continue
        if eta:
            y -= eta
        if kind == "exponential":
            total += float(y.sum())
            continue
        part_mean = float(y.sum()) / y.size
        y -= part_mean
        part_m2 = float(y @ y)
        grown = count + y.size
        delta = part_mean - mean
        mean += delta * y.size / grown
        m2 += part_m2 + delta * delta * count * y.size / grown
        count = grown
    if kind == "gamma":
        return [count, total, logs]
    if kind == "exponential":
        return [total / src.size]
    return [mean, m2 / src.size]


def threshold(scores: torch.Tensor, delta: float, dist: str = "exponential", stages: int = 1,
              *, first: float = FIRST, check: bool = True) -> float:
    """Return the threshold that a fraction ``delta`` of the scores are expected to reach.

    Args:
        scores: non-negative float tensor (flattened).
        delta: the target ratio ``k / n`` in (0, 1].
        dist: ``"exponential"``, ``"pareto"`` or ``"gamma-pareto"``.
        stages: the number of fitting stages ``M``.
        first: the first stage's ratio when ``M > 1``.
        check: raise ``ValueError`` on NaN, inf or negative scores.

    Returns ``inf`` for empty or all-zero scores (nothing is selected).

    """
    s = _frame.check_float(scores, "scores")
    delta = _check_delta(delta)
    stages = _check_stages(stages)
    if dist not in DISTRIBUTIONS:
        raise ValueError(f"expected dist in {DISTRIBUTIONS}, got {dist!r}")
    if not 0 < first < 1:
        raise ValueError(f"expected first in (0, 1), got {first}")
    if s.numel() == 0:
        return math.inf
    if delta >= first:
        stages = 1
    ratios = [delta] if stages == 1 else \
        [first] + [(delta / first) ** (1 / (stages - 1))] * (stages - 1)
    if _frame.numpy_float(s):
        data = _NumpyStages(s, check)
    elif _frame.use_triton(s):
        data = _TritonStages(s, check)
    else:
        data = _TorchStages(s, check)
    eta = 0.0
    for m, ratio in enumerate(ratios):
        gamma = m == 0 and dist == "gamma-pareto"
        stage = data.stage(eta, "gamma" if gamma else "exponential" if dist == "exponential"
                           else "pareto")
        if data.top <= 0:
            return math.inf
        if stage is None:  # no exceedance: nothing to fit
            break
        if stage.low == stage.high:  # equal values: keep them all
            eta = eta if m else stage.low
            break
        if gamma:  # fitted to the positive values, for their share of the target
            positive, *moments = stage.moments
            fit = _gamma(*moments, min(1.0, ratio * stage.size / positive))
        elif dist == "exponential":
            fit = _exponential(*stage.moments, ratio)
        else:
            fit = _pareto(*stage.moments, ratio)
        if fit is None:  # the positive values are all equal: keep them all
            eta = data.least()
            break
        eta += fit
    return eta * data.top


def sidco(scores: torch.Tensor, k: int, dist: str = "exponential", stages: int = 1, *,
          first: float = FIRST, check: bool = True) -> torch.Tensor:
    """Return the indices (ascending) of the scores at or above SIDCo's threshold for ``k``.

    The number selected is about ``k`` (how close depends on the fit); ``k = 0`` selects nothing
    and ``k >= n`` everything.

    Args:
        scores: non-negative float tensor (flattened).
        k: the target count.
        dist: ``"exponential"``, ``"pareto"`` or ``"gamma-pareto"``.
        stages: the number of fitting stages (see :class:`StageControl` to adapt it).
        first: the first stage's ratio when ``stages > 1``.
        check: raise ``ValueError`` on NaN, inf or negative scores.

    """
    s = _frame.check_float(scores, "scores")
    k = _frame.check_count(k, "k")
    n = s.numel()
    if k == 0 or k >= n:  # no fit: nothing or everything (threshold checks the rest)
        if check and n and not _frame.all_finite(s):
            raise ValueError("expected finite scores, got NaN or inf")
        return torch.arange(n if k else 0, device=s.device)
    eta = threshold(s, k / n, dist, stages, first=first, check=check)
    if _frame.numpy_float(s):
        a = s.numpy()
        return torch.from_numpy(np.flatnonzero(a >= _frame.rounded(eta, a)))
    return torch.nonzero(s >= eta).reshape(-1)


@dataclasses.dataclass
class StageControl:
    """Algorithm 1's adaptation of the number of stages, one per tensor that is selected from.

    Call :meth:`update` after each selection with the count it gave; every ``period`` calls the
    mean ratio ``k_hat / k`` moves :attr:`stages` by one when outside ``1 +- tolerance``.

    Attributes:
        stages: the number of stages the next selection uses.
        period: calls between adaptations (the paper's ``Q = 5``).
        tolerance: allowed relative error of the mean ratio (the paper's 20%).

    """

    stages: int = 1
    period: int = 5
    tolerance: float = 0.2
    _sum: float = 0.0
    _calls: int = 0

    def __post_init__(self) -> None:
        _check_stages(self.stages)
        if isinstance(self.period, bool) or not isinstance(self.period, int) or self.period < 1:
            raise ValueError(f"expected period to be an int >= 1, got {self.period!r}")
        if not 0 <= self.tolerance < 1:
            raise ValueError(f"expected tolerance in [0, 1), got {self.tolerance}")

    def update(self, selected: int, k: int, n: int) -> int:
        """Record one selection of ``selected`` for target ``k`` of ``n``; return the stages next.

        ``k = 0`` (nothing wanted) is not recorded.
        """
        if k <= 0:
            return self.stages
        self._sum += selected / k
        self._calls += 1
        if self._calls == self.period:
            mean = self._sum / self.period
            if mean > 1 + self.tolerance:
                self.stages -= 1
            elif mean < 1 - self.tolerance:
                self.stages += 1
            self.stages = min(max(self.stages, 1), max_stages(min(1.0, k / n)))
            self._sum, self._calls = 0.0, 0
        return self.stages

    def state_dict(self) -> dict[str, float]:
        """Return the state to resume from (as ``torch.optim`` state dicts do)."""
        return {"stages": self.stages, "sum": self._sum, "calls": self._calls}

    def load_state_dict(self, state: dict[str, float]) -> None:
        """Restore what :meth:`state_dict` returned."""
        self.stages, self._sum, self._calls = int(state["stages"]), float(state["sum"]), \
            int(state["calls"])
