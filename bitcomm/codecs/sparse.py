"""Sparse frames: (index, value) pairs of a dense vector, for the sparse allgather collectives.

One self-describing frame per rank (RedSync, Section 5.3: "the packaged
message should include an initial element, which indicates the length"; SparCML
SparCML adds quantised values). Frames from several ranks can be concatenated and
read back one after another, since each decoder reports the bytes it consumed.

Wire format
-----------
::

    offset  size      field
    0       8         n        int64 LE: length of the dense vector
    8       8         k        int64 LE: number of entries, 0 <= k <= n
    16      1         values   uint8: 0 = fp32, 1 = fp16, 2 = qsgd, 3 = mean
    17      k * iw    indices  strictly increasing, int32 LE when n < 2**31 (iw = 4), else
                               int64 LE (iw = 8)
    ...               payload  fp32: k float32 LE; fp16: k float16 LE;
                               qsgd: one :mod:`bitcomm.codecs.qsgd` frame of the k values;
                               mean: one float32 LE, the value of every entry (RedSync's
                               sign-uniform mean, 5.2.3)

qsgd's settings (bits, bucket, scale, seed) travel as the value format :class:`Qsgd`, not as
options of every call; the qsgd block's own header records bits, bucket and scale.

The encoder sorts the entries by index (the canonical order, which also makes frames identical
across devices); duplicate or out-of-range indices raise ``ValueError``. Non-finite values raise
``ValueError``; values too large for fp16 raise ``OverflowError``.

Worked example: ``encode(torch.tensor([5, 2]), torch.tensor([1.0, -2.0]), n=8)`` sorts to indices
``[2, 5]`` with values ``[-2, 1]``:
``08 00 00 00 00 00 00 00 | 02 00 00 00 00 00 00 00 | 00 | 02 00 00 00 05 00 00 00 |
00 00 00 c0 00 00 80 3f`` (33 bytes). :func:`decode` returns the dense
``[0, 0, -2, 0, 0, 1, 0, 0]``, or adds those values into ``out``. :func:`encode_at` makes the
frame of a dense vector's entries at a selector's indices, :func:`encode_top` that of its top-k
by magnitude.
"""

from __future__ import annotations

import dataclasses
import math
import struct

import numpy as np
import torch

from bitcomm.codecs import _frame, qsgd, select

__all__ = ["encode", "encode_at", "encode_top", "decode", "decode_all", "decode_entries",
           "encoded_size", "entries_in", "value_format", "Qsgd", "ValueFormat", "HEADER",
           "FORMATS", "FP16_MAX"]

HEADER = struct.Struct("<qqB")
"""Frame header: n (int64), k (int64), value format (uint8); 17 bytes."""
FORMATS = ("fp32", "fp16", "qsgd", "mean")
"""Value formats; their index is the header's format code."""
FP16_MAX = 65504.0
"""The largest finite float16: larger fp16 values raise ``OverflowError``."""

_CODEC = "sparse"
# Below this many indices numpy sorts them on the CPU path (see _sort): torch's CPU sort of
# int64 switches to its fast (radix) sort from 2**15 elements, and is 5x slower below.
_NUMPY_SORT_MAX = 1 << 15


def _index_dtype(n: int) -> torch.dtype:
    return torch.int32 if n < 1 << 31 else torch.int64


@dataclasses.dataclass(frozen=True)
class Qsgd:
    """The ``qsgd`` value format with its settings (see :mod:`bitcomm.codecs.qsgd`).

    The name ``"qsgd"`` means ``Qsgd()``. The settings are checked when the object is made, so a
    bad one fails before anything is selected, encoded or sent.

    Attributes:
        bits: 2, 4 or 8 bits per value.
        bucket: values per fp32 scale.
        scale: ``"max"`` or ``"l2"``.
        seed: int making the rounding reproducible; ``None`` draws the stream key from torch's
            default generator (one draw per frame).

    """

    bits: int = 4
    bucket: int = qsgd.DEFAULT_BUCKET
    scale: str = "max"
    seed: int | None = None

    def __post_init__(self) -> None:
        qsgd.check_config(self.bits, self.bucket, self.scale)
        qsgd.check_seed(self.seed)


ValueFormat = str | Qsgd
"""A value format: a name in :data:`FORMATS`, or a :class:`Qsgd` with settings."""


def value_format(fmt: object) -> str | Qsgd:
    """Return ``fmt`` as ``"fp32"``, ``"fp16"``, ``"mean"`` or a :class:`Qsgd`; raise otherwise.

    ``ValueError`` names the choices for anything that is neither a name in :data:`FORMATS` nor
    a :class:`Qsgd`.
    """
    if isinstance(fmt, Qsgd):
        return fmt
    if isinstance(fmt, str) and fmt in FORMATS:
        return Qsgd() if fmt == "qsgd" else fmt
    raise ValueError(f"expected fmt in {FORMATS} or a sparse.Qsgd, got {fmt!r}")


