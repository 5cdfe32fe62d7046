import inspect
import math

import numpy as np
import pytest
import torch

from bitcomm.codecs import counts, qsgd, select, sparse
from bitcomm.collectives import (
    OneBitState,
    allgather_majority,
    allgather_majority_bytes,
    allgather_majority_packed,
    allreduce,
    allreduce_bytes,
    alltoall_majority,
    alltoall_majority_bytes,
    alltoall_majority_packed,
    onebit_allreduce,
    onebit_allreduce_bytes,
    padded_length,
    qsgd_allgather,
    qsgd_allgather_bytes,
    ring_majority,
    ring_majority_bytes,
    ring_majority_packed,
    sparse_allgather,
    sparse_allgather_bytes,
)
from bitcomm.collectives.onebit import collective_for
from bitcomm.comm import run_local

from conftest import OTHER_PATHS, forced, host_reads, needs_interpreter

SIZES = [1, 2, 3, 4, 5, 8]


def inputs(size, n, seed, zeros=True):
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(n, generator=g) for _ in range(size)]
    if zeros and n:
        for r, x in enumerate(xs):  # +0 and -0 vote +1
            x[r % n] = 0.0 if r % 2 else -0.0
    return xs


def brute_majority(xs, tie="negative", phase=0):
    votes = torch.stack([(x >= 0).to(torch.int64) for x in xs]).sum(0)
    n = len(xs)
    if tie == "alternate":  # a tie goes up where index + phase is even
        even = (torch.arange(votes.numel()) + phase) % 2 == 0
        plus = (2 * votes > n) | ((2 * votes == n) & even)
    else:
        plus = 2 * votes > n if tie == "negative" else 2 * votes >= n
    return plus.float() * 2 - 1


def identical(results):
    """Bit-identical on every rank (compares the raw bytes, so -0.0 != 0.0 and NaNs count)."""
    first = results[0].contiguous().view(torch.uint8)
    return all(torch.equal(first, r.contiguous().view(torch.uint8)) for r in results[1:])


def out_runs(call, xs):
    """Run ``call(comm, x, out)`` on thread ranks (``x`` a copy of the rank's input) with
    ``out=None``; then into a separate tensor and in place (``out`` is ``x``). Return the
    first run's results and, for the other two, each rank's ``(out, result)``."""
    size = len(xs)

    def into(c):
        out = torch.full_like(xs[c.rank], 5.0)
        return out, call(c, xs[c.rank].clone(), out)

    def in_place(c):
        x = xs[c.rank].clone()
        return x, call(c, x, x)

    want = run_local(lambda c: call(c, xs[c.rank].clone(), None), size)
    return want, [run_local(into, size), run_local(in_place, size)]


def refused_out(call, xs, rank, bad):
    """Run ``call(comm, x, out)`` with ``out=bad`` on ``rank`` alone; return what each rank
    raised (or returned)."""
    return run_local(lambda c: call(c, xs[c.rank], bad if c.rank == rank else None), len(xs),
                     return_exceptions=True, timeout=20)


@pytest.mark.parametrize("path", ["numpy", *OTHER_PATHS])
@pytest.mark.parametrize("fn, kwargs", [
    (ring_majority, {}), (ring_majority, {"packing": "radix"}), (alltoall_majority, {}),
    (allgather_majority, {})])
def test_a_majority_writes_into_out_even_when_it_is_the_input(path, fn, kwargs):
    """out= receives the result and is what the call returns, also when it is x itself (a DDP
    bucket voted in place): the same +-1 as a new tensor, at 1 to 3 ranks and for float32 and
    bfloat16; an out of another dtype or shape is refused on every rank before any bytes move."""
    def call(c, x, out):
        return fn(c, x, out=out, **kwargs)

    for size in (1, 2, 3):
        for dtype in (torch.float32, torch.bfloat16):
            xs = [x.reshape(3, 333).to(dtype) for x in inputs(size, 999, seed=40 + size)]
            with forced(path):
                want, runs = out_runs(call, xs)
            for got in runs:
                for (out, result), expect in zip(got, want, strict=True):
                    assert result is out
                    assert torch.equal(out, expect), (size, dtype)
    xs = inputs(2, 100, seed=1)
    for bad, error, message in [(torch.zeros(100, dtype=torch.float64), TypeError, "float32"),
                                (torch.zeros(99), ValueError, "shape"),
                                (torch.zeros(200)[::2], ValueError, "contiguous")]:
        got = refused_out(call, xs, 1, bad)
        assert all(isinstance(e, error) for e in got) and message in str(got[1]), got


@pytest.mark.parametrize("size", SIZES)
def test_majority_equals_brute_force(size):
    for n in sorted({0, 1, max(size - 1, 0), size, 1000, 2**20 + 3}):
        xs = inputs(size, n, seed=size * 7 + n)
        for tie, phase in (("negative", 0), ("positive", 0), ("alternate", 0), ("alternate", 3)):
            expect = brute_majority(xs, tie, phase)
            if size % 2 == 0 and n >= 1000:
                # the inputs really hold ties, so the tie rule is exercised
                votes = torch.stack([(x >= 0).long() for x in xs]).sum(0)
                assert bool((2 * votes == size).any())
            for fn, kw in ((ring_majority, {"packing": "fixed"}),
                           (ring_majority, {"packing": "radix"}),
                           (alltoall_majority, {}), (allgather_majority, {})):
                out = run_local(lambda c, f=fn, kw=kw, t=tie, ph=phase: f(
                    c, xs[c.rank], tie=t, phase=ph, **kw), size, timeout=60)
                assert identical(out)
                assert torch.equal(out[0], expect), (fn.__name__, kw, n, tie, phase)


@pytest.mark.parametrize("fn", [ring_majority, alltoall_majority, allgather_majority])
def test_alternate_tie_is_unbiased(fn):
    """Two workers with opposite signs tie everywhere: the fixed rules move every element the
    same way, the alternating rule half each way within a step and back over two steps."""
    n = 1001
    x = torch.randn(n, generator=torch.Generator().manual_seed(4)).abs() + 0.1
    xs = [x, -x]
    neg = run_local(lambda c: fn(c, xs[c.rank]), 2)[0]
    assert torch.equal(neg, -torch.ones(n))
    steps = [run_local(lambda c, p=p: fn(c, xs[c.rank], tie="alternate", phase=p), 2)
             for p in (0, 1)]
    for out in steps:
        assert identical(out)
    first, second = steps[0][0], steps[1][0]
    assert first[0] == 1 and first[1] == -1 and first.sum() == 1  # 501 up, 500 down
    assert torch.equal(first + second, torch.zeros(n))


@pytest.mark.parametrize("path", ["numpy", "torch"])
@pytest.mark.parametrize("dtype", [torch.uint8, torch.int32])
def test_decide_takes_counts_of_a_byte_of_ranks_without_wrapping(path, dtype):
    """The majorities add the votes of up to 255 ranks in uint8: counts of 128 or more must
    still compare against N/2 (doubling them in uint8 would wrap 128 to 0)."""
    from bitcomm.collectives.majority import _decide

    total = torch.tensor([0, 127, 128, 200, 255, 126, 127], dtype=dtype)
    cases = {  # (size, tie, phase): the decisions expected
        (255, "negative", 0): [0, 0, 1, 1, 1, 0, 0],
        (254, "negative", 0): [0, 0, 1, 1, 1, 0, 0],
        (254, "positive", 0): [0, 1, 1, 1, 1, 0, 1],
        # start 5, phase 2: elements 0..6 at global index + phase 7..13; ties at 8 and 13
        (254, "alternate", 2): [0, 1, 1, 1, 1, 0, 0],
        (255, "positive", 0): [0, 0, 1, 1, 1, 0, 0],  # no ties with an odd number of ranks
    }
    with forced(path):
        for (size, tie, phase), expect in cases.items():
            got = _decide(total, size, tie, start=5, phase=phase)
            assert got.tolist() == [bool(e) for e in expect], (size, tie, phase)


