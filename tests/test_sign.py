import math

import numpy as np
import pytest
import torch
from bitarray import bitarray
from hypothesis import given, settings
from hypothesis import strategies as st

from bitcomm.codecs import sign

from conftest import AWKWARD, OTHER_PATHS, dispatched, forced, unhex


def test_golden_worked_example():
    x = torch.tensor([1.5, -2.0, 0.0, -0.0, -1e-9, 3.0, 7.0, -4.0, 2.0])
    frame = sign.encode(x)
    assert frame.tolist() == unhex("09 00 00 00 00 00 00 00 b6 80")
    out, used = sign.decode(frame)
    assert out.tolist() == [1, -1, 1, 1, -1, 1, 1, -1, 1] and used == 10


def test_golden_scaled():
    frame = sign.encode_scaled(torch.tensor([3.0, -4.0]))
    assert frame.tolist() == unhex("02 00 00 00 00 00 00 00 30 46 62 40 80")
    out, used = sign.decode_scaled(frame)
    rms = np.float32(math.sqrt(12.5))
    assert out.tolist() == [float(rms), -float(rms)] and used == 13


def test_convention_matches_numpy_and_deepspeed(path):
    x = torch.tensor([0.0, -0.0, 1.0, -1.0, float("inf"), float("-inf"), 1e-45, -1e-45])
    payload = sign.pack(x)
    assert payload.tolist() == np.packbits(x.numpy() >= 0).tolist()
    # DeepSpeed 1-bit Adam: x.sign().add_(1).bool() (sign(0) = 0 -> True)
    ds = x.sign().add_(1).bool()
    assert sign.unpack(payload, x.numel()).gt(0).tolist() == ds.tolist()


def test_nan_encodes_as_negative_and_scaled_frame_rejects_it(path):
    x = torch.tensor([float("nan"), 1.0])
    assert sign.unpack(sign.pack(x), 2).tolist() == [-1.0, 1.0]
    with pytest.raises(ValueError, match="finite"):
        sign.encode_scaled(x)
    with pytest.raises(ValueError, match="finite"):
        sign.encode_scaled(torch.tensor([float("inf"), 1.0]), "mean_abs")


@pytest.mark.parametrize("n", [1, 8, 9, 100, 1001])
def test_bits_match_bitarray(path, n):
    x = torch.randn(n, generator=torch.Generator().manual_seed(n))
    ref = bitarray([bool(v >= 0) for v in x], endian="big").tobytes()
    assert bytes(sign.pack(x).tolist()) == ref


def test_round_trip_awkward_sizes(path):
    g = torch.Generator().manual_seed(0)
    big = [(1 << 20) - 1, 1 << 20, (1 << 20) + 9, 3 * (1 << 20) + 5]
    for n in AWKWARD + ([65537] if path == "triton" else big):  # the interpreter is slow
        x = torch.randn(n, generator=g)
        frame = sign.encode(x)
        assert frame.numel() == sign.encoded_size(n) == 8 + (n + 7) // 8
        out, used = sign.decode(frame)
        assert used == frame.numel()
        assert torch.equal(out, torch.where(x >= 0, 1.0, -1.0))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_dtypes(path, dtype):
    x = torch.randn(77, generator=torch.Generator().manual_seed(2)).to(dtype)
    out, _ = sign.decode(sign.encode(x), dtype=dtype)
    assert out.dtype == dtype
    assert torch.equal(out, torch.where(x >= 0, 1.0, -1.0).to(dtype))


@pytest.mark.parametrize("other", OTHER_PATHS)
def test_every_path_gives_identical_bytes(other):
    n = 3 * (1 << 20) + 3 if other == "torch" else 40_003  # the interpreter is slow
    x = torch.randn(n, generator=torch.Generator().manual_seed(5))
    a = sign.encode(x)
    with forced(other):
        b = sign.encode(x)
        ob = sign.decode(b)[0]
    assert torch.equal(a, b)
    assert torch.equal(sign.decode(a)[0], ob)


