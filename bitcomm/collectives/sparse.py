"""Quantised sparse allgather (RedSync, SparCML).

Each rank selects ``k`` elements of ``x`` (selectors of :mod:`bitcomm.codecs.select`), encodes
them as one :mod:`bitcomm.codecs.sparse` frame (fp32, fp16, qsgd 2/4/8-bit values, or RedSync's
sign-uniform mean, 5.2.3), and the frames, of different lengths, are exchanged by one
``allgatherv`` after an allgather of their int64 lengths. Every rank decodes and adds all frames
into a dense float32 tensor in rank order, so the sum is bit-identical everywhere.

Bytes sent by a rank whose frame has ``F`` bytes (:func:`sparse_allgather_bytes`)::

    (N - 1) * (8 + F)  + 16 * (N - 1) with check

with ``F = sparse.encoded_size(n, k, fmt, ...)`` (for ``fmt="mean"`` the k actually selected).
"""

from __future__ import annotations

import struct

import torch

from bitcomm.codecs import qsgd, redsync, select, sparse
from bitcomm.collectives import _common
from bitcomm.comm.base import Comm

__all__ = ["sparse_allgather", "sparse_allgather_bytes", "FORMATS"]

FORMATS = sparse.FORMATS
"""Value formats of the frames (:data:`bitcomm.codecs.sparse.FORMATS`)."""
_LEN = struct.Struct("<q")


def sparse_allgather(comm: Comm, x: torch.Tensor, k: int, *, fmt: str = "fp32",
                     method: str = "topk", side: str = "top", bits: int = 4,
                     bucket: int = qsgd.DEFAULT_BUCKET, seed: int | None = None,
                     check: bool = True) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Sum every rank's k selected elements into a dense tensor.

    Args:
        comm: the transport.
        x: float tensor, the same number of elements on every rank.
        k: elements each rank selects (by ``|x|``, or the signed side for ``fmt="mean"``).
        fmt: value format: ``"fp32"``, ``"fp16"``, ``"qsgd"`` or ``"mean"`` (sign-uniform mean).
        method: selector: ``"topk"``, ``"trimmed"`` or ``"threshold"``.
        side: ``"top"`` or ``"bottom"`` for ``fmt="mean"`` (RedSync alternates them).
        bits: qsgd bits (``fmt="qsgd"``).
        bucket: qsgd bucket (``fmt="qsgd"``).
        seed: qsgd seed; rank ``r`` uses ``seed + r`` so ranks draw independent streams.
        check: agree on the input first (raises on every rank for bad input).

    Returns:
        ``(dense, (indices, values))``: the float32 sum of all frames (shape of ``x``), and the
        entries this rank sent as the receivers decode them, for residual bookkeeping.

    """
    if fmt not in FORMATS:
        raise ValueError(f"expected fmt in {FORMATS}, got {fmt!r}")
    if method not in select.METHODS:
        raise ValueError(f"expected method in {select.METHODS}, got {method!r}")
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise ValueError(f"expected k to be an int >= 0, got {k!r}")
    v = _common.prepare(comm, x, check, "sparse_allgather", float32=True)
    n = v.numel()
    if k > n:
        raise ValueError(f"expected k <= {n} elements, got k={k}")
    if fmt == "mean":
        frame = redsync.encode(v, k, side, method)
    else:
        idx = select.select(v.abs(), k, method, check=False)
        rank_seed = None if seed is None else seed + comm.rank
        frame = sparse.encode(idx, v[idx], n, fmt, bits=bits, bucket=bucket, seed=rank_seed)
    if comm.size > 1:
        mine = torch.frombuffer(bytearray(_LEN.pack(frame.numel())), dtype=torch.uint8)
        lengths = [_LEN.unpack(bytes(t.cpu().tolist()))[0]
                   for t in comm.allgatherv(mine, [_LEN.size] * comm.size)]
        frames = comm.allgatherv(frame, lengths)
    else:
        frames = [frame]
    dense = torch.zeros(n, dtype=torch.float32, device=v.device)
    for f in frames:
        sparse.decode(f.to(v.device), out=dense)
    indices, values, _, _ = sparse.decode_entries(frame)
    return dense.reshape(x.shape), (indices, values)


def sparse_allgather_bytes(frame_bytes: int, size: int, *, check: bool = True) -> int:
    """Return the bytes a rank with a ``frame_bytes``-byte frame sends."""
    return (size - 1) * (_LEN.size + frame_bytes) + _common.control_bytes(size, check)