def encoded_size(n: int, k: int, fmt: ValueFormat = "fp32") -> int:
    """Return the exact frame size in bytes for ``k`` entries of an ``n``-vector."""
    n = _frame.check_count(n, "n")
    k = _frame.check_count(k, "k")
    fmt = value_format(fmt)
    size = HEADER.size + k * _index_dtype(n).itemsize
    if isinstance(fmt, Qsgd):
        return size + qsgd.encoded_size(k, fmt.bits, fmt.bucket)
    if fmt == "fp32":
        return size + 4 * k
    if fmt == "fp16":
        return size + 2 * k
    return size + 4


def encode(indices: torch.Tensor, values: torch.Tensor, n: int,
           fmt: ValueFormat = "fp32", *, check: bool = True) -> torch.Tensor:
    """Encode entries ``(indices[i], values[i])`` of an ``n``-vector as one sparse frame.

    Args:
        indices: integer tensor of k distinct positions in ``[0, n)``, any order.
        values: float tensor of k values (for ``fmt="mean"``, their mean is what is sent).
        n: the dense length.
        fmt: ``"fp32"``, ``"fp16"``, ``"mean"``, ``"qsgd"`` or a :class:`Qsgd` with settings.
        check: sort the entries and check them (indices in range and distinct, values finite
            and, for fp16, in its range), which costs a host read on a GPU (inside a
            ``_frame.deferred`` block, a flag that the block's one read covers). ``False`` is for
            callers whose entries are already so (a selector's ascending indices of a checked
            vector); broken entries then make a broken frame.

    Returns:
        uint8 frame on ``values``' device, :func:`encoded_size` bytes long.

    """
    idx = _frame.check_int(indices, "indices")
    val = _frame.check_float(values, "values")
    n = _frame.check_count(n, "n")
    fmt = value_format(fmt)
    k = idx.numel()
    if val.numel() != k:
        raise ValueError(f"expected as many values as indices ({k}), got {val.numel()}")
    device = val.device
    idx = idx.to(device=device, dtype=torch.int64)
    # Off the numpy path the entries' check is a device flag, read with the qsgd block's, or
    # with the enclosing block's flags (a collective's, which reads once at its end: a broken
    # frame then still goes out, and its receivers flag it too).
    later = not _frame.use_numpy(idx) and (isinstance(fmt, Qsgd) or _frame.deferring())
    written = _writes(k, fmt, val)
    if k and check:
        idx, order = _sort(idx)
        val = val[order]
        if not (later or written):
            _check_entries(idx, val, n, fp16=fmt == "fp16")
    code = FORMATS.index("qsgd" if isinstance(fmt, Qsgd) else fmt)
    if written:
        return _written(idx, val, n, HEADER.pack(n, k, code), fmt, check, gather=False)
    parts = [
        _frame.host_bytes(HEADER.pack(n, k, code), device),
        _frame.float_bytes(idx.to(_index_dtype(n))),
    ]
    # one host read for both checks (the entries' first), unless an enclosing block reads
    with _frame.deferred_here():
        if later and k and check:
            broken = ((idx[0] < 0) | (idx[-1] >= n) | (idx[1:] == idx[:-1]).any()
                      | _frame.nonfinite_any(val, as_float32=True))
            if fmt == "fp16":
                broken |= (val.abs() > FP16_MAX).any()
            _frame.check_later(broken, lambda: _check_entries(idx, val, n, fp16=fmt == "fp16"))
        if isinstance(fmt, Qsgd):
            parts.append(qsgd.encode(val, fmt.bits, fmt.bucket, scale=fmt.scale,
                                     seed=fmt.seed))
        elif fmt == "fp32":
            parts.append(_frame.float_bytes(val.to(torch.float32)))
        elif fmt == "fp16":
            parts.append(_frame.float_bytes(val.to(torch.float16)))
        else:
            # Accumulated in float64, rounded once to float32, on the device: no host round
            # trip.
            mean = (val.to(torch.float64).mean() if k else torch.zeros((), dtype=torch.float64,
                                                                       device=device))
            parts.append(_frame.float_bytes(mean.to(torch.float32).reshape(1)))
    return torch.cat(parts)


_WRITTEN = {"fp32": (torch.float16, torch.bfloat16, torch.float32, torch.float64),
            "fp16": (torch.float16, torch.float32),
            "mean": (torch.float16, torch.bfloat16, torch.float32, torch.float64)}