@pytest.mark.parametrize("kind", sign.SCALES)
def test_scales_against_numpy(kind):
    x = torch.randn(1000, generator=torch.Generator().manual_seed(7)) * 3
    a = x.double().numpy()
    ref = np.sqrt(np.mean(a * a)) if kind == "rms" else np.mean(np.abs(a))
    out, used = sign.decode_scaled(sign.encode_scaled(x, kind))
    assert used == sign.scaled_size(1000) == 12 + 125
    assert out.abs().unique().tolist() == [pytest.approx(float(np.float32(ref)), rel=0, abs=0)]
    assert torch.equal(out.sign(), torch.where(x >= 0, 1.0, -1.0))


def test_empty_round_trip():
    out, used = sign.decode(sign.encode(torch.empty(0)))
    assert out.numel() == 0 and used == 8
    out, used = sign.decode_scaled(sign.encode_scaled(torch.empty(0)))
    assert out.numel() == 0 and used == 12


def test_bad_input():
    with pytest.raises(TypeError, match="floating-point tensor, got dtype torch.int64"):
        sign.encode(torch.tensor([1, 2]))
    with pytest.raises(TypeError, match="floating-point dtype"):
        sign.unpack(torch.zeros(1, dtype=torch.uint8), 3, dtype=torch.int32)
    with pytest.raises(ValueError, match="scale in"):
        sign.encode_scaled(torch.ones(3), "max")
    with pytest.raises(TypeError, match="uint8 tensor"):
        sign.decode(torch.zeros(9, dtype=torch.int32))


@pytest.mark.parametrize("path", ["numpy", *OTHER_PATHS])
def test_inputs_that_autograd_tracks_are_read_outside_it(path):
    """A tensor that requires grad, of any shape, encodes as its values do, and no result is
    tracked: the codecs read their input detached. A 1-D tensor autograd does not track is
    taken as it is, with no torch call of the host's (a detach and a reshape are two)."""
    from bitcomm.codecs import _frame

    base = torch.randn(6, 7, generator=torch.Generator().manual_seed(3))
    tracked = base.clone().requires_grad_()
    with forced(path):
        frame = sign.encode_scaled(tracked * 2)  # a non-leaf, inside a graph
        assert not frame.requires_grad and frame.grad_fn is None
        assert torch.equal(frame, sign.encode_scaled(base.reshape(-1) * 2))
        values, _ = sign.decode_scaled(frame)
        assert not values.requires_grad
    flat = base.reshape(-1)
    assert _frame.check_float(flat) is flat
    with dispatched(counted={"detach", "view", "alias"}) as ops:  # views too
        _frame.check_float(flat)
    assert ops == []
    with dispatched(counted={"detach", "view", "alias"}) as ops:
        _frame.check_float(tracked)
    assert ops == ["detach", "view"]
    got = _frame.check_float(tracked)
    assert got.shape == (42,) and not got.requires_grad
    assert got.data_ptr() == tracked.data_ptr()  # a view: no copy
    assert _frame.check_int(torch.arange(6).reshape(2, 3)).tolist() == list(range(6))


def test_truncated_and_corrupt_frames():
    frame = sign.encode(torch.randn(20))
    for cut in (0, 7, 8, frame.numel() - 1):
        with pytest.raises(ValueError, match="truncated sign frame"):
            sign.decode(frame[:cut])
    bad = frame.clone()
    bad[-1] |= 0x01  # n = 20 leaves 4 padding bits
    with pytest.raises(ValueError, match="padding bits must be zero"):
        sign.decode(bad)
    scaled = sign.encode_scaled(torch.randn(20))
    bad = scaled.clone()
    bad[8:12] = torch.tensor([0, 0, 0xC0, 0x7F], dtype=torch.uint8)  # NaN scale
    with pytest.raises(ValueError, match="finite scale"):
        sign.decode_scaled(bad)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(allow_nan=False, width=32), max_size=200))
