"""DDP hook benchmark: the time of a training step with each communication hook.

Run on every rank of a launched torch.distributed job (``bitcomm bench hooks`` launches gloo
processes). For each bucket size, a DistributedDataParallel MLP trains on fixed random batches
with each hook in turn: PyTorch's ``allreduce_hook`` (the anchor), ``fp16_compress_hook`` and
``powerSGD_hook`` (matrix rank 1, compressing from the second step), and bitcomm's four hooks, each
both overlapped (the default: the exchange runs on the state's thread during backward) and
blocking (``overlap=False``). A step is ``zero_grad``, forward, backward and ``SGD.step``; each
is timed by :func:`bitcomm.collectives.registry.time_calls` after ``warmup`` untimed steps (DDP
rebuilds its buckets after the first), a step's time is its slowest rank's, and a row reports
the median step, its min and max, and the ratio to ``allreduce_hook`` at the same bucket size
in the same run (these machines are shared: compare ratios, not times across runs).

``powerSGD_hook`` is measured only where the model makes one bucket: over gloo, with several
buckets, its future callbacks issue their allreduces from gloo's thread while the autograd
thread issues the next bucket's, in an order that differs between ranks, and the job hangs
(PyTorch 2.13, 2 ranks). The anchor's bucket count decides, and the skip is reported.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from bitcomm.collectives import registry
from bitcomm.comm.base import Comm
from bitcomm.train import hooks

__all__ = ["HOOKS", "Row", "run", "mlp"]


def _torch(hook: Callable, state: Callable[[Comm], object]) -> Callable:
    return lambda comm: (state(comm), hook)


def _ours(hook: Callable, kind: type, **options: object) -> Callable:
    return lambda comm: (kind(comm, **options), hook)


HOOKS: dict[str, Callable[[Comm], tuple[object, Callable]]] = {
    "allreduce": _torch(default_hooks.allreduce_hook, lambda comm: None),
    "fp16_compress": _torch(default_hooks.fp16_compress_hook, lambda comm: None),
    "powerSGD": _torch(powerSGD_hook.powerSGD_hook, lambda comm: powerSGD_hook.PowerSGDState(
        None, matrix_approximation_rank=1, start_powerSGD_iter=2)),
    "sign": _ours(hooks.sign_majority_hook, hooks.SignState),
    "sign/blocking": _ours(hooks.sign_majority_hook, hooks.SignState, overlap=False),
    "onebit": _ours(hooks.onebit_hook, hooks.OneBitHookState),
    "onebit/blocking": _ours(hooks.onebit_hook, hooks.OneBitHookState, overlap=False),
    "qsgd": _ours(hooks.qsgd_hook, hooks.QsgdState),
    "qsgd/blocking": _ours(hooks.qsgd_hook, hooks.QsgdState, overlap=False),
    "topk": _ours(hooks.topk_hook, hooks.TopkState),
    "topk/blocking": _ours(hooks.topk_hook, hooks.TopkState, overlap=False),
}
"""Hook name -> ``make(comm) -> (state, hook)``; ``allreduce`` is the anchor of the ratios."""


@dataclasses.dataclass
class Row:
    """One hook at one bucket size: step times (slowest rank per step) and the anchor ratio."""

    hook: str
    bucket_mb: float
    buckets: int
    params: int
    ranks: int
    step_ms: float
    step_ms_min: float
    step_ms_max: float
    vs_allreduce: float

    def as_dict(self) -> dict:
        """Return the row as a JSON-friendly dict."""
        return dataclasses.asdict(self)


def mlp(width: int, depth: int, inputs: int = 32) -> torch.nn.Module:
    """Return the benchmark's model: ``depth`` Linear+Tanh layers of ``width``, then 1 output."""
    layers: list[torch.nn.Module] = []
    for i in range(depth):
        layers += [torch.nn.Linear(inputs if i == 0 else width, width), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(width if depth else inputs, 1))


def run(comm: Comm, bucket_mbs: tuple[float, ...] = (0.004, 0.25, 1.0), *, width: int = 128,
        depth: int = 8, batch: int = 64, steps: int = 30, warmup: int = 5,
        names: tuple[str, ...] = tuple(HOOKS),
        progress: Callable[[Row], None] | None = None,
        skipped: Callable[[str, float, str], None] | None = None) -> list[Row] | None:
    """Time a DDP training step with each hook in ``names`` at each bucket size.

    Args:
        comm: a bitcomm transport over torch.distributed's default group (the hooks' and the
            timing loop's); every rank calls this with the same arguments.
        bucket_mbs: DDP's ``bucket_cap_mb`` values.
        width: hidden width of the model (:func:`mlp`).
        depth: its hidden layers.
        batch: samples per step and rank.
        steps: timed steps per hook and bucket size.
        warmup: untimed steps first (at least 2: DDP rebuilds its buckets after the first).
        names: keys of :data:`HOOKS`; ``"allreduce"`` is always measured (the anchor).
        progress: called on rank 0 with each row as soon as it is measured.
        skipped: called on rank 0 with (hook, bucket_mb, reason) for each hook not measured.

    Returns:
        the rows on rank 0, None elsewhere.

    """
    unknown = [n for n in names if n not in HOOKS]
    if unknown:
        raise ValueError(f"expected hooks from {list(HOOKS)}, got {unknown}")
    if steps < 1 or warmup < 2:
        raise ValueError(f"expected steps >= 1 and warmup >= 2, got {steps} and {warmup}")
    order = ["allreduce", *[n for n in names if n != "allreduce"]]
    g = torch.Generator().manual_seed(1000 + comm.rank)
    x, y = torch.randn(batch, 32, generator=g), torch.randn(batch, 1, generator=g)
    rows: list[Row] = []
    for mb in bucket_mbs:
        anchor, anchor_buckets = None, 0
        for name in order:
            if name == "powerSGD" and anchor_buckets > 1:
                if comm.rank == 0 and skipped is not None:
                    skipped(name, mb, f"{anchor_buckets} buckets: over gloo its callbacks' "
                                      "allreduces deadlock with the next bucket's")
                continue
            torch.manual_seed(0)
            model = DistributedDataParallel(mlp(width, depth), bucket_cap_mb=mb)
            state, hook = HOOKS[name](comm)
            buckets = [0]

            # DDP reads the hook's signature: ``bucket`` must be called so, unannotated here
            # (this module's annotations are strings). The wrapper costs every hook one call.
            def counting(s, bucket, hook=hook, buckets=buckets):  # noqa: ANN001, ANN202
                buckets[0] = max(buckets[0], bucket.index() + 1)
                return hook(s, bucket)

            model.register_comm_hook(state, counting)
            opt = torch.optim.SGD(model.parameters(), lr=1e-3)

            def step(model=model, opt=opt) -> None:
                opt.zero_grad()
                torch.nn.functional.mse_loss(model(x), y).backward()
                opt.step()

            for _ in range(warmup):
                step()
            timing = registry.combine(comm, registry.time_calls(comm, step, steps))
            if hasattr(state, "close"):  # a bitcomm state: stop its exchange thread
                state.close()
            low, median, high = (t * 1e3 for t in timing.spread)
            if anchor is None:
                anchor, anchor_buckets = median, buckets[0]
            row = Row(name, mb, buckets[0], sum(p.numel() for p in model.parameters()),
                      comm.size, median, low, high, median / anchor)
            rows.append(row)
            if comm.rank == 0 and progress is not None:
                progress(row)
    return rows if comm.rank == 0 else None

