"""torch.distributed transport: gloo on CPU, NCCL on GPU (GPU tensors stay on the GPU).

Point-to-point exchanges use ``batch_isend_irecv``; a ring step (:meth:`Comm.shift`) is one
``all_to_all_single`` on gloo; ``alltoallv`` is ``dist.all_to_all_single`` (uneven splits);
``allgatherv`` is one allgather into a tensor where every rank gives the same size, else the
all-to-all of one buffer to every rank; ``allreduce`` is ``dist.all_reduce``. One native
collective in place of ``size - 1`` Python rounds matters for the small tensors of DDP
buckets: each round's latency, not its bytes, is their cost.

With gloo, CUDA tensors are staged through the host; with NCCL, CPU tensors are moved to the
rank's current CUDA device for the exchange. A host buffer goes to the GPU from pinned memory
(from pageable memory the copy would first wait for the device), and the parts of a received
buffer come back to the host in one copy (one wait, not one a rank). Waits are bounded by the
process group's ``timeout`` (``init_process_group(timeout=...)``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from bitcomm.comm.base import Comm, Request, _copy_into, _joined, _moved, _parts

__all__ = ["TorchComm"]

# torch 2.13 renamed all_gather_into_tensor (and deprecated the old name); torch >= 2.1 is kept.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class TorchComm(Comm):
    """A :class:`~bitcomm.comm.base.Comm` over an initialised torch.distributed process group.

    Args:
        group: the process group; the default (world) group when ``None``.
        native: use the backend's all-to-all and allgather, and on gloo a collective for each
            ring step (default). With ``False`` they run as :class:`~bitcomm.comm.base.Comm`'s
            pairwise rounds and ring steps of point-to-point messages, the pattern the network
            model of :mod:`bitcomm.netem.model` predicts (as ``MPIComm(native=False)``).

    """

    def __init__(self, group: dist.ProcessGroup | None = None, *, native: bool = True):
        if not dist.is_initialized():
            raise RuntimeError("expected torch.distributed to be initialised "
                               "(call dist.init_process_group first)")
        self.group = group
        backend = self.backend = dist.get_backend(group)
        self.wire = (torch.device("cuda", torch.cuda.current_device()) if backend == "nccl"
                     else torch.device("cpu"))
        super().__init__(dist.get_rank(group), dist.get_world_size(group))
        if not native:  # fall back to the base class's pairwise rounds
            self._alltoallv = super()._alltoallv  # type: ignore[method-assign]
            self._allgatherv = super()._allgatherv  # type: ignore[method-assign]
            self._shift = super()._shift  # type: ignore[method-assign]

    def _global(self, rank: int) -> int:
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    def _ops(self, buf: torch.Tensor | None, dest: int, out: torch.Tensor | None, source: int
             ) -> torch.Tensor | None:
        # Empty messages are skipped on both sides (each side knows the size), since some
        # backends reject zero-element tensors.
        ops, staged = [], None
        if buf is not None and buf.numel():
            ops.append(dist.P2POp(dist.isend, _moved(buf, self.wire), self._global(dest),
                                  self.group))
        if out is not None and out.numel():
            staged = out if out.device == self.wire else torch.empty_like(out, device=self.wire)
            ops.append(dist.P2POp(dist.irecv, staged, self._global(source), self.group))
        for req in dist.batch_isend_irecv(ops) if ops else []:
            req.wait()
        if out is not None and staged is not None and staged is not out:
            _copy_into(out, staged)
        return out

    def _send(self, buf: torch.Tensor, dest: int) -> None:
        self._ops(buf, dest, None, dest)

    def _isend(self, buf: torch.Tensor, dest: int) -> Request:
        if not buf.numel():
            return Request()  # skipped on both sides, as in _ops
        wire = _moved(buf, self.wire)
        work = dist.isend(wire, self._global(dest), self.group)
        return Request(work.wait, wire)

    def _recv(self, out: torch.Tensor, source: int) -> torch.Tensor:
        return self._ops(None, source, out, source)

    def _sendrecv(self, buf: torch.Tensor, dest: int, out: torch.Tensor, source: int
                  ) -> torch.Tensor:
        return self._ops(buf, dest, out, source)

    def _shift(self, buf: torch.Tensor, dest: int, out: torch.Tensor, source: int) -> Request:
        # gloo's point-to-point messages cost more latency than its collectives (in a one-off
        # measurement over loopback, a small ring step took about twice as long as isend/irecv
        # as it did as this all-to-all), and a DDP bucket's exchange is paid in such latencies.
        # Every rank takes part in a ring step, as a collective needs.
        if self.backend != "gloo":
            return super()._shift(buf, dest, out, source)
        splits_in, splits_out = [0] * self.size, [0] * self.size
        splits_in[dest], splits_out[source] = buf.numel(), out.numel()
        staged = out if out.device == self.wire else torch.empty_like(out, device=self.wire)
        dist.all_to_all_single(staged, _moved(buf, self.wire), output_split_sizes=splits_out,
                               input_split_sizes=splits_in, group=self.group)
        if staged is not out:
            _copy_into(out, staged)
        return Request()

    def _alltoallv(self, bufs: list[torch.Tensor], sizes: list[int]) -> list[torch.Tensor]:
        device = bufs[self.rank].device
        send = _joined(bufs, self.wire)
        recv = torch.empty(sum(sizes), dtype=torch.uint8, device=self.wire)
        dist.all_to_all_single(recv, send, output_split_sizes=sizes,
                               input_split_sizes=[b.numel() for b in bufs], group=self.group)
        out = _parts(recv, sizes, device)
        out[self.rank] = bufs[self.rank]
        return out

    def _allgatherv(self, buf: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
        if len(set(sizes)) > 1:
            return self._alltoallv([buf] * self.size, sizes)
        recv = torch.empty(self.size * sizes[0], dtype=torch.uint8, device=self.wire)
        if sizes[0]:
            _all_gather(recv, _moved(buf, self.wire), group=self.group)
        # this rank's part too is recv's (the same bytes as buf): the parts lie back to back
        # in one buffer, which a decoder reads as the rows of one tensor without a copy
        return _parts(recv, sizes, buf.device)

    def _allreduce(self, x: torch.Tensor) -> torch.Tensor:
        t = _moved(x, self.wire)
        t = t.clone() if t is x else t
        dist.all_reduce(t, group=self.group)
        return _moved(t, x.device)

    def _barrier(self) -> None:
        dist.barrier(group=self.group)
