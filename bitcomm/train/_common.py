"""Pieces the optimizers share: checked hyper-parameters and flat views of parameters."""

from __future__ import annotations

from collections.abc import Callable

import torch

from bitcomm.codecs import _frame
from bitcomm.collectives import allreduce
from bitcomm.comm.base import Comm


def check_comm(comm: object) -> Comm:
    if not isinstance(comm, Comm):
        raise TypeError(f"expected comm to be a bitcomm Comm (LocalComm, MPIComm, TorchComm), "
                        f"got {type(comm).__name__}")
    return comm


def check_range(name: str, value: object, lo: float, hi: float | None = None, *,
                lo_open: bool = False) -> float:
    """Return ``value`` as a float if it lies in [lo, hi) (or (lo, hi)); else ValueError."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"expected {name} to be a number, got {type(value).__name__}")
    ok = (value > lo if lo_open else value >= lo) and (hi is None or value < hi)
    if not ok:
        bound = f"{'(' if lo_open else '['}{lo}, {hi if hi is not None else 'inf'})"
        raise ValueError(f"expected {name} in {bound}, got {value}")
    return float(value)


def evaluate(closure: Callable[[], float] | None) -> float | None:
    """Run a ``step(closure)`` closure with gradients enabled; return its loss (or None)."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def all_params(groups: list[dict]) -> list[torch.Tensor]:
    """Return every parameter of ``groups``, in order, with or without a gradient.

    Every rank must contribute the same flat layout to a collective, so a parameter without a
    gradient on this rank still takes its place (as zeros, see :func:`flat_grads`).
    """
    return [p for g in groups for p in g["params"]]


def with_grads(params: list[torch.Tensor]) -> tuple[list[bool], bytes]:
    """Return which of ``params`` have a gradient, and that mask packed (for :func:`agree_on`).

    A parameter without one is skipped by the step, as ``torch.optim.SGD`` skips it: it does
    not move and its state does not change. Its place in the flat vector stays (as zeros), so
    the layout is the same on every rank; the optimizers run their collectives inside
    ``agree_on(mask)``, so ranks whose masks differ raise ``ValueError`` on every rank (with
    ``check=True``) instead of updating different parameters.
    """
    has = [p.grad is not None for p in params]
    packed = bytes(sum(1 << j for j in range(8) if i + j < len(has) and has[i + j])
                   for i in range(0, len(has), 8))
    return has, packed


def live_groups(groups: list[dict], has: list[bool]) -> list[tuple[dict, list[int]]]:
    """Return each group with the indices of its parameters that have a gradient.

    Indices are into :func:`all_params`, ``has`` is :func:`with_grads`'s; groups with none are
    left out, as their parameters take no step.
    """
    out, at = [], 0
    for group in groups:
        n = len(group["params"])
        live = [i for i in range(at, at + n) if has[i]]
        at += n
        if live:
            out.append((group, live))
    return out


def float32_operand(g: torch.Tensor) -> torch.Tensor:
    """Return ``g`` as an operand of float32 arithmetic with a float32 tensor.

    A 16-bit float or float32 tensor is returned as it is: torch widens it exactly as it reads
    it, so ``e + g`` gives the bits of ``e + g.float()`` without a widened copy (6 bytes an
    element). A float64 one is rounded to float32 first (torch would compute in float64).
    """
    return g.to(torch.float32) if g.dtype == torch.float64 else g


