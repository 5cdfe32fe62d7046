"""QSGD: unbiased stochastic quantisation in buckets, 2, 4 or 8 bits per element.

SparCML, Section 6 (its use of QSGD, Alistarh et al. 2017): the vector is
cut into buckets of ``B`` consecutive elements, each quantised independently against one
full-precision scale. With ``bits`` per element, one bit is the sign and ``bits - 1`` bits are a
level in ``0..s`` with ``s = 2**(bits - 1) - 1`` (1, 7 or 127 levels). For ``y = |x| / scale * s``
the level is ``floor(y)`` or ``floor(y) + 1``, the latter with probability ``y - floor(y)``, so
``E[level] = y`` and the decoded ``sign * scale * level / s`` is unbiased. The scale is the
bucket's max ``|x|`` (``scale="max"``, the default: lowest variance) or its L2 norm
(``scale="l2"``, QSGD's own choice, for which QSGD proves
``E||Q(v) - v||^2 <= min(n / s^2, sqrt(n) / s) * ||v||^2`` per bucket).

Randomness comes from a counter-based hash (:mod:`bitcomm.codecs._rng`) keyed by ``seed`` or by
one draw from ``generator``: the same seed gives the same bytes, on CPU and CUDA alike. Its
uniforms have 16 bits, so the rounding probability is ``frac`` to within 2**-17: the decoded
mean is within ``scale / s * 2**-17`` of ``x``, far below float32 resolution of the scale for 8
bits and below any measurable bias for 2 and 4.

CPU tensors are quantised by a numba-compiled kernel (:mod:`bitcomm.codecs._qsgd_cpu`: one
cache-resident pass per block of 2**16 elements, on torch's intra-op threads; the ``jit``
extra), every other device, and the CPU without numba, by the same arithmetic as torch ops. Both
write the same bytes (tests compare them).

Non-finite input raises ``ValueError`` naming the first bucket whose scale is not finite (a NaN
or inf anywhere in a bucket makes its max and norm non-finite, so the check costs nothing).

Wire format
-----------
::

    offset   size            field
    0        8               n       int64 LE: number of elements
    8        1               bits    uint8: 2, 4 or 8
    9        1               scale   uint8: 0 = max |x|, 1 = L2 norm
    10       4               bucket  uint32 LE: B >= 1
    14       4 * nb          scales  float32 LE, nb = ceil(n / B), one per bucket
    14+4nb   ceil(n*bits/8)  codes   element codes, MSB-first, zero padding

An element's code is ``sign << (bits - 1) | level`` with sign bit 1 for ``x < 0``. Codes are
packed MSB-first: with 4 bits, element ``2j`` is the high nibble of code byte ``j``; with 2 bits,
element ``4j`` takes bits 7-6.

Worked example: ``encode(torch.tensor([1.0, -0.5, 0.0]), bits=4, bucket=4)``: one bucket, scale
``max |x| = 1.0`` (``00 00 80 3f``), ``s = 7``. ``y = [7, 3.5, 0]``: element 0 is level 7 exactly
(code ``0111``), element 2 is level 0 (``0000``), element 1 is level 3 or 4 with probability 1/2
each, negative: code ``1011`` or ``1100``. The frame is the 14-byte header
``03 00 00 00 00 00 00 00 04 00 04 00 00 00``, the scale, then ``7b 00`` or ``7c 00``; it
decodes to ``[1, -3/7, 0]`` or ``[1, -4/7, 0]``.
"""

from __future__ import annotations

import contextlib
import functools
import struct
import warnings
from collections.abc import Callable

import numpy as np
import torch

from bitcomm.codecs import _frame, _jit, _rng
from bitcomm.codecs._rng import check_seed

__all__ = ["encode", "decode", "decode_all", "mean_all", "encoded_size", "check_config",
           "check_seed", "HEADER", "BITS", "SCALES", "DEFAULT_BUCKET"]

HEADER = struct.Struct("<qBBI")
"""Frame header: n (int64), bits (uint8), scale kind (uint8), bucket (uint32); 14 bytes."""
BITS = (2, 4, 8)
"""Allowed bits per element."""
SCALES = ("max", "l2")
"""Scale kinds; their index is the header's scale code."""
DEFAULT_BUCKET = 512

_CODEC = "qsgd"
_CHUNK = 1 << 18  # elements quantised per pass, to stay in cache


