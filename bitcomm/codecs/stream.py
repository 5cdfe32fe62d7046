"""SparCML's sparse streams: a vector as sorted (index, value) pairs, or dense once that is smaller.

A :class:`Stream` holds a float32 vector of length ``n`` either as ``nnz`` pairs with strictly
increasing indices or as all ``n`` values (SparCML, Section 5.1). Pairs take ``nnz * (iw + 4)``
bytes against the dense block's ``4 * n``, so a stream is sparse only while

    nnz * (iw + 4) < 4 * n        (iw = 4: nnz < n / 2)

and :func:`sparse_limit` gives the first ``nnz`` that is dense. Sums follow the paper: adding two
sparse streams merges them when ``|H1| + |H2|`` (an upper bound on the union, which is not
computed first) stays below the limit, and is dense otherwise; adding to a dense stream is
dense. Streams over disjoint consecutive ranges concatenate (:func:`concat`). A sum never drops
an entry, not even one that cancels to zero: the result is the exact sum.

Every two-operand sum adds each index's two values once (``a + b``, which IEEE makes equal to
``b + a``), so both ranks of an exchange compute the same bits whichever stream was theirs.

Wire format
-----------
::

    offset  size      field
    0       8         n        int64 LE: the vector's length
    8       8         nnz      int64 LE: the pairs held; n for a dense stream
    16      1         dense    uint8: 0 = sparse, 1 = dense
    17      nnz * iw  indices  sparse only: strictly increasing, int32 LE when n < 2**31
                               (iw = 4), else int64 LE (iw = 8)
    ...     nnz * 4   values   float32 LE: the pairs' values, or the n dense values

A sparse frame always has ``nnz < sparse_limit(n)``; the decoder refuses one that does not.

Worked example: ``from_entries(torch.tensor([2, 5]), torch.tensor([-2.0, 1.0]), 8)`` is sparse
(2 pairs of 8 bytes < 32 dense bytes) and encodes to
``08 00 00 00 00 00 00 00 | 02 00 00 00 00 00 00 00 | 00 | 02 00 00 00 05 00 00 00 |
00 00 00 c0 00 00 80 3f`` (33 bytes). ``from_entries(torch.tensor([2, 3]),
torch.tensor([-2.0, 1.0]), 4)`` is dense (16 pair bytes >= 16 dense bytes), ``[0, 0, -2, 1]``:
``04 00 00 00 00 00 00 00 | 04 00 00 00 00 00 00 00 | 01 | 00 00 00 00 00 00 00 00
00 00 00 c0 00 00 80 3f`` (33 bytes). A stream of length 0 is dense.
"""

from __future__ import annotations

import dataclasses
import struct

import numpy as np
import torch

from bitcomm.codecs import _frame

__all__ = ["Stream", "HEADER", "sparse_limit", "index_width", "encoded_size", "layout",
           "from_entries", "from_dense", "empty", "add", "add_all", "concat", "part", "split",
           "encode", "decode", "decode_all"]

HEADER = struct.Struct("<qqB")
"""Frame header: n (int64), nnz (int64), dense flag (uint8); 17 bytes."""

_CODEC = "stream"


def index_width(n: int) -> int:
    """Return the bytes of one index in a stream of length ``n``: 4 below 2**31, else 8."""
    return 4 if n < 1 << 31 else 8


