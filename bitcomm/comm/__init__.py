"""Transports: move uint8 tensors between ranks and count the bytes, per peer, in one place.

* :class:`~bitcomm.comm.base.Comm`: the interface collectives are written against (send,
  isend, recv, sendrecv, alltoallv, allgatherv, allreduce, barrier, rank, size, counters).
* :class:`~bitcomm.comm.local.LocalComm` / :func:`~bitcomm.comm.local.run_local`: ranks as
  threads in one process.
* :class:`~bitcomm.comm.mpi.MPIComm`: mpi4py (import ``bitcomm.comm.mpi``; needs the ``mpi``
  extra).
* :class:`~bitcomm.comm.torchdist.TorchComm`: torch.distributed, gloo or NCCL.
* :mod:`~bitcomm.comm.launch`: start an N-rank job (mpiexec or gloo processes) and build each
  rank's Comm in it.
"""

from bitcomm.comm.base import Comm, Counters, Request
from bitcomm.comm.local import LocalComm, LocalGroup, run_local

__all__ = ["Comm", "Counters", "LocalComm", "LocalGroup", "Request", "run_local"]
