"""train-digits configuration: the methods compared, their dense baselines, the file format.

``METHODS`` maps a name to ``factory(params, comm)``, each with the hyper-parameters the experiment
uses (chosen once for the dense baselines and reused by the compressed method of the same
family); ``BASELINES`` names each compressed method's dense counterpart. A ``kind: train``
experiment file (``bitcomm/configs/experiments/train-digits.yaml``) is a :class:`TrainConfig`.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

import torch

from bitcomm import _names
from bitcomm.collectives import allreduce
from bitcomm.comm.base import Comm
from bitcomm.comm.launch import CPU_TRANSPORTS
from bitcomm.train.oktopk_sgd import OkTopkSGD
from bitcomm.train.onebit_adam import OneBitAdam
from bitcomm.train.qsgd_sgd import QSGDSGD
from bitcomm.train.rgc import RGC, SIDCoSGD
from bitcomm.train.signum import MajoritySignSGD
from bitcomm.train.sparcml_sgd import SparCMLSGD

__all__ = ["METHODS", "BASELINES", "DenseAllreduce", "TrainConfig", "load_config", "config_from"]


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
    # SparCML's CIFAR-10 setup: 16 of every 512 (3%); 4810 parameters give 151 entries per
    # worker, k >= 4P at 4 workers
    "sparcml-topk": lambda ps, c: SparCMLSGD(ps, c, lr=0.05, momentum=0.9, k=16, bucket=512,
                                             check=False),
    "sparcml-topk-4bit": lambda ps, c: SparCMLSGD(ps, c, lr=0.05, momentum=0.9, k=16,
                                                  bucket=512, bits=4, seed=0, check=False),
    # 1% of every parameter: Ok-Topk over one flat buffer, SIDCo per compressed layer
    "oktopk-sgd": lambda ps, c: OkTopkSGD(ps, c, lr=0.05, momentum=0.9, density=0.01,
                                          check=False),
    "sidco-sgd": lambda ps, c: SIDCoSGD(ps, c, lr=0.05, momentum=0.9, density=0.01,
                                        compress_threshold=1000, check=False),
    "sidco-e-sgd": lambda ps, c: SIDCoSGD(ps, c, lr=0.05, momentum=0.9, density=0.01,
                                          dist="sidco-e", compress_threshold=1000, check=False),
}
"""Methods by name, each ``factory(params, comm)`` with the hyper-parameters the experiment uses
(chosen once for the dense baselines and reused by the compressed method of the same family)."""
BASELINES = {"signum-ring": "dense-sgd", "onebit-adam": "dense-adam", "rgc-topk": "dense-sgd",
             "rgc-topk-mean": "dense-sgd", "qsgd-4bit": "dense-sgd",
             "sparcml-topk": "dense-sgd", "sparcml-topk-4bit": "dense-sgd",
             "oktopk-sgd": "dense-sgd", "sidco-sgd": "dense-sgd",
             "sidco-e-sgd": "dense-sgd"}
"""The dense counterpart each compressed method's accuracy is compared with."""


@dataclasses.dataclass
class TrainConfig:
    """What one train-digits run does (bitcomm/configs/experiments/train-digits.yaml)."""

    methods: list[str] = dataclasses.field(default_factory=lambda: list(METHODS))
    steps: int = 300
    batch: int = 32
    eval_every: int = 25
    seed: int = 0
    workers: int = 4
    hidden: int = 64
    transports: list[str] = dataclasses.field(default_factory=lambda: list(CPU_TRANSPORTS))
    name: str = "train-digits"
    description: str = ""


def load_config(path: str | os.PathLike) -> TrainConfig:
    """Load and check a ``kind: train`` experiment file."""
    import yaml

    with open(path) as fh:
        return config_from(yaml.safe_load(fh.read()), path)


def config_from(data: object, path: str | os.PathLike) -> TrainConfig:
    """Check a ``kind: train`` experiment file's parsed ``data`` (``path`` names it in errors)."""
    if not isinstance(data, dict) or data.get("kind") != "train":
        raise ValueError(f"{path}: expected a mapping with kind: train")
    data = {k: v for k, v in data.items() if k != "kind"}
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    extra = sorted(set(data) - fields)
    if extra:
        raise ValueError(f"{path}: unknown keys {extra}; expected some of {sorted(fields)}")
    cfg = TrainConfig(**data)
    _names.check(cfg.name, f"{path}: name")
    bad = [m for m in cfg.methods if m not in METHODS]
    if bad:
        raise ValueError(f"{path}: unknown methods {bad}; expected some of {sorted(METHODS)}")
    bad = [t for t in cfg.transports if t not in CPU_TRANSPORTS]
    if bad:
        raise ValueError(f"{path}: unknown transports {bad}; expected mpi and/or gloo")
    for key in ("steps", "batch", "eval_every", "workers", "hidden"):
        value = getattr(cfg, key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{path}: expected {key} to be an int >= 1, got {value!r}")
    return cfg
