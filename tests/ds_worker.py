"""One rank of the comparison with DeepSpeed's own 1-bit compressed allreduce (0.17.x).

    RANK=r WORLD_SIZE=N BITCOMM_STORE=path python tests/ds_worker.py

Runs ``deepspeed.runtime.comm.compressed.CompressedBackend.compressed_allreduce`` and bitcomm's
``onebit_allreduce`` (over ``TorchComm``) on the same inputs for several consecutive calls and
checks that outputs and both error buffers agree to float32 rounding. Two adaptations let
DeepSpeed run on a CPU with gloo (see ../shared/ENVIRONMENT.md): its packbits op (an XPU/CUDA
kernel) is replaced by torch code with the same bit layout (MSB-first, bit 1 = x >= 0), and its
0-dim scales are all-gathered as 1-element tensors, which gloo requires. And its shared-memory
allreduce op, which ``init_distributed`` would build on a CPU and which the compressed
allreduce never calls (it all-to-alls and all-gathers through torch.distributed), is not
built: building it compiles C++ (some 19 s on 2 cores) under a lock file in torch's extension
cache shared by every checkout, and a run killed while holding that lock would make every
later run wait on it.
"""

import datetime
import os

import torch
import torch.distributed as dist

from bitcomm.comm.launch import finish


class TorchPacker:
    """DeepSpeed's packbits/unpackbits op in torch: MSB-first, 1 for x >= 0, unpack to +-1."""

    def packbits(self, buffer, numel, rank):
        bits = (buffer.reshape(-1)[:numel] >= 0).to(torch.uint8)
        bits = torch.nn.functional.pad(bits, (0, (-numel) % 8)).reshape(-1, 8)
        weights = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8)
        return (bits * weights).sum(1).to(torch.uint8)

    def unpackbits(self, buffer, numel, rank):
        shifts = torch.tensor([7, 6, 5, 4, 3, 2, 1, 0], dtype=torch.uint8)
        bits = (buffer.reshape(-1, 1) >> shifts) & 1
        return bits.reshape(-1).float().add_(-0.5).mul_(2.0)


def main():
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # Import DeepSpeed before joining the group: two ranks importing it at once on 2 cores can
    # take most of a minute, which would otherwise count against the group's timeout.
    import importlib

    import deepspeed.comm as ds_dist
    from deepspeed.runtime.comm.compressed import CompressedBackend

    # the module itself: the name deepspeed.comm.torch is the torch package there
    ds_torch = importlib.import_module("deepspeed.comm.torch")
    ds_torch.build_shm_op = lambda: None  # as where the op is not available: not on the path

    dist.init_process_group("gloo", init_method=f"file://{os.environ['BITCOMM_STORE']}",
                            rank=rank, world_size=size, timeout=datetime.timedelta(seconds=60))

    ds_dist.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    plain_all_gather = ds_dist.all_gather

    def all_gather(tensor_list, tensor, group=None, async_op=False):
        if tensor.dim() == 0:  # gloo gathers 0-dim scales only as 1-element tensors
            tensor = tensor.reshape(1)
        return plain_all_gather(tensor_list, tensor, group=group, async_op=async_op)
    ds_dist.all_gather = all_gather

    backend = CompressedBackend.__new__(CompressedBackend)  # skips loading the packbits op
    backend.world_group = None
    backend.size, backend.rank = size, rank
    backend.packer = TorchPacker()

    from bitcomm.collectives import OneBitState, onebit_allreduce
    from bitcomm.comm.torchdist import TorchComm

    comm = TorchComm()
    for n in (1000, 4096 * size + 5):
        state = OneBitState(n, size)
        # every rank serving every chunk: DeepSpeed's result in one round
        served = OneBitState(n, size, collective="allgather")
        chunk = state.server_error.numel()
        ds_worker = torch.zeros_like(state.worker_error)
        ds_server = torch.zeros_like(state.server_error)
        for step in range(4):
            g = torch.Generator().manual_seed(1000 * step + 10 * rank + n)
            x = torch.randn(n, generator=g) * (1 + step)
            ours = onebit_allreduce(comm, x, state)
            one_round = onebit_allreduce(comm, x, served)
            theirs = backend.compressed_allreduce(x.clone(), ds_worker, ds_server, 0)
            for name, a, b in (("output", ours, theirs),
                               ("worker error", state.worker_error, ds_worker),
                               ("server error", state.server_error, ds_server)):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6,
                                           msg=f"{name} differs at n={n}, call {step}")
            assert torch.equal(one_round, ours), f"allgather output differs at n={n}, {step}"
            assert torch.equal(served.worker_error, state.worker_error)
            assert torch.equal(served.server_error[rank * chunk:(rank + 1) * chunk],
                               state.server_error)
    print(f"OK rank {rank}", flush=True)
    dist.barrier()


if __name__ == "__main__":
    main()
    finish()  # skips the interpreter's teardown, where a gloo rank can abort after its work
