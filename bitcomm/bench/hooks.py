"""DDP hook benchmark: the time of a training step with each communication hook.

Run on every rank of a launched torch.distributed job (``bitcomm bench hooks`` launches gloo
processes). For each bucket size, a DistributedDataParallel MLP trains on fixed random batches
with each hook in turn: PyTorch's ``allreduce_hook`` (the anchor; ``allreduce/blocking`` waits
for its allreduce inside the hook, PyTorch without overlap), ``fp16_compress_hook`` and
``powerSGD_hook`` (matrix rank 1, compressing from the second step), and bitcomm's four hooks,
each both overlapped (the default: the exchange runs on the state's thread during backward) and
blocking (``overlap=False``). A step is ``zero_grad``, forward, backward and ``SGD.step``; each
is timed by :func:`bitcomm.collectives.registry.time_calls` after ``warmup`` untimed steps (DDP
rebuilds its buckets after the first), a step's time is its slowest rank's, and a row reports
the median step, its min and max, and the ratio to ``allreduce_hook`` at the same bucket size
in the same run (these machines are shared: compare ratios, not times across runs).

Overlap is told apart from the rest by two more figures. ``local`` is the same step under
DDP's ``no_sync()``: forward, backward and the optimizer with no exchange at all, the time no
hook can beat. A blocking hook's exchange then costs about ``blocking - local``, and an
overlapped hook can hide at most ``min(backward, exchange)`` of it; :func:`overlap` reports, per
hook with both forms, how much of the exchange the overlapped form hid. With ``repeats`` above
1 each bucket size measures every hook ``repeats`` times, in an order shuffled anew for each
repeat (the same on every rank), so a slow spell of a shared machine or a warm cache does not
always favour the hook that runs next to it; a row pools the steps of all its repeats.

``powerSGD_hook`` is measured only where the model makes one bucket: over gloo, with several
buckets, its future callbacks issue their allreduces from gloo's thread while the autograd
thread issues the next bucket's, in an order that differs between ranks, and the job hangs
(PyTorch 2.13, 2 ranks). The anchor's bucket count decides, and the skip is reported.
"""

from __future__ import annotations

import dataclasses
import random
import statistics
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.futures import Future
from torch.nn.parallel import DistributedDataParallel

from bitcomm.collectives import registry
from bitcomm.comm.base import Comm
from bitcomm.train import hooks

__all__ = ["HOOKS", "LOCAL", "Row", "Overlap", "run", "mlp", "order", "overlap"]


def _torch(hook: Callable, state: Callable[[Comm], object]) -> Callable:
    return lambda comm: (state(comm), hook)


def _ours(hook: Callable, kind: type, **options: object) -> Callable:
    return lambda comm: (kind(comm, **options), hook)


def _allreduce_blocking(process_group, bucket):  # noqa: ANN001, ANN202 - DDP's hook signature
    """``allreduce_hook`` waiting for its allreduce inside the hook: PyTorch without overlap."""
    group = process_group if process_group is not None else dist.group.WORLD
    t = bucket.buffer().div_(dist.get_world_size(group))
    dist.all_reduce(t, group=group)
    fut: Future = Future()
    fut.set_result(t)
    return fut


HOOKS: dict[str, Callable[[Comm], tuple[object, Callable]]] = {
    "allreduce": _torch(default_hooks.allreduce_hook, lambda comm: None),
    "allreduce/blocking": _torch(_allreduce_blocking, lambda comm: None),
    "fp16_compress": _torch(default_hooks.fp16_compress_hook, lambda comm: None),
    "powerSGD": _torch(powerSGD_hook.powerSGD_hook, lambda comm: powerSGD_hook.PowerSGDState(
        None, matrix_approximation_rank=1, start_powerSGD_iter=2)),
    "sign": _ours(hooks.sign_majority_hook, hooks.SignState),
    "sign/blocking": _ours(hooks.sign_majority_hook, hooks.SignState, overlap=False),
    "sign/ring": _ours(hooks.sign_majority_hook, hooks.SignState, collective="ring"),
    "onebit": _ours(hooks.onebit_hook, hooks.OneBitHookState),
    "onebit/blocking": _ours(hooks.onebit_hook, hooks.OneBitHookState, overlap=False),
    "onebit/alltoall": _ours(hooks.onebit_hook, hooks.OneBitHookState, collective="alltoall"),
    "qsgd": _ours(hooks.qsgd_hook, hooks.QsgdState),
    "qsgd/blocking": _ours(hooks.qsgd_hook, hooks.QsgdState, overlap=False),
    "topk": _ours(hooks.topk_hook, hooks.TopkState),
    "topk/blocking": _ours(hooks.topk_hook, hooks.TopkState, overlap=False),
}
"""Hook name -> ``make(comm) -> (state, hook)``; ``allreduce`` is the anchor of the ratios."""

