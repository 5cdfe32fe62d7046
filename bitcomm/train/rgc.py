"""RGC: residual gradient compression SGD, RedSync's Algorithm 4 (Appendix A).

For every parameter larger than ``compress_threshold`` elements, each worker keeps a residual
``V`` and a momentum ``U`` (zero at first) and per step, with ``G = grad + weight_decay * w``::

    U = momentum * U + G ;  V = V + U            (momentum correction; V += G without momentum)
    idx, val = selection(V, density)             (Algorithm 5, below)
    V[idx] = 0 ;  U[idx] = 0                     (momentum factor masking)
    G_all = sum over workers of their (idx, val) (sparse_allgather: one frame per worker)
    w = w - lr * G_all / N

Parameters at or below ``compress_threshold`` go densely: their gradients (with weight decay)
are concatenated into one fp32 allreduce (RedSync's tensor fusion), averaged, and drive plain
SGD with momentum (``buf = momentum * buf + g``, as ``torch.optim.SGD``).

Selection by the parameter's size (Algorithm 5): below ``thresholds[0]`` elements exact top-k of
``|V|``, below ``thresholds[1]`` trimmed top-k (Alg. 2), above it threshold binary search
(Alg. 3, which sends k to 2k elements). ``k = ceil(density * size)``. With ``quantize=True`` each
worker sends only same-signed elements and their mean (RedSync 5.2.3), alternating the largest
positive (top) and the most negative (bottom) elements from one step to the next, per parameter.
``method`` names one selector for every size instead, for instance SIDCo's ``"sidco-e"``
(:mod:`bitcomm.codecs.sidco`); a SIDCo selector keeps a :class:`~bitcomm.codecs.sidco.
StageControl` per parameter, which adapts its number of stages to the counts this rank selects
(saved in ``state_dict``). :class:`SIDCoSGD` is SIDCo's own training loop (its Appendix A:
error compensation, a SIDCo selector and an allgather of the selected entries) on this class.

Differences from the paper, on purpose: the sum is divided by ``N`` so that ``lr`` means what it
means for dense SGD (DGC does the same); Algorithm 4's line 12 adds the raw gradient to ``U``
although line 9 added weight decay to ``G``, and here ``G`` (with weight decay) is used; the
threshold reuse of Algorithm 5 (search every 5th step only) is not implemented, each step
searches. Exchanges are blocking: the dense allreduce first, then one per compressed parameter,
in parameter order.

A parameter whose ``grad`` is None is skipped, as ``torch.optim.SGD`` skips it: it does not move
and its residual and momentum do not change. A compressed one is not exchanged at all; a dense
one keeps its place in the fused vector (as zeros), so every rank sends the same layout. Every
exchange runs inside ``agree_on`` of which parameters have gradients, so ranks that differ raise
``ValueError`` on every rank (with ``check=True``) at the dense allreduce, which every step runs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch

from bitcomm.codecs import select
from bitcomm.codecs.sidco import StageControl
from bitcomm.collectives import agree_on, allreduce, sparse_allgather
from bitcomm.comm.base import Comm
from bitcomm.train._common import (
    ScalerAware,
    all_params,
    check_comm,
    check_range,
    evaluate,
    sgd_step,
    with_grads,
)

__all__ = ["RGC", "SIDCoSGD"]


class RGC(ScalerAware, torch.optim.Optimizer):
    """Residual gradient compression SGD (RedSync's Algorithm 4).

    Args:
        params: parameters or parameter groups (``lr``, ``momentum``, ``weight_decay``).
        comm: the transport; every rank builds the optimizer over the same parameter layout.
        lr: learning rate.
        momentum: momentum in [0, 1) (momentum correction for compressed parameters).
        weight_decay: added to the gradient as ``weight_decay * w``.
        density: fraction of a compressed parameter's elements each worker sends, in (0, 1].
        compress_threshold: parameters with at most this many elements are reduced densely.
        thresholds: ``(thsd1, thsd2)`` element counts switching top-k -> trimmed top-k ->
            threshold binary search.
        quantize: send same-signed elements and their mean (RedSync 5.2.3), alternating sides.
        method: one selector (:data:`bitcomm.codecs.select.METHODS`) for every compressed
            parameter, in place of the size-based switch of ``thresholds``.
        check: run the collectives' input agreement (every rank raises on a NaN gradient).

    """

    def __init__(self, params: Iterable, comm: Comm, lr: float = 0.1, momentum: float = 0.9,
                 weight_decay: float = 0.0, *, density: float = 0.01,
                 compress_threshold: int = 1024, thresholds: tuple[int, int] = (1 << 15, 1 << 20),
                 quantize: bool = False, method: str | None = None, check: bool = True):
        self.comm = check_comm(comm)
        if method is not None and method not in select.METHODS:
            raise ValueError(f"expected method None or one of {select.METHODS}, got {method!r}")
        self.density = check_range("density", density, 0.0, 1.0 + 1e-12, lo_open=True)
        if isinstance(compress_threshold, bool) or not isinstance(compress_threshold, int) \
                or compress_threshold < 0:
            raise ValueError(f"expected compress_threshold to be an int >= 0 elements, got "
                             f"{compress_threshold!r}")
        if (not isinstance(thresholds, (tuple, list)) or len(thresholds) != 2
                or not all(isinstance(t, int) and t >= 0 for t in thresholds)
                or thresholds[0] > thresholds[1]):
            raise ValueError(f"expected thresholds (thsd1, thsd2) with 0 <= thsd1 <= thsd2, got "
                             f"{thresholds!r}")
        defaults = {"lr": check_range("lr", lr, 0.0, lo_open=True),
                    "momentum": check_range("momentum", momentum, 0.0, 1.0),
                    "weight_decay": check_range("weight_decay", weight_decay, 0.0)}
        super().__init__(params, defaults)
        self.compress_threshold, self.thresholds = compress_threshold, tuple(thresholds)
        self.quantize, self.check, self.selector = quantize, check, method
        self._selection = [0, 0]

    @property
    def selection(self) -> tuple[int, int]:
        """``(selected, k)`` summed over the compressed parameters in the last step."""
        return self._selection[0], self._selection[1]

    def method(self, numel: int) -> str:
        """Return the selector for a parameter of ``numel`` elements (the named one, if any)."""
        if self.selector is not None:
            return self.selector
        if numel < self.thresholds[0]:
            return "topk"
        return "trimmed" if numel < self.thresholds[1] else "threshold"

    def compressed(self, p: torch.Tensor) -> bool:
        """Whether ``p`` is exchanged sparsely (it has more than ``compress_threshold``)."""
        return p.numel() > self.compress_threshold

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One RGC step: sparse exchange of the large parameters, dense of the small ones."""
        loss = evaluate(closure)
        if self._scaler_skips():  # some rank's loss scaler found an overflow
            return loss
        size = self.comm.size
        params = all_params(self.param_groups)
        has, mask = with_grads(params)
        dense: list[tuple[torch.Tensor, dict, torch.Tensor, bool]] = []
        sparse: list[tuple[torch.Tensor, dict, torch.Tensor]] = []
        at = 0
        for group in self.param_groups:
            for p in group["params"]:
                live, at = has[at], at + 1
                g = (p.grad.detach().to(torch.float32).reshape(-1) if live
                     else torch.zeros(p.numel(), device=p.device))
                if live and group["weight_decay"]:
                    g = g + group["weight_decay"] * p.detach().to(torch.float32).reshape(-1)
                if not self.compressed(p):
                    dense.append((p, group, g, live))
                elif live:
                    sparse.append((p, group, g))
        self._selection = [0, 0]
        with agree_on(("grads", mask)):
            # Always, even with nothing dense: it is where ranks agree on the mask.
            flat = (torch.cat([g for _, _, g, _ in dense]) if dense else
                    torch.zeros(0, device=params[0].device if params else "cpu"))
            flat = allreduce(self.comm, flat, check=self.check).div_(size)
            for p, group, g in sparse:
                self._sparse_step(p, g, group, size)
        at, moves = 0, []
        for p, group, _, live in dense:
            d = flat[at:at + p.numel()]
            at += p.numel()
            if live:  # no gradient: no step, no momentum
                moves.append((p, d, group))
        sgd_step(moves, self.state)
        return loss

    def _sparse_step(self, p: torch.Tensor, g: torch.Tensor, group: dict, size: int) -> None:
        state = self.state[p]
        if "residual" not in state:
            state["residual"] = torch.zeros_like(g)
            state["momentum"] = torch.zeros_like(g)
            state["top"] = True
        v, u = state["residual"], state["momentum"]
        if group["momentum"]:
            u.mul_(group["momentum"]).add_(g)
            v.add_(u)
        else:
            v.add_(g)
        k = max(1, math.ceil(self.density * v.numel()))
        method = self.method(v.numel())
        control = None
        if method in select.SIDCO:
            control = StageControl()
            if "sidco" in state:
                control.load_state_dict(state["sidco"])
        options = {"stages": control.stages} if control else None
        if self.quantize:
            side = "top" if state["top"] else "bottom"
            state["top"] = not state["top"]
            total, (idx, _) = sparse_allgather(self.comm, v, k, fmt="mean", method=method,
                                               side=side, options=options, check=self.check)
        else:
            total, (idx, _) = sparse_allgather(self.comm, v, k, fmt="fp32", method=method,
                                               options=options, check=self.check)
        if control:
            control.update(idx.numel(), k, v.numel())
            state["sidco"] = control.state_dict()
        self._selection[0] += idx.numel()
        self._selection[1] += k
        v.index_fill_(0, idx, 0)  # not v[idx] = 0: on a GPU that copies the 0 from the host
        u.index_fill_(0, idx, 0)
        p.add_(total.div_(size).view_as(p).to(p.dtype), alpha=-group["lr"])


class SIDCoSGD(RGC):
    """SIDCo's distributed SGD (its Appendix A): error compensation and a SIDCo selector.

    Each worker adds its gradient to its residual, selects about ``density * n`` entries of
    every compressed parameter with a SIDCo threshold (stages adapted per parameter), allgathers
    them (:func:`~bitcomm.collectives.sparse_allgather`), keeps what it did not send as the next
    residual and steps with the mean. It is :class:`RGC` with ``method`` set to a SIDCo selector
    and, as the paper's loop, no momentum by default (``momentum`` turns on RGC's momentum
    correction).

    Args:
        params, comm, lr, weight_decay, density, compress_threshold, check: as :class:`RGC`.
        dist: ``"sidco-p"`` (generalized Pareto), ``"sidco-e"`` (exponential, the paper's
            default) or ``"sidco-gp"`` (gamma, then Pareto). The default is not the paper's:
            the residual that error compensation leaves has a short tail (what crossed the
            threshold was sent), which an exponential over-estimates; on train-digits at 1%
            SIDCo-E selects nothing at two stages and 1.3k at three, alternating with every
            adaptation, while SIDCo-P stays within 15% of k.
        momentum: as :class:`RGC` (0 here by default).

    """

    def __init__(self, params: Iterable, comm: Comm, lr: float = 0.1, momentum: float = 0.0,
                 weight_decay: float = 0.0, *, density: float = 0.01, dist: str = "sidco-p",
                 compress_threshold: int = 1024, check: bool = True):
        if dist not in select.SIDCO:
            raise ValueError(f"expected dist in {tuple(select.SIDCO)}, got {dist!r}")
        super().__init__(params, comm, lr, momentum, weight_decay, density=density,
                         compress_threshold=compress_threshold, method=dist, check=check)