@pytest.mark.parametrize("size", [2, 3, 5])
def test_the_majorities_tally_in_int32_beyond_a_byte_of_ranks(size, monkeypatch):
    """Beyond 255 ranks the votes add up in int32; run that branch at a few ranks."""
    from bitcomm.collectives import majority

    monkeypatch.setattr(majority, "_BYTE_RANKS", 1)
    for n in (1, 1000, (1 << 17) + 5):
        xs = inputs(size, n, seed=n + size)
        for fn, kw in ((ring_majority, {"packing": "fixed"}), (ring_majority, {"packing": "radix"}),
                       (alltoall_majority, {}), (allgather_majority, {})):
            out = run_local(lambda c, f=fn, kw=kw: f(c, xs[c.rank], tie="alternate", phase=1,
                                                     **kw), size)
            assert identical(out)
            assert torch.equal(out[0], brute_majority(xs, "alternate", 1)), (n, fn, kw)


def test_majority_keeps_shape_dtype_and_packs():
    xs = [x.reshape(3, 4).double() for x in inputs(3, 12, seed=1)]
    out = run_local(lambda c: ring_majority(c, xs[c.rank]), 3)
    assert out[0].shape == (3, 4) and out[0].dtype == torch.float64
    packed = run_local(lambda c: ring_majority_packed(c, xs[c.rank]), 3)
    bits = torch.tensor([int(b) for byte in packed[0].tolist() for b in f"{byte:08b}"][:12],
                        dtype=torch.float64) * 2 - 1
    assert torch.equal(bits, out[0].reshape(-1))
    assert packed[0].numel() == 2
    for fn in (alltoall_majority_packed, allgather_majority_packed,
               lambda c, x: ring_majority_packed(c, x, packing="radix")):
        assert all(torch.equal(p, packed[0]) for p in run_local(lambda c: fn(c, xs[c.rank]), 3))


