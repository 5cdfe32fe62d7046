"""QSGDSGD: data-parallel SGD on QSGD-quantised gradients (SparCML, Section 6).

Each step every worker flattens its gradients (plus ``weight_decay * p``) into one vector,
optionally adds its error-feedback residual (:class:`~bitcomm.train.feedback.ErrorFeedback`),
and :func:`~bitcomm.collectives.qsgd_allgather` averages the workers' 2/4/8-bit stochastic
quantisations; the residual keeps what this worker's quantisation dropped. The average then
drives SGD with optional (heavy-ball) momentum, ``buf = momentum * buf + mean``, ``p -= lr * buf``.

Quantisation is reproducible: at step ``t`` (from 0) rank ``r`` quantises with seed
``seed + t * N + r``, so a resumed run draws the same streams as an uninterrupted one.

Example: 8 bits with buckets of 512 quantise each element to within 1/127 of its bucket's largest
magnitude, so with ``error_feedback=True`` the run tracks dense SGD closely; 2 bits keep only
sign and one level per element, and error feedback is what makes them converge.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from bitcomm.codecs import qsgd
from bitcomm.collectives import agree_on, qsgd_allgather
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
    sgd_step,
    split_like,
    with_grads,
)
from bitcomm.train.feedback import ErrorFeedback

__all__ = ["QSGDSGD"]


class QSGDSGD(ExtraState, ScalerAware, torch.optim.Optimizer):
    """SGD whose gradient average is exchanged as QSGD frames.

    Args:
        params: parameters or parameter groups (``lr``, ``momentum``, ``weight_decay``).
        comm: the transport; every rank builds the optimizer over the same parameter layout.
        lr: learning rate.
        momentum: heavy-ball momentum in [0, 1).
        weight_decay: added to the gradient as ``weight_decay * p``.
        bits: 2, 4 or 8 bits per element.
        bucket: elements per qsgd bucket (one fp32 scale each).
        error_feedback: keep and re-add what quantisation dropped.
        seed: base of the quantisation seeds (see the module docstring).
        check: run the collectives' input agreement (every rank raises on a NaN gradient).

    """

    def __init__(self, params: Iterable, comm: Comm, lr: float = 0.01, momentum: float = 0.0,
                 weight_decay: float = 0.0, *, bits: int = 4, bucket: int = qsgd.DEFAULT_BUCKET,
                 error_feedback: bool = False, seed: int = 0, check: bool = True):
        self.comm = check_comm(comm)
        if bits not in qsgd.BITS:
            raise ValueError(f"expected bits in {qsgd.BITS}, got {bits!r}")
        if isinstance(bucket, bool) or not isinstance(bucket, int) or bucket < 1:
            raise ValueError(f"expected bucket to be an int >= 1, got {bucket!r}")
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"expected seed to be an int >= 0, got {seed!r}")
        defaults = {"lr": check_range("lr", lr, 0.0, lo_open=True),
                    "momentum": check_range("momentum", momentum, 0.0, 1.0),
                    "weight_decay": check_range("weight_decay", weight_decay, 0.0)}
        super().__init__(params, defaults)
        self.bits, self.bucket, self.seed, self.check = bits, bucket, seed, check
        self.feedback = ErrorFeedback() if error_feedback else None
        self.steps = 0

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Average the quantised gradients over workers and take one SGD step."""
        loss = evaluate(closure)
        if self._scaler_skips():  # some rank's loss scaler found an overflow
            return loss
        params = all_params(self.param_groups)
        has, mask = with_grads(params)
        flat = flat_grads(params)
        pieces, at = split_like(flat, params), 0
        for group in self.param_groups:
            for p in group["params"]:
                if group["weight_decay"] and has[at]:
                    pieces[at].add_(p.to(torch.float32), alpha=group["weight_decay"])
                at += 1
        skipped = None if all(has) else torch.cat(
            [torch.full((p.numel(),), not h, dtype=torch.bool, device=flat.device)
             for p, h in zip(params, has, strict=True)])
        kept = None
        if self.feedback is not None:
            flat = self.feedback.compensate("flat", flat)
            if skipped is not None:  # a skipped parameter's residual waits, unsent
                kept = self.feedback.residuals.get("flat")
                kept = None if kept is None else kept.clone()
                flat.masked_fill_(skipped, 0)  # flat[skipped] = 0 would wait (nonzero)
        with agree_on(("grads", mask)):
            mean, sent = qsgd_allgather(self.comm, flat, bits=self.bits, bucket=self.bucket,
                                        seed=self.seed + self.steps * self.comm.size,
                                        check=self.check)
        if self.feedback is not None:
            self.feedback.update("flat", flat, sent)
            if skipped is not None:
                residual = self.feedback.residuals["flat"]
                if kept is None:
                    residual.masked_fill_(skipped, 0)
                else:
                    torch.where(skipped, kept, residual, out=residual)
        directions = split_like(mean, params)
        sgd_step([(params[i], directions[i], group)
                  for group, live in live_groups(self.param_groups, has) for i in live],
                 self.state)
        self.steps += 1
        return loss

    def _extra_state(self) -> dict:
        return {"steps": self.steps,
                "feedback": None if self.feedback is None else self.feedback.state_dict()}

    def _load_extra_state(self, state: dict) -> None:
        self.steps = int(state["steps"])
        if (state["feedback"] is None) != (self.feedback is None):
            raise ValueError("the checkpoint and this optimizer disagree on error_feedback")
        if self.feedback is not None:
            self.feedback.load_state_dict(state["feedback"])
