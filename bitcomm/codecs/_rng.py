"""Counter-based 16-bit random numbers that are bit-identical on every device.

Stochastic codecs (qsgd) must give the same bytes for the same seed on CPU and CUDA, which
``torch.rand`` cannot promise (each device has its own generator). So stream position ``i`` draws
from an integer hash of ``(key, i)`` computed with int32 torch ops only:

* positions come in blocks of ``BLOCK = 2**16``; position ``p`` of block ``b`` uses hash index
  ``j = b * 2**15 + (p mod 2**15)``: the first half of a block takes the low 16 bits of
  ``hash(j)``, the second half the high 16 bits, so one hash feeds two positions without an
  interleaving copy.
* ``hash(j)`` starts from ``h = (j mod 2**31) ^ key'`` and applies the "lowbias32" finaliser
  on 32-bit words: ``h ^= h >>> 16; h *= 0x7feb352d; h ^= h >>> 15; h *= 0x846ca68b;
  h ^= h >>> 16``, products modulo 2**32 and ``>>>`` a logical shift (int32 has only
  arithmetic shifts, so the sign-extended bits are masked off).
  ``key' = key ^ ((j >> 31) * 0x27d4eb2f)`` (low 32 bits) keeps streams longer than 2**32
  positions from repeating.
* the 16-bit value ``r`` is in ``[0, 65536)``.

16-bit values halve the hashing work. For stochastic rounding (:mod:`bitcomm.codecs.qsgd`) they
make the probability of rounding up exact to 2**-17.
"""

from __future__ import annotations

import torch

__all__ = ["BLOCK", "key_from", "add_random16_", "random16"]

BLOCK = 1 << 16
_HALF = BLOCK // 2
_M1 = 0x7FEB352D
_M2 = 0x846CA68B - (1 << 32)  # the same 32 bits as a signed int32 constant
_HI = 0x27D4EB2F


def _signed32(v: int) -> int:
    v &= 0xFFFFFFFF
    return v - (1 << 32) if v >= 1 << 31 else v


def check_seed(seed: object) -> None:
    """Raise ``TypeError`` unless ``seed`` is an int or ``None``."""
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise TypeError(f"expected seed to be an int or None, got {type(seed).__name__}")


def key_from(seed: int | None = None, generator: torch.Generator | None = None) -> int:
    """Return a 32-bit stream key from an int seed, a ``torch.Generator``, or torch's default.

    A seed maps to the same key everywhere; a generator advances by one draw per call, so
    successive encodes with one generator differ but replay identically after re-seeding.
    """
    if seed is not None and generator is not None:
        raise ValueError("expected at most one of seed and generator, got both")
    check_seed(seed)
    if seed is not None:
        # Spread nearby seeds apart before they become keys (a Weyl-sequence multiplier).
        return _signed32(((seed * 0x9E3779B97F4A7C15) >> 32) ^ seed)
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"expected generator to be a torch.Generator, got "
                        f"{type(generator).__name__}")
    device = generator.device if generator is not None else "cpu"
    draw = torch.randint(-(1 << 31), 1 << 31, (1,), generator=generator, dtype=torch.int64,
                         device=device)
    return int(draw.item())


def _xorshift_(h: torch.Tensor, tmp: torch.Tensor, shift: int) -> None:
    # h ^= h >>> shift. int32 shifts are arithmetic, and an arithmetic xorshift is not a
    # bijection (it always clears the sign bit), so mask the sign-extended bits away.
    torch.bitwise_right_shift(h, shift, out=tmp)
    tmp &= (1 << (32 - shift)) - 1
    h ^= tmp


def _hash_but_last_(h: torch.Tensor, tmp: torch.Tensor) -> None:
    # All of lowbias32 but its final h ^= h >>> 16, which add_random16_ folds into the split.
    # int32 multiplication wraps modulo 2**32 on CPU and CUDA alike.
    _xorshift_(h, tmp, 16)
    h.mul_(_M1)
    _xorshift_(h, tmp, 15)
    h.mul_(_M2)


def add_random16_(t: torch.Tensor, key: int, start: int, *, work: tuple | None = None
                  ) -> torch.Tensor:
    """Add the 16-bit stream values of positions ``start ..`` to the int32 tensor ``t`` in place.

    ``start`` and ``t.numel()`` must be multiples of :data:`BLOCK`. ``work`` optionally holds
    two int32 scratch tensors of ``t.numel() // 2`` elements, reused across calls.
    """
    count = t.numel()
    if start % BLOCK or count % BLOCK:
        raise ValueError(f"expected start and length to be multiples of {BLOCK}, "
                         f"got start={start}, length={count}")
    if work is None:
        work = (torch.empty(count // 2, dtype=torch.int32, device=t.device),
                torch.empty(count // 2, dtype=torch.int32, device=t.device))
    h, tmp = work[0][: count // 2], work[1][: count // 2]
    j0 = start // 2
    j1 = j0 + count // 2
    # Split where j crosses a multiple of 2**31, so each piece has one high word.
    pos = 0
    while j0 < j1:
        cut = min(j1, (j0 // (1 << 31) + 1) << 31)
        piece = h[pos : pos + cut - j0]
        lo = j0 % (1 << 31)
        torch.arange(lo, lo + (cut - j0), out=piece)
        piece ^= _signed32(key ^ ((j0 >> 31) * _HI))
        pos += cut - j0
        j0 = cut
    _hash_but_last_(h, tmp)
    # The last step h ^= h >>> 16 leaves the high half alone and xors it into the low half, so
    # it is folded into splitting h: high = h >>> 16, low = (h ^ high) & 0xffff.
    tv = t.view(-1, 2, _HALF)
    hv = h.view(-1, _HALF)
    rv = tmp.view(-1, _HALF)
    torch.bitwise_right_shift(hv, 16, out=rv)
    rv &= 0xFFFF
    tv[:, 1].add_(rv)
    hv ^= rv
    hv &= 0xFFFF
    tv[:, 0].add_(hv)
    return t


def random16(key: int, start: int, count: int, device: torch.device | str = "cpu"
             ) -> torch.Tensor:
    """Return the 16-bit stream values (int32 in [0, 65536)) of positions ``start..start+count``.

    A reference view of the stream for tests and tools; codecs add it in place instead.
    """
    first = start - start % BLOCK
    padded = -(-(start + count - first) // BLOCK) * BLOCK
    t = torch.zeros(padded, dtype=torch.int32, device=device)
    add_random16_(t, key, first)
    return t[start - first : start - first + count]
