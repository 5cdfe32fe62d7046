import math
import os
import struct
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bitcomm.codecs import _rng, qsgd

from conftest import AWKWARD, forced, needs_interpreter, unhex


def test_golden_values_on_levels(path):
    # Scale 7 and s = 7: every value sits exactly on a level, so the frame is seed-independent.
    x = torch.tensor([7.0, -3.0, 0.0, 1.0, 2.0])
    expect = unhex("05 00 00 00 00 00 00 00 04 00 00 02 00 00 | 00 00 e0 40 | 7b 01 20")
    for seed in range(5):
        frame = qsgd.encode(x, bits=4, seed=seed)
        assert frame.tolist() == expect
    out, used = qsgd.decode(frame)
    assert out.tolist() == x.tolist() and used == len(expect)


def test_golden_worked_example(path):
    frame = qsgd.encode(torch.tensor([1.0, -0.5, 0.0]), bits=4, bucket=4, seed=1)
    head = unhex("03 00 00 00 00 00 00 00 04 00 04 00 00 00 00 00 80 3f")
    assert frame.tolist()[:18] == head
    assert frame.tolist()[18:] in ([0x7B, 0x00], [0x7C, 0x00])
    seen = {tuple(qsgd.encode(torch.tensor([1.0, -0.5, 0.0]), 4, 4, seed=s).tolist()[18:])
            for s in range(40)}
    assert seen == {(0x7B, 0x00), (0x7C, 0x00)}


@pytest.mark.parametrize("bits", qsgd.BITS)
@pytest.mark.parametrize("bucket", [1, 7, 512, 500, 1 << 20])
def test_round_trip_error_and_size(bits, bucket, path):
    s = (1 << (bits - 1)) - 1
    g = torch.Generator().manual_seed(bits * 1000 + bucket)
    # The interpreter (path "triton") runs about a second per million elements.
    for n in AWKWARD + ([70001] if path == "triton" else [70001, 300001]):
        x = torch.randn(n, generator=g)
        frame = qsgd.encode(x, bits, bucket, seed=n)
        assert frame.numel() == qsgd.encoded_size(n, bits, bucket)
        out, used = qsgd.decode(frame)
        assert used == frame.numel()
        if n:
            # each element is within one level step of its bucket's scale, with its sign
            pad = (-n) % bucket
            xb = torch.nn.functional.pad(x, (0, pad)).view(-1, bucket)
            step = (xb.abs().amax(1) / s).repeat_interleave(bucket)[:n]
            assert bool(((out - x).abs() <= step * (1 + 1e-6)).all())
            assert bool((out * x >= 0).all())


def test_same_seed_same_bytes_and_generators():
    x = torch.randn(5000, generator=torch.Generator().manual_seed(0))
    assert torch.equal(qsgd.encode(x, seed=3), qsgd.encode(x, seed=3))
    assert not torch.equal(qsgd.encode(x, seed=3), qsgd.encode(x, seed=4))
    g1, g2 = torch.Generator().manual_seed(9), torch.Generator().manual_seed(9)
    a1, a2 = qsgd.encode(x, generator=g1), qsgd.encode(x, generator=g1)
    assert not torch.equal(a1, a2)  # the generator advances
    assert torch.equal(a1, qsgd.encode(x, generator=g2))
    assert torch.equal(a2, qsgd.encode(x, generator=g2))
    with pytest.raises(ValueError, match="at most one of seed and generator"):
        qsgd.encode(x, seed=1, generator=g1)


