"""The CPU loops of :mod:`bitcomm.codecs.counts`' radix packing, compiled with numba.

A group's code is ``sum(count[j] * (m + 1)**(g - 1 - j))``, the first count most significant.
The weights travel as a tuple: numba compiles one loop per tuple length, so the group size is
a constant of the compiled code and its inner loop unrolls (and vectorises) as if written out.
With the group size a plain argument the loop took 534 us for 1M counts in [0, 2] (g = 5) on
the 2-core VM; as a tuple's length, 12.6 us, where numpy's Horner steps over strided columns
took 420 (64M: 2.2 ms against 36). Unpacking, each code's digits are a row of a table of
every code's digits, copied with the same constant: 164 us against numpy's ``np.take`` of the
rows, 401 us (as an argument, 333 us; arithmetic, a division and a remainder per digit, 3.2
ms). One compiled loop per group size and count dtype, cached on disk like every bitcomm loop
(:mod:`bitcomm.codecs._jit`).
"""

from __future__ import annotations

import numpy as np

from bitcomm.codecs._jit import jit

__all__ = ["radix_codes", "radix_digits"]


@jit(nogil=True)
def _codes(a: np.ndarray, weights: tuple, out: np.ndarray) -> None:
    g = len(weights)
    for i in range(a.size // g):
        k = i * g
        code = 0
        for j in range(g):
            code += a[k + j] * weights[j]
        out[i] = code


def radix_codes(a: np.ndarray, base: int, g: int, b: int) -> np.ndarray:
    """Return the base-``base`` codes of ``a``'s groups of ``g`` counts (1-D; last zero-padded).

    uint8 codes for ``b <= 8`` code bits, else uint16; the caller checked the counts' range.
    """
    weights = tuple(base ** (g - 1 - j) for j in range(g))
    full, rest = divmod(a.size, g)
    out = np.empty(full + (rest > 0), dtype=np.uint8 if b <= 8 else np.uint16)
    a = np.ascontiguousarray(a)
    _codes(a[: full * g], weights, out)
    if rest:  # the last group, its missing counts zero
        last = a[full * g :].tolist()
        out[full] = sum(c * w for c, w in zip(last, weights[:rest], strict=True))
    return out


@jit(nogil=True)
def _digits(code: np.ndarray, table: np.ndarray, weights: tuple, out: np.ndarray) -> None:
    g = len(weights)  # only the length is used: it makes g a constant of the compiled loop
    for i in range(code.size):
        c = code[i]
        for j in range(g):
            out[i * g + j] = table[c, j]


def radix_digits(code: np.ndarray, table: np.ndarray) -> np.ndarray:
    """Return the ``g`` digits of every code, ``table[code]`` flattened (uint8).

    ``table``: the ``(2**b, g)`` digits of every ``b``-bit code; ``code`` below ``2**b``.
    """
    g = table.shape[1]
    out = np.empty(code.size * g, dtype=np.uint8)
    _digits(code, table, (0,) * g, out)
    return out
