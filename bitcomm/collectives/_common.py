"""Shared pieces of the collectives: chunk bounds and the up-front agreement on the input.

The agreement is one allgather of a 16-byte record per rank (int64 element count, int64 status:
0 fine, 1 not a floating-point tensor, 2 holds NaN or inf, 3 holds a float64 value beyond
float32's range where the collective computes in float32), so that bad input on any rank raises
the same exception on every rank instead of leaving the others blocked. It costs
``CONTROL_BYTES * (size - 1)`` sent bytes per rank; ``check=False`` skips it.
"""

from __future__ import annotations

import struct

import torch

from bitcomm.comm.base import Comm

__all__: list[str] = []

CONTROL_BYTES = 16
_RECORD = struct.Struct("<qq")
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_OK, _NOT_FLOAT, _NON_FINITE, _TOO_BIG = 0, 1, 2, 3


def bounds(n: int, size: int) -> list[tuple[int, int]]:
    """Return the ``size`` chunks ``[n*c//size, n*(c+1)//size)`` of ``n`` elements."""
    return [(n * c // size, n * (c + 1) // size) for c in range(size)]


def control_bytes(size: int, check: bool) -> int:
    """Return the bytes one rank sends for the agreement (0 without ``check``)."""
    return CONTROL_BYTES * (size - 1) if check else 0


def prepare(comm: Comm, x: object, check: bool, name: str, *, float32: bool = False
            ) -> torch.Tensor:
    """Return ``x`` flattened after every rank agreed that all inputs are valid.

    Raises on every rank: ``TypeError`` if any rank's input is not a floating-point tensor,
    ``ValueError`` if the lengths differ or (with ``check``) any rank holds NaN or inf, or, for a
    collective that computes in float32 (``float32=True``), a float64 value that float32 cannot
    hold (it would become inf after the cast). Without ``check`` only the local type check runs
    (a bad rank raises alone).
    """
    is_float = isinstance(x, torch.Tensor) and x.dtype in _FLOATS
    if not check:
        if not is_float:
            raise TypeError(f"{name}: expected a floating-point torch.Tensor, got "
                            f"{_describe(x)} on rank {comm.rank}")
        return x.detach().reshape(-1)
    status = _OK if is_float else _NOT_FLOAT
    n = x.numel() if isinstance(x, torch.Tensor) else -1
    if status == _OK and n:
        # One pass over x: float64 input to a float32 collective is checked as float32, which
        # also catches NaN and inf; only a failing check looks again to say which it was.
        wide = float32 and x.dtype == torch.float64
        if not bool(torch.isfinite(x.to(torch.float32) if wide else x).all()):
            status = _TOO_BIG if wide and bool(torch.isfinite(x).all()) else _NON_FINITE
    mine = torch.frombuffer(bytearray(_RECORD.pack(n, status)), dtype=torch.uint8)
    records = comm.allgatherv(mine, [CONTROL_BYTES] * comm.size) if comm.size > 1 else [mine]
    table = [_RECORD.unpack(bytes(r.cpu().tolist())) for r in records]
    bad = [r for r, (_, s) in enumerate(table) if s == _NOT_FLOAT]
    if bad:
        what = _describe(x) if comm.rank in bad else "see that rank"
        raise TypeError(f"{name}: expected a floating-point torch.Tensor on every rank, got "
                        f"something else on rank(s) {bad} (here: {what})")
    sizes = [c for c, _ in table]
    if len(set(sizes)) > 1:
        raise ValueError(f"{name}: expected the same number of elements on every rank, got "
                         f"{sizes} (by rank)")
    bad = [r for r, (_, s) in enumerate(table) if s == _NON_FINITE]
    if bad:
        raise ValueError(f"{name}: expected finite values, got NaN or inf on rank(s) {bad}")
    bad = [r for r, (_, s) in enumerate(table) if s == _TOO_BIG]
    if bad:
        raise ValueError(f"{name}: expected values that float32 (its arithmetic) can hold, got a "
                         f"float64 beyond float32's range on rank(s) {bad}")
    return x.detach().reshape(-1)


def _describe(x: object) -> str:
    if isinstance(x, torch.Tensor):
        return f"a tensor of dtype {x.dtype}"
    return type(x).__name__