def test_property_round_trip(values):
    x = torch.tensor(values, dtype=torch.float32)
    out, used = sign.decode(sign.encode(x))
    assert used == sign.encoded_size(len(values))
    assert out.tolist() == [1.0 if v >= 0 else -1.0 for v in values]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_scaled_encode_leaves_input_untouched(dtype):
    x = torch.tensor([-1.0, 2.0, -3.0], dtype=dtype)
    before = x.clone()
    for kind in sign.SCALES:
        sign.encode_scaled(x, kind)
    assert torch.equal(x, before)


def test_pack_mask_is_the_sign_convention(path):
    x = torch.randn(1001, generator=torch.Generator().manual_seed(3))
    x[:4] = torch.tensor([0.0, -0.0, 1e-40, -1e-40])
    payload = sign.pack_mask(x >= 0)
    assert torch.equal(payload, sign.pack(x))
    assert payload[0].item() >> 4 == 0b1110  # 0, -0 and 1e-40 are +1, -1e-40 is -1
    assert torch.equal(sign.unpack_mask(payload, 1001), x >= 0)
    with pytest.raises(TypeError, match="expected a bool tensor"):
        sign.pack_mask((x >= 0).to(torch.uint8))


def test_backend_names_the_path_a_tensor_takes():
    from bitcomm.codecs import backend

    with forced("numpy"):
        assert backend(torch.zeros(1)) == "numpy"  # CPU tensors take the numpy fast path
        assert backend(torch.zeros(1, device="meta")) == "torch"  # other devices: torch ops
    with forced("torch"):
        assert backend(torch.zeros(1)) == "torch"


def test_a_triton_too_old_for_the_kernels_is_left_unused(monkeypatch):
    """triton before 3.4 lacks what the kernels compile with: CUDA tensors take the torch path
    (same bytes), and the user hears why once."""
    import importlib.metadata

    from bitcomm.codecs import _frame

    versions = {"triton": "3.3.1"}
    monkeypatch.setattr(importlib.metadata, "version", lambda name: versions[name])
    _frame.has_triton.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match=r"triton 3\.3\.1 is older than 3\.4"):
            assert not _frame.has_triton()
        for good in ("3.4.0", "3.6.0+git1234", "4.0"):
            versions["triton"] = good
            _frame.has_triton.cache_clear()
            assert _frame.has_triton(), good
    finally:
        _frame.has_triton.cache_clear()


def test_layouts_and_devices_without_data_are_type_errors():
    with pytest.raises(TypeError, match="dense"):
        sign.encode(torch.tensor([1.0, -2.0]).to_sparse())
    with pytest.raises(TypeError, match="meta"):
        sign.encode(torch.ones(3, device="meta"))


