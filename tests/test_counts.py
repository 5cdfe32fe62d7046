import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bitcomm.codecs import counts

from conftest import AWKWARD, OTHER_PATHS, forced, needs_interpreter, unhex

MS = [0, 1, 2, 3, 4, 5, 6, 7, 8, 15, 16, 100, 255, 256, 1000, 65535]


def test_golden_fixed():
    frame = counts.encode(torch.tensor([2, 0, 1]), m=2)
    assert frame.tolist() == unhex("03 00 00 00 00 00 00 00 02 00 00 80 20")
    values, used = counts.decode(frame)
    assert values.tolist() == [2, 0, 1] and used == 13


def test_golden_radix():
    frame = counts.encode(torch.tensor([2, 0, 1]), m=2, packing="radix")
    assert frame.tolist() == unhex("03 00 00 00 00 00 00 00 02 00 01 80 00 80 00 80 00 80 80")
    values, used = counts.decode(frame)
    assert values.tolist() == [2, 0, 1] and used == 19


def test_width_is_ceil_log2():
    for m in range(0, 2000):
        assert counts.width(m) == math.ceil(math.log2(m + 1))


def test_radix_groups():
    # three values in [0, 2] fit in 5 bits, five in 8 (1.6 bits each, as the issue asks)
    assert counts.radix_group(2) == (5, 8)
    for m in range(1, 300):
        g, b = counts.radix_group(m)
        assert (m + 1) ** g <= 1 << b < 2 * (m + 1) ** g  # b is the least that holds g counts
        assert b <= 16
        assert b / g <= counts.width(m)  # never worse than fixed
        assert b / g >= math.log2(m + 1) - 1e-12  # and never beats information theory


def test_radix_approaches_log2_for_large_n():
    n = 1 << 20
    for m in (2, 4, 5, 8):
        per_value = counts.packed_size(n, m, "radix") * 8 / n
        g, b = counts.radix_group(m)
        assert per_value == pytest.approx(b / g, rel=1e-3)
        assert per_value < counts.width(m)
    assert counts.packed_size(3000, 2, "fixed") == 750
    assert counts.packed_size(3000, 2, "radix") == 600


@pytest.mark.parametrize("packing", counts.PACKINGS)
@pytest.mark.parametrize("m", MS)
def test_round_trip_and_exact_size(path, m, packing):
    g = torch.Generator().manual_seed(m)
    for n in AWKWARD:
        x = torch.randint(0, m + 1, (n,), generator=g)
        frame = counts.encode(x, m, packing)
        assert frame.numel() == counts.encoded_size(n, m, packing)
        out, used = counts.decode(frame)
        assert used == frame.numel()
        assert torch.equal(out.long(), x)
        assert out.dtype == (torch.uint8 if m <= 255 else torch.int32)


@pytest.mark.parametrize("other", OTHER_PATHS)
def test_every_path_gives_identical_bytes(other):
    # radix codes of 8, 13, 16 (above 32767) and 15 bits
    for m in (2, 5, 8, 12):
        x = torch.randint(0, m + 1, (10001,), generator=torch.Generator().manual_seed(m))
        x[:10] = m  # a group of the largest code
        for packing in counts.PACKINGS:
            a = counts.encode(x, m, packing)
            with forced(other):
                b = counts.encode(x, m, packing)
                back, _ = counts.decode(b)
            assert torch.equal(a, b), (m, packing)
            assert torch.equal(back.long(), x)
            assert torch.equal(counts.decode(a)[0].long(), x)


def test_bad_input():
    with pytest.raises(OverflowError, match=r"counts in \[0, 3\], got 4"):
        counts.encode(torch.tensor([1, 4]), 3)
    with pytest.raises(OverflowError, match="got -2"):
        counts.encode(torch.tensor([-2, 1]), 3, "radix")
    with pytest.raises(TypeError, match="integer tensor"):
        counts.encode(torch.tensor([1.0]), 3)
    with pytest.raises(ValueError, match="0 <= m <= 65535, got 70000"):
        counts.encode(torch.tensor([1]), 70000)
    with pytest.raises(ValueError, match="packing in"):
        counts.encode(torch.tensor([1]), 3, "huffman")
    with pytest.raises(OverflowError, match="got 1"):
        counts.encode(torch.tensor([0, 1]), 0)


def test_corrupt_payloads():
    # fixed, m = 2: the 2-bit value 3 is not a count
    frame = counts.encode(torch.tensor([2, 0, 1]), 2)
    bad = frame.clone()
    bad[-1] = 0xA0  # low plane 1 0 1 -> the first count becomes 3
    with pytest.raises(ValueError, match="decoded count 3 > m=2"):
        counts.decode(bad)
    # radix, m = 2: an 8-bit code of 255 > 3**5 - 1
    frame = counts.encode(torch.tensor([2, 0, 1]), 2, "radix")
    bad = frame.clone()
    bad[11:] = 0x80
    with pytest.raises(ValueError, match="radix code 255 >= .* = 243"):
        counts.decode(bad)
    # radix padding counts must be zero: code 1 = [0, 0, 0, 0, 1], only 3 counts are real
    bad = frame.clone()
    bad[11:] = 0
    bad[-1] = 0x80
    with pytest.raises(ValueError, match="padding counts"):
        counts.decode(bad)
    bad = frame.clone()
    bad[10] = 9
    with pytest.raises(ValueError, match="packing code 0 or 1, got 9"):
        counts.decode(bad)
    for cut in (0, 10, 11, frame.numel() - 1):
        with pytest.raises(ValueError, match="truncated counts frame"):
            counts.decode(frame[:cut])


