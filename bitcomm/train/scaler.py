"""GradScaler: ``torch.amp.GradScaler`` whose overflow verdict is the same on every rank.

With DDP every rank unscales the same averaged gradients, so every rank's scaler sees the same
overflow and backs off together. A bitcomm optimizer averages the gradients inside ``step()``,
after the scaler looked at them, so each rank's scaler sees only its own gradients. The
optimizers already agree on the flag so that no rank steps alone
(:class:`~bitcomm.train._common.ScalerAware`); this scaler agrees on it too, summing it over the
ranks wherever it is computed (``unscale_`` and ``step``), so every rank's scale backs off and
grows at the same steps, as under DDP. It is FSDP's ``ShardedGradScaler`` idea over a bitcomm
transport: one 4-byte allreduce per optimizer and step.

Example::

    scaler = GradScaler(comm, "cuda")
    with torch.autocast("cuda", dtype=torch.float16):
        loss = model(x).loss
    scaler.scale(loss).backward()
    scaler.step(opt)  # every rank skips, or none does
    scaler.update()   # every rank's scale stays the same
"""

from __future__ import annotations

import torch

from bitcomm.collectives import allreduce
from bitcomm.comm.base import Comm
from bitcomm.train._common import check_comm

__all__ = ["GradScaler"]


class GradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` with the overflow flag summed over ``comm``'s ranks.

    Args:
        comm: the transport the optimizer uses (every rank must call the scaler's methods
            in the same order, as it calls the optimizer's).
        device: as ``torch.amp.GradScaler`` (``"cuda"``, ``"cpu"``, ...).
        check: run the collectives' input agreement on the flag's exchange.
        **kwargs: ``init_scale``, ``growth_factor``, ``backoff_factor``, ``growth_interval``,
            ``enabled``, as ``torch.amp.GradScaler``.

    """

    def __init__(self, comm: Comm, device: str = "cuda", *, check: bool = True, **kwargs):
        super().__init__(device, **kwargs)
        self.comm = check_comm(comm)
        self.check = bool(check)

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):  # noqa: D102
        # Every path that looks for an overflow (unscale_, and step's check when the optimizer
        # unscales by itself) comes through here: sum the per-device flags over the ranks.
        per_device = super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
        local = torch.zeros(1, dtype=torch.float32)
        for flag in per_device.values():
            local += flag.detach().to("cpu", torch.float32).reshape(-1)[:1]
        total = allreduce(self.comm, local, check=self.check)
        verdict = float(total.item() > 0)
        if not per_device:  # no gradient here, but another rank overflowed
            per_device[found_inf.device] = found_inf
        for flag in per_device.values():
            flag.fill_(verdict)
        return per_device