@pytest.mark.parametrize("size", [2, 3, 5, 8])
@pytest.mark.parametrize("check", [True, False])
def test_wire_bytes_equal_the_formulas(size, check):
    for n in (0, 1, 7, 1000, 4099):
        xs = inputs(size, n, seed=n)
        for packing in counts.PACKINGS:
            got = run_local(lambda c, p=packing: (ring_majority(c, xs[c.rank], packing=p,
                                                                 check=check),
                                                  c.counters)[1], size)
            for r, cnt in enumerate(got):
                assert cnt.total_sent == ring_majority_bytes(n, size, r, packing=packing,
                                                             check=check)
            assert sum(c.total_sent for c in got) == sum(c.total_received for c in got)
        got = run_local(lambda c: (alltoall_majority(c, xs[c.rank], check=check),
                                   c.counters)[1], size)
        for r, cnt in enumerate(got):
            assert cnt.total_sent == alltoall_majority_bytes(n, size, r, check=check)
        got = run_local(lambda c: (allgather_majority(c, xs[c.rank], check=check),
                                   c.counters)[1], size)
        # every rank's ceil(n/8) bytes of signs to every other rank
        assert all(c.total_sent == (size - 1) * ((n + 7) // 8) + (24 * (size - 1) if check
                                                                  else 0) for c in got)
        assert all(c.total_sent == allgather_majority_bytes(n, size, check=check) for c in got)
        got = run_local(lambda c: (allreduce(c, xs[c.rank], check=check), c.counters)[1], size)
        assert all(c.total_sent == allreduce_bytes(n, size, check=check) for c in got)
        for collective in ("alltoall", "allgather"):
            states = [OneBitState(n, size, collective=collective) for _ in range(size)]
            got = run_local(lambda c: (onebit_allreduce(c, xs[c.rank], states[c.rank],
                                                        check=check), c.counters)[1], size)
            assert all(c.total_sent == onebit_allreduce_bytes(
                n, size, check=check, collective=collective) for c in got)
            if collective == "allgather":  # every rank's P/8 bytes of signs and its scale
                padded = states[0].worker_error.numel()
                assert all(c.total_sent == (size - 1) * (padded // 8 + 4 + 24 * check)
                           for c in got)
        k = min(n, 5)
        got = run_local(lambda c: (sparse_allgather(c, xs[c.rank], k, fmt=sparse.Qsgd(seed=1),
                                                    check=check), c.counters)[1], size)
        frame = sparse.encoded_size(n, k, "qsgd")
        assert all(c.total_sent == sparse_allgather_bytes(frame, size, check=check)
                   for c in got)


@pytest.mark.parametrize("size", [2, 3, 4, 5, 8])
def test_ring_bytes_match_the_paper(size):
    # All-Reducible signSGD, Section 3: K/N counts at ceil(log2(i+1)) bits at step i, then
    # N-1 one-bit chunks; in bits, for K a multiple of 8N.
    k = 8 * size * 25
    paper_bits = k // size * sum(math.ceil(math.log2(i + 1)) for i in range(1, size))
    paper_bits += (size - 1) * k // size
    for r in range(size):
        assert ring_majority_bytes(k, size, r, check=False) * 8 == paper_bits
    # the radix packing of three ranks' counts: steps 1 (1 bit) and 2 (base 3, 1.6 bits)
    if size == 3:
        assert ring_majority_bytes(k, 3, 0, packing="radix", check=False) < k * 2 // 8 * 3 // 3


def test_dense_allreduce_sums_in_rank_order():
    xs = inputs(5, 333, seed=4)
    out = run_local(lambda c: allreduce(c, xs[c.rank]), 5)
    expect = xs[0].clone()
    for x in xs[1:]:
        expect += x
    assert identical(out) and torch.equal(out[0], expect)


@pytest.mark.parametrize("fmt", ["fp32", "fp16"])
def test_sparse_allgather_sums_top_k(fmt):
    size, n, k = 4, 1000, 37
    xs = inputs(size, n, seed=8, zeros=False)
    out = run_local(lambda c: sparse_allgather(c, xs[c.rank], k, fmt=fmt), size)
    expect = torch.zeros(n)
    for x in xs:
        idx = torch.topk(x.abs(), k).indices  # random normals: no ties
        vals = x[idx] if fmt == "fp32" else x[idx].half().float()
        expect.index_add_(0, idx, vals)
    dense = [d for d, _ in out]
    assert identical(dense)
    assert torch.allclose(dense[0], expect, rtol=0, atol=1e-6)
    for (_, (idx, _vals)), x in zip(out, xs, strict=True):
        assert sorted(idx.tolist()) == sorted(torch.topk(x.abs(), k).indices.tolist())


@pytest.mark.parametrize("fmt", ["qsgd", "mean"])
def test_sparse_allgather_sum_of_what_was_sent(fmt):
    size, n, k = 3, 5000, 100
    xs = inputs(size, n, seed=9, zeros=False)
    sides = ("top", "bottom") if fmt == "mean" else (None,)
    form = sparse.Qsgd(seed=3) if fmt == "qsgd" else fmt
    for side in sides:
        out = run_local(lambda c, s=side: sparse_allgather(c, xs[c.rank], k, fmt=form, side=s),
                        size)
        expect = torch.zeros(n)
        for _, (idx, vals) in out:
            expect.index_add_(0, idx.long(), vals)
        assert identical([d for d, _ in out])
        assert torch.equal(out[0][0], expect)
        if fmt == "mean":
            for (_, (idx, vals)), x in zip(out, xs, strict=True):
                sel = x[idx.long()]
                assert bool((sel > 0).all()) if side == "top" else bool((sel < 0).all())
                assert torch.allclose(vals, sel.mean().expand_as(vals))


@pytest.mark.parametrize("method", ["topk", "threshold"])
@pytest.mark.parametrize("path", ["torch", pytest.param(
    "triton", marks=[needs_interpreter, pytest.mark.triton])])
def test_sparse_allgather_of_qsgd_values_reads_the_host_as_often_at_any_number_of_ranks(
        path, method):
    """Off the numpy path (CUDA) the received frames of qsgd values are checked in one host
    read (headers, indices and qsgd blocks), not a few reads a frame, whether their lengths
    are k's (topk) or each frame's own (threshold: its size says how many entries it holds).
    With topk a rank reads once whatever the ranks: its own entries' and qsgd scales' checks
    ride on that read; a threshold search adds its own reads and the lengths."""
    fmt = sparse.Qsgd(bits=4, bucket=64, seed=1)
    per_rank = []
    for size in (2, 4):
        reads = _sparse_allgather_reads(path, size, fmt, method)
        assert len(reads) % size == 0, reads
        per_rank.append(len(reads) // size)
    assert per_rank[0] == per_rank[1], per_rank
    if method == "topk":
        assert per_rank[0] == 1, per_rank


def test_sparse_allgather_takes_qsgd_settings_as_its_value_format():
    size, n, k = 3, 500, 20
    xs = inputs(size, n, seed=12, zeros=False)
    fmt = sparse.Qsgd(bits=8, bucket=16, seed=40)
    out = run_local(lambda c: sparse_allgather(c, xs[c.rank], k, fmt=fmt), size)
    for r, (_, (idx, vals)) in enumerate(out):
        # rank r draws its own stream from seed + r, so ranks' rounding errors are independent
        expect, _ = qsgd.decode(qsgd.encode(xs[r][idx], 8, 16, seed=40 + r))
        assert torch.equal(vals, expect)
    # a side chooses which signed tail a mean frame sends: meaningless for other formats
    with pytest.raises(ValueError, match="side"):
        run_local(lambda c: sparse_allgather(c, xs[c.rank], k, side="bottom"), 1)


def onebit_reference(xs, worker_errors, server_errors):
    """DeepSpeed's compressed_allreduce for all ranks at once, written from its algorithm."""
    size = len(xs)
    length = worker_errors[0].numel()
    chunk = length // size
    signs, scales = [], []
    for r, x in enumerate(xs):
        buf = torch.zeros(length)
        buf[: x.numel()] = x.reshape(-1)
        buf += worker_errors[r]
        scale = buf.norm() / math.sqrt(length)
        pm = torch.where(buf >= 0, 1.0, -1.0)
        worker_errors[r] = buf - scale * pm
        signs.append(pm)
        scales.append(scale)
    server_signs, server_scales = [], []
    for r in range(size):
        comp = sum(signs[j][r * chunk:(r + 1) * chunk] * (scales[j] / size) for j in range(size))
        comp = comp + server_errors[r]
        scale = comp.norm() / math.sqrt(chunk)
        pm = torch.where(comp >= 0, 1.0, -1.0)
        server_errors[r] = comp - scale * pm
        server_signs.append(pm)
        server_scales.append(scale)
    out = torch.cat([server_scales[r] * server_signs[r] for r in range(size)])
    return out[: xs[0].numel()].reshape(xs[0].shape)


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_onebit_allreduce_matches_reference_over_calls(size):
    n = 1001
    states = [OneBitState(n, size) for _ in range(size)]
    werr = [torch.zeros_like(states[0].worker_error) for _ in range(size)]
    serr = [torch.zeros_like(states[0].server_error) for _ in range(size)]
    assert states[0].worker_error.numel() % (size * math.lcm(size, 8)) == 0
    for step in range(4):
        xs = [x.reshape(7, 143) for x in inputs(size, n, seed=100 + step)]
        out = run_local(lambda c: onebit_allreduce(c, xs[c.rank], states[c.rank]), size)
        expect = onebit_reference(xs, werr, serr)
        assert identical(out)
        assert out[0].shape == (7, 143)
        torch.testing.assert_close(out[0], expect, rtol=1e-5, atol=1e-6)
        for r in range(size):
            torch.testing.assert_close(states[r].worker_error, werr[r], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(states[r].server_error, serr[r], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("size", [1, 2, 3, 5])
def test_onebit_allgather_gives_the_alltoalls_result_bit_for_bit(size):
    """Every rank serving every chunk makes the all-to-all's floats: the same output, worker
    errors and (chunk by chunk) server errors over calls that feed the errors back."""
    n = 1001
    a = [OneBitState(n, size) for _ in range(size)]
    b = [OneBitState(n, size, collective="allgather") for _ in range(size)]
    chunk = a[0].server_error.numel()
    assert b[0].server_error.numel() == size * chunk
    for step in range(4):
        xs = inputs(size, n, seed=200 + step)
        xs[0][:2] = torch.tensor([0.0, -0.0])  # +1 votes, as DeepSpeed's
        want = run_local(lambda c: onebit_allreduce(c, xs[c.rank], a[c.rank], check=False),
                         size)
        got = run_local(lambda c: onebit_allreduce(c, xs[c.rank], b[c.rank], check=False),
                        size)
        assert all(torch.equal(g, want[0]) for g in got)
        for r in range(size):
            assert torch.equal(b[r].worker_error, a[r].worker_error)
            for j in range(size):
                assert torch.equal(b[r].server_error[j * chunk:(j + 1) * chunk],
                                   a[j].server_error)


@pytest.mark.parametrize("n", [1001, 3 * 4096 + 5])
@pytest.mark.parametrize("collective", ["alltoall", "allgather"])
def test_onebit_numpy_path_gives_the_torch_paths_bits(monkeypatch, collective, n):
    """On CPU tensors the sign and error steps set the scale's sign bit instead of multiplying
    by +-1: outputs and both errors must keep the torch path's bits over calls, with -0.0, a
    scale of 0 with negative elements (-1e-30 squares to 0) and NaN (a NaN scale takes the
    multiplying path). From _jit.MIN_VALUES values (the larger n: every chunk) numba's loops
    compress and decompress."""
    from bitcomm.codecs import _jit
    from bitcomm.collectives import _onebit_cpu

    calls = []
    for name in ("sign_error", "scaled_signs"):
        compiled = getattr(_onebit_cpu, name)
        monkeypatch.setattr(_onebit_cpu, name, lambda *a, f=compiled, k=name: calls.append(k)
                            or f(*a))
    size = 3
    runs = {}
    for path in ("numpy", "torch"):
        states = [OneBitState(n, size, collective=collective) for _ in range(size)]
        outs = []
        for step in range(5):
            xs = inputs(size, n, seed=300 + step)
            xs[1][:3] = torch.tensor([0.0, -0.0, -1e-30])
            if step == 0:
                xs = [torch.zeros(n).index_fill_(0, torch.arange(r, n, 7), -1e-30)
                      for r in range(size)]
            if step == 4:
                xs[2][5] = float("nan")
            with forced(path):
                outs.append(run_local(lambda c: onebit_allreduce(
                    c, xs[c.rank], states[c.rank], check=False), size))
        runs[path] = outs, states
    (a, sa), (b, sb) = runs["numpy"], runs["torch"]
    for step in range(5):
        assert identical(a[step] + b[step]), step
    assert a[0][0].eq(0).all() and a[4][0].isnan().any()  # the cases happened
    for r in range(size):
        assert identical([sa[r].worker_error, sb[r].worker_error])
        assert identical([sa[r].server_error, sb[r].server_error])
    large = sa[0].worker_error.numel() // size >= _jit.MIN_VALUES
    assert set(calls) == ({"sign_error", "scaled_signs"} if large else set()), (n, set(calls))


@pytest.mark.parametrize("path", ["numpy", "torch", pytest.param(
    "triton", marks=[needs_interpreter, pytest.mark.triton])])
@pytest.mark.parametrize("collective", ["alltoall", "allgather"])
def test_onebit_allreduce_binds_new_errors_and_leaves_the_old_ones(path, collective):
    """A call's errors are new tensors bound to the state: the tensors it held before keep
    their values (a caller goes back to them without a copy), and the new ones are the
    errors of DeepSpeed's algorithm."""
    size, n = 3, 1001
    states = [OneBitState(n, size, collective=collective) for _ in range(size)]
    werr = [torch.zeros_like(states[0].worker_error) for _ in range(size)]
    serr = [torch.zeros(states[0].worker_error.numel() // size) for _ in range(size)]
    for step in range(2):
        xs = inputs(size, n, seed=500 + step)
        old = [(s.worker_error, s.server_error, s.worker_error.clone(), s.server_error.clone())
               for s in states]
        with forced(path):
            run_local(lambda c: onebit_allreduce(c, xs[c.rank], states[c.rank]), size)
        onebit_reference(xs, werr, serr)
        for r, (w, s, w_was, s_was) in enumerate(old):
            assert states[r].worker_error is not w and states[r].server_error is not s
            assert torch.equal(w, w_was) and torch.equal(s, s_was), (step, r)
            torch.testing.assert_close(states[r].worker_error, werr[r], rtol=1e-5, atol=1e-6)
            served = (states[r].server_error if collective == "alltoall" else
                      states[r].server_error.reshape(size, -1)[r])
            torch.testing.assert_close(served, serr[r], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("path", ["numpy", *OTHER_PATHS])
@pytest.mark.parametrize("collective", ["alltoall", "allgather"])
def test_onebit_allreduce_writes_into_out_even_when_it_is_the_input(path, collective):
    """out= receives the result and is returned, also when it is x itself: the bits of a new
    tensor, and the same new errors; an out of another dtype is refused on every rank."""
    size, n = 3, 1001
    xs = [x.reshape(7, 143) for x in inputs(size, n, seed=14)]

    def run(make_out):
        states = [OneBitState(n, size, collective=collective) for _ in range(size)]

        def rank_fn(c):
            x = xs[c.rank].clone()
            out = make_out(x)
            return out, onebit_allreduce(c, x, states[c.rank], out=out)

        with forced(path):
            return run_local(rank_fn, size), states

    want, errors = run(lambda x: None)
    for make_out in (lambda x: torch.full_like(x, 5.0), lambda x: x):
        got, states = run(make_out)
        for r, ((out, result), (_, expect)) in enumerate(zip(got, want, strict=True)):
            assert result is out and torch.equal(result, expect)
            assert torch.equal(states[r].worker_error, errors[r].worker_error)
            assert torch.equal(states[r].server_error, errors[r].server_error)
    states = [OneBitState(n, size, collective=collective) for _ in range(size)]
    got = refused_out(lambda c, x, out: onebit_allreduce(c, x, states[c.rank], out=out), xs, 1,
                      torch.zeros(7, 143, dtype=torch.float16))
    assert all(isinstance(e, TypeError) for e in got) and "float32" in str(got[1]), got


@pytest.mark.parametrize("collective", ["alltoall", "allgather"])
def test_a_failed_onebit_call_leaves_the_state_as_it_was(collective):
    """An exchange that fails after the worker error was computed leaves the state's errors
    the tensors and values they were."""
    state = OneBitState(100, 2, collective=collective)

    def fail(*args, **kwargs):
        raise RuntimeError("link down")

    def rank_fn(comm):
        x = torch.randn(100, generator=torch.Generator().manual_seed(comm.rank))
        onebit_allreduce(comm, x, state if comm.rank == 0 else OneBitState(
            100, 2, collective=collective), check=False)
        comm.barrier()
        if comm.rank == 0:
            was = (state.worker_error, state.server_error, state.worker_error.clone(),
                   state.server_error.clone())
            comm.alltoallv = comm.allgatherv = fail
            with pytest.raises(RuntimeError, match="link down"):
                onebit_allreduce(comm, x, state, check=False)
            assert state.worker_error is was[0] and state.server_error is was[1]
            assert torch.equal(was[0], was[2]) and torch.equal(was[1], was[3])
            assert was[2].abs().sum() > 0  # the first call left errors to keep

    run_local(rank_fn, 2)


def test_onebit_collective_names():
    assert collective_for("auto", 2) == "allgather"
    assert collective_for("auto", 3) == collective_for("alltoall", 2) == "alltoall"
    assert OneBitState(10, 2, collective="auto").server_error.numel() == 16
    assert OneBitState(10, 3, collective="auto").server_error.numel() == 24
    with pytest.raises(ValueError, match="expected collective in"):
        OneBitState(10, 2, collective="ring")
    with pytest.raises(ValueError, match="expected collective in"):
        onebit_allreduce_bytes(10, 2, collective="ring")
    saved = OneBitState(10, 3, collective="allgather").state_dict()
    with pytest.raises(ValueError, match="'alltoall' collective, got one of 'allgather'"):
        OneBitState(10, 3).load_state_dict(saved)


@pytest.mark.parametrize("path", ["numpy", "torch"])
@pytest.mark.parametrize("fn", [alltoall_majority, allgather_majority])
def test_a_vote_payload_with_padding_bits_set_is_refused(fn, path, monkeypatch):
    """Rank 1 sends votes whose padding bits are not zero (a corrupt frame): every rank counts
    some of them, and each raises rather than count a vote that no element cast."""
    from bitcomm.codecs import sign

    honest = sign.pack

    def corrupt(v):  # rank 1's input is all 7s
        out = honest(v)
        if v.numel() and bool(v[0] == 7):
            out = out.clone()
            out[-1] |= 1
        return out

    monkeypatch.setattr(sign, "pack", corrupt)
    n = 13  # every rank's votes (and both chunks of the all-to-all) end in padding bits
    with forced(path):
        out = run_local(lambda c: fn(c, torch.full((n,), -1.0 + 8 * c.rank), check=False), 2,
                        return_exceptions=True, timeout=10)
    assert all(isinstance(e, ValueError) and "padding bits must be zero" in str(e)
               for e in out), out


def test_onebit_state_round_trip_and_checks():
    s = OneBitState(10, 3)
    s.worker_error.normal_()
    t = OneBitState(10, 3)
    t.load_state_dict(s.state_dict())
    assert torch.equal(t.worker_error, s.worker_error)
    with pytest.raises(ValueError, match="multiple of 8 \\* size = 24"):
        OneBitState(10, 3, length=30)
    with pytest.raises(ValueError, match="expected a state for numel=11, size=3, got numel=10"):
        OneBitState(11, 3).load_state_dict(s.state_dict())


ALL = {
    "ring": lambda c, x: ring_majority(c, x),
    "alltoall": lambda c, x: alltoall_majority(c, x),
    "allgather": lambda c, x: allgather_majority(c, x),
    "onebit": lambda c, x: onebit_allreduce(c, x, OneBitState(8, c.size)),
    "sparse": lambda c, x: sparse_allgather(c, x, 2),
    "dense": lambda c, x: allreduce(c, x),
}


@pytest.mark.parametrize("name", sorted(ALL))
def test_bad_input_raises_on_every_rank(name):
    fn = ALL[name]

    def with_nan(c):
        x = torch.ones(8)
        if c.rank == 2:
            x[3] = float("nan")
        return fn(c, x)
    out = run_local(with_nan, 4, return_exceptions=True, timeout=10)
    assert all(isinstance(e, ValueError) and "NaN or inf on rank(s) [2]" in str(e) for e in out)

    def beyond_float32(c):
        # finite in float64, inf once cast to the float32 the value collectives compute in
        x = torch.ones(8, dtype=torch.float64)
        if c.rank == 1:
            x[5] = 1e300
        return fn(c, x)
    out = run_local(beyond_float32, 3, return_exceptions=True, timeout=10)
    if name in ("ring", "alltoall", "allgather"):  # only signs are used: 1e300 votes +1
        assert all(torch.equal(o, torch.ones(8, dtype=torch.float64)) for o in out), out
    else:
        assert all(isinstance(e, ValueError) and "float32's range on rank(s) [1]" in str(e)
                   for e in out), out

    def uneven(c):
        return fn(c, torch.ones(8 + (c.rank == 1)))
    out = run_local(uneven, 3, return_exceptions=True, timeout=10)
    assert all(isinstance(e, ValueError) and "[8, 9, 8]" in str(e) for e in out)

    def ints(c):
        return fn(c, torch.ones(8, dtype=torch.int32) if c.rank == 0 else torch.ones(8))
    out = run_local(ints, 3, return_exceptions=True, timeout=10)
    assert all(isinstance(e, TypeError) and "rank(s) [0]" in str(e) for e in out)


def test_unchecked_input_skips_the_agreement():
    x = torch.ones(8)
    x[0] = float("inf")
    out = run_local(lambda c: (ring_majority(c, x, check=False), c.counters.total_sent), 3)
    assert out[0][1] == ring_majority_bytes(8, 3, 0, check=False)


@pytest.mark.parametrize("size", [2, 4])
def test_the_agreement_reads_the_host_twice_at_any_number_of_ranks(size):
    """On a device the agreement waits for its input's finiteness check, then for the
    records every rank sent: one read of all of them, not one per rank."""
    xs = inputs(size, 1001, seed=3)

    def job():
        return run_local(lambda c: allreduce(c, xs[c.rank]), size)

    with forced("torch"):
        got = job()
        reads = host_reads(job)
        unchecked = run_local(lambda c: allreduce(c, xs[c.rank], check=False), size)
        assert not host_reads(lambda: run_local(
            lambda c: allreduce(c, xs[c.rank], check=False), size))
    assert len(reads) == 2 * size, reads
    assert identical(got) and all(torch.equal(g, u) for g, u in zip(got, unchecked, strict=True))


def test_bad_options():
    with pytest.raises(ValueError, match="tie in"):
        run_local(lambda c: ring_majority(c, torch.ones(3), tie="up"), 1)
    with pytest.raises(TypeError, match="phase to be an int"):
        run_local(lambda c: ring_majority(c, torch.ones(3), tie="alternate", phase=1.0), 1)
    with pytest.raises(ValueError, match="phase >= 0"):
        run_local(lambda c: alltoall_majority(c, torch.ones(3), tie="alternate", phase=-1), 1)
    # ranks at different phases would decide ties differently: refused on every rank
    with pytest.raises(ValueError, match="phase"):
        run_local(lambda c: ring_majority(c, torch.ones(3), tie="alternate", phase=c.rank), 2)
    with pytest.raises(ValueError, match="packing in"):
        run_local(lambda c: ring_majority(c, torch.ones(3), packing="zip"), 1)
    with pytest.raises(ValueError, match="fmt in"):
        run_local(lambda c: sparse_allgather(c, torch.ones(3), 1, fmt="fp8"), 1)
    with pytest.raises(ValueError, match="k <= 3"):
        run_local(lambda c: sparse_allgather(c, torch.ones(3), 4), 1)
    with pytest.raises(TypeError, match="OneBitState"):
        run_local(lambda c: onebit_allreduce(c, torch.ones(3), None), 1)
    with pytest.raises(ValueError, match="method in .* got 'sorted'"):
        run_local(lambda c: sparse_allgather(c, torch.ones(3), 1, method="sorted"), 1)
    for k in (True, 1.0):
        with pytest.raises(TypeError, match="k to be an int"):
            run_local(lambda c, k=k: sparse_allgather(c, torch.ones(3), k), 1)
    with pytest.raises(ValueError, match="side applies to fmt='mean' only"):
        run_local(lambda c: sparse_allgather(c, torch.ones(3), 1, side="top"), 1)
    with pytest.raises(ValueError, match="side in .* got 'up'"):
        run_local(lambda c: sparse_allgather(c, torch.ones(3), 1, fmt="mean", side="up"), 1)
    with pytest.raises(TypeError, match="average to be a bool"):
        run_local(lambda c: sparse_allgather(c, torch.ones(3), 1, average=1), 1)
    # without the agreement each rank still refuses what it cannot compute with
    with pytest.raises(TypeError, match="floating-point torch.Tensor, got a tensor of dtype "
                                        "torch.int32 on rank 0"):
        run_local(lambda c: allreduce(c, torch.ones(3, dtype=torch.int32), check=False), 1)
    with pytest.raises(TypeError, match="floating-point torch.Tensor, got list on rank 0"):
        run_local(lambda c: ring_majority(c, [1.0, -1.0], check=False), 1)


def test_a_failing_rank_stops_the_others_quickly():
    def fn(c):
        if c.rank == 1:
            raise RuntimeError("boom")
        return ring_majority(c, torch.ones(100))
    out = run_local(fn, 4, return_exceptions=True, timeout=30)
    assert str(out[1]) == "boom"
    assert all(isinstance(e, RuntimeError) and "rank 1 failed" in str(e)
               for r, e in enumerate(out) if r != 1)


def test_a_silent_rank_makes_the_others_time_out():
    def fn(c):
        if c.rank == 0:
            return None  # never joins
        return ring_majority(c, torch.ones(100))
    out = run_local(fn, 3, return_exceptions=True, timeout=0.5)
    # the first rank to give up times out; it then releases the other at its next wait
    assert any(isinstance(e, TimeoutError) for e in out[1:])
    assert all(isinstance(e, (TimeoutError, RuntimeError)) and "waited 0.5 s for 24 bytes from "
               "rank 0" in str(e) for e in out[1:])


def test_torch_only_codec_path_gives_the_same_results():
    """The codecs' torch-only path (what CUDA tensors take) changes no collective's result."""
    size, n = 4, 10007
    xs = inputs(size, n, seed=21)

    def fn(c):
        x = xs[c.rank]
        return [ring_majority(c, x), ring_majority(c, x, packing="radix"),
                alltoall_majority(c, x), sparse_allgather(c, x, 100, fmt=sparse.Qsgd(seed=1))[0],
                onebit_allreduce(c, x, OneBitState(n, size))]
    fast = run_local(fn, size)
    with forced("torch"):
        slow = run_local(fn, size)
    for a, b in zip(fast, slow, strict=True):
        assert all(torch.equal(p, q) for p, q in zip(a, b, strict=True))


@pytest.mark.parametrize("size", [1, 2, 4])
@pytest.mark.parametrize("check", [True, False])
def test_qsgd_allgather_mean_and_bytes(size, check):
    n, bits, bucket = 1000, 4, 512
    xs = [torch.randn(n, generator=torch.Generator().manual_seed(r)) for r in range(size)]

    def fn(c):
        c.counters.reset()
        mean, sent = qsgd_allgather(c, xs[c.rank], bits=bits, bucket=bucket, seed=9,
                                    check=check)
        return mean, sent, c.counters.total_sent

    out = run_local(fn, size, timeout=30)
    # each rank's frame decoded by hand, added in rank order
    decoded = [qsgd.decode(qsgd.encode(xs[r], bits, bucket, seed=9 + r))[0] for r in range(size)]
    total = torch.zeros(n)
    for d in decoded:
        total += d
    for r, (mean, sent, nbytes) in enumerate(out):
        assert torch.equal(mean, out[0][0])
        torch.testing.assert_close(mean, total / size, rtol=0, atol=0)
        assert torch.equal(sent, decoded[r])
        assert nbytes == qsgd_allgather_bytes(n, size, bits=bits, bucket=bucket, check=check)
    if size == 4 and check:
        assert qsgd_allgather_bytes(n, size, bits=bits, bucket=bucket) == 3 * 522 + 3 * 24


@pytest.mark.parametrize("path", ["numpy", *OTHER_PATHS])
@pytest.mark.parametrize("fmt, method", [("fp32", "topk"), ("mean", "topk"),
                                         ("fp32", "threshold")])
def test_sparse_allgather_writes_its_sum_into_out_even_when_it_is_the_input(path, fmt, method):
    """out= receives the dense sum and is returned, also when it is x itself: the bits of a
    new tensor, and the same entries; an out of another shape is refused on every rank."""
    size = 3
    xs = [x.reshape(3, 333) for x in inputs(size, 999, seed=13)]

    def call(c, x, out):
        return sparse_allgather(c, x, 20, fmt=fmt, method=method, out=out)

    with forced(path):
        want, runs = out_runs(call, xs)
    for got in runs:
        for (out, (dense, (idx, val))), (dense0, (idx0, val0)) in zip(got, want, strict=True):
            assert dense is out and torch.equal(dense, dense0)
            assert torch.equal(idx, idx0) and torch.equal(val, val0)
    got = refused_out(call, xs, 0, torch.zeros(999))
    assert all(isinstance(e, ValueError) for e in got) and "shape" in str(got[0]), got


@pytest.mark.parametrize("path", ["numpy", *OTHER_PATHS])
@pytest.mark.parametrize("fmt", ["fp32", "mean", "qsgd"])
def test_sparse_allgather_average_is_the_dense_sum_divided(path, fmt):
    """average=True gives the bits of the sum divided by N (torch's division by a Python
    number) at 1 and 3 ranks, where frames share indices (k is a third of n) and where they do
    not; ranks that disagree on it raise on every rank."""
    for size in (1, 3):
        for n, k in ((300, 100), (3000, 10)):
            xs = inputs(size, n, seed=size + n)
            form = sparse.Qsgd(seed=3) if fmt == "qsgd" else fmt
            with forced(path):
                summed = run_local(lambda c, xs=xs, k=k, form=form: sparse_allgather(
                    c, xs[c.rank], k, fmt=form), size)
                averaged = run_local(lambda c, xs=xs, k=k, form=form: sparse_allgather(
                    c, xs[c.rank], k, fmt=form, average=True), size)
            for (total, entries), (mean, entries2) in zip(summed, averaged, strict=True):
                assert torch.equal(mean.view(torch.int32),
                                   total.div(size).view(torch.int32)), (size, n)
                assert all(torch.equal(a, b) for a, b in zip(entries, entries2, strict=True))
    xs = inputs(2, 300, seed=1)
    got = run_local(lambda c: sparse_allgather(c, xs[c.rank], 10, average=c.rank == 0), 2,
                    return_exceptions=True, timeout=20)
    assert all(isinstance(e, ValueError) for e in got), got
    with pytest.raises(TypeError, match="average"):
        run_local(lambda c: sparse_allgather(c, xs[c.rank], 10, average=1), 1)


@pytest.mark.parametrize("path", ["numpy", *OTHER_PATHS])
@pytest.mark.parametrize("residual", [False, True])
def test_qsgd_allgather_writes_its_mean_into_out_even_when_it_is_the_input(path, residual):
    """out= receives the mean and is returned, also when it is x itself (then the residual is
    still x less what was sent, x as it was): the bits of a new tensor; an out of another
    dtype is refused on every rank."""
    size, n = 3, 1001
    xs = [x.reshape(7, 143) for x in inputs(size, n, seed=12)]

    def call(c, x, out):
        return qsgd_allgather(c, x, bits=4, bucket=100, seed=2, residual=residual, out=out)

    with forced(path):
        want, runs = out_runs(call, xs)
    for got in runs:
        for (out, (mean, second)), (mean0, second0) in zip(got, want, strict=True):
            assert mean is out and torch.equal(mean.view(torch.int32), mean0.view(torch.int32))
            assert torch.equal(second.view(torch.int32), second0.view(torch.int32))
    got = refused_out(call, xs, 2, torch.zeros(7, 143, dtype=torch.float64))
    assert all(isinstance(e, TypeError) for e in got) and "float32" in str(got[2]), got


@pytest.mark.parametrize("path", ["numpy", "torch", pytest.param(
    "triton", marks=[needs_interpreter, pytest.mark.triton])])
def test_qsgd_allgather_residual_is_x_less_what_was_sent(path):
    """residual=True gives error feedback's residual in place of ``sent``: x (as float32)
    less this rank's decoded frame, bit for bit, on every path and for float64 input; the
    mean is unchanged and x is left as it was."""
    n, bits, bucket = 1001, 4, 100
    xs = [torch.randn(n, generator=torch.Generator().manual_seed(r), dtype=torch.float64)
          for r in range(3)]

    def fn(c, residual):
        x = xs[c.rank].clone()
        mean, second = qsgd_allgather(c, x, bits=bits, bucket=bucket, seed=5, check=False,
                                      residual=residual)
        assert torch.equal(x, xs[c.rank])
        return mean, second

    with forced(path):
        plain = run_local(lambda c: fn(c, False), 3)
        left = run_local(lambda c: fn(c, True), 3)
    for r, ((mean, sent), (mean2, residual)) in enumerate(zip(plain, left, strict=True)):
        assert torch.equal(mean.view(torch.int32), mean2.view(torch.int32))
        want = xs[r].float().numpy() - sent.numpy()
        assert residual.dtype == torch.float32
        assert np.array_equal(residual.numpy().view(np.int32), want.view(np.int32)), r


def _inconsistent_cases(n=40):
    """Calls where rank 0 differs from the others: name -> (call(comm, x), error type, text).

    Mixed collectives and mixed options must be refused by the agreement; arguments that only
    one rank gets wrong must be reported on every rank. Shared with tests/mp_worker.py.
    """
    def first(other, mine):
        return lambda c, x: (mine if c.rank == 0 else other)(c, x)

    def state(pad=0, collective="alltoall"):  # pad: extra groups of 8 * size elements
        return lambda c, x: onebit_allreduce(c, x, OneBitState(
            n, c.size, length=padded_length(n, c.size) + 8 * c.size * pad,
            collective=collective))

    calls = "different calls"
    return {
        "collective": (first(ring_majority, alltoall_majority), ValueError, calls),
        "collective-allgather": (first(allgather_majority, alltoall_majority), ValueError,
                                 calls),
        "packing": (first(ring_majority, lambda c, x: ring_majority(c, x, packing="radix")),
                    ValueError, calls),
        "tie": (first(alltoall_majority, lambda c, x: alltoall_majority(c, x, tie="positive")),
                ValueError, calls),
        "qsgd-bits": (first(lambda c, x: qsgd_allgather(c, x, bits=4),
                            lambda c, x: qsgd_allgather(c, x, bits=2)), ValueError, calls),
        "sparse-k": (first(lambda c, x: sparse_allgather(c, x, 3),
                           lambda c, x: sparse_allgather(c, x, 5)), ValueError, calls),
        "sparse-fmt": (first(lambda c, x: sparse_allgather(c, x, 3),
                             lambda c, x: sparse_allgather(c, x, 3, fmt="qsgd")), ValueError,
                       calls),
        "onebit-length": (first(state(), state(pad=1)), ValueError, calls),
        "onebit-collective": (first(state(), state(collective="allgather")), ValueError, calls),
        "k-above-n": (first(lambda c, x: sparse_allgather(c, x, 3),
                            lambda c, x: sparse_allgather(c, x, n + 1)), ValueError,
                      "invalid arguments on rank(s) [0]"),
        "k-negative": (first(lambda c, x: sparse_allgather(c, x, 3),
                             lambda c, x: sparse_allgather(c, x, -1)), ValueError,
                       "invalid arguments on rank(s) [0]"),
        "qsgd-bits-3": (first(qsgd_allgather, lambda c, x: qsgd_allgather(c, x, bits=3)),
                        ValueError, "invalid arguments on rank(s) [0]"),
        "bad-tie": (first(ring_majority, lambda c, x: ring_majority(c, x, tie="sideways")),
                    ValueError, "invalid arguments on rank(s) [0]"),
        "fp16-overflow": (first(lambda c, x: sparse_allgather(c, x, 3, fmt="fp16"),
                                lambda c, x: sparse_allgather(c, x * 1e5, 3, fmt="fp16")),
                          OverflowError, "invalid arguments on rank(s) [0]"),
        "no-state": (first(state(), lambda c, x: onebit_allreduce(c, x, None)), TypeError,
                     "invalid arguments on rank(s) [0]"),
    }


@pytest.mark.parametrize("size", [2, 3, 5])
@pytest.mark.parametrize("case", sorted(_inconsistent_cases()))
def test_inconsistent_calls_raise_the_same_exception_on_every_rank(case, size):
    call, kind, text = _inconsistent_cases()[case]
    x = torch.randn(40, generator=torch.Generator().manual_seed(size))
    out = run_local(lambda c: call(c, x), size, return_exceptions=True, timeout=10)
    assert all(type(e) is kind and text in str(e) for e in out), out


def test_equal_calls_spelled_differently_agree():
    # "qsgd" is Qsgd(); seeds may differ (each rank offsets its own); no side is "top"
    x = torch.randn(40)

    def fn(c):
        fmt = "qsgd" if c.rank == 0 else sparse.Qsgd(seed=c.rank)
        side = None if c.rank == 0 else "top"
        return (sparse_allgather(c, x, 3, fmt=fmt)[0], sparse_allgather(c, x, 3, fmt="mean",
                                                                         side=side)[0],
                qsgd_allgather(c, x, seed=c.rank)[0])
    out = run_local(fn, 3, timeout=10)
    assert all(torch.equal(a, b) for r in out[1:] for a, b in zip(r, out[0], strict=True))


@pytest.mark.parametrize("size", [2, 3, 5])
def test_onebit_allreduce_sends_two_messages_per_peer(size):
    """The scales ride with the signs: two exchanges (three with the agreement), whose latency
    is what a small tensor pays, and the documented bytes."""
    n = 100
    xs = [torch.randn(n, generator=torch.Generator().manual_seed(r)) for r in range(size)]
    for check, rounds in ((False, 2), (True, 3)):
        states = [OneBitState(n, size) for _ in range(size)]

        def call(c, states=states, check=check):
            c.trace = []
            out = onebit_allreduce(c, xs[c.rank], states[c.rank], check=check)
            return out, list(c.trace)

        got = run_local(call, size)
        for r, (_, trace) in enumerate(got):
            assert sorted(dest for dest, _, _ in trace) == sorted(
                [d for d in range(size) if d != r] * rounds)
            assert sum(b for _, b, _ in trace) == onebit_allreduce_bytes(n, size, check=check)
        assert all(torch.equal(got[0][0], out) for out, _ in got)


@pytest.mark.parametrize("size", [2, 4])
def test_sparse_allgather_frame_lengths_ride_in_the_agreement(size):
    """With the agreement, each peer gets two messages (the record, holding the frame's length,
    then the frame), not three; without it the lengths take a round of their own."""
    n, k = 300, 7
    xs = [torch.randn(n, generator=torch.Generator().manual_seed(r)) for r in range(size)]
    results = {}
    for check, rounds in ((True, 2), (False, 2)):
        def call(c, check=check):
            c.trace = []
            out, _ = sparse_allgather(c, xs[c.rank], k, method="threshold", check=check)
            return out, list(c.trace)

        got = run_local(call, size)
        for r, (_, trace) in enumerate(got):
            assert sorted(dest for dest, _, _ in trace) == sorted(
                [d for d in range(size) if d != r] * rounds)
        results[check] = got[0][0]
        assert all(torch.equal(got[0][0], out) for out, _ in got)
    assert torch.equal(results[True], results[False])
    # the lengths differ between ranks (threshold selects about k): each frame arrives whole
    expect = torch.zeros(n)
    for x in xs:
        idx = select.select(x.abs(), k, "threshold")
        expect[idx] += x[idx]
    assert torch.equal(results[True], expect)


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("method", ["topk", "trimmed"])
def test_sparse_allgather_without_check_sends_a_fixed_length_frame_alone(size, method):
    """An exact selection of k fp32 or qsgd values makes a frame whose length every rank knows,
    so without the agreement each peer gets one message, the frame, and nothing else."""
    n, k = 300, 7
    xs = [torch.randn(n, generator=torch.Generator().manual_seed(r)) for r in range(size)]
    for fmt in ("fp32", sparse.Qsgd(bits=4, bucket=8, seed=2)):
        def call(c, fmt=fmt):
            c.trace = []
            out, _ = sparse_allgather(c, xs[c.rank], k, fmt=fmt, method=method, check=False)
            return out, list(c.trace)

        got = run_local(call, size)
        frame = sparse.encoded_size(n, k, fmt)
        for r, (_, trace) in enumerate(got):
            assert sorted(dest for dest, _, _ in trace) == [d for d in range(size) if d != r]
            assert all(b == frame for _, b, _ in trace)
            assert sum(b for _, b, _ in trace) == sparse_allgather_bytes(frame, size,
                                                                          check=False)
        assert all(torch.equal(got[0][0], out) for out, _ in got)
        if fmt == "fp32":
            expect = torch.zeros(n)
            for x in xs:
                idx = select.select(x.abs(), k, "topk")
                expect[idx] += x[idx]
            assert torch.equal(got[0][0], expect)
    # a threshold frame's length depends on the data: it still sends its length first
    assert sparse_allgather_bytes(50, 3, check=False, fixed=False) == 2 * (50 + 8)


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("path", ["torch", pytest.param(
    "triton", marks=[needs_interpreter, pytest.mark.triton])])
def test_qsgd_allgather_reads_the_host_once_per_call_on_a_device(size, path):
    """On CUDA every host read waits for the device: a call checks its own scales and every
    frame it decodes with one read at its end, however many ranks send them (CPU tensors on
    the paths a CUDA tensor takes; the counts are over all the ranks)."""
    xs = inputs(size, 1001, seed=3)

    def job():
        return run_local(lambda c: qsgd_allgather(c, xs[c.rank], bits=4, bucket=100, seed=0,
                                                  check=False), size)

    with forced(path):
        got = job()
        reads = host_reads(job)
    assert len(reads) == size, reads
    assert identical([mean for mean, _ in got])


@pytest.mark.parametrize("path", ["numpy", "torch", pytest.param(
    "triton", marks=[needs_interpreter, pytest.mark.triton])])
def test_qsgd_allgather_without_the_agreement_raises_a_bad_scale_on_every_rank(path):
    """check=False: rank 1's NaN makes a non-finite scale. Its frame still goes out, so every
    rank raises at the end of the call (rank 1 naming its input, the others its frame)
    instead of waiting for a frame that rank 1 would never send."""
    xs = inputs(3, 1001, seed=6)
    xs[1][700] = float("nan")
    with forced(path):
        out = run_local(lambda c: qsgd_allgather(c, xs[c.rank], bits=4, bucket=100, seed=0,
                                                 check=False), 3,
                        return_exceptions=True, timeout=20)
    assert all(isinstance(e, ValueError) for e in out), out
    assert "non-finite max scale nan in bucket 7" in str(out[1]), out[1]
    assert all("corrupt qsgd frame: expected a finite scale >= 0 in bucket 7" in str(out[r])
               for r in (0, 2)), out


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("path", ["torch", pytest.param(
    "triton", marks=[needs_interpreter, pytest.mark.triton])])
def test_sparse_allgather_reads_the_host_once_per_call_on_a_device(size, path):
    """The exact top-k selects without a host read, and the checks of this rank's entries and
    of the frames every rank receives (their length known to all) are one read at the end."""
    xs = inputs(size, 1001, seed=4)
    with forced("numpy"):
        want = run_local(lambda c: sparse_allgather(c, xs[c.rank], 10, check=False), size)

    def job():
        return run_local(lambda c: sparse_allgather(c, xs[c.rank], 10, check=False), size)

    with forced(path):
        got = job()
        reads = host_reads(job)
    assert len(reads) == size, reads
    for (dense, (idx, val)), (dense0, (idx0, val0)) in zip(got, want, strict=True):
        assert torch.equal(dense, dense0) and torch.equal(idx, idx0) and torch.equal(val, val0)


def test_sparse_allgather_checks_its_own_entries_only_without_the_agreement(monkeypatch):
    """With check the agreement found the input finite (and fp16's range was validated), so
    the selector's entries are not checked again (a host read on a device); without it the
    encoder's check is the only one, and stays."""
    from bitcomm.codecs import sparse as sparse_codec

    xs = inputs(2, 1001, seed=4)
    checked = []
    original = sparse_codec._check_entries

    def spy(*args, **kwargs):
        checked.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(sparse_codec, "_check_entries", spy)
    for fmt in ("fp32", "fp16"):
        for check, calls in ((True, 0), (False, 2)):
            checked.clear()
            got = run_local(lambda c, f=fmt, ch=check: sparse_allgather(c, xs[c.rank], 10,
                                                                         fmt=f, check=ch), 2)
            assert len(checked) == calls, (fmt, check)
            want = run_local(lambda c, f=fmt: sparse_allgather(c, xs[c.rank], 10, fmt=f,
                                                               check=False), 2)
            assert all(torch.equal(a[0], b[0]) for a, b in zip(got, want, strict=True))


@pytest.mark.parametrize("packing, path", [
    ("fixed", "numpy"), ("fixed", "torch"), ("radix", "numpy"), ("radix", "torch"),
    pytest.param("radix", "triton", marks=[needs_interpreter, pytest.mark.triton])])
def test_a_ring_count_above_its_ranks_is_refused_at_the_end_of_the_call(packing, path):
    """Rank 1's second step sends counts over 2 ranks in which element 0 says 3 (fixed) or its
    radix group's code is 255 (a corrupt payload): rank 2, which receives it, raises the
    decoder's error once the ring is done, and the others finish rather than wait for it."""
    planes = counts.width(2) if packing == "fixed" else counts.radix_group(2)[1]

    def job(c):
        if c.rank == 1:
            honest, calls = c.shift, []

            def shift(buf, dest, out, source):
                calls.append(1)
                if len(calls) == 2:
                    buf = buf.clone()
                    buf.view(planes, -1)[:, 0] |= 0x80
                return honest(buf, dest, out, source)

            c.shift = shift
        return ring_majority(c, torch.ones(40), packing=packing, check=False)

    with forced(path):
        out = run_local(job, 3, return_exceptions=True, timeout=20)
    assert isinstance(out[2], ValueError), out
    assert ("decoded count 3 > m=2" if packing == "fixed" else "radix code 255") in str(out[2])
    assert all(isinstance(out[r], torch.Tensor) for r in (0, 1)), out


@pytest.mark.parametrize("packing", ["fixed", "radix"])
@pytest.mark.parametrize("path", ["torch", pytest.param(
    "triton", marks=[needs_interpreter, pytest.mark.triton])])
def test_the_unfused_ring_checks_its_payloads_with_one_read_per_call(packing, path):
    """On a device every step's payload checks are flags, read once at the end of the call
    (the fused fixed ring on the Triton path does not check, and reads nothing)."""
    size, n = 4, 1001  # odd chunks: every decision payload ends in padding bits
    xs = inputs(size, n, seed=8)
    with forced("numpy"):
        want = run_local(lambda c: ring_majority(c, xs[c.rank], packing=packing), size)

    def job():
        return run_local(lambda c: ring_majority(c, xs[c.rank], packing=packing,
                                                 check=False), size)

    with forced(path):
        got = job()
        reads = host_reads(job)
    fused = packing == "fixed" and path == "triton"
    assert len(reads) == (0 if fused else size), reads
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


@pytest.mark.parametrize("fn", [alltoall_majority, allgather_majority])
@pytest.mark.parametrize("path", ["torch", pytest.param(
    "triton", marks=[needs_interpreter, pytest.mark.triton])])
def test_the_one_round_majorities_read_the_host_at_most_once_per_call(fn, path):
    """Off the fused path every payload's padding check is a flag read once at the end of the
    call; the fused kernels read nothing (3 ranks, 1001 elements: every payload is padded)."""
    size, n = 3, 1001
    xs = inputs(size, n, seed=9)
    with forced("numpy"):
        want = run_local(lambda c: fn(c, xs[c.rank]), size)

    def job():
        return run_local(lambda c: fn(c, xs[c.rank], check=False), size)

    with forced(path):
        got = job()
        reads = host_reads(job)
    assert len(reads) == (0 if path == "triton" else size), reads
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


@pytest.mark.parametrize("fmt, method", [("fp32", "threshold"), ("mean", "topk"),
                                         ("fp16", "sidco-e")])
def test_frames_of_data_dependent_lengths_are_checked_with_one_read(fmt, method):
    """A selector that picks about k, or a sign-uniform frame: every rank knows every frame's
    length, so the checks of this rank's entries and of every frame it receives are one host
    read for all of them, at the call's end, at any number of ranks; the codec reads nothing
    of its own."""
    from bitcomm.codecs import _frame

    lines, first = inspect.getsourcelines(_frame.deferred.__exit__)
    for size in (2, 4):
        reads = _sparse_allgather_reads("torch", size, fmt, method)
        assert [r for r in reads if r[1].endswith("codecs/sparse.py")] == [], reads
        at_end = [r for r in reads if r[1] == _frame.__file__
                  and first <= r[2] < first + len(lines)]
        assert len(at_end) == size, reads


def _sparse_allgather_reads(path, size, fmt, method):
    """Run sparse_allgather without the agreement on ``path``; check its results against the
    numpy path's and return the host reads of a call."""
    xs = inputs(size, 3001, seed=size)

    def job():
        return run_local(lambda c: sparse_allgather(c, xs[c.rank], 30, fmt=fmt,
                                                    method=method, check=False), size)

    with forced("numpy"):
        want = job()
    with forced(path):
        got = job()
        reads = host_reads(job)
    for (dense, (idx, val)), (dense0, (idx0, val0)) in zip(got, want, strict=True):
        assert torch.equal(dense, dense0) and torch.equal(idx, idx0)
        assert torch.equal(val, val0)
    return reads


@pytest.mark.parametrize("path", ["numpy", *OTHER_PATHS])
@pytest.mark.parametrize("fmt, method", [("fp32", "topk"), ("fp32", "threshold"),
                                         ("mean", "topk"), ("qsgd", "topk")])
@pytest.mark.parametrize("broken", ["index", "order"])
def test_a_corrupt_frame_received_raises_its_error_with_its_indices_kept_in_range(
        path, fmt, method, broken):
    """Rank 1's frame reaches rank 0 with its last index past n (or its first two out of
    order): rank 0 raises
    the decoder's precise ValueError. Off the numpy path its check is read at the end of the
    call, after the frames were added, so until then the indices were clamped into range: an
    index past n never reached index_add_ (which would raise IndexError on a CPU, and
    write out of bounds on a GPU)."""
    n, k = 1000, 10
    xs = inputs(2, n, seed=5, zeros=False)
    form = sparse.Qsgd(bits=4, bucket=8, seed=1) if fmt == "qsgd" else fmt

    def job(c):
        if c.rank == 0:
            honest = c.allgatherv

            def allgatherv(buf, sizes):
                parts = honest(buf, sizes)
                if len(parts) == 2 and parts[1].numel() > 24:
                    bad = parts[1].clone()
                    # the last index past n, or the first above the second (int32 indices)
                    held = int.from_bytes(bytes(bad[8:16].tolist()), "little")  # its k
                    at = sparse.HEADER.size + (4 * (held - 1) if broken == "index" else 0)
                    value = n + 5 if broken == "index" else 999
                    bad[at : at + 4] = torch.tensor(list(value.to_bytes(4, "little")),
                                                    dtype=torch.uint8)
                    parts = [parts[0], bad]
                return parts

            c.allgatherv = allgatherv
        return sparse_allgather(c, xs[c.rank], k, fmt=form, method=method, check=False)

    with forced(path):
        out = run_local(job, 2, return_exceptions=True, timeout=30)
    assert isinstance(out[0], ValueError), out[0]
    assert "corrupt sparse frame" in str(out[0]), out[0]
    assert ("expected indices in [0, 1000)" if broken == "index"
            else "strictly increasing") in str(out[0]), out[0]
    assert not isinstance(out[1], BaseException), out[1]


@pytest.mark.parametrize("path", OTHER_PATHS)
def test_without_the_agreement_a_nan_selected_on_one_rank_raises_on_every_rank(path):
    """check=False off the numpy path: rank 1's NaN is selected (NaN ranks on top), its
    entries' check waits for the call's one read, so its frame goes out and every rank raises
    (rank 1 its encoder's error, rank 0 the decoder's) instead of rank 0 waiting for it."""
    xs = inputs(2, 1000, seed=6, zeros=False)
    xs[1][123] = float("nan")
    with forced(path):
        out = run_local(lambda c: sparse_allgather(c, xs[c.rank], 10, check=False), 2,
                        return_exceptions=True, timeout=30)
    assert isinstance(out[1], ValueError) and "expected finite values" in str(out[1]), out
    assert isinstance(out[0], ValueError) and "expected finite fp32 values" in str(out[0]), out


def test_an_announced_frame_length_is_bounded_before_anything_is_allocated():
    """Rank 1 says its threshold frame is 2**40 bytes: every rank refuses the lengths before
    allocating the frames."""
    xs = inputs(3, 1000, seed=2)

    def job(c):
        if c.rank == 1:
            honest = c.allgatherv

            def allgatherv(buf, sizes):
                if buf.numel() == 8:  # the length message
                    buf = torch.tensor(list((1 << 40).to_bytes(8, "little")), dtype=torch.uint8)
                return honest(buf, sizes)

            c.allgatherv = allgatherv
        return sparse_allgather(c, xs[c.rank], 10, method="threshold", check=False)

    out = run_local(job, 3, return_exceptions=True, timeout=20)
    assert all(isinstance(e, ValueError) and "rank(s) [1] announced frames of [1099511627776]"
               in str(e) for e in out), out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_results_and_error_buffers_are_numpys_arrays_where_numpy_has_the_dtype(dtype):
    """On the CPU path the majorities' and the sparse allgather's new results and 1-bit's new
    error buffers are arrays numpy allocated, which Linux backs with huge pages (2 ranks x 8M
    elements: a 1-bit call 49 -> 33 ms, the majority's +-1 result 14.5 -> 3.5 ms), where
    numpy has the dtype; bfloat16's come from torch."""
    size, n = 2, 1000

    def numpys(t):  # numpy owns a from_numpy tensor's memory, which torch cannot resize
        return not t.untyped_storage().resizable()

    xs = [x.to(dtype) for x in inputs(size, n, seed=3)]
    for fn in (ring_majority, alltoall_majority, allgather_majority):
        out = run_local(lambda c, fn=fn: fn(c, xs[c.rank]), size)
        assert identical(out) and out[0].dtype == dtype
        assert numpys(out[0]) == (dtype != torch.bfloat16), fn.__name__
    dense = [d for d, _ in run_local(lambda c: sparse_allgather(c, xs[c.rank].float(), 10),
                                     size)]
    assert identical(dense) and numpys(dense[0])
    states = [OneBitState(n, size) for _ in range(size)]
    run_local(lambda c: onebit_allreduce(c, xs[c.rank], states[c.rank]), size)
    assert all(numpys(s.worker_error) for s in states)  # 1-bit works in float32
    served = [OneBitState(n, size, collective="allgather") for _ in range(size)]
    run_local(lambda c: onebit_allreduce(c, xs[c.rank], served[c.rank]), size)
    assert all(numpys(s.worker_error) and numpys(s.server_error) for s in served)
