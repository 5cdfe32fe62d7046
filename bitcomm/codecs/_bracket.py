"""The sampled bracket of an exact top-k, shared by the numpy path and the Triton kernels.

An exact top-k of ``n`` scores need not rank all of them. The ``r``-th largest score of a sample
of :data:`SAMPLE` of them, ``r`` a margin above the ``k * SAMPLE / n`` that the sample's share of
``k`` predicts, is a bound that a few more than ``k`` scores reach (about ``r * n / SAMPLE``).
Whenever at least ``k`` do, they hold the top k and every score tied with the k-th largest, so
the exact selection among them alone is the exact selection of the vector: one comparison of
each score with the bound, and the ranking of a few more than ``k`` candidates. When fewer reach
it (the sample misled, which the margin of six standard deviations makes rare for any order of
the scores but an adversarial one), the caller ranks the whole vector instead.

The sample is stratified: one score from each of :data:`SAMPLE` runs of ``n // SAMPLE``
consecutive scores, at an offset within the run that a multiplicative hash of the run's number
picks (:func:`positions`). A strided sample, the same offset in every run, sees a few columns
only of a row-major matrix whose rows divide the run, and the columns of a weight's gradient
differ in scale.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["SAMPLE", "MIN_N", "HASH", "positions", "rank"]

SAMPLE = 1 << 14
"""How many scores the bound is read from."""
MIN_N = 1 << 18
"""The fewest scores whose exact top-k starts from a sampled bound."""
HASH = 0x9E3779B1
"""The multiplier of the offsets' hash (the golden ratio's 32-bit fraction); the Triton sampling
kernel multiplies by the same constant."""


def positions(n: int) -> np.ndarray:
    """Return the int64 positions of the sample of ``n >= SAMPLE`` scores, ascending.

    Run ``s`` starts at ``s * step`` (``step = n // SAMPLE``); its score is at offset
    ``(h * step) >> 16``, ``h`` the high 16 bits of ``s * HASH mod 2**32``: an offset in
    ``[0, step)`` that varies from run to run without pattern.
    """
    step = n // SAMPLE
    s = np.arange(SAMPLE, dtype=np.int64)
    return s * step + ((((s * HASH) & 0xFFFFFFFF) >> 16) * step >> 16)


def rank(n: int, k: int) -> int:
    """Return ``r``: the sample's ``r``-th largest score bounds the top ``k`` of ``n``.

    Six standard deviations (of a Poisson count) above the sample's expected share of ``k``,
    plus eight for the smallest ``k``: at ``n = 8M`` and ``k = 1%``, ``r = 248`` of 16384,
    about 1.5k candidates.
    """
    expect = k * SAMPLE / n
    return min(SAMPLE, int(expect + 6 * math.sqrt(expect)) + 8)
