"""Pack unsigned integers into exactly ``width`` bits each (1 <= width <= 16), bit-plane layout.

Wire format
-----------
The payload (:func:`pack`) is ``width`` *bit planes*, most significant plane first. Plane ``p``
holds bit ``p`` of every value, value ``i`` at byte ``i // 8``, bit position ``7 - i % 8``
(MSB-first inside a byte, the ``numpy.packbits`` / ``bitarray(endian="big")`` order). Each plane
is padded with zero bits to a whole byte, so the payload is ``width * ceil(n / 8)`` bytes: exactly
``width`` bits per value plus at most 7 padding bits per plane. Bit planes are the layout of
choice because a plane is one ``packbits`` on the CPU and one shift-and-sum on a GPU, with no
bit straddling byte boundaries.

The frame (:func:`encode`) is a header followed by the payload::

    offset  size  field
    0       8     n       int64, little-endian: number of values
    8       1     width   uint8: bits per value, 1..16
    9       ...   payload width * ceil(n / 8) bytes

Worked example: ``encode(torch.tensor([5, 0, 3]), width=3)``. In binary the values are
``101 000 011``. Plane 2 takes the top bits ``1 0 0`` -> ``10000000`` = ``0x80``; plane 1 takes
``0 0 1`` -> ``00100000`` = ``0x20``; plane 0 takes ``1 0 1`` -> ``10100000`` = ``0xa0``. The
frame is the 12 bytes ``03 00 00 00 00 00 00 00 03 80 20 a0``.

Errors: a non-integer tensor raises ``TypeError``; a value below 0 or at least ``2**width``
raises ``OverflowError``; ``width`` outside 1..16 raises ``ValueError``; a truncated frame, a bad
header field or non-zero padding raises ``ValueError`` naming the field. Empty tensors round-trip.
"""

from __future__ import annotations

import struct

import numpy as np
import torch

from bitcomm.codecs import _frame, _jit

__all__ = ["pack", "unpack", "packed_size", "encode", "decode", "encoded_size", "HEADER"]

HEADER = struct.Struct("<qB")
"""Frame header: n (int64) and width (uint8), little-endian, 9 bytes."""

_CODEC = "bits"
MAX_WIDTH = 16
_CHUNK = 1 << 18  # values per chunk on the CPU path; a multiple of 8 keeps bytes aligned


def _check_width(width: object) -> int:
    if isinstance(width, bool) or not isinstance(width, (int, np.integer)):
        raise TypeError(f"expected width to be an int, got {type(width).__name__}")
    if not 1 <= width <= MAX_WIDTH:
        raise ValueError(f"expected 1 <= width <= {MAX_WIDTH}, got {width}")
    return int(width)


