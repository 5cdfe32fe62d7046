"""On a GPU: CPU and CUDA frames byte-identical, decoded values identical, collectives on CUDA
tensors over every transport, no host synchronisation in the fused majorities, the GPU
benchmarks. Without a GPU the same comparisons run on CPU tensors through the torch path (each
codec's tests) and the Triton kernels under the interpreter (test_kernels.py)."""

import itertools
import re
import time

import pytest
import torch

from bitcomm.bench.collectives import count_syncs, sync_sites
from bitcomm.codecs import bits, counts, qsgd, redsync, select, sign, sparse, stream

from conftest import needs_cuda

pytestmark = needs_cuda


def _both(fn, *tensors):
    cpu = fn(*tensors)
    gpu = fn(*(t.cuda() for t in tensors))
    assert gpu.is_cuda
    return cpu, gpu.cpu()


def _frames(n, g):
    x = torch.randn(n, generator=g)
    x[: min(n, 3)] = torch.tensor([0.0, -0.0, 1e-40])[: min(n, 3)]
    c = torch.randint(0, 6, (n,), generator=g)
    c2 = torch.randint(0, 3, (n,), generator=g)
    cases = [
        ("sign", lambda t: sign.encode(t), x),
        ("sign-bf16", lambda t: sign.encode(t.bfloat16()), x),
        ("sign-f64", lambda t: sign.encode(t.double()), x),
        ("scaled-rms", lambda t: sign.encode_scaled(t), x),
        ("scaled-mean", lambda t: sign.encode_scaled(t, "mean_abs"), x),
        ("counts-m5", lambda t: counts.encode(t, 5), c),
        ("radix-m5", lambda t: counts.encode(t, 5, "radix"), c),
        ("radix-m2", lambda t: counts.encode(t, 2, "radix"), c2),
        ("redsync", lambda t: redsync.encode(t, max(1, n // 50), "top", "trimmed"), x),
    ]
    for w in (1, 3, 11, 16):
        cases.append((f"bits-{w}", lambda t, w=w: bits.encode(t, w),
                      torch.randint(0, 1 << w, (n,), generator=g)))
    for b in qsgd.BITS:
        for bucket in (7, 512, 8192):
            for scale in qsgd.SCALES:
                cases.append((f"qsgd-{b}-{bucket}-{scale}",
                              lambda t, b=b, k=bucket, s=scale: qsgd.encode(t, b, k, scale=s,
                                                                            seed=5), x))
        cases.append((f"qsgd-{b}-f16", lambda t, b=b: qsgd.encode(t.half(), b, seed=5), x))
    return cases


@pytest.mark.parametrize("n", [0, 1, 9, 4097, (1 << 20) + 3])
def test_frames_identical(n):
    for name, fn, t in _frames(n, torch.Generator().manual_seed(n)):
        a, b = _both(fn, t)
        assert torch.equal(a, b), name


@pytest.mark.parametrize("n", [1, 4097, (1 << 20) + 3])
def test_decoders_agree(n):
    """Every decoder gives the same values (same bits) on CPU and CUDA."""
    decoders = {"sign": sign.decode, "scaled": sign.decode_scaled, "counts": counts.decode,
                "radix": counts.decode, "bits": bits.decode, "qsgd": qsgd.decode,
                "redsync": redsync.decode}
    for name, fn, t in _frames(n, torch.Generator().manual_seed(n + 1)):
        frame = fn(t)
        key = next(k for k in decoders if name.startswith(k))
        a, _ = decoders[key](frame)
        b, _ = decoders[key](frame.cuda())
        assert b.is_cuda and a.dtype == b.dtype, name
        assert torch.equal(a.view(-1), b.cpu().view(-1)), name
    x = torch.randn(n, generator=torch.Generator().manual_seed(1))
    k = max(1, n // 100)
    idx = select.topk(x.abs(), k)
    for fmt in ("fp32", "fp16", "mean"):  # the scatter kernel's value formats
        frame = sparse.encode(idx, x[idx], x.numel(), fmt)
        for dtype in (torch.float32, torch.float64):
            a = sparse.decode(frame, dtype=dtype)[0]
            assert torch.equal(a, sparse.decode(frame.cuda(), dtype=dtype)[0].cpu()), fmt
    assert torch.equal(select.topk(x.abs(), k), select.topk(x.abs().cuda(), k).cpu())


@pytest.mark.parametrize("n", [1, 4097, (1 << 20) + 3])
def test_the_mean_of_qsgd_frames_agrees(n):
    """qsgd.mean_all's one pass on the GPU gives the CPU's mean and kept values, to the bit,
    for 1 to 7 frames (qsgd_allgather's ranks)."""
    g = torch.Generator().manual_seed(n + 2)
    for b, bucket, count in ((2, 512, 1), (4, 7, 3), (8, 8192, 7), (4, 512, 8)):
        frames = [qsgd.encode(torch.randn(n, generator=g) * (r + 1), b, bucket, seed=r)
                  for r in range(count)]
        mean, kept = qsgd.mean_all(frames, n, b, bucket, keep=count - 1)
        on_gpu = qsgd.mean_all([f.cuda() for f in frames], n, b, bucket, keep=count - 1)
        assert on_gpu[0].is_cuda
        assert torch.equal(mean.view(torch.int32), on_gpu[0].cpu().view(torch.int32))
        assert torch.equal(kept.view(torch.int32), on_gpu[1].cpu().view(torch.int32))


def test_codecs_take_the_triton_path_on_cuda():
    from bitcomm.codecs import backend

    assert backend(torch.empty(1, device="cuda")) == "triton"


def test_collectives_on_cuda_tensors_match_cpu():
    """Collectives over the local transport give CUDA results equal to the CPU ones."""
    from bitcomm.collectives import (
        OneBitState,
        allgather_majority,
        allreduce,
        alltoall_majority,
        onebit_allreduce,
        ring_majority,
        ring_majority_packed,
        sparse_allgather,
    )
    from bitcomm.comm import run_local

    size, n = 4, 10007
    xs = [torch.randn(n, generator=torch.Generator().manual_seed(r)) for r in range(size)]

    def every(device):
        states = [OneBitState(n, size, device) for _ in range(size)]
        served = [OneBitState(n, size, device, collective="allgather") for _ in range(size)]

        def fn(c):
            x = xs[c.rank].to(device)
            outs = [ring_majority(c, x), ring_majority(c, x, packing="radix"),
                    alltoall_majority(c, x), ring_majority_packed(c, x),
                    onebit_allreduce(c, x, states[c.rank]),
                    sparse_allgather(c, x, 100, fmt=sparse.Qsgd(seed=1))[0], allreduce(c, x),
                    allgather_majority(c, x), onebit_allreduce(c, x, served[c.rank])]
            assert all(o.device.type == torch.device(device).type for o in outs)
            return [o.cpu() for o in outs]
        return run_local(fn, size)[0]

    cpus, gpus = every("cpu"), every("cuda")
    for i, (cpu, gpu) in enumerate(zip(cpus, gpus, strict=True)):
        if i < 4 or i == 7:  # majorities: exact
            assert torch.equal(gpu, cpu), i
        else:
            torch.testing.assert_close(gpu, cpu, rtol=1e-5, atol=1e-6)
    assert torch.equal(gpus[8], gpus[4])  # 1-bit's one-round form: the all-to-all's floats


def test_sparcml_on_cuda_tensors_matches_cpu():
    """SparCML's allreduces keep CUDA inputs on the device and give the CPU's bits: the same
    streams, the same two-operand sums, the same qsgd frames (the hash stream is per device
    identical)."""
    from bitcomm.collectives import sparcml
    from bitcomm.comm import run_local

    size, n = 5, 20011
    g = torch.Generator().manual_seed(0)
    sets = [torch.randperm(n, generator=g)[:700].sort().values for _ in range(size)]
    values = [torch.randn(700, generator=g) for _ in range(size)]

    def every(device):
        def fn(c):
            ix, v = sets[c.rank].to(device), values[c.rank].to(device)
            outs = [sparcml.ssar_recursive_double(c, ix, v, n).to_dense(),
                    sparcml.ssar_split_allgather(c, ix, v, n).to_dense(),
                    sparcml.dsar_split_allgather(c, ix, v, n),
                    sparcml.dsar_split_allgather(c, ix, v, n, bits=4, seed=2)]
            assert all(o.device.type == torch.device(device).type for o in outs)
            return [o.cpu() for o in outs]
        return run_local(fn, size)[0]

    results = list(zip(every("cpu"), every("cuda"), strict=True))
    for i, (cpu, gpu) in enumerate(results[:3]):
        assert torch.equal(gpu.view(torch.int32), cpu.view(torch.int32)), i
    # the quantised ranges: the same frames; their decode is test_decoders_agree's business
    torch.testing.assert_close(results[3][1], results[3][0], rtol=1e-6, atol=0)


@pytest.mark.parametrize("size", [2, 5])
def test_fused_majorities_do_not_synchronise(size):
    """No host synchronisation inside the three majorities (check=False)."""
    from bitcomm.collectives import allgather_majority, alltoall_majority, ring_majority
    from bitcomm.comm import run_local

    xs = [torch.randn(100_003, generator=torch.Generator().manual_seed(r)).cuda()
          for r in range(size)]
    for fn in (ring_majority, alltoall_majority, allgather_majority):
        fn_ = fn
        run_local(lambda c: fn_(c, xs[c.rank], check=False), size)  # warm-up: compiles kernels
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            run_local(lambda c: fn_(c, xs[c.rank], check=False), size)
        finally:
            torch.cuda.set_sync_debug_mode("default")


def test_device_checks_give_the_cpus_results_with_one_read_per_decode():
    """The exact top-k selects on the device without a synchronisation, and qsgd's and
    sparse's decode_all check every frame with one; all give the CPU's bits."""

    g = torch.Generator().manual_seed(9)
    n, k = 100_003, 1000
    scores = torch.randint(0, 50, (n,), generator=g).float()  # many ties at the k-th value
    assert torch.equal(select.topk(scores, k), select.topk(scores.cuda(), k).cpu())
    q = [qsgd.encode(torch.randn(n, generator=g), 4, 512, seed=i) for i in range(3)]
    idx = select.topk(scores, k)
    sp = [sparse.encode(idx, torch.randn(k, generator=g), n) for _ in range(3)]
    for cpu, gpu in zip(qsgd.decode_all(q, n, 4, 512),
                        qsgd.decode_all([f.cuda() for f in q], n, 4, 512), strict=True):
        assert torch.equal(cpu.view(torch.int32), gpu.cpu().view(torch.int32))
    for (ci, cv), (gi, gv) in zip(sparse.decode_all(sp, n, k),
                                  sparse.decode_all([f.cuda() for f in sp], n, k), strict=True):
        assert torch.equal(ci, gi.cpu()) and torch.equal(cv, gv.cpu())
    on_gpu = scores.cuda(), [f.cuda() for f in q], [f.cuda() for f in sp]
    sites = sync_sites(lambda: (select.topk(on_gpu[0], k, check=False),
                                qsgd.decode_all(on_gpu[1], n, 4, 512),
                                sparse.decode_all(on_gpu[2], n, k)))
    assert len(sites) == 2, sites


def test_a_qsgd_decode_of_a_layout_seen_before_waits_once():
    """With n, a qsgd frame whose header is the last one of that length decoded on the GPU
    waits once, after its launch, where the first waits twice (its header, then its check);
    frames of that layout and of another give the CPU's bits, and a broken one its error."""
    g = torch.Generator().manual_seed(12)
    n = 100_003
    frames = [qsgd.encode(torch.randn(n, generator=g), 4, 512, seed=i) for i in range(2)]
    frames.append(qsgd.encode(torch.randn(n, generator=g), 2, 512, seed=3))
    on_gpu = [f.cuda() for f in frames]
    assert count_syncs(lambda: qsgd.decode(on_gpu[0], n=n)) == 2
    assert count_syncs(lambda: qsgd.decode(on_gpu[1], n=n)) == 1
    for f, d in zip(frames, on_gpu, strict=True):
        assert torch.equal(qsgd.decode(f, n=n)[0].view(torch.int32),
                           qsgd.decode(d, n=n)[0].cpu().view(torch.int32))
    bad = on_gpu[2].clone()
    bad[14 + 4 * 3 + 3] = 0xFF  # bucket 3's scale becomes a NaN
    with pytest.raises(ValueError, match="finite scale >= 0 in bucket 3"):
        qsgd.decode(bad, n=n)


def test_the_device_checks_and_redsyncs_top_k_read_once():
    """On the GPU: a finiteness check is one kernel and one read, with the CPU's answer for
    NaN, inf and float64 beyond float32's range; RedSync's checked top-k from a sampled bound
    (from 2**18 values) reads the host once, with its check and count of the side's sign,
    and sends the CPU's frame."""

    from bitcomm.codecs import _frame

    g = torch.Generator().manual_seed(11)
    x = torch.randn(300_007, generator=g, dtype=torch.float64)
    for bad in (None, float("nan"), float("inf"), 3.5e38):
        y = x.clone()
        if bad is not None:
            y[123_456] = bad
        for narrow in (False, True):
            assert _frame.all_finite(y.cuda(), as_float32=narrow) == \
                _frame.all_finite(y, as_float32=narrow), (bad, narrow)
    few = -x.float().abs()
    few[torch.randperm(300_007, generator=g)[:1000]] = 1.0  # fewer of the top side than k
    for v in (x.float(), few):
        assert torch.equal(redsync.encode(v, 3000, "top"), redsync.encode(v.cuda(), 3000,
                                                                          "top").cpu())
    on_gpu = few.cuda()
    redsync.encode(on_gpu, 3000, "top")
    sites = sync_sites(lambda: redsync.encode(on_gpu, 3000, "top"))
    assert len(sites) == 1, sites


def test_sidco_fits_as_on_the_cpu_with_one_read_a_stage():
    """SIDCo's stages on the GPU (compiled kernels): the CPU's thresholds to rounding and its
    selections, for every fit and 1 to 3 stages, 32-, 16- and 64-bit scores; a fit of three
    stages waits for the device three times."""

    from bitcomm.codecs import sidco

    g = torch.Generator().manual_seed(12)
    laplace = torch.distributions.Laplace(0.0, 1.0).sample((1_000_003,)).abs()
    sparse = torch.randn(500_000, generator=g).abs() * (torch.rand(500_000, generator=g) < 0.1)
    for v in (laplace, sparse, laplace.half(), laplace.double() * 1e200):
        for dist, stages in itertools.product(sidco.DISTRIBUTIONS, (1, 3)):
            cpu = sidco.threshold(v, 0.001, dist, stages)
            gpu = sidco.threshold(v.cuda(), 0.001, dist, stages)
            assert gpu == pytest.approx(cpu, rel=1e-12), (v.dtype, dist, stages)
            assert torch.equal(sidco.sidco(v, 1000, dist, stages),
                               sidco.sidco(v.cuda(), 1000, dist, stages).cpu())
    on_gpu = laplace.cuda()
    sidco.threshold(on_gpu, 0.001, "pareto", 3)
    sites = sync_sites(lambda: sidco.threshold(on_gpu, 0.001, "pareto", 3))
    assert len(sites) == 3, sites


def test_momentum_gives_torchs_bits_on_the_gpu():
    """The momentum kernel (compiled) writes the CPU's ``m.mul(beta).add_(g, alpha=1 - beta)``
    and torch's on CUDA bit for bit, for 32-, 16- and 64-bit gradients."""
    from bitcomm.train._common import momentum

    g = torch.Generator().manual_seed(13)
    m = torch.randn(1_000_003, generator=g)
    for grad in (torch.randn(m.numel(), generator=g) * 3, torch.randn(m.numel()).half(),
                 torch.randn(m.numel(), dtype=torch.float64) * 1e-3):
        cpu = m.mul(0.9).add_(grad.float(), alpha=1 - 0.9)
        on_cuda = m.cuda().mul(0.9).add_(grad.cuda().float(), alpha=1 - 0.9)
        kernel = momentum(m.cuda(), grad.cuda(), 0.9, torch.empty_like(m, device="cuda"))
        assert torch.equal(on_cuda.cpu().view(torch.int32), cpu.view(torch.int32)), grad.dtype
        assert torch.equal(kernel.cpu().view(torch.int32), cpu.view(torch.int32)), grad.dtype


def test_radix_selection_gives_the_cpus_sets_for_every_dtype_and_side():
    """select_abs, select_side and topk select on the GPU by radix selection (compiled, not
    interpreted): the CPU's sets, ties to lower indices, for 32-, 64- and 16-bit floats; with
    candidates gathered (normal scores) and without (few distinct values)."""
    from bitcomm.codecs import _kernels

    g = torch.Generator().manual_seed(10)
    for dtype, spread in itertools.product(
            (torch.float32, torch.float64, torch.float16, torch.bfloat16), (False, True)):
        if spread:
            v = torch.randn(300_007, generator=g).to(dtype)
            gathered = _kernels._radix_select(v.cuda(), 1000, 2).m.item()
            assert 1000 <= gathered <= 1000 + 300_007 // _kernels.SLACK, dtype
        else:
            v = (torch.randint(-20, 21, (300_007,), generator=g) / 4).to(dtype)  # ties, zeros
        v[:3] = torch.tensor([-0.0, 1e-40, -1e-40]).to(dtype)
        for k in (1, 1000, 150_000):
            assert torch.equal(select.select_abs(v, k), select.select_abs(v.cuda(), k).cpu())
            for side in (1, -1):
                assert torch.equal(select.select_side(v, k, side),
                                   select.select_side(v.cuda(), k, side).cpu()), (dtype, k)
            kth = v.abs().double().sort(descending=True).values[k - 1].item()
            assert _kernels.kth_largest(v.cuda(), k, 2).item() == kth, (dtype, k)


def test_crowded_runs_of_a_sampled_top_k_read_x_again_with_the_cpus_sets(monkeypatch):
    """From a sampled bound the count pass keeps each program's candidates for the gathering
    to copy; a program whose candidates overflow its stretch reads its run of x again
    (compiled, not interpreted): here four runs of 1024 scores, every one above the bound,
    beside runs that copy; and with LOCAL_ROOM = 0 every run read again. The CPU's sets."""
    from bitcomm.codecs import _kernels

    g = torch.Generator().manual_seed(12)
    v = torch.randn(300_007, generator=g)
    v[:4096] += 50  # the first four programs' runs: all candidates, far past their stretches
    for room in (_kernels.LOCAL_ROOM, 0):
        monkeypatch.setattr(_kernels, "LOCAL_ROOM", room)
        for k in (1000, 5000):
            assert _kernels._sampling(v.numel(), k) is not None  # the premise: a sampled bound
            assert torch.equal(select.select_abs(v, k),
                               select.select_abs(v.cuda(), k).cpu()), (room, k)
            for side in (1, -1):
                assert torch.equal(select.select_side(v, k, side),
                                   select.select_side(v.cuda(), k, side).cpu()), (room, k)


def test_a_small_vectors_top_k_is_one_program_with_the_cpus_sets():
    """Up to SMALL_TOP scores the top-k on the GPU is one program (compiled, not
    interpreted): the CPU's sets, ties to lower indices, for 32-, 64- and 16-bit floats and
    every side, with census as the CPU counts, without waiting for the device."""
    from bitcomm.codecs import _kernels

    g = torch.Generator().manual_seed(14)
    for n in (1, 1000, _kernels.SMALL_TOP):
        for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
            v = (torch.randint(-20, 21, (n,), generator=g) / 4 + torch.randn(n, generator=g)
                 * (torch.rand(n, generator=g) < 0.5)).to(dtype)
            for k in sorted({1, max(1, n // 100), n}):
                assert torch.equal(select.select_abs(v, k),
                                   select.select_abs(v.cuda(), k).cpu()), (n, dtype, k)
                for side in (1, -1):
                    assert torch.equal(select.select_side(v, k, side),
                                       select.select_side(v.cuda(), k, side).cpu()), (n, k)
    v = torch.randn(_kernels.SMALL_TOP, generator=g).cuda()
    v[:100] = 0.0
    idx, census = _kernels.top_indices(v, 300, 1, census=True)
    assert census.tolist() == [0, 300]
    v[300:] = -1.0  # fewer positive than k
    assert _kernels.top_indices(v, 400, 1, census=True)[1].tolist() == [0, int((v > 0).sum())]
    assert count_syncs(lambda: _kernels.top_indices(v, 300, 2)) == 0


def test_encoders_copy_their_headers_without_waiting():
    """A header goes to the GPU from pinned memory: sign's and stream's encoders do not wait
    for the device, qsgd's waits once (its scale check), redsync's once (below), and every
    frame is the CPU's."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(100_003, generator=g)
    idx = select.topk(x.abs(), 500)
    sparse_s, dense_s = stream.from_entries(idx, x[idx], x.numel()), stream.from_dense(x)
    jobs = [lambda v: sign.encode(v), lambda v: stream.encode(sparse_s.to(v.device)),
            lambda v: stream.encode(dense_s.to(v.device))]
    for job in jobs:
        assert torch.equal(job(x), job(x.cuda()).cpu())
    on_gpu = x.cuda()
    streams = sparse_s.to("cuda"), dense_s.to("cuda")
    assert count_syncs(lambda: (sign.encode(on_gpu), stream.encode(streams[0]),
                                stream.encode(streams[1]))) == 0
    assert count_syncs(lambda: qsgd.encode(on_gpu, 4, 512, seed=1)) == 1
    # redsync: the exact top-k's check brings the number of values of the side's sign; a
    # search reads its statistics with the counts of its first thresholds, which the device
    # makes from them (that number among them; these searches need no more)
    for method, waits in (("topk", 1), ("trimmed", 1), ("threshold", 1)):
        frame = redsync.encode(x, 500, "top", method)
        assert torch.equal(redsync.encode(on_gpu, 500, "top", method).cpu(), frame), method
        assert count_syncs(lambda m=method: redsync.encode(on_gpu, 500, "top", m)) == waits


def test_sparse_frames_are_written_on_the_gpu_as_on_the_cpu():
    """sparse.encode and encode_at on the GPU (one kernel, one more for a mean): the CPU's
    frame for fp32, fp16 and mean values of float32 and float64 vectors, 1% of 1M entries;
    unchecked without waiting for the device, checked with one wait (the flag), and broken
    entries raise the CPU's error."""
    g = torch.Generator().manual_seed(13)
    n = 1_000_003
    idx = torch.randperm(n, generator=g)[: n // 100]
    for dtype in (torch.float32, torch.float64):
        x = torch.randn(n, generator=g, dtype=dtype) * 100
        on_gpu = x.cuda()
        for fmt in ("fp32", "fp16", "mean"):
            if fmt == "fp16" and dtype == torch.float64:
                continue  # float64 to fp16 takes the torch path
            want = sparse.encode(idx, x[idx], n, fmt)
            assert torch.equal(sparse.encode(idx.cuda(), on_gpu[idx.cuda()], n, fmt).cpu(),
                               want), (dtype, fmt)
            assert torch.equal(sparse.encode_at(on_gpu, idx.cuda(), fmt).cpu(), want)
            chosen = idx.sort().values.cuda()
            sparse.encode_at(on_gpu, chosen, fmt, check=False)
            assert count_syncs(lambda f=fmt, c=chosen, v=on_gpu: sparse.encode_at(
                v, c, f, check=False)) == 0
            assert count_syncs(lambda f=fmt, c=chosen, v=on_gpu: sparse.encode_at(v, c, f)) == 1
    for bad, error in ((n, ValueError), (-1, ValueError), ("nan", ValueError),
                       ("big", OverflowError)):
        x = torch.randn(n, generator=g)
        i = idx.clone()
        if bad == "nan":
            x[i[5]] = float("nan")
        elif bad == "big":
            x[i[5]] = 1e6
        else:
            i[5] = bad
        with pytest.raises(error) as want:
            sparse.encode_at(x, i, "fp16")
        with pytest.raises(error, match=re.escape(str(want.value))):
            sparse.encode_at(x.cuda(), i.cuda(), "fp16")


def test_a_top_k_frame_is_written_by_its_selection_on_the_gpu_as_on_the_cpu():
    """sparse.encode_top on the GPU (the top-k's writing pass writes the frame's entries,
    compiled): the CPU's frame for fp32 and fp16 values at 1% and 10% of a DDP bucket (one
    program) and of 1M and 4M scores (the sampled and the two-digit radix paths), ties
    included; unchecked without waiting for the device, checked with one wait; RedSync's
    frames of both sides with one wait, also where fewer than k values have the side's sign;
    NaN in x is the CPU's error."""
    g = torch.Generator().manual_seed(19)
    for n in (30_000, 1_000_003, 1 << 22):
        x = torch.randn(n, generator=g) * 100
        x[:200] = torch.tensor([7.0, -7.0, 0.0, -0.0] * 50)  # ties at the k-th
        on_gpu = x.cuda()
        for k, fmt, check in itertools.product((n // 100, n // 10), ("fp32", "fp16"),
                                               (True, False)):
            want = sparse.encode_top(x, k, fmt, check=check)
            assert torch.equal(sparse.encode_top(on_gpu, k, fmt, check=check).cpu(), want), \
                (n, k, fmt, check)
            waits = count_syncs(lambda k=k, f=fmt, c=check: sparse.encode_top(on_gpu, k, f,
                                                                              check=c))
            assert waits == (1 if check else 0), (n, k, fmt, check)
        # RedSync's frames (a mean of a side's values), also where fewer than k have the sign
        few = -x.abs()
        few[torch.randperm(n, generator=g)[:50]] = 3.0
        for v, side in itertools.product((x, few), ("top", "bottom")):
            want = redsync.encode(v, n // 100, side)
            on = v.cuda()
            assert torch.equal(redsync.encode(on, n // 100, side).cpu(), want), (n, side)
            assert count_syncs(lambda on=on, s=side: redsync.encode(on, n // 100, s)) == 1
    x[n // 2] = float("nan")
    with pytest.raises(ValueError) as want:
        sparse.encode_top(x, 5000)
    with pytest.raises(ValueError, match=re.escape(str(want.value))):
        sparse.encode_top(x.cuda(), 5000)


@pytest.fixture
def launches(monkeypatch):
    """The kernels launched through the codecs' launch wrapper (a whole-call replay makes
    none), with nothing recorded by the tests before (calls, plans, qsgd's frame layouts):
    the same lengths recur."""
    from bitcomm.codecs import _kernels, _launch

    if not _launch._DIRECT:
        pytest.skip("launches go through Triton's own path here (BITCOMM_DIRECT_LAUNCH=0, or a "
                    "Triton release outside _launch.VERIFIED)")
    made = []
    real = _kernels.launch

    def counting(kernel, grid, *args, **kwargs):
        made.append(kernel)
        real(kernel, grid, *args, **kwargs)

    monkeypatch.setattr(_kernels, "launch", counting)
    monkeypatch.setattr(_launch, "_CALLS", {})
    monkeypatch.setattr(_launch, "_PLANS", {})
    monkeypatch.setattr(qsgd, "_SEEN", qsgd._Layouts())
    return made


def test_a_top_k_made_again_from_its_record_gives_the_cpus_frames(launches):
    """From its second call on new vectors of one length, a sampled top-k is made again from
    the launches its first call recorded (_launch.replay: no Python of the selection's, the
    launcher given the new addresses): the CPU's frames, indices and census on each of four
    new vectors, for sparse.encode_top checked and not, RedSync's frame and top_indices with
    census, 16-byte aligned and not; none of the later calls goes through the selection's
    launches."""
    from bitcomm.codecs import _kernels

    g = torch.Generator().manual_seed(23)
    n, k = 1_000_003, 10_000
    assert _kernels._sampling(n, k) is not None  # the premise: a sampled bound
    calls = {
        "encode_top": lambda v: sparse.encode_top(v, k, check=False),
        "encode_top checked": lambda v: sparse.encode_top(v, k),
        "redsync": lambda v: redsync.encode(v, k, "top"),
        "top_indices census": lambda v: (
            _kernels.top_indices(v, k, 1, census=True) if v.is_cuda
            else (select.select_side(v, k, 1), torch.tensor([0, min(k, int((v > 0).sum()))]))),
    }
    for shift in (0, 1):  # x 16-byte aligned, then 4 bytes past it
        for i in range(4):
            x = torch.randn(n + 1, generator=g) * 10
            x[shift : shift + 100] = 7.0  # a run of equal scores
            x = x[shift : shift + n]
            on_gpu = x.cuda() if shift == 0 else torch.cat([x[:1], x]).cuda()[1:]
            for name, call in calls.items():
                launches.clear()
                want, got = call(x), call(on_gpu)
                for w, h in zip(want if isinstance(want, tuple) else (want,),
                                got if isinstance(got, tuple) else (got,), strict=True):
                    assert torch.equal(h.cpu(), w), (shift, i, name)
                assert (launches == []) == (i > 0), (shift, i, name, len(launches))


def test_a_qsgd_call_made_again_from_its_record_gives_the_cpus_frames_and_values(launches):
    """qsgd's encoding kernel call is recorded whole with its stream key as a scalar, its
    decoding kernel call with its frame's header (_launch.replay): five new vectors, each
    with another seed, give the CPU's frames for 2, 4 and 8 bits, the frames decode on the
    GPU to the CPU's values, and only each layout's first two calls go through the launch
    wrapper (the first decode reads its header first; the next, given n, compares it in the
    kernel: another launch)."""
    g = torch.Generator().manual_seed(29)
    n = 100_003
    for width in (2, 4, 8):
        for i in range(5):
            x = torch.randn(n, generator=g)
            launches.clear()
            got = qsgd.encode(x.cuda(), width, seed=1000 * width + i)
            want = qsgd.encode(x, width, seed=1000 * width + i)
            assert torch.equal(got.cpu(), want), (width, i)
            values, used = qsgd.decode(got, n=n)
            assert used == want.numel() and values.is_cuda, (width, i)
            assert torch.equal(values.cpu(), qsgd.decode(want, n=n)[0]), (width, i)
            assert (launches == []) == (i > 1), (width, i, len(launches))


def test_the_torch_transport_moves_host_buffers_without_extra_waits():
    """The transports' staging: with NCCL a host buffer (a length, a count, the agreement's
    record) goes to the GPU, and with MPI or gloo a CUDA tensor's received bytes go back to
    it, from pinned memory without waiting for the device; every rank's part of a buffer
    received on the GPU comes back to the host in one copy: one wait, not one a rank."""
    from bitcomm.comm.base import _copy_into, _moved, _parts

    host = torch.arange(64, dtype=torch.uint8)
    on_gpu = torch.empty(64, dtype=torch.uint8, device="cuda")
    cuda = torch.device("cuda", torch.cuda.current_device())
    assert count_syncs(lambda: _moved(host, cuda)) == 0
    assert count_syncs(lambda: _copy_into(on_gpu, host)) == 0
    assert torch.equal(on_gpu.cpu(), host) and torch.equal(_moved(host, cuda).cpu(), host)
    recv = torch.arange(64, dtype=torch.uint8, device="cuda")
    assert count_syncs(lambda: _parts(recv, [16] * 4, torch.device("cpu"))) == 1
    assert [p.tolist() for p in _parts(recv, [16] * 4, torch.device("cpu"))] == [
        list(range(j, j + 16)) for j in range(0, 64, 16)]


def test_sparcml_reads_the_host_once_per_received_round():
    """Recursive doubling on the GPU: the entries' check, then per round one read for the
    frame's check and the size of the merge (the peer's length is in host memory here)."""
    from bitcomm.collectives import sparcml
    from bitcomm.comm import run_local

    n, k = 100_000, 500
    sets = [torch.randperm(n, generator=torch.Generator().manual_seed(r))[:k].sort().values
            for r in range(2)]
    vals = [torch.randn(k, generator=torch.Generator().manual_seed(10 + r)) for r in range(2)]

    on_gpu = [(ix.cuda(), v.cuda()) for ix, v in zip(sets, vals, strict=True)]

    def call(inputs):
        return run_local(lambda c: sparcml.ssar_recursive_double(
            c, *inputs[c.rank], n, check=False), 2)

    cpu, gpu = call(list(zip(sets, vals, strict=True))), call(on_gpu)
    for a, b in zip(cpu, gpu, strict=True):
        assert torch.equal(a.to_dense(), b.to_dense().cpu())
    # per rank: the entries' check, then the round's frame check with its merge's size
    assert count_syncs(lambda: call(on_gpu)) <= 2 * 2


@pytest.mark.timeout(400)
@pytest.mark.parametrize("transport", ["mpi", "gloo"])
def test_collectives_on_cuda_tensors_across_processes(transport, tmp_path):
    from test_multiprocess import run_gloo, run_mpi

    if transport == "mpi":
        r = run_mpi(3, "check-cuda")
        assert r.returncode == 0, r.stdout + r.stderr
        assert r.stdout.count("OK rank") == 3
    else:
        codes, out = run_gloo(3, "check-cuda", tmp_path)
        assert codes == [0] * 3, out


@pytest.mark.timeout(400)
@pytest.mark.skipif(torch.cuda.device_count() < 2,
                    reason="NCCL needs one GPU per rank (it refuses two ranks on one device)")
def test_collectives_over_nccl_keep_tensors_on_the_gpu(tmp_path):
    from test_multiprocess import run_gloo

    size = min(4, torch.cuda.device_count())
    codes, out = run_gloo(size, "check-cuda", tmp_path, kind="nccl")
    assert codes == [0] * size, out


def test_gpu_benchmarks_run_and_check_their_results():
    from bitcomm.bench import codecs as bench_codecs
    from bitcomm.bench.collectives import ring_steps

    rows = bench_codecs.run([1 << 16, 4097], repeat=2, device="cuda")
    names = {(r.codec, r.op) for r in rows}
    assert {("anchor", "sum"), ("anchor", "clone"), ("anchor", "ds-sign"),
            ("sign-vs-ds", "encode"), ("qsgd-4", "decode")} <= names
    assert all(r.wrong == 0 for r in rows)
    assert all(r.host_seconds > 0 for r in rows)
    # the host's time is the call's on the host, the time the device's: a call that sleeps on
    # the host leaves the device idle between the events, a spinning kernel the host free
    [(device, host)] = bench_codecs._timings([lambda: time.sleep(0.002)], 2, "cuda")
    assert host >= 0.002 and device >= 0.0015, (device, host)
    [(device, host)] = bench_codecs._timings([lambda: torch.cuda._sleep(4_000_000)], 2, "cuda")
    assert device > 4 * host and device > 0.0005, (device, host)
    steps = ring_steps(1 << 16, 4, repeat=2)
    assert [r.what for r in steps][-3:] == ["rank-total", "call", "vote count"]
    assert all(r.seconds > 0 for r in steps)
    from bitcomm.bench import select as bench_select

    picks = bench_select.run([1 << 16], [0.01], ["laplace"], repeat=1, device="cuda")
    k = 656  # ceil(0.01 * 65536)
    exact = {r.selector: r.selected for r in picks if r.mode == "exact"}
    assert exact == {"topk": k, "torch-topk": k, "trimmed": k}


def test_the_sync_count_of_each_collective_on_the_gpu():
    """The counts the CPU tests make on the GPU's paths, counted by torch on the GPU itself
    (4 ranks, 4001 elements: every payload padded)."""
    from bitcomm.bench.collectives import steady_call, syncs
    from bitcomm.collectives import registry

    got = {r.collective: r.syncs for r in syncs(4001, 4)}
    for name in ("ring-majority", "alltoall-majority", "allgather-majority", "onebit-allreduce",
                 "onebit-allgather"):
        assert got[name] == 0, (name, got)
    assert got["ring-majority-radix"] == 1, got  # its payloads' checks, at the end
    # the checks of its entries and of the frames it received, one read at the end (as
    # tests/test_collectives.py counts on the CPU)
    assert got["sparse-allgather"] == 1, got
    # tests/test_oktopk.py counts 5 reads a steady call on the CPU, one of them of host memory
    # (the pieces' counts); balancing adds one
    assert got["oktopk"] <= 5, (got, sync_sites(steady_call(
        "oktopk", [registry.standard_input(0, r, 4001).cuda() for r in range(4)])))


@pytest.mark.parametrize("kind", ["qsgd", "topk"])
def test_a_hook_step_waits_as_often_with_six_buckets_as_with_one(kind):
    """Under check=True qsgd_hook's and topk_hook's exchanges hand their checks to the step's
    one read: a step of six CUDA buckets synchronises as often as a step of one (3 ranks as
    threads; the top-k's radix selection reads nothing)."""
    from test_hooks import Bucket

    from bitcomm.comm import run_local
    from bitcomm.train.hooks import QsgdState, TopkState, qsgd_hook, topk_hook

    hook, make = {"qsgd": (qsgd_hook, lambda c: QsgdState(c, bits=4, bucket_size=64,
                                                          overlap=False)),
                  "topk": (topk_hook, lambda c: TopkState(c, density=0.05,
                                                          overlap=False))}[kind]

    def syncs(buckets):
        def rank_fn(comm):
            state = make(comm)
            params = [torch.zeros(1001, device="cuda") for _ in range(buckets)]

            # each step's gradients on the GPU beforehand: a copy from pageable host memory
            # waits for the device too, and is not the hook's
            grads = [[torch.randn(1001, generator=torch.Generator().manual_seed(
                100 * k + 10 * i + comm.rank)).cuda() for i in range(buckets)]
                for k in range(2)]

            def step(k):
                futures = [hook(state, Bucket(i, [p], [g], last=i == buckets - 1))
                           for i, (p, g) in enumerate(zip(params, grads[k], strict=True))]
                return [f.wait() for f in futures]

            step(0)  # the layout's own agreements
            return step

        steps = run_local(rank_fn, 3)
        got = []
        sites = sync_sites(lambda: got.extend(run_local(lambda c: steps[c.rank](1), 3)))
        assert all(t.is_cuda and bool(torch.isfinite(t).all()) for t in got[0])
        assert all(torch.equal(a, b) for a, b in zip(got[0], got[1], strict=True))
        return sites

    one, six = syncs(1), syncs(6)
    assert len(six) == len(one), (one, six)


def test_bench_hooks_over_nccl_runs_the_hooks_cuda_path(tmp_path):
    """One NCCL rank per GPU (NCCL refuses two on one device): DDP on the GPU with every
    bitcomm hook, overlapped (its CUDA stream) and blocking, against allreduce_hook."""
    import json
    import subprocess
    import sys

    ranks = torch.cuda.device_count()
    cmd = [sys.executable, "-m", "bitcomm.cli", "bench", "hooks", "--transport", "nccl",
           "--ranks", str(ranks), "--width", "64", "--depth", "3", "--steps", "3",
           "--repeats", "2", "--bucket-mb", "0.004,25", "--hooks",
           "sign,sign/blocking,onebit,qsgd,topk,topk/blocking", "--out", str(tmp_path)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    data = json.loads((tmp_path / f"hooks-nccl-{ranks}.json").read_text())
    assert data["config"]["transport"] == "nccl"
    hooks = {row["hook"] for row in data["rows"]}
    assert {"allreduce", "local", "sign", "sign/blocking", "onebit", "qsgd", "topk"} <= hooks