def momentum(m: torch.Tensor, g: torch.Tensor, beta: float,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """Write ``beta * m + (1 - beta) * g`` into ``out`` (default: ``m``, in place); return it.

    ``m`` (and ``out``) are float32; ``g`` is any float tensor of their length, rounded to
    float32 first. Every path gives the bits of torch's ``m.mul(beta).add_(g, alpha=1 - beta)``
    (the product rounded, then one fused multiply-add: torch's add with ``alpha`` is one on CPU
    and CUDA). On the Triton path one kernel reads ``m`` and ``g`` and writes ``out``, 12 bytes
    an element for a float32 gradient, where the torch ops move 20.
    """
    out = m if out is None else out
    if (_frame.use_triton(m) and m.is_contiguous() and g.is_contiguous()
            and out.is_contiguous()):
        _frame.kernels().momentum(m, g, beta, out)
        return out
    return torch.mul(m, beta, out=out).add_(float32_operand(g), alpha=1 - beta)


KERNEL_MIN = 1 << 16
"""Elements from which :func:`momenta` gives a tensor a Triton launch of its own."""


def momenta(ms: list[torch.Tensor], gs: list[torch.Tensor], beta: float) -> None:
    """Apply :func:`momentum` to each pair ``(ms[i], gs[i])`` in place.

    An optimizer's parameters are often hundreds of tensors, most of them small, where a launch
    each costs the host more than the device's work: tensors under :data:`KERNEL_MIN` elements,
    and every tensor off the Triton path, go through torch's multi-tensor ops
    (``torch._foreach_mul_`` then ``torch._foreach_add_`` with ``alpha``, as ``torch.optim``'s
    default implementations do): two launches for all of them, the operations of
    :func:`momentum`'s torch path (on a CPU that path itself, one tensor after another). A
    larger tensor on the Triton path takes the one-pass kernel.
    """
    small_m, small_g = [], []
    for m, g in zip(ms, gs, strict=True):
        if m.numel() >= KERNEL_MIN and _frame.use_triton(m):
            momentum(m, g, beta)
        else:
            small_m.append(m)
            small_g.append(float32_operand(g))
    if small_m:
        torch._foreach_mul_(small_m, beta)
        torch._foreach_add_(small_m, small_g, alpha=1 - beta)


def flat_grads(params: list[torch.Tensor]) -> torch.Tensor:
    """Concatenate the gradients of ``params`` (zeros where None) into one float32 vector."""
    parts = []
    for p in params:  # per parameter, only the calls it needs: hundreds of them a step
        g = p.grad
        if g is None:
            parts.append(torch.zeros(p.numel(), dtype=torch.float32, device=p.device))
            continue
        g = g.reshape(-1)
        if g.requires_grad:  # a gradient with a graph (backward's create_graph)
            g = g.detach()
        parts.append(g if g.dtype == torch.float32 else g.to(torch.float32))
    if not parts:
        return torch.zeros(0)
    return torch.cat(parts)


def split_like(flat: torch.Tensor, params: list[torch.Tensor]) -> list[torch.Tensor]:
    """Split ``flat`` (as many elements as ``params`` hold) into views shaped like them."""
    if not params:
        return []
    # one split into views, then a reshape each: half the time of slicing in Python
    parts = flat.split_with_sizes([p.numel() for p in params])
    return [t.view_as(p) for t, p in zip(parts, params, strict=True)]


class ExtraState:
    """Mixin for optimizers with state beyond torch's per-parameter ``state``.

    ``state_dict()`` gains a ``"bitcomm"`` entry from :meth:`_extra_state`, and
    ``load_state_dict`` hands it to :meth:`_load_extra_state`, so one checkpoint resumes the
    whole optimizer.
    """

    def _extra_state(self) -> dict:
        raise NotImplementedError

    def _load_extra_state(self, state: dict) -> None:
        raise NotImplementedError

    def state_dict(self) -> dict:  # noqa: D102 - torch.optim.Optimizer's, plus "bitcomm"
        sd = super().state_dict()  # type: ignore[misc]
        sd["bitcomm"] = self._extra_state()
        return sd

    def load_state_dict(self, state_dict: dict) -> None:  # noqa: D102 - see state_dict
        sd = dict(state_dict)
        if "bitcomm" not in sd:
            raise ValueError(f"expected a state_dict from {type(self).__name__}.state_dict() "
                             "(it has no 'bitcomm' entry)")
        extra = sd.pop("bitcomm")
        super().load_state_dict(sd)  # type: ignore[misc]
        self._load_extra_state(extra)


class ScalerAware:
    """Mixin: ``torch.amp.GradScaler.step`` calls ``step()`` on every rank, with its flags.

    A scaler that sees NaN or inf in this rank's gradients skips ``step()``; with per-rank
    gradients (the optimizer, not DDP, averages them) only the overflowing rank would skip, and
    its next step would be exchanged with the other ranks' current one. With
    ``_step_supports_amp_scaling`` the scaler instead always calls ``step()`` and hands over its
    overflow flag (``found_inf``) and scale (``grad_scale``): :meth:`_scaler_skips` sums the flag
    over the ranks (one 4-byte allreduce) and every rank skips the step together when any rank
    overflowed; otherwise it unscales the gradients, as ``GradScaler.unscale_`` would. Each
    rank's scaler backs off only on its own overflow; :class:`GradScaler` agrees on the flag so
    that they all do.
    """

    _step_supports_amp_scaling = True
    comm: Comm
    check: bool
    param_groups: list[dict]

    def _scaler_skips(self) -> bool:
        """Return whether a scaler's overflow on any rank skips this step (else unscale)."""
        found = getattr(self, "found_inf", None)
        if found is None:  # no scaler, or one that does not pass its flags
            return False
        flag = found.detach().to(torch.float32).reshape(1).clone()
        if float(allreduce(self.comm, flag, check=self.check).item()) > 0:
            return True
        scale = getattr(self, "grad_scale", None)
        if scale is not None:  # None when the user called scaler.unscale_ already
            inv = scale.detach().double().reciprocal().float()
            for p in all_params(self.param_groups):
                if p.grad is not None:
                    p.grad.mul_(inv.to(p.grad.device))
        return False


def sgd_step(moves: list[tuple[torch.Tensor, torch.Tensor, dict]], states: dict) -> None:
    """Apply ``torch.optim.SGD``'s update to each ``(p, d, group)``: ``p`` along ``d``.

    ``d`` is a float32 direction of ``p.numel()`` elements; ``buf = momentum * buf + d`` when
    the group has momentum (the buffer kept in ``states[p]``, created at the first step), then
    ``p -= lr * buf``. A group's parameters move together through torch's multi-tensor ops (a
    few launches for all of them, as ``torch.optim.SGD``'s default; on a CPU the per-tensor
    ops one after another, with their bits).
    """
    groups: dict[int, tuple[dict, list, list]] = {}
    for p, d, group in moves:
        _, ps, ds = groups.setdefault(id(group), (group, [], []))
        ps.append(p)
        ds.append(d)
    for group, ps, ds in groups.values():
        if group["momentum"]:
            bufs = []
            for p, d in zip(ps, ds, strict=True):
                state = states[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(d)
                bufs.append(state["momentum_buffer"])
            torch._foreach_mul_(bufs, group["momentum"])
            torch._foreach_add_(bufs, ds)
            ds = bufs
        torch._foreach_add_(ps, [d.view_as(p).to(p.dtype) for d, p in zip(ds, ps, strict=True)],
                            alpha=-group["lr"])
