"""train-digits runs: the data, the model, one rank's training, the launch of a job.

:func:`main` is the rank program (``python -m bitcomm.experiments.digits --transport mpi|gloo
...``).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from bitcomm.comm.base import Comm
from bitcomm.comm.launch import CPU_TRANSPORTS, commands, job_dir, run_job, world
from bitcomm.experiments.digits.config import METHODS, TrainConfig
from bitcomm.experiments.digits.results import MethodResult

__all__ = ["load_digits_split", "requirements", "train", "launch", "main", "recorded_gradients"]


def requirements() -> list[str]:
    """Return what this experiment needs and this environment lacks (the experiments extra)."""
    missing = []
    for module, package in (("sklearn", "scikit-learn"), ("matplotlib", "matplotlib")):
        try:
            __import__(module)
        except ImportError:
            missing.append(package)
    return missing


def load_digits_split(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Return ``(x_train, y_train, x_test, y_test)``: a 75/25 stratified split, standardised."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    data = load_digits()
    xtr, xte, ytr, yte = train_test_split(data.data.astype(np.float32), data.target,
                                          test_size=0.25, random_state=seed,
                                          stratify=data.target)
    mean, std = xtr.mean(0), xtr.std(0) + 1e-6
    return (torch.from_numpy((xtr - mean) / std), torch.from_numpy(ytr).long(),
            torch.from_numpy((xte - mean) / std), torch.from_numpy(yte).long())


def _model(seed: int, hidden: int = 64) -> torch.nn.Module:
    # Initialised from its own generator (torch's default init range), not the global RNG, so
    # ranks that are threads of one process get the same weights too.
    model = torch.nn.Sequential(torch.nn.Linear(64, hidden), torch.nn.Tanh(),
                                torch.nn.Linear(hidden, 10))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in (model[0], model[2]):
            bound = 1 / layer.in_features ** 0.5
            for p in (layer.weight, layer.bias):
                p.copy_(torch.rand(p.shape, generator=g) * 2 * bound - bound)
    return model


def recorded_gradients(points: Sequence[tuple[int, int]], *, hidden: int = 1024,
                       seed: int = 0) -> list[torch.Tensor]:
    """Return real gradients of the digits MLP, flattened, for benchmarks of sparsifiers.

    One worker trains the MLP by dense SGD (lr 0.05, momentum 0.9, 32 samples a step, the
    batch of step ``s`` drawn with seed ``s``). For each ``(step, batch)`` the gradient is taken
    at the weights before update ``step``, on the 32 samples drawn with seed ``batch``: the
    same batch seed as the step gives the training run's own gradient, another seed what a
    second worker would see at the same weights.
    """
    return list(_recorded(tuple(points), hidden, seed))


@functools.lru_cache(maxsize=4)
def _recorded(points: tuple[tuple[int, int], ...], hidden: int, seed: int
              ) -> tuple[torch.Tensor, ...]:
    xtr, ytr, _, _ = load_digits_split(seed)
    model = _model(seed, hidden)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    def grad(batch: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(batch)
        idx = torch.randint(0, xtr.shape[0], (32,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(xtr[idx]), ytr[idx]).backward()
        return torch.cat([p.grad.reshape(-1) for p in model.parameters()]).clone()

    out: dict[tuple[int, int], torch.Tensor] = {}
    for step in range(max((s for s, _ in points), default=-1) + 1):
        for point in points:
            if point[0] == step:
                out[point] = grad(point[1])
        grad(step)
        opt.step()
    return tuple(out[p] for p in points)


def _accuracy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean())


def train(comm: Comm, method: str, cfg: TrainConfig,
          data: tuple[torch.Tensor, ...]) -> MethodResult:
    """Train with ``method`` on this rank; return its curve, bytes per step and time."""
    if method not in METHODS:
        raise ValueError(f"expected a method in {sorted(METHODS)}, got {method!r}")
    xtr, ytr, xte, yte = data
    model = _model(cfg.seed, cfg.hidden)
    params = list(model.parameters())
    opt = METHODS[method](params, comm)
    comm.counters.reset()
    curve = []
    ratios = []
    t0 = time.perf_counter()
    for step in range(cfg.steps):
        g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step * comm.size + comm.rank)
        idx = torch.randint(0, xtr.shape[0], (cfg.batch,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(xtr[idx]), ytr[idx]).backward()
        opt.step()
        selection = getattr(opt, "selection", None)
        if selection is not None and selection[1]:
            ratios.append(selection[0] / selection[1])
        if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
            curve.append((step + 1, _accuracy(model, xte, yte)))
    seconds = time.perf_counter() - t0
    nparams = sum(p.numel() for p in params)
    per_step = comm.counters.total_sent / cfg.steps
    dense = 4 * nparams * (comm.size - 1)
    digest = float(sum(p.detach().double().sum() for p in params))
    return MethodResult(transport="", method=method, workers=comm.size, steps=cfg.steps,
                        curve=curve, accuracy=curve[-1][1], bytes_per_step=per_step,
                        compression=dense / per_step if per_step else float("inf"),
                        seconds=seconds, params=nparams, digest=digest,
                        selected_ratio=sum(ratios) / len(ratios) if ratios else None,
                        selected_deviation=(sum(abs(r - 1) for r in ratios) / len(ratios)
                                            if ratios else None))


def launch(cfg: TrainConfig, transport: str, progress: Callable[[str], None] = print,
           timeout: float = 3600) -> list[MethodResult]:
    """Run every method of ``cfg`` on ``cfg.workers`` processes over ``transport``; return rows."""
    with job_dir("digits") as tmp:
        out = tmp / "rows.json"
        args = [sys.executable, "-m", "bitcomm.experiments.digits", "--transport", transport,
                "--methods", ",".join(cfg.methods), "--steps", str(cfg.steps), "--batch",
                str(cfg.batch), "--eval-every", str(cfg.eval_every), "--seed", str(cfg.seed),
                "--hidden", str(cfg.hidden), "--out", str(out)]
        jobs = [(c, dict(e, OMP_NUM_THREADS="1"))
                for c, e in commands(cfg.workers, transport, args, tmp)]
        run_job(jobs, timeout=timeout, what=f"the {transport} training job", progress=progress)
        return [MethodResult.from_dict(d) for d in json.loads(out.read_text())]


def main(argv: list[str] | None = None) -> None:
    """Rank program: train every method and have rank 0 write one JSON row per method."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--transport", choices=CPU_TRANSPORTS, required=True)
    ap.add_argument("--methods", required=True)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    cfg = TrainConfig(args.methods.split(","), args.steps, args.batch, args.eval_every, args.seed,
                      hidden=args.hidden)
    comm = world(args.transport, timeout=120)
    data = load_digits_split(cfg.seed)
    rows = []
    for method in cfg.methods:
        row = train(comm, method, cfg, data)
        # the parameters must be identical on every rank: compare a digest
        every = [v[0] for v in comm.allgather_floats([row.digest])]
        row.identical_on_ranks = all(d == every[0] for d in every)
        row.transport = args.transport
        rows.append(row)
        if comm.rank == 0:
            print(f"  {args.transport} {method}: test accuracy {row.accuracy:.3f}, "
                  f"{row.bytes_per_step:.0f} B/step/worker "
                  f"({row.compression:.1f}x less than fp32), {row.seconds:.1f} s",
                  flush=True)
    if comm.rank == 0:
        with open(args.out, "w") as fh:
            json.dump([r.as_dict() for r in rows], fh)
    comm.barrier()