@pytest.mark.parametrize("bits", qsgd.BITS)
@pytest.mark.parametrize("scale", qsgd.SCALES)
@pytest.mark.parametrize("path", ["numpy", "torch"], indirect=True)
def test_unbiased(bits, scale, path):
    """The mean of R decodes converges to x: |mean - x| within 5 standard errors everywhere.

    (The Triton path writes the numpy path's bytes, tested in test_kernels.py, so its
    statistics are these.)
    """
    n, reps, bucket = 1024, 400, 256
    x = torch.randn(n, generator=torch.Generator().manual_seed(11))
    s = (1 << (bits - 1)) - 1
    acc = torch.zeros(n, dtype=torch.float64)
    for r in range(reps):
        acc += qsgd.decode(qsgd.encode(x, bits, bucket, scale=scale, seed=r))[0].double()
    mean = acc / reps
    xb = x.view(-1, bucket)
    sc = xb.abs().amax(1) if scale == "max" else xb.norm(dim=1)
    step = (sc / s).repeat_interleave(bucket).double()
    # Bernoulli rounding: per-element std <= step / 2
    assert bool(((mean - x.double()).abs() <= 5 * step / 2 / math.sqrt(reps) + 1e-7).all())
    # the average signed error over all elements is far smaller still (no systematic bias)
    assert abs(float((mean - x.double()).mean())) <= 5 * float(step.mean()) / 2 / math.sqrt(
        reps * n)


@pytest.mark.parametrize("bits", qsgd.BITS)
def test_qsgd_variance_bound_l2(bits):
    """E||Q(v) - v||^2 <= min(n/s^2, sqrt(n)/s) ||v||^2 per bucket (QSGD, L2 scale)."""
    bucket, reps = 512, 200
    s = (1 << (bits - 1)) - 1
    for dist in ("normal", "sparse-ish"):
        g = torch.Generator().manual_seed(bits)
        v = torch.randn(bucket, generator=g)
        if dist == "sparse-ish":
            v = v * (torch.rand(bucket, generator=g) < 0.05)
        err = 0.0
        for r in range(reps):
            q = qsgd.decode(qsgd.encode(v, bits, bucket, scale="l2", seed=r))[0]
            err += float(((q - v).double() ** 2).sum())
        bound = min(bucket / s**2, math.sqrt(bucket) / s) * float((v.double() ** 2).sum())
        assert err / reps <= bound


def test_non_finite_raises_naming_the_bucket(path):
    x = torch.ones(1500)
    x[1100] = float("nan")
    with pytest.raises(ValueError, match=r"non-finite max scale nan in bucket 2 \(elements "
                                         r"1024..1499\)"):
        qsgd.encode(x, seed=0)
    x[1100] = float("inf")
    with pytest.raises(ValueError, match="non-finite l2 scale inf in bucket 2"):
        qsgd.encode(x, scale="l2", seed=0)
    x = torch.ones(20)
    x[19] = float("-inf")
    with pytest.raises(ValueError, match="bucket 2"):
        qsgd.encode(x, bucket=7, seed=0)  # buckets that do not divide the chunk


def test_bad_config():
    x = torch.ones(4)
    with pytest.raises(ValueError, match=r"bits in \(2, 4, 8\), got 3"):
        qsgd.encode(x, bits=3)
    with pytest.raises(ValueError, match="bucket"):
        qsgd.encode(x, bucket=0)
    with pytest.raises(ValueError, match="scale in"):
        qsgd.encode(x, scale="mean")
    with pytest.raises(TypeError, match="floating-point"):
        qsgd.encode(torch.ones(4, dtype=torch.int32))
    with pytest.raises(TypeError, match="seed"):
        qsgd.encode(x, seed=1.5)


def test_truncated_and_corrupt_frames():
    frame = qsgd.encode(torch.randn(1001), 4, 100, seed=0)
    for cut in (0, 13, 14, 20, frame.numel() - 1):
        with pytest.raises(ValueError, match="truncated qsgd frame"):
            qsgd.decode(frame[:cut])
    bad = frame.clone()
    bad[8] = 3
    with pytest.raises(ValueError, match=r"bits in \(2, 4, 8\), got 3"):
        qsgd.decode(bad)
    bad = frame.clone()
    bad[9] = 5
    with pytest.raises(ValueError, match="scale code"):
        qsgd.decode(bad)
    bad = frame.clone()
    bad[10:14] = 0
    with pytest.raises(ValueError, match="bucket >= 1"):
        qsgd.decode(bad)
    bad = frame.clone()
    bad[14 + 4 * 3: 14 + 4 * 4] = torch.tensor([0, 0, 0xC0, 0x7F], dtype=torch.uint8)
    with pytest.raises(ValueError, match="finite scale >= 0 in bucket 3"):
        qsgd.decode(bad)
    bad = frame.clone()
    bad[-1] |= 0x01  # 1001 4-bit codes leave 4 padding bits
    with pytest.raises(ValueError, match="padding"):
        qsgd.decode(bad)