def test_empty_and_m_zero():
    for packing in counts.PACKINGS:
        out, used = counts.decode(counts.encode(torch.empty(0, dtype=torch.int64), 7, packing))
        assert out.numel() == 0 and used == 11
        frame = counts.encode(torch.zeros(10, dtype=torch.int64), 0, packing)
        assert frame.numel() == 11  # m = 0 needs no bits at all
        assert counts.decode(frame)[0].tolist() == [0] * 10


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 300).flatmap(
    lambda m: st.tuples(st.just(m), st.sampled_from(counts.PACKINGS),
                        st.lists(st.integers(0, m), max_size=200))))
def test_property_round_trip(case):
    m, packing, values = case
    frame = counts.encode(torch.tensor(values, dtype=torch.int64), m, packing)
    assert frame.numel() == counts.encoded_size(len(values), m, packing)
    assert counts.decode(frame)[0].long().tolist() == values


def test_few_million():
    n = 2_000_003
    x = torch.randint(0, 5, (n,), generator=torch.Generator().manual_seed(3))
    for packing in counts.PACKINGS:
        assert torch.equal(counts.decode(counts.encode(x, 4, packing))[0].long(), x)



@pytest.mark.parametrize("m", [2, 4, 8, 40])
def test_the_compiled_cpu_radix_loops_write_and_read_the_codes(monkeypatch, m):
    """From _jit.MIN_VALUES values (codes, unpacking) the CPU radix path composes the codes and
    splits them in numba's loops: the payload is the planes of each group's base-(m + 1)
    number written out here (a zero-padded last group; 8, 7, 16 and 11-bit codes), every count
    comes back, a code out of range and non-zero padding counts are still refused, and a
    process without numba writes the same bytes."""
    import sys

    from bitarray import bitarray

    from bitcomm.codecs import _counts_cpu, _jit

    calls = []
    for name in ("radix_codes", "radix_digits"):
        compiled = getattr(_counts_cpu, name)
        monkeypatch.setattr(_counts_cpu, name, lambda *a, f=compiled, k=name: calls.append(k)
                            or f(*a))
    g, b = counts.radix_group(m)
    n = g * _jit.MIN_VALUES + 1  # enough groups to unpack compiled, the last one padded
    x = torch.randint(0, m + 1, (n,), generator=torch.Generator().manual_seed(m))
    x[:g] = m  # the largest code
    values = x.tolist() + [0] * (-n % g)
    codes = [sum(c * (m + 1) ** (g - 1 - j) for j, c in enumerate(values[i:i + g]))
             for i in range(0, len(values), g)]
    want = b"".join(bitarray([(c >> p) & 1 for c in codes], endian="big").tobytes()
                    for p in range(b - 1, -1, -1))
    for dt in (torch.uint8, torch.int64):
        calls.clear()
        payload = counts.pack(x.to(dt), m, "radix")
        assert bytes(payload.numpy()) == want and calls == ["radix_codes"]
    calls.clear()
    assert torch.equal(counts.unpack(payload, n, m, "radix").long(), x)
    assert calls == ["radix_digits"]
    nb = (len(codes) + 7) // 8
    bad = payload.clone()
    bad[::nb] = 0xFF  # every plane's first byte: codes of all ones, 2**b - 1 >= (m + 1)**g
    with pytest.raises(ValueError, match="radix code"):
        counts.unpack(bad, n, m, "radix")
    padded = counts.pack(torch.cat([x, torch.tensor([1])]), m, "radix")
    with pytest.raises(ValueError, match="padding counts"):
        counts.unpack(padded, n, m, "radix")
    with monkeypatch.context() as mp:
        mp.setitem(sys.modules, "numba", None)  # `import numba` now fails
        calls.clear()
        assert bytes(counts.pack(x, m, "radix").numpy()) == want
        assert torch.equal(counts.unpack(payload, n, m, "radix").long(), x) and not calls

@needs_interpreter
def test_a_checked_pack_reuses_its_flag_until_a_count_is_out_of_range():
    """counts.pack on the Triton path checks the range in its kernel and reads the flag before
    it returns: the thread's flag is reused while clear (no zeroing launch a call), and after
    a count out of range (OverflowError) the next pack gets a zeroed flag and the numpy path's
    bytes."""
    c = torch.randint(0, 4, (1000,), generator=torch.Generator().manual_seed(2),
                      dtype=torch.uint8)
    want = counts.pack(c, 3)
    bad = c.clone()
    bad[7] = 9
    with forced("triton"):
        counts.pack(c, 3)
        zeros = []
        real = torch.zeros
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(torch, "zeros", lambda *a, **k: zeros.append(a) or real(*a, **k))
            for _ in range(2):
                assert torch.equal(counts.pack(c, 3), want)
        assert zeros == []
        with pytest.raises(OverflowError, match="got 9"):
            counts.pack(bad, 3)
        assert torch.equal(counts.pack(c, 3), want)
