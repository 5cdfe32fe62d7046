"""The train-digits experiment: every compressed method trains a small MLP on real data.

scikit-learn's bundled digits (1797 8x8 images, 10 classes, no download) are split into train and
test sets by a fixed seed and standardised with the training set's statistics. ``workers``
data-parallel ranks each draw their own mini-batches (seeded by step and rank) and train the same
MLP (64-64-10, tanh) from the same initial weights with each method; every rank ends with the
same parameters (the collectives are bit-identical), so rank 0 evaluates. Per method the
experiment records test accuracy every ``eval_every`` steps, the payload bytes each worker sent
per step (the transport's counters), the compression ratio against the fp32 allreduce's direct
exchange (``4 * params * (N - 1)``, what ``collectives.allreduce`` counts), and wall time.

Run: ``bitcomm run experiment train-digits`` (experiments/train-digits.yaml), over MPI
(``mpiexec``) and torch.distributed gloo, one launch per transport. This module is also the rank
program: ``python -m bitcomm.train.digits --transport mpi|gloo ...``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from collections.abc import Callable

import numpy as np
import torch

from bitcomm.collectives import allreduce
from bitcomm.comm.base import Comm
from bitcomm.comm.launch import TRANSPORTS, commands, run_job, world
from bitcomm.train.onebit_adam import OneBitAdam
from bitcomm.train.qsgd_sgd import QSGDSGD
from bitcomm.train.rgc import RGC
from bitcomm.train.signum import MajoritySignSGD

__all__ = ["METHODS", "BASELINES", "DenseAllreduce", "TrainConfig", "load_digits_split", "train",
           "load_config", "launch", "summarise", "write_report"]


class DenseAllreduce:
    """A torch optimizer whose step first averages the gradients by one fp32 allreduce."""

    def __init__(self, inner: torch.optim.Optimizer, comm: Comm):
        self.inner, self.comm = inner, comm

    def zero_grad(self) -> None:
        """Clear the gradients."""
        self.inner.zero_grad()

    @torch.no_grad()
    def step(self) -> None:
        """Average every gradient over the workers, then step the inner optimizer."""
        params = [p for g in self.inner.param_groups for p in g["params"]]
        flat = torch.cat([p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel())
                          for p in params])
        flat = allreduce(self.comm, flat, check=False).div_(self.comm.size)
        at = 0
        for p in params:
            p.grad = flat[at:at + p.numel()].view_as(p).clone()
            at += p.numel()
        self.inner.step()


Factory = Callable[[list, Comm], object]
METHODS: dict[str, Factory] = {
    "dense-sgd": lambda ps, c: DenseAllreduce(torch.optim.SGD(ps, lr=0.05, momentum=0.9), c),
    "dense-adam": lambda ps, c: DenseAllreduce(torch.optim.Adam(ps, lr=0.003), c),
    "signum-ring": lambda ps, c: MajoritySignSGD(ps, c, lr=0.002, momentum=0.9, check=False),
    "onebit-adam": lambda ps, c: OneBitAdam(ps, c, lr=0.003, freeze_step=100, check=False),
    "rgc-topk": lambda ps, c: RGC(ps, c, lr=0.05, momentum=0.9, density=0.05,
                                  compress_threshold=1000, check=False),
    "rgc-topk-mean": lambda ps, c: RGC(ps, c, lr=0.05, momentum=0.9, density=0.05,
                                       compress_threshold=1000, quantize=True, check=False),
    "qsgd-4bit": lambda ps, c: QSGDSGD(ps, c, lr=0.05, momentum=0.9, bits=4, bucket=512,
                                       error_feedback=True, check=False),
}
"""Methods by name, each ``factory(params, comm)`` with the hyper-parameters the experiment uses
(chosen once for the dense baselines and reused by the compressed method of the same family)."""
BASELINES = {"signum-ring": "dense-sgd", "onebit-adam": "dense-adam", "rgc-topk": "dense-sgd",
             "rgc-topk-mean": "dense-sgd", "qsgd-4bit": "dense-sgd"}
"""The dense counterpart each compressed method's accuracy is compared with."""