def test_empty_and_zero_buckets(path):
    out, used = qsgd.decode(qsgd.encode(torch.empty(0), seed=0))
    assert out.numel() == 0 and used == 14
    out, _ = qsgd.decode(qsgd.encode(torch.zeros(700), seed=0))
    assert out.abs().sum() == 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_other_float_dtypes(dtype, path):
    x = torch.randn(300, generator=torch.Generator().manual_seed(1)).to(dtype)
    assert torch.equal(qsgd.encode(x, seed=2), qsgd.encode(x.float(), seed=2))
    assert qsgd.decode(qsgd.encode(x, seed=2), dtype=dtype)[0].dtype == dtype


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(-1e6, 1e6, width=32), max_size=300), st.sampled_from(qsgd.BITS),
       st.integers(1, 64), st.integers(0, 2**40))
def test_property_round_trip(values, bits, bucket, seed):
    x = torch.tensor(values, dtype=torch.float32)
    frame = qsgd.encode(x, bits, bucket, seed=seed)
    out, used = qsgd.decode(frame)
    assert used == frame.numel() == qsgd.encoded_size(len(values), bits, bucket)
    assert bool((out * x >= 0).all())


def test_few_million():
    n = 3_000_001
    x = torch.randn(n, generator=torch.Generator().manual_seed(3))
    out, _ = qsgd.decode(qsgd.encode(x, 8, seed=1))
    assert float((out - x).abs().max()) <= float(x.abs().max()) / 127 * (1 + 1e-6)


@pytest.mark.parametrize("bits", qsgd.BITS)
@pytest.mark.parametrize("scale", qsgd.SCALES)
def test_compiled_cpu_path_matches_torch_path(bits, scale):
    """The numba CPU kernel and the torch-only (CUDA) path write the same bytes."""
    g = torch.Generator().manual_seed(bits)
    sizes = [0, 1, 7, 9, 65535, 65537, (1 << 18) + 3, 3 * 65536 + 5]
    for n in sizes:
        for bucket in (1, 7, 512, 65536, 100000):
            for dtype in (torch.float32, torch.float64, torch.float16):
                x = (torch.randn(n, generator=g) * 3).to(dtype)
                x[:3] = torch.tensor([-0.0, 0.0, 1e-40])[: min(n, 3)].to(dtype)  # signed 0s
                x[3:50:5] *= 1e30 if dtype != torch.float16 else 1  # buckets of mixed scale
                cpu = qsgd.encode(x, bits, bucket, scale=scale, seed=n + bucket)
                with forced("torch"):
                    ref = qsgd.encode(x, bits, bucket, scale=scale, seed=n + bucket)
                assert torch.equal(cpu, ref), (n, bucket, dtype)


@pytest.mark.parametrize("task", [0, 5, (1 << 16) - 1, 1 << 16, 3 << 16])
def test_compiled_stream_matches_torch_stream(task):
    """The numba kernel's stream equals _rng's, also past 2**32 positions (a new high word)."""
    from bitcomm.codecs import _qsgd_cpu

    for key in (0, 12345, -7, 2**31 - 1):
        # a whole block, and the first m values of one (a tensor shorter than a block)
        for m in (_qsgd_cpu.TASK, 1, 1000, (1 << 15) + 3):
            r = np.full(_qsgd_cpu.TASK, -1, dtype=np.int32)
            _qsgd_cpu._stream(task, key & 0xFFFFFFFF, r, m)
            ref = _rng.random16(key, task * _qsgd_cpu.TASK, m).numpy()
            assert np.array_equal(r[:m], ref)
            assert (r[m:] == -1).all()  # nothing written past what was asked for


# --- the counter-based stream ----------------------------------------------------------------

