"""Counts in ``[0, m]``: the running +1 tallies of the ring-majority allreduce.

All-Reducible signSGD, Section 3: at step ``i`` of the ring reduce-scatter a count is at most
``i``, so it needs only ``ceil(log2(i + 1))`` bits. Two packings:

``packing="fixed"`` (the paper's): every count in ``w = ceil(log2(m + 1))`` bits
(``m.bit_length()``), laid out as :mod:`bitcomm.codecs.bits` planes. ``m = 0`` needs no bits.

``packing="radix"``: groups of ``g`` counts are read as one base-``(m + 1)`` number (first count
most significant), and that group code is stored in ``b = bitlen((m + 1)**g - 1)`` bits, again as
bit planes. ``g`` is the group size in 1..16 with ``b <= 16`` that minimises ``b / g`` (the
smallest such ``g`` on ties), so the cost approaches ``log2(m + 1)`` bits per count: three counts
in [0, 2] take 5 bits instead of 6, five take 8 (1.6 bits each). When ``m + 1`` is a power of two
radix equals fixed. The last group is padded with zero counts.

Wire format
-----------
Payload (:func:`pack`): fixed: ``w * ceil(n / 8)`` bytes; radix: ``b * ceil(ceil(n / g) / 8)``
bytes (:func:`packed_size`). Frame (:func:`encode`)::

    offset  size  field
    0       8     n        int64, little-endian: number of counts
    8       2     m        uint16, little-endian: largest allowed count (0..65535)
    10      1     packing  uint8: 0 = fixed, 1 = radix
    11      ...   payload

Worked example, fixed: ``encode(torch.tensor([2, 0, 1]), m=2)``: ``w = 2``; the high plane holds
``1 0 0`` -> ``0x80`` and the low plane ``0 0 1`` -> ``0x20``. Frame:
``03 00 00 00 00 00 00 00 02 00 00 80 20``.

Worked example, radix: ``encode(torch.tensor([2, 0, 1]), m=2, packing="radix")``: base 3,
``g = 5`` (``3**5 - 1 = 242`` fits ``b = 8`` bits); the group ``[2, 0, 1, 0, 0]`` (two padding
zeros) is ``2*81 + 0*27 + 1*9 + 0*3 + 0 = 171`` = ``10101011``, one value in 8 planes of one
byte each: ``80 00 80 00 80 00 80 80``. Frame:
``03 00 00 00 00 00 00 00 02 00 01 80 00 80 00 80 00 80 80``.

Errors: non-integer input -> ``TypeError``; a count below 0 or above ``m`` -> ``OverflowError``;
``m`` outside 0..65535 or an unknown packing -> ``ValueError``; a truncated frame, a decoded count
above ``m``, a radix code out of range or non-zero padding -> ``ValueError``.
"""

from __future__ import annotations

import functools
import struct

import numpy as np
import torch

from bitcomm.codecs import _frame, _jit, bits

__all__ = [
    "width",
    "radix_group",
    "pack",
    "unpack",
    "packed_size",
    "encode",
    "decode",
    "encoded_size",
    "HEADER",
    "PACKINGS",
]

HEADER = struct.Struct("<qHB")
"""Frame header: n (int64), m (uint16), packing (uint8), little-endian, 11 bytes."""
PACKINGS = ("fixed", "radix")
"""Packing modes; their index is the header's packing code."""
MAX_M = 0xFFFF

_CODEC = "counts"


def _check_m(m: object) -> int:
    if isinstance(m, bool) or not isinstance(m, (int, np.integer)):
        raise TypeError(f"expected m to be an int, got {type(m).__name__}")
    if not 0 <= m <= MAX_M:
        raise ValueError(f"expected 0 <= m <= {MAX_M}, got {m}")
    return int(m)


def _check_packing(packing: object) -> str:
    if packing not in PACKINGS:
        raise ValueError(f"expected packing in {PACKINGS}, got {packing!r}")
    return str(packing)


