"""The dense float32 baseline: the transport's native allreduce (sum).

Bytes counted per rank (:func:`allreduce_bytes`): ``4 * n * (N - 1)`` (the operand once to every
other rank, what a direct exchange moves; MPI and gloo may use other schedules) plus
``24 * (N - 1)`` with ``check``.
"""

from __future__ import annotations

import torch

from bitcomm.collectives import _common
from bitcomm.comm.base import Comm

__all__ = ["allreduce", "allreduce_bytes"]


def allreduce(comm: Comm, x: torch.Tensor, *, check: bool = True) -> torch.Tensor:
    """Return the float32 sum of ``x`` over ranks (shape of ``x``)."""
    v = _common.prepare(comm, x, check, "allreduce", float32=True)
    if comm.size == 1:
        return v.to(torch.float32, copy=True).reshape(x.shape)
    return comm.allreduce(v.to(torch.float32)).reshape(x.shape)


def allreduce_bytes(n: int, size: int, *, check: bool = True) -> int:
    """Return the bytes each rank is counted as sending in :func:`allreduce` of n floats."""
    return 4 * n * (size - 1) + _common.control_bytes(size, check)