"""The value formats one kernel writes on the Triton path, and the value dtypes it takes: those
whose conversion to the wire's float rounds once, as torch's does."""


def _writes(k: int, fmt: str | Qsgd, values: torch.Tensor) -> bool:
    # Whether one kernel writes the frame of k > 0 entries (_written) of these values' dtype.
    return bool(k) and fmt in _WRITTEN and values.dtype in _WRITTEN[fmt] \
        and _frame.use_triton(values)


def _written(idx: torch.Tensor, val: torch.Tensor, n: int, header: bytes, fmt: str,
             check: bool, *, gather: bool) -> torch.Tensor:
    # The frame written by one kernel (and a one-program one for a mean): header, indices and
    # values (or the tiles' sums for the mean) in one pass over the entries, the rules flagged
    # in it and read once (or with the enclosing block's flags), where the torch path takes a
    # host copy of the header, casts, a reduction for a mean, a concatenation and, checked, a
    # dozen more launches. gather: val is the dense vector, read at each index.
    device = val.device
    frame = _frame.empty_aligned_at(encoded_size(n, idx.numel(), fmt), HEADER.size, device)
    flags = torch.zeros(1, dtype=torch.int32, device=device) if check else None
    _frame.kernels().sparse_frame(idx.contiguous(), val.contiguous(), header, fmt, frame, flags,
                                  gather=gather)
    # the numpy path's checks name the broken rule
    _frame.raise_if(flags, lambda: _check_entries(idx, _at(val, idx) if gather else val, n,
                                                  fp16=fmt == "fp16"))
    return frame


