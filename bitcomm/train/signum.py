"""MajoritySignSGD: signSGD with momentum (Signum) and a majority vote over workers.

Each worker keeps a momentum ``m = beta * m + (1 - beta) * g`` (plain signSGD for ``beta = 0``)
and votes with the sign of ``m`` (``m >= 0`` votes +1); every parameter then moves by
``-lr * majority``. The vote runs on all parameters at once, flattened into one vector, through
:func:`~bitcomm.collectives.ring_majority` (All-Reducible signSGD, Section 3: counts in
``ceil(log2(i+1))`` bits around a ring), 1-bit Adam's all-to-all
(:func:`~bitcomm.collectives.alltoall_majority`) or one allgather of every worker's signs
(:func:`~bitcomm.collectives.allgather_majority`). All give the same majority, so the choice
changes only the bytes, the rounds and who talks to whom. Weight decay is added to the gradient
(``g + weight_decay * p``) before the momentum, as in ``torch.optim.SGD``.

With an even number of workers half of them can vote each way. The paper's rule sends every
such tie to -1 (``tie="negative"``), which moves every tied element up at every step: a bias
that grows with the number of ties. The default ``tie="alternate"`` decides a tie by the
element's index in the flat vector plus the step number (even: +1, odd: -1), so within a step
half the ties go each way and a tied element goes back and forth from step to step; the step
number is saved in :meth:`state_dict`.

Example: two workers, one parameter ``[1.0, 1.0]``, lr 0.1, momentum 0: worker gradients
``[0.5, -2.0]`` and ``[0.3, 1.0]`` vote ``[+1, -1]`` and ``[+1, +1]``. The second element
ties: at the first step (step 0, element 1: odd) it goes to -1, so both workers step to
``[0.9, 1.1]``; at the next step the same tie would go to +1.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from bitcomm.collectives import agree_on
from bitcomm.collectives.majority import check_collective, check_tie, vote_for
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

__all__ = ["MajoritySignSGD"]

class MajoritySignSGD(ExtraState, ScalerAware, torch.optim.Optimizer):
    """Signum with a majority vote of the workers' momentum signs.

    Args:
        params: parameters or parameter groups (``lr``, ``momentum``, ``weight_decay`` per group).
        comm: the transport; every rank builds the optimizer over the same parameter layout.
        lr: step size (each element moves by exactly ``lr`` per step).
        momentum: Signum's ``beta`` in [0, 1); 0 is signSGD.
        weight_decay: added to the gradient as ``weight_decay * p``.
        collective: ``"auto"`` (the default: allgather at 2 workers, else ring), ``"ring"``
            (ring_majority), ``"alltoall"`` (alltoall_majority) or ``"allgather"``
            (allgather_majority: one round, for small tensors).
        tie: the vote where exactly half the workers say +1: ``"alternate"`` (by element index
            and step, unbiased), ``"negative"`` (the paper's -1) or ``"positive"``.
        check: run the collectives' input agreement (every rank raises on a NaN gradient).

    """

    def __init__(self, params: Iterable, comm: Comm, lr: float = 1e-3, momentum: float = 0.9,
                 weight_decay: float = 0.0, *, collective: str = "auto", tie: str = "alternate",
                 check: bool = True):
        self.comm = check_comm(comm)
        check_collective(collective)
        check_tie(tie)
        defaults = {"lr": check_range("lr", lr, 0.0, lo_open=True),
                    "momentum": check_range("momentum", momentum, 0.0, 1.0),
                    "weight_decay": check_range("weight_decay", weight_decay, 0.0)}
        super().__init__(params, defaults)
        self.collective, self.tie, self.check = collective, tie, check
        self.steps = 0  # the alternating tie's phase

    def _extra_state(self) -> dict:
        return {"steps": self.steps}

    def _load_extra_state(self, state: dict) -> None:
        steps = state.get("steps") if isinstance(state, dict) else None
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise ValueError(f"expected the 'bitcomm' entry to hold steps (an int >= 0), got "
                             f"{state!r}")
        self.steps = steps

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Vote on the momentum signs and move every parameter by ``-lr`` times the majority."""
        loss = evaluate(closure)
        if self._scaler_skips():  # some rank's loss scaler found an overflow
            return loss
        params = all_params(self.param_groups)
        has, mask = with_grads(params)
        grads = split_like(flat_grads(params), params)
        moms = list(grads)  # a parameter without a gradient votes its zeros and keeps its state
        for group, live in live_groups(self.param_groups, has):
            beta, wd = group["momentum"], group["weight_decay"]
            gs = [grads[i] for i in live]
            if wd:
                gs = torch._foreach_add(gs, torch._foreach_mul(
                    [params[i].to(torch.float32) for i in live], wd))
            for i, g in zip(live, gs, strict=True):
                state = self.state[params[i]]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(g)
                moms[i] = state["momentum_buffer"]
            # torch's multi-tensor ops for the many small tensors, a kernel for each large one
            momenta([moms[i] for i in live], gs, beta)
        flat = torch.cat([m.reshape(-1) for m in moms]) if moms else torch.zeros(0)
        vote = vote_for(self.collective, self.comm.size)
        with agree_on(("grads", mask)):
            # into the momenta's concatenation, read by then: no second vector of n floats
            majority = vote(self.comm, flat, tie=self.tie, phase=self.steps, check=self.check,
                            out=flat)
        self.steps += 1
        votes = split_like(majority, params)
        for group, live in live_groups(self.param_groups, has):
            # -lr * (+-1) is exact: one rounding per element, as p.add_ makes
            torch._foreach_add_([params[i] for i in live],
                                [votes[i].to(params[i].dtype) for i in live], alpha=-group["lr"])
        return loss
