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

Example: scores ``[4, 3, 2, 1, 0, 0, 0, 0]`` with ``k = 2`` (``delta = 0.25``), exponential
stage: scaled scores have mean ``10 / 32 = 0.3125`` of the largest (4), ``eta = 4 * 0.3125 *
ln 4 = 1.733``, so indices ``[0, 1, 2]`` are kept (``k_hat = 3``).
"""

from __future__ import annotations

import dataclasses
import math

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
    if check and s.numel():
        if not _frame.all_finite(s):
            raise ValueError("expected finite scores, got NaN or inf")
        if bool((s < 0).any()):
            raise ValueError("expected non-negative scores (|g| or a clamp of it)")
    if s.numel() == 0:
        return math.inf
    # Scaled by the largest score (a tensor: the quotient is correctly rounded on every
    # device); each stage reads what its fit needs, with the range, in one host read.
    top = s.max().to(torch.float64)
    y = s.to(torch.float64) / top
    if delta >= first:
        stages = 1
    ratios = [delta] if stages == 1 else \
        [first] + [(delta / first) ** (1 / (stages - 1))] * (stages - 1)
    eta, scale = 0.0, None
    for m, ratio in enumerate(ratios):
        if m and y.numel():
            y = y[y >= eta]  # the exceedances, still in scaled units
        if y.numel() == 0:
            break
        z = y - eta if m else y  # later stages fit the exceedances over eta
        gamma = m == 0 and dist == "gamma-pareto"
        # the positive values (a gamma fit's data; the smallest is kept when a fit fails)
        pos = y[y > 0] if gamma else None
        least = torch.where(y > 0, y, math.inf).min()
        if gamma:
            fitted = [pos.mean(), pos.log().mean()]
        elif dist == "exponential":
            fitted = [z.mean()]
        else:
            fitted = [z.mean(), z.var(correction=0)]
        low, high, head, scale, smallest, *moments = torch.stack(
            [y.min(), y.max(), y[0], top, least, *fitted]).tolist()  # the stage's one read
        if scale <= 0:
            return math.inf
        if low == high:  # equal values: keep them all
            eta = eta if m else head
            break
        if gamma:  # fitted to the positive values, for their share of the target
            fit = _gamma(*moments, min(1.0, ratio * y.numel() / pos.numel()))
        elif dist == "exponential":
            fit = _exponential(*moments, ratio)
        else:
            fit = _pareto(*moments, ratio)
        if fit is None:  # the positive values are all equal: keep them all
            eta = smallest
            break
        eta += fit
    return eta * scale if scale is not None else math.inf


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