LOCAL = "local"
"""The row of the step without any exchange (DDP's ``no_sync``), measured beside the anchor."""


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
    steps: int  # timed steps pooled over the repeats

    def as_dict(self) -> dict:
        """Return the row as a JSON-friendly dict."""
        return dataclasses.asdict(self)


def mlp(width: int, depth: int, inputs: int = 32) -> torch.nn.Module:
    """Return the benchmark's model: ``depth`` Linear+Tanh layers of ``width``, then 1 output."""
    layers: list[torch.nn.Module] = []
    for i in range(depth):
        layers += [torch.nn.Linear(inputs if i == 0 else width, width), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(width if depth else inputs, 1))


def order(names: tuple[str, ...], repeat: int, seed: int = 0) -> list[str]:
    """Return the order in which repeat ``repeat`` measures ``names``.

    Repeat 0 keeps the given order; later ones shuffle it with a generator seeded by ``seed``
    and ``repeat`` only, so every rank measures the same hook at the same time.
    """
    out = list(names)
    if repeat:
        random.Random(seed * 1_000_003 + repeat).shuffle(out)
    return out


@dataclasses.dataclass
class Overlap:
    """How much of an exchange the overlapped form of a hook hid, at one bucket size.

    ``exchange_ms`` is the blocking step less the ``local`` step (the exchange, done after
    backward); ``hidden_ms`` the blocking step less the overlapped one; ``hidden_share`` their
    ratio (1: all of the exchange hidden; 0 or below: nothing, or the thread cost more than it
    hid); ``bound_share`` is ``min(local, exchange) / exchange``, a loose upper bound on it (the
    most overlap could hide is backward's time, and ``local`` also holds forward and the
    optimizer step).
    """

    hook: str
    bucket_mb: float
    local_ms: float
    exchange_ms: float
    hidden_ms: float
    hidden_share: float
    bound_share: float

    def as_dict(self) -> dict:
        """Return the row as a JSON-friendly dict."""
        return dataclasses.asdict(self)


def overlap(rows: list[Row]) -> list[Overlap]:
    """Return an :class:`Overlap` for each hook measured both overlapped and ``/blocking``.

    Needs the ``local`` row at the same bucket size; sizes where the blocking step is not
    slower than the local one (no exchange to hide) are left out.
    """
    by = {(r.hook, r.bucket_mb): r for r in rows}
    out = []
    for r in rows:
        blocking, local = by.get((r.hook + "/blocking", r.bucket_mb)), by.get((LOCAL, r.bucket_mb))
        if blocking is None or local is None or r.hook.endswith("/blocking"):
            continue
        exchange = blocking.step_ms - local.step_ms
        if exchange <= 0:
            continue
        hidden = blocking.step_ms - r.step_ms
        out.append(Overlap(r.hook, r.bucket_mb, local.step_ms, exchange, hidden,
                           hidden / exchange, min(local.step_ms, exchange) / exchange))
    return out


