"""The Triton kernels write the numpy path's bytes and decode to its values.

Without a GPU they run in triton's interpreter on CPU tensors (conftest sets
``TRITON_INTERPRET=1``), a few thousand elements at a time: the interpreter runs a program as
numpy operations, about a second per million elements. On a GPU machine, tests/test_cuda.py runs
them on CUDA tensors.
"""

import itertools
import math
import re
import sys

import numpy as np
import pytest
import torch

from bitcomm.codecs import _bracket, _rng, bits, counts, qsgd, select, sign, sparse

from conftest import (
    AWKWARD,
    OTHER_PATHS,
    dispatched,
    forced,
    host_reads,
    needs_interpreter,
    ops_on_the_triton_path,
    serial_scans,
)

pytestmark = [needs_interpreter, pytest.mark.triton]
triton = pytest.importorskip("triton", reason="triton (the dev extra) is not installed")
tl = pytest.importorskip("triton.language")
from bitcomm.codecs import _kernels  # noqa: E402  (imports triton)

SIZES = AWKWARD + [8191, 8193, 65537]  # 8192 elements is one program of the packing kernels


@pytest.fixture(autouse=True)
def _radix_passes(monkeypatch):
    # The radix selection's tests run it on vectors the interpreter takes in seconds, far
    # below SMALL_TOP: they take its passes, not the one-program path (whose tests ask for it).
    monkeypatch.setattr(_kernels, "SMALL_TOP", 0)


def _both(fn):
    ref = fn()
    with forced("triton"):
        got = fn()
    return ref, got


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_nonfinite_flags_nan_and_inf_anywhere(dtype):
    """nonfinite's one read flags NaN, inf or -inf at any position (first, last, in a partial
    last tile), never a finite value (subnormals, -0.0, the largest finite); with narrow,
    float64 values that round to inf in float32 (from 2**128 - 2**103 on), not those that
    round to its largest finite value. _frame.nonfinite_any and all_finite agree with torch."""
    from bitcomm.codecs import _frame

    g = torch.Generator().manual_seed(9)
    info = torch.finfo(dtype)
    for n in (1, 7, 4095, 4097, 9000):
        x = torch.randn(n, generator=g).to(dtype)
        x[0] = info.tiny / 2  # a subnormal
        x[-1] = -0.0 if n > 1 else info.max
        assert _kernels.nonfinite(x).tolist() == [0, 0], n
        for at in {0, n // 2, n - 1}:
            for bad in (float("nan"), float("inf"), -float("inf")):
                y = x.clone()
                y[at] = bad
                assert _kernels.nonfinite(y)[0] != 0, (n, at, bad)
                with forced("triton"):
                    assert bool(_frame.nonfinite_any(y)) and not _frame.all_finite(y)
                expect = y.clone()
                expect[at] = 0.0
                assert_zeroed(y, expect, True)
        assert_zeroed(x, x, False)
    if dtype == torch.float64:
        edge = 2.0**128 - 2.0**103  # the float32 rounding of it and above is inf
        for value, bad in ((edge, True), (-edge, True), (np.nextafter(edge, 0), False),
                           (1e300, True), (float(torch.finfo(torch.float32).max), False)):
            x = torch.zeros(5000, dtype=dtype)
            x[4321] = value
            assert _kernels.nonfinite(x, narrow=True).tolist() == [0, int(bad)], value
            assert bool(torch.isinf(x.float()).any()) == bad  # torch's rounding agrees
            with forced("triton"):
                assert _frame.all_finite(x, as_float32=True) != bad
                assert bool(_frame.nonfinite_any(x, as_float32=True)) == bad
            assert_zeroed(x, torch.zeros_like(x) if bad else x, bad, as_float32=True)
    else:
        with pytest.raises(ValueError, match="narrow takes float64"):
            _kernels.nonfinite(torch.ones(3, dtype=dtype), narrow=True)
    with pytest.raises(TypeError, match="floating-point"):
        _kernels.nonfinite(torch.ones(3, dtype=torch.int32))
    for path in ("torch", "triton"):
        with forced(path), pytest.raises(ValueError, match="contiguous"):
            _frame.zero_nonfinite_(torch.ones(8, dtype=dtype)[::2])


def assert_zeroed(x, expect, had, **kwargs):
    """zero_nonfinite_ on both device paths: ``x``'s copy becomes ``expect`` bit for bit (+0.0
    where it zeroes), and the flag says ``had``."""
    from bitcomm.codecs import _frame

    bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()]
    for path in ("torch", "triton"):
        y = x.clone()
        with forced(path):
            flag = _frame.zero_nonfinite_(y, **kwargs)
        assert flag.dim() == 0 and bool(flag) == had, path
        assert torch.equal(y.view(bits), expect.view(bits)), path


def _assert_same_bits(got, expect, where):
    # float32 bits, -0.0 and subnormals included; NaN where expected (its payload aside)
    nan = torch.isnan(expect)
    assert torch.equal(torch.isnan(got), nan), where
    assert torch.equal(got[~nan].view(torch.int32), expect[~nan].view(torch.int32)), where


def test_kernels_negate_floats_by_a_product_not_by_unary_minus():
    """Triton before 3.8 (3.6 ships with torch 2.11) compiles ``-x`` on floats as ``0 - x``, so
    -(+0.0) came out +0.0 where torch gives -0.0: on an H200 the qsgd mean's kept values lost
    the sign of every zero-level negative code. Every kernel negates a float through
    ``_kernels._neg`` (a product by -1); a unary minus on anything but a literal is refused
    here, since the interpreter's Triton in CI gets it right and cannot show the difference."""
    import ast
    import pathlib

    import bitcomm
    root = pathlib.Path(bitcomm.__file__).parent
    found = []
    for path in (root / "codecs" / "_kernels.py", root / "collectives" / "_kernels.py"):
        for fn in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(fn, ast.FunctionDef)
                    and any("jit" in ast.unparse(d) for d in fn.decorator_list)):
                continue
            for node in ast.walk(fn):
                if (isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub)
                        and not isinstance(node.operand, ast.Constant)
                        and not (isinstance(node.operand, ast.Call)
                                 and ast.unparse(node.operand.func) == "float")):
                    found.append(f"{path.name}:{node.lineno} {fn.name}: {ast.unparse(node)}")
    assert found == [], found


@pytest.mark.parametrize("path", OTHER_PATHS)
def test_a_negative_code_of_level_zero_decodes_to_minus_zero(path):
    """qsgd's sign bit is kept at level 0, so a small negative value decodes to -0.0 on every
    path, alone, among frames, and as the kept frame of their mean."""
    x = torch.tensor([-1e-6, 1e-6, 4.0, -4.0, -1e-7, 0.0, -0.0, 2.5] * 9)
    frames = [qsgd.encode(x, 2, 8, seed=s) for s in (0, 1)]
    want = qsgd.decode(frames[1], n=x.numel())[0]
    assert torch.signbit(want[[0, 4]]).all() and not torch.signbit(want[1])
    with forced(path):
        alone = qsgd.decode(frames[1], n=x.numel())[0]
        each = qsgd.decode_all(frames, x.numel(), 2, 8)[1]
        kept = qsgd.mean_all(frames, x.numel(), 2, 8, keep=1)[1]
    for got in (alone, each, kept):
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), path


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_momentum_gives_torchs_bits_in_one_kernel(dtype):
    """train._common.momentum writes torch's ``m.mul(beta).add_(g.float(), alpha=1 - beta)``
    bit for bit on both device paths, into a new output or into ``m`` itself, at every length
    (a partial last tile too): the product rounded, then one fused multiply-add, which differs
    from adding the two rounded products in about a tenth of the elements. The Triton path
    is one kernel, with no widened copy of a 16-bit gradient."""
    from bitcomm.train._common import momentum

    gen = torch.Generator().manual_seed(12)
    for n in (0, 1, 7, 2047, 2049, 5000):
        m = torch.randn(n, generator=gen)
        g = (torch.randn(n, generator=gen) * 3).to(dtype)
        if n > 2:
            m[0], m[1] = -0.0, torch.finfo(torch.float32).tiny / 8  # signed zero, subnormal
            g[1] = float("nan")
        for beta in (0.9, 0.5, 0.999, 0.0):
            expect = m.mul(beta).add_(g.float(), alpha=1 - beta)
            for path in ("torch", "triton"):
                out = torch.full_like(m, 7.0)
                with forced(path):
                    assert momentum(m, g, beta, out) is out
                _assert_same_bits(out, expect, (n, beta, path))
                inplace = m.clone()
                with forced(path):
                    assert momentum(inplace, g, beta) is inplace
                _assert_same_bits(inplace, expect, (n, beta, path))
    unfused = m * 0.9 + g.float() * (1 - 0.9)
    assert (unfused.view(torch.int32) != m.mul(0.9).add_(g.float(), alpha=0.1)
            .view(torch.int32)).sum() > 100
    out = torch.empty_like(m)
    assert ops_on_the_triton_path(lambda: momentum(m, g, 0.9, out)) == ["_momentum_kernel"]
    with pytest.raises(TypeError, match="float32 momentum"):
        _kernels.momentum(m.double(), g, 0.9, out)
    with pytest.raises(ValueError, match="one length"):
        _kernels.momentum(m, g[1:], 0.9, out)


def test_momenta_launch_a_kernel_only_for_large_tensors():
    """train._common.momenta: an optimizer's many small tensors go through torch's
    multi-tensor ops together (two ops for all of them), each tensor of KERNEL_MIN elements
    or more through the one-pass kernel; every tensor gets momentum()'s bits either way."""
    from bitcomm.train._common import KERNEL_MIN, momenta

    gen = torch.Generator().manual_seed(13)
    sizes = [1, 7, 300, KERNEL_MIN - 1, KERNEL_MIN, KERNEL_MIN + 9]
    ms = [torch.randn(n, generator=gen) for n in sizes]
    gs = [torch.randn(n, generator=gen).to(dt) for n, dt in
          zip(sizes, [torch.float32, torch.bfloat16] * 3, strict=True)]
    expect = [m.mul(0.9).add_(g.float(), alpha=1 - 0.9) for m, g in zip(ms, gs, strict=True)]
    for path in ("numpy", "torch", "triton"):
        got = [m.clone() for m in ms]
        if path == "triton":
            ops = ops_on_the_triton_path(lambda got=got: momenta(got, gs, 0.9))
            assert ops.count("_momentum_kernel") == 2, ops
            assert len(ops) == 4, ops  # and the two multi-tensor ops for the other four
        else:
            with forced(path):
                momenta(got, gs, 0.9)
        for a, b, n in zip(got, expect, sizes, strict=True):
            _assert_same_bits(a, b, (path, n))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_sign_pack_and_unpack(dtype):
    g = torch.Generator().manual_seed(1)
    for n in SIZES:
        x = torch.randn(n, generator=g).to(dtype)
        x[: min(n, 4)] = torch.tensor([0.0, -0.0, float("nan"), -1e-30])[: min(n, 4)].to(dtype)
        ref, got = _both(lambda x=x: sign.encode(x))
        assert torch.equal(ref, got), n
        ref, got = _both(lambda f=ref: sign.decode(f, dtype=dtype)[0])
        assert got.dtype == dtype and torch.equal(ref, got), n


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_scaled_sign(dtype):
    # 70001 elements span 9 blocks of the scale's reduction kernel.
    for n in (1, 1001, 70001):
        x = (torch.randn(n, generator=torch.Generator().manual_seed(n)) * 3.3).to(dtype)
        for kind in sign.SCALES:
            ref, got = _both(lambda kind=kind, x=x: sign.encode_scaled(x, kind))
            assert torch.equal(ref, got), (n, kind)
            ref, got = _both(lambda f=ref: sign.decode_scaled(f, dtype=dtype)[0])
            assert torch.equal(ref, got), (n, kind)


def test_sign_unpack_keeps_the_sign_of_a_zero_scale():
    """The scale rounded to the output dtype is cached per value: a -0.0 scale after a 0.0
    one (equal as floats) still gives its own signed zeros (bit 1: +scale, bit 0: -scale)."""
    buf = torch.tensor([0b10110000], dtype=torch.uint8)
    for first, second in ((0.0, -0.0), (-0.0, 0.0)):
        for scale in (first, second):
            got, _ = _kernels.sign_unpack(buf, 4, torch.float32, scale)
            signs = [math.copysign(1.0, v) for v in got.tolist()]
            assert signs == [math.copysign(1.0, scale if b else -scale) for b in (1, 0, 1, 1)]


@pytest.mark.parametrize("width", [1, 2, 3, 7, 8, 9, 16])
def test_bit_planes(width):
    g = torch.Generator().manual_seed(width)
    for n in SIZES:
        v = torch.randint(0, 1 << width, (n,), generator=g)
        ref, got = _both(lambda v=v: bits.encode(v, width))
        assert torch.equal(ref, got), n
        ref, got = _both(lambda f=ref: bits.decode(f)[0])
        assert ref.dtype == got.dtype and torch.equal(ref, got), n


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 6, 10, 100, 1000])
def test_counts_fixed_and_radix(m):
    g = torch.Generator().manual_seed(m)
    for n in SIZES:
        c = torch.randint(0, m + 1, (n,), generator=g, dtype=torch.int32)
        for packing in counts.PACKINGS:
            ref, got = _both(lambda c=c, p=packing: counts.encode(c, m, p))
            assert torch.equal(ref, got), (n, packing)
            ref, got = _both(lambda f=ref: counts.decode(f)[0])
            assert torch.equal(ref, got), (n, packing)


def _messages(fn):
    """Return the error message of ``fn`` on the numpy path and on the Triton path."""
    out = []
    for p in ("numpy", "triton"):
        with forced(p), pytest.raises(ValueError) as e:
            fn()
        out.append(str(e.value))
    return out


def test_corrupt_payloads_raise_the_same_errors():
    # sign: a padding bit set.
    a, b = _messages(lambda: sign.unpack(torch.tensor([0xFF, 0x01], dtype=torch.uint8), 9))
    assert a == b and "padding" in a
    # bits: a padding bit in the second of three planes.
    payload = bits.pack(torch.tensor([5, 0, 3]), 3)
    payload[1] |= 1
    a, b = _messages(lambda: bits.unpack(payload, 3, 3))
    assert a == b and "row 1" in a
    # counts, fixed: 3 in two bits is above m = 2.
    a, b = _messages(lambda: counts.unpack(torch.tensor([0xC0, 0xC0], dtype=torch.uint8), 2, 2))
    assert a == b and "decoded count 3 > m=2" in a
    # counts, radix m = 2 (5 counts per byte): code 250 >= 3**5.
    a, b = _messages(lambda: counts.unpack(bits.pack(torch.tensor([250]), 8), 5, 2, "radix"))
    assert a == b and "radix code 250" in a
    # counts, radix: a valid code whose padding counts (after n = 3) are not zero.
    a, b = _messages(lambda: counts.unpack(bits.pack(torch.tensor([1]), 8), 3, 2, "radix"))
    assert a == b and "padding counts" in a