def sparse_limit(n: int) -> int:
    """Return the fewest pairs that make a stream of length ``n`` dense (SparCML's delta)."""
    width = index_width(n) + 4
    return -(-4 * n // width)  # ceil(4n / (iw + 4)): the first nnz with nnz * (iw + 4) >= 4n


def _is_sparse(n: int, nnz: int) -> bool:
    return nnz < sparse_limit(n)


@dataclasses.dataclass(frozen=True)
class Stream:
    """A float32 vector of length ``n``: sorted pairs, or dense (``indices is None``).

    Attributes:
        n: the vector's length.
        indices: int64 strictly increasing positions in ``[0, n)``, or ``None`` when dense.
        values: float32 values, one per index, or all ``n`` of a dense stream.

    """

    n: int
    indices: torch.Tensor | None
    values: torch.Tensor

    @property
    def dense(self) -> bool:
        """Whether the stream holds all ``n`` values."""
        return self.indices is None

    @property
    def nnz(self) -> int:
        """The pairs held (``n`` when dense)."""
        return self.n if self.indices is None else self.indices.numel()

    def to_dense(self) -> torch.Tensor:
        """Return the vector as a dense float32 tensor of length ``n`` (a new tensor)."""
        if self.indices is None:
            return self.values.clone()
        out = torch.zeros(self.n, dtype=torch.float32, device=self.values.device)
        out[self.indices] = self.values
        return out

    def to(self, device: torch.device | str) -> Stream:
        """Return the stream on ``device`` (itself if it is there already)."""
        if self.values.device == torch.device(device):
            return self
        return Stream(self.n, None if self.indices is None else self.indices.to(device),
                      self.values.to(device))

    def encoded_size(self) -> int:
        """Return the bytes of this stream's frame."""
        return encoded_size(self.n, self.nnz, self.dense)


def encoded_size(n: int, nnz: int, dense: bool) -> int:
    """Return the bytes of the frame of a stream of length ``n`` with ``nnz`` pairs or dense."""
    if dense:
        return HEADER.size + 4 * n
    return HEADER.size + nnz * (index_width(n) + 4)


def layout(n: int, size: int) -> tuple[int, bool] | None:
    """Return ``(nnz, dense)`` of a frame of ``size`` bytes for a stream of length ``n``.

    A frame's size fixes its layout: a dense frame is ``HEADER.size + 4 * n`` bytes and a sparse
    one, holding fewer pairs than :func:`sparse_limit`, is always smaller. ``None`` when no
    frame of length ``n`` has that size.
    """
    if size == HEADER.size + 4 * n:
        return n, True
    width = index_width(n) + 4
    nnz, rest = divmod(size - HEADER.size, width)
    if size < HEADER.size or rest or nnz >= sparse_limit(n):
        return None
    return nnz, False


def empty(n: int, device: torch.device | str = "cpu") -> Stream:
    """Return the all-zero stream of length ``n`` (sparse, no pairs; dense if ``n`` is 0)."""
    if not n:
        return Stream(0, None, torch.empty(0, dtype=torch.float32, device=device))
    return Stream(n, torch.empty(0, dtype=torch.int64, device=device),
                  torch.empty(0, dtype=torch.float32, device=device))


def from_dense(x: torch.Tensor) -> Stream:
    """Return a dense stream holding ``x`` (flattened, as float32)."""
    v = _frame.check_float(x, "x")
    return Stream(v.numel(), None, v.to(torch.float32, copy=True))


def from_entries(indices: torch.Tensor, values: torch.Tensor, n: int, *,
                 check: bool = True) -> Stream:
    """Return the stream of pairs ``(indices[i], values[i])`` of a vector of length ``n``.

    ``indices`` must be strictly increasing and in ``[0, n)``, ``values`` finite floats, one per
    index (``ValueError`` otherwise; ``TypeError`` for tensors of the wrong kind). The stream is
    dense when the pairs reach :func:`sparse_limit`. ``check=False`` skips the entries' rules
    (one host read, which waits for a GPU) for entries that :func:`check_entries` has passed.
    """
    idx = _frame.check_int(indices, "indices")
    val = _frame.check_float(values, "values")
    n = _frame.check_count(n, "n")
    if check:
        check_entries(idx, val, n)
    idx = idx.to(device=val.device, dtype=torch.int64)
    val = val.to(torch.float32)
    if _is_sparse(n, idx.numel()):
        return Stream(n, idx.clone(), val.clone())
    out = torch.zeros(n, dtype=torch.float32, device=val.device)
    out[idx] = val
    return Stream(n, None, out)


def check_entries(idx: torch.Tensor, val: torch.Tensor, n: int, *, finite: bool = True) -> None:
    """Raise ``ValueError`` unless ``idx`` and ``val`` are valid entries of a length-``n`` stream.

    Indices strictly increasing in ``[0, n)``, as many values, finite ones (float64 within
    float32's range) unless ``finite`` is False (for callers that check that themselves).
    """
    if idx.numel() != val.numel():
        raise ValueError(f"expected as many values as indices ({idx.numel()}), got "
                         f"{val.numel()}")
    if not idx.numel():
        return
    # Every rule in one host read; the message, which needs more, only when one is broken.
    lo, hi, unordered, bad = torch.stack([
        idx[0].to(torch.int64), idx[-1].to(torch.int64),
        (idx[1:] <= idx[:-1]).any().to(torch.int64),
        (_frame.nonfinite_any(val, as_float32=True) if finite
         else torch.zeros((), dtype=torch.bool))
        .to(torch.int64).to(idx.device)]).tolist()
    if lo < 0 or hi >= n:
        raise ValueError(f"expected indices in [0, {n}), got {lo if lo < 0 else hi}")
    if unordered:
        at = int((idx[1:] <= idx[:-1]).nonzero()[0, 0].item())
        what = "a duplicate" if idx[at + 1] == idx[at] else "a decrease"
        raise ValueError(f"expected strictly increasing indices, got {what} at position "
                         f"{at + 1} ({int(idx[at].item())} then {int(idx[at + 1].item())})")
    if bad:
        raise ValueError("expected finite values, got NaN, inf or a float64 beyond float32's "
                         "range")


def add(a: Stream, b: Stream, *, checks: list | None = None) -> Stream:
    """Return the sum of two streams of the same length (SparCML's summation rules).

    ``checks``: the unread checks of operands that :func:`decode_all` decoded with ``checks``.
    Off the numpy path a sparse merge reads them with its size (sorting and adding within the
    merge touch no memory by an index); a sum that addresses the dense vector by the indices
    reads them first.
    """
    if a.n != b.n:
        raise ValueError(f"expected streams of the same length, got {a.n} and {b.n}")
    if a.indices is not None and b.indices is not None and _is_sparse(a.n, a.nnz + b.nnz) \
            and not _frame.use_numpy(a.values):
        return _merge_sparse([a, b], checks or [])
    _frame.read_checked(checks or [])
    if a.indices is None or b.indices is None:
        dense, other = (a, b) if a.indices is None else (b, a)
        out = dense.values.clone()
        if other.indices is None:
            out += other.values
        else:
            out.index_add_(0, other.indices, other.values)
        return Stream(a.n, None, out)
    if not _is_sparse(a.n, a.nnz + b.nnz):
        out = torch.zeros(a.n, dtype=torch.float32, device=a.values.device)
        out.index_add_(0, a.indices, a.values)
        out.index_add_(0, b.indices, b.values)
        return Stream(a.n, None, out)
    return _union_numpy(a, b)  # off the numpy path _merge_sparse took it


def _union_numpy(a: Stream, b: Stream) -> Stream:
    # Each slot of the union is 0, plus a's value, plus b's (so -0.0 alone sums to +0.0, as
    # _merge_sparse's rounds make it). The union comes from a stable sort of the two ascending
    # runs, which timsort merges in one pass: 3-4x faster than torch.unique on a CPU.
    both = np.concatenate([a.indices.numpy(), b.indices.numpy()])
    order = np.argsort(both, kind="stable")
    ordered = both[order]
    first = np.ones(ordered.size, dtype=bool)
    np.not_equal(ordered[1:], ordered[:-1], out=first[1:])
    slot = np.empty(ordered.size, dtype=np.int64)
    slot[order] = np.cumsum(first) - 1
    idx = ordered[first]
    val = np.zeros(idx.size, dtype=np.float32)
    val[slot[: a.nnz]] += a.values.numpy()
    val[slot[a.nnz :]] += b.values.numpy()
    return Stream(a.n, torch.from_numpy(idx), torch.from_numpy(val))


def add_all(streams: list[Stream], *, checks: list | None = None) -> Stream:
    """Return the sum of ``streams``, added left to right (so the order fixes the bits).

    The stream that :func:`add` makes pairwise from the left, dense where it would be. Off
    the numpy path (CUDA) each pairwise merge would read its size back to the host; there
    sparse streams are summed together from one sort of all their pairs, and one read brings
    every pairwise sum's size, from which add's rule says whether the sum turned dense.
    ``checks`` as :func:`add` takes them.
    """
    if not streams:
        raise ValueError("expected at least one stream")
    if len(streams) > 1 and not _frame.use_numpy(streams[0].values) \
            and all(s.indices is not None for s in streams):
        return _merge_sparse(streams, checks or [])
    _frame.read_checked(checks or [])
    total = streams[0]
    for s in streams[1:]:
        total = add(total, s)
    return total


def _merge_sparse(streams: list[Stream], checks: list) -> Stream:
    """:func:`add_all` of sparse streams with one host read, which ``checks`` share.

    One stable sort of every stream's pairs groups each index's values in stream order; then
    round ``j`` adds each index's ``j``-th value into its slot, so every index sums its values
    left to right as pairwise :func:`add` does (a round adds at most one value a slot besides
    zeros, which cannot change a sum that started from +0). An index is new to the sum in the
    first stream that holds it (the stable sort keeps streams in order), so the size of the
    pairwise sum up to stream ``j`` is how many first occurrences lie in streams ``0..j``,
    from which add's rule says whether the sum turned dense. Those are counted by a running
    sum over the streams' own order (the first-occurrence marks put back there), read at each
    stream's end: adding each mark into its stream's counter instead would send every pair's
    atomic addition on a GPU to the same few addresses, one after another.
    """
    n = streams[0].n
    for s in streams[1:]:
        if s.n != n:
            raise ValueError(f"expected streams of the same length, got {n} and {s.n}")
    device = streams[0].values.device
    nnz = [s.nnz for s in streams]
    total = sum(nnz)
    key, order = torch.sort(torch.cat([s.indices for s in streams]), stable=True)
    val = torch.cat([s.values for s in streams])[order]
    first = torch.ones(total, dtype=torch.bool, device=device)
    first[1:] = key[1:] != key[:-1]
    slot = torch.cumsum(first, 0) - 1
    at = torch.arange(total, device=device)
    rank = at - torch.cummax(torch.where(first, at, 0), 0).values  # place among its values
    out = torch.zeros(total, dtype=torch.float32, device=device)
    for j in range(len(streams)):
        out.index_add_(0, slot, torch.where(rank == j, val, 0.0))
    # firsts[e]: the first occurrences among the pairs before position e, in stream order
    firsts = torch.zeros(total + 1, dtype=torch.int64, device=device)
    torch.cumsum(torch.empty_like(first).scatter_(0, order, first), 0, out=firsts[1:])
    ends = _frame.to_device(torch.tensor(nnz).cumsum(0)[1:], device)  # streams 1.. end there
    sizes = _frame.read_checked(checks, firsts[ends])  # the one host read
    idx = torch.full_like(key, n).scatter_(0, slot, key)
    held = nnz[0]
    for s, size in zip(streams[1:], sizes, strict=True):
        if not _is_sparse(n, held + s.nnz):  # add's rule: dense from this sum on
            dense = torch.zeros(n, dtype=torch.float32, device=device)
            dense[idx[:sizes[-1]]] = out[:sizes[-1]]
            return Stream(n, None, dense)
        held = size
    return Stream(n, idx[:held], out[:held])


def concat(parts: list[Stream]) -> Stream:
    """Return the stream of consecutive disjoint ranges ``parts`` laid end to end.

    Dense when any part is, or when the pairs together reach the limit of the whole length.
    """
    if not parts:
        raise ValueError("expected at least one stream")
    n = sum(p.n for p in parts)
    device = parts[0].values.device
    if any(p.dense for p in parts) or not _is_sparse(n, sum(p.nnz for p in parts)):
        return Stream(n, None, torch.cat([p.to_dense() for p in parts]) if n else
                      torch.empty(0, dtype=torch.float32, device=device))
    offsets, at = [], 0
    for p in parts:
        offsets.append(p.indices + at)
        at += p.n
    return Stream(n, torch.cat(offsets), torch.cat([p.values for p in parts]))


def part(s: Stream, lo: int, hi: int) -> Stream:
    """Return the entries of ``s`` in ``[lo, hi)`` as a stream of length ``hi - lo``.

    A sparse stream's part is sparse or dense by the limit of its own length; a dense one's
    part is dense.
    """
    return split(s, [(lo, hi)])[0]


def split(s: Stream, bounds: list[tuple[int, int]]) -> list[Stream]:
    """Return :func:`part` of ``s`` for each ``(lo, hi)`` of ``bounds``.

    The ranges' ends are found among the indices in one search and one host read (which waits
    for a GPU), not one per range.
    """
    for lo, hi in bounds:
        if not 0 <= lo <= hi <= s.n:
            raise ValueError(f"expected 0 <= lo <= hi <= {s.n}, got [{lo}, {hi})")
    if s.indices is None:
        return [Stream(hi - lo, None, s.values[lo:hi].clone()) for lo, hi in bounds]
    ends = [e for pair in bounds for e in pair]
    at = torch.searchsorted(s.indices, _frame.to_device(torch.tensor(ends, dtype=torch.int64),
                                                        s.indices.device)).tolist()
    out = []
    for j, (lo, hi) in enumerate(bounds):
        first, last = at[2 * j], at[2 * j + 1]
        idx, val = s.indices[first:last] - lo, s.values[first:last]
        if _is_sparse(hi - lo, idx.numel()):
            out.append(Stream(hi - lo, idx, val))
            continue
        dense = torch.zeros(hi - lo, dtype=torch.float32, device=val.device)
        dense[idx] = val
        out.append(Stream(hi - lo, None, dense))
    return out


def encode(s: Stream) -> torch.Tensor:
    """Return the frame of ``s`` (a uint8 tensor on its device, :func:`encoded_size` bytes)."""
    device = s.values.device
    head = _frame.host_bytes(HEADER.pack(s.n, s.nnz, int(s.dense)), device)
    if s.indices is None:
        return torch.cat([head, _frame.float_bytes(s.values)])
    itype = torch.int32 if index_width(s.n) == 4 else torch.int64
    return torch.cat([head, _frame.float_bytes(s.indices.to(itype)),
                      _frame.float_bytes(s.values)])


def decode(frame: torch.Tensor, *, n: int | None = None) -> tuple[Stream, int]:
    """Decode one stream frame; return ``(stream, bytes_consumed)``.

    ``n``, the length the caller expects, is checked against the header (``ValueError``);
    without it a dense frame's length is what its bytes hold and a sparse one's is bounded as
    :mod:`bitcomm.codecs` says. A corrupt frame (a sparse one at or above the limit, indices
    out of order or range, non-finite values, too few bytes) raises ``ValueError``.
    """
    buf = _frame.as_buffer(frame)
    length, nnz, dense = _frame.read_struct(buf, 0, HEADER, _CODEC, "header")
    if length < 0:
        raise ValueError(f"corrupt {_CODEC} frame: expected n >= 0, got {length}")
    if dense not in (0, 1):
        raise ValueError(f"corrupt {_CODEC} frame: expected a dense flag of 0 or 1, got {dense}")
    if n is not None or not dense:
        _frame.check_length(length, buf.numel(), n, _CODEC)
    off = HEADER.size
    if dense:
        if nnz != length:
            raise ValueError(f"corrupt {_CODEC} frame: expected a dense frame's nnz to be "
                             f"n={length}, got {nnz}")
        end = off + 4 * length  # checked against the buffer before anything is allocated
        _frame.need(buf, end, _CODEC, "values")
        val = _frame.from_bytes(buf[off:end], torch.float32).clone()
        if length and not _frame.all_finite(val):
            raise ValueError(f"corrupt {_CODEC} frame: expected finite values")
        return Stream(length, None, val), end
    if not 0 <= nnz < sparse_limit(length):
        raise ValueError(f"corrupt {_CODEC} frame: expected a sparse frame of n={length} to "
                         f"hold 0 <= nnz < {sparse_limit(length)} pairs, got {nnz}")
    width = index_width(length)
    end = off + nnz * width
    _frame.need(buf, end + 4 * nnz, _CODEC, "indices and values")
    idx = _frame.from_bytes(buf[off:end], torch.int32 if width == 4 else torch.int64
                            ).to(torch.int64)
    val = _frame.from_bytes(buf[end:end + 4 * nnz], torch.float32).clone()
    try:
        check_entries(idx, val, length)
    except ValueError as e:
        raise ValueError(f"corrupt {_CODEC} frame: {e}") from None
    return Stream(length, idx, val), end + 4 * nnz


def decode_all(frames: list[torch.Tensor], n: int, *, checks: list | None = None
               ) -> list[Stream]:
    """Return the streams of ``frames``, each of which must hold a whole stream of length ``n``.

    ``decode(f, n=n)[0]`` for each frame, with its errors, and a frame with bytes past its
    stream is a ``ValueError`` too. A frame's size fixes its layout (:func:`layout`), so off
    the numpy path (CUDA), where :func:`decode` reads each header and each frame's rules to the
    host, the headers are compared with the layouts and the rules checked on the device, and
    one host read covers every frame. With a list ``checks`` that read is left to the caller:
    the check is appended to it for :func:`add` or :func:`add_all`, and the streams' indices
    may break the rules until it is read.
    """
    n = _frame.check_count(n, "n")
    bufs = [_frame.as_buffer(f) for f in frames]
    shapes = [layout(n, b.numel()) for b in bufs]
    if bufs and not _frame.use_numpy(bufs[0]) and None not in shapes:
        itype = torch.int32 if index_width(n) == 4 else torch.int64
        flags, out = [], []
        for b, (nnz, dense) in zip(bufs, shapes, strict=True):
            head = _frame.from_bytes(b[:16], torch.int64)
            flags += [head[0] != n, head[1] != nnz, b[16] != int(dense)]
            off = HEADER.size if dense else HEADER.size + nnz * index_width(n)
            val = _frame.from_bytes(b[off:], torch.float32).clone()
            flags.append(_frame.nonfinite_any(val))
            if dense:
                out.append(Stream(n, None, val))
                continue
            idx = _frame.from_bytes(b[HEADER.size:off], itype).to(torch.int64)
            if nnz:
                flags.append(_frame.broken_order(idx, 0, n))
            out.append(Stream(n, idx, val))
        if checks is not None:
            checks.append((torch.stack(flags).any(), lambda: _decode_each(bufs, n)))
            return out
        if not bool(torch.stack(flags).any()):  # the one host read
            return out
    return _decode_each(bufs, n)


def _decode_each(bufs: list[torch.Tensor], n: int) -> list[Stream]:
    # The numpy path, or some frame is corrupt: one at a time, each raising its precise error.
    streams = []
    for b in bufs:
        s, used = decode(b, n=n)
        if used != b.numel():
            raise ValueError(f"corrupt {_CODEC} frame: expected {used} bytes for its stream, "
                             f"got {b.numel()}")
        streams.append(s)
    return streams
