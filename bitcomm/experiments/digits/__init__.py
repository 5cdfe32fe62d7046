"""The train-digits experiment: every compressed method trains a small MLP on real data.

scikit-learn's bundled digits (1797 8x8 images, 10 classes, no download) are split into train and
test sets by a fixed seed and standardised with the training set's statistics. ``workers``
data-parallel ranks each draw their own mini-batches (seeded by step and rank) and train the same
MLP (64-64-10, tanh) from the same initial weights with each method; every rank ends with the
same parameters (the collectives are bit-identical), so rank 0 evaluates. Per method the
experiment records test accuracy every ``eval_every`` steps, the payload bytes each worker sent
per step (the transport's counters), the compression ratio against the fp32 allreduce's direct
exchange (``4 * params * (N - 1)``, what ``collectives.allreduce`` counts), and wall time.

Run: ``bitcomm run experiment train-digits`` (``bitcomm/configs/experiments/train-digits.yaml``),
over MPI (``mpiexec``) and torch.distributed gloo, one launch per transport. Split into
:mod:`~bitcomm.experiments.digits.config` (methods, baselines, the file),
:mod:`~bitcomm.experiments.digits.run` (data, model, training, launch, the rank program) and
:mod:`~bitcomm.experiments.digits.report` (summary, files, plot).
"""

from bitcomm.experiments.digits.config import (
    BASELINES,
    METHODS,
    DenseAllreduce,
    TrainConfig,
    config_from,
    load_config,
)
from bitcomm.experiments.digits.report import summarise, write_report
from bitcomm.experiments.digits.run import launch, load_digits_split, requirements, train

__all__ = ["METHODS", "BASELINES", "DenseAllreduce", "TrainConfig", "load_config", "config_from",
           "load_digits_split", "requirements", "train", "launch", "summarise", "write_report"]