def test_full_tiles_and_the_last_one_decode_and_check_alike():
    """The plain decoders run full tiles without masks and the last tile with them: lengths
    that fill every tile (no last tile) or leave one, and a broken rule in either, decode and
    raise as the numpy path does."""
    g = torch.Generator().manual_seed(6)
    sign_tile = 8 * _kernels.TUNING["sign_unpack"][0]  # elements
    for n in (sign_tile, 2 * sign_tile, 2 * sign_tile + 5):
        frame = sign.pack(torch.randn(n, generator=g))
        ref, got = _both(lambda f=frame, n=n: sign.unpack(f, n))
        assert torch.equal(ref, got), n
    bad = sign.pack(torch.randn(2 * sign_tile + 5, generator=g))
    bad[-1] |= 1
    a, b = _messages(lambda: sign.unpack(bad, 2 * sign_tile + 5))
    assert a == b and "padding" in a
    plane_tile = 8 * _kernels.TUNING["planes_unpack"][0]  # counts
    for n in (plane_tile, 2 * plane_tile, 2 * plane_tile + 3):
        c = torch.randint(0, 3, (n,), generator=g)
        ref, got = _both(lambda c=c: counts.unpack(counts.pack(c, 2), c.numel(), 2))
        assert torch.equal(ref, got), n
        for at in (plane_tile // 2, n - 1):  # in the first full tile; in the last tile
            broken = c.clone()
            broken[at] = 3  # above m = 2, packed in two bits as a count of m = 3
            a, b = _messages(lambda br=broken: counts.unpack(counts.pack(br, 3), br.numel(), 2))
            assert a == b and "decoded count 3 > m=2" in a, (n, at)
    payload = bits.pack(torch.randint(0, 8, (plane_tile + 3,), generator=g), 3)
    payload[-1] |= 1  # a padding bit of the last plane
    a, b = _messages(lambda: bits.unpack(payload, plane_tile + 3, 3))
    assert a == b and "padding" in a


def test_radix_rules_are_checked_by_every_program():
    # 3 * 1024 codes of 5 counts each span several programs of the radix decoder; each broken
    # rule sits in the last of them, or in one after the first.
    n = 5 * 3 * 1024 - 2  # the last group holds 3 counts and 2 padding counts
    codes = torch.randint(0, 3**5, (3 * 1024,), generator=torch.Generator().manual_seed(5))
    codes[-1] = 3 * 3**2  # counts 0, 0, 1 and padding 0, 0: a valid last group
    good = bits.pack(codes, 8)
    ref, got = _both(lambda: counts.unpack(good, n, 2, "radix"))
    assert torch.equal(ref, got)
    for i, code, rule in [(1500, 243, "radix code 243"), (3 * 1024 - 1, 1, "padding counts")]:
        bad = codes.clone()
        bad[i] = code
        a, b = _messages(lambda bad=bad: counts.unpack(bits.pack(bad, 8), n, 2, "radix"))
        assert a == b and rule in a, (a, b)


_BUCKETS = [1, 7, 8, 512, 4096, 8192, 100_000]  # fused: powers of two from 8 to 4096


@pytest.mark.parametrize("nbits", qsgd.BITS)
@pytest.mark.parametrize("scale", qsgd.SCALES)
def test_qsgd_encode(nbits, scale):
    g = torch.Generator().manual_seed(nbits)
    for n in [0, 1, 7, 9, 4095, 4097]:
        for bucket in _BUCKETS:
            for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
                x = (torch.randn(n, generator=g) * 3).to(dtype)
                x[:3] = torch.tensor([-0.0, 0.0, 1e-40])[: min(n, 3)].to(dtype)
                x[3:50:5] *= 1e30 if dtype in (torch.float32, torch.float64) else 1
                ref, got = _both(lambda x=x, b=bucket: qsgd.encode(x, nbits, b, scale=scale,
                                                                  seed=n + b))
                assert torch.equal(ref, got), (n, bucket, dtype)


def test_qsgd_codes_are_written_16_byte_aligned():
    """The encoder places its frame so that the kernel's codes (behind a 14-byte header and
    the scales) start on a 16-byte boundary, where a store moves 16 bytes a lane."""
    x = torch.randn(5000, generator=torch.Generator().manual_seed(4))
    for nbits in qsgd.BITS:
        for bucket in (512, 1000, 4096):
            with forced("triton"):
                frame = qsgd.encode(x, nbits, bucket, seed=1)
            start = qsgd.HEADER.size + 4 * -(-x.numel() // bucket)
            assert (frame.data_ptr() + start) % 16 == 0, (nbits, bucket)
            assert torch.equal(frame, qsgd.encode(x, nbits, bucket, seed=1))


@pytest.mark.parametrize("bucket", [512, 1000])
def test_qsgd_non_finite_buckets_raise_the_same_errors(bucket):
    # The fused kernel finds a bucket's max and its NaNs in one integer reduction: a NaN
    # anywhere in the bucket (with or without an inf) makes the scale NaN, an inf alone inf.
    one, two = bucket, 2 * bucket  # the first elements of buckets 1 and 2
    for bad, named in [({one + 5: "inf", two + 3: "nan"}, "inf in bucket 1"),
                       ({one + 5: "nan", two: "inf"}, "nan in bucket 1"),
                       ({one + 5: "-inf", one + 9: "nan"}, "nan in bucket 1")]:
        x = torch.randn(4 * bucket, generator=torch.Generator().manual_seed(3))
        for i, value in bad.items():
            x[i] = float(value)
        a, got = _messages(lambda x=x: qsgd.encode(x, 4, bucket, seed=1))
        assert a == got and named in a, (a, got)


def test_qsgd_fused_encode_checks_its_scales_in_its_pass():
    """The fused encoder's kernel flags a bucket whose scale is not finite and writes the
    scales where they lie in the frame, and the header: besides it, a zeroed flag and the
    flag's read, no copy of the header from the host and no torch op over the scales
    (torch's isfinite is five). Inside _frame.deferred the flag is read at the block's end,
    with the usual error. The unfused encoder (a bucket not a power of two) writes the
    header in its kernel too, and an empty vector's frame is the header alone."""
    from bitcomm.codecs import _frame

    x = torch.randn(5000, generator=torch.Generator().manual_seed(4))
    frame = []
    ops = ops_on_the_triton_path(lambda: frame.append(qsgd.encode(x, 4, 512, seed=1)))
    assert ops == ["zeros", "_qsgd_codes_kernel", "_local_scalar_dense"], ops
    assert torch.equal(frame[0], qsgd.encode(x, 4, 512, seed=1))
    for bucket, n in ((1000, 5000), (512, 0), (1000, 0)):
        frame.clear()
        ops = ops_on_the_triton_path(
            lambda bucket=bucket, n=n: frame.append(qsgd.encode(x[:n], 4, bucket, seed=1)))
        # the scales' copy into the frame (torch computes them for such a bucket), none of
        # the header
        assert ops.count("copy_") == (bucket == 1000 and n > 0), ops
        assert ("_head_kernel" in ops) == (n == 0), ops
        assert torch.equal(frame[0], qsgd.encode(x[:n], 4, bucket, seed=1)), (bucket, n)
    x[2600] = float("inf")
    with forced("triton"), pytest.raises(ValueError, match="max scale inf in bucket 5"):
        with _frame.deferred():
            qsgd.encode(x, 4, 512, seed=1)


def test_qsgd_decode_is_one_pass_and_one_read():
    """A qsgd frame's decode on the Triton path (no frame of its length decoded before)
    reads its header, then launches one kernel (over its full tiles and its partial one)
    that computes the steps, checks both rules and writes the values, then reads the check's
    flag; no steps kernel and no steps in memory. A broken rule still raises its precise
    error, and a flagged frame in _frame.deferred at the block's end."""
    from bitcomm.codecs import _frame

    x = torch.randn(5000, generator=torch.Generator().manual_seed(4))
    frame = qsgd.encode(x, 4, 512, seed=1)
    got = []
    ops = ops_on_the_triton_path(lambda: got.append(qsgd.decode(frame, n=5000)))
    # the header's read is not a torch op on a CPU tensor; 5000 elements are full tiles and a
    # partial one; the check's read comes behind the kernels
    assert ops == ["zeros", "_qsgd_decode_kernel", "_qsgd_decode_kernel",
                   "_local_scalar_dense"], ops
    assert torch.equal(got[0][0], qsgd.decode(frame, n=5000)[0])
    bad = frame.clone()
    bad[14 + 4 * 3 + 3] = 0xFF  # bucket 3's scale becomes a NaN
    with forced("triton"), pytest.raises(ValueError, match="finite scale >= 0 in bucket 3"):
        qsgd.decode(bad, n=5000)
    with forced("triton"), pytest.raises(ValueError, match="finite scale >= 0 in bucket 3"):
        with _frame.deferred():
            qsgd.decode(bad, n=5000)
    # a bucket that is not a power of two: the steps kernel, then the values'
    frame = qsgd.encode(x, 4, 500, seed=1)
    qsgd._SEEN = qsgd._Layouts()
    ops = ops_on_the_triton_path(lambda: qsgd.decode(frame, n=5000))
    assert ops == ["zeros", "_qsgd_steps_kernel", "_qsgd_values_kernel",
                   "_qsgd_values_kernel", "_local_scalar_dense"], ops


@pytest.mark.parametrize("nbits", [2, 8])
def test_qsgd_decode_reads_aligned_scales_as_words_and_others_by_the_byte(nbits, monkeypatch):
    """A frame laid out as the encoder allocates it (codes 16-byte aligned, so its scales
    4-byte aligned) is decoded reading each scale as one int32; the same frame one byte off
    (as a transport may place it) byte by byte. Both give numpy's values to the bit, and a
    NaN scale raises its error from either."""
    from bitcomm.codecs import _frame, _kernels

    n, bucket = 5000, 512
    x = torch.randn(n, generator=torch.Generator().manual_seed(5))
    frame = qsgd.encode(x, nbits, bucket, seed=1)
    start = qsgd.HEADER.size + 4 * -(-n // bucket)
    aligned = _frame.empty_aligned_at(frame.numel(), start, "cpu")
    aligned.copy_(frame)
    off = torch.empty(frame.numel() + 16, dtype=torch.uint8)
    shifted = off[(aligned.data_ptr() - off.data_ptr() + 1) % 16 :][: frame.numel()]
    shifted.copy_(frame)
    words = []
    launch = _kernels.launch

    def seen(kernel, grid, *args, **kwargs):
        words.append(kwargs.get("WORDS"))
        launch(kernel, grid, *args, **kwargs)

    monkeypatch.setattr(_kernels, "launch", seen)
    want = _qsgd_decoded_by_numpy(frame, n, nbits, bucket).view(np.int32)
    for buf, as_words in ((aligned, True), (shifted, False)):
        words.clear()
        with forced("triton"):
            got = qsgd.decode(buf, n=n)[0]
        assert words == [as_words, as_words], (as_words, words)  # full tiles and the edge
        assert np.array_equal(got.numpy().view(np.int32), want), as_words
        bad = _frame.empty_aligned_at(frame.numel(), start, "cpu") if as_words else shifted
        bad.copy_(frame)
        bad[14 + 4 * 3 + 3] = 0xFF  # bucket 3's scale becomes a NaN
        with forced("triton"), pytest.raises(ValueError, match="finite scale >= 0 in bucket 3"):
            qsgd.decode(bad, n=n)


def _outcome(fn):
    # A decode's values as int32 bits (with the bytes it consumed), or its error's message.
    try:
        values, used = fn()
    except ValueError as e:
        return str(e)
    return values.view(torch.int16 if values.element_size() == 2 else torch.int32), used


@pytest.mark.parametrize("bucket", [512, 500])
def test_qsgd_decode_of_a_layout_seen_before_is_one_read_after_the_launch(bucket):
    """With n given, a frame with the header of the last frame of n elements decoded on its
    device decodes with one host read, behind the launch (one pass for a power-of-two bucket,
    the steps kernel then the values' for another); the pass compares the header on the
    device. Whatever the frame holds - another layout of n elements, a header that differs
    in any byte, a broken rule, too few bytes - the result or the error is the one a decode
    with nothing remembered gives."""
    from bitcomm.codecs import _frame

    from conftest import host_reads

    g = torch.Generator().manual_seed(11)
    x = torch.randn(5000, generator=g)
    first, frame = (qsgd.encode(x * s, 4, bucket, seed=s) for s in (1, 2))
    with forced("triton"):
        # the header's (.cpu().numpy(), one line), then the flag's
        reads = host_reads(lambda: qsgd.decode(first, n=5000))
        assert len({r[1:] for r in reads}) == 2, reads
        reads = host_reads(lambda: qsgd.decode(frame, n=5000))
        assert [r[0] for r in reads] == ["__bool__"], reads
    ops = ops_on_the_triton_path(lambda: qsgd.decode(frame, n=5000))
    kernels = (["_qsgd_decode_kernel"] * 2 if bucket == 512 else
               ["_qsgd_steps_kernel", "_qsgd_values_kernel", "_qsgd_values_kernel"])
    # the header's bytes for the steps kernel come from pinned memory; the flag is the one the
    # decodes above zeroed, the thread's
    assert [o for o in ops if o not in ("empty", "copy_")] == \
        [*kernels, "_local_scalar_dense"], ops
    want = _qsgd_decoded_by_numpy(frame, 5000, 4, bucket)
    with forced("triton"):
        got, used = qsgd.decode(frame, n=5000)
        assert np.array_equal(got.numpy().view(np.int32), want.view(np.int32))
        assert used == frame.numel()
        half = qsgd.decode(frame, n=5000, dtype=torch.bfloat16)[0]
        assert torch.equal(half, torch.from_numpy(want).bfloat16())
        tail = qsgd.decode(torch.cat([frame, frame[:7]]), n=5000)
        assert torch.equal(tail[0], got) and tail[1] == frame.numel()

    def fresh(buf):  # the same decode with nothing remembered
        qsgd._SEEN = qsgd._Layouts()
        return _outcome(lambda: qsgd.decode(buf, n=5000))

    def primed(buf):
        qsgd._SEEN = qsgd._Layouts()
        qsgd.decode(frame, n=5000)
        return _outcome(lambda: qsgd.decode(buf, n=5000))

    others = [qsgd.encode(x, 2, bucket, seed=3), qsgd.encode(x, 4, bucket, scale="l2", seed=3),
              qsgd.encode(x, 4, 256, seed=3), qsgd.encode(x[:4999], 4, bucket, seed=3),
              torch.cat([qsgd.encode(x[:4999], 4, bucket, seed=3), frame[-8:]]),
              frame[:-1], frame[:14]]
    for i in range(qsgd.HEADER.size):  # a header that differs in one byte
        bad = frame.clone()
        bad[i] ^= 1 << (i % 8)
        others.append(bad)
    bad = frame.clone()
    bad[14 + 4 * 3 + 3] = 0xFF  # bucket 3's scale becomes a NaN
    others.append(bad)
    bad = frame.clone()
    bad[-1] |= 1  # 5000 4-bit codes fill their bytes: the last code, not padding
    others.append(bad)
    with forced("triton"):
        for i, buf in enumerate(others):
            want, got = fresh(buf), primed(buf)
            assert type(want) is type(got), (i, want, got)
            if isinstance(want, str):
                assert got == want, i
            else:
                assert torch.equal(got[0], want[0]) and got[1] == want[1], i
        assert "finite scale >= 0 in bucket 3" in fresh(others[-2])
        qsgd.decode(frame, n=5000)
        with pytest.raises(ValueError, match="finite scale >= 0 in bucket 3"), \
                _frame.deferred():
            qsgd.decode(others[-2], n=5000)
        with pytest.raises(TypeError, match="n"):
            qsgd.decode(frame, n=5000.0)


def _qsgd_decoded_by_numpy(frame: torch.Tensor, n: int, nbits: int, bucket: int) -> np.ndarray:
    # float32(scale / s) * level, negated for sign 1, from the frame's bytes by numpy.
    s = (1 << (nbits - 1)) - 1
    nb = -(-n // bucket)
    scales = frame[14 : 14 + 4 * nb].numpy().copy().view(np.float32)
    codes = np.unpackbits(frame[14 + 4 * nb :].numpy()).reshape(-1, nbits)
    codes = (codes * (1 << np.arange(nbits - 1, -1, -1))).sum(1)[:n]
    step = (scales / np.float32(s)).astype(np.float32)  # numpy divides correctly rounded
    level = (codes & s).astype(np.float32)
    want = level * step[np.arange(n) // bucket]
    return np.where(codes >> (nbits - 1), -want, want).astype(np.float32)


@pytest.mark.parametrize("block", [16, 1024])
def test_qsgd_one_pass_decode_tiles_buckets_every_way(block, monkeypatch):
    """The one-pass decoder's tiles hold several buckets, one, or part of one, with a partial
    last bucket, tile and code byte: every value is numpy's formula to the bit (also as
    bfloat16), and a bad scale or padding bit is flagged wherever it lies."""
    from bitcomm.codecs import _frame

    monkeypatch.setitem(_kernels.TUNING, "qsgd_decode", (block, 2))
    x = torch.randn(301, generator=torch.Generator().manual_seed(block)) * 3.1
    cases = [(nbits, bucket, n) for nbits in qsgd.BITS for bucket in (1, 2, 4, 8, 16, 64, 4096)
             if bucket >= 8 // nbits for n in (0, 1, 9, 301)]
    for nbits, bucket, n in cases:
        frame = qsgd.encode(x[:n], nbits, bucket, seed=n)
        want = _qsgd_decoded_by_numpy(frame, n, nbits, bucket)
        with forced("triton"):
            got = qsgd.decode(frame, n=n)
            half = qsgd.decode(frame, dtype=torch.bfloat16)[0]
        assert got[1] == frame.numel(), (nbits, bucket, n)
        assert np.array_equal(got[0].numpy().view(np.int32), want.view(np.int32)), \
            (nbits, bucket, n)
        assert torch.equal(half, torch.from_numpy(want).bfloat16()), (nbits, bucket, n)
        nb = -(-n // bucket)
        for i in sorted({0, nb // 2, nb - 1}) if n == x.numel() else ():
            bad = frame.clone()
            bad[14 + 4 * i : 18 + 4 * i] = torch.tensor([0, 0, 0x80, 0xBF], dtype=torch.uint8)
            with forced("triton"), pytest.raises(ValueError, match=f"scale >= 0 in bucket {i}"):
                with _frame.deferred():
                    qsgd.decode(bad)
        if n * nbits % 8:
            bad = frame.clone()
            bad[-1] |= 1
            with forced("triton"), pytest.raises(ValueError, match="padding bits"):
                qsgd.decode(bad)


def test_the_finiteness_checks_are_one_kernel_on_the_triton_path():
    """all_finite and the device flags of the codecs' checks read the tensor once, in one
    kernel (and a zeroed flag), where torch's isfinite is five kernels; a checked
    collective's input check is that kernel and one read."""
    from bitcomm.codecs import _frame
    from bitcomm.collectives import _common
    from bitcomm.comm.local import LocalComm, LocalGroup

    x = torch.randn(5000, dtype=torch.float64)
    assert sorted(ops_on_the_triton_path(lambda: _frame.all_finite(x, as_float32=True))) \
        == sorted(["zeros", "_nonfinite_kernel", "select", "ne", "_local_scalar_dense"])
    narrow = x.float()
    assert sorted(ops_on_the_triton_path(lambda: _frame.nonfinite_any(narrow))) \
        == sorted(["zeros", "_nonfinite_kernel", "select", "ne"])
    # zeroing in place rides on the same read: no isfinite, no where or masked fill, no copy
    assert sorted(ops_on_the_triton_path(lambda: _frame.zero_nonfinite_(x, as_float32=True))) \
        == sorted(["zeros", "_nonfinite_kernel", "select", "ne"])
    comm = LocalComm(LocalGroup(1), 0)
    ops = ops_on_the_triton_path(lambda: _common.prepare(comm, x, True, "test"))
    assert ops.count("_nonfinite_kernel") == 1 and "isfinite" not in ops and "abs" not in ops


def test_qsgd_encode_across_stream_blocks():
    # 3 stream blocks of 2**16 elements and a partial one, fused and unfused buckets.
    x = torch.randn(3 * 65536 + 5, generator=torch.Generator().manual_seed(7))
    for bucket in (512, 1000):
        ref, got = _both(lambda b=bucket: qsgd.encode(x, 4, b, seed=b))
        assert torch.equal(ref, got), bucket


def test_qsgd_stream_past_two_to_the_32():
    """The kernel's hash of a tile in the first half of a 2**16-element block gives _rng's
    stream there and, from the same hashes, at its partner 2**15 elements on, where the hash
    index's high word changes (2**31 and 2**32 elements on) and far beyond, for tiles of the
    sizes the encoder takes (a power of two up to 2**15)."""
    starts = [0, (1 << 32) - (1 << 16), 1 << 32, (1 << 33) - (1 << 16),
              (5 << 32) + (3 << 16), 1 << 62]
    for tile in (2048, 1 << 15):
        for start in starts:
            for base in (start, start + (1 << 15) - tile):  # a half's first and last tiles
                for key in (0, 12345, -7, 2**31 - 1):
                    out = torch.empty(2, tile, dtype=torch.int32)
                    signed = (key & 0xFFFFFFFF) - ((key & 0x80000000) << 1)  # key as int32
                    # the base as an int64 tensor: triton types an int argument in
                    # [2**31, 2**32) as uint32
                    _stream_kernel[(1,)](out, torch.tensor([base]), signed, TILE=tile)
                    assert torch.equal(out[0], _rng.random16(key, base, tile)), (tile, base)
                    assert torch.equal(out[1], _rng.random16(key, base + (1 << 15), tile)), \
                        (tile, base, key)


def test_qsgd_encoder_tiles_suit_the_stream():
    """Every tile the encoder launches is a power of two of at most 2**15 elements, which its
    hash takes (a tile in the first half of a 2**16-element block, and its partner 2**15 on),
    and its programs' tiles cover the vector: each tile start below n once."""
    from bitcomm.bench.kernels import _recorded

    for n in (1 << 20, (1 << 20) + 5000, (1 << 20) + 40000, 100):
        x = torch.empty(n, device="meta")
        for bucket in [1 << k for k in range(3, _kernels.MAX_FUSED_BUCKET.bit_length())] + [1000]:
            fused = bucket & (bucket - 1) == 0
            with _recorded() as calls:
                _kernels.qsgd_codes(x, 4, bucket, 1, torch.empty(-(-n // bucket), device="meta"),
                                    None if fused else torch.empty(1024, device="meta"))
            (_, grid, _, kwargs), = calls
            size = kwargs["ROWS"] * kwargs["ROW"]
            assert size & (size - 1) == 0 and size <= 1 << 15, (bucket, size)
            half = (1 << 15) // size
            firsts = [(p // half) * (1 << 16) + (p % half) * size for p in range(grid[0])]
            tiles = [t for f in firsts for t in (f, f + (1 << 15)) if t < n]
            assert max(firsts) < n and sorted(tiles) == list(range(0, n, size)), (n, bucket)


@triton.jit
def _stream_kernel(out_ptr, base_ptr, key, TILE: tl.constexpr):
    i = tl.arange(0, TILE)
    low, high = _kernels._pair_random16(tl.load(base_ptr), i, key)
    tl.store(out_ptr + i, low)
    tl.store(out_ptr + TILE + i, high)


@pytest.mark.parametrize("nbits", qsgd.BITS)
def test_qsgd_decode_is_one_formula(nbits):
    """Every path decodes to float32(float32(scale / s) * level), negated for sign 1."""
    x = torch.randn(5003, generator=torch.Generator().manual_seed(nbits)) * 2.7
    s = (1 << (nbits - 1)) - 1
    for bucket in (7, 512):
        frame = qsgd.encode(x, nbits, bucket, seed=3)
        nb = -(-x.numel() // bucket)
        scales = frame[14 : 14 + 4 * nb].numpy().view(np.float32)
        codes = np.unpackbits(frame[14 + 4 * nb :].numpy()).reshape(-1, nbits)
        codes = (codes * (1 << np.arange(nbits - 1, -1, -1))).sum(1)[: x.numel()]
        step = (scales / np.float32(s)).astype(np.float32)  # numpy divides correctly rounded
        level = (codes & s).astype(np.float32)
        want = level * step[np.arange(x.numel()) // bucket]
        want = np.where(codes >> (nbits - 1), -want, want).astype(np.float32)
        for p in ("numpy", "torch", "triton"):
            with forced(p):
                got = qsgd.decode(frame)[0].numpy()
                narrow = {dt: qsgd.decode(frame, dtype=dt)[0]
                          for dt in (torch.float16, torch.bfloat16, torch.float64)}
            assert np.array_equal(got.view(np.int32), want.view(np.int32)), (p, bucket)
            for dt, values in narrow.items():  # the float32 values, rounded to nearest once
                assert torch.equal(values, torch.from_numpy(want).to(dt)), (p, bucket, dt)


@pytest.mark.parametrize("grid_y", [65535, 2])
def test_qsgd_steps_checks_every_rule_of_every_frame_in_one_launch(grid_y, monkeypatch):
    """qsgd_steps gives each bucket's scale / s (numpy's correctly rounded float32 division)
    and sets its flag for a scale that is NaN, inf, -inf or below 0 (not -0.0), a set padding
    bit, or a header byte other than the expected one, in any frame: frames past the first,
    buckets past the first block of 1024. decode and decode_all raise their usual errors.
    With more frames than a grid's second axis holds (2 here), the same, a launch a part."""
    monkeypatch.setattr(_kernels, "MAX_GRID_Y", grid_y)
    g = torch.Generator().manual_seed(12)
    n, nbits, bucket = 2053, 4, 2  # 1027 buckets: two blocks; 2053 codes leave 4 pad bits
    frames = [qsgd.encode(torch.randn(n, generator=g) * (r + 1), nbits, bucket, seed=r)
              for r in range(3)]
    nb, head = -(-n // bucket), qsgd.HEADER.size
    header = torch.tensor(list(frames[0][:head].tolist()), dtype=torch.uint8)

    def run(rows, expected=header):
        flag = torch.zeros(1, dtype=torch.int32)
        steps = _kernels.qsgd_steps(rows, head, nb, n, nbits, expected, flag)
        return steps, int(flag)

    rows = torch.stack(frames)
    steps, flag = run(rows)
    scales = rows[:, head : head + 4 * nb].contiguous().view(torch.float32).numpy()
    assert flag == 0
    assert np.array_equal(steps.numpy(), scales / np.float32(7))
    assert run(rows[:1], None)[1] == 0

    def broken(r, at, value):
        bad = rows.clone()
        bad[r, at : at + len(value)] = torch.tensor(value, dtype=torch.uint8)
        return bad

    last = head + 4 * (nb - 1)  # the last scale, in the second block
    for r, at, value in [(2, last, [0, 0, 0xC0, 0x7F]), (1, head, [0, 0, 0x80, 0x7F]),
                         (1, last, [0, 0, 0x80, 0xFF]), (2, head + 8, [0, 0, 0x80, 0xBF]),
                         (1, rows.shape[1] - 1, [int(rows[1, -1]) | 1]), (2, 9, [8]),
                         (1, 0, [6])]:
        assert run(broken(r, at, value))[1] == 1, (r, at, value)
    assert run(broken(2, head + 8, [0, 0, 0, 0x80]))[1] == 0  # -0.0 is a scale >= 0
    assert run(broken(1, 0, [6]), None)[1] == 0  # no header to compare
    bad = broken(1, head + 4 * 1026, [0, 0, 0xC0, 0x7F])[1]
    for p in ("numpy", "triton"):
        with forced(p), pytest.raises(ValueError, match="finite scale >= 0 in bucket 1026"):
            qsgd.decode(bad)
        with forced(p), pytest.raises(ValueError, match="finite scale >= 0 in bucket 1026"):
            qsgd.decode_all([frames[0], bad], n, nbits, bucket)


@pytest.mark.parametrize("nbits", qsgd.BITS)
def test_qsgd_mean_is_the_rank_order_sum_of_the_decodes(nbits):
    """qsgd.mean_all's one pass over every frame gives, to the bit, the frames' decoded
    float32 values added in list order from +0.0 (a level 0 of sign 1 decodes to -0.0) and
    divided by their number, correctly rounded (brute force in numpy); the kept frame's
    values are its decode's. Awkward lengths (full tiles and a partial last one), a power-of-
    two bucket and another, 1 to 5 frames, scales that make the sum's rounding matter."""
    g = torch.Generator().manual_seed(40 + nbits)
    for n, bucket, count in ((1, 8, 1), (9, 7, 3), (1025, 512, 5), (4097, 100, 2),
                             (5003, 64, 3), (0, 8, 2)):
        xs = [torch.randn(n, generator=g) * 10.0 ** (r % 3) for r in range(count)]
        frames = [qsgd.encode(x, nbits, bucket, seed=r) for r, x in enumerate(xs)]
        decoded = [qsgd.decode(f)[0].numpy() for f in frames]
        total = np.zeros(n, dtype=np.float32)
        for d in decoded:
            total = total + d
        want = total / np.float32(count)
        for keep in (None, count - 1):
            with forced("triton"):
                mean, kept = qsgd.mean_all(frames, n, nbits, bucket, keep=keep)
            assert np.array_equal(mean.numpy().view(np.int32), want.view(np.int32)), \
                (n, bucket, count)
            if keep is None:
                assert kept is None
                continue
            assert np.array_equal(kept.numpy().view(np.int32), decoded[keep].view(np.int32))
            # the residual of x: x less the kept values, float32 subtraction
            with forced("triton"):
                mean2, left = qsgd.mean_all(frames, n, nbits, bucket, keep=keep,
                                            residual_of=xs[keep])
            assert torch.equal(mean2.view(torch.int32), mean.view(torch.int32))
            assert np.array_equal(left.numpy().view(np.int32),
                                  (xs[keep].numpy() - decoded[keep]).view(np.int32))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_sidco_stage_sums_what_each_fit_needs_of_the_scaled_scores(dtype):
    """sidco_stage divides each score by the largest in float64 (correctly rounded, as numpy
    does) and sums per tile: counts, a later stage's least and largest exactly as numpy's, the
    fits' sums
    (a later stage's of the exceedances of eta, less eta) to float64 rounding; at awkward
    lengths (one element, a tile less and more one, a partial last tile), with zeros."""
    g = torch.Generator().manual_seed(11)
    for n in (1, 1023, 1025, 5000):
        x = (torch.randn(n, generator=g).abs() * 3).to(dtype)
        x[1::7] = 0.0
        top = x.max()
        y = x.double().numpy() / np.float64(top)  # the quotients as numpy divides
        for eta in (None, 0.125, 2.0):
            taken = y if eta is None else y[y >= eta]
            z = taken - (eta or 0.0)
            pos = taken[taken > 0]
            want = {"exponential": [z.sum()],
                    "pareto": [z.mean() if z.size else 0.0, ((z - z.mean()) ** 2).sum()
                               if z.size else 0.0],
                    "gamma": [pos.size, pos.sum(), np.log(pos).sum()]}
            for kind in _kernels.SIDCO_KINDS:
                got = _kernels.sidco_stage(x, kind, top if eta is None else float(top),
                                           eta or 0.0).tolist()
                assert got[0] == taken.size, (n, eta, kind)
                if eta is not None and taken.size:  # the first stage's range is aminmax's
                    assert got[1:3] == [taken.min(), taken.max()], (n, eta, kind)
                assert got[3:] == pytest.approx(want[kind], rel=1e-12, abs=1e-12), \
                    (n, eta, kind)
    with pytest.raises(ValueError, match="expected kind"):
        _kernels.sidco_stage(x, "cauchy", top)
    with pytest.raises(TypeError, match="contiguous float"):
        _kernels.sidco_stage(x[::2], "pareto", top)


def test_qsgd_mean_takes_one_pass_over_the_frames(launched):
    """The Triton path decodes no frame on its own: one launch checks every frame and
    computes its steps, then one mean kernel (a full-tile launch and a last-tile one), no
    qsgd_values launch, whatever the number of frames."""
    frames = [qsgd.encode(torch.randn(3001), 4, 512, seed=r) for r in range(6)]
    with forced("triton"):
        launched.clear()
        qsgd.mean_all(frames, 3001, 4, 512, keep=2)
    assert launched == ["_qsgd_steps_kernel"] + ["_qsgd_mean_kernel"] * 2, launched


# --- fused collective steps -------------------------------------------------------------------


@pytest.mark.parametrize("size", [1, 2, 3, 5, 8])
def test_fused_majorities_equal_the_numpy_path(size):
    """The three majorities with their fused kernels: same result, same bytes."""
    from bitcomm.collectives import (
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
    from bitcomm.comm import run_local

    # Each interpreted launch costs milliseconds and a ring makes 2 (size - 1) per rank, so
    # the larger rings see fewer cases.
    if size <= 3:
        cases = [(n, tie) for n in (0, 1, 9, 4097) for tie in ("negative", "positive", "alternate")]
    else:
        cases = [(2 * size + 1, "negative"), (1001, "positive"), (1003, "alternate")]
    for n, tie in cases:
        g = torch.Generator().manual_seed(n * 10 + size)
        xs = [torch.randn(n, generator=g) for _ in range(size)]
        xs[0][: min(n, 2)] = 0.0  # zeros vote +1
        votes = sum((x >= 0).to(torch.int32) for x in xs)

        def fn(c):
            x = xs[c.rank]
            c.counters.reset()
            ring = ring_majority(c, x, tie=tie, phase=1)
            ring_extra = c.counters.total_sent - ring_majority_bytes(n, size, c.rank)
            c.counters.reset()
            a2a = alltoall_majority(c, x.half(), tie=tie, phase=1)
            a2a_extra = c.counters.total_sent - alltoall_majority_bytes(n, size, c.rank)
            c.counters.reset()
            ag = allgather_majority(c, x.half(), tie=tie, phase=1)
            ag_extra = c.counters.total_sent - allgather_majority_bytes(n, size)
            packed = ring_majority_packed(c, x.double(), tie=tie, phase=1)
            ag_packed = allgather_majority_packed(c, x, tie=tie, phase=1)
            a2a_packed = alltoall_majority_packed(c, x, tie=tie, phase=1)
            return (ring, a2a, packed, ag, ag_packed, a2a_packed, ring_extra, a2a_extra,
                    ag_extra)

        ref = run_local(fn, size)
        with forced("triton"):
            got = run_local(fn, size)
        for r in range(size):
            for a, b in zip(ref[r][:6], got[r][:6], strict=True):
                assert a.dtype == b.dtype and torch.equal(a, b), (n, size, tie)
            assert torch.equal(got[r][3], got[r][1])  # all-to-all and allgather agree
            assert torch.equal(got[r][4], got[r][2]) and torch.equal(got[r][5], got[r][2])
            assert got[r][6:] == (0, 0, 0)  # bytes sent equal the documented formulas
        # Against a brute-force count of the votes: ties give -1, or +1 with tie="positive",
        # or (phase 1) +1 at odd indices with tie="alternate".
        odd = torch.arange(n) % 2 == 1
        want = {"negative": 2 * votes > size, "positive": 2 * votes >= size,
                "alternate": (2 * votes > size) | ((2 * votes == size) & odd)}[tie]
        assert torch.equal(got[0][0], torch.where(want, 1.0, -1.0))


def test_count_step_adds_votes_and_repacks():
    """One ring step: received planes + this rank's votes, repacked at the next width."""
    from bitcomm.collectives import _kernels as ck

    g = torch.Generator().manual_seed(3)
    for n in (1, 8, 9, 8191, 8192, 8193):  # 8192: two full tiles and no last one
        for i in (1, 2, 3, 4, 7, 8):  # 8: a decision over 9 ranks from 4 planes
            before = torch.randint(0, i + 1, (n,), generator=g)
            x = torch.randn(n, generator=g)
            # every count, with either vote
            before[: 2 * (i + 1)] = torch.arange(i + 1).repeat_interleave(2)[:n]
            x[: 2 * (i + 1)] = torch.tensor([-1.0, 1.0]).repeat(i + 1)[:n]
            received = counts.pack(before, i)
            if n % 8:  # padding bits set in the received planes stay clear in what is sent
                w, nb = counts.width(i), (n + 7) // 8
                received.view(w, nb)[:, -1] |= (1 << (8 - n % 8)) - 1
            got = ck.count_step(received, x, counts.width(i), counts.width(i + 1))
            assert torch.equal(got, counts.pack(before + (x >= 0).long(), i + 1)), (n, i)
            wider = counts.width(i) + 2  # planes past the sum's are zeros
            got = ck.count_step(received, x, counts.width(i), wider)
            assert torch.equal(got, counts.pack(before + (x >= 0).long(), (1 << wider) - 1))
            twice = 2 * (before + (x >= 0))
            for base in (5, 0):  # odd, then even local indices go up on a tie
                even = (torch.arange(n) + base) % 2 == 0
                for tie, want in (("negative", twice > i + 1), ("positive", twice >= i + 1),
                                  ("alternate", (twice > i + 1) | ((twice == i + 1) & even))):
                    dec = ck.count_step(received, x, counts.width(i), 1, decide=i + 1,
                                        tie=tie, tie_base=base)
                    assert torch.equal(dec, bits.pack(want.to(torch.uint8), 1)), (n, i, tie)
    with pytest.raises(ValueError, match="at most 8 ranks"):  # 2 planes and a vote: 3 bits
        ck.count_step(counts.pack(torch.zeros(8, dtype=torch.long), 3), torch.ones(8), 2, 1,
                      decide=9)


def _unpacked(packed: torch.Tensor, n: int) -> torch.Tensor:
    return torch.from_numpy(np.unpackbits(packed.numpy())[:n].astype(bool))


def test_onebit_and_vote_kernels_in_full_tiles_and_the_last_one():
    """The all-to-all vote count and 1-bit Adam's kernels against torch, at lengths that fill
    every tile (no masks), leave a last tile (masks, padding bits), or both; scaled_signs with
    chunks of a tile or more (one scale division a tile) and smaller."""
    from bitcomm.collectives import _kernels as ck

    g = torch.Generator().manual_seed(8)
    tile = 8 * ck.TUNING["vote_count"][0]  # elements a program (vote_count, scaled_signs)
    for n in (13, tile, 2 * tile + 13):
        # 255: the most ranks whose counts take a byte each; 256: an int32 each
        for size in (1, 2, 4, 5) if n > 13 else (1, 2, 4, 5, 254, 255, 256):
            raw = torch.randint(0, 2, (size, n), generator=g, dtype=torch.uint8)
            raw[:, :4], raw[:, 4:8] = 1, 0  # every rank alike: the counts' extremes
            raw[:, 8:12] = 0  # and at the majority's edge: half the ranks, one more, a tie
            raw[: size // 2, 8:10] = raw[: size // 2 + 1, 10:12] = 1
            votes = torch.stack([bits.pack(r, 1) for r in raw])
            if n % 8:  # padding bits set in the votes stay clear in the decision
                votes[:, -1] |= (1 << (8 - n % 8)) - 1
            count = raw.sum(0)
            for base in (1, 2):  # odd, then even local indices go up on a tie
                even = (torch.arange(n) + base) % 2 == 0
                for tie, want in (("negative", 2 * count > size),
                                  ("positive", 2 * count >= size),
                                  ("alternate", (2 * count > size) | ((2 * count == size) & even))):
                    got = ck.vote_count(votes, n, tie=tie, tie_base=base)
                    assert torch.equal(got, bits.pack(want.to(torch.uint8), 1)), (n, size, tie)
        for chunk in (1000, tile, tile + 8):
            scales = torch.rand(-(-n // chunk), generator=g) + 0.5
            signs = torch.randint(0, 2, (n,), generator=g, dtype=torch.uint8)
            got = ck.scaled_signs(bits.pack(signs, 1), scales, n, chunk)
            want = scales[torch.arange(n) // chunk] * torch.where(signs.bool(), 1.0, -1.0)
            assert torch.equal(got, want), (n, chunk)
    tile = 8 * ck.TUNING["sign_error"][0]
    for n in (8, tile, 2 * tile + 8):
        buf = torch.randn(n, generator=g)
        buf[:2] = torch.tensor([-0.0, float("nan")])
        scale = torch.tensor(0.75)
        error = torch.empty(n)
        packed = ck.sign_error(buf, scale, error)
        bit = (buf >= 0) | buf.isnan()
        assert torch.equal(_unpacked(packed, n), bit), n
        assert torch.equal(error[2:], (buf - torch.where(bit, scale, -scale))[2:]), n
        assert error[1].isnan()
        size = 3
        votes = torch.stack([bits.pack(torch.randint(0, 2, (n,), generator=g,
                                                     dtype=torch.uint8), 1)
                             for _ in range(size)])
        weights = torch.rand(size, generator=g)
        want = torch.zeros(n)
        for r in range(size):  # in rank order, then the error: the kernel's float additions
            want += torch.where(_unpacked(votes[r], n), weights[r], -weights[r])
        want += error.nan_to_num()
        got = ck.weighted_votes(votes, weights, error.nan_to_num())
        assert torch.equal(got, want), n


def test_ring_steps_benchmark_rows():
    """bench.collectives.ring_steps: one row per kernel of rank 0, bytes as derived here."""
    from bitcomm.bench.collectives import ring_steps

    with forced("triton"):
        rows = ring_steps(1000, 4, device="cpu", repeat=1)
    by = {r.what: r for r in rows}
    assert [r.what for r in rows] == ["step 1", "step 2", "step 3", "decide", "unpack 0",
                                      "unpack 1", "unpack 2", "unpack 3", "rank-total", "call",
                                      "vote count"]
    # 4 chunks of 250 elements: 1000 bytes of fp32 and 32 bytes per bit plane each. Step 1
    # writes 1 plane; steps 2 and 3 read counts over 1 and 2 ranks (1 and 2 planes) and write
    # 2 planes; the last step reads 2 planes and writes 1; an unpack reads 1 and writes 1000.
    assert [by[w].moved for w in ("step 1", "step 2", "step 3", "decide")] == [
        1032, 32 + 1000 + 64, 64 + 1000 + 64, 64 + 1000 + 32]
    assert all(by[f"unpack {c}"].moved == 1032 for c in range(4))
    # Wire: counts over 1, 2, 3 ranks (1 + 2 + 2 planes of 32 bytes), then 3 decision chunks.
    assert by["rank-total"].wire_bytes == 5 * 32 + 3 * 32
    assert by["rank-total"].wire_seconds == 256 * 8 / 100e9
    assert by["rank-total"].seconds == pytest.approx(sum(r.seconds for r in rows[:8]))
    assert all(r.seconds > 0 and r.vs_hbm > 0 for r in rows)
    # each kernel's bytes at the read speed of the sum timed beside it (4 bytes an element)
    for r in rows[:8] + rows[9:]:
        assert r.hbm_seconds == pytest.approx(r.moved * r.sum_seconds / 4000), r
        assert r.vs_hbm == pytest.approx(r.seconds / r.hbm_seconds)
    assert by["rank-total"].hbm_seconds == pytest.approx(sum(r.hbm_seconds for r in rows[:8]))
    assert by["call"].moved == 4 * by["rank-total"].moved
    assert by["call"].wire_bytes == by["rank-total"].wire_bytes
    assert by["vote count"].moved == 5 * 32  # 4 ranks' votes of 250 elements, the decisions
    # the table `bench collectives --device cuda` saves: a line a row, the rows' figures
    from bitcomm.bench.collectives import steps_markdown

    md = steps_markdown(rows, {"time": "2026-01-02T03:04:05", "gpu": "Some_GPU",
                               "path": "triton"}, "cmd").splitlines()
    assert md[:3] == ["- Date: 2026-01-02", "- Machine: Some GPU (triton path); ?, ? CPUs, "
                      "torch ? (? threads)", "- Command: `cmd`"]
    cells = [line.split("|")[1:-1] for line in md[6:]]
    assert [c[2].strip() for c in cells] == [r.what for r in rows]
    total = cells[8]
    assert [c.strip() for c in total[:4]] == ["4", "1000", "rank-total", "1000"]
    assert total[5].strip() == str(by["rank-total"].moved)
    assert total[8].strip() == "256" and total[9].strip() == f"{256 * 8 / 100e9 * 1e3:.3f}"
    assert cells[0][8].strip() == cells[0][9].strip() == ""  # a kernel sends nothing itself


@pytest.mark.parametrize("size", [2, 5])
def test_fused_majorities_read_nothing_back_to_the_host(size):
    from bitcomm.collectives import allgather_majority, alltoall_majority, ring_majority
    from bitcomm.comm import run_local

    xs = [torch.randn(1001, generator=torch.Generator().manual_seed(r)) for r in range(size)]

    def job():
        run_local(lambda c: (ring_majority(c, xs[c.rank], check=False),
                             alltoall_majority(c, xs[c.rank], check=False),
                             allgather_majority(c, xs[c.rank], check=False)), size)

    with forced("triton"):
        assert host_reads(job) == []
    with forced("torch"):  # the unfused path checks every received payload on the host
        assert len(host_reads(job)) >= 2 * (size - 1)


@pytest.mark.parametrize("collective", ["alltoall", "allgather"])
@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_fused_onebit_allreduce_matches_the_reference_over_calls(size, collective):
    """The fused 1-bit allreduce: same bytes sent, same result and error buffers as DeepSpeed's
    algorithm (test_collectives.onebit_reference) over calls that feed errors back, with either
    exchange (the allgather's server error holds every rank's chunk)."""
    from test_collectives import onebit_reference

    from bitcomm.collectives import OneBitState, onebit_allreduce, onebit_allreduce_bytes
    from bitcomm.comm import run_local

    n = 1001
    states = {p: [OneBitState(n, size, collective=collective) for _ in range(size)]
              for p in ("numpy", "triton")}
    werr = [torch.zeros_like(states["numpy"][0].worker_error) for _ in range(size)]
    chunk = werr[0].numel() // size
    serr = [torch.zeros(chunk) for _ in range(size)]
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        xs = [torch.randn(n, generator=g) for _ in range(size)]
        xs[0][:2] = torch.tensor([0.0, -0.0])  # zeros are +1, as sign().add_(1).bool() says
        outs = {}
        for p in ("numpy", "triton"):
            with forced(p):
                outs[p] = run_local(lambda c, p=p: (
                    onebit_allreduce(c, xs[c.rank], states[p][c.rank]),
                    c.counters.total_sent), size)
        expect = onebit_reference(xs, werr, serr)
        for r in range(size):
            out, sent = outs["triton"][r]
            assert sent == onebit_allreduce_bytes(n, size, collective=collective)
            assert torch.equal(out, outs["triton"][0][0])  # identical on every rank
            torch.testing.assert_close(out, outs["numpy"][r][0], rtol=1e-6, atol=1e-7)
            torch.testing.assert_close(out, expect, rtol=1e-5, atol=1e-6)
            fused, plain = states["triton"][r], states["numpy"][r]
            torch.testing.assert_close(fused.worker_error, plain.worker_error, rtol=1e-6,
                                       atol=1e-7)
            torch.testing.assert_close(fused.server_error, plain.server_error, rtol=1e-6,
                                       atol=1e-7)
            torch.testing.assert_close(fused.worker_error, werr[r], rtol=1e-5, atol=1e-6)
            served = torch.cat(serr) if collective == "allgather" else serr[r]
            torch.testing.assert_close(fused.server_error, served, rtol=1e-5, atol=1e-6)


def test_ring_steps_needs_the_triton_path():
    from bitcomm.bench.collectives import ring_steps

    with pytest.raises(RuntimeError, match="expected a CUDA device with triton installed"):
        ring_steps(100, 2, device="cpu")


@pytest.mark.parametrize("programs", [4096, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_selection_statistics_and_counts(dtype, programs, monkeypatch):
    """score_stats and count_above against brute force, for scores given and for both sides of
    a signed vector; values equal to a bound are not above it. With 2 programs each of
    count_above's programs strides over several tiles. score_stats is two launches: its pass
    and one program adding its blocks' rows (several steps of rows too)."""
    monkeypatch.setattr(_kernels, "COUNT_PROGRAMS", programs)
    g = torch.Generator().manual_seed(11)
    for n in (1, 7, 4097, 9000):  # 9000 spans programs of both kernels
        v = torch.randint(-8, 9, (n,), generator=g).to(dtype) / 4  # ties at the bounds below
        for side in (0, 1, -1):
            s = v if side == 0 else (v.clamp(min=0) if side == 1 else v.neg().clamp(min=0))
            total, top, bad, positive = _kernels.score_stats(v, side).tolist()
            assert total == s.double().sum().item() and top == s.max().item() and bad == 0
            assert positive == (s > 0).sum().item()
            for m in (1, 2, 63, 64, 100):
                bounds = torch.linspace(-2, 2, m, dtype=dtype)
                got = _kernels.count_above(v, bounds, side)
                want = [(s > b).sum().item() for b in bounds]
                assert got.tolist() == want, (n, side, m)
    # many rows of block statistics, added by one program several rows a step
    monkeypatch.setitem(_kernels.TUNING, "score_stats", (16, 4))
    monkeypatch.setitem(_kernels.TUNING, "score_totals", (64, 1))
    v = torch.randint(-8, 9, (9000,), generator=g).to(dtype) / 4
    s = v.clamp(min=0)
    assert _kernels.score_stats(v, 1).tolist() == [s.double().sum().item(), s.max().item(), 0,
                                                   (s > 0).sum().item()]
    meta = v.to("meta")
    assert _launches(lambda: _kernels.score_stats(meta, 1)) == ["score_stats", "score_totals"]
    with pytest.raises(TypeError, match="float32 or float64 scores"):
        _kernels.count_above(v.half(), torch.tensor([0.5]).half())
    # runs of tiles: 5 tiles on 4 programs are runs of 2, 2, 1 and none (a row that adds
    # nothing to the sums and the counts, -inf to the max)
    monkeypatch.setattr(_kernels, "COUNT_PROGRAMS", 4)
    v = torch.randint(-8, 9, (80,), generator=g).to(dtype) / 4
    s = v.neg().clamp(min=0)
    assert _kernels.score_stats(v, -1).tolist() == [s.double().sum().item(), s.max().item(), 0,
                                                    (s > 0).sum().item()]
    if dtype == torch.float32:  # 16-bit scores, widened to float32 in the pass
        for half in (torch.float16, torch.bfloat16):
            w = (torch.randint(-8, 9, (80,), generator=g) / 4).to(half)
            s = w.float().clamp(min=0)
            assert _kernels.score_stats(w, 1).tolist() == [
                s.double().sum().item(), s.max().item(), 0, (s > 0).sum().item()], half
    # at most COUNT_PROGRAMS rows for the one program that adds them, however long x is
    monkeypatch.setattr(_kernels, "COUNT_PROGRAMS", 4096)
    from bitcomm.bench.kernels import _recorded

    with _recorded() as calls:
        _kernels.score_stats(torch.empty(1 << 26, dtype=dtype, device="meta"), 1)
    (stats, grid, args, _), (totals, _, rows, _) = calls
    assert grid == (4096,) and args[1].shape == (4096, 4) and rows[2] == 4096
    v = torch.ones(5000, dtype=dtype)
    v[4500] = float("nan")
    assert _kernels.score_stats(v, 1).tolist() == [4999.0, 1.0, 1.0, 4999.0]
    v[4500] = -float("inf")  # its score on the top side is 0, but the vector is not finite
    assert _kernels.score_stats(v, 1).tolist() == [4999.0, 1.0, 1.0, 4999.0]
    v[4500] = float("inf")  # left out of the count of positive scores too
    assert _kernels.score_stats(v, 1).tolist() == [4999.0, 1.0, 1.0, 4999.0]


def _brute_top(s: torch.Tensor, k: int) -> list[int]:
    # the k largest scores, ties to lower indices (-0.0 ties with 0.0), in ascending order
    a = s.double().numpy()
    return sorted(np.lexsort((np.arange(a.size), -a))[:k].tolist())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_top_indices_by_radix_selection(dtype, monkeypatch):
    """top_indices against a sort, for scores given and both sides of a signed vector: ties
    (many, across tiles), signed zeros, the dtype's extremes and subnormals. With 2 programs the
    counting passes stride over several tiles."""
    g = torch.Generator().manual_seed(12)
    fi = torch.finfo(dtype)
    extremes = torch.tensor([fi.max, -fi.max, fi.tiny, -fi.tiny, fi.tiny / 4, -fi.tiny / 4],
                            dtype=torch.float64).to(dtype)
    # 2100: three tiles of the writing kernels
    for programs, n in [(4096, 2), (4096, 9), (4096, 2100), (2, 2100)]:
        monkeypatch.setattr(_kernels, "COUNT_PROGRAMS", programs)
        ties = (torch.randint(-4, 5, (n,), generator=g) / 2).to(dtype)
        ties[torch.rand(n, generator=g) < 0.5] *= -1  # random signs: zeros become -0.0 too
        spread = torch.randn(n, generator=g).to(dtype)
        spread[: extremes.numel()] = extremes[:n]
        for v in (ties, spread):
            for side in (0, 1, -1):
                s = v if side == 0 else (v.clamp(min=0) if side == 1
                                         else v.neg().clamp(min=0))
                for k in sorted({1, n // 2, n - 1}):
                    got = _kernels.top_indices(v, k, side)
                    assert got.dtype == torch.int64
                    assert got.tolist() == _brute_top(s, k), (programs, n, side, k)


@pytest.mark.parametrize("sampled", [True, False])
def test_the_writing_pass_finds_each_runs_place_from_group_sums(sampled, monkeypatch):
    """The writing pass's programs each take a run of several tiles (of the candidates, or of
    x) and place their indices after those of the programs before them, from the counting
    pass's counts and group sums (7 programs: 2 groups of 4, the last short), keys above the
    k-th largest and ties apart: ties at the k-th spread over several programs, only the
    first ``need`` taken. Against a sort, from a sampled bound and from two digits."""
    from bitcomm.codecs import _bracket

    monkeypatch.setitem(_kernels.TUNING, "top_write", (256, 4))
    monkeypatch.setattr(_kernels, "COUNT_PROGRAMS", 7)
    if sampled:
        monkeypatch.setattr(_bracket, "SAMPLE", 256)
        monkeypatch.setattr(_bracket, "MIN_N", 4096)
        monkeypatch.setattr(_kernels, "SLACK", 4)
    g = torch.Generator().manual_seed(5)
    n = 5003
    assert _kernels._group(7) == 4  # the test's premise: 2 groups
    ties = torch.randint(0, 8, (n,), generator=g) / 4  # some 625 scores a value
    spread = torch.randn(n, generator=g)
    for v in (ties, spread):
        for k in (1, 700, 2500):
            assert _kernels.top_indices(v, k).tolist() == _brute_top(v, k), (k, v is ties)


def _float32_keys(s: torch.Tensor) -> np.ndarray:
    # the order-preserving integer keys of float32 scores, -0.0 as +0.0
    b = np.where(s.numpy() == 0, np.float32(0), s.numpy()).view(np.int32).astype(np.int64)
    return b ^ ((b >> 31) & 0x7FFFFFFF)


@pytest.mark.parametrize("programs", [4096, 2])
def test_radix_selection_gathers_its_candidates_in_index_order(programs, monkeypatch):
    """After two digits the selection gathers every key whose top 16 bits are at least the
    k-th largest's, with its index, in index order (also when the runs of several tiles
    belong to 2 programs), and the later passes read them; with too little room it gathers
    nothing and reads x, with the same result."""
    monkeypatch.setattr(_kernels, "COUNT_PROGRAMS", programs)
    g = torch.Generator().manual_seed(21)
    n, k = 5000, 50
    v = torch.randn(n, generator=g)
    v[:3] = torch.tensor([0.0, -0.0, float("inf")])
    for side in (0, 1, 2):
        s = {0: v, 1: v.clamp(min=0), 2: v.abs()}[side]
        keys = _float32_keys(s)
        kth = np.sort(keys)[::-1][k - 1]
        want = np.flatnonzero((keys >> 16) >= (kth >> 16))
        assert k <= want.size <= k + n // _kernels.SLACK  # the test's premise: they fit
        sel = _kernels._radix_select(v, k, side)
        m = int(sel.m)
        assert m == want.size, side
        assert sel.idx[:m].tolist() == want.tolist()
        assert sel.keys[:m].tolist() == keys[want].tolist()
        assert int(sel.state[2][0]) == kth & ~0xFFFF  # the first two digits, settled
        assert _kernels.top_indices(v, k, side).tolist() == _brute_top(s, k)
        # room for fewer candidates than there are: nothing gathered, the same result
        monkeypatch.setattr(_kernels, "SLACK", 10**9)
        assert want.size > k  # so room for k leaves some out
        assert int(_kernels._radix_select(v, k, side).m) == 0
        assert _kernels.top_indices(v, k, side).tolist() == _brute_top(s, k)
        assert _kernels.kth_largest(v, k, side).item() == s.sort(descending=True).values[k - 1]
        monkeypatch.undo()
        monkeypatch.setattr(_kernels, "COUNT_PROGRAMS", programs)
    for dtype in (torch.float64, torch.float16, torch.bfloat16):  # they gather too
        w = v.to(dtype)
        m = int(_kernels._radix_select(w, k, 2).m)
        assert k <= m <= k + n // _kernels.SLACK, dtype
        assert _kernels.top_indices(w, k, 2).tolist() == _brute_top(w.abs(), k)


def _keys(s: torch.Tensor) -> np.ndarray:
    # the order keys of the scores as the selection ranks them: float64's own, the float32
    # values' for every narrower float
    if s.dtype != torch.float64:
        return _float32_keys(s.float())
    a = s.numpy()
    b = np.where(a == 0, 0.0, a).view(np.int64)
    return b ^ ((b >> 63) & 0x7FFFFFFFFFFFFFFF)


@pytest.mark.parametrize("programs", [4096, 2])
def test_radix_selection_starts_from_a_sampled_bound(programs, monkeypatch, small_sample):
    """From _bracket.MIN_N scores the selection first gathers every key at or above the
    sampled bound (the rank(n, k)-th largest key at the numpy path's sample positions,
    rounded down to its first 16 bits, 20 for float64), with its index, in index order, and
    every pass reads those: the sort's result, for every float dtype and side, negative
    bounds included. When the sample misleads (fewer than k keys reach its bound), nothing is
    gathered, and the passes read x with the same result; when every key ties at it, the k-th
    largest is the bound (test_a_mass_of_ties_at_the_sampled_bound). (A smaller sample and
    more room than the defaults, for the interpreter.)"""
    monkeypatch.setattr(_kernels, "COUNT_PROGRAMS", programs)
    g = torch.Generator().manual_seed(22)
    n, k = 5003, 50
    pos = _bracket.positions(n)
    v = torch.randn(n, generator=g)
    v[:3] = torch.tensor([0.0, -0.0, float("inf")])
    cases = [(side, 0.0) for side in (0, 1, -1, 2)] + [(0, -3.0)]  # -3: a negative bound
    dtypes = (torch.float32, torch.float64) + (
        (torch.float16, torch.bfloat16) if programs == 2 else ())
    for dtype, (side, shift) in itertools.product(dtypes, cases):
        w = (v + shift).to(dtype)
        s = {0: w, 1: w.clamp(min=0), -1: w.neg().clamp(min=0), 2: w.abs()}[side]
        keys = _keys(s)
        low = (1 << 44 if dtype == torch.float64 else 1 << 16) - 1  # below the bound's bits
        bound = np.sort(keys[pos])[-_bracket.rank(n, k)] & ~low
        want = np.flatnonzero(keys >= bound)
        assert k <= want.size <= k + n // 4, (dtype, side)  # the premise: they fit
        sel = _kernels._radix_select(w, k, side)
        assert int(sel.bound) == bound, (dtype, side, shift)
        m = int(sel.m)
        assert m == want.size
        assert sel.idx[:m].tolist() == want.tolist()
        assert sel.keys[:m].tolist() == keys[want].tolist()
        assert _kernels.top_indices(w, k, side).tolist() == _brute_top(s, k)
    peaks = torch.ones(n)
    peaks[pos] = 5.0  # the sample sees only these: 256 scores reach its bound, k = 300
    flat = torch.full((n,), 2.0)  # every key ties at the bound: more than the room
    for x, k, m in ((peaks, 300, 0), (flat, 50, -1)):
        assert int(_kernels._radix_select(x, k, 0).m) == m
        assert _kernels.top_indices(x, k).tolist() == _brute_top(x, k)
        assert _kernels.kth_largest(x, k).item() == x.sort(descending=True).values[k - 1]


@pytest.mark.parametrize("tiles", [8, 1])
def test_the_digit_passes_after_a_sampled_bound_take_programs_by_the_room(tiles, monkeypatch,
                                                                         small_sample):
    """After a sampled bound the four digit passes read the gathered candidates, at most the
    room's keys: a program per CANDIDATE_TILES tiles of room, where the count pass over x
    takes one per tile. With the sample misled (nothing gathered) those programs read all of
    x: the same indices. (The sample and room of
    test_radix_selection_starts_from_a_sampled_bound: 1300 keys of room at n = 5003.)"""
    monkeypatch.setattr(_kernels, "CANDIDATE_TILES", tiles)
    monkeypatch.setitem(_kernels.TUNING, "key_digits", (256, 4))
    grids: dict[str, list] = {}
    launch = _kernels.launch

    def spy(kernel, grid, *args, **kwargs):
        grids.setdefault(kernel.fn.__name__, []).append(grid)
        return launch(kernel, grid, *args, **kwargs)

    monkeypatch.setattr(_kernels, "launch", spy)
    n = 5003
    v = torch.randn(n, generator=torch.Generator().manual_seed(3))
    peaks = torch.ones(n)
    peaks[_bracket.positions(n)] = 5.0  # misled: 256 reach the bound, k = 300
    for x, k, m in ((v, 50, None), (peaks, 300, 0)):
        grids.clear()
        sel_m = int(_kernels._radix_select(x, k, 0).m)
        assert m is None and sel_m >= k or sel_m == m
        room = min(n, k + n // _kernels.SLACK)
        assert grids["_count_at_least_kernel"] == [(20,)]  # ceil(5003 / 256) tiles of x
        assert grids["_key_digits_kernel"] == [(-(-room // (tiles * 256)),)] * 4
        assert _kernels.top_indices(x, k).tolist() == _brute_top(x, k)


def test_the_selection_reads_no_word_it_did_not_write(monkeypatch, small_sample):
    """Every buffer of the selection that is not cleared by a launch of its own (the sampled
    path's work buffer, which the bound's kernel clears; the gathered keys and indices; the
    counts) is written before it is read: with torch.empty's memory filled with garbage the
    sampled and the unsampled path, and a mass of ties, still give the sort's indices."""
    empty = torch.empty

    def dirty(*a, **k):
        t = empty(*a, **k)
        if t.device.type == "cpu" and t.numel():
            t.view(torch.uint8).fill_(0xA5)
        return t

    monkeypatch.setattr(torch, "empty", dirty)
    g = torch.Generator().manual_seed(31)
    n = 5003
    cases = [(torch.randn(n, generator=g), 50, 1), (torch.randn(n, generator=g), 50, 0),
             (torch.randn(1000, generator=g), 30, 2), (torch.full((n,), 2.0), 50, 0)]
    for x, k, side in cases:
        s = {0: x, 1: x.clamp(min=0), 2: x.abs()}[side]
        assert _kernels.top_indices(x, k, side).tolist() == _brute_top(s, k), (x.numel(), side)
        assert int(_kernels._radix_select(x, k, side).state[0][1]) == k


@pytest.mark.parametrize("programs", [4096, 2])
def test_a_mass_of_ties_at_the_sampled_bound(programs, monkeypatch, small_sample):
    """Keys tied at the sampled bound can overflow the room (exact zeros of a sparse gradient:
    the bound is 0). Then, if k or more keys lie strictly above the bound and fit, those are
    the candidates; if fewer than k do, the k-th largest key is the bound itself: m = -1, no
    counting pass reads anything (their histograms stay empty), and the writing passes take
    every key above it and the first ties in index order from x. The sort's result either way.
    (The sample and room of test_radix_selection_starts_from_a_sampled_bound.)"""
    monkeypatch.setattr(_kernels, "COUNT_PROGRAMS", programs)
    g = torch.Generator().manual_seed(23)
    n, k = 5003, 50  # room: k + n // 4 = 1300
    spots = torch.randperm(n, generator=g)

    def vector(ties: float, above: int, dtype) -> torch.Tensor:
        # 30% of the scores tie at `ties`, `above` lie over it, the rest below it
        x = torch.rand(n, generator=g, dtype=torch.float64) * 0.5 * ties
        x[spots[: n * 3 // 10]] = ties
        x[spots[n * 3 // 10 : n * 3 // 10 + above]] = ties + 1 + torch.rand(above, generator=g,
                                                                             dtype=torch.float64)
        return x.to(dtype)

    sparse = torch.zeros(n)  # 30 nonzero magnitudes, of either sign: the bound is a zero
    sparse[spots[:30]] = torch.randn(30, generator=g)
    cases = [(sparse, 2, -1), (sparse.double(), 2, -1),
             (vector(1.0, 30, torch.float32), 0, -1), (vector(1.0, 30, torch.float64), 0, -1),
             (vector(1.0, 100, torch.float32), 0, 100), (vector(3.0, 200, torch.float64), 0, 200)]
    for x, side, m in cases:
        s = x.abs() if side == 2 else x
        sel = _kernels._radix_select(x, k, side)
        assert int(sel.m) == m, (x.dtype, side, m)
        if m < 0:
            assert int(torch.stack(sel.hist).abs().sum()) == 0  # no pass counted anything
            kth = s.sort(descending=True).values[k - 1]
            assert sel.state[sel.digits].tolist() == [_keys(kth.reshape(1))[0],
                                                      k - int((s > kth).sum())]
        else:  # the keys strictly above the bound, in index order
            assert sel.idx[:m].tolist() == np.flatnonzero(_keys(s) > int(sel.bound)).tolist()
        assert _kernels.top_indices(x, k, side).tolist() == _brute_top(s, k)
        assert _kernels.kth_largest(x, k, side).item() == s.sort(descending=True).values[k - 1]


def test_a_sampled_count_adds_up_its_programs_by_groups():
    """The gathering after a sampled bound finds where each run starts from the count pass's
    sums of its programs' counts by groups: groups of the least power of 2 whose square covers
    the programs, so that one load of a group's counts and one of the groups' sums reach every
    program's start (4096 programs: 64 groups of 64)."""
    got = {p: _kernels._group(p) for p in (1, 2, 3, 4, 5, 16, 17, 20, 4096, 4097, 1 << 16)}
    assert got == {1: 2, 2: 2, 3: 2, 4: 2, 5: 4, 16: 4, 17: 8, 20: 8, 4096: 64, 4097: 128,
                   1 << 16: 256}


def test_the_gathering_copies_what_the_count_pass_kept(monkeypatch, small_sample):
    """From a sampled bound the count pass keeps each program's keys at or above the bound,
    with their indices, up to LOCAL_ROOM times its share of the room, and the gathering copies
    those instead of reading x again: x changed between the two passes (each score doubled)
    leaves the candidates those of the x counted. A program whose keys overflow its stretch
    reads its run of x (the doubled scores), as every program does with LOCAL_ROOM = 0; the
    others still copy. A program writes nothing outside its stretch, and nothing from a tile
    that would overflow it. (Runs of one 256-element tile, 20 programs, whose counts the count
    pass adds up in 3 groups of 8 for the gathering's running sums: room 1300, a stretch of
    65 keys at LOCAL_ROOM = 1, 260 at 4.)"""
    monkeypatch.setitem(_kernels.TUNING, "key_digits", (256, 4))
    launch = _kernels.launch

    kept = []

    def doubling(kernel, grid, *args, **kwargs):
        counting = kernel.fn.__name__ == "_count_at_least_kernel"
        if counting:
            args[4].fill_(-7)  # the stretches: what the pass leaves is seen
        launch(kernel, grid, *args, **kwargs)
        if counting:
            kept.append(args[4].clone())
            args[0].mul_(2)  # x, once counted

    monkeypatch.setattr(_kernels, "launch", doubling)
    n, k = 5003, 50
    g = torch.Generator().manual_seed(41)
    even = torch.randn(n, generator=g)
    crowded = torch.randn(n, generator=g)
    crowded[:256] = 100 + torch.rand(256, generator=g)  # the first run: all candidates
    for v, room, first_run in ((even, 2, "kept"), (even, 0, "x"), (crowded, 1, "x"),
                               (crowded, 4, "kept")):
        monkeypatch.setattr(_kernels, "LOCAL_ROOM", room)
        kept.clear()
        sel = _kernels._radix_select(v.clone(), k, 0)
        keys = _float32_keys(v)
        want = np.flatnonzero(keys >= int(sel.bound))
        m = int(sel.m)
        assert m == want.size and m >= k, room  # counted before x changed
        if room:  # each program's keys and indices in its stretch, if they fit, else none
            cap = 65 * room
            runs = np.bincount(want // 256, minlength=20)
            # a key and its index a word: the key in the high half
            stretches = kept[0].reshape(20, cap)
            assert kept[0].dtype == torch.int64
            for p in range(20):
                fits = runs[p] <= cap
                held = want[want // 256 == p] if fits else want[:0]
                words = stretches[p, : held.size]
                assert (words & 0xFFFFFFFF).tolist() == held.tolist(), (room, p)
                assert (words >> 32).tolist() == keys[held].tolist(), (room, p)
                assert (stretches[p, held.size :] == -7).all(), (room, p)
        got_idx, got_keys = sel.idx[:m].tolist(), sel.keys[:m].tolist()
        if v is even:  # re-read, a run takes more than it counted: its writes go astray
            copied = first_run == "kept"
            assert (got_idx == want.tolist()) == copied, room
            assert (got_keys == keys[want].tolist()) == copied, room
            continue
        assert runs[0] == 256 and runs[1:].max() <= 65, runs  # the premise
        assert got_idx == want.tolist()  # the doubled first run stays above the bound
        assert got_keys[256:] == keys[want[256:]].tolist()  # the other runs: copied
        first = keys[:256] if first_run == "kept" else _float32_keys(2 * v[:256])
        assert got_keys[:256] == first.tolist(), room


def test_the_kept_keys_of_negative_scores_come_back_signed(small_sample, launched):
    """Below zero the sampled bound's candidates have negative keys, which the count pass
    keeps with their indices (a key in the high half of an int64 word) and the gathering
    copies: the top-k of all-negative scores, and of bfloat16 ones, against a sort."""
    g = torch.Generator().manual_seed(44)
    for dtype in (torch.float32, torch.bfloat16):
        v = (-torch.rand(6000, generator=g) - 1.0).to(dtype)
        for k in (30, 60):
            launched.clear()
            got = _kernels.top_indices(v, k)
            assert "_count_at_least_kernel" in launched, launched
            assert got.tolist() == _brute_top(v.float(), k), (dtype, k)


@pytest.mark.parametrize("programs", [4096, 2])
def test_the_sampled_count_pass_takes_the_census(programs, monkeypatch, small_sample,
                                                 launched):
    """With census, top_indices also says whether x holds NaN or inf and how many of the k
    chosen scores are positive: from a sampled bound its count pass finds NaN and inf in its
    read of x and its writing pass counts the positive (no score_stats pass), below MIN_N
    score_stats does. Fewer positive scores than k (a mass of zeros, the k-th largest 0),
    exactly k and more. -inf has the score 0 on the top side, and is still reported. The
    indices are those without census. (The sample and room of
    test_radix_selection_starts_from_a_sampled_bound.)"""
    monkeypatch.setattr(_kernels, "COUNT_PROGRAMS", programs)
    g = torch.Generator().manual_seed(24)
    for n, sampled in ((5003, True), (3001, False)):
        many = torch.randint(-6, 7, (n,), generator=g) + torch.rand(n, generator=g) * 0.5
        many[:20] = 0.0  # zeros are not positive on any side
        few = -torch.rand(n, generator=g) - 0.5  # 40 zeros, 30 positive, the rest negative
        few[:40] = 0.0
        few[40 + torch.randperm(n - 40, generator=g)[:30]] = torch.rand(30, generator=g) + 2.0
        exact = torch.zeros(n)
        exact[torch.randperm(n, generator=g)[:50]] = 1.5  # ties at the k-th largest
        for v in (many, few, exact):
            for dtype, side in itertools.product((torch.float32, torch.float64), (1, -1, 2)):
                w = v.to(dtype)
                s = {1: w.clamp(min=0), -1: w.neg().clamp(min=0), 2: w.abs()}[side]
                launched.clear()
                idx, census = _kernels.top_indices(w, 50, side, census=True)
                assert ("_score_stats_kernel" in launched) != sampled, launched
                assert census.dtype == torch.int64
                assert census.tolist() == [0, min(50, int((s > 0).sum()))], (n, dtype, side)
                assert idx.tolist() == _kernels.top_indices(w, 50, side).tolist() \
                    == _brute_top(s, 50)
        assert [int((few > 0).sum()), int((exact > 0).sum())] == [30, 50]
        v = many
        for bad, dtype in itertools.product((float("nan"), float("inf"), -float("inf")),
                                            (torch.float32, torch.float64)):
            w = v.to(dtype)
            w[n - 7] = bad
            w[n - 8] = torch.finfo(dtype).max  # the largest finite magnitude is not bad
            assert int(_kernels.top_indices(w, 50, 1, census=True)[1][0]) > 0, (n, bad)
            w[n - 7] = 0.0
            assert int(_kernels.top_indices(w, 50, 1, census=True)[1][0]) == 0, (n, bad)
    with pytest.raises(ValueError, match="float32 or float64"):
        _kernels.top_indices(torch.ones(10, dtype=torch.float16), 2, census=True)
    with pytest.raises(ValueError, match="side 1, -1 or 2, got side=0"):
        _kernels.top_indices(torch.ones(10), 2, census=True)


def _launches(fn) -> list[str]:
    # The kernels fn launches on meta tensors: its Triton launches (recorded, not run) and
    # the torch ops that launch one on a device (not views, not allocations).
    from bitcomm.bench.kernels import _recorded

    with _recorded() as calls, dispatched() as ops:
        fn()
    return [kernel.fn.__name__.strip("_").removesuffix("_kernel") for kernel, *_ in calls] + ops


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_top_indices_of_a_small_vector_is_one_program(dtype, monkeypatch, launched):
    """Up to SMALL_TOP scores top_indices is one launch of one program, its passes' results
    to the brute force's: the k largest, ties (many, across tiles) to lower indices, NaN on
    top, -0.0 with +0.0, the dtype's extremes, for scores given and every side, n from 1 to
    several tiles, k from 1 to n; with census, x's NaN and inf and its positive scores."""
    monkeypatch.setattr(_kernels, "SMALL_TOP", 1 << 15)
    monkeypatch.setitem(_kernels.TUNING, "small_top", (512, 4))  # 2500 scores: five tiles
    g = torch.Generator().manual_seed(31)
    fi = torch.finfo(dtype)
    for n in (1, 2, 9, 1024, 2500):
        v = torch.randint(-5, 6, (n,), generator=g).to(torch.float64)
        v += torch.rand(n, generator=g).round() * 0.25  # ties, across tiles
        v[: min(n, 6)] = torch.tensor([fi.max, -fi.max, -0.0, fi.tiny, float("nan"), 0.0],
                                      dtype=torch.float64)[: min(n, 6)]
        w = v.to(dtype)
        for side in (0, 1, -1, 2):
            s = {0: w, 1: w.clamp(min=0), -1: w.neg().clamp(min=0), 2: w.abs()}[side]
            s = torch.where(s.isnan(), float("inf"), s.double())  # NaN ranks on top
            for k in sorted({1, max(1, n // 3), n - 1, n} - {0}):
                launched.clear()
                got = _kernels.top_indices(w, k, side)
                assert launched == ["_small_top_kernel"], launched
                assert got.dtype == torch.int64
                assert got.tolist() == _brute_top(s, k), (n, side, k)
    if dtype in (torch.float32, torch.float64):
        v = torch.randn(3000, generator=g, dtype=dtype)
        v[:40] = 0.0
        for side in (1, -1, 2):
            s = {1: v.clamp(min=0), -1: v.neg().clamp(min=0), 2: v.abs()}[side]
            idx, census = _kernels.top_indices(v, 30, side, census=True)
            assert census.tolist() == [0, 30] and idx.tolist() == _brute_top(s, 30), side
        for bad in (float("nan"), float("inf"), -float("inf")):
            w = v.clone()
            w[2999] = bad
            assert int(_kernels.top_indices(w, 30, 1, census=True)[1][0]) == 1, bad
        w = torch.where(torch.arange(3000) % 200 == 7, v.abs() + 1, -v.abs())  # 15 positive
        assert _kernels.top_indices(w, 30, 1, census=True)[1].tolist() == [0, 15]
    with pytest.raises(ValueError, match="0 < k <= 9"):
        _kernels.top_indices(torch.ones(9, dtype=dtype), 10)


def test_radix_selection_launches_few_kernels():
    """A pass over a few million elements takes about as long as its launch, so the launches
    count: top_indices of 32-bit scores is 11 (a kernel settles each digit at its start
    instead of a kernel of its own, and the writing pass finds where each program's indices
    go from the counting pass's group sums: no scan between them), 15 for float64;
    kth_largest 10."""
    x = torch.empty(10_000, device="meta")
    got = _launches(lambda: _kernels.top_indices(x, 100, 2))
    assert sorted(got) == sorted(["zero_", "fill_", "key_digits", "key_digits",
                                  "gathered_counts", "cumsum", "gather", "key_digits",
                                  "key_digits", "chosen_counts", "chosen_write"])
    wide = torch.empty(10_000, device="meta", dtype=torch.float64)
    assert len(_launches(lambda: _kernels.top_indices(wide, 100))) == 15
    assert len(_launches(lambda: _kernels.kth_largest(x, 100))) == 10
    # from a sampled bound: the bound (whose one program also clears the selection's
    # buffers: no zeros and fill), a count and the gathering (no scan between them: the count
    # adds up its programs' counts by groups), then four passes
    big = torch.empty(1 << 18, device="meta")
    got = _launches(lambda: _kernels.top_indices(big, 1 << 11, 2))
    assert sorted(got) == sorted(["sample_bound", "count_at_least",
                                  "gather", "key_digits", "key_digits", "key_digits",
                                  "key_digits", "chosen_counts", "chosen_write"])


def _allocations(fn) -> list[tuple[int, torch.dtype]]:
    # (elements, dtype) of each tensor bitcomm's code makes with torch's factories while fn
    # runs (not torch's own: its meta kernels make theirs with them too)
    made = []
    with pytest.MonkeyPatch.context() as patch:
        for name in ("empty", "zeros", "full", "ones", "empty_like", "zeros_like"):
            factory = getattr(torch, name)

            def recording(*args, factory=factory, **kwargs):
                out = factory(*args, **kwargs)
                if sys._getframe(1).f_globals["__name__"].startswith("bitcomm"):
                    made.append((out.numel(), out.dtype))
                return out

            patch.setattr(torch, name, recording)
        fn()
    return made


@pytest.mark.parametrize("n", [10_000, 1 << 18, 1 << 20])
def test_a_selection_allocates_its_scratch_once(n):
    """An allocation on a GPU costs the host some microseconds (a view about one): the radix
    selection's buffers are views of one allocation, so top_frame makes one tensor (its frame
    is the caller's), RedSync's mean of the programs' sums and census included, and
    top_indices two (the scratch and its indices); the two-digit path (10_000 scores, whose
    census is score_stats' pass) too, float64 too. Only the two-digit pass writes a
    program's 257 counts: the sampled path's scratch has no room for them (at 2**18 scores
    they would outweigh the rest)."""
    k = n // 100
    x = torch.empty(n, device="meta")
    sampled = _kernels._sampling(n, k) is not None
    for values in ("fp32", "mean"):
        header = sparse.HEADER.pack(n, k, sparse.FORMATS.index(values))
        size = sparse.encoded_size(n, k, values)  # its index field at byte 32
        frame = torch.empty(15 + size, dtype=torch.uint8, device="meta")[15:]
        made = _allocations(lambda: _launches(lambda: _kernels.top_frame(
            x, k, header, values, frame, side=1, census=sampled and values == "mean")))
        assert [dtype for _, dtype in made] == [torch.int64], (values, made)
    for v in (x, x.double()):
        made = _allocations(lambda v=v: _launches(lambda: _kernels.top_indices(v, k, 2)))
        assert sorted(size for size, _ in made)[0] == k and len(made) == 2, made
    if not sampled:
        return
    (words, _), = _allocations(lambda: _launches(lambda: _kernels.top_frame(
        x, k, header, "mean", frame, side=1)))
    programs = _kernels._programs(n)
    room = k + n // _kernels.SLACK
    local = _kernels.LOCAL_ROOM * -(-room // programs)
    # int32 keys and indices (a word for two), a program's kept keys (a word each), its two
    # counts, two more and a mean's sum for the writing pass, the work buffer's 2K words, its
    # padding
    bound = room + programs * local + 5 * programs + 2048 + 16
    assert words <= bound, (words, programs)
    assert words + programs * 257 // 2 > bound  # with the rows in it, it would not be


def test_no_kernel_wrapper_scans_row_by_row():
    """The running sums between passes (where each program's or tile's run of indices
    starts) are scans over whole 1-D tensors: a GPU scans those in parallel, but a scan down
    a column of a 2-D tensor one step at a time (conftest.serial_scans). Every benchmarked
    kernel configuration at 64M elements, on meta tensors (the top-k ones start from a
    sampled bound, whose count pass keeps both of its counts a program), and the selection's
    other calls: the census, float64, kth_largest and indices_above."""
    from bitcomm.bench.kernels import _recorded, cases

    n = 1 << 26
    calls = [(name, launch) for name, _, launch in cases(n)]
    x = torch.empty(n, device="meta")
    calls += [("census", lambda: _kernels.top_indices(x, n // 100, 1, census=True)),
              ("float64", lambda: _kernels.top_indices(x.double(), n // 100)),
              ("kth", lambda: _kernels.kth_largest(x, n // 100, 2)),
              ("above", lambda: _kernels.indices_above(x, 0.5, n // 100, 1))]
    for name, call in calls:
        with _recorded(), serial_scans() as scans:
            call()
        assert scans == [], name


def test_no_benchmarked_codec_scans_row_by_row(small_sample):
    """Each codec call of bitcomm bench codecs on the Triton path, encode and decode, at
    5000 elements (a sampled bound from 4096 on, small_sample): no scan that a GPU runs row
    by row, and every call decodes what was encoded."""
    from bitcomm.bench.codecs import _cases, vector

    n = 5000
    x = vector(n, 0, "cpu")
    with forced("triton"):
        for name, encode, decode, check in _cases(x, n, 0):
            with serial_scans() as scans:
                out = decode(encode())
            assert scans == [], name
            assert check(out) == 0, name


def test_the_census_rides_on_the_count_pass_of_long_runs(monkeypatch):
    """The count pass's census keeps a float a lane, whatever the run's length: a
    program's run of 2**15 tiles and more (one program here, at 2**25 scores) takes it as
    well, without a score_stats pass of its own."""
    monkeypatch.setattr(_kernels, "COUNT_PROGRAMS", 1)
    for n in ((1 << 25) - 1024, 1 << 25):
        got = _launches(lambda n=n: _kernels.top_indices(torch.empty(n, device="meta"),
                                                         n // 1000, 1, census=True))
        assert "score_stats" not in got and "count_at_least" in got, (n, got)


@pytest.mark.parametrize("programs", [4096, 2])
def test_indices_above_a_threshold_without_a_host_read(programs, monkeypatch):
    """indices_above writes torch.nonzero's indices of the scores above a threshold, rounded
    to the scores' dtype as the comparison rounds it, for each side; signed zeros, a
    threshold between two floats and one beyond float32's range; several tiles a program."""
    monkeypatch.setattr(_kernels, "COUNT_PROGRAMS", programs)
    g = torch.Generator().manual_seed(14)
    for dtype in (torch.float32, torch.float64):
        v = torch.randn(5000, generator=g).to(dtype)
        v[:4] = torch.tensor([0.0, -0.0, 1.25, -1.25]).to(dtype)
        for side in (0, 1, -1, 2):
            s = {0: v, 1: v.clamp(min=0), -1: v.neg().clamp(min=0), 2: v.abs()}[side]
            for t in (0.0, 0.5, 1.25, 1.25 - 1e-12, 2.9, 1e39):
                count = int((s > t).sum())
                got = _kernels.indices_above(v, t, count, side)
                assert got.dtype == torch.int64
                assert got.tolist() == torch.nonzero(s > t).reshape(-1).tolist(), (side, t)
            # the scores beside them, from the same pass: bit for bit s[idx] (+0.0 for -0.0)
            for t in (-2.0, 0.5):
                count = int((s > t).sum())
                idx, scores = _kernels.indices_above(v, t, count, side, scores=True)
                assert torch.equal(idx, torch.nonzero(s > t).reshape(-1)), (side, t)
                want = s[idx] + 0.0  # -0.0 + 0.0 is +0.0
                bits = torch.int32 if dtype == torch.float32 else torch.int64
                assert scores.dtype == dtype
                assert torch.equal(scores.view(bits), want.view(bits)), (side, t)
    assert _kernels.indices_above(v, 1e39, 0).numel() == 0
    idx, scores = _kernels.indices_above(v, 1e39, 0, scores=True)
    assert idx.numel() == scores.numel() == 0 and scores.dtype == v.dtype


@pytest.mark.parametrize("programs", [4096, 2])
def test_indices_above_starts_from_the_runs_count_above_counted(programs, monkeypatch):
    """count_above's programs take the runs of tiles that indices_above's gathering takes, so
    each program's counts (Runs) place the gathering's runs without a counting pass of its
    own: each run's count above bounds[j] is a brute count over that run, and the indices are
    those of a counting pass. Signed zeros, NaN (above no bound), ties at the bounds, float32
    and float64, every side; 9000 scores in 2 programs: runs of several tiles."""
    monkeypatch.setattr(_kernels, "COUNT_PROGRAMS", programs)
    g = torch.Generator().manual_seed(15)
    block = _kernels._config("key_digits")[0]
    for dtype in (torch.float32, torch.float64):
        v = (torch.randint(-8, 9, (9000,), generator=g) / 4).to(dtype)
        v[:3] = torch.tensor([-0.0, float("nan"), 0.0]).to(dtype)
        p = _kernels._programs(v.numel())
        tiles = math.ceil(v.numel() / block)
        per = math.ceil(tiles / p) * block  # each program's run: whole tiles
        for side in (0, 1, -1, 2):
            s = {0: v, 1: v.clamp(min=0), -1: v.neg().clamp(min=0), 2: v.abs()}[side]
            bounds = torch.tensor([-1.0, 0.0, 0.5, 1.25], dtype=dtype)
            counts, runs = _kernels.count_above(v, bounds, side, runs=True)
            assert torch.equal(counts, _kernels.count_above(v, bounds, side))
            for j, t in enumerate(bounds.tolist()):
                each = runs.above(j)
                want = [int((s[r * per : (r + 1) * per] > t).sum()) for r in range(p)]
                assert each.tolist() == want, (dtype, side, t)
                got = _kernels.indices_above(v, t, int(counts[j]), side, runs=each)
                assert got.tolist() == torch.nonzero(s > t).reshape(-1).tolist()
    with pytest.raises(ValueError, match="runs of"):
        _kernels.indices_above(v, 0.5, 3, 0, runs=torch.zeros(p + 1, dtype=torch.int64))
    # the counts come out of the kernel as the suffix sums they are read as: no pass over
    # them on the device after it, and a run's count above a bound is a view of its row
    ops = ops_on_the_triton_path(lambda: _kernels.count_above(v, bounds, 1, runs=True))
    assert ops == ["full", "copy_", "zeros", "_count_above_kernel"], ops
    # bounds from the host (a search's): padded there, one copy (none to a CPU tensor)
    got = []
    ops = ops_on_the_triton_path(lambda: got.append(_kernels.count_above(v, bounds.numpy(), 1)))
    assert ops == ["zeros", "_count_above_kernel"], ops
    assert torch.equal(got[0], _kernels.count_above(v, bounds, 1))
    assert ops_on_the_triton_path(lambda: runs.above(2)) == ["select"]  # a view, no launch


@pytest.mark.parametrize("sampled", [True, False])
def test_the_top_ks_running_sums_scan_int64_counts_without_a_cast(sampled, monkeypatch):
    """On a GPU torch scans int32 counts into int64 running sums by a cast, a launch of its
    own, then the scan: the two-digit gathering's counts (each program's run) are int64
    where its kernel writes them, so that the running sum is one scan. The sampled path
    scans nothing (its gathering and the writing pass add up their counting passes' group
    sums instead), the two-digit one once."""
    import sys

    from bitcomm.codecs import _bracket

    if sampled:
        monkeypatch.setattr(_bracket, "SAMPLE", 256)
        monkeypatch.setattr(_bracket, "MIN_N", 4096)
        monkeypatch.setattr(_kernels, "SLACK", 4)
    else:
        monkeypatch.setattr(_bracket, "MIN_N", 1 << 30)
    scans = []
    original = torch.Tensor.cumsum

    def cumsum(t, *a, **k):
        if sys._getframe(1).f_code.co_filename == _kernels.__file__:
            scans.append((t.dtype, k.get("dtype", t.dtype)))
        return original(t, *a, **k)

    monkeypatch.setattr(torch.Tensor, "cumsum", cumsum)
    x = torch.randn(6000, generator=torch.Generator().manual_seed(3))
    with forced("triton"):
        got = _kernels.top_indices(x, 60)
    assert torch.equal(got, torch.topk(x, 60).indices.sort().values)
    assert scans == [(torch.int64, torch.int64)] * (0 if sampled else 1), scans


def test_unchecked_nan_is_above_every_score_in_a_top_k_and_above_no_threshold():
    """NaN of either sign (x86 makes negative ones: inf - inf) ranks above every score in the
    exact top-k, ties to the lower index, as on the numpy and torch paths; and is above no
    threshold in indices_above, as count_above counts it, so that the count it is given is
    the number it writes (not uninitialised memory)."""
    g = torch.Generator().manual_seed(17)
    v = torch.randn(5000, generator=g)
    nan = torch.tensor(float("nan"))
    v[[7, 300, 4000]] = torch.stack([nan, -nan, nan])
    assert torch.signbit(v[300]) and not torch.signbit(v[7])
    for side in (0, 1, -1, 2):
        s = {0: v, 1: v.clamp(min=0), -1: v.neg().clamp(min=0), 2: v.abs()}[side]
        for k in (2, 3, 50):
            with forced("numpy"):
                want = select.select_side(v, k, side, check=False) if side in (1, -1) \
                    else select.topk(s, k, check=False)
            assert _kernels.top_indices(v, k, side).tolist() == want.tolist(), (side, k)
        count = int(_kernels.count_above(v, torch.tensor([1.25]), side)[0])
        assert count == int((s > 1.25).sum())
        got = _kernels.indices_above(v, 1.25, count, side)
        assert got.tolist() == torch.nonzero(s > 1.25).reshape(-1).tolist(), side


def test_kth_largest_is_the_sorted_scores_kth():
    """kth_largest returns the k-th of the scores sorted in descending order, in x's dtype;
    Ok-Topk's threshold takes it on the Triton path."""
    from bitcomm.collectives import oktopk

    g = torch.Generator().manual_seed(13)
    for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        v = torch.randn(2000, generator=g).to(dtype)
        v[:4] = torch.tensor([-0.0, 0.0, 0.0, -7.0]).to(dtype)
        for side in (0, 1, -1, 2):
            s = {0: v, 1: v.clamp(min=0), -1: v.neg().clamp(min=0), 2: v.abs()}[side]
            ranked = s.double().sort(descending=True).values
            for k in (1, 5, 1000, 2000):
                got = _kernels.kth_largest(v, k, side)
                assert got.dtype == dtype and got.item() == ranked[k - 1].item(), (side, k)
    for k in (0, 2001):
        with pytest.raises(ValueError, match="expected 0 < k <= 2000"):
            _kernels.kth_largest(v, k)
        with pytest.raises(ValueError, match="expected 0 < k <= 2000"):
            _kernels.top_indices(v, k)
    a = torch.rand(3000, generator=g)
    for k in (1, 30, 2999):
        with forced("triton"):
            got = oktopk._kth_largest(a, k)
        assert got == float(a.sort(descending=True).values[k - 1])


def test_a_decoder_reads_no_flag_where_no_payload_of_its_size_breaks_a_rule():
    """Sign and bit-plane payloads of a multiple of 8 values have no padding bits, and codes of
    the full width cannot exceed m = 2**width - 1: no rule to check, so the Triton decoders
    wait for nothing (a GPU would idle through the read). Where a rule can be broken they read
    their flag once and raise the precise error."""
    g = torch.Generator().manual_seed(6)
    calls = {
        "sign": (lambda n: sign.pack(torch.randn(n, generator=g)), sign.unpack),
        "planes": (lambda n: bits.pack(torch.randint(0, 4, (n,), generator=g), 2),
                   lambda f, n: bits.unpack(f, n, 2)),
        "counts": (lambda n: counts.pack(torch.randint(0, 4, (n,), generator=g), 3),
                   lambda f, n: counts.unpack(f, n, 3)),
        "counts m=2": (lambda n: counts.pack(torch.randint(0, 3, (n,), generator=g), 2),
                       lambda f, n: counts.unpack(f, n, 2)),
    }
    for name, (encode, decode) in calls.items():
        for n in (16, 8 * 4096, 13):
            frame = encode(n)
            want = decode(frame, n)
            with forced("triton"):
                got = []
                reads = host_reads(lambda: got.append(decode(frame, n)))
                assert torch.equal(got[0], want), (name, n)
                checked = n % 8 != 0 or name == "counts m=2"
                assert len(reads) == checked, (name, n, reads)
                if n % 8:
                    bad = frame.clone()
                    bad[-1] |= 1  # a padding bit of the last plane
                    with pytest.raises(ValueError):
                        decode(bad, n)


def test_a_decoders_one_flag_is_read_without_a_reduction(monkeypatch):
    """A Triton decoder's single flag is read as it is (one read, no reduction kernel before
    it); a set flag still raises the precise error."""
    reductions = []
    original = torch.Tensor.any
    monkeypatch.setattr(torch.Tensor, "any",
                        lambda self, *a, **k: reductions.append(self) or original(self, *a, **k))
    frame = sign.pack(torch.randn(13, generator=torch.Generator().manual_seed(5)))
    want = sign.unpack(frame, 13)
    with forced("triton"):
        assert torch.equal(sign.unpack(frame, 13), want)
        assert reductions == []
        bad = frame.clone()
        bad[-1] |= 1  # a padding bit: 13 elements leave 3 in the last byte
        with pytest.raises(ValueError, match="padding"):
            sign.unpack(bad, 13)


def test_packing_checks_the_range_in_the_packing_pass():
    """bits.pack and counts.pack (fixed and radix) check the range inside the packing kernel:
    besides it a zeroed flag and its one read at the end (none inside _frame.deferred until
    the block's end), no reduction over the input before it; encode writes the payload into
    its frame (besides, the header's copy), not a payload then a concatenation. A value out
    of range anywhere (first, in a later program, in a partial last tile) raises the
    numpy path's OverflowError; so does a wide value that would wrap into range if narrowed
    first."""
    from bitcomm.codecs import _frame

    g = torch.Generator().manual_seed(12)
    cases = [  # (pack, encode, the largest value they take, dtype)
        (lambda v: bits.pack(v, 4), lambda v: bits.encode(v, 4), 15, torch.int64),
        (lambda v: bits.pack(v, 1), lambda v: bits.encode(v, 1), 1, torch.uint8),
        (lambda v: counts.pack(v, 2), lambda v: counts.encode(v, 2), 2, torch.int32),
        (lambda v: counts.pack(v, 2, "radix"), lambda v: counts.encode(v, 2, "radix"), 2,
         torch.int16),
        (lambda v: counts.pack(v, 12, "radix"), lambda v: counts.encode(v, 12, "radix"), 12,
         torch.uint8),
    ]
    n = 8192 * 2 + 13  # four full programs of the checked fixed packing, a partial fifth
    kernel = ["_planes_pack_kernel", "_local_scalar_dense"]
    for pack, encode, top, dtype in cases:
        # the thread's flag is zeroed by a case's first pack and reused by its second; the
        # errors that end each case retire it (they find it set)
        zeroed = ["zeros"]
        v = torch.randint(0, top + 1, (n,), generator=g).to(dtype)
        for fn, extra in ((pack, []), (encode, ["copy_"])):
            want, got = fn(v), []
            ops = ops_on_the_triton_path(lambda fn=fn, v=v: got.append(fn(v)))
            assert torch.equal(got[0], want), top
            assert sorted(ops) == sorted(zeroed + kernel + extra), (top, ops)
            zeroed = []
        with forced("triton"), _frame.deferred():
            assert host_reads(lambda v=v: pack(v)) == []
        wide = [top + 1, -1] if dtype != torch.uint8 else [top + 1]
        if dtype == torch.int64:
            wide.append((1 << 32) + 1)  # 1 in its low 32 bits
        for bad in wide:
            for at in (0, 9000, n - 1):
                w = v.clone()
                w[at] = bad
                with pytest.raises(OverflowError) as ref:
                    pack(w)
                with forced("triton"), pytest.raises(OverflowError) as err:
                    pack(w)
                assert str(err.value) == str(ref.value), (top, bad, at)
                with forced("triton"), pytest.raises(OverflowError):
                    with _frame.deferred():
                        pack(w)


def _sparse_frame(idx: list[int], val: list[float], n: int, fmt: str, iw: int = 4
                  ) -> torch.Tensor:
    # A sparse frame written byte by byte, whatever its entries (the encoder refuses bad ones).
    head = sparse.HEADER.pack(n, len(idx), sparse.FORMATS.index(fmt))
    body = np.asarray(idx, dtype=np.int32 if iw == 4 else np.int64).tobytes()
    if fmt == "mean":
        body += np.float32(val[0]).tobytes()
    else:
        body += np.asarray(val, dtype=np.float32 if fmt == "fp32" else np.float16).tobytes()
    return torch.frombuffer(bytearray(head + body), dtype=torch.uint8)


@pytest.mark.parametrize("block", [8, 1024])
def test_sparse_decode_is_one_scatter_on_the_triton_path(block, monkeypatch):
    """A sparse frame (fp32, fp16 or mean values) decodes on the Triton path by the header's
    read, the zeros, one launch over the entries (the last tile masked as the others) and the
    flag's read: the numpy path's vector to the bit, as float32 and float64. A qsgd block and
    a frame without entries take the torch path."""
    from bitcomm.codecs import sparse

    monkeypatch.setitem(_kernels.TUNING, "sparse_scatter", (block, 4))
    g = torch.Generator().manual_seed(block)
    n = 5000
    for k in (1, 7, 8, 9, 300):
        idx = torch.randperm(n, generator=g)[:k]
        val = torch.randn(k, generator=g) * 1000
        for fmt in ("fp32", "fp16", "mean"):
            frame = sparse.encode(idx, val, n, fmt)
            for dtype in (torch.float32, torch.float64):
                want = sparse.decode(frame, dtype=dtype)
                with forced("triton"):
                    got = sparse.decode(frame, dtype=dtype, n=n)
                assert got[1] == want[1] == frame.numel(), (k, fmt)
                assert torch.equal(got[0], want[0]) and got[0].dtype == dtype, (k, fmt, dtype)
    frame = sparse.encode(idx, val, n)
    ops = ops_on_the_triton_path(lambda: sparse.decode(frame, n=n))
    assert ops == ["zeros", "zeros", "_sparse_scatter_kernel", "_local_scalar_dense"], ops
    with forced("triton"):  # the header's copy to the host, then the flag's
        reads = host_reads(lambda: sparse.decode(frame, n=n))
    assert [name for name, _, _ in reads] == ["cpu", "numpy", "__bool__"], reads
    # the sparse header is read once (and a qsgd block's header once)
    for frame, headers in ((sparse.encode(idx, val, n, sparse.Qsgd(seed=1)), 2),
                           (sparse.encode(idx[:0], val[:0], n), 1)):
        want = sparse.decode(frame)
        with forced("triton"):
            got = sparse.decode(frame)
            reads = host_reads(lambda frame=frame: sparse.decode(frame))
        assert torch.equal(got[0], want[0]) and got[1] == want[1]
        assert [name for name, _, _ in reads].count("cpu") == headers, reads


def test_sparse_decode_flags_every_rule_as_the_numpy_path_raises(monkeypatch):
    """Each broken rule of a sparse frame, in a full tile, the last one or across two (an
    index not above the previous tile's last), raises the numpy path's error on the Triton
    path; inside _frame.deferred at the block's end, with nothing written outside the
    vector."""
    from bitcomm.codecs import _frame

    monkeypatch.setitem(_kernels.TUNING, "sparse_scatter", (8, 4))
    n = 100
    good = list(range(3, 63, 3))  # 20 entries: two full tiles of 8 and a partial one
    vals = [float(i) / 4 for i in range(20)]
    bad = []
    for at in (0, 7, 8, 19):  # the first, a tile's last, the next tile's first, the last entry
        for index in (-1, n, n + 2**20):
            bad.append((good[:at] + [index] + good[at + 1 :], vals, "fp32"))
        if at:
            bad.append((good[:at] + [good[at - 1]] + good[at + 1 :], vals, "fp32"))  # repeated
            bad.append((good[:at] + [good[at - 1] - 1] + good[at + 1 :], vals, "fp16"))
        for v in (float("nan"), float("inf"), -float("inf")):
            bad.append((good, vals[:at] + [v] + vals[at + 1 :], "fp32"))
            bad.append((good, vals[:at] + [v] + vals[at + 1 :], "fp16"))
    bad += [(good, [float("nan")], "mean"), (good, [float("inf")], "mean"),
            (good, [-0.0], "mean"), ([5, 4], [1.0], "mean")]
    for idx, val, fmt in bad:
        frame = _sparse_frame(idx, val, n, fmt)
        with pytest.raises(ValueError) as want:
            sparse.decode(frame)
        message = re.escape(want.value.args[0])
        with forced("triton"), pytest.raises(ValueError, match=message):
            sparse.decode(frame)
        with forced("triton"), pytest.raises(ValueError, match=message):
            with _frame.deferred():
                assert sparse.decode(frame)[0].numel() == n
    # a value of -0.0 is kept as it is (a mean of -0.0 is refused)
    frame = _sparse_frame(good, [-0.0] + vals[1:], n, "fp16")
    want = sparse.decode(frame)[0]
    with forced("triton"):
        got = sparse.decode(frame)[0]
    assert torch.equal(got, want) and math.copysign(1.0, got[3].item()) == -1.0


def test_sparse_scatter_reads_int64_indices():
    """From n = 2**31 a frame's indices are int64: the kernel reads all eight bytes of each
    (an index of 2**32 + 5 is not 5) and writes only those below n."""
    n = 2**31 + 10
    idx = [0, 5, 99, 2**32 + 5]
    frame = _sparse_frame(idx, [1.0, 2.0, 3.0, 4.0], n, "fp32", iw=8)
    out = torch.zeros(100)
    flag = torch.zeros(1, dtype=torch.int32)
    _kernels.sparse_scatter(frame, n, 4, 17, "fp32", out, flag)
    assert flag.item() == 1  # 2**32 + 5 >= n
    want = torch.zeros(100)
    want[[0, 5, 99]] = torch.tensor([1.0, 2.0, 3.0])
    assert torch.equal(out, want)
    flag.zero_()
    frame = _sparse_frame(idx[:3], [1.0, 2.0, 3.0], n, "fp32", iw=8)
    out.zero_()
    _kernels.sparse_scatter(frame, n, 3, 17, "fp32", out, flag)
    assert flag.item() == 0 and torch.equal(out, want)


@pytest.mark.parametrize("block", [8, 1024])
def test_sparse_encode_is_one_kernel_on_the_triton_path(block, monkeypatch):
    """A sparse frame (fp32, fp16 or mean values) is written on the Triton path by one launch
    over the entries (the last tile masked as the others) and, for a mean, a one-program
    kernel: the numpy path's frame to the byte for every value dtype, checked or not, with
    int32 and (n >= 2**31) int64 indices. Besides the kernels: no host copy of the header, no
    cast, no concatenation; checked, the sort, the zeroed flag and its one read."""
    from bitcomm.codecs import sparse

    monkeypatch.setitem(_kernels.TUNING, "sparse_frame", (block, 4))
    g = torch.Generator().manual_seed(block)
    dtypes = {"fp32": (torch.float16, torch.bfloat16, torch.float32, torch.float64),
              "fp16": (torch.float16, torch.float32),
              "mean": (torch.float16, torch.bfloat16, torch.float32, torch.float64)}
    for n in (5000, 2**32 + 9):
        for k in (1, 7, 8, 9, 300):
            idx = torch.randint(0, n, (k,), generator=g).unique()
            idx = idx[torch.randperm(idx.numel(), generator=g)]
            val = torch.randn(idx.numel(), generator=g, dtype=torch.float64) * 1000
            val[0] = -0.0
            for fmt, kinds in dtypes.items():
                for dtype in kinds:
                    v = val.to(dtype)
                    for check in (True, False):
                        i = idx if check else idx.sort().values
                        want = sparse.encode(i, v, n, fmt, check=check)
                        with forced("triton"):
                            got = sparse.encode(i, v, n, fmt, check=check)
                        assert got.dtype == torch.uint8 and torch.equal(got, want), \
                            (n, k, fmt, dtype, check)
    # a mean of -0.0 alone is +0.0, as the numpy path writes it
    zeros = torch.full((block + 3,), -0.0)
    i = torch.arange(block + 3)
    with forced("triton"):
        got = sparse.encode(i, zeros, 100 + block, "mean")
    assert torch.equal(got, sparse.encode(i, zeros, 100 + block, "mean"))
    assert got[-4:].tolist() == [0, 0, 0, 0]
    k = 300
    i, v = torch.arange(0, 3 * k, 3), torch.randn(k, generator=g)
    tiles = ["_sparse_frame_kernel"]  # one launch, its last tile masked as the others
    assert ops_on_the_triton_path(lambda: sparse.encode(i, v, 5000, check=False)) == tiles
    ops = ops_on_the_triton_path(lambda: sparse.encode(i, v, 5000, "mean", check=False))
    assert ops == [*tiles, "_sparse_mean_kernel"], ops
    ops = ops_on_the_triton_path(lambda: sparse.encode(i, v, 5000, "fp16"))
    assert ops == ["sort", "index", "zeros", *tiles, "_local_scalar_dense"], ops
    with forced("triton"):
        assert host_reads(lambda: sparse.encode(i, v, 5000, check=False)) == []
        reads = host_reads(lambda: sparse.encode(i, v, 5000))
    assert [name for name, _, _ in reads] == ["__bool__"], reads


@pytest.mark.parametrize("block", [8, 1024])
def test_sparse_encode_at_reads_the_values_in_its_kernel(block, monkeypatch):
    """encode_at(x, idx) is encode(idx, x[idx], n)'s frame on every path, for every value
    format and dtype, checked (any order) or not; on the Triton path its kernel reads x at
    each index: no gathered copy, the same ops as encode of ready values. An index outside x
    is encode's ValueError on both paths (never torch's IndexError), and NaN in x counts only
    where an index reads it."""
    from bitcomm.codecs import sparse

    monkeypatch.setitem(_kernels.TUNING, "sparse_frame", (block, 4))
    g = torch.Generator().manual_seed(block + 1)
    n = 3000
    x = torch.randn(n, generator=g, dtype=torch.float64) * 100
    formats = {"fp32": (torch.bfloat16, torch.float32, torch.float64),
               "fp16": (torch.float16, torch.float32), "mean": (torch.float32, torch.float64),
               sparse.Qsgd(bits=2, seed=3): (torch.float32,)}
    for k in (1, 9, 300):
        idx = torch.randperm(n, generator=g)[:k]
        for fmt, kinds in formats.items():
            for dtype in kinds:
                v = x.to(dtype)
                for check in (True, False):
                    i = idx if check else idx.sort().values
                    want = sparse.encode(i, v[i], n, fmt, check=check)
                    assert torch.equal(sparse.encode_at(v, i, fmt, check=check), want)
                    with forced("triton"):
                        got = sparse.encode_at(v, i, fmt, check=check)
                    assert torch.equal(got, want), (k, fmt, dtype, check)
    i, v = torch.arange(0, 900, 3), x.float()
    tiles = ["_sparse_frame_kernel"]  # one launch, its last tile masked as the others
    assert ops_on_the_triton_path(lambda: sparse.encode_at(v, i, check=False)) == tiles
    ops = ops_on_the_triton_path(lambda: sparse.encode_at(v, i, "mean", check=False))
    assert ops == [*tiles, "_sparse_mean_kernel"], ops
    ops = ops_on_the_triton_path(lambda: sparse.encode_at(v, i))
    assert ops == ["sort", "zeros", *tiles, "_local_scalar_dense"], ops
    for bad in (-1, n, n + 2**20):
        i = torch.tensor([5, bad, 7])
        with pytest.raises(ValueError) as want:
            sparse.encode(i, torch.ones(3), n)
        assert str(want.value).startswith("expected indices in [0, 3000)")
        for fmt in ("fp32", "mean", "qsgd"):
            with pytest.raises(ValueError, match=re.escape(str(want.value))):
                sparse.encode_at(v, i, fmt)
            with forced("triton"), pytest.raises(ValueError, match=re.escape(str(want.value))):
                sparse.encode_at(v, i, fmt)
    w = v.clone()
    w[10] = float("nan")
    for path in ("numpy", "triton"):
        with forced(path):
            assert torch.equal(sparse.encode_at(w, torch.tensor([9, 11])),
                               sparse.encode(torch.tensor([9, 11]), w[[9, 11]], n))
            with pytest.raises(ValueError, match="expected finite values"):
                sparse.encode_at(w, torch.tensor([9, 10]))


@pytest.mark.parametrize("small", [True, False])
def test_a_top_k_frame_is_written_by_the_selections_writing_pass(small, monkeypatch,
                                                                  small_sample):
    """encode_top(x, k) is encode_at(x, select_abs(x, k))'s frame, byte for byte: on the
    Triton path, for fp32 values and unchecked fp16 ones, the top-k's writing pass writes the
    frame (the one-program path, the sampled radix path and, at k = n, the two-digit one; no
    sparse_frame launch), ties to lower indices; other formats, checked fp16 and checked
    float64 take the two calls. Checked, NaN, inf or -inf anywhere in float32 x is the
    frame's ValueError, also when a deferred block reads the flag. RedSync's frames (a mean
    of a side's values) are written alike."""
    from bitcomm.codecs import _frame

    if small:
        monkeypatch.setattr(_kernels, "SMALL_TOP", 1 << 14)
    g = torch.Generator().manual_seed(61)
    n = 5000
    x = torch.randn(n, generator=g, dtype=torch.float64) * 100
    x[:60] = torch.tensor([300.0, -300.0, 0.0, -0.0] * 15, dtype=torch.float64)  # ties
    kinds = {"fp32": (torch.bfloat16, torch.float32, torch.float64),
             "fp16": (torch.float16, torch.float32), "mean": (torch.float32,)}
    for k, (fmt, dtypes) in itertools.product((1, 50, n + 3), kinds.items()):
        for dtype, check in itertools.product(dtypes, (True, False)):
            v = x.to(dtype)
            with forced("numpy"):
                want = sparse.encode_at(v, select.select_abs(v, k, check=False), fmt,
                                        check=check)
            got = []
            ops = ops_on_the_triton_path(
                lambda v=v, f=fmt, c=check: got.append(sparse.encode_top(v, k, f, check=c)))
            assert torch.equal(got[0], want), (k, fmt, dtype, check)
            fused = (fmt == "fp32" and (dtype == torch.float32 or not check)
                     or fmt == "fp16" and not check)
            assert ("_sparse_frame_kernel" not in ops) == fused, (fmt, dtype, check, ops)
            if fused:
                assert ("_small_top_kernel" in ops) == small, ops
    none = torch.zeros(0, dtype=torch.int64)
    with forced("triton"):
        assert torch.equal(sparse.encode_top(v, 0), sparse.encode(none, v[:0], n))
    # RedSync's mean frame of a side: the programs' float64 sums (one program's tiles), then
    # their mean
    from bitcomm.codecs import redsync

    for side, w, k in itertools.product(("top", "bottom"), (x.float(), x), (1, 50, 700)):
        with forced("numpy"):
            want = redsync.encode(w, k, side)
        got = []
        ops = ops_on_the_triton_path(lambda w=w, k=k, s=side: got.append(redsync.encode(w, k, s)))
        assert torch.equal(got[0], want), (side, w.dtype, k)
        assert "_sparse_frame_kernel" not in ops, ops
        assert ("_sparse_mean_kernel" in ops) != small, ops
    for bad in (float("nan"), float("inf"), -float("inf")):
        w = x.float()
        w[4321] = bad
        with forced("triton"):
            with pytest.raises(ValueError, match="expected finite values, got NaN, inf"):
                sparse.encode_top(w, 50)
            with pytest.raises(ValueError, match="expected finite values, got NaN, inf"):
                with _frame.deferred():
                    sparse.encode_top(w, 50)
            assert sparse.encode_top(w, 50, check=False).numel() == sparse.encoded_size(n, 50)


def test_redsyncs_trimmed_search_ranks_and_frames_its_survivors_in_kernels():
    """RedSync's trimmed search ranks its survivors by their side's scores inside the top-k's
    kernels (no clamped copy of their values) and writes the frame with its mean in two
    launches (no gather, cast, reduction or concatenation by torch): the numpy path's frame
    for both sides."""
    from bitcomm.codecs import redsync

    g = torch.Generator().manual_seed(5)
    x = torch.randn(20_000, generator=g)
    for side in ("top", "bottom"):
        want = redsync.encode(x, 900, side, "trimmed")
        with forced("triton"):
            assert torch.equal(redsync.encode(x, 900, side, "trimmed"), want), side
        ops = ops_on_the_triton_path(lambda s=side: redsync.encode(x, 900, s, "trimmed"))
        assert "clamp" not in ops, ops
        assert ops[-3:] == ["index", "_sparse_frame_kernel", "_sparse_mean_kernel"], ops


def test_redsyncs_exact_top_k_reads_its_check_behind_the_frames_launches(launched,
                                                                          monkeypatch):
    """RedSync's encode with the exact top-k has the selection's writing pass write its
    frame (the indices and the programs' sums, then their mean: no sparse_frame) before its
    one host read (the selection's check, and how many values have the side's sign): the
    frame of the k as if all had it, which they do where k or more values do; where fewer
    do, they are the side's largest scores, whose frame a second selection writes after the
    read, without another read; where none does, a frame of no entries, which takes no
    launch. Each gives the numpy path's frame; NaN raises the check's error."""
    import sys

    from bitcomm.codecs import redsync

    g = torch.Generator().manual_seed(6)
    x = torch.randn(20_000, generator=g)
    few = -x.abs()
    few[torch.randperm(20_000, generator=g)[:50]] = 1.0  # 50 of the top side's sign
    original = torch.Tensor.tolist

    def tolist(t):
        if sys._getframe(1).f_code.co_filename.endswith(("select.py", "redsync.py")):
            launched.append("read")
        return original(t)

    monkeypatch.setattr(torch.Tensor, "tolist", tolist)
    written = ["_chosen_write_kernel", "_sparse_mean_kernel"]
    for v, after, sent in ((x, [], 200), (-x.abs(), [], 0), (few, written, 50)):
        with forced("numpy"):
            want = redsync.encode(v, 200, "top")
        launched.clear()
        with forced("triton"):
            got = redsync.encode(v, 200, "top")
        read = launched.index("read")
        assert launched.count("read") == 1 and "_sparse_frame_kernel" not in launched
        assert set(written) <= set(launched[:read]), str(launched)
        tail = launched[read + 1 :]
        assert (tail[-len(after):] if after else tail) == after, str(launched)
        assert torch.equal(got, want)
        assert redsync.decode_entries(got)[0].numel() == sent
    x[123] = float("nan")
    with forced("triton"), pytest.raises(ValueError, match="expected finite values"):
        redsync.encode(x, 200, "top")


def test_sparse_encode_flags_every_rule_as_the_numpy_path_raises():
    """Each broken rule of sparse.encode's entries, in a full tile, the last one or across
    two (a repeated index where one tile ends and the next begins), raises the numpy path's
    error on the Triton path (ValueError, or OverflowError for fp16), with the same message;
    inside _frame.deferred at the block's end."""
    from bitcomm.codecs import _frame, sparse

    n = 100
    good = list(range(3, 63, 3))  # 20 entries: two full tiles of 8 and a partial one
    vals = [float(i) / 4 - 2 for i in range(20)]
    bad = []
    for at in (0, 7, 8, 19):
        for index in ((-1, n, n + 2**20) if at in (0, 19) else ()):
            bad.append((good[:at] + [index] + good[at + 1 :], vals, "fp32", torch.float32))
        if at:
            bad.append((good[:at] + [good[at - 1]] + good[at + 1 :], vals, "fp16",
                        torch.float32))
        for v in (float("nan"), float("inf"), -float("inf"), 1e39):
            for fmt in ("fp32", "fp16", "mean"):
                bad.append((good, vals[:at] + [v] + vals[at + 1 :], fmt, torch.float64))
        bad.append((good, vals[:at] + [-70000.0] + vals[at + 1 :], "fp16", torch.float32))
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(_kernels.TUNING, "sparse_frame", (8, 4))
        for idx, val, fmt, dtype in bad:
            i, v = torch.tensor(idx), torch.tensor(val, dtype=dtype)
            with pytest.raises((ValueError, OverflowError)) as want:
                sparse.encode(i, v, n, fmt)
            message = re.escape(want.value.args[0])
            with forced("triton"), pytest.raises(want.type, match=message):
                sparse.encode(i, v, n, fmt)
            with forced("triton"), pytest.raises(want.type, match=message):
                with _frame.deferred():
                    assert sparse.encode(i, v, n, fmt).dtype == torch.uint8


def test_a_kernel_writes_any_header_to_the_byte():
    """A header written by a kernel (_store_head, from two int64 words) is HEADER.pack's bytes
    for lengths that triton passes as int32, uint32 or int64 arguments, and bytes past it
    stay as they were."""
    for n in (0, 1, 2**31 - 1, 2**31, 2**32 - 1, 2**32 + 5, 2**62 + 3, 2**63 - 1):
        for bucket in (1, 512, 2**31, 2**32 - 1):
            data = qsgd.HEADER.pack(n, 8, 1, bucket)
            frame = torch.full((20,), 0xAB, dtype=torch.uint8)
            _kernels.launch(_kernels._head_kernel, (1,), frame, *_kernels._head_words(data),
                            HEAD=len(data), num_warps=1)
            assert bytes(frame[:14].tolist()) == data, (n, bucket)
            assert frame[14:].tolist() == [0xAB] * 6
    with pytest.raises(ValueError, match="at most 16 bytes"):
        _kernels._head_words(bytes(17))
