"""Quantised sparse allgather (RedSync, SparCML).

Each rank selects ``k`` elements of ``x`` (selectors of :mod:`bitcomm.codecs.select`), encodes
them as one :mod:`bitcomm.codecs.sparse` frame (fp32, fp16, qsgd 2/4/8-bit values, or RedSync's
sign-uniform mean, 5.2.3), and the frames, of different lengths, are exchanged by one
``allgatherv``. The ranks learn each other's frame lengths from the input agreement (they ride
in its records). Without ``check`` a frame whose length follows from the call (an exact
selection, ``"topk"`` or ``"trimmed"``, of k values in any format but ``"mean"``) needs no
lengths at all; any other frame's length goes first, in an allgather of int64 lengths. Every
rank decodes and adds all frames into a dense float32 tensor in rank order, so the sum is
bit-identical everywhere.

Bytes sent by a rank whose frame has ``F`` bytes (:func:`sparse_allgather_bytes`)::

    (N - 1) * F  + 24 * (N - 1) with check; without it, + 0 for a fixed-length frame and
    + 8 * (N - 1) for one whose length depends on the data

with ``F = sparse.encoded_size(n, k, fmt)`` (for ``fmt="mean"`` the k actually selected).
"""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Mapping

import torch

from bitcomm.codecs import _frame, redsync, select, sparse
from bitcomm.collectives import _common
from bitcomm.comm.base import Comm

__all__ = ["sparse_allgather", "sparse_allgather_bytes", "FORMATS"]

FORMATS = sparse.FORMATS
"""Value formats of the frames (:data:`bitcomm.codecs.sparse.FORMATS`)."""
_LEN = struct.Struct("<q")


