"""CPU and CUDA frames must be byte-identical (the CPU side of this is tested without a GPU by
forcing the torch-only path in each codec's tests)."""

import pytest
import torch

from bitcomm.codecs import bits, counts, qsgd, redsync, select, sign, sparse

from conftest import needs_cuda

pytestmark = needs_cuda


def _both(fn, *tensors):
    cpu = fn(*tensors)
    gpu = fn(*(t.cuda() for t in tensors))
    assert gpu.is_cuda
    return cpu, gpu.cpu()


@pytest.mark.parametrize("n", [0, 1, 9, 4097, (1 << 20) + 3])
def test_frames_identical(n):
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=g)
    c = torch.randint(0, 6, (n,), generator=g)
    cases = [
        (lambda t: sign.encode(t), x),
        (lambda t: sign.encode_scaled(t), x),
        (lambda t: bits.encode(t, 11), torch.randint(0, 2048, (n,), generator=g)),
        (lambda t: counts.encode(t, 5), c),
        (lambda t: counts.encode(t, 5, "radix"), c),
        (lambda t: redsync.encode(t, max(1, n // 50), "top", "trimmed"), x),
    ]
    for b in qsgd.BITS:
        cases.append((lambda t, b=b: qsgd.encode(t, b, seed=5), x))
    for fn, t in cases:
        a, b = _both(fn, t)
        assert torch.equal(a, b)


def test_decoders_agree():
    x = torch.randn(100_003, generator=torch.Generator().manual_seed(1))
    for enc, dec in ((sign.encode, sign.decode), (lambda t: qsgd.encode(t, 4, seed=1),
                                                  qsgd.decode)):
        frame = enc(x)
        a, _ = dec(frame)
        b, _ = dec(frame.cuda())
        assert b.is_cuda and torch.equal(a, b.cpu())
    idx = select.topk(x.abs(), 1000)
    frame = sparse.encode(idx, x[idx], x.numel())
    assert torch.equal(sparse.decode(frame)[0], sparse.decode(frame.cuda())[0].cpu())
    assert torch.equal(select.topk(x.abs(), 1000), select.topk(x.abs().cuda(), 1000).cpu())


def test_collectives_on_cuda_tensors_match_cpu():
    """Collectives over the local transport give CUDA results equal to the CPU ones."""
    from bitcomm.collectives import (
        OneBitState,
        allreduce,
        alltoall_majority,
        onebit_allreduce,
        ring_majority,
        sparse_allgather,
    )
    from bitcomm.comm import run_local

    size, n = 4, 10007
    xs = [torch.randn(n, generator=torch.Generator().manual_seed(r)) for r in range(size)]

    def every(device):
        states = [OneBitState(n, size, device) for _ in range(size)]

        def fn(c):
            x = xs[c.rank].to(device)
            outs = [ring_majority(c, x), ring_majority(c, x, packing="radix"),
                    alltoall_majority(c, x), onebit_allreduce(c, x, states[c.rank]),
                    sparse_allgather(c, x, 100, fmt="qsgd", seed=1)[0], allreduce(c, x)]
            assert all(o.device.type == torch.device(device).type for o in outs)
            return [o.cpu() for o in outs]
        return run_local(fn, size)[0]

    for cpu, gpu in zip(every("cpu"), every("cuda"), strict=True):
        torch.testing.assert_close(gpu, cpu, rtol=1e-5, atol=1e-6)
