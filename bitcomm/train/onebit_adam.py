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
    live_groups,
    momenta,
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
        # torch's multi-tensor ops throughout (a few launches for all parameters, as
        # torch.optim.Adam's default), with a parameter's ops those of torch's per-tensor form
        groups = []
        # a parameter without a gradient keeps its moments and does not move
        for group, live in live_groups(self.param_groups, has):
            b1, b2 = group["betas"]
            for i in live:
                state = self.state[params[i]]
                if not state:
                    state["exp_avg"] = torch.zeros(params[i].shape, dtype=torch.float32,
                                                   device=params[i].device)
                    state["exp_avg_sq"] = torch.zeros_like(state["exp_avg"])
            avgs = [self.state[params[i]]["exp_avg"] for i in live]
            sqs = [self.state[params[i]]["exp_avg_sq"] for i in live]
            gs = [grads[i] for i in live]
            momenta(avgs, gs, b1)
            if not compressing:
                torch._foreach_mul_(sqs, b2)
                torch._foreach_addcmul_(sqs, gs, gs, value=1 - b2)
            groups.append((group, live, avgs, sqs))
        if compressing and params:
            m = torch.cat([self.state[p]["exp_avg"].reshape(-1) if h else
                           torch.zeros(p.numel(), dtype=torch.float32, device=p.device)
                           for p, h in zip(params, has, strict=True)])
            with agree_on(("grads", mask)):
                m = onebit_allreduce(self.comm, m, self.onebit, check=self.check, out=m)
            averaged = split_like(m, params)
            for _, live, avgs, _ in groups:
                _copy_all(avgs, [averaged[i] for i in live])
        for group, live, avgs, sqs in groups:
            update = torch._foreach_sqrt(sqs)
            torch._foreach_add_(update, group["eps"])
            update = torch._foreach_div(avgs, update)
            ps = [params[i] for i in live]
            if group["weight_decay"]:
                torch._foreach_add_(update, torch._foreach_mul(
                    [p.to(torch.float32) for p in ps], group["weight_decay"]))
            torch._foreach_add_(ps, [u.to(p.dtype) for u, p in zip(update, ps, strict=True)],
                                alpha=-group["lr"])
        self.steps += 1
        return loss

    def _extra_state(self) -> dict:
        return {"steps": self.steps, "onebit": self.onebit.state_dict()}

    def _load_extra_state(self, state: dict) -> None:
        self.steps = int(state["steps"])
        self.onebit.load_state_dict(state["onebit"])


def _copy_all(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    # torch's multi-tensor copy where this torch has it (one launch), else one a tensor
    copy = getattr(torch, "_foreach_copy_", None)
    if copy is not None:
        copy(dst, src)
        return
    for d, s in zip(dst, src, strict=True):
        d.copy_(s)
