"""OneBitAdam: 1-bit Adam as DeepSpeed defines it (``deepspeed/runtime/fp16/onebit/adam.py``).

Two stages, switched at ``freeze_step``:

1. Warm-up (steps 1 .. ``freeze_step``): plain Adam on gradients averaged by a dense fp32
   allreduce: ``m = b1 m + (1 - b1) g``, ``v = b2 v + (1 - b2) g^2``.
2. Compression (later steps): ``v`` is frozen; each worker updates ``m`` with its *local*
   gradient, and the momentum is averaged through
   :func:`~bitcomm.collectives.onebit_allreduce` (1-bit signs with a worker and a server error,
   All-Reducible signSGD's all-to-all baseline).

Every step: ``p -= lr * (m / (sqrt(v) + eps) + weight_decay * p)``. Like DeepSpeed's optimizer,
there is no bias correction (DeepSpeed accepts ``bias_correction`` and does not use it). All
parameters are flattened into one buffer padded to ``N * lcm(N, 8)`` elements, so a step is one
collective whatever the number of tensors (DeepSpeed compresses each parameter tensor
separately). The error buffers, the step count and Adam's moments are in ``state_dict()``.

Example: one worker, ``p = [1.0]``, ``g = [0.5]``, lr 0.1, betas (0.9, 0.999), eps 0: step 1
gives ``m = 0.05``, ``v = 0.00025``, ``p = 1 - 0.1 * 0.05 / 0.0158114 = 0.683772``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from bitcomm.collectives import OneBitState, agree_on, allreduce, onebit_allreduce
from bitcomm.comm.base import Comm
from bitcomm.train._common import (
    ExtraState,
    ScalerAware,
    all_params,
    check_comm,
    check_range,
    evaluate,
    flat_grads,
    momentum,
    split_like,
    with_grads,
)

__all__ = ["OneBitAdam"]


class OneBitAdam(ExtraState, ScalerAware, torch.optim.Optimizer):
    """1-bit Adam over a bitcomm transport.

    Args:
        params: parameters or parameter groups (``lr``, ``betas``, ``eps``, ``weight_decay``).
        comm: the transport; every rank builds the optimizer over the same parameter layout.
        lr: learning rate.
        betas: Adam's (b1, b2), each in [0, 1).
        eps: added to ``sqrt(v)``.
        weight_decay: L2 term added to the update (DeepSpeed's form, not decoupled).
        freeze_step: warm-up steps of dense Adam before the variance freezes (>= 1: the frozen
            variance must have seen gradients).
        collective: the exchange of :func:`~bitcomm.collectives.onebit_allreduce` (its
            ``OneBitState``'s): ``"alltoall"`` (DeepSpeed's two rounds), ``"allgather"`` (one
            round, the same result) or ``"auto"`` (the allgather at 2 ranks, where it sends the
            same sign bytes, the all-to-all above).
        check: run the collectives' input agreement (every rank raises on a NaN gradient).

    """

    def __init__(self, params: Iterable, comm: Comm, lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, *, freeze_step: int = 100, collective: str = "auto",
                 check: bool = True):
        self.comm = check_comm(comm)
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise ValueError(f"expected betas to be a pair (b1, b2), got {betas!r}")
        if isinstance(freeze_step, bool) or not isinstance(freeze_step, int) or freeze_step < 1:
            raise ValueError(f"expected freeze_step to be an int >= 1 (warm-up steps before the "
                             f"variance freezes), got {freeze_step!r}")
        defaults = {"lr": check_range("lr", lr, 0.0, lo_open=True),
                    "betas": (check_range("betas[0]", betas[0], 0.0, 1.0),
                              check_range("betas[1]", betas[1], 0.0, 1.0)),
                    "eps": check_range("eps", eps, 0.0),
                    "weight_decay": check_range("weight_decay", weight_decay, 0.0)}
        super().__init__(params, defaults)
        self.freeze_step, self.check = freeze_step, check
        self.steps = 0
        params_ = all_params(self.param_groups)
        self.onebit = OneBitState(sum(p.numel() for p in params_), self.comm.size,
                                  params_[0].device if params_ else "cpu",
                                  collective=collective)

    @property
    def compressing(self) -> bool:
        """Whether the next step communicates 1-bit momentum (the warm-up is over)."""
        return self.steps >= self.freeze_step

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One 1-bit Adam step (dense Adam during the warm-up)."""
        loss = evaluate(closure)
        if self._scaler_skips():  # some rank's loss scaler found an overflow
            return loss
        params = all_params(self.param_groups)
        has, mask = with_grads(params)
        compressing = self.compressing
        flat = flat_grads(params)
        if not compressing:
            with agree_on(("grads", mask)):
                flat = allreduce(self.comm, flat, check=self.check).div_(self.comm.size)
        grads = split_like(flat, params)
        at = 0
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if not has[at]:  # no gradient: its moments and the parameter stay
                    at += 1
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
                    state["exp_avg_sq"] = torch.zeros_like(state["exp_avg"])
                momentum(state["exp_avg"], grads[at], b1)
                if not compressing:
                    state["exp_avg_sq"].mul_(b2).addcmul_(grads[at], grads[at], value=1 - b2)
                at += 1
        if compressing and params:
            m = torch.cat([self.state[p]["exp_avg"].reshape(-1) if h else
                           torch.zeros(p.numel(), dtype=torch.float32, device=p.device)
                           for p, h in zip(params, has, strict=True)])
            with agree_on(("grads", mask)):
                m = onebit_allreduce(self.comm, m, self.onebit, check=self.check, out=m)
            for p, h, avg in zip(params, has, split_like(m, params), strict=True):
                if h:
                    self.state[p]["exp_avg"].copy_(avg)
        skip = iter([not h for h in has])
        for group in self.param_groups:
            for p in group["params"]:
                if next(skip):
                    continue
                state = self.state[p]
                update = state["exp_avg"] / (state["exp_avg_sq"].sqrt() + group["eps"])
                if group["weight_decay"]:
                    update += group["weight_decay"] * p.to(torch.float32)
                p.add_(update.to(p.dtype), alpha=-group["lr"])
        self.steps += 1
        return loss

    def _extra_state(self) -> dict:
        return {"steps": self.steps, "onebit": self.onebit.state_dict()}

    def _load_extra_state(self, state: dict) -> None:
        self.steps = int(state["steps"])
        self.onebit.load_state_dict(state["onebit"])