def sparse_allgather(comm: Comm, x: torch.Tensor, k: int, *, fmt: sparse.ValueFormat = "fp32",
                     method: str = "topk", side: str | None = None,
                     options: Mapping[str, float] | None = None, check: bool = True,
                     average: bool = False, out: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Sum every rank's k selected elements into a dense tensor.

    Args:
        comm: the transport.
        x: float tensor, the same number of elements on every rank.
        k: elements each rank selects (by ``|x|``, or the signed side for ``fmt="mean"``).
        fmt: value format: ``"fp32"``, ``"fp16"``, ``"mean"`` (sign-uniform mean), ``"qsgd"``,
            or a :class:`bitcomm.codecs.sparse.Qsgd` with its settings. With a qsgd seed ``s``,
            rank ``r`` rounds with seed ``s + r``, so the ranks' rounding errors are
            independent.
        method: selector, one of :data:`bitcomm.codecs.select.METHODS`: ``"topk"``,
            ``"trimmed"``, ``"threshold"``, or SIDCo's ``"sidco-e"``, ``"sidco-p"``,
            ``"sidco-gp"`` (these select about k; the frames carry however many they chose).
        options: the selector's options (``eps``; SIDCo's ``stages`` and ``first``). They may
            differ between ranks (SIDCo adapts its stages to each rank's own counts), so the
            agreement leaves them out.
        side: ``"top"`` (default) or ``"bottom"``: the signed tail a ``fmt="mean"`` frame
            sends (RedSync alternates them); other formats select by ``|x|`` and take none.
        check: agree on the input first (raises on every rank for bad input).
        average: return the sum divided by the number of ranks, the bits of ``dense / N``
            (torch's division by a Python number), dividing only the entries some rank sent:
            about ``N * k`` elements read and written where dividing the dense sum moves all
            ``n`` twice.
        out: where to write the dense sum (a contiguous float32 tensor of ``x``'s shape and
            device; ``x`` itself may be given), returned in its place.

    Returns:
        ``(dense, (indices, values))``: the float32 sum of all frames (shape of ``x``), and the
        entries this rank sent as the receivers decode them, for residual bookkeeping.

    """
    def validate(v: torch.Tensor) -> None:
        form = sparse.value_format(fmt)
        if method not in select.METHODS:
            raise ValueError(f"expected method in {select.METHODS}, got {method!r}")
        if isinstance(k, bool) or not isinstance(k, int):
            raise TypeError(f"expected k to be an int, got {type(k).__name__}")
        if not 0 <= k <= v.numel():
            raise ValueError(f"expected 0 <= k <= {v.numel()} elements, got k={k}")
        if side is not None and form != "mean":
            raise ValueError(f"side applies to fmt='mean' only, got side={side!r} with "
                             f"fmt={fmt!r}")
        if side is not None and side not in redsync.SIDES:
            raise ValueError(f"expected side in {redsync.SIDES}, got {side!r}")
        if not isinstance(average, bool):
            raise TypeError(f"expected average to be a bool, got {type(average).__name__}")
        _common.check_out(out, x, torch.float32)
        if form == "fp16" and k and v.numel():
            # the k selected include the largest |x|: it must fit fp16 (a NaN is reported later)
            top = float(v.abs().max())
            if top > sparse.FP16_MAX:
                raise OverflowError(f"expected |x| <= {sparse.FP16_MAX} for fmt='fp16', got "
                                    f"{top}")

    made: list[torch.Tensor] = []

    def encode(v: torch.Tensor) -> int:
        # Runs on input that passed the local checks, before the agreement: the frame's length
        # then rides in the agreement's record.
        form = sparse.value_format(fmt)
        if form == "mean":
            frame = redsync.encode(v, k, side or "top", method, **(options or {}))
        elif method == "topk" and form in ("fp32", "fp16") and not options:
            # With check, the agreement found v finite (and in fp16's range): no second check
            frame = sparse.encode_top(v, k, form, check=not check)
        else:
            idx = select.select_abs(v, k, method, check=False, **(options or {}))
            if isinstance(form, sparse.Qsgd) and form.seed is not None:
                form = dataclasses.replace(form, seed=form.seed + comm.rank)
            # With check, the agreement found v finite (and in fp16's range, validate): the
            # selector's ascending entries need no second check, which would read the host.
            frame = sparse.encode_at(v, idx, form, check=not check)
        made.append(frame)
        return frame.numel()

    # The checks of the entries this rank encodes (without the agreement) and of every frame it
    # decodes are read once, at the end (on a device, one wait per call; inside a DDP hook's
    # step, at its agreement): until then decoded indices stay in range, and a broken frame
    # still goes out, so every rank raises instead of waiting for it.
    with _frame.deferred(handover=True):
        v, lengths = _common.prepare_sized(comm, x, check, "sparse_allgather", encode,
                                           float32=True,
                                           options={**_call_options(k, fmt, method, side),
                                                    "average": average},
                                           validate=validate)
        n, frame = v.numel(), made[0]
        fixed = _fixed_length(n, k, fmt, method)
        if comm.size > 1:
            if lengths is None and fixed is not None:
                if frame.numel() != fixed:  # the selector broke its promise of exactly k
                    raise RuntimeError(f"sparse_allgather: expected a {fixed}-byte frame from "
                                       f"{method!r}, built {frame.numel()} bytes")
                lengths = [fixed] * comm.size
            elif lengths is None:
                lengths = [c for (c,) in comm.allgather_ints([frame.numel()])]
            # Bounded before anything is allocated: no frame of n entries is longer, nor any
            # shorter than its header (the same lengths, and the same error, on every rank).
            most = sparse.encoded_size(n, n, fmt)
            bad = [r for r, b in enumerate(lengths) if not sparse.HEADER.size <= b <= most]
            if bad:
                raise ValueError(f"sparse_allgather: rank(s) {bad} announced frames of "
                                 f"{[lengths[r] for r in bad]} bytes, beyond "
                                 f"{sparse.HEADER.size}..{most} for n={n}")
            frames = comm.allgatherv(frame, lengths)
        else:
            frames = [frame]
        # x was read when this rank's frame was made: out may be x.
        dense = _common.result_buffer(out, n, torch.float32, v, zeroed=True)
        # Frames of one known format, each as long as its entries (the lengths are known to
        # every rank): checked together. This rank's entries come back as the receivers decode
        # them, for the sum and the caller's residual bookkeeping.
        entries = sparse.decode_all([f.to(v.device) for f in frames], n,
                                    k if fixed is not None else None, fmt)
        for idx, val in entries:  # in rank order, so the sum is the same on every rank
            dense.index_add_(0, idx, val)  # what sparse.decode(out=dense) adds
        if average and comm.size > 1:
            # Every index some frame holds, repeated where frames share it: each copy writes
            # the same quotient, so the order of the writes does not matter.
            touched = torch.cat([idx for idx, _ in entries])
            dense.index_put_((touched,), dense[touched].div_(comm.size))
    return dense.reshape(x.shape) if out is None else out, entries[comm.rank]


def _fixed_length(n: int, k: int, fmt: sparse.ValueFormat, method: str) -> int | None:
    # The frame length every rank can compute without being told, or None where it depends on
    # the data (a selector that picks about k, or a sign-uniform frame of one side's entries).
    form = sparse.value_format(fmt)
    if method in ("topk", "trimmed") and form != "mean":
        return sparse.encoded_size(n, k, form)
    return None


def _call_options(k: object, fmt: object, method: object, side: object) -> dict[str, object]:
    # What must be equal on every rank: the seed is not (ranks offset it), and a format or side
    # may be spelled two ways ("qsgd" is Qsgd(); no side is "top").
    try:
        form = sparse.value_format(fmt)
    except ValueError:
        form = fmt  # refused by the validation, on every rank
    if isinstance(form, sparse.Qsgd):
        form = dataclasses.replace(form, seed=None)
    if form == "mean" and side is None:
        side = "top"
    return {"k": k, "fmt": form, "method": method, "side": side}


def sparse_allgather_bytes(frame_bytes: int, size: int, *, check: bool = True,
                           fixed: bool = True) -> int:
    """Return the bytes a rank with a ``frame_bytes``-byte frame sends.

    ``fixed``: the frame's length follows from the call (``method`` ``"topk"`` or ``"trimmed"``
    and ``fmt`` other than ``"mean"``), so without ``check`` no lengths are exchanged.
    """
    lengths = 0 if check or fixed else _LEN.size
    return (size - 1) * (lengths + frame_bytes) + _common.control_bytes(size, check)
