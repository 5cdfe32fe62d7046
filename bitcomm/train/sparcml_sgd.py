"""SparCML's top-k SGD (Algorithm 2): bucketed top-k, error feedback, a sparse allreduce.

Per step, over all parameters with a gradient laid end to end (``G = grad + weight_decay * w``)::

    acc = residual + G
    idx = in every bucket of ``bucket`` consecutive elements, the ``k`` of largest |acc|
    residual = acc ;  residual[idx] = 0          (error feedback: what was not sent waits)
    total = sparse_allreduce(idx, acc[idx])       (the exact sum over workers, or DSAR with
                                                   ``bits``: the reduced ranges QSGD-quantised)
    buf = momentum * buf + total / N ;  w = w - lr * buf

The paper's CIFAR-10 setup is ``k = 8`` or ``16`` of every 512 with 4-bit values. The residual
holds gradient units (``lr`` is applied after the exchange, so a changed ``lr`` does not rescale
what waits). The sparse allreduce is :func:`bitcomm.collectives.sparcml.sparse_allreduce`:
``algorithm="auto"`` chooses from E[K] and the given ``alpha``/``beta`` each step (the choice of
the last step is :attr:`SparCMLSGD.last_choice`); with ``bits`` it is DSAR.

A parameter whose ``grad`` is None is skipped as ``torch.optim.SGD`` skips it (no step, its
residual kept); the ranks agree on which have gradients (``agree_on``), so ranks that differ
raise ``ValueError`` on every rank with ``check=True``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import numpy as np
import torch

from bitcomm.codecs import _frame, qsgd
from bitcomm.collectives import agree_on
from bitcomm.collectives.sparcml import ALGORITHMS, Choice, sparse_allreduce
from bitcomm.comm.base import Comm
from bitcomm.train._common import (
    ExtraState,
    ScalerAware,
    all_params,
    check_comm,
    check_range,
    evaluate,
    sgd_step,
    with_grads,
)

__all__ = ["SparCMLSGD", "bucket_topk"]


def bucket_topk(acc: torch.Tensor, k: int, bucket: int) -> torch.Tensor:
    """Return the sorted positions of the ``k`` largest ``|acc|`` of every ``bucket`` elements.

    The last, shorter bucket gives ``min(k, its length)``; ties go to the lower position, on
    every device (``torch.topk`` breaks them its own way, and differently on CPU and CUDA), and
    NaN ranks as inf. Their number is known, so no host read.
    """
    n = acc.numel()
    if n == 0 or k == 0:
        return torch.empty(0, dtype=torch.int64, device=acc.device)
    acc = acc.detach().reshape(-1)
    full = n // bucket * bucket
    spans = ([(0, full, bucket)] if full else []) + ([(full, n, n - full)] if full < n else [])
    count = sum((hi - lo) // width * min(k, width) for lo, hi, width in spans)
    if _frame.numpy_float(acc):
        # Each bucket's elements at or above its k-th largest: its top k, unless it has ties
        # there (then more than k in all) or NaN (torch.topk ranks it first, so its k-th is
        # NaN), which the general path sorts out.
        a = np.abs(acc.numpy())
        ge = [_at_or_above(a[lo:hi].reshape(-1, width), min(k, width))
              for lo, hi, width in spans]
        if all(g is not None for g in ge):
            found = np.flatnonzero(np.concatenate(ge))
            if found.size == count:
                return torch.from_numpy(found)
    mags = acc.abs().nan_to_num_(nan=math.inf)
    masks = [_row_top(mags[lo:hi].view(-1, width), min(k, width)).reshape(-1)
             for lo, hi, width in spans]
    return _frame.indices_of(torch.cat(masks) if len(masks) > 1 else masks[0], count)


def _kth(rows: torch.Tensor, k: int) -> torch.Tensor:
    """Return each row's k-th largest value, as a column."""
    return torch.topk(rows, k, dim=1, sorted=False).values.amin(1, keepdim=True)


def _at_or_above(rows: np.ndarray, k: int) -> np.ndarray | None:
    """Return the flat mask of each row's values at or above its k-th largest.

    ``None`` if a row's k largest hold NaN.
    """
    kth = _kth(torch.from_numpy(rows), k).numpy()
    if np.isnan(kth).any():
        return None
    return (rows >= kth).reshape(-1)


def _row_top(rows: torch.Tensor, k: int) -> torch.Tensor:
    """Return the mask of each row's ``k`` largest values, ties to the lower position."""
    kth = _kth(rows, k)
    above = rows > kth
    tie = rows == kth
    need = k - torch.count_nonzero(above, dim=1).unsqueeze(1)
    return above | (tie & (tie.cumsum(1, dtype=torch.int32) <= need))


