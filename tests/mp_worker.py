"""One rank of the multi-process collective checks (launched by test_multiprocess.py).

    mpiexec -n N python -m mpi4py tests/mp_worker.py mpi [check|fault|check-cuda]
    RANK=r WORLD_SIZE=N BITCOMM_STORE=path python tests/mp_worker.py torch [check|fault|...]
    RANK=r WORLD_SIZE=N BITCOMM_STORE=path python tests/mp_worker.py nccl check-cuda

``check-cuda`` runs the collectives on CUDA tensors (rank r on GPU r mod the GPU count);
``nccl`` needs a GPU per rank (NCCL refuses two ranks on one device).

Every rank builds every rank's input from one seed, so it can compute the expected result
itself; results are also compared byte for byte across ranks. Any failure raises (under
``python -m mpi4py`` that aborts every rank); success prints ``OK rank R``.
"""

import datetime
import os
import sys

import torch
from test_collectives import _inconsistent_cases, brute_majority, inputs, onebit_reference

from bitcomm.codecs import sparse
from bitcomm.collectives import (
    OneBitState,
    allreduce,
    allreduce_bytes,
    alltoall_majority,
    alltoall_majority_bytes,
    onebit_allreduce,
    onebit_allreduce_bytes,
    ring_majority,
    ring_majority_bytes,
    sparcml,
    sparse_allgather,
    sparse_allgather_bytes,
)
from bitcomm.comm.launch import finish, world


def make_comm(kind):
    if kind != "nccl":
        return world("mpi" if kind == "mpi" else "gloo", timeout=20)
    import torch.distributed as dist

    from bitcomm.comm.torchdist import TorchComm

    rank = int(os.environ["RANK"])
    torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group("nccl", init_method=f"file://{os.environ['BITCOMM_STORE']}",
                            rank=rank, world_size=int(os.environ["WORLD_SIZE"]),
                            timeout=datetime.timedelta(seconds=20))
    return TorchComm()


def same_everywhere(comm, t):
    if t.numel() == 0:
        return
    raw = t.reshape(-1).clone().view(torch.uint8)
    for other in comm.allgatherv(raw, [raw.numel()] * comm.size):
        assert torch.equal(other, raw), f"rank {comm.rank}: results differ across ranks"


def counted(comm, fn):
    comm.counters.reset()
    out = fn()
    return out, comm.counters.total_sent


def check_exchanges(comm):
    """alltoallv / allgatherv move exactly the bytes asked for: uneven, empty and equal sizes.

    A TorchComm over gloo runs them, and a ring step (shift), as one native collective (never a
    point-to-point message) and its ``native=False`` form as pairwise rounds: both give the
    same buffers and the same counts.
    """
    size, rank = comm.size, comm.rank

    def payload(src, dst, n):
        return torch.arange(n, dtype=torch.int64).add_(31 * src + 7 * dst).to(torch.uint8)

    def cases():
        yield "uneven", lambda s, d: (s + 2 * d) % 5  # some pairs send nothing
        yield "empty", lambda s, d: 0
        yield "equal", lambda s, d: 6

    def run(c, native=True):
        for name, length in cases():
            sizes = [length(j, rank) for j in range(size)]
            c.counters.reset()
            got = c.alltoallv([payload(rank, j, length(rank, j)) for j in range(size)], sizes)
            for j in range(size):
                assert torch.equal(got[j], payload(j, rank, sizes[j])), (name, j)
            assert c.counters.total_sent == sum(length(rank, j) for j in range(size) if j != rank)
            lengths = [length(j, j) for j in range(size)]
            got = c.allgatherv(payload(rank, rank, lengths[rank]), lengths)
            for j in range(size):
                assert torch.equal(got[j], payload(j, j, lengths[j])), (name, "allgatherv", j)
            if name == "equal" and native:  # back to back in one buffer, this rank's part
                # too: the batched decoders read them as rows, uncopied
                from bitcomm.codecs import _frame

                assert _frame.rows_of(got).data_ptr() == got[0].data_ptr(), name
            if size > 1:  # a ring step: every rank sends to the next, receives from the last
                nxt, prv = (rank + 1) % size, (rank - 1) % size
                out = torch.empty(length(prv, prv), dtype=torch.uint8)
                c.shift(payload(rank, nxt, length(rank, rank)), nxt, out, prv).wait()
                assert torch.equal(out, payload(prv, rank, length(prv, prv))), (name, "shift")

    run(comm)
    from bitcomm.comm.torchdist import TorchComm

    if isinstance(comm, TorchComm):
        def refuse(*args):
            raise AssertionError("a native exchange sent a point-to-point message")

        ops, isend = comm._ops, comm._isend
        comm._ops = comm._isend = refuse
        try:
            run(comm)
        finally:
            comm._ops, comm._isend = ops, isend
        run(TorchComm(comm.group, native=False), native=False)