def check_config(bits: object, bucket: object, scale: object) -> tuple[int, int, str]:
    """Return ``(bits, bucket, scale)`` as plain values, or raise naming the bad one.

    ``TypeError`` for a non-int ``bits`` or ``bucket``, ``ValueError`` for ``bits`` outside
    :data:`BITS`, a bucket outside ``[1, 2**32 - 1]`` (its header field is a uint32) or a scale
    outside :data:`SCALES`.
    """
    if isinstance(bits, bool) or not isinstance(bits, (int, np.integer)):
        raise TypeError(f"expected bits to be an int, got {type(bits).__name__}")
    if bits not in BITS:
        raise ValueError(f"expected bits in {BITS}, got {bits}")
    if isinstance(bucket, bool) or not isinstance(bucket, (int, np.integer)):
        raise TypeError(f"expected bucket to be an int, got {type(bucket).__name__}")
    if not 1 <= bucket <= 0xFFFFFFFF:
        raise ValueError(f"expected 1 <= bucket <= 2**32 - 1, got {bucket}")
    if scale not in SCALES:
        raise ValueError(f"expected scale in {SCALES}, got {scale!r}")
    return int(bits), int(bucket), str(scale)


def encoded_size(n: int, bits: int = 4, bucket: int = DEFAULT_BUCKET) -> int:
    """Return the exact frame size: 14 + 4 * ceil(n / bucket) + ceil(n * bits / 8) bytes."""
    n = _frame.check_count(n, "n")
    bits, bucket, _ = check_config(bits, bucket, "max")
    return HEADER.size + 4 * (-(-n // bucket)) + (n * bits + 7) // 8


def _scales_into(out: torch.Tensor, v: torch.Tensor, bucket: int, kind: str) -> None:
    """Write the scales of the buckets of ``v`` (which starts on a bucket boundary) to ``out``."""
    n = v.numel()
    full = n // bucket
    parts = [(0, full, v[: full * bucket].view(full, bucket))] if full else []
    if out.numel() > full:
        parts.append((full, full + 1, v[full * bucket:].view(1, -1)))
    for lo, hi, block in parts:
        if kind == "max":
            low, high = torch.aminmax(block, dim=1)  # one pass, no |x| temporary
            # abs_: maximum(-0.0, +0.0) may be -0.0, and a scale is written as +0.
            out[lo:hi] = torch.maximum(-low, high).abs_().to(torch.float32)
        else:
            # float64 accumulation: CPU and CUDA reduce in different orders, and rounding a
            # float64 norm to float32 hides that difference in all but rare ties.
            out[lo:hi] = torch.linalg.vector_norm(block.to(torch.float64), dim=1)


def _check_scales(scales: torch.Tensor | Callable[[], torch.Tensor], bucket: int, n: int,
                  kind: str, flag: torch.Tensor | None = None) -> None:
    # `flag`: set by the encoding kernel when a scale is not finite (else tested here); with
    # it, `scales` may be a function giving them, wanted only to name a bad one.
    if flag is None and _frame.use_numpy(scales) and np.isfinite(scales.numpy()).all():
        return  # numpy's test of a few scales costs a microsecond, torch's three ops ~30

    def explain() -> None:
        found = scales() if callable(scales) else scales
        i = int(torch.nonzero(~torch.isfinite(found))[0, 0])
        raise ValueError(f"expected finite values, got a non-finite {kind} scale "
                         f"{float(found[i].item())} in bucket {i} (elements {i * bucket}.."
                         f"{min(n, (i + 1) * bucket) - 1})")

    # A flag: inside _frame.deferred (a collective) it is read with the call's other checks.
    _frame.check_later(_frame.nonfinite_any(scales) if flag is None else flag, explain)


def _unpack_codes(packed: torch.Tensor, n: int, bits: int) -> torch.Tensor:
    per = 8 // bits
    if per == 1:
        return packed
    shifts = _frame.to_device(torch.tensor([8 - bits * (j + 1) for j in range(per)],
                                           dtype=torch.uint8), packed.device)
    return ((packed.unsqueeze(1) >> shifts) & ((1 << bits) - 1)).reshape(-1)[:n]


class _Work:
    """Scratch buffers for one chunk, reused so the hot loop allocates nothing."""

    __slots__ = ("f", "t", "s", "h", "tmp", "pair")

    def __init__(self, size: int, device: torch.device):
        self.f = torch.empty(size, dtype=torch.float32, device=device)
        self.t = torch.empty(size, dtype=torch.int32, device=device)
        self.s = torch.empty(size, dtype=torch.int32, device=device)
        self.h = torch.empty(size // 2, dtype=torch.int32, device=device)
        self.tmp = torch.empty(size // 2, dtype=torch.int32, device=device)
        self.pair = torch.empty(size // 2, dtype=torch.int64, device=device)


def _pack_chunk(codes: torch.Tensor, bits: int, work: _Work, out: torch.Tensor) -> None:
    # Merge neighbours inside int64 words: the low int32 of a pair is the earlier element, so
    # (v << bits) | (v >> 32) holds "first then second" in its low bits (little-endian view).
    # Narrowing copies keep the low bits only.
    width = bits
    while width < 8:
        v = codes.view(torch.int64)
        merged = work.pair[: v.numel()]
        torch.bitwise_left_shift(v, width, out=merged)
        v >>= 32
        merged |= v
        width *= 2
        if width < 8:
            codes = merged.to(torch.int32)
        else:
            out.copy_(merged)
            return
    out.copy_(codes)


def encode(x: torch.Tensor, bits: int = 4, bucket: int = DEFAULT_BUCKET, *, scale: str = "max",
           seed: int | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
    """Quantise ``x`` stochastically and return one qsgd frame.

    Args:
        x: floating-point tensor (flattened); quantised in float32.
        bits: 2, 4 or 8 bits per element (one of them the sign).
        bucket: elements per bucket, each with its own fp32 scale.
        scale: ``"max"`` (max ``|x|``) or ``"l2"`` (the bucket's L2 norm, as in QSGD).
        seed: int making the frame reproducible on any device.
        generator: ``torch.Generator`` to draw the stream key from instead (one draw per call);
            with neither, torch's default CPU generator is used.

    Returns:
        uint8 frame on ``x``'s device, :func:`encoded_size` bytes long.

    Raises:
        ValueError: a bucket holds NaN or inf, or a bad ``bits``/``bucket``/``scale``.

    """
    v = _frame.check_float(x)
    bits, bucket, scale = check_config(bits, bucket, scale)
    key = _rng.key_from(seed, generator)
    n = v.numel()
    path = _frame.backend(v)
    header = HEADER.pack(n, bits, SCALES.index(scale), bucket)
    if path == "triton":
        # The kernel writes the codes into the frame itself: a copy of them would add up to
        # half the traffic of reading x (8-bit codes) to a pass that is memory bound. The
        # frame is placed so that its codes start 16-byte aligned (the header is 14 bytes),
        # and the kernel writes the header too: no copy from the host, no launch of its own.
        start = HEADER.size + 4 * (-(-n // bucket))
        kernels = _frame.kernels()
        if (scale == "max" and 8 <= bucket <= kernels.MAX_FUSED_BUCKET
                and bucket & (bucket - 1) == 0):  # one pass: the scales with the codes
            flag = _frame.clean_flag(v.device)
            frame = kernels.qsgd_frame(v.contiguous(), bits, bucket, key, header, flag)
            _check_scales(lambda: frame[HEADER.size : start].view(torch.float32), bucket, n,
                          scale, flag)
            return frame
        frame = _frame.empty_aligned_at(encoded_size(n, bits, bucket), start, v.device)
        # The scales end where the aligned codes start, so they are 4-byte aligned too: they
        # are written into the frame where they lie, not copied there.
        scales = frame[HEADER.size : start].view(torch.float32)
        _encode_triton(v, bits, bucket, scale, key, scales, frame[start:], (frame, header))
        _check_scales(scales, bucket, n, scale)
        return frame
    if path == "numpy" and _has_numba():
        scales, codes = _encode_cpu(v, bits, bucket, scale, key)
    else:
        scales, codes = _encode_torch(v, bits, bucket, scale, key)
    _check_scales(scales, bucket, n, scale)  # once at the end: one device sync, not one a chunk
    return torch.cat([_frame.host_bytes(header, v.device), _frame.float_bytes(scales), codes])


def _has_numba() -> bool:
    # The compiled CPU encoder needs the jit extra; without it the torch ops write the same
    # bytes, several times slower, and the user hears once what to install.
    if not _jit.available():  # importing numba costs ~0.3 s: only on first use
        warnings.warn("qsgd on CPU tensors runs torch ops without numba (same bytes, several "
                      "times slower): pip install 'bitcomm[jit]' for the compiled encoder",
                      RuntimeWarning, stacklevel=3)
        return False
    return True


def _encode_cpu(v: torch.Tensor, bits: int, bucket: int, scale: str, key: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    # One compiled pass (bitcomm.codecs._qsgd_cpu); it computes what _encode_torch computes.
    # Importing numba costs ~0.3 s: only on first use.
    from bitcomm.codecs import _qsgd_cpu

    n = v.numel()
    v32 = v.to(torch.float32).contiguous()
    a = v32.numpy()
    scales = torch.empty(-(-n // bucket), dtype=torch.float32)
    fuse = scale == "max" and _qsgd_cpu.TASK % bucket == 0
    threads = _qsgd_cpu.threads_for(n)
    if scale == "l2":
        _scales_into(scales, v32, bucket, scale)
    elif not fuse:
        (_qsgd_cpu.max_scales if threads > 1 else _qsgd_cpu.max_scales_serial)(
            a, bucket, scales.numpy())
    codes = np.empty((n * bits + 7) // 8, dtype=np.uint8)
    args = (a, bucket, bits, key & 0xFFFFFFFF, scales.numpy(), fuse, codes)
    if threads > 1:
        _qsgd_cpu.encode_codes(*args, threads)
    else:
        _qsgd_cpu.encode_codes_serial(*args)
    return scales, torch.from_numpy(codes)


def _encode_triton(v: torch.Tensor, bits: int, bucket: int, scale: str, key: int,
                   scales: torch.Tensor, out: torch.Tensor, header: tuple[torch.Tensor, bytes]
                   ) -> None:
    # The scales by torch, then one kernel pass over x (bitcomm.codecs._kernels) for the
    # codes, written to ``out`` (ceil(n * bits / 8) bytes), and the header (`header`: the
    # frame and its bytes): what _encode_torch computes. The fused pass (the bucket max in
    # it) is qsgd_frame's.
    x = v.contiguous()
    _scales_into(scales, x.to(torch.float32), bucket, scale)
    factors = _factors(scales, (1 << (bits - 1)) - 1)
    _frame.kernels().qsgd_codes(x, bits, bucket, key, scales, factors, out=out, header=header)


def _factors(scales: torch.Tensor, s: int) -> torch.Tensor:
    # s * 2**16 / scale evaluated as a reciprocal then a product (what torch does for a scalar
    # over a tensor), written out so the compiled CPU path can match it bit for bit.
    return torch.where(scales > 0, scales.reciprocal() * (s * 65536.0), torch.zeros_like(scales))


def _encode_torch(v: torch.Tensor, bits: int, bucket: int, scale: str, key: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    # Torch ops only, so it runs on any device (the CUDA path); chunked to stay in cache.
    n = v.numel()
    s = (1 << (bits - 1)) - 1
    scales = torch.empty(-(-n // bucket), dtype=torch.float32, device=v.device)
    aligned = _CHUNK % bucket == 0
    if not aligned:  # buckets straddle chunks: all scales first, then a gather per element
        _scales_into(scales, v.to(torch.float32), bucket, scale)
        factor_all = _factors(scales, s)
    codes = torch.empty((n * bits + 7) // 8, dtype=torch.uint8, device=v.device)
    size = min(_CHUNK, -(-n // _rng.BLOCK) * _rng.BLOCK)
    work = _Work(size, v.device)
    sign_shift = 32 - bits
    for start in range(0, n, _CHUNK):
        m = min(_CHUNK, n - start)
        padded = -(-m // _rng.BLOCK) * _rng.BLOCK
        xs = v[start : start + m]
        if xs.dtype != torch.float32:
            xs = xs.to(torch.float32)
        f, t, sg = work.f[:padded], work.t[:padded], work.s[:padded]
        torch.abs(xs, out=f[:m])
        f[m:].zero_()
        # Fixed-point stochastic rounding: t = round(y * 2**16) with y = |x| * s / scale, then
        # level = (t + r) >> 16 for a uniform 16-bit r: E[level] = t / 2**16 = y within 2**-17.
        if aligned:
            # Scales chunk by chunk, while the chunk is in cache for the quantisation pass too.
            first, nbk = start // bucket, -(-m // bucket)
            sc = scales[first : first + nbk]
            _scales_into(sc, xs, bucket, scale)
            factor = _factors(sc, s)
            full = m // bucket
            f[: full * bucket].view(full, bucket).mul_(factor[:full, None])
            if full < nbk:
                f[full * bucket : m].mul_(factor[full])
        else:
            index = torch.arange(start, start + m, device=v.device).div_(bucket,
                                                                         rounding_mode="floor")
            f[:m].mul_(factor_all[index])
        f.add_(0.5)
        t.copy_(f)  # float -> int32 truncates: t = round(y * 2**16)
        _rng.add_random16_(t, key, start, work=(work.h, work.tmp))
        t >>= 16
        t.clamp_(max=s)
        # The float's sign bit, moved to bit (bits - 1) by an arithmetic shift of its int view.
        torch.bitwise_right_shift(xs.view(torch.int32), sign_shift, out=sg[:m])
        sg[m:].zero_()
        sg &= 1 << (bits - 1)
        t |= sg
        lo = start * bits // 8
        nbytes = padded * bits // 8
        dest = codes[lo : lo + nbytes]
        if dest.numel() == nbytes:
            _pack_chunk(t, bits, work, dest)
        else:  # the last chunk: pack the padded codes, keep the bytes that belong to n
            tail = torch.empty(nbytes, dtype=torch.uint8, device=v.device)
            _pack_chunk(t, bits, work, tail)
            dest.copy_(tail[: dest.numel()])
    return scales, codes




def decode(frame: torch.Tensor, *, dtype: torch.dtype = torch.float32, n: int | None = None
           ) -> tuple[torch.Tensor, int]:
    """Decode one qsgd frame to ``sign * (level * step)``; return ``(values, consumed)``.

    ``step = scale / s`` is one correctly rounded float32 division per bucket and each value
    one float32 product, so every device decodes a frame to the same bits. The bucket size
    never sizes an allocation (a frame may legally have one bucket of 2**32 - 1 elements).

    ``n``: the length the caller expects, checked against the header (``ValueError``); without
    it the header's length is bounded as :mod:`bitcomm.codecs` says. With it, on the Triton
    path a frame with the header of the last frame of ``n`` elements decoded on its device
    costs one host read, after the decoding pass, in place of a read of the header before it
    and one of the checks after.
    """
    buf = _frame.as_buffer(frame)
    expected = n
    if expected is not None and _frame.use_triton(buf):
        known = _speculated(buf, _frame.check_count(expected, "n"), dtype)
        if known is not None:
            return known
    n, bits, scale_code, bucket = _frame.read_struct(buf, 0, HEADER, _CODEC, "header")
    if n < 0:
        raise ValueError(f"corrupt {_CODEC} frame: expected n >= 0, got {n}")
    _frame.check_length(n, buf.numel(), expected, _CODEC)
    if bits not in BITS:
        raise ValueError(f"corrupt {_CODEC} frame: expected bits in {BITS}, got {bits}")
    if scale_code >= len(SCALES):
        raise ValueError(f"corrupt {_CODEC} frame: expected scale code 0 or 1, got {scale_code}")
    if bucket < 1:
        raise ValueError(f"corrupt {_CODEC} frame: expected bucket >= 1, got {bucket}")
    nb = -(-n // bucket)
    off = HEADER.size + 4 * nb  # the codes'
    _frame.need(buf, off, _CODEC, "scales")
    end = off + (n * bits + 7) // 8
    _frame.need(buf, end, _CODEC, "codes")
    raw = buf[HEADER.size : off]
    if _frame.use_numpy(buf):
        return _decode_numpy(_frame.from_bytes(raw, torch.float32), buf[off:end], n, bits,
                             bucket, dtype), end
    if _frame.use_triton(buf):  # the steps, both rules' checks and the values in one pass
        flag = _frame.clean_flag(buf.device)  # read by _check_frame
        values = _frame.kernels().qsgd_decode(buf[:end], HEADER.size, n, bits, bucket, dtype,
                                              flag)
        # the scales as floats only to name a broken rule
        _check_frame(lambda: _frame.from_bytes(raw, torch.float32), None, n, bits, flag)
        if n:
            _SEEN.remember(buf.device, (n, bits, scale_code, bucket))
        return values, end
    codes = buf[off:end]
    scales = _frame.from_bytes(raw, torch.float32)
    _check_frame(lambda: scales, codes, n, bits)
    steps = _steps(scales, bits)
    return _values(steps, codes, n, bits, bucket, dtype), end


class _Layouts:
    """The header of the last frame of each length decoded on each device (Triton path).

    A caller that passes the length it expects (a collective, a training loop) decodes frames
    of one layout call after call. :func:`_speculated` decodes the next frame of that length
    as if it had the same header, which the decoding pass compares on the device: one host
    read after the launch, where reading the header first waits for the device before the
    launch (on an H100 a qsgd decode of 64M elements spent about as long on the two waits and
    the host's work between them as in its kernel). Bounded: a job decodes a few lengths.
    """

    LIMIT = 256
    """Lengths remembered; past it the memory starts again."""

    def __init__(self) -> None:
        # (device, n): (the header's fields, its bytes, the frame's length)
        self._last: dict[tuple[torch.device, int], tuple[tuple[int, int, int, int], bytes,
                                                         int]] = {}

    def get(self, device: torch.device, n: int
            ) -> tuple[tuple[int, int, int, int], bytes, int] | None:
        """Return the last header of ``n`` on ``device``, its bytes and frame length, or None.

        The header as ``(n, bits, scale code, bucket)``; the length as :func:`encoded_size`.
        """
        return self._last.get((device, n))

    def remember(self, device: torch.device, header: tuple[int, int, int, int]) -> None:
        """Remember a header that decoded on ``device`` (its n > 0)."""
        if len(self._last) >= self.LIMIT:
            self._last.clear()
        n, bits, _, bucket = header
        self._last[(device, n)] = (header, HEADER.pack(*header), encoded_size(n, bits, bucket))


_SEEN = _Layouts()


def _speculated(buf: torch.Tensor, n: int, dtype: torch.dtype
                ) -> tuple[torch.Tensor, int] | None:
    """Decode ``buf`` as :func:`decode` would if its header is the last one of ``n`` seen.

    ``None`` where no header of ``n`` was seen on the device, where ``buf`` is shorter than a
    frame of that layout (so the pass reads only its bytes and allocates only what they
    justify), or where the pass flags the frame: another header, or a broken rule. The caller
    then decodes it the ordinary way, which names any error; a frame that only differs pays
    one pass more.
    """
    device = buf.device
    seen = _SEEN.get(device, n)
    if seen is None:
        return None
    (_, bits, _, bucket), packed, end = seen
    size = buf.numel()
    if size < end:
        return None
    flag = _frame.clean_flag(device)
    values = _frame.kernels().qsgd_decode(buf if size == end else buf[:end], HEADER.size, n,
                                          bits, bucket, dtype, flag, header=packed)
    if _frame.read_flag(flag):  # the one host read
        return None
    return values, end


def decode_all(frames: list[torch.Tensor], n: int, bits: int, bucket: int, *,
               scale: str = "max", dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """Return the values of frames that must each hold ``n`` elements of one layout.

    The layout is ``n`` elements encoded with ``bits``, ``bucket`` and ``scale``. The values
    are ``decode(f, dtype=dtype, n=n)``'s for each frame, and so are the errors; a frame whose
    header says another layout is a ``ValueError`` too. Off the numpy path (CUDA), where
    ``decode`` reads each frame's header and checks to the host, the frames are compared with
    the expected header and checked on the device, and one host read covers them all (inside
    :func:`bitcomm.codecs._frame.deferred`, the block's read at its end).
    """
    layout, bufs = _layout(frames, n, bits, bucket, scale)
    stacked = _stacked(bufs, layout, dtype)
    if stacked is None:  # the numpy path, or a frame of another size: one at a time, each
        return [_decode_as(b, layout, dtype) for b in bufs]  # raising its precise error
    rows, steps, off = stacked
    return [_values(steps[i], rows[i, off:], n, bits, bucket, dtype) for i in range(len(bufs))]


def mean_all(frames: list[torch.Tensor], n: int, bits: int, bucket: int, *,
             scale: str = "max", keep: int | None = None,
             residual_of: torch.Tensor | None = None, out: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Return the float32 mean of the frames' values and, with ``keep``, frame ``keep``'s values.

    The frames are :func:`decode_all`'s (the same layout, the same checks and errors); their
    float32 values are added in list order from +0.0 and the sum divided by the number of
    frames, correctly rounded, so every device and path gives the same bits. With triton one
    pass reads every frame's codes once and writes the mean (and the kept frame's values):
    no frame's values are written to memory and read back. For 8 frames of 4 bits that is
    12 bytes an element (4 of codes, 8 written), where decoding each frame to a float vector
    and adding them moved about 150.

    With ``residual_of`` (a float32 tensor of ``n`` elements; needs ``keep``) the second result
    is ``residual_of`` less frame ``keep``'s values (float32 subtraction): error feedback's
    residual, in the same pass where the values would be written and then read back.

    ``out`` (a contiguous float32 tensor of ``n`` elements on the frames' device) receives the
    mean, and is returned, in place of a new tensor.
    """
    layout, bufs = _layout(frames, n, bits, bucket, scale)
    if not bufs:
        raise ValueError("expected at least one frame")
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int)
                             or not 0 <= keep < len(bufs)):
        raise ValueError(f"expected keep in 0..{len(bufs) - 1} or None, got {keep!r}")
    if residual_of is not None:
        if keep is None:
            raise ValueError("residual_of needs keep: the frame whose values it is less")
        if not isinstance(residual_of, torch.Tensor) or residual_of.dtype != torch.float32:
            raise TypeError(f"expected residual_of to be a float32 tensor, got "
                            f"{getattr(residual_of, 'dtype', type(residual_of).__name__)}")
        if residual_of.numel() != n or residual_of.device != bufs[0].device:
            raise ValueError(f"expected residual_of of {n} elements on {bufs[0].device}, got "
                             f"{residual_of.numel()} on {residual_of.device}")
        residual_of = residual_of.detach().reshape(-1).contiguous()
    if out is not None and (not isinstance(out, torch.Tensor) or out.dtype != torch.float32):
        raise TypeError(f"expected out to be a float32 tensor, got "
                        f"{getattr(out, 'dtype', type(out).__name__)}")
    if out is not None and (out.numel() != n or out.device != bufs[0].device
                            or not out.is_contiguous()):
        raise ValueError(f"expected out to be a contiguous tensor of {n} elements on "
                         f"{bufs[0].device}, got {out.numel()} on {out.device}")
    flat = None if out is None else out.view(-1)
    if _frame.use_triton(bufs[0]):
        stacked = _stacked(bufs, layout, torch.float32)
        if stacked is not None:
            rows, steps, off = stacked
            mean, kept = _frame.kernels().qsgd_mean(rows, off, n, bits, bucket, steps, keep,
                                                    residual_of, flat)
            return mean if out is None else out, kept
    values = decode_all(bufs, n, bits, bucket, scale=scale)
    total = (_frame.host_array(n, torch.float32, bufs[0], zeroed=True) if flat is None
             else flat.zero_())
    for v in values:  # in list order: the same sum on every device
        total += v
    # by a tensor on the device: CUDA divides by a Python scalar through its reciprocal
    total /= torch.full((), float(len(values)), device=total.device)
    total = total if out is None else out
    if keep is None:
        return total, None
    return total, values[keep] if residual_of is None else residual_of - values[keep]


def _layout(frames: list[torch.Tensor], n: int, bits: int, bucket: int, scale: str
            ) -> tuple[tuple[int, int, int, int], list[torch.Tensor]]:
    # The header every frame must carry, and the frames as byte buffers.
    bits, bucket, scale = check_config(bits, bucket, scale)
    layout = (_frame.check_count(n, "n"), bits, SCALES.index(scale), bucket)
    return layout, [_frame.as_buffer(f) for f in frames]


def _stacked(bufs: list[torch.Tensor], layout: tuple[int, int, int, int], dtype: torch.dtype
             ) -> tuple[torch.Tensor, torch.Tensor, int] | None:
    """Return the frames as rows, their buckets' float32 steps and the codes' offset.

    Off the numpy path, when every frame has the layout's size: the headers, scales and
    padding are checked on the device, one flag for all (:func:`_frame.check_later`), which a
    frame-by-frame decode (``dtype``) names when set; with triton the checks and the steps
    are one launch. Else ``None``.
    """
    n, bits, _, bucket = layout
    if not bufs or _frame.use_numpy(bufs[0]) or any(
            b.numel() != encoded_size(n, bits, bucket) for b in bufs):
        return None
    rows = _frame.rows_of(bufs)
    nb, off = -(-n // bucket), HEADER.size
    header = _frame.header_on(rows.device, HEADER, layout)
    if _frame.use_triton(rows):
        flag = torch.zeros(1, dtype=torch.int32, device=rows.device)
        steps = _frame.kernels().qsgd_steps(rows, off, nb, n, bits, header, flag)
    else:
        scales = torch.empty((len(bufs), nb), dtype=torch.float32, device=rows.device)
        scales.view(torch.uint8).copy_(rows[:, off : off + 4 * nb])  # aligned for float32
        flags = [(rows[:, :off] != header).any(), (~torch.isfinite(scales) | (scales < 0)).any()]
        used = (n * bits) % 8
        if n and used:
            flags.append((rows[:, -1] & ((1 << (8 - used)) - 1)).any())
        flag = torch.stack(flags).any()
        steps = _steps(scales, bits)
    # The one host read, or inside _frame.deferred a flag read with the call's others: decoded
    # values only ever get added, never address memory. A broken rule is named by the
    # frame-by-frame decode.
    _frame.check_later(flag, lambda: [_decode_as(b, layout, dtype) for b in bufs])
    return rows, steps, off + 4 * nb


def _decode_as(buf: torch.Tensor, layout: tuple[int, int, int, int], dtype: torch.dtype
               ) -> torch.Tensor:
    _frame.check_header(buf, HEADER, ("n", "bits", "scale", "bucket"), layout, _CODEC)
    return decode(buf, dtype=dtype, n=layout[0])[0]


def _values(step: torch.Tensor, codes: torch.Tensor, n: int, bits: int, bucket: int,
            dtype: torch.dtype) -> torch.Tensor:
    # sign * (level * step) of a checked frame's steps (_steps) and packed codes (devices other
    # than numpy's; _decode_numpy is the same arithmetic).
    s = (1 << (bits - 1)) - 1
    if _frame.use_triton(codes):
        return _frame.kernels().qsgd_values(codes, n, bits, bucket, step, dtype)
    codes = _unpack_codes(codes, n, bits)
    level = (codes & s).to(torch.float32)
    neg = (codes >> (bits - 1)).bool()
    full, nb = n // bucket, -(-n // bucket)
    if full:
        level[: full * bucket].view(full, bucket).mul_(step[:full].unsqueeze(1))
    if full < nb:  # the last, partial bucket
        level[full * bucket :].mul_(step[full])
    out = torch.where(neg, -level, level)
    return out.to(dtype)


def _steps(scales: torch.Tensor, bits: int) -> torch.Tensor:
    # scale / s per bucket. A tensor divisor: CUDA divides by a Python scalar as a product
    # with its reciprocal, which differs from the correctly rounded quotient in the last bit.
    return scales / torch.full_like(scales, (1 << (bits - 1)) - 1)


@functools.cache
def _signed_levels(bits: int) -> np.ndarray:
    """Return the float32 table of ``[256, 8 // bits]``: byte -> its codes' signed levels.

    A code with its sign bit set gives ``-level`` (``-0.0`` for level 0); ``(-level) * step``
    is ``-(level * step)`` to the bit, so a product by the step gives the torch path's values.
    """
    s = (1 << (bits - 1)) - 1
    shifts = np.arange(8 - bits, -1, -bits, dtype=np.uint8)
    codes = (np.arange(256, dtype=np.uint8)[:, None] >> shifts) & ((1 << bits) - 1)
    level = (codes & s).astype(np.float32)
    table = np.where(codes >> (bits - 1) != 0, -level, level).astype(np.float32)
    table.setflags(write=False)
    return table


def _decode_numpy(scales: torch.Tensor, codes: torch.Tensor, n: int, bits: int, bucket: int,
                  dtype: torch.dtype) -> torch.Tensor:
    # The torch path's float32 operations in numpy, which costs a microsecond an operation
    # where torch's dispatch costs several: small buckets of a DDP hook decode in a few ops.
    # Each byte's signed levels come from one table lookup, a pass that costs what a copy does
    # (unpacking the codes bit field by bit field and negating under a mask cost 5-10 times more).
    sc, c = scales.numpy(), codes.numpy()
    used = (n * bits) % 8
    flagged = not (np.isfinite(sc).all() and (sc >= 0).all()) or bool(
        n and used and c[-1] & ((1 << (8 - used)) - 1))
    if flagged:
        # Raises the precise error, or, inside _frame.deferred, flags it for the end of the
        # block: the refused frame's values are decoded meanwhile, without numpy's warnings.
        _check_frame(lambda: scales, codes, n, bits)
    with np.errstate(invalid="ignore", over="ignore") if flagged else contextlib.nullcontext():
        step = sc / np.float32((1 << (bits - 1)) - 1)  # float32 / float32: correctly rounded
        per = 8 // bits
        if bucket % per == 0 and _jit.worth(n):
            from bitcomm.codecs import _qsgd_cpu  # the same products in one compiled pass

            level = np.empty(n, dtype=np.float32)
            _qsgd_cpu.decode_values(c, _signed_levels(bits), step, bucket, level, (0,) * per)
            return torch.from_numpy(level).to(dtype)
        level = np.take(_signed_levels(bits), c, axis=0).reshape(-1)[:n]
        full = n // bucket
        if full:
            whole = level[: full * bucket].reshape(full, bucket)  # a view: scaled in place
            np.multiply(whole, step[:full, None], out=whole)
        if full * bucket < n:  # the last, partial bucket
            level[full * bucket :] *= step[full]
    return torch.from_numpy(level).to(dtype)


def _check_frame(scales_of, codes: torch.Tensor | None, n: int, bits: int,
                 flag: torch.Tensor | None = None) -> None:
    # Both rules in one host synchronisation; the messages are built only when one is broken.
    # `scales_of()`: the frame's float32 scales. `flag`: set by qsgd_decode or qsgd_steps
    # when a rule is broken (else tested here, on the packed `codes`).
    def explain() -> None:
        scales = scales_of()
        bad_scale = ~torch.isfinite(scales) | (scales < 0)
        bad = torch.nonzero(bad_scale).reshape(-1)
        if bad.numel():
            i = int(bad[0].item())
            raise ValueError(f"corrupt {_CODEC} frame: expected a finite scale >= 0 in bucket "
                             f"{i}, got {float(scales[i].item())}")
        raise ValueError(f"corrupt {_CODEC} frame: codes padding bits must be zero")

    if flag is None:
        scales = scales_of()
        used = (n * bits) % 8
        pad = codes[-1:] & ((1 << (8 - used)) - 1) if n and used else codes[:0]
        flag = (~torch.isfinite(scales) | (scales < 0)).any() | (pad != 0).any()
    _frame.check_later(flag, explain)
