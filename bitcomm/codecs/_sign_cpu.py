"""The CPU loops of :mod:`bitcomm.codecs.sign`, compiled with numba: packing and the scale.

One pass: each byte from its eight values' ``x >= 0``, MSB first, as ``np.packbits(x >= 0)``
writes it (NaN is not ``>= 0``: bit 0; -0.0 is: bit 1). numpy's way compares into a boolean
array and packs that; here the comparisons and the packing are one loop. A whole
``sign.pack`` of float32 took 0.83x the time of its numpy path at 1M elements and 0.92x at
16M and 64M (1.17, 1.19 and 1.56x ``np.packbits(x < 0)``, against 0.97, 1.10 and 1.45; 2-core
VM), but more at 64K (0.55 against 0.63), hence ``sign._JIT_MIN``. One thread: a parallel
region was slower, and it would wake numba's OpenMP team, whose spinning takes the cores the
other ranks of a job need (see :mod:`bitcomm.codecs._qsgd_cpu`).

:func:`scale_sum` adds ``x**2`` or ``|x|`` in float64, as :func:`bitcomm.codecs.sign.
compute_scale` needs, in one pass with no float64 copy of ``x``. It lets the compiler reorder
the additions (``fastmath`` ``reassoc``: SIMD lanes of partial sums), as the GPU's block sums
and torch's chunked dots each add in their own order: in float64 the orders differ in the
last bits, far below the fp32 scale's rounding. At 1M float32 values on the 2-core VM: 42 us
against torch's chunked float64 dot, 146 us, and mean ``|x|``'s ``abs().sum()``, 3.5 ms.
"""

from __future__ import annotations

import numpy as np

from bitcomm.codecs._jit import jit

__all__ = ["pack_bytes", "scale_sum"]


@jit(nogil=True)
def pack_bytes(a: np.ndarray, out: np.ndarray) -> None:
    """Write the signs of ``a``'s first ``8 * out.size`` values to ``out``, one byte per 8."""
    for i in range(out.size):
        k = 8 * i
        out[i] = (((a[k] >= 0) << 7) | ((a[k + 1] >= 0) << 6) | ((a[k + 2] >= 0) << 5)
                  | ((a[k + 3] >= 0) << 4) | ((a[k + 4] >= 0) << 3) | ((a[k + 5] >= 0) << 2)
                  | ((a[k + 6] >= 0) << 1) | (a[k + 7] >= 0))


@jit(nogil=True, fastmath={"reassoc"})
def scale_sum(a: np.ndarray, squares: bool) -> float:
    """Return the float64 sum of ``a``'s squares (``squares``) or of its absolute values."""
    total = 0.0
    if squares:
        for i in range(a.size):
            d = np.float64(a[i])
            total += d * d
    else:
        for i in range(a.size):
            total += abs(np.float64(a[i]))
    return total
