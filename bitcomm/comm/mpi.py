"""MPI transport through mpi4py (MPICH from PyPI: ``pip install "bitcomm[mpi]"``).

Buffers travel as ``MPI.BYTE``. CPU tensors are handed to MPI without a copy (their numpy view);
CUDA tensors are staged through host memory (one copy for all of a call's buffers each way,
and back to the GPU from pinned memory, which does not wait for the device), unless
``cuda_aware=True`` says the MPI library reads device memory itself (it is then given the
tensor through DLPack). ``alltoallv`` and
``allgatherv`` use MPI's native ``Alltoallv``/``Allgatherv``; ``allreduce`` is ``MPI.SUM``.

MPI has no timeouts: launch with ``mpiexec -n N python -m mpi4py script.py`` so that an uncaught
exception on one rank aborts them all instead of leaving the others blocked.
"""

from __future__ import annotations

import numpy as np
import torch

from bitcomm.comm.base import Comm, Request, _copy_into, _joined, _moved, _parts

__all__ = ["MPIComm"]

_TAG = 0x6263  # "bc": keeps bitcomm's point-to-point traffic apart from the application's


class MPIComm(Comm):
    """A :class:`~bitcomm.comm.base.Comm` over an ``mpi4py`` communicator.

    Args:
        comm: an ``mpi4py.MPI.Comm``; ``MPI.COMM_WORLD`` by default.
        cuda_aware: the MPI library accepts CUDA buffers, so do not stage them through the host.
        poll_interval: when set (seconds), blocking waits post non-blocking operations and
            test them, sleeping between tests instead of MPI's busy polling: the sleep starts
            at 1/64 of ``poll_interval`` and doubles up to it, so a message that is nearly
            there is picked up quickly while a long wait costs few wake-ups. For more ranks
            than cores (emulated networks on a laptop): a waiting rank then leaves the CPU to
            the ranks that have work. ``None`` (default) keeps MPI's own waits.
        native: use MPI's own ``Alltoallv``/``Allgatherv`` (default). With ``False`` they run as
            :class:`~bitcomm.comm.base.Comm`'s pairwise rounds of ``Sendrecv``, a documented
            pattern (every rank sends straight to every other) that the network model of
            :mod:`bitcomm.netem.model` predicts byte for byte; MPICH's native allgather may
            instead forward data around a ring for large messages.

    """

    def __init__(self, comm=None, *, cuda_aware: bool = False,  # noqa: ANN001 - mpi4py type
                 native: bool = True, poll_interval: float | None = None):
        from mpi4py import MPI  # optional dependency: imported only when MPI is used

        if poll_interval is not None and not poll_interval >= 0:
            raise ValueError(f"expected poll_interval >= 0 seconds or None, got {poll_interval}")
        self._MPI = MPI
        self.mpi = MPI.COMM_WORLD if comm is None else comm
        self.cuda_aware = cuda_aware
        self.poll_interval = poll_interval
        super().__init__(self.mpi.Get_rank(), self.mpi.Get_size())
        if not native:  # fall back to the base class's pairwise rounds
            self._alltoallv = super()._alltoallv  # type: ignore[method-assign]
            self._allgatherv = super()._allgatherv  # type: ignore[method-assign]

    def _out(self, buf: torch.Tensor):  # noqa: ANN202 - a buffer spec for mpi4py
        if buf.device.type == "cpu":
            return [buf.numpy(), self._MPI.BYTE]
        if self.cuda_aware:
            return [buf, self._MPI.BYTE]
        return [buf.cpu().numpy(), self._MPI.BYTE]

    def _into(self, out: torch.Tensor) -> tuple[object, torch.Tensor | None]:
        # (buffer spec to receive into, host staging tensor to copy back from or None)
        if out.device.type == "cpu" or self.cuda_aware:
            return ([out.numpy() if out.device.type == "cpu" else out, self._MPI.BYTE], None)
        host = torch.empty(out.numel(), dtype=torch.uint8)
        return [host.numpy(), self._MPI.BYTE], host

    def _wait(self, requests: list) -> list:
        """Complete ``requests`` by test-and-sleep (see ``poll_interval``); return statuses."""
        import time

        statuses = [self._MPI.Status() for _ in requests]
        nap = self.poll_interval / 64
        while not self._MPI.Request.Testall(requests, statuses):
            time.sleep(nap)
            nap = min(2 * nap, self.poll_interval)
        return statuses

    def _check_count(self, status, out: torch.Tensor, source: int) -> None:  # noqa: ANN001
        got = status.Get_count(self._MPI.BYTE)
        if got != out.numel():
            raise ValueError(f"rank {self.rank} expected {out.numel()} bytes from rank {source}, "
                             f"got {got}")

    def _send(self, buf: torch.Tensor, dest: int) -> None:
        if self.poll_interval is None:
            self.mpi.Send(self._out(buf), dest=dest, tag=_TAG)
        else:
            self._wait([self.mpi.Isend(self._out(buf), dest=dest, tag=_TAG)])

    def _isend(self, buf: torch.Tensor, dest: int) -> Request:
        spec = self._out(buf)
        req = self.mpi.Isend(spec, dest=dest, tag=_TAG)
        if self.poll_interval is None:
            return Request(req.Wait, spec)
        return Request(lambda: self._wait([req]), spec)

    def _recv(self, out: torch.Tensor, source: int) -> torch.Tensor:
        spec, host = self._into(out)
        try:
            if self.poll_interval is None:
                status = self._MPI.Status()
                self.mpi.Recv(spec, source=source, tag=_TAG, status=status)
            else:
                status = self._wait([self.mpi.Irecv(spec, source=source, tag=_TAG)])[0]
        except self._MPI.Exception as e:
            # Blocking receives report ERR_TRUNCATE; Testall reports ERR_IN_STATUS for it.
            if e.Get_error_class() not in (self._MPI.ERR_TRUNCATE, self._MPI.ERR_IN_STATUS):
                raise
            raise ValueError(f"rank {self.rank} expected {out.numel()} bytes from rank "
                             f"{source}, got more") from None
        self._check_count(status, out, source)
        return out if host is None else _copy_into(out, host)

    def _sendrecv(self, buf: torch.Tensor, dest: int, out: torch.Tensor, source: int
                  ) -> torch.Tensor:
        spec, host = self._into(out)
        if self.poll_interval is None:
            self.mpi.Sendrecv(self._out(buf), dest=dest, sendtag=_TAG, recvbuf=spec,
                              source=source, recvtag=_TAG)
        else:
            self._wait([self.mpi.Irecv(spec, source=source, tag=_TAG),
                        self.mpi.Isend(self._out(buf), dest=dest, tag=_TAG)])
        return out if host is None else _copy_into(out, host)

    def _alltoallv(self, bufs: list[torch.Tensor], sizes: list[int]) -> list[torch.Tensor]:
        send = _joined(bufs, torch.device("cpu"))
        scounts = [b.numel() for b in bufs]
        recv = torch.empty(sum(sizes), dtype=torch.uint8)
        self.mpi.Alltoallv([send.numpy(), (scounts, _displs(scounts)), self._MPI.BYTE],
                           [recv.numpy(), (sizes, _displs(sizes)), self._MPI.BYTE])
        return _parts(recv, sizes, bufs[self.rank].device)

    def _allgatherv(self, buf: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
        recv = torch.empty(sum(sizes), dtype=torch.uint8)
        self.mpi.Allgatherv([buf.cpu().numpy(), self._MPI.BYTE],
                            [recv.numpy(), (sizes, _displs(sizes)), self._MPI.BYTE])
        return _parts(recv, sizes, buf.device)

    def _allreduce(self, x: torch.Tensor) -> torch.Tensor:
        host = x.detach().cpu().contiguous()
        if host.dtype in (torch.float16, torch.bfloat16):
            raise TypeError(f"expected a float32/float64/integer tensor for MPI allreduce, got "
                            f"{x.dtype}")
        out = np.empty_like(host.numpy())
        self.mpi.Allreduce(host.numpy(), out, op=self._MPI.SUM)
        return _moved(torch.from_numpy(out), x.device)

    def _barrier(self) -> None:
        if self.poll_interval is None:
            self.mpi.Barrier()
        else:
            self._wait([self.mpi.Ibarrier()])


def _displs(counts: list[int]) -> list[int]:
    out, acc = [], 0
    for c in counts:
        out.append(acc)
        acc += c
    return out