class SparCMLSGD(ExtraState, ScalerAware, torch.optim.Optimizer):
    """SparCML's top-k SGD with error feedback over a sparse allreduce.

    Args:
        params: parameters or parameter groups (``lr``, ``momentum``, ``weight_decay``); every
            rank builds the optimizer over the same parameters in the same order.
        comm: the transport.
        lr: learning rate.
        momentum: momentum in [0, 1) applied to the averaged sparse update.
        weight_decay: added to the gradient as ``weight_decay * w``.
        k: entries sent per bucket.
        bucket: elements per top-k bucket (512 in the paper).
        algorithm: ``"auto"`` or a name in :data:`bitcomm.collectives.sparcml.ALGORITHMS`.
        bits: ``None``, or 2/4/8 for DSAR with QSGD-quantised reduced values (then the
            algorithm is DSAR's).
        alpha: latency per message for ``"auto"`` (seconds).
        beta: seconds per byte for ``"auto"``.
        seed: base seed of the quantisation (each step and owner gets its own stream).
        check: run the collectives' input agreement (every rank raises on a NaN gradient).

    """

    def __init__(self, params: Iterable, comm: Comm, lr: float = 0.1, momentum: float = 0.0,
                 weight_decay: float = 0.0, *, k: int = 8, bucket: int = 512,
                 algorithm: str = "auto", bits: int | None = None, alpha: float = 5e-6,
                 beta: float = 1 / 12.5e9, seed: int = 0, check: bool = True):
        self.comm = check_comm(comm)
        for name, value, low in (("k", k, 1), ("bucket", bucket, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"expected {name} to be an int >= {low}, got {value!r}")
        if algorithm != "auto" and algorithm not in ALGORITHMS:
            raise ValueError(f"expected algorithm 'auto' or one of {ALGORITHMS}, got "
                             f"{algorithm!r}")
        if bits is not None:
            qsgd.check_config(bits, 512, "max")
            algorithm = "dsar_split_allgather"
        defaults = {"lr": check_range("lr", lr, 0.0, lo_open=True),
                    "momentum": check_range("momentum", momentum, 0.0, 1.0),
                    "weight_decay": check_range("weight_decay", weight_decay, 0.0)}
        super().__init__(params, defaults)
        self.k, self.bucket, self.algorithm, self.bits = k, bucket, algorithm, bits
        self.alpha, self.beta, self.seed, self.check = alpha, beta, seed, check
        self.steps = 0
        self.last_choice: Choice | None = None
        self.sent = 0  # entries this rank selected in the last step

    def _extra_state(self) -> dict:
        return {"steps": self.steps}

    def _load_extra_state(self, state: dict) -> None:
        self.steps = int(state["steps"])

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One step: select, keep the rest as residual, sparse-allreduce, apply."""
        loss = evaluate(closure)
        if self._scaler_skips():
            return loss
        params = all_params(self.param_groups)
        _, mask = with_grads(params)
        live = [(p, g) for g in self.param_groups for p in g["params"] if p.grad is not None]
        parts = []
        for p, group in live:
            grad = p.grad.detach().to(torch.float32).reshape(-1)
            if group["weight_decay"]:
                grad = grad + group["weight_decay"] * p.detach().to(torch.float32).reshape(-1)
            state = self.state[p]
            if "residual" not in state:
                state["residual"] = torch.zeros_like(grad)
            parts.append(state["residual"] + grad)
        device = params[0].device if params else torch.device("cpu")
        acc = torch.cat(parts) if parts else torch.zeros(0, device=device)
        idx = bucket_topk(acc, self.k, self.bucket)
        self.sent = idx.numel()
        with agree_on(("grads", mask)):
            total, self.last_choice = sparse_allreduce(
                self.comm, idx, acc[idx], acc.numel(), algorithm=self.algorithm,
                alpha=self.alpha, beta=self.beta, bits=self.bits,
                seed=self.seed + self.steps * self.comm.size, check=self.check)
        acc.index_fill_(0, idx, 0)  # not acc[idx] = 0: on a GPU that copies the 0 from the host
        total = total.to(device).div_(self.comm.size)
        at, moves = 0, []
        for p, group in live:
            n = p.numel()
            state = self.state[p]
            state["residual"].copy_(acc[at:at + n])
            moves.append((p, total[at:at + n], group))
            at += n
        sgd_step(moves, self.state)
        self.steps += 1
        return loss