def _numpy_stream(key: int, start: int, count: int) -> np.ndarray:
    """Independent reference of _rng's documented stream, in numpy's wrapping integer math."""
    pos = np.arange(start, start + count, dtype=np.int64)
    block, p = pos >> 16, pos & 0xFFFF
    j = block * (1 << 15) + (p & 0x7FFF)
    keyp = (key ^ ((j >> 31) * 0x27D4EB2F)) & 0xFFFFFFFF
    h = ((j % (1 << 31)) ^ keyp).astype(np.uint32)
    with np.errstate(over="ignore"):
        h ^= h >> np.uint32(16)
        h *= np.uint32(0x7FEB352D)
        h ^= h >> np.uint32(15)
        h *= np.uint32(0x846CA68B)
        h ^= h >> np.uint32(16)
    u = h.astype(np.int64)
    return np.where(p < (1 << 15), u & 0xFFFF, u >> 16)


@pytest.mark.parametrize("start", [0, 1 << 16, 5 << 16, (1 << 32) - (1 << 16), 3 << 32])
def test_stream_matches_numpy_reference(start):
    for key in (0, 12345, -7, 2**31 - 1):
        ours = _rng.random16(key, start, 3 << 16).numpy()
        ref = _numpy_stream(key & 0xFFFFFFFF, start, 3 << 16)
        assert np.array_equal(ours, ref)


def test_stream_is_uniform():
    r = _rng.random16(42, 0, 1 << 20).numpy()
    assert r.min() >= 0 and r.max() < 65536
    counts = np.bincount(r >> 12, minlength=16)
    expected = r.size / 16
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 37.7  # 99.9th percentile of chi-square with 15 degrees of freedom
    assert abs(np.corrcoef(r[:-1], r[1:])[0, 1]) < 0.01


# The same float32 values in every process: integer arithmetic, then exact divisions by 256.
# (torch 2.13's CPU sin of torch.arange(5000) differed between processes in 8 of 30 runs here,
# by up to 1.5e-4 in half of the elements, which made this comparison fail now and then.)
_EXACT_INPUT = "((torch.arange(5000) * 7919) % 2001 - 1000).to(torch.float32) / 256"


@pytest.mark.timeout(200)
def test_numba_without_a_writable_cache_location_still_encodes(tmp_path):
    # A non-root user in a container: the package's __pycache__ and $HOME are read-only, so no
    # numba cache locator can write. Simulated as root by refusing every cache directory but
    # one under NUMBA_CACHE_DIR, had it been set.
    import json
    import os
    import subprocess
    import sys

    code = (
        "import json, torch\n"
        "from numba.core import caching\n"
        "real = caching._CacheLocator.ensure_cache_path\n"
        "def refuse(self):\n"
        "    from numba import config\n"
        "    if not (config.CACHE_DIR and self.get_cache_path().startswith(config.CACHE_DIR)):\n"
        "        raise PermissionError('read-only file system')\n"
        "    return real(self)\n"
        "caching._CacheLocator.ensure_cache_path = refuse\n"
        "from bitcomm.codecs import qsgd\n"
        f"x = {_EXACT_INPUT}\n"
        "print(json.dumps(qsgd.encode(x, 4, seed=3).tolist()))\n")
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
    env["TMPDIR"] = str(tmp_path)  # where the private cache goes
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180,
                       env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert list((tmp_path / f"bitcomm-numba-{os.getuid()}").rglob("*.nbi"))  # it cached there
    x = eval(_EXACT_INPUT)
    assert json.loads(r.stdout.splitlines()[-1]) == qsgd.encode(x, 4, seed=3).tolist()


def test_one_thread_encodes_without_a_parallel_region(monkeypatch):
    """Under one torch thread (a rank per core) the kernels run serially, with the same bytes.

    A numba parallel region wakes OpenMP threads that spin on every core afterwards, taking the
    cores of the job's other ranks; the encoder follows torch's thread budget instead.
    """
    from bitcomm.codecs import _qsgd_cpu

    g = torch.Generator().manual_seed(5)
    x = torch.randn(3 * _qsgd_cpu.TASK + 11, generator=g)
    cases = [(512, "max"), (100000, "max"), (7, "l2")]  # fused scales, separate, torch's L2
    before = {c: qsgd.encode(x, 4, c[0], scale=c[1], seed=3) for c in cases}
    for name in ("encode_codes", "max_scales"):
        def refuse(*args, _name=name):
            raise AssertionError(f"{_name} (a parallel region) ran under one thread")
        monkeypatch.setattr(_qsgd_cpu, name, refuse)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert _qsgd_cpu.threads_for(x.numel()) == 1
        for c in cases:
            assert torch.equal(qsgd.encode(x, 4, c[0], scale=c[1], seed=3), before[c]), c
    finally:
        torch.set_num_threads(threads)
    # more threads than tasks is pointless: a tensor of one task is encoded serially too
    assert _qsgd_cpu.threads_for(_qsgd_cpu.TASK) == 1


