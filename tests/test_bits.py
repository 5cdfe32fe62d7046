import pytest
import torch
from bitarray import bitarray
from hypothesis import given, settings
from hypothesis import strategies as st

from bitcomm.codecs import bits

from conftest import AWKWARD, OTHER_PATHS, forced, unhex


def test_golden_worked_example():
    frame = bits.encode(torch.tensor([5, 0, 3]), 3)
    assert frame.tolist() == unhex("03 00 00 00 00 00 00 00 03 80 20 a0")
    values, used = bits.decode(frame)
    assert values.tolist() == [5, 0, 3] and used == 12


@pytest.mark.parametrize("width", [1, 3, 8, 11, 16])
@pytest.mark.parametrize("n", [1, 9, 100, 1001])
def test_planes_match_bitarray(path, width, n):
    g = torch.Generator().manual_seed(n * 31 + width)
    x = torch.randint(0, 1 << width, (n,), generator=g)
    payload = bits.pack(x, width)
    nb = (n + 7) // 8
    for row, p in enumerate(range(width - 1, -1, -1)):
        ref = bitarray([(int(v) >> p) & 1 for v in x], endian="big").tobytes()
        assert bytes(payload[row * nb:(row + 1) * nb].tolist()) == ref


@pytest.mark.parametrize("width", range(1, 17))
def test_round_trip_awkward_sizes(path, width):
    g = torch.Generator().manual_seed(width)
    for n in AWKWARD:
        x = torch.randint(0, 1 << width, (n,), generator=g)
        frame = bits.encode(x, width)
        assert frame.numel() == bits.encoded_size(n, width) == 9 + width * ((n + 7) // 8)
        out, used = bits.decode(frame)
        assert used == frame.numel()
        assert torch.equal(out.long(), x)


@pytest.mark.parametrize("other", OTHER_PATHS)
def test_every_path_gives_identical_bytes(other):
    x = torch.randint(0, 1 << 13, (12345,), generator=torch.Generator().manual_seed(1))
    a = bits.pack(x, 13)
    with forced(other):
        b = bits.pack(x, 13)
        back = bits.unpack(b, x.numel(), 13)
    assert torch.equal(a, b)
    assert torch.equal(back.long(), x)


def test_input_dtypes_and_output_dtype():
    x = torch.tensor([0, 1, 200, 255])
    for dt in (torch.uint8, torch.int16, torch.int32, torch.int64):
        assert bits.decode(bits.encode(x.to(dt), 8))[0].tolist() == [0, 1, 200, 255]
    assert bits.unpack(bits.pack(x, 8), 4, 8).dtype == torch.uint8
    assert bits.unpack(bits.pack(x, 9), 4, 9).dtype == torch.int32
    assert bits.unpack(bits.pack(x, 9), 4, 9, dtype=torch.int64).dtype == torch.int64


def test_frames_read_back_to_back():
    a, b = torch.tensor([1, 2, 3]), torch.tensor([7, 7])
    buf = torch.cat([bits.encode(a, 2), bits.encode(b, 3)])
    first, used = bits.decode(buf)
    second, used2 = bits.decode(buf[used:])
    assert first.tolist() == [1, 2, 3] and second.tolist() == [7, 7]
    assert used + used2 == buf.numel()


def test_bad_input():
    with pytest.raises(TypeError, match="integer tensor"):
        bits.pack(torch.tensor([1.0]), 4)
    with pytest.raises(TypeError, match="torch.Tensor"):
        bits.pack([1, 2], 4)
    with pytest.raises(OverflowError, match=r"\[0, 15\].*got 16"):
        bits.pack(torch.tensor([3, 16]), 4)
    with pytest.raises(OverflowError, match="got -1"):
        bits.pack(torch.tensor([-1, 2]), 4)
    with pytest.raises(ValueError, match="1 <= width <= 16, got 17"):
        bits.pack(torch.tensor([1]), 17)
    with pytest.raises(ValueError, match="got 0"):
        bits.pack(torch.tensor([1]), 0)


def test_truncated_and_corrupt_frames():
    frame = bits.encode(torch.tensor([5, 0, 3, 1, 2, 7, 6, 4, 1]), 3)
    for cut in (0, 5, 8, 9, frame.numel() - 1):
        with pytest.raises(ValueError, match="truncated bits frame"):
            bits.decode(frame[:cut])
    bad = frame.clone()
    bad[8] = 17
    with pytest.raises(ValueError, match="width in 1..16, got 17"):
        bits.decode(bad)
    bad = frame.clone()
    bad[7] = 0x80  # n becomes negative
    with pytest.raises(ValueError, match="n >= 0"):
        bits.decode(bad)
    bad = frame.clone()
    bad[-1] |= 0x01  # a padding bit of the last plane (n = 9 uses 1 bit of the 2nd byte)
    with pytest.raises(ValueError, match="padding bits must be zero"):
        bits.decode(bad)
    with pytest.raises(ValueError, match="expected a bits payload of"):
        bits.unpack(torch.zeros(3, dtype=torch.uint8), 9, 3)


def test_empty_round_trip():
    frame = bits.encode(torch.empty(0, dtype=torch.int64), 5)
    assert frame.numel() == 9
    out, used = bits.decode(frame)
    assert out.numel() == 0 and used == 9


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 16).flatmap(
    lambda w: st.tuples(st.just(w), st.lists(st.integers(0, (1 << w) - 1), max_size=300))))