def width(m: int) -> int:
    """Return the fixed-packing width for counts in [0, m]: ceil(log2(m + 1)) bits."""
    return _check_m(m).bit_length()


@functools.lru_cache(maxsize=None)
def radix_group(m: int) -> tuple[int, int]:
    """Return ``(g, b)``: radix packing stores ``g`` counts in [0, m] per ``b``-bit code."""
    m = _check_m(m)
    if m == 0:
        return 1, 0
    base = m + 1
    best = (1, m.bit_length())
    for g in range(2, 17):
        b = (base**g - 1).bit_length()
        if b > bits.MAX_WIDTH:
            break
        if b * best[0] < best[1] * g:  # b / g < best_b / best_g
            best = (g, b)
    return best


def packed_size(n: int, m: int, packing: str = "fixed") -> int:
    """Return the exact payload size in bytes for ``n`` counts in [0, m]."""
    n = _frame.check_count(n, "n")
    m = _check_m(m)
    if _check_packing(packing) == "fixed":
        return m.bit_length() * ((n + 7) // 8)
    g, b = radix_group(m)
    groups = -(-n // g)
    return b * ((groups + 7) // 8)


def encoded_size(n: int, m: int, packing: str = "fixed") -> int:
    """Return the exact frame size in bytes: 11-byte header plus :func:`packed_size`."""
    return HEADER.size + packed_size(n, m, packing)


def _check_range(v: torch.Tensor, m: int) -> None:
    if v.numel() == 0:
        return
    lo, hi = torch.stack(torch.aminmax(v)).tolist()  # one host read: on a GPU, one wait
    if lo < 0 or hi > m:
        bad = lo if lo < 0 else hi
        raise OverflowError(f"expected counts in [0, {m}], got {bad}")


def pack(x: torch.Tensor, m: int, packing: str = "fixed", *, check: bool = True) -> torch.Tensor:
    """Pack counts in [0, m] into the payload of ``packing`` (no header).

    Args:
        x: integer tensor (flattened).
        m: the largest count the receiver must accept (at ring step ``i``, ``m = i``).
        packing: ``"fixed"`` or ``"radix"``.
        check: verify ``0 <= x <= m`` (``OverflowError`` otherwise).

    """
    v = _frame.check_int(x)
    m = _check_m(m)
    packing = _check_packing(packing)
    return _pack(v, m, packing, check)


def _pack(v: torch.Tensor, m: int, packing: str, check: bool, out: torch.Tensor | None = None
          ) -> torch.Tensor:
    # pack() of checked arguments; `out` (the payload's place in a frame) only on the triton
    # path, which writes into it and returns it.
    n = v.numel()
    if _frame.use_triton(v) and m and n:
        # One kernel: groups composed and the counts' range checked as they are packed, the
        # check's flag read once, at the end.
        g, b = (1, m.bit_length()) if packing == "fixed" else radix_group(m)
        payload, flags = _frame.kernels().planes_pack(v.contiguous(), b, g, m + 1,
                                                      limit=m if check else None, out=out)
        _frame.raise_if(flags, lambda: _check_range(v, m))
        return payload
    if check:
        _check_range(v, m)
    if m == 0 or n == 0:
        return torch.empty(0, dtype=torch.uint8, device=v.device)
    if packing == "fixed":
        return bits.pack(v, m.bit_length(), check=False)
    g, b = radix_group(m)
    if g == 1:
        return bits.pack(v, b, check=False)
    groups = -(-n // g)
    if _frame.use_numpy(v) and _jit.worth(n):
        from bitcomm.codecs import _counts_cpu

        code = _counts_cpu.radix_codes(v.numpy(), m + 1, g, b)
        return bits.pack(torch.from_numpy(code if b <= 8 else code.view(np.int16)), b,
                         check=False)
    if _frame.use_numpy(v):
        # Horner's rule in the code's own width (uint8 for b <= 8, else uint16): every partial
        # code is below (m + 1)**g <= 2**b, so nothing wraps, and no int32 copy is made.
        digits = np.zeros(groups * g, dtype=np.uint8 if b <= 8 else np.uint16)
        digits[:n] = v.numpy()
        digits = digits.reshape(groups, g)
        code = digits[:, 0].copy()
        for j in range(1, g):
            code *= m + 1
            code += digits[:, j]
        # torch has no uint16 integer type that bits accepts; int16 holds the same 16 bits,
        # which is all that bits' planes take.
        return bits.pack(torch.from_numpy(code if b <= 8 else code.view(np.int16)), b,
                         check=False)
    digits = torch.zeros(groups * g, dtype=torch.int32, device=v.device)
    digits[:n] = v
    digits = digits.reshape(groups, g)
    # Horner's rule, first count most significant; (m + 1)**g - 1 < 2**16 fits int32.
    code = digits[:, 0].clone()
    for j in range(1, g):
        code.mul_(m + 1).add_(digits[:, j])
    return bits.pack(code, b, check=False)


def unpack(payload: torch.Tensor, n: int, m: int, packing: str = "fixed", *,
           dtype: torch.dtype | None = None) -> torch.Tensor:
    """Unpack ``n`` counts in [0, m] from a payload made by :func:`pack`.

    Args:
        payload: uint8 tensor of exactly :func:`packed_size` bytes.
        n: number of counts (not on the wire).
        m: the largest count, as given to :func:`pack`.
        packing: as given to :func:`pack`.
        dtype: result dtype; default uint8 when m <= 255, else int32.

    Raises:
        ValueError: a count above ``m`` or a radix code out of range (corrupt payload).

    """
    buf = _frame.as_buffer(payload, "payload")
    n = _frame.check_count(n, "n")
    m = _check_m(m)
    packing = _check_packing(packing)
    if dtype is None:
        dtype = torch.uint8 if m <= 0xFF else torch.int32
    size = packed_size(n, m, packing)
    if buf.numel() != size:
        raise ValueError(f"expected a {_CODEC} payload of {size} bytes for n={n}, m={m}, "
                         f"packing={packing!r}, got {buf.numel()}")
    if m == 0 or n == 0:
        return torch.zeros(n, dtype=dtype, device=buf.device)
    g, b = radix_group(m) if packing == "radix" else (1, m.bit_length())
    if _frame.use_triton(buf):
        # Every rule checked in the kernel; the torch path below names a broken one.
        out, flags = _frame.kernels().planes_unpack(buf, n, b, dtype, group=g, base=m + 1,
                                                     maxval=m)
        _frame.raise_if(flags, lambda: _unpack_torch(buf, n, m, g, b, dtype))
        return out
    return _unpack_torch(buf, n, m, g, b, dtype)


def _unpack_torch(buf: torch.Tensor, n: int, m: int, g: int, b: int, dtype: torch.dtype
                  ) -> torch.Tensor:
    if g == 1:
        v = bits.unpack(buf, n, b)
        _check_decoded(v, m)
        return v.to(dtype)
    groups = -(-n // g)
    numpy = _frame.use_numpy(buf)
    code = bits.unpack(buf, groups, b, dtype=None if numpy else torch.int32)
    limit = (m + 1) ** g
    hi = code.max()

    def too_big() -> None:
        raise ValueError(f"corrupt {_CODEC} payload: radix code {int(hi)} >= (m + 1)**g = "
                         f"{limit}")

    # Flags, not reads: inside _frame.deferred a collective reads them once per call.
    _frame.check_later(hi >= limit, too_big)
    if numpy and _jit.worth(groups):
        from bitcomm.codecs import _counts_cpu  # the same gather, compiled

        flat = torch.from_numpy(_counts_cpu.radix_digits(code.numpy(), _digit_table(m, g, b)))
    elif numpy:
        # Every code's g digits in one gather from a table of all 2**b codes (at most 64 Ki
        # rows of g <= 16 bytes): 3-5x the divisions' speed on a CPU. Rows past the limit hold
        # zeros; a code there fails the check above.
        flat = torch.from_numpy(np.take(_digit_table(m, g, b), code.numpy(), axis=0)
                                ).reshape(-1)
    else:
        digits = torch.empty(groups, g, dtype=torch.int32, device=buf.device)
        for j in range(g - 1, -1, -1):
            digits[:, j] = code % (m + 1)
            code = code.div_(m + 1, rounding_mode="floor")
        flat = digits.reshape(-1)

    def padded() -> None:
        raise ValueError(f"corrupt {_CODEC} payload: padding counts after n={n} must be zero")

    _frame.check_later(flat[n:].any(), padded)
    return flat[:n].to(dtype)


@functools.lru_cache(maxsize=64)
def _digit_table(m: int, g: int, b: int) -> np.ndarray:
    """Return the ``(2**b, g)`` uint8 digits of every radix code, first most significant.

    Groups of ``g >= 2`` exist only for ``m <= 255``: ``(m + 1)**2`` must fit 16 bits.
    """
    base = m + 1
    code = np.arange(base**g, dtype=np.int64)
    table = np.zeros((1 << b, g), dtype=np.uint8)
    for j in range(g - 1, -1, -1):
        table[: base**g, j] = code % base
        code //= base
    table.setflags(write=False)
    return table


def _check_decoded(v: torch.Tensor, m: int) -> None:
    if m + 1 == 1 << m.bit_length():
        return  # every w-bit value is a valid count
    hi = v.max()

    def too_big() -> None:
        raise ValueError(f"corrupt {_CODEC} payload: decoded count {int(hi)} > m={m}")

    _frame.check_later(hi > m, too_big)


def encode(x: torch.Tensor, m: int, packing: str = "fixed") -> torch.Tensor:
    """Encode counts in [0, m] as a frame: header (n, m, packing) then :func:`pack`'s payload.

    Example:
        >>> encode(torch.tensor([2, 0, 1]), m=2).tolist()
        [3, 0, 0, 0, 0, 0, 0, 0, 2, 0, 0, 128, 32]

    """
    v = _frame.check_int(x)
    m = _check_m(m)
    packing = _check_packing(packing)
    header = HEADER.pack(v.numel(), m, PACKINGS.index(packing))
    if _frame.use_triton(v):  # the kernel writes the payload into the frame: no copy of it
        frame, payload = _frame.empty_frame(header, packed_size(v.numel(), m, packing),
                                            v.device)
        _pack(v, m, packing, True, payload)
        return frame
    return torch.cat([_frame.host_bytes(header, v.device), _pack(v, m, packing, True)])


def decode(frame: torch.Tensor, *, dtype: torch.dtype | None = None, n: int | None = None
           ) -> tuple[torch.Tensor, int]:
    """Decode one counts frame; return ``(counts, bytes_consumed)``.

    A frame with ``m = 0`` has no payload, so only the bound on its length keeps a corrupt
    header from allocating gigabytes of zeros.

    ``n``: the length the caller expects, checked against the header (``ValueError``); without
    it the header's length is bounded as :mod:`bitcomm.codecs` says.
    """
    buf = _frame.as_buffer(frame)
    expected = n
    n, m, code = _frame.read_struct(buf, 0, HEADER, _CODEC, "header")
    if n < 0:
        raise ValueError(f"corrupt {_CODEC} frame: expected n >= 0, got {n}")
    _frame.check_length(n, buf.numel(), expected, _CODEC)
    if code >= len(PACKINGS):
        raise ValueError(f"corrupt {_CODEC} frame: expected packing code 0 or 1, got {code}")
    packing = PACKINGS[code]
    end = HEADER.size + packed_size(n, m, packing)
    _frame.need(buf, end, _CODEC, "payload")
    return unpack(buf[HEADER.size:end], n, m, packing, dtype=dtype), end