@pytest.mark.timeout(120)
def test_one_thread_never_starts_numbas_thread_pool():
    """Asking numba for its thread count launches its pool, whose OpenMP thread spins on the
    core the job's other rank needs: in a 2-rank DDP run with qsgd_hook that doubled the step
    (the other rank's forward pass slowed several times). Under one torch thread the pool must
    stay down; in a fresh process, since other tests start it."""
    code = ("import os, torch; torch.set_num_threads(1); "
            "from bitcomm.codecs import qsgd; import numba.np.ufunc.parallel as p; "
            "qsgd.encode(torch.randn(5000), 8, 512, seed=1); "
            "qsgd.encode(torch.randn(5000), 4, 7, seed=2); "
            "print(p._is_initialized, len(os.listdir('/proc/self/task')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=100, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    initialized, threads = out.stdout.split()
    assert initialized == "False"
    assert int(threads) == 1


@pytest.mark.parametrize("bits", qsgd.BITS)
def test_numpy_decode_matches_the_torch_decode_bit_for_bit(monkeypatch, bits):
    """CPU frames decode through numpy, and from _jit.MIN_VALUES values, where a byte's
    codes share a bucket, through one compiled pass; the torch path (CUDA's formula) gives the
    same bits, signed zeros and a zero bucket included, and the same errors for a corrupt
    scale or padding."""
    from bitcomm.codecs import _jit, _qsgd_cpu

    calls = []
    compiled = _qsgd_cpu.decode_values
    monkeypatch.setattr(_qsgd_cpu, "decode_values", lambda *a: calls.append(a[-2].size)
                        or compiled(*a))
    g = torch.Generator().manual_seed(bits)
    for n in (0, 1, 7, 8, 9, 100, 1000, 4099, 3 * 4096 + 5):
        for bucket in (1, 3, 8, 512, 1 << 20):
            x = torch.randn(n, generator=g) * 4
            x[: min(n, 2)] = torch.tensor([-0.0, 0.0])[: min(n, 2)]
            x[5:40:7] *= 1e20
            x[1024:1536] = 0.0  # a zero scale where the bucket is 512
            frame = qsgd.encode(x, bits, bucket, seed=n + bucket)
            calls.clear()
            got, used = qsgd.decode(frame)
            with forced("torch"):
                ref, ref_used = qsgd.decode(frame)
            assert used == ref_used == frame.numel()
            assert torch.equal(got.view(torch.int32), ref.view(torch.int32)), (n, bucket)
            assert torch.equal(qsgd.decode(frame, dtype=torch.float16)[0], ref.half())
            whole_bytes = bucket % (8 // bits) == 0
            # both numpy-path decodes (float32, float16) or neither
            assert calls == ([n] * 2 if n >= _jit.MIN_VALUES and whole_bytes else []), (
                n, bucket)
    frame = qsgd.encode(torch.ones(5), bits, 4, seed=1)
    bad_scale = frame.clone()
    bad_scale[qsgd.HEADER.size + 4 : qsgd.HEADER.size + 8] = torch.tensor(
        list(struct.pack("<f", -1.0)), dtype=torch.uint8)
    with pytest.raises(ValueError, match="finite scale >= 0 in bucket 1"):
        qsgd.decode(bad_scale)
    if (5 * bits) % 8:
        bad_pad = frame.clone()
        bad_pad[-1] |= 1
        with pytest.raises(ValueError, match="padding bits"):
            qsgd.decode(bad_pad)


def _refused(g: torch.Generator) -> tuple[list[torch.Tensor], list[tuple[list, str]]]:
    # Three good frames of 1001 elements (4 bits, buckets of 100), and groups of frames that
    # a decoder of that layout refuses, with its message.
    frames = [qsgd.encode(torch.randn(1001, generator=g), 4, 100, seed=i) for i in range(3)]
    bad_scale, bad_pad = frames[1].clone(), frames[2].clone()
    bad_scale[14 + 4 * 3: 14 + 4 * 4] = torch.tensor([0, 0, 0xC0, 0x7F], dtype=torch.uint8)
    bad_pad[-1] |= 0x01  # 1001 4-bit codes leave 4 padding bits
    return frames, [
        ([frames[0], bad_scale], "finite scale >= 0 in bucket 3"),
        ([bad_pad, frames[0]], "padding"),
        ([frames[0], frames[1][:-1]], "truncated qsgd frame"),
        ([frames[0], qsgd.encode(torch.randn(1000), 4, 100, seed=0)], "expected n=1001"),
        ([frames[0], qsgd.encode(torch.randn(1001), 2, 100, seed=0)], "expected bits=4"),
        ([qsgd.encode(torch.randn(1001), 4, 100, scale="l2", seed=0)], "expected scale=0")]


def test_decode_all_gives_decodes_values_and_errors(path):
    """Frames of one known layout decode to decode's bits on every path, and the same errors;
    a frame whose header says another layout is refused. Off the numpy path (CUDA's) the
    checks of all the frames cost one host read, where decode makes two per frame."""
    from conftest import host_reads

    g = torch.Generator().manual_seed(7)
    for n, bits, bucket in ((0, 4, 8), (1, 2, 3), (13, 4, 5), (1001, 8, 100), (4099, 2, 512)):
        xs = [torch.randn(n, generator=g) * 3 for _ in range(3)]
        frames = [qsgd.encode(x, bits, bucket, seed=i) for i, x in enumerate(xs)]
        got = qsgd.decode_all(frames, n, bits, bucket)
        for f, values in zip(frames, got, strict=True):
            assert torch.equal(values.view(torch.int32), qsgd.decode(f, n=n)[0].view(torch.int32))
        if path != "numpy":
            reads = host_reads(lambda f=frames: qsgd.decode_all(f, n, bits, bucket))
            assert len(reads) == 1, reads
    frames, cases = _refused(g)
    for group, message in cases:
        with pytest.raises(ValueError, match=message):
            qsgd.decode_all(group, 1001, 4, 100)
    same_size = qsgd.encode(torch.randn(1001, generator=g), 4, 91, seed=0)  # 11 buckets too
    assert same_size.numel() == frames[0].numel()
    with pytest.raises(ValueError, match="expected bucket=100, got bucket=91"):
        qsgd.decode_all([frames[0], same_size], 1001, 4, 100)


def test_mean_all_is_the_correctly_rounded_mean_of_the_decodes(path):
    """mean_all adds the frames' decoded float32 values in list order from +0.0 and divides
    by their number, correctly rounded (numpy's float32 arithmetic here), on every path; the
    kept frame's values are its decode's; the errors are decode_all's, and off the numpy path
    the checks of all the frames cost one host read."""
    from conftest import host_reads

    g = torch.Generator().manual_seed(8)
    for n, bits, bucket, count in ((0, 4, 8, 2), (1, 2, 3, 1), (13, 4, 5, 3),
                                   (1001, 8, 100, 5), (4099, 2, 512, 6)):
        xs = [torch.randn(n, generator=g) * 7.0 ** r for r in range(count)]
        frames = [qsgd.encode(x, bits, bucket, seed=r) for r, x in enumerate(xs)]
        decoded = [qsgd.decode(f)[0].numpy() for f in frames]
        total = np.zeros(n, dtype=np.float32)
        for d in decoded:
            total = total + d
        want = total / np.float32(count)
        mean, kept = qsgd.mean_all(frames, n, bits, bucket, keep=count - 1)
        assert mean.dtype == torch.float32 and mean.shape == (n,)
        assert np.array_equal(mean.numpy().view(np.int32), want.view(np.int32)), (n, count)
        assert np.array_equal(kept.numpy().view(np.int32), decoded[-1].view(np.int32))
        # error feedback's residual: x less the kept values (float32), x left as it was
        x = xs[-1].clone()
        _, left = qsgd.mean_all(frames, n, bits, bucket, keep=count - 1, residual_of=x)
        assert torch.equal(x, xs[-1])
        assert np.array_equal(left.numpy().view(np.int32),
                              (xs[-1].numpy() - decoded[-1]).view(np.int32))
        assert qsgd.mean_all(frames, n, bits, bucket)[1] is None
        if path != "numpy":
            reads = host_reads(lambda f=frames: qsgd.mean_all(f, n, bits, bucket))
            assert len(reads) == 1, reads
    frames, cases = _refused(g)
    for group, message in [*cases, ([], "at least one frame")]:
        with pytest.raises(ValueError, match=message):
            qsgd.mean_all(group, 1001, 4, 100)
    for keep in (3, -1, True, 1.0):
        with pytest.raises(ValueError, match="keep in 0..2"):
            qsgd.mean_all(frames, 1001, 4, 100, keep=keep)
    x = torch.zeros(1001)
    with pytest.raises(ValueError, match="residual_of needs keep"):
        qsgd.mean_all(frames, 1001, 4, 100, residual_of=x)
    with pytest.raises(TypeError, match="float32 tensor, got torch.float64"):
        qsgd.mean_all(frames, 1001, 4, 100, keep=0, residual_of=x.double())
    with pytest.raises(TypeError, match="float32 tensor, got list"):
        qsgd.mean_all(frames, 1001, 4, 100, keep=0, residual_of=[0.0] * 1001)
    with pytest.raises(ValueError, match="residual_of of 1001 elements on cpu, got 1000"):
        qsgd.mean_all(frames, 1001, 4, 100, keep=0, residual_of=x[:1000])


@needs_interpreter
def test_the_triton_paths_flag_is_reused_while_clear_and_retired_once_set():
    """On the Triton path a qsgd encode or decode reads its kernel's flag before it returns, so
    the thread's flag is reused while every read finds it clear: no zeroing launch a call. A
    call whose flag is set (a NaN bucket, a corrupt frame, a frame of another header) retires
    it, and the next call gets a zeroed one: it neither raises nor falls back on the stale
    flag, and its bytes and values are the numpy path's. Inside a deferred block, whose reads
    wait for its end, each call gets a flag of its own."""
    from bitcomm.codecs import _frame

    g = torch.Generator().manual_seed(31)
    x = torch.randn(4096, generator=g)
    want = qsgd.encode(x, 4, 512, seed=3)
    bad = x.clone()
    bad[100] = float("nan")
    corrupt = want.clone()
    corrupt[qsgd.HEADER.size + 3] = 0xFF  # the first scale's top byte: a negative NaN
    other = qsgd.encode(x, 2, 512, seed=3)  # another header, the same n: the guess fails
    with forced("triton"):
        zeros = []
        real_zeros = torch.zeros

        def counted(*args, **kwargs):
            zeros.append(args)
            return real_zeros(*args, **kwargs)

        qsgd.encode(x, 4, 512, seed=3)
        qsgd.decode(want, n=4096)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(torch, "zeros", counted)
            for _ in range(3):
                assert torch.equal(qsgd.encode(x, 4, 512, seed=3), want)
                assert torch.equal(qsgd.decode(want, n=4096)[0], qsgd.decode(want)[0])
        assert zeros == []  # the flag of the first calls, reused
        for broken in (lambda: qsgd.encode(bad, 4, 512, seed=3),
                       lambda: qsgd.decode(corrupt, n=4096)):
            with pytest.raises(ValueError):
                broken()
            assert torch.equal(qsgd.encode(x, 4, 512, seed=3), want)
            decoded = qsgd.decode(want, n=4096)[0]
        with forced("numpy"):
            numpy_values = qsgd.decode(want)[0]
            numpy_other = qsgd.decode(other)[0]
        assert torch.equal(decoded, numpy_values)
        assert torch.equal(qsgd.decode(other, n=4096)[0], numpy_other)  # the guess set it
        assert torch.equal(qsgd.decode(want, n=4096)[0], numpy_values)
        with _frame.deferred():
            flags = {_frame.clean_flag(x.device).data_ptr() for _ in range(2)}
        assert len(flags) == 2
