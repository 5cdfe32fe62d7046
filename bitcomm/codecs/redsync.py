"""RedSync's sign-uniform mean: k same-signed elements sent as indices plus one fp32 mean.

RedSync, Section 5.2.3: "By setting the values of all elements of the same sign
in the communication-set to their mean, we can halve the communication bandwidth requirement by
transmitting only one floating-point number instead of k." The communication set is the k
largest positive elements (``side="top"``) or the k most negative (``side="bottom"``); RedSync
alternates the side every iteration (Algorithm 4), which is the caller's business. Selection uses
:mod:`bitcomm.codecs.select` (``"topk"``, ``"trimmed"`` Algorithm 2, ``"threshold"``
Algorithm 3) on the scores ``x.clamp(min=0)`` or ``(-x).clamp(min=0)``; elements of the wrong sign
and zeros are never sent, so a frame may hold fewer than k entries (none if no element has the
requested sign). ``"threshold"`` may send up to about 2k.

Wire format
-----------
A :mod:`bitcomm.codecs.sparse` frame with value format ``mean``::

    offset  size    field
    0       8       n        int64 LE: dense length
    8       8       k        int64 LE: entries actually sent
    16      1       values   uint8 = 3 (mean)
    17      k * iw  indices  strictly increasing int32 LE (int64 when n >= 2**31)
    17+k*iw 4       mean     float32 LE: mean of the sent values (accumulated in float64)

Worked example: ``encode(torch.tensor([0.5, -3.0, 2.0, 1.0, -1.0]), k=2, side="top")`` selects
indices 2 and 3 (values 2 and 1), mean 1.5:
``05 00 00 00 00 00 00 00 | 02 00 00 00 00 00 00 00 | 03 | 02 00 00 00 03 00 00 00 | 00 00 c0 3f``
(29 bytes), which decodes to ``[0, 0, 1.5, 1.5, 0]``. With ``side="bottom"`` it selects indices 1
and 4 with mean -2.

NaN or inf anywhere in ``x`` raises ``ValueError``: a non-finite residual would poison the mean.
"""

from __future__ import annotations

import torch

from bitcomm.codecs import _frame, select, sparse
from bitcomm.codecs.sparse import decode, decode_entries

__all__ = ["encode", "decode", "decode_entries", "encoded_size", "SIDES"]

SIDES = ("top", "bottom")
"""Which tail of the values to send: the largest positive or the most negative."""


def encoded_size(n: int, k: int) -> int:
    """Return the frame size in bytes for ``k`` sent entries of an ``n``-vector."""
    return sparse.encoded_size(n, k, "mean")


def encode(x: torch.Tensor, k: int, side: str = "top", method: str = "topk",
           **options: float) -> torch.Tensor:
    """Select up to k same-signed elements of ``x`` and encode them with their mean.

    Args:
        x: floating-point tensor (flattened).
        k: number of elements to select (``"threshold"`` selects k to about 2k).
        side: ``"top"`` (largest positive) or ``"bottom"`` (most negative).
        method: ``"topk"``, ``"trimmed"`` or ``"threshold"`` (see :mod:`bitcomm.codecs.select`).
        **options: selector options (``eps``).

    Returns:
        A sparse frame (value format ``mean``) on ``x``'s device.

    """
    v = _frame.check_float(x)
    k = _frame.check_count(k, "k")
    if side not in SIDES:
        raise ValueError(f"expected side in {SIDES}, got {side!r}")
    if method not in select.METHODS:
        raise ValueError(f"expected method in {select.METHODS}, got {method!r}")
    # NaN or inf raise from the selector's check, which on the Triton path rides on its
    # first read of v; the scores of the side are never written there.
    # Zeros and the other sign are not sent.
    # The indices come ascending, distinct and in range from the selector, finite from its
    # check; the frame's launches go ahead of the exact top-k's check (select_side's then).
    sign = 1 if side == "top" else -1
    if method == "topk" and not options and _fuses(v, k):
        return _selected_frame(v, k, sign)
    return select.select_side(v, k, sign, method, positive=True,
                              then=lambda idx: sparse.encode_at(v, idx, "mean", check=False),
                              **options)


def _fuses(v: torch.Tensor, k: int) -> bool:
    # Whether the exact top-k's writing pass writes the frame (_selected_frame).
    return (0 < k < v.numel() < 2**31 and v.dtype in (torch.float32, torch.float64)
            and v.is_contiguous() and _frame.use_triton(v))


def _selected_frame(v: torch.Tensor, k: int, sign: int) -> torch.Tensor:
    # The frame of the side's k largest scores as the top-k's writing pass writes it
    # (_kernels.top_frame; its mean added by one more launch): no indices written, and no
    # frame kernel to read them back. Its census, the one host read, checks v and says how
    # many of the k have the side's sign; where fewer do, they are the side's largest
    # `positive` scores, all of them, whose frame follows without a read. The mean's float64
    # sum is grouped by the pass's programs, not by sparse_frame's tiles: the same sum, as
    # on the CPU, while it is exact (the k values within 29 - log2(k) binades of each other).
    n = v.numel()
    frame = _frame.empty_aligned_at(encoded_size(n, k), sparse.HEADER.size, v.device)
    census = _frame.kernels().top_frame(v, k, _header(n, k), "mean", frame, side=sign,
                                        census=True)
    bad, positive = census.tolist()
    if bad:
        raise ValueError("expected finite values, got NaN or inf")
    if positive == k:
        return frame
    if positive == 0:  # a frame of no entries, which says a mean of zero
        return sparse.encode_at(v, torch.empty(0, dtype=torch.int64, device=v.device), "mean",
                                check=False)
    frame = _frame.empty_aligned_at(encoded_size(n, positive), sparse.HEADER.size, v.device)
    _frame.kernels().top_frame(v, positive, _header(n, positive), "mean", frame, side=sign)
    return frame


def _header(n: int, k: int) -> bytes:
    return sparse.HEADER.pack(n, k, sparse.FORMATS.index("mean"))