@dataclasses.dataclass
class TrainConfig:
    """What one train-digits run does (experiments/train-digits.yaml)."""

    methods: list[str] = dataclasses.field(default_factory=lambda: list(METHODS))
    steps: int = 300
    batch: int = 32
    eval_every: int = 25
    seed: int = 0
    workers: int = 4
    transports: list[str] = dataclasses.field(default_factory=lambda: list(TRANSPORTS))
    name: str = "train-digits"
    description: str = ""


def load_config(path: str | os.PathLike) -> TrainConfig:
    """Load and check a ``kind: train`` experiment file."""
    import yaml

    data = yaml.safe_load(open(path).read())
    if not isinstance(data, dict) or data.get("kind") != "train":
        raise ValueError(f"{path}: expected a mapping with kind: train")
    data = {k: v for k, v in data.items() if k != "kind"}
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    extra = sorted(set(data) - fields)
    if extra:
        raise ValueError(f"{path}: unknown keys {extra}; expected some of {sorted(fields)}")
    cfg = TrainConfig(**data)
    bad = [m for m in cfg.methods if m not in METHODS]
    if bad:
        raise ValueError(f"{path}: unknown methods {bad}; expected some of {sorted(METHODS)}")
    bad = [t for t in cfg.transports if t not in TRANSPORTS]
    if bad:
        raise ValueError(f"{path}: unknown transports {bad}; expected mpi and/or gloo")
    for key in ("steps", "batch", "eval_every", "workers"):
        value = getattr(cfg, key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{path}: expected {key} to be an int >= 1, got {value!r}")
    return cfg


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


def _model(seed: int) -> torch.nn.Module:
    # Initialised from its own generator (torch's default init range), not the global RNG, so
    # ranks that are threads of one process get the same weights too.
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 10))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in (model[0], model[2]):
            bound = 1 / layer.in_features ** 0.5
            for p in (layer.weight, layer.bias):
                p.copy_(torch.rand(p.shape, generator=g) * 2 * bound - bound)
    return model


def _accuracy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean())


