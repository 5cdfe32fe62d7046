"""Collectives written once against :class:`bitcomm.comm.base.Comm`.

* :func:`ring_majority` / :func:`alltoall_majority` / :func:`allgather_majority`: majority
  vote of signs (All-Reducible signSGD), ring with ceil(log2(i+1))-bit counts, 1-bit Adam's
  all-to-all, or one allgather of every rank's signs (one round: small tensors); the
  ``*_packed`` variants return the decisions as packed sign bits.
* :func:`onebit_allreduce`: DeepSpeed's 1-bit Adam compressed allreduce with error feedback.
* :func:`sparse_allgather`: RedSync / SparCML quantised sparse exchange.
* :func:`qsgd_allgather`: every rank's whole tensor as one QSGD frame, averaged (SparCML).
* :func:`ssar_recursive_double`, :func:`ssar_split_allgather`, :func:`dsar_split_allgather`:
  SparCML's sparse allreduces, the exact sum of every rank's sparse vector.
* :func:`oktopk_allreduce`: Ok-Topk's O(k) sparse allreduce, ``Topk(sum Topk)`` with reused
  thresholds and balanced regions (state in an :class:`OkTopkState`).
* :func:`allreduce`: the dense float32 baseline.

Each documents the bytes a rank sends and has a ``*_bytes`` function computing it; the
transport's counters equal it exactly. Each agrees on its call first (with ``check=True``):
:class:`NonFiniteError` (a ``ValueError``) on every rank when any rank's input is not finite,
and :func:`agree_on` extends the agreement to a caller's own value.
"""

from bitcomm.collectives._common import NonFiniteError, agree_on
from bitcomm.collectives.dense import allreduce, allreduce_bytes
from bitcomm.collectives.majority import (
    allgather_majority,
    allgather_majority_bytes,
    allgather_majority_packed,
    alltoall_majority,
    alltoall_majority_bytes,
    alltoall_majority_packed,
    ring_majority,
    ring_majority_bytes,
    ring_majority_packed,
)
from bitcomm.collectives.oktopk import OkTopkState, oktopk_allreduce, oktopk_allreduce_bytes
from bitcomm.collectives.onebit import (
    OneBitState,
    onebit_allreduce,
    onebit_allreduce_bytes,
    padded_length,
)
from bitcomm.collectives.quantized import qsgd_allgather, qsgd_allgather_bytes
from bitcomm.collectives.sparcml import (
    dsar_split_allgather,
    dsar_split_allgather_bytes,
    ssar_recursive_double,
    ssar_recursive_double_bytes,
    ssar_split_allgather,
    ssar_split_allgather_bytes,
)
from bitcomm.collectives.sparse import sparse_allgather, sparse_allgather_bytes

__all__ = [
    "NonFiniteError",
    "agree_on",
    "allreduce",
    "allreduce_bytes",
    "allgather_majority",
    "allgather_majority_bytes",
    "allgather_majority_packed",
    "alltoall_majority",
    "alltoall_majority_bytes",
    "alltoall_majority_packed",
    "ring_majority",
    "ring_majority_bytes",
    "ring_majority_packed",
    "OkTopkState",
    "oktopk_allreduce",
    "oktopk_allreduce_bytes",
    "OneBitState",
    "onebit_allreduce",
    "onebit_allreduce_bytes",
    "padded_length",
    "qsgd_allgather",
    "qsgd_allgather_bytes",
    "sparse_allgather",
    "sparse_allgather_bytes",
    "ssar_recursive_double",
    "ssar_recursive_double_bytes",
    "ssar_split_allgather",
    "ssar_split_allgather_bytes",
    "dsar_split_allgather",
    "dsar_split_allgather_bytes",
]