def run(comm: Comm, bucket_mbs: tuple[float, ...] = (0.004, 0.25, 1.0), *, width: int = 128,
        depth: int = 8, batch: int = 64, steps: int = 30, warmup: int = 5, repeats: int = 1,
        seed: int = 0, names: tuple[str, ...] = tuple(HOOKS),
        progress: Callable[[Row], None] | None = None,
        skipped: Callable[[str, float, str], None] | None = None,
        hook_comm: Comm | None = None,
        device: torch.device | str = "cpu") -> list[Row] | None:
    """Time a DDP training step with each hook in ``names`` at each bucket size.

    Args:
        comm: a bitcomm transport over torch.distributed's default group (the hooks' and the
            timing loop's); every rank calls this with the same arguments.
        bucket_mbs: DDP's ``bucket_cap_mb`` values.
        width: hidden width of the model (:func:`mlp`).
        depth: its hidden layers.
        batch: samples per step and rank.
        steps: timed steps per hook, bucket size and repeat.
        warmup: untimed steps first (at least 2: DDP rebuilds its buckets after the first).
        repeats: measurements of each hook per bucket size, in an order shuffled per repeat
            (:func:`order`); a row pools their steps.
        seed: seed of the shuffles.
        names: keys of :data:`HOOKS`; ``"allreduce"`` (the anchor) and :data:`LOCAL` are
            always measured.
        progress: called on rank 0 with each row as soon as all its repeats are measured.
        skipped: called on rank 0 with (hook, bucket_mb, reason) for each hook not measured.
        hook_comm: the bitcomm hooks' transport (default ``comm``; with NCCL a group of its
            own, so the exchange thread and the timing loop never share a communicator).
        device: where the model and batches live (a CUDA device for NCCL: each step then
            ends with ``torch.cuda.synchronize()``, so its time holds the GPU's work).

    Returns:
        the rows on rank 0, None elsewhere.

    """
    unknown = [n for n in names if n not in HOOKS]
    if unknown:
        raise ValueError(f"expected hooks from {list(HOOKS)}, got {unknown}")
    if steps < 1 or warmup < 2 or repeats < 1:
        raise ValueError(f"expected steps >= 1, warmup >= 2 and repeats >= 1, got {steps}, "
                         f"{warmup} and {repeats}")
    chosen = ["allreduce", LOCAL, *[n for n in names if n != "allreduce"]]
    g = torch.Generator().manual_seed(1000 + comm.rank)
    x, y = torch.randn(batch, 32, generator=g), torch.randn(batch, 1, generator=g)
    device = torch.device(device)
    x, y = x.to(device), y.to(device)
    hooked = comm if hook_comm is None else hook_comm
    rows: list[Row] = []
    for mb in bucket_mbs:
        # The anchor's bucket count decides powerSGD's skip, so the anchor goes first once.
        first = _measure(comm, hooked, "allreduce", mb, x, y, width, depth, steps, warmup)
        buckets = first[1]
        todo = [n for n in chosen if not (n == "powerSGD" and buckets > 1)]
        if len(todo) < len(chosen) and comm.rank == 0 and skipped is not None:
            skipped("powerSGD", mb, f"{buckets} buckets: over gloo its callbacks' allreduces "
                                    "deadlock with the next bucket's")
        times: dict[str, list[float]] = {n: [] for n in todo}
        counts: dict[str, int] = {}
        params = first[2]
        times["allreduce"] += first[0]
        counts["allreduce"] = buckets
        for r in range(repeats):
            for name in order(tuple(todo), r, seed):
                if r == 0 and name == "allreduce":
                    continue
                seconds, counts[name], _ = _measure(comm, hooked, name, mb, x, y, width, depth,
                                                    steps, warmup)
                times[name] += seconds
        anchor = statistics.median(times["allreduce"]) * 1e3
        for name in todo:
            ms = [t * 1e3 for t in times[name]]
            median = statistics.median(ms)
            row = Row(name, mb, counts[name], params, comm.size, median, min(ms), max(ms),
                      median / anchor, len(ms))
            rows.append(row)
            if comm.rank == 0 and progress is not None:
                progress(row)
    return rows if comm.rank == 0 else None


def _measure(comm: Comm, hooked: Comm, name: str, mb: float, x: torch.Tensor,
             y: torch.Tensor, width: int, depth: int, steps: int, warmup: int
             ) -> tuple[list[float], int, int]:
    """Return (seconds per step on the slowest rank, buckets, parameters) of one hook."""
    torch.manual_seed(0)
    cuda = x.device.type == "cuda"
    model = DistributedDataParallel(mlp(width, depth).to(x.device), bucket_cap_mb=mb,
                                    device_ids=[x.device.index] if cuda else None)
    buckets = [0]
    state = None
    if name != LOCAL:
        state, hook = HOOKS[name](hooked)

        # DDP reads the hook's signature: ``bucket`` must be called so, unannotated here
        # (this module's annotations are strings). The wrapper costs every hook one call.
        def counting(s, bucket, hook=hook):  # noqa: ANN001, ANN202
            buckets[0] = max(buckets[0], bucket.index() + 1)
            return hook(s, bucket)

        model.register_comm_hook(state, counting)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step() -> None:
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        if cuda:
            torch.cuda.synchronize()

    def unsynced() -> None:
        with model.no_sync():
            step()

    fn = unsynced if name == LOCAL else step
    for _ in range(warmup):
        fn()
    timing = registry.combine(comm, registry.time_calls(comm, fn, steps))
    if hasattr(state, "close"):  # a bitcomm state: stop its exchange thread
        state.close()
    return timing.seconds, buckets[0], sum(p.numel() for p in model.parameters())