def _at(v: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    # v's values at idx, and a zero for an index outside v: the entries' check refuses that
    # index before it looks at any value.
    if not v.numel():
        return v.new_zeros(idx.numel())
    return v[idx.clamp(0, v.numel() - 1)]


def encode_at(x: torch.Tensor, indices: torch.Tensor, fmt: ValueFormat = "fp32", *,
              check: bool = True) -> torch.Tensor:
    """Encode the entries of ``x`` at ``indices`` as one sparse frame of ``x.numel()`` elements.

    The frame of ``encode(indices, x.reshape(-1)[indices], x.numel(), fmt, check=check)`` and
    its errors (an index outside ``[0, n)`` is its ``ValueError``, not torch's ``IndexError``),
    for a selector's indices: on the Triton path one kernel reads each value at its index as it
    writes fp32, fp16 or mean values, where a gathered copy of the values would be one more
    launch and pass. Unchecked, the indices are trusted: one outside ``x`` reads nothing (its
    value is 0) and makes a broken frame.
    """
    v = _frame.check_float(x)
    idx = _frame.check_int(indices, "indices")
    n, k, fmt = v.numel(), idx.numel(), value_format(fmt)
    if _writes(k, fmt, v):
        idx = idx.to(device=v.device, dtype=torch.int64)
        if check:  # the values follow their indices: they are read after the sort
            idx = idx.sort().values
        header = HEADER.pack(n, k, FORMATS.index(fmt))
        return _written(idx, v, n, header, fmt, check, gather=True)
    idx = idx.to(v.device)
    return encode(idx, _at(v, idx), n, fmt, check=check)


def encode_top(x: torch.Tensor, k: int, fmt: ValueFormat = "fp32", *,
               check: bool = True) -> torch.Tensor:
    """Encode the ``k`` entries of ``x`` of largest magnitude as one sparse frame.

    The frame of ``encode_at(x, select.select_abs(x, k, check=False), fmt, check=check)``
    (ties to lower indices; a ``k`` above ``x.numel()`` takes every entry) and its errors.
    On the Triton path, for fp32 values (and unchecked fp16 ones) of fewer than ``2**31``
    scores, the top-k's writing pass writes the frame's entries itself: no indices written
    and read back, one launch less. Its check is then the selection's read of ``x`` (float32
    ``x`` only): NaN or inf anywhere in ``x`` is a non-finite value among the k, which rank
    above every finite one; a device flag, read at once or with an enclosing
    ``_frame.deferred`` block's.
    """
    v = _frame.check_float(x)
    k = min(_frame.check_count(k, "k"), v.numel())
    fmt = value_format(fmt)

    def composed() -> torch.Tensor:
        return encode_at(v, select.select_abs(v, k, check=False), fmt, check=check)

    if not _fuses(v, k, fmt, check):
        return composed()
    n = v.numel()
    frame = _frame.empty_aligned_at(encoded_size(n, k, fmt), HEADER.size, v.device)
    census = _frame.kernels().top_frame(v, k, HEADER.pack(n, k, FORMATS.index(fmt)), fmt,
                                        frame, census=check)
    if check:  # the frame's own check says which rule
        _frame.check_later(census[0], composed)
    return frame


def _fuses(v: torch.Tensor, k: int, fmt: str | Qsgd, check: bool) -> bool:
    # Whether encode_top's selection writes the frame (_kernels.top_frame).
    if not (k and fmt in ("fp32", "fp16") and v.numel() < 2**31 and v.is_contiguous()
            and _frame.use_triton(v)):
        return False
    if check:  # the census's check covers what the frame's would: float32 into float32
        return fmt == "fp32" and v.dtype == torch.float32
    return v.dtype in _WRITTEN[fmt]


def _sort(idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``idx`` sorted and the order that sorts it (``Tensor.sort``'s pair).

    On the numpy path below ``_NUMPY_SORT_MAX`` indices numpy sorts: torch's CPU sort of int64
    took 5x numpy's time from about 8K elements to 32767 on the 2-core VM (10K: 383 us against
    ``np.argsort``'s 76; 32000: 1457 against 281), and from 32768 it is the faster (162
    against 285). Indices are distinct or refused, so both orders are the same.
    """
    if _frame.use_numpy(idx) and idx.numel() < _NUMPY_SORT_MAX:
        a = idx.numpy()
        order = np.argsort(a)
        return torch.from_numpy(a[order]), torch.from_numpy(order)
    return idx.sort()


def _check_entries(idx: torch.Tensor, val: torch.Tensor, n: int, *, fp16: bool) -> None:
    # Sorted indices and their values: every rule in one host read; the message, which needs
    # more, is built only when a rule is broken.
    if _frame.use_numpy(idx) and val.dtype != torch.bfloat16:
        i, v = idx.numpy(), val.numpy()  # numpy's small operations cost a microsecond each
        lo, hi, dup = int(i[0]), int(i[-1]), bool((i[1:] == i[:-1]).any())
        nonfinite = not _frame.all_finite(val, as_float32=True)
        too_big = fp16 and bool((np.abs(v) > FP16_MAX).any())
    else:
        rules = torch.stack([
            idx[0], idx[-1], (idx[1:] == idx[:-1]).any().to(torch.int64),
            # on the wire's float32 (or smaller): a float64 beyond float32's range becomes inf
            _frame.nonfinite_any(val, as_float32=True).to(torch.int64),
            (val.abs() > FP16_MAX).any().to(torch.int64) if fp16 else idx[0] * 0,
        ])
        lo, hi, dup, nonfinite, too_big = rules.tolist()
    if lo < 0 or hi >= n:
        raise ValueError(f"expected indices in [0, {n}), got {lo if lo < 0 else hi}")
    if dup:
        first = int(idx[1:][idx[1:] == idx[:-1]][0].item())
        raise ValueError(f"expected distinct indices, got {first} more than once")
    if nonfinite:
        raise ValueError("expected finite values, got NaN, inf or a float64 beyond float32's "
                         "range")
    if too_big:
        raise OverflowError(f"expected |values| <= {FP16_MAX} for fp16, got "
                            f"{float(val.abs().max().item())}")


def decode_entries(frame: torch.Tensor, *, dtype: torch.dtype = torch.float32,
                   n: int | None = None) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """Decode one sparse frame to ``(indices, values, n, bytes_consumed)`` without densifying.

    Allocates only the k entries the frame carries, so any dense length is accepted; ``n``, the
    length the caller expects, is checked against the header (``ValueError``).
    """
    return _entries(_frame.as_buffer(frame), dtype, n, bounded=False)


def _header(buf: torch.Tensor, expected: int | None, *, bounded: bool
            ) -> tuple[int, int, str, int, int]:
    # The frame's (n, k, value format, where its values start, where they end: for a qsgd
    # block, where it starts), its header checked and its indices' bytes (and fp32 / fp16
    # values') present. bounded: the caller will allocate the dense n, so without an expected
    # length the header's n must be one the frame can justify (bitcomm.codecs' limit).
    n, k, code = _frame.read_struct(buf, 0, HEADER, _CODEC, "header")
    if n < 0:
        raise ValueError(f"corrupt {_CODEC} frame: expected n >= 0, got {n}")
    if expected is not None or bounded:
        _frame.check_length(n, buf.numel(), expected, _CODEC)
    if not 0 <= k <= n:
        raise ValueError(f"corrupt {_CODEC} frame: expected 0 <= k <= n={n}, got k={k}")
    if code >= len(FORMATS):
        raise ValueError(f"corrupt {_CODEC} frame: expected a value format code below "
                         f"{len(FORMATS)}, got {code}")
    fmt = FORMATS[code]
    off = HEADER.size + k * _index_dtype(n).itemsize
    _frame.need(buf, off, _CODEC, "indices")
    end = off
    if fmt in _VALUE_TYPES:
        end = off + k * _VALUE_TYPES[fmt].itemsize
        _frame.need(buf, end, _CODEC, "values")
    elif fmt == "mean":  # checked where it is read, after the indices
        end = off + 4
    return n, k, fmt, off, end


_VALUE_TYPES = {"fp32": torch.float32, "fp16": torch.float16}
"""The value formats that carry one float a value, and its type."""


def _entries(buf: torch.Tensor, dtype: torch.dtype, expected: int | None, *, bounded: bool,
             head: tuple[int, int, str, int, int] | None = None
             ) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    # head: _header's result, where the caller read it already (a host read on a GPU).
    n, k, fmt, off, end = _header(buf, expected, bounded=bounded) if head is None else head
    idx = _frame.from_bytes(buf[HEADER.size : off], _index_dtype(n)).to(torch.int64)
    val = None
    if fmt in _VALUE_TYPES:
        val = _frame.from_bytes(buf[off:end], _VALUE_TYPES[fmt]).to(dtype)
    if k:
        # Every rule in one host read.
        if _frame.use_numpy(idx):
            i = idx.numpy()
            lo, hi, unordered = int(i[0]), int(i[-1]), bool((i[1:] <= i[:-1]).any())
            nonfinite = val is not None and not _frame.all_finite(val)
        else:
            rules = torch.stack([
                idx[0], idx[-1], (idx[1:] <= idx[:-1]).any().to(torch.int64),
                _frame.nonfinite_any(val).to(torch.int64) if val is not None else idx[0] * 0,
            ])
            lo, hi, unordered, nonfinite = rules.tolist()
        if lo < 0 or hi >= n:
            raise ValueError(f"corrupt {_CODEC} frame: expected indices in [0, {n}), got "
                             f"{lo}..{hi}")
        if unordered:
            raise ValueError(f"corrupt {_CODEC} frame: expected strictly increasing indices")
        if nonfinite:
            raise ValueError(f"corrupt {_CODEC} frame: expected finite {fmt} values")
    if fmt == "qsgd":
        val, used = qsgd.decode(buf[off:], dtype=dtype)
        if val.numel() != k:
            raise ValueError(f"corrupt {_CODEC} frame: expected a qsgd block of k={k} values, "
                             f"got {val.numel()}")
        end = off + used
    elif fmt == "mean":
        (mean,) = _frame.read_struct(buf, off, struct.Struct("<f"), _CODEC, "mean")
        if not math.isfinite(mean):
            raise ValueError(f"corrupt {_CODEC} frame: expected a finite mean, got {mean}")
        if k == 0 and mean != 0:  # the encoder writes 0: one frame per content, none other
            raise ValueError(f"corrupt {_CODEC} frame: expected k = 0 to come with mean 0, "
                             f"got {mean}")
        if mean == 0 and math.copysign(1.0, mean) < 0:  # the mean accumulates from +0
            raise ValueError(f"corrupt {_CODEC} frame: expected a zero mean to be +0, got -0")
        val = torch.full((k,), mean, dtype=dtype, device=buf.device)
    return idx, val, n, end


def decode_all(frames: list[torch.Tensor], n: int, k: int | None, fmt: ValueFormat = "fp32", *,
               dtype: torch.dtype = torch.float32) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Return ``(indices, values)`` of frames of ``n``-vectors that must each hold ``k`` entries.

    The entries of ``decode_entries(f, dtype=dtype, n=n)`` for each frame, and its errors; a
    frame whose header says another ``k`` or format, or with bytes past its entries, is a
    ``ValueError`` too. ``k=None``: each frame holds however many its size says
    (:func:`entries_in`). Off the numpy path (CUDA), where ``decode_entries`` reads each
    frame's header and rules to the host, the frames are compared with the expected header
    and checked on the device (for qsgd values, with their qsgd blocks), and one host read
    covers them all; inside a ``_frame.deferred`` block (a collective's) that read is the
    block's, at its end, and until then the indices are handed out clamped into ``[0, n)``.
    """
    form = value_format(fmt)
    n = _frame.check_count(n, "n")
    if k is not None:
        k = _frame.check_count(k, "k")
    code = FORMATS.index(form if isinstance(form, str) else "qsgd")
    bufs = [_frame.as_buffer(f) for f in frames]
    ks = [entries_in(n, b.numel(), form) for b in bufs]
    device_path = (form in ("fp32", "fp16", "mean") and bufs
                   and not _frame.use_numpy(bufs[0]) and None not in ks
                   and (k is None or all(c == k for c in ks)))
    if device_path and form != "mean" and k is not None and 0 < k <= n:
        got = _rows(bufs, n, k, form, code, dtype)
        if got is not None:
            return got
    elif device_path:
        got = _each(bufs, ks, n, form, code, dtype)
        if got is not None:
            return got
    elif (isinstance(form, Qsgd) and bufs and not _frame.use_numpy(bufs[0]) and None not in ks
          and (k is None or all(c == k for c in ks))):
        if len(set(ks)) == 1:
            return _qsgd_rows(bufs, ks, n, k, form, code, dtype)
        return _qsgd_each(bufs, ks, n, form, code, dtype)
    return _one_by_one(bufs, ks, n, k, code, dtype)


def _one_by_one(bufs: list[torch.Tensor], ks: list[int | None], n: int, k: int | None,
                code: int, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    # The numpy path, qsgd values of unknown k, or some frame is corrupt: one at a time, each
    # raising its precise error.
    out = []
    for b, sized in zip(bufs, ks, strict=True):
        # the entries the call expects, else those the size of a frame of this format says,
        # else (another format, which the check names) its header's
        want = k
        if want is None:
            _, said, said_code = _frame.read_struct(b, 0, HEADER, _CODEC, "header")
            want = sized if sized is not None and said_code == code else said
        _frame.check_header(b, HEADER, ("n", "k", "format"), (n, want, code), _CODEC)
        idx, val, _, used = decode_entries(b, dtype=dtype, n=n)
        if used != b.numel():
            raise ValueError(f"corrupt {_CODEC} frame: expected {used} bytes for its entries, "
                             f"got {b.numel()}")
        out.append((idx, val))
    return out


def entries_in(n: int, size: int, fmt: ValueFormat = "fp32") -> int | None:
    """Return the entries a ``size``-byte frame of ``fmt`` values of an ``n``-vector holds.

    ``None`` where no frame has that size. Every format's frame grows with the entries, by at
    least an index each, so at most one count has a given size; for qsgd values, whose block
    is not linear in the entries, a bisection finds it.
    """
    form = value_format(fmt)
    if isinstance(form, Qsgd):
        lo, hi = 0, n
        while lo < hi:  # the least k whose frame is at least size bytes
            mid = (lo + hi) // 2
            if encoded_size(n, mid, form) < size:
                lo = mid + 1
            else:
                hi = mid
        return lo if encoded_size(n, lo, form) == size else None
    iw = _index_dtype(n).itemsize
    body = size - HEADER.size - (4 if form == "mean" else 0)
    per = iw + {"fp32": 4, "fp16": 2, "mean": 0}[form]
    count, rest = divmod(body, per)
    return count if body >= 0 and not rest and count <= n else None


def _rows(bufs: list[torch.Tensor], n: int, k: int, form: str, code: int, dtype: torch.dtype
          ) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    # Frames of one size, stacked: the checks of all in a few operations and one host read.
    rows = _frame.rows_of(bufs)
    itype = _index_dtype(n)
    vtype = torch.float32 if form == "fp32" else torch.float16
    off = HEADER.size
    parts = []
    for t in (itype, vtype):  # copied out of the rows, so aligned for their dtypes
        part = torch.empty((len(bufs), k), dtype=t, device=rows.device)
        part.view(torch.uint8).copy_(rows[:, off : off + k * t.itemsize])
        parts.append(part)
        off += k * t.itemsize
    idx, val = parts[0].to(torch.int64), parts[1].to(dtype)
    header = _frame.header_on(rows.device, HEADER, (n, k, code))
    flags = [(rows[:, : HEADER.size] != header).any(), (idx[:, 0] < 0).any(),
             (idx[:, -1] >= n).any(), (idx[:, 1:] <= idx[:, :-1]).any(),
             _frame.nonfinite_any(parts[1])]
    idx = _checked(torch.stack(flags).any(), idx, n,
                   lambda: _one_by_one(bufs, [k] * len(bufs), n, k, code, dtype))
    return None if idx is None else [(idx[i], val[i]) for i in range(len(bufs))]


def _checked(flag: torch.Tensor, idx: torch.Tensor, n: int, fallback) -> torch.Tensor | None:
    # The device paths' checks: read now (None: a rule is broken, else idx), or, inside a
    # deferred block (a collective's, whose caller may take its flags), left to the block's
    # read, the indices handed out in range until then.
    if not _frame.deferring():
        return None if bool(flag) else idx  # the one host read
    _frame.check_later(flag, fallback)
    return _in_range(idx, n)


def _in_range(idx: torch.Tensor, n: int) -> torch.Tensor:
    # Indices whose check an enclosing block reads later, clamped into [0, n): until that
    # read raises, a broken frame's indices address only the vector's own memory. A copy:
    # they may view the frame, which the precise check re-reads if a rule is broken.
    return idx.clamp(0, max(n - 1, 0))


def _qsgd_rows(bufs: list[torch.Tensor], ks: list[int | None], n: int, expected: int | None,
               form: Qsgd, code: int, dtype: torch.dtype
               ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    # Frames of qsgd values that all hold k entries (their sizes say so), stacked: the
    # headers' and indices' checks and the qsgd blocks' (qsgd.decode_all) share one host
    # read, made before any index is returned (or an enclosing block's, the indices kept in
    # range until then).
    k = ks[0]
    assert k is not None
    rows = _frame.rows_of(bufs)
    itype = _index_dtype(n)
    end = HEADER.size + k * itype.itemsize
    idx = torch.empty((len(bufs), k), dtype=itype, device=rows.device)
    idx.view(torch.uint8).copy_(rows[:, HEADER.size:end])  # copied out: aligned for itype
    idx = idx.to(torch.int64)
    flags = [(rows[:, : HEADER.size] != _frame.header_on(rows.device, HEADER, (n, k, code))
              ).any()]
    if k:
        flags += [(idx[:, 0] < 0).any(), (idx[:, -1] >= n).any(),
                  (idx[:, 1:] <= idx[:, :-1]).any()]
    outer = _frame.deferring()
    with _frame.deferred_here():  # inside a collective's block, its read is this one
        _frame.check_later(torch.stack(flags).any(),
                           lambda: _one_by_one(bufs, ks, n, expected, code, dtype))
        values = qsgd.decode_all([rows[i, end:] for i in range(len(bufs))], k, form.bits,
                                 form.bucket, scale=form.scale, dtype=dtype)
    if outer:
        idx = _in_range(idx, n)
    return [(idx[i], values[i]) for i in range(len(bufs))]


def _indices_flagged(b: torch.Tensor, n: int, k: int, code: int, flags: list[torch.Tensor]
                     ) -> tuple[torch.Tensor, int]:
    """Return a frame's k indices (int64) and the offset where they end.

    The header's and the indices' rules go to ``flags`` as device flags (no host read).
    """
    head = _frame.from_bytes(b[:16], torch.int64)
    flags += [head[0] != n, head[1] != k, b[16] != code]
    itype = _index_dtype(n)
    end = HEADER.size + k * itype.itemsize
    idx = _frame.from_bytes(b[HEADER.size:end], itype).to(torch.int64)
    if k:
        flags.append(_frame.broken_order(idx, 0, n))
    return idx, end


def _qsgd_each(bufs: list[torch.Tensor], ks: list[int], n: int, form: Qsgd, code: int,
               dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    # Frames of qsgd values of any sizes: each one's checks as device flags, read with every
    # qsgd block's in one host read, made before any index is returned (or an enclosing
    # block's, the indices kept in range until then).
    flags: list[torch.Tensor] = []
    entries = []
    outer = _frame.deferring()
    with _frame.deferred_here():  # inside a collective's block, its read is this one
        for b, k in zip(bufs, ks, strict=True):
            idx, end = _indices_flagged(b, n, k, code, flags)
            entries.append((_in_range(idx, n) if outer else idx, b[end:]))
        _frame.check_later(torch.stack(flags).any(),
                           lambda: _one_by_one(bufs, ks, n, None, code, dtype))
        out = [(idx, qsgd.decode_all([block], k, form.bits, form.bucket, scale=form.scale,
                                     dtype=dtype)[0])
               for (idx, block), k in zip(entries, ks, strict=True)]
    return out


def _each(bufs: list[torch.Tensor], ks: list[int], n: int, form: str, code: int,
          dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    # Frames of any sizes: their headers, indices and values gathered into one tensor each,
    # every rule checked on all of them at once and one host read for all (None if one is
    # broken): a fixed number of small operations, where a frame at a time took about twenty
    # a frame, each a kernel launch on a GPU.
    device = bufs[0].device
    itype = _index_dtype(n)
    ends = [HEADER.size + k * itype.itemsize for k in ks]
    total = sum(ks)
    heads = torch.stack([b[: HEADER.size] for b in bufs])
    want = _frame.host_bytes(b"".join(HEADER.pack(n, k, code) for k in ks), device)
    flags = [(heads != want.view(len(bufs), HEADER.size)).any()]
    # concatenated into a new tensor: aligned for the index dtype
    idx = torch.cat([b[HEADER.size : e] for b, e in zip(bufs, ends, strict=True)]
                    ).view(itype).to(torch.int64)
    # each frame's count of entries, then where each frame but the first starts among them
    # (those that hold entries): one copy to the device
    starts = [int(s) for s in np.cumsum(ks)[:-1] if 0 < s < total]
    meta = _frame.host_bytes(np.asarray(ks + starts, dtype=np.int64).tobytes(), device
                             ).view(torch.int64)
    counts = meta[: len(ks)]
    if total:
        lo, hi = torch.aminmax(idx)
        flags.append((lo < 0) | (hi >= n))
        if total > 1:
            # strictly increasing within each frame: a pair whose second entry starts a frame
            # does not count
            first = torch.zeros(total, dtype=torch.bool, device=device)
            first.index_fill_(0, meta[len(ks) :], True)  # = True would copy from the host
            flags.append(((idx[1:] <= idx[:-1]) & ~first[1:]).any())
    if form == "mean":
        means = torch.cat([b[e : e + 4] for b, e in zip(bufs, ends, strict=True)]
                          ).view(torch.float32)
        # finite; 0 when there are no entries; a zero mean is +0 (the encoder's)
        flags += [_frame.nonfinite_any(means), (means.view(torch.int32) == -(1 << 31)).any(),
                  ((means != 0) & (counts == 0)).any()]
        val = torch.repeat_interleave(means.to(dtype), counts, output_size=total)
    else:
        val = torch.cat([b[e:] for b, e in zip(bufs, ends, strict=True)]).view(
            torch.float32 if form == "fp32" else torch.float16)
        flags.append(_frame.nonfinite_any(val))
        val = val.to(dtype)
    idx = _checked(torch.stack(flags).any(), idx, n,
                   lambda: _one_by_one(bufs, ks, n, None, code, dtype))
    return None if idx is None else list(zip(idx.split(ks), val.split(ks), strict=True))


def decode(frame: torch.Tensor, *, out: torch.Tensor | None = None,
           dtype: torch.dtype = torch.float32, n: int | None = None
           ) -> tuple[torch.Tensor, int]:
    """Decode one sparse frame into a dense vector; return ``(dense, bytes_consumed)``.

    Args:
        frame: buffer starting with a sparse frame.
        out: optional 1-D float tensor of length n to *add* the entries into (returned); its
            length is the one expected.
        dtype: dtype of a freshly allocated result when ``out`` is not given.
        n: the dense length the caller expects (``ValueError`` if the header says otherwise).
            Without ``n`` or ``out``, the header's length is bounded as :mod:`bitcomm.codecs`
            says: the zeros of a dense vector are backed by no payload.

    """
    buf = _frame.as_buffer(frame)
    head = None
    if out is not None:
        _frame.check_float(out, "out")
    elif _frame.use_triton(buf) and dtype in (torch.float32, torch.float64):
        head = _header(buf, n, bounded=True)
        scattered = _scattered(buf, dtype, n, head)
        if scattered is not None:
            return scattered
    # One read of the header (a host copy for a device frame); the entries alone are allocated
    # before the dense length is checked, and they are what the frame's bytes justify.
    idx, val, n, end = _entries(buf, dtype if out is None else out.dtype, n,
                                bounded=out is None, head=head)
    if out is None:
        out = _frame.host_array(n, dtype, val, zeroed=True)
    elif out.dim() != 1 or out.numel() != n:
        raise ValueError(f"expected out to be 1-D of length {n} (the frame's n), got shape "
                         f"{tuple(out.shape)}")
    # Indices are distinct, so index_add_ is deterministic on every device.
    out.index_add_(0, idx.to(out.device), val.to(out.device))
    return out, end


def _scattered(buf: torch.Tensor, dtype: torch.dtype, expected: int | None,
               head: tuple[int, int, str, int, int]) -> tuple[torch.Tensor, int] | None:
    # decode into a fresh vector on the Triton path, the header read (`head`): the zeros, then
    # one kernel writes every value at its index and flags the frame's rules (indices in range
    # and increasing, values finite, a mean finite and not -0), and one read of the flag at
    # the end, where the torch path reads the entries twice (its checks, then index_add_) in a
    # dozen launches. None for what the torch path decodes: a qsgd block, a frame with no
    # entries, a mean cut short (the torch path's error).
    n, k, fmt, _, end = head
    if fmt == "qsgd" or k == 0 or buf.numel() < end:
        return None
    out = torch.zeros(n, dtype=dtype, device=buf.device)
    flag = torch.zeros(1, dtype=torch.int32, device=buf.device)
    _frame.kernels().sparse_scatter(buf[:end], n, k, HEADER.size, fmt, out, flag)
    # the torch path's checks name the broken rule
    _frame.raise_if(flag, lambda: _entries(buf, dtype, expected, bounded=True))
    return out, end