def test_property_round_trip(case):
    width, values = case
    x = torch.tensor(values, dtype=torch.int64)
    frame = bits.encode(x, width)
    assert frame.numel() == bits.encoded_size(len(values), width)
    assert bits.decode(frame)[0].long().tolist() == values


def test_few_million():
    n = 3_000_001
    x = torch.randint(0, 1 << 5, (n,), generator=torch.Generator().manual_seed(3))
    assert torch.equal(bits.decode(bits.encode(x, 5))[0].long(), x)


@pytest.mark.parametrize("width", [1, 2, 3, 7, 8, 9, 13, 16])
def test_the_compiled_cpu_passes_write_and_read_the_planes(monkeypatch, width):
    """From _jit.MIN_VALUES values the CPU path packs and unpacks in numba's passes: the planes
    are bitarray's for partial last words, every integer dtype, a strided and a misaligned
    input, and the values come back in the default dtype; a process without numba and a
    shorter vector take numpy's way to the same bytes."""
    import sys

    from bitcomm.codecs import _bits_cpu, _jit

    calls = []
    for name in ("pack", "unpack"):
        compiled = getattr(_bits_cpu, name)
        monkeypatch.setattr(_bits_cpu, name, lambda *a, f=compiled, k=name: calls.append(k)
                            or f(*a))

    def planes(x):  # the reference: each plane's bits, MSB first, by bitarray
        return b"".join(bitarray([(int(v) >> p) & 1 for v in x.tolist()], endian="big").tobytes()
                        for p in range(width - 1, -1, -1))

    g = torch.Generator().manual_seed(width)
    dtypes = [dt for dt in (torch.uint8, torch.int16, torch.int32, torch.int64)
              if (1 << width) - 1 <= torch.iinfo(dt).max]
    for n in (_jit.MIN_VALUES, _jit.MIN_VALUES + 1, _jit.MIN_VALUES + 13):
        x = torch.randint(0, 1 << width, (n,), generator=g)
        x[:3] = torch.tensor([0, (1 << width) - 1, 1 << (width - 1)])
        want = planes(x)
        for dt in dtypes:
            calls.clear()
            payload = bits.pack(x.to(dt), width)
            assert bytes(payload.numpy()) == want and calls == ["pack"], (n, dt)
        calls.clear()
        back = bits.unpack(payload, n, width)
        assert calls == ["unpack"]
        assert back.dtype == (torch.uint8 if width <= 8 else torch.int32)
        assert torch.equal(back.long(), x)
        strided = torch.randint(0, 1 << width, (2 * n,), generator=g)[::2]
        assert bytes(bits.pack(strided, width).numpy()) == planes(strided)
        with monkeypatch.context() as m:
            m.setitem(sys.modules, "numba", None)  # `import numba` now fails
            calls.clear()
            assert bytes(bits.pack(x, width).numpy()) == want
            assert torch.equal(bits.unpack(payload, n, width).long(), x) and not calls
    if width <= 8:  # 8-byte words read from an address that is not a multiple of 8
        buf = torch.zeros(n + 1, dtype=torch.uint8)
        buf[1:] = x.to(torch.uint8)
        assert buf[1:].numpy().ctypes.data % 8 and bytes(bits.pack(buf[1:], width).numpy()) == want
    short = torch.randint(0, 1 << width, (_jit.MIN_VALUES - 1,), generator=g)
    calls.clear()
    assert bytes(bits.pack(short, width).numpy()) == planes(short) and not calls