def test_numpys_way_packs_a_long_vector_a_chunk_at_a_time_to_the_same_bytes(monkeypatch):
    """Past sign._CHUNK elements, where numba does not pack (float16, a strided vector, no
    numba), numpy compares and packs a chunk at a time: the bytes are np.packbits(x >= 0)'s,
    across chunk boundaries and with a partial last byte."""
    import sys

    g = torch.Generator().manual_seed(11)
    x = torch.randn(2 * sign._CHUNK + 13, generator=g).to(torch.float16)
    x[[0, sign._CHUNK - 1, sign._CHUNK, -1]] = torch.tensor([-0.0, float("nan"), 0.0, -1.0],
                                                             dtype=torch.float16)
    assert sign.pack(x).tolist() == np.packbits((x >= 0).numpy()).tolist()
    monkeypatch.setattr(sign, "_CHUNK", 64)  # many chunks, at small sizes
    monkeypatch.setitem(sys.modules, "numba", None)  # `import numba` now fails
    for n in (64, 65, 3 * 64, 3 * 64 + 5, 1000):
        for v in (torch.randn(n, generator=g),
                  torch.randn(2 * n, generator=g, dtype=torch.float64)[::2]):
            assert sign.pack(v).tolist() == np.packbits((v >= 0).numpy()).tolist(), n


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_compiled_cpu_pass_writes_numpys_bytes(monkeypatch, dtype):
    """From sign._JIT_MIN elements the CPU encoder packs in numba's one pass: the bytes are
    np.packbits(x >= 0)'s for NaN, +-0.0, +-inf and a partial last byte; a strided input, a
    process without numba and a shorter vector take numpy's way to the same bytes."""
    import sys

    from bitcomm.codecs import _sign_cpu

    calls = []
    compiled = _sign_cpu.pack_bytes
    monkeypatch.setattr(_sign_cpu, "pack_bytes",
                        lambda a, out: calls.append(a.size) or compiled(a, out))

    def packed(x):  # the bytes, and whether the compiled pass wrote them
        before = len(calls)
        return sign.pack(x).tolist(), len(calls) > before

    g = torch.Generator().manual_seed(7)
    for n in (sign._JIT_MIN, sign._JIT_MIN + 1, sign._JIT_MIN + 13):
        x = torch.randn(n, generator=g).to(dtype)
        x[[3, 17, 100, 101, 102, n - 1]] = torch.tensor(
            [float("nan"), -0.0, 0.0, float("inf"), -float("inf"), -0.0], dtype=dtype)
        want = np.packbits((x >= 0).numpy()).tolist()
        assert packed(x) == (want, True), n
        strided = torch.randn(2 * n, generator=g).to(dtype)[::2]
        assert packed(strided) == (np.packbits((strided >= 0).numpy()).tolist(), False)
        with monkeypatch.context() as m:
            m.setitem(sys.modules, "numba", None)  # `import numba` now fails
            assert packed(x) == (want, False)
    short = torch.randn(sign._JIT_MIN - 8, generator=g).to(dtype)
    assert packed(short) == (np.packbits((short >= 0).numpy()).tolist(), False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_compiled_cpu_scale_is_the_fp32_of_the_exact_one(monkeypatch, dtype):
    """From sign._JIT_MIN elements the CPU scale adds in numba's float64 pass: rms and mean
    |x| equal the fp32 rounding of the exactly summed scale (math.fsum) and the torch path's,
    a NaN or inf is refused, and a strided input and a process without numba take torch's
    chunked sums to the same value."""
    import math
    import sys

    from bitcomm.codecs import _sign_cpu

    calls = []
    compiled = _sign_cpu.scale_sum
    monkeypatch.setattr(_sign_cpu, "scale_sum", lambda a, sq: calls.append(a.size)
                        or compiled(a, sq))
    g = torch.Generator().manual_seed(11)
    n = sign._JIT_MIN + 5
    for spread in (1.0, 1e-30, 1e30):
        x = (torch.randn(n, generator=g, dtype=torch.float64) * spread).to(dtype)
        a = x.double().numpy().tolist()
        exact = {"rms": math.sqrt(math.fsum(v * v for v in a) / n),
                 "mean_abs": math.fsum(abs(v) for v in a) / n}
        for kind, want in exact.items():
            calls.clear()
            got = sign.compute_scale(x, kind)
            assert calls == [n] and got == float(np.float32(want)), (spread, kind)
            with monkeypatch.context() as m:
                m.setitem(sys.modules, "numba", None)  # `import numba` now fails
                assert sign.compute_scale(x, kind) == got and calls == [n]
            assert sign.compute_scale(torch.stack([x, x], 1)[:, 0], kind) == got
            assert calls == [n]
    x[n // 2] = float("nan")
    with pytest.raises(ValueError, match="finite"):
        sign.compute_scale(x)
    x[n // 2] = float("inf")
    with pytest.raises(ValueError, match="finite"):
        sign.compute_scale(x, "mean_abs")