def train(comm: Comm, method: str, cfg: TrainConfig,
          data: tuple[torch.Tensor, ...]) -> dict:
    """Train with ``method`` on this rank; return its curve, bytes per step and time."""
    if method not in METHODS:
        raise ValueError(f"expected a method in {sorted(METHODS)}, got {method!r}")
    xtr, ytr, xte, yte = data
    model = _model(cfg.seed)
    params = list(model.parameters())
    opt = METHODS[method](params, comm)
    comm.counters.reset()
    curve = []
    t0 = time.perf_counter()
    for step in range(cfg.steps):
        g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step * comm.size + comm.rank)
        idx = torch.randint(0, xtr.shape[0], (cfg.batch,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(xtr[idx]), ytr[idx]).backward()
        opt.step()
        if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
            curve.append((step + 1, _accuracy(model, xte, yte)))
    seconds = time.perf_counter() - t0
    nparams = sum(p.numel() for p in params)
    per_step = comm.counters.total_sent / cfg.steps
    dense = 4 * nparams * (comm.size - 1)
    digest = float(sum(p.detach().double().sum() for p in params))
    return {"method": method, "workers": comm.size, "steps": cfg.steps, "curve": curve,
            "accuracy": curve[-1][1], "bytes_per_step": per_step,
            "compression": dense / per_step if per_step else float("inf"),
            "seconds": seconds, "params": nparams, "digest": digest}


def launch(cfg: TrainConfig, transport: str, progress: Callable[[str], None] = print,
           timeout: float = 3600) -> list[dict]:
    """Run every method of ``cfg`` on ``cfg.workers`` processes over ``transport``; return rows."""
    import sys
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory(prefix="bitcomm-digits-") as tmp:
        out = Path(tmp) / "rows.json"
        args = [sys.executable, "-m", "bitcomm.train.digits", "--transport", transport,
                "--methods", ",".join(cfg.methods), "--steps", str(cfg.steps), "--batch",
                str(cfg.batch), "--eval-every", str(cfg.eval_every), "--seed", str(cfg.seed),
                "--out", str(out)]
        jobs = [(c, dict(e, OMP_NUM_THREADS="1"))
                for c, e in commands(cfg.workers, transport, args, tmp)]
        run_job(jobs, timeout=timeout, what=f"the {transport} training job", progress=progress)
        return json.loads(out.read_text())


def summarise(rows: list[dict]) -> list[dict]:
    """Add to each row its dense counterpart's accuracy and the gap in points."""
    by = {(r["transport"], r["method"]): r for r in rows}
    for r in rows:
        base = by.get((r["transport"], BASELINES.get(r["method"], "")))
        r["baseline"] = base["method"] if base else None
        r["gap_points"] = 100 * (base["accuracy"] - r["accuracy"]) if base else None
    return rows


def write_report(rows: list[dict], config: dict, out: os.PathLike) -> list[str]:
    """Write results.json, results.csv, table.md and accuracy.png under ``out``; return paths."""
    import csv
    from pathlib import Path

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"config": config, "rows": rows}, indent=1))
    keys = ["transport", "method", "workers", "steps", "accuracy", "baseline", "gap_points",
            "bytes_per_step", "compression", "seconds", "identical_on_ranks"]
    with open(out / "results.csv", "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(keys)
        for r in rows:
            w.writerow([r[k] for k in keys])
    lines = ["| transport | method | test accuracy | vs dense (points) | bytes/step/worker | "
             "less than fp32 | wall s |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        gap = "" if r["gap_points"] is None else f"{-r['gap_points']:+.1f} ({r['baseline']})"
        lines.append(f"| {r['transport']} | {r['method']} | {r['accuracy']:.3f} | {gap} | "
                     f"{r['bytes_per_step']:.0f} | {r['compression']:.1f}x | "
                     f"{r['seconds']:.1f} |")
    table = "\n".join(lines) + "\n"
    (out / "table.md").write_text(table)
    transports = sorted({r["transport"] for r in rows})
    fig, axes = plt.subplots(1, len(transports), figsize=(6 * len(transports), 4), squeeze=False)
    for ax, t in zip(axes[0], transports, strict=True):
        for r in rows:
            if r["transport"] == t:
                steps, acc = zip(*r["curve"], strict=True)
                ax.plot(steps, acc, label=r["method"], marker=".")
        ax.set(title=f"digits, {rows[0]['workers']} workers, {t}", xlabel="step",
               ylabel="test accuracy", ylim=(0.5, 1.0))
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "accuracy.png", dpi=100)
    plt.close(fig)
    return [str(out / n) for n in ("results.json", "results.csv", "table.md", "accuracy.png")]


def main(argv: list[str] | None = None) -> None:
    """Rank program: train every method and have rank 0 write one JSON row per method."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--transport", choices=TRANSPORTS, required=True)
    ap.add_argument("--methods", required=True)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    cfg = TrainConfig(args.methods.split(","), args.steps, args.batch, args.eval_every, args.seed)
    comm = world(args.transport, timeout=120)
    data = load_digits_split(cfg.seed)
    rows = []
    for method in cfg.methods:
        row = train(comm, method, cfg, data)
        # the parameters must be identical on every rank: compare a digest
        every = [v[0] for v in comm.allgather_floats([row["digest"]])]
        row["identical_on_ranks"] = all(d == every[0] for d in every)
        row["transport"] = args.transport
        rows.append(row)
        if comm.rank == 0:
            print(f"  {args.transport} {method}: test accuracy {row['accuracy']:.3f}, "
                  f"{row['bytes_per_step']:.0f} B/step/worker "
                  f"({row['compression']:.1f}x less than fp32), {row['seconds']:.1f} s",
                  flush=True)
    if comm.rank == 0:
        with open(args.out, "w") as fh:
            json.dump(rows, fh)
    comm.barrier()


if __name__ == "__main__":
    main()
