"""Ok-Topk SGD (Algorithm 2): a residual, Ok-Topk's sparse allreduce, then SGD with momentum.

Per step, over every parameter laid end to end (one flat buffer, as the paper)::

    acc = residual + grad
    u, indexes = oktopk_allreduce(acc, k)        (k = ceil(density * n); state carried over)
    residual = acc ;  residual[indexes] = 0      (only what reached the global top-k leaves)
    d = u / P + weight_decay * w
    buf = momentum * buf + d ;  w = w - lr * buf

The update after the exchange is ``torch.optim.SGD``'s, as in the authors' public code (which
hands the averaged sparse gradient to a stock SGD step, weight decay and momentum included);
the paper's Algorithm 2 folds ``lr`` into the accumulator instead, which makes a changed ``lr``
rescale what waits in the residual. ``warmup`` first steps exchange the dense mean gradient
(the public code uses 128-512 such steps; the paper does not mention them).

A parameter whose ``grad`` is None is skipped as ``torch.optim.SGD`` skips it: its place in the
flat buffer is zeros (never selected, since Ok-Topk selects no zero), it does not move and its
residual waits. The ranks agree on which parameters have gradients (``agree_on``).
:attr:`OkTopkSGD.collective` is the :class:`~bitcomm.collectives.OkTopkState`, whose ``last``
says how many entries the last step selected.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch

from bitcomm.collectives import OkTopkState, agree_on, allreduce, oktopk_allreduce
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

__all__ = ["OkTopkSGD"]


class OkTopkSGD(ExtraState, ScalerAware, torch.optim.Optimizer):
    """Ok-Topk's sparse SGD with a residual (Algorithm 2).

    Args:
        params: parameters or parameter groups (``lr``, ``momentum``, ``weight_decay``); every
            rank builds the optimizer over the same parameters in the same order.
        comm: the transport.
        lr: learning rate.
        momentum: momentum in [0, 1) on the averaged sparse gradient.
        weight_decay: added after the exchange as ``weight_decay * w``.
        density: ``k / n`` of the flat buffer, in (0, 1].
        tau: steps between space repartitions (64).
        tau_prime: steps between exact thresholds (32).
        balance: ``"auto"``, ``"always"`` or ``"never"`` (see
            :mod:`bitcomm.collectives.oktopk`).
        feedback: adjust reused thresholds by the counts (the public code's rules).
        warmup: first steps that exchange the dense mean gradient.
        check: run the collectives' input agreement (every rank raises on a NaN gradient).

    """

    def __init__(self, params: Iterable, comm: Comm, lr: float = 0.1, momentum: float = 0.0,
                 weight_decay: float = 0.0, *, density: float = 0.01, tau: int = 64,
                 tau_prime: int = 32, balance: str = "auto", feedback: bool = True,
                 warmup: int = 0, check: bool = True):
        self.comm = check_comm(comm)
        self.density = check_range("density", density, 0.0, 1.0 + 1e-12, lo_open=True)
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
            raise ValueError(f"expected warmup to be an int >= 0, got {warmup!r}")
        self.collective = OkTopkState(tau=tau, tau_prime=tau_prime, balance=balance,
                                      feedback=feedback)
        self.collective.check()
        defaults = {"lr": check_range("lr", lr, 0.0, lo_open=True),
                    "momentum": check_range("momentum", momentum, 0.0, 1.0),
                    "weight_decay": check_range("weight_decay", weight_decay, 0.0)}
        super().__init__(params, defaults)
        self.warmup, self.check = warmup, check
        self.steps = 0
        self._target = 0

    @property
    def selection(self) -> tuple[int, int] | None:
        """``(selected, k)`` of the last sparse step: the global top-k's entries and the target."""
        last = self.collective.last
        return None if last is None or self.steps <= self.warmup else (last.selected,
                                                                        self._target)

    def _extra_state(self) -> dict:
        return {"steps": self.steps, "collective": self.collective.state_dict()}

    def _load_extra_state(self, state: dict) -> None:
        self.steps = int(state["steps"])
        self.collective.load_state_dict(state["collective"])

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One step: accumulate, Ok-Topk allreduce (or dense in warm-up), SGD update."""
        loss = evaluate(closure)
        if self._scaler_skips():
            return loss
        params = all_params(self.param_groups)
        has, mask = with_grads(params)
        device = params[0].device if params else torch.device("cpu")
        parts = []
        for p, live in zip(params, has, strict=True):
            if not live:
                parts.append(torch.zeros(p.numel(), device=p.device))
                continue
            grad = p.grad.detach().to(torch.float32).reshape(-1)
            state = self.state[p]
            if "residual" not in state:
                state["residual"] = torch.zeros_like(grad)
            parts.append(grad if self.steps < self.warmup else state["residual"] + grad)
        acc = torch.cat(parts) if parts else torch.zeros(0, device=device)
        size = self.comm.size
        with agree_on(("grads", mask)):
            if self.steps < self.warmup:
                mean = allreduce(self.comm, acc, check=self.check).div_(size)
            else:
                k = self._target = math.ceil(self.density * acc.numel())
                u, indexes = oktopk_allreduce(self.comm, acc, k, self.collective,
                                              check=self.check)
                acc.index_fill_(0, indexes, 0)  # acc[indexes] = 0 copies from the host
                mean = u.to(device).div_(size)
        at, moves = 0, []
        for (p, group), live in zip(((p, g) for g in self.param_groups for p in g["params"]),
                                    has, strict=True):
            n = p.numel()
            d, rest = mean[at:at + n], acc[at:at + n]
            at += n
            if not live:
                continue
            state = self.state[p]
            if self.steps >= self.warmup:
                state["residual"].copy_(rest)
            if group["weight_decay"]:
                d = d + group["weight_decay"] * p.detach().to(torch.float32).reshape(-1)
            moves.append((p, d, group))
        sgd_step(moves, self.state)
        self.steps += 1
        return loss