def packed_size(n: int, width: int) -> int:
    """Return the payload size in bytes for ``n`` values of ``width`` bits: w * ceil(n/8)."""
    n = _frame.check_count(n, "n")
    return _check_width(width) * ((n + 7) // 8)


def encoded_size(n: int, width: int) -> int:
    """Return the frame size in bytes (header plus payload) for ``n`` values of ``width`` bits."""
    return HEADER.size + packed_size(n, width)


def _check_range(v: torch.Tensor, width: int) -> None:
    if v.numel() == 0:
        return
    lo, hi = torch.stack(torch.aminmax(v)).tolist()  # one host read: on a GPU, one wait
    if lo < 0 or hi >= (1 << width):
        bad = lo if lo < 0 else hi
        raise OverflowError(f"expected values in [0, {(1 << width) - 1}] for width={width}, "
                            f"got {bad}")


def pack(x: torch.Tensor, width: int, *, check: bool = True) -> torch.Tensor:
    """Pack the integers of ``x`` into ``width`` bit planes; return the payload (no header).

    Args:
        x: integer tensor of any shape (flattened), values in ``[0, 2**width)``.
        width: bits per value, 1..16.
        check: verify the range (``OverflowError`` otherwise); callers that know the range
            may skip the pass.

    Returns:
        uint8 tensor of :func:`packed_size` bytes on ``x``'s device.

    """
    v = _frame.check_int(x)
    width = _check_width(width)
    return _pack(v, width, check)


def _pack(v: torch.Tensor, width: int, check: bool, out: torch.Tensor | None = None
          ) -> torch.Tensor:
    # pack() of a checked flat tensor; `out` (the payload's place in a frame) only on the
    # triton path, which writes into it and returns it.
    n = v.numel()
    path = _frame.backend(v)
    if path == "triton" and n:
        # The kernel checks the range as it packs; its flag is read once, at the end.
        payload, flags = _frame.kernels().planes_pack(
            v.contiguous(), width, limit=(1 << width) - 1 if check else None, out=out)
        _frame.raise_if(flags, lambda: _check_range(v, width))
        return payload
    if check:
        _check_range(v, width)
    nb = (n + 7) // 8
    if n == 0:
        return torch.empty(0, dtype=torch.uint8, device=v.device)
    if path == "numpy" and _jit.worth(n):  # numba's passes (bitcomm.codecs._bits_cpu)
        from bitcomm.codecs import _bits_cpu

        return torch.from_numpy(_bits_cpu.pack(v.numpy(), width).reshape(-1))
    if path == "numpy":
        a = v.numpy()
        # A narrow working dtype keeps the per-plane passes cheap.
        if width <= 8 and a.dtype != np.uint8:
            a = a.astype(np.uint8)
        elif 8 < width <= 16 and a.dtype not in (np.uint16, np.int16):
            a = a.astype(np.uint16)
        if width == 1:  # one plane, one pass: packbits maps non-zero to 1
            return torch.from_numpy(np.packbits(a))
        out = np.empty((width, nb), dtype=np.uint8)
        tmp = np.empty(min(n, _CHUNK), dtype=np.uint8)
        # Chunk by chunk, every plane of a chunk while it is in cache: the values are read
        # from memory once, not once per plane.
        for start in range(0, n, _CHUNK):
            stop = min(n, start + _CHUNK)
            part, t = a[start:stop], tmp[: stop - start]
            # Wider values split into their low and high bytes first: packbits of 16-bit
            # values is about 50x slower than of bytes.
            octets = (part,) if width <= 8 else (part.astype(np.uint8),
                                                 (part >> 8).astype(np.uint8))
            lo, hi = start // 8, (stop + 7) // 8
            for row, p in enumerate(range(width - 1, -1, -1)):
                # packbits maps non-zero to 1: each plane is the values' bit p, masked.
                plane = np.bitwise_and(octets[p >> 3], np.uint8(1 << (p & 7)), out=t)
                out[row, lo:hi] = np.packbits(plane)
        return torch.from_numpy(out.reshape(-1))
    shifts = torch.arange(width - 1, -1, -1, device=v.device, dtype=torch.int64)
    wide = v if v.dtype in (torch.int32, torch.int64) else v.to(torch.int32)
    planes = (wide.unsqueeze(0) >> shifts.to(wide.dtype).unsqueeze(1)) & 1
    return _frame.packbits(planes).reshape(-1)


def unpack(payload: torch.Tensor, n: int, width: int, *, dtype: torch.dtype | None = None
           ) -> torch.Tensor:
    """Unpack ``n`` values of ``width`` bits from a payload made by :func:`pack`.

    Args:
        payload: uint8 tensor of exactly :func:`packed_size` bytes.
        n: number of values (not on the wire: the caller knows it).
        width: bits per value.
        dtype: result dtype; default uint8 for width <= 8, else int32.

    Returns:
        1-D integer tensor of ``n`` values on the payload's device.

    """
    buf = _frame.as_buffer(payload, "payload")
    n = _frame.check_count(n, "n")
    width = _check_width(width)
    nb = (n + 7) // 8
    if buf.numel() != width * nb:
        raise ValueError(f"expected a {_CODEC} payload of {width * nb} bytes for n={n}, "
                         f"width={width}, got {buf.numel()}")
    if dtype is None:
        dtype = torch.uint8 if width <= 8 else torch.int32
    if n == 0:
        return torch.empty(0, dtype=dtype, device=buf.device)
    planes = buf.reshape(width, nb)
    path = _frame.backend(buf)
    if path == "triton":
        out, flags = _frame.kernels().planes_unpack(buf, n, width, dtype)
        _frame.raise_if(flags, lambda: _frame.check_padding(planes, n, _CODEC, "plane"))
        return out
    _frame.check_padding(planes, n, _CODEC, "plane")
    if path == "numpy" and _jit.worth(n):
        from bitcomm.codecs import _bits_cpu

        return torch.from_numpy(_bits_cpu.unpack(planes.numpy(), n)).to(dtype)
    if path == "numpy":
        p = planes.numpy()
        if width == 1:
            return torch.from_numpy(np.unpackbits(p[0], count=n)).to(dtype)
        acc = np.zeros(nb * 8, dtype=np.uint8 if width <= 8 else np.uint16)
        tmp = np.empty(nb * 8, dtype=acc.dtype)
        for row in range(width):
            shift = width - 1 - row
            bits = np.unpackbits(p[row])
            if shift:
                # A product by 2**shift, not a shift: numpy's uint8 left_shift took 261 us for
                # 1M values where the product took 25 (the bits are 0 or 1, so they are equal).
                np.multiply(bits, acc.dtype.type(1 << shift), out=tmp)
                acc |= tmp
            else:
                acc |= bits
        if acc.dtype == np.uint16:
            # torch has no general uint16 arithmetic; int32 holds every 16-bit value.
            return torch.from_numpy(acc[:n].astype(np.int32)).to(dtype)
        return torch.from_numpy(acc[:n]).to(dtype)
    bits = _frame.unpackbits(planes, n).to(torch.int64)
    shifts = torch.arange(width - 1, -1, -1, device=buf.device, dtype=torch.int64).unsqueeze(1)
    return (bits << shifts).sum(0).to(dtype)


def encode(x: torch.Tensor, width: int) -> torch.Tensor:
    """Encode integers as a self-describing frame: header (n, width) then :func:`pack`'s planes.

    Example:
        >>> encode(torch.tensor([5, 0, 3]), 3).tolist()
        [3, 0, 0, 0, 0, 0, 0, 0, 3, 128, 32, 160]

    """
    v = _frame.check_int(x)
    width = _check_width(width)
    header = HEADER.pack(v.numel(), width)
    if _frame.use_triton(v):  # the kernel writes the planes into the frame: no copy of them
        frame, payload = _frame.empty_frame(header, packed_size(v.numel(), width), v.device)
        _pack(v, width, True, payload)
        return frame
    return torch.cat([_frame.host_bytes(header, v.device), _pack(v, width, True)])


def decode(frame: torch.Tensor, *, dtype: torch.dtype | None = None, n: int | None = None
           ) -> tuple[torch.Tensor, int]:
    """Decode one frame from the start of ``frame``; return ``(values, bytes_consumed)``.

    Bytes after the frame are left alone, so frames can be read back to back.

    ``n``: the length the caller expects, checked against the header (``ValueError``); without
    it the header's length is bounded as :mod:`bitcomm.codecs` says.
    """
    buf = _frame.as_buffer(frame)
    expected = n
    n, width = _frame.read_struct(buf, 0, HEADER, _CODEC, "header")
    if n < 0:
        raise ValueError(f"corrupt {_CODEC} frame: expected n >= 0, got {n}")
    _frame.check_length(n, buf.numel(), expected, _CODEC)
    if not 1 <= width <= MAX_WIDTH:
        raise ValueError(f"corrupt {_CODEC} frame: expected width in 1..{MAX_WIDTH}, got {width}")
    end = HEADER.size + width * ((n + 7) // 8)
    _frame.need(buf, end, _CODEC, "payload")
    return unpack(buf[HEADER.size:end], n, width, dtype=dtype), end