def check(comm):
    size, rank = comm.size, comm.rank
    check_exchanges(comm)
    for n in sorted({0, 1, max(size - 1, 0), size, 1000, 2**16 + 3}):
        xs = inputs(size, n, seed=n + 17 * size)
        x = xs[rank]
        for tie in ("negative", "positive", "alternate"):
            expect = brute_majority(xs, tie, phase=7)
            for packing in ("fixed", "radix"):
                out, sent = counted(comm, lambda p=packing, t=tie: ring_majority(
                    comm, x, packing=p, tie=t, phase=7))
                assert torch.equal(out, expect), (n, packing, tie)
                assert sent == ring_majority_bytes(n, size, rank, packing=packing), (n, sent)
            out, sent = counted(comm, lambda t=tie: alltoall_majority(comm, x, tie=t, phase=7))
            assert torch.equal(out, expect) and sent == alltoall_majority_bytes(n, size, rank)
        out, sent = counted(comm, lambda: allreduce(comm, x))
        same_everywhere(comm, out)
        assert torch.allclose(out, sum(xs), atol=1e-5) and sent == allreduce_bytes(n, size)
        k = min(n, 9)
        for fmt in ("fp32", sparse.Qsgd(seed=5), "mean"):
            (dense, _), sent = counted(comm, lambda f=fmt: sparse_allgather(comm, x, k, fmt=f))
            same_everywhere(comm, dense)
            if fmt != "mean":
                assert sent == sparse_allgather_bytes(sparse.encoded_size(n, k, fmt), size)
    check_sparcml(comm, "cpu")
    # 1-bit allreduce over consecutive calls against the single-process reference
    n = 777
    state = OneBitState(n, size)
    werr = [torch.zeros_like(state.worker_error) for _ in range(size)]
    serr = [torch.zeros_like(state.server_error) for _ in range(size)]
    for step in range(3):
        xs = inputs(size, n, seed=300 + step)
        out, sent = counted(comm, lambda xs=xs: onebit_allreduce(comm, xs[rank], state))
        expect = onebit_reference(xs, werr, serr)
        same_everywhere(comm, out)
        torch.testing.assert_close(out, expect, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(state.worker_error, werr[rank], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(state.server_error, serr[rank], rtol=1e-5, atol=1e-6)
        assert sent == onebit_allreduce_bytes(n, size)
    # bad input on one rank raises the same error on every rank, and the group stays usable
    for fn in (ring_majority, alltoall_majority, allreduce):
        x = torch.ones(10)
        if rank == size - 1:
            x[4] = float("nan")
        try:
            fn(comm, x)
        except ValueError as e:
            assert f"NaN or inf on rank(s) [{size - 1}]" in str(e), str(e)
        else:
            raise AssertionError(f"{fn.__name__} accepted NaN")
        try:
            fn(comm, torch.ones(10 + (rank == 0)))
        except ValueError as e:
            assert "same number of elements" in str(e), str(e)
        else:
            raise AssertionError(f"{fn.__name__} accepted uneven lengths")
        try:
            fn(comm, torch.ones(10, dtype=torch.int64) if rank == 1 else torch.ones(10))
        except TypeError as e:
            assert "rank(s) [1]" in str(e), str(e)
        else:
            raise AssertionError(f"{fn.__name__} accepted an integer tensor")
    assert torch.equal(ring_majority(comm, torch.ones(5)), torch.ones(5))


def check_sparcml(comm, device):
    """SparCML's allreduces: exact integer sums, the same bits everywhere, bytes by formula."""
    size, rank = comm.size, comm.rank
    for n, k in ((1, 1), (100, 3), (1000, 40), (1000, 400)):
        g = torch.Generator().manual_seed(n + k)
        sets = [torch.randperm(n, generator=g)[:k].sort().values for _ in range(size)]
        values = [torch.randint(-9, 10, (k,), generator=g).float() for _ in range(size)]
        want = torch.zeros(n)
        for ix, v in zip(sets, values, strict=True):
            want[ix] += v
        for name in ("ssar_recursive_double", "ssar_split_allgather", "dsar_split_allgather",
                     "stream_allgather"):
            fn = getattr(sparcml, name)
            out, sent = counted(comm, lambda fn=fn: fn(
                comm, sets[rank].to(device), values[rank].to(device), n))
            out = out if isinstance(out, torch.Tensor) else out.to_dense()
            assert out.device.type == torch.device(device).type, (name, out.device)
            assert torch.equal(out.cpu(), want), (name, n, k)
            same_everywhere(comm, out.cpu())
            assert sent == getattr(sparcml, name + "_bytes")(sets, n)[rank], (name, n, k, sent)
        out, sent = counted(comm, lambda: sparcml.dsar_split_allgather(
            comm, sets[rank].to(device), values[rank].to(device), n, bits=4, bucket=64, seed=3))
        same_everywhere(comm, out.cpu())
        assert sent == sparcml.dsar_split_allgather_bytes(sets, n, bits=4, bucket=64)[rank]
    # unsorted indices on the last rank: refused on every rank, and the group stays usable
    for fn in (sparcml.ssar_recursive_double, sparcml.ssar_split_allgather,
               sparcml.dsar_split_allgather):
        ix = torch.tensor([3, 1]) if rank == size - 1 else torch.tensor([1, 3])
        try:
            fn(comm, ix, torch.ones(2), 10)
        except ValueError as e:
            assert f"rank(s) [{size - 1}]" in str(e), str(e)
        else:
            raise AssertionError(f"{fn.__name__} accepted unsorted indices")


def check_cuda(comm):
    """The collectives on CUDA tensors: results stay on the device and equal the CPU ones."""
    size, rank = comm.size, comm.rank
    torch.cuda.set_device(rank % torch.cuda.device_count())
    device = torch.device("cuda", torch.cuda.current_device())
    for n in (1, 1000, 2**16 + 3):
        xs = inputs(size, n, seed=n + 17 * size)
        x = xs[rank].to(device)
        for tie in ("negative", "positive", "alternate"):
            expect = brute_majority(xs, tie, phase=7)
            for packing in ("fixed", "radix"):
                out, sent = counted(comm, lambda p=packing, t=tie: ring_majority(
                    comm, x, packing=p, tie=t, phase=7))
                assert out.device == device and torch.equal(out.cpu(), expect), (n, packing)
                assert sent == ring_majority_bytes(n, size, rank, packing=packing), (n, sent)
            out = alltoall_majority(comm, x, tie=tie, phase=7)
            assert out.device == device and torch.equal(out.cpu(), expect), n
        out = allreduce(comm, x)
        assert out.device == device
        assert torch.allclose(out.cpu(), sum(xs), atol=1e-5)
        dense, _ = sparse_allgather(comm, x, min(n, 9), fmt=sparse.Qsgd(seed=5))
        assert dense.device == device
        same_everywhere(comm, dense.cpu())
    check_sparcml(comm, device)


def fault(comm):
    # Rank 1 fails inside the ring, at its second step (after the agreement and one step), while
    # the others wait for it; they must not hang.
    if comm.rank == 1:
        calls = []
        plain = comm.shift  # each ring step is one shift

        def failing(*args):
            calls.append(1)
            if len(calls) == 2:
                raise RuntimeError("rank 1 fails on purpose at ring step 2")
            return plain(*args)
        comm.shift = failing
    ring_majority(comm, torch.ones(1 << 16))


def inconsistent(comm):
    # Every rank must raise the same exception type for each mismatched or half-wrong call, and
    # stay in step for the next one: none may block in the agreement or die by a signal.
    x = torch.randn(40, generator=torch.Generator().manual_seed(comm.size))
    for name, (call, kind, text) in sorted(_inconsistent_cases().items()):
        try:
            call(comm, x)
        except Exception as e:  # noqa: BLE001 - checked below
            assert type(e) is kind and text in str(e), (name, comm.rank, repr(e))
        else:
            raise AssertionError(f"{name}: rank {comm.rank} raised nothing")
    print(f"rank {comm.rank} raised as expected in {len(_inconsistent_cases())} cases",
          flush=True)


def sizes(comm):
    # A message longer or shorter than its receive is a ValueError on the receiver naming both
    # sizes, with blocking receives and with polled ones (the emulator's), and the ranks go on.
    from bitcomm.comm.mpi import MPIComm

    for polled in (False, True):
        c = MPIComm(poll_interval=1e-3) if polled else comm
        for sent, want in ((5, "got more"), (2, "got 2")):
            if c.rank == 0:
                c.send(torch.arange(sent, dtype=torch.uint8), 1)
            elif c.rank == 1:
                try:
                    c.recv(torch.empty(3, dtype=torch.uint8), 0)
                except ValueError as e:
                    assert f"rank 1 expected 3 bytes from rank 0, {want}" in str(e), (polled, e)
                else:
                    raise AssertionError(f"a {sent}-byte message was taken for 3 bytes")
            c.barrier()
        # still in step: an exchange of the right size goes through
        got = c.sendrecv(torch.full((4,), c.rank, dtype=torch.uint8), (c.rank + 1) % c.size,
                         torch.empty(4, dtype=torch.uint8), (c.rank - 1) % c.size)
        assert got.tolist() == [(c.rank - 1) % c.size] * 4, got


def main():
    kind, mode = sys.argv[1], sys.argv[2]
    comm = make_comm(kind)
    {"check": check, "fault": fault, "check-cuda": check_cuda,
     "inconsistent": inconsistent, "sizes": sizes}[mode](comm)
    comm.barrier()
    print(f"OK rank {comm.rank}", flush=True)


if __name__ == "__main__":
    main()
    finish()  # skips the interpreter's teardown, where a gloo rank can abort after its work
