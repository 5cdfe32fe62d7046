import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bitcomm.codecs import qsgd, sparse

from conftest import dispatched, forced, host_reads, unhex


def test_golden_worked_example():
    frame = sparse.encode(torch.tensor([5, 2]), torch.tensor([1.0, -2.0]), n=8)
    assert frame.tolist() == unhex(
        "08 00 00 00 00 00 00 00 | 02 00 00 00 00 00 00 00 | 00 | 02 00 00 00 05 00 00 00 |"
        "00 00 00 c0 00 00 80 3f")
    dense, used = sparse.decode(frame)
    assert dense.tolist() == [0, 0, -2, 0, 0, 1, 0, 0] and used == 33


@pytest.mark.parametrize("fmt", sparse.FORMATS)
def test_round_trip_and_size(fmt):
    g = torch.Generator().manual_seed(0)
    for n, k in ((0, 0), (1, 1), (10, 0), (9, 9), (1000, 17), (100_000, 1000)):
        idx = torch.randperm(n, generator=g)[:k]
        val = torch.randn(k, generator=g)
        if fmt == "mean":
            val = val.abs() + 0.1
        frame = sparse.encode(idx, val, n, sparse.Qsgd(seed=1) if fmt == "qsgd" else fmt)
        assert frame.numel() == sparse.encoded_size(n, k, fmt)
        dense, used = sparse.decode(frame)
        assert used == frame.numel() and dense.numel() == n
        ref = torch.zeros(n)
        ref[idx] = val
        if fmt == "fp32":
            assert torch.equal(dense, ref)
        elif fmt == "fp16":
            assert torch.equal(dense, ref.half().float())
        elif fmt == "qsgd":
            assert bool(((dense - ref).abs() <= val.abs().max() / 7 * 1.0001).all()) if k else True
            assert bool((dense[idx] * val >= 0).all())
        else:
            mean = float(val.double().mean()) if k else 0.0
            assert dense[idx].tolist() == pytest.approx([mean] * k, rel=1e-6)
            assert int((dense != 0).sum()) == k


def test_decode_adds_into_out_and_frames_chain():
    a = sparse.encode(torch.tensor([0, 3]), torch.tensor([1.0, 2.0]), 5)
    b = sparse.encode(torch.tensor([3, 4]), torch.tensor([10.0, -1.0]), 5, "fp16")
    buf = torch.cat([a, b])
    out = torch.ones(5)
    _, used = sparse.decode(buf, out=out)
    _, used2 = sparse.decode(buf[used:], out=out)
    assert used + used2 == buf.numel()
    assert out.tolist() == [2, 1, 1, 13, 0]
    idx, val, n, used3 = sparse.decode_entries(b)
    assert idx.tolist() == [3, 4] and val.tolist() == [10, -1] and n == 5 and used3 == used2


def test_large_n_uses_int64_indices_without_densifying():
    n = 1 << 31
    assert sparse.encoded_size(n, 3) == 17 + 3 * 8 + 3 * 4
    assert sparse.encoded_size(n - 1, 3) == 17 + 3 * 4 + 3 * 4
    frame = sparse.encode(torch.tensor([n - 1, 0, 5]), torch.tensor([1.0, 2.0, 3.0]), n)
    idx, val, got_n, used = sparse.decode_entries(frame)
    assert got_n == n and idx.tolist() == [0, 5, n - 1] and val.tolist() == [2, 3, 1]
    assert used == frame.numel() == sparse.encoded_size(n, 3)


def test_bad_input():
    with pytest.raises(ValueError, match=r"indices in \[0, 4\), got 4"):
        sparse.encode(torch.tensor([4]), torch.tensor([1.0]), 4)
    with pytest.raises(ValueError, match="got -1"):
        sparse.encode(torch.tensor([-1]), torch.tensor([1.0]), 4)
    with pytest.raises(ValueError, match="distinct indices, got 2 more than once"):
        sparse.encode(torch.tensor([2, 1, 2]), torch.tensor([1.0, 2.0, 3.0]), 4)
    with pytest.raises(ValueError, match="as many values as indices"):
        sparse.encode(torch.tensor([1]), torch.tensor([1.0, 2.0]), 4)
    with pytest.raises(ValueError, match="finite values"):
        sparse.encode(torch.tensor([1]), torch.tensor([float("nan")]), 4)
    for fmt in ("fp32", "mean"):  # finite in float64, inf on the wire's float32
        with pytest.raises(ValueError, match="finite values"):
            sparse.encode(torch.tensor([1]), torch.tensor([1e300], dtype=torch.float64), 4, fmt)
    with pytest.raises(OverflowError, match="fp16"):
        sparse.encode(torch.tensor([1]), torch.tensor([1e5]), 4, "fp16")
    with pytest.raises(ValueError, match="fmt in"):
        sparse.encode(torch.tensor([1]), torch.tensor([1.0]), 4, "bf16")
    with pytest.raises(TypeError, match="integer tensor"):
        sparse.encode(torch.tensor([1.0]), torch.tensor([1.0]), 4)
    with pytest.raises(ValueError, match="1-D of length 4"):
        sparse.decode(sparse.encode(torch.tensor([1]), torch.tensor([1.0]), 4), out=torch.ones(3))


def test_qsgd_values_check_their_entries_with_their_scales(path):
    """qsgd values: the entries' check and the qsgd block's scale check share one host read
    off the numpy path, and broken entries raise the entries' error first (a NaN value, which
    also breaks its bucket's scale, is named as a value)."""
    fmt = sparse.Qsgd(bits=4, bucket=2, seed=3)
    cases = [(torch.tensor([4]), torch.tensor([1.0]), r"indices in \[0, 4\), got 4"),
             (torch.tensor([2, 1, 2]), torch.ones(3), "distinct indices, got 2 more than once"),
             (torch.tensor([1, 3]), torch.tensor([1.0, float("nan")]), "finite values"),
             (torch.tensor([1]), torch.tensor([1e300], dtype=torch.float64), "finite values")]
    for idx, val, message in cases:
        with pytest.raises(ValueError, match=message):
            sparse.encode(idx, val, 4, fmt)
    idx, val = torch.tensor([3, 0, 2]), torch.tensor([0.5, -1.0, 2.0])
    with forced("numpy"):
        want = sparse.encode(idx, val, 4, fmt)
    assert torch.equal(sparse.encode(idx, val, 4, fmt), want)
    if path != "numpy":
        assert len(host_reads(lambda: sparse.encode(idx, val, 4, fmt))) == 1


def test_truncated_and_corrupt_frames():
    frame = sparse.encode(torch.tensor([1, 5, 7]), torch.tensor([1.0, 2.0, 3.0]), 10)
    for cut in (0, 16, 17, 28, frame.numel() - 1):
        with pytest.raises(ValueError, match="truncated sparse frame"):
            sparse.decode(frame[:cut])
    bad = frame.clone()
    bad[8] = 11  # k > n
    with pytest.raises(ValueError, match="0 <= k <= n=10, got k=11"):
        sparse.decode(bad)
    bad = frame.clone()
    bad[16] = 9
    with pytest.raises(ValueError, match="format code below 4, got 9"):
        sparse.decode(bad)
    bad = frame.clone()
    bad[21] = 1  # second index 5 -> 1: not increasing
    with pytest.raises(ValueError, match="strictly increasing"):
        sparse.decode(bad)
    bad = frame.clone()
    bad[25] = 10  # last index 7 -> 10 >= n
    with pytest.raises(ValueError, match=r"indices in \[0, 10\)"):
        sparse.decode(bad)
    bad = frame.clone()
    bad[-4:] = torch.tensor([0, 0, 0x80, 0x7F], dtype=torch.uint8)  # +inf value
    with pytest.raises(ValueError, match="finite fp32 values"):
        sparse.decode(bad)


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 500).flatmap(lambda n: st.tuples(
    st.just(n), st.lists(st.integers(0, n - 1), unique=True, max_size=min(n, 60)))),
    st.sampled_from(["fp32", "fp16"]))
def test_property_round_trip(case, fmt):
    n, indices = case
    val = torch.linspace(-3, 3, len(indices))
    frame = sparse.encode(torch.tensor(indices, dtype=torch.int64), val, n, fmt)
    idx, got, got_n, used = sparse.decode_entries(frame)
    assert got_n == n and used == frame.numel()
    order = sorted(range(len(indices)), key=lambda i: indices[i])
    assert idx.tolist() == [indices[i] for i in order]
    want = val[order] if fmt == "fp32" else val[order].half().float()
    assert torch.equal(got, want)


def test_one_host_read_for_all_checks():
    """encode reads its checks back once (none for the mean); decode once more than the header.

    On CUDA each read waits for the device, so these are the codec's synchronisations: counted
    on the torch path, the one a CUDA tensor takes without triton (the numpy path reads CPU
    tensors freely).
    """
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    idx = torch.tensor([7, 3, 900, 41])
    for fmt in ("fp32", "fp16", "mean"):
        with forced("torch"):
            hits = host_reads(lambda f=fmt: sparse.encode(idx, x[idx], 1000, f))
        assert len(hits) == 1, (fmt, hits)
    frame = sparse.encode(idx, x[idx], 1000, "fp32")
    with forced("torch"):
        hits = host_reads(lambda: sparse.decode_entries(frame))
    sites = {(f.rsplit("/", 1)[-1], line) for _, f, line in hits}
    assert len(sites) == 2 and any(f == "_frame.py" for f, _ in sites), hits  # header, rules


def test_encode_without_the_check_writes_the_same_frame_and_reads_nothing():
    # For entries a selector built (ascending, distinct, in range, finite): the checked frame's
    # bytes, without its sort and its host read.
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    idx = torch.tensor([3, 7, 41, 900])
    for fmt in ("fp32", "fp16", "mean"):
        checked = sparse.encode(idx, x[idx], 1000, fmt)
        with forced("torch"):
            hits = host_reads(lambda f=fmt: sparse.encode(idx, x[idx], 1000, f, check=False))
            assert hits == [] and torch.equal(
                sparse.encode(idx, x[idx], 1000, fmt, check=False), checked), fmt
    # unsorted entries are the caller's to avoid: check=False writes them as given
    frame = sparse.encode(idx.flip(0), x[idx.flip(0)], 1000, "fp32", check=False)
    with pytest.raises(ValueError, match="increasing"):
        sparse.decode(frame)


def test_wrong_inputs_get_the_documented_exception_types():
    with pytest.raises(OverflowError, match=r"n < 2\*\*63"):
        sparse.encode(torch.tensor([1]), torch.tensor([1.0]), 2**63)
    coo = torch.tensor([0.0, 2.0]).to_sparse()
    with pytest.raises(TypeError, match="dense"):
        sparse.encode(torch.tensor([1]), coo, 4)
    with pytest.raises(TypeError, match="meta"):
        sparse.encode(torch.tensor([1]), torch.ones(1, device="meta"), 4)


def test_a_mean_frame_without_entries_must_say_zero():
    frame = sparse.encode(torch.tensor([], dtype=torch.int64), torch.tensor([]), 4, "mean")
    assert sparse.decode(frame)[0].tolist() == [0.0] * 4
    bad = frame.clone()
    bad[-4:] = torch.tensor([0, 0, 0x80, 0x3F], dtype=torch.uint8)  # mean 1.0 with k = 0
    with pytest.raises(ValueError, match="k = 0 .* mean 0"):
        sparse.decode(bad)


def test_a_mean_of_zero_is_written_one_way():
    # The mean accumulates from +0, so the encoder writes +0 for values that are all +-0; a frame
    # with -0 would be a second frame for the same content, and is refused.
    for k in (0, 2):
        frame = sparse.encode(torch.arange(k), torch.tensor([-0.0] * k), 4, "mean")
        assert frame[-4:].tolist() == [0, 0, 0, 0]
        bad = frame.clone()
        bad[-1] = 0x80
        with pytest.raises(ValueError, match="mean"):
            sparse.decode(bad)


def test_qsgd_settings_travel_as_one_value_format():
    # qsgd's options belong to the qsgd value format, not to every call of the sparse codec
    idx, val, n = torch.tensor([7, 1, 4]), torch.tensor([0.5, -2.0, 1.25]), 10
    fmt = sparse.Qsgd(bits=2, bucket=8, scale="l2", seed=9)
    frame = sparse.encode(idx, val, n, fmt)
    inner = qsgd.encode(torch.tensor([-2.0, 1.25, 0.5]), 2, 8, scale="l2", seed=9)
    assert frame[17 + 3 * 4:].tolist() == inner.tolist()  # values in index order
    assert frame.numel() == sparse.encoded_size(n, 3, fmt) == 17 + 12 + inner.numel()
    # the name "qsgd" is the default settings
    assert sparse.encoded_size(n, 3, "qsgd") == sparse.encoded_size(n, 3, sparse.Qsgd())
    with pytest.raises(ValueError, match="bits"):
        sparse.Qsgd(bits=3)
    with pytest.raises(ValueError, match="bucket"):
        sparse.Qsgd(bucket=0)
    with pytest.raises(ValueError, match="scale"):
        sparse.Qsgd(scale="mean")
    with pytest.raises(TypeError, match="seed"):
        sparse.Qsgd(seed=1.5)
    with pytest.raises(TypeError):  # no qsgd options on the sparse codec's own signature
        sparse.encode(idx, val, n, "qsgd", bits=2)
    with pytest.raises(ValueError, match="fmt"):
        sparse.encode(idx, val, n, object())


def test_decode_all_gives_decode_entries_entries_and_errors(path):
    """Frames of k entries of n decode to decode_entries' entries on every path, with its
    errors; a frame whose header says another k or format is refused. Off the numpy path
    (CUDA's) the fp32, fp16 and qsgd frames' checks cost one host read for all of them."""
    g = torch.Generator().manual_seed(5)

    def frames_of(n, k, fmt, count=3):
        out = []
        for _ in range(count):
            idx = torch.randperm(n, generator=g)[:k].sort().values
            out.append(sparse.encode(idx, torch.randn(k, generator=g), n, fmt))
        return out

    for n, k, fmt in ((1, 1, "fp32"), (9, 4, "fp16"), (1000, 10, "fp32"), (70000, 7, "fp16"),
                      (50, 0, "fp32"), (300, 5, sparse.Qsgd(bits=4, bucket=2, seed=0))):
        frames = frames_of(n, k, fmt)
        got = sparse.decode_all(frames, n, k, fmt)
        for f, (idx, val) in zip(frames, got, strict=True):
            want_idx, want_val, _, _ = sparse.decode_entries(f, n=n)
            assert idx.dtype == torch.int64 and torch.equal(idx, want_idx)
            assert torch.equal(val.view(torch.int32), want_val.view(torch.int32))
        if path != "numpy" and k:
            reads = host_reads(lambda f=frames: sparse.decode_all(f, n, k, fmt))
            assert len(reads) == 1, reads
    good = frames_of(1000, 10, "fp32")
    unordered, outside, nan = good[0].clone(), good[1].clone(), good[2].clone()
    off = sparse.HEADER.size
    unordered[off:off + 8] = torch.tensor([5, 0, 0, 0, 5, 0, 0, 0], dtype=torch.uint8)
    outside[off + 36:off + 40] = torch.tensor([0xE8, 0x03, 0, 0], dtype=torch.uint8)  # 1000
    nan[off + 40:off + 44] = torch.tensor([0, 0, 0xC0, 0x7F], dtype=torch.uint8)
    cases = [([good[0], unordered], "strictly increasing"),
             ([outside], r"indices in \[0, 1000\)"),
             ([good[1], nan], "finite fp32"),
             ([good[0], good[1][:-1]], "truncated sparse frame"),
             ([frames_of(999, 10, "fp32", 1)[0]], "expected n=1000"),
             ([good[0], frames_of(1000, 11, "fp32", 1)[0]], "expected k=10"),
             ([frames_of(1000, 10, "fp16", 1)[0]], "expected format=0")]
    for group, message in cases:
        with pytest.raises(ValueError, match=message):
            sparse.decode_all(group, 1000, 10, "fp32")


def test_decode_all_of_qsgd_frames_refuses_what_decode_entries_refuses(path):
    """qsgd values: the headers, the indices and the qsgd blocks are checked together (off
    the numpy path with one host read), and a broken rule raises decode_entries' error."""
    fmt = sparse.Qsgd(bits=4, bucket=4, seed=0)
    g = torch.Generator().manual_seed(6)
    good = [sparse.encode(torch.randperm(1000, generator=g)[:9].sort().values,
                          torch.randn(9, generator=g), 1000, fmt) for _ in range(3)]
    off = sparse.HEADER.size
    q = off + 9 * 4  # the qsgd block: its header (14 bytes), 3 scales, then the codes
    unordered, outside, nan, pad = (good[i % 3].clone() for i in range(4))
    unordered[off:off + 8] = torch.tensor([5, 0, 0, 0, 5, 0, 0, 0], dtype=torch.uint8)
    outside[off + 32:off + 36] = torch.tensor([0xE8, 0x03, 0, 0], dtype=torch.uint8)  # 1000
    nan[q + 14:q + 18] = torch.tensor([0, 0, 0xC0, 0x7F], dtype=torch.uint8)
    pad[-1] |= 0x01  # 9 4-bit codes leave 4 padding bits
    cases = [([good[0], unordered], "strictly increasing"),
             ([outside, good[1]], r"indices in \[0, 1000\)"),
             ([good[2], nan], "finite scale"),
             ([pad], "padding"),
             ([good[0], sparse.encode(torch.arange(9), torch.randn(9), 999, fmt)],
              "expected n=1000")]
    for group, message in cases:
        with pytest.raises(ValueError, match=message):
            sparse.decode_all(group, 1000, 9, fmt)
    got = sparse.decode_all(good, 1000, 9, fmt)
    assert all(torch.equal(i, sparse.decode_entries(f, n=1000)[0])
               for f, (i, _) in zip(good, got, strict=True))


@pytest.mark.parametrize("n, size, fmt, want", [
    (1000, 17 + 10 * 8, "fp32", 10), (1000, 17 + 10 * 6, "fp16", 10),
    (1000, 17 + 10 * 4 + 4, "mean", 10), (1000, 17 + 4, "mean", 0), (1000, 17, "fp32", 0),
    (1000, 17 + 7, "fp32", None), (1000, 16, "fp32", None), (1000, 17, "mean", None),
    (3, 17 + 4 * 8, "fp32", None),  # 4 entries of a 3-vector
    ((1 << 31) + 1, 17 + 2 * 12, "fp32", 2),  # int64 indices
    (1000, 100, "qsgd", None),
    # qsgd values, bucket 4: 17 + 4k (indices) + 14 + 4 ceil(k / 4) (scales) + ceil(k / 2)
    (1000, 17 + 14, sparse.Qsgd(bucket=4), 0), (1000, 17 + 36 + 14 + 12 + 5, sparse.Qsgd(
        bucket=4), 9), (1000, 17 + 36 + 14 + 12 + 6, sparse.Qsgd(bucket=4), None),
    (8, 17 + 32 + 14 + 8 + 4, sparse.Qsgd(bucket=4), 8), (7, 17 + 32 + 14 + 8 + 4,
                                                         sparse.Qsgd(bucket=4), None),
])
def test_a_frames_size_says_how_many_entries_it_holds(n, size, fmt, want):
    assert sparse.entries_in(n, size, fmt) == want
    if want is not None:
        assert sparse.encoded_size(n, want, fmt) == size


def test_decode_all_of_qsgd_frames_of_any_size_on_every_path(path):
    """k=None with qsgd values: each frame's size says how many entries it holds, so off the
    numpy path one host read checks frames of every size with their qsgd blocks."""
    fmt = sparse.Qsgd(bits=2, bucket=3, seed=1)
    g = torch.Generator().manual_seed(9)
    frames = [sparse.encode(torch.randperm(500, generator=g)[:k].sort().values,
                            torch.randn(k, generator=g), 500, fmt) for k in (0, 1, 7, 17, 3)]
    got = sparse.decode_all(frames, 500, None, fmt)
    for f, (idx, val) in zip(frames, got, strict=True):
        want_idx, want_val, _, _ = sparse.decode_entries(f, n=500)
        assert idx.dtype == torch.int64 and torch.equal(idx, want_idx)
        assert torch.equal(val.view(torch.int32), want_val.view(torch.int32))
    if path != "numpy":
        assert len(host_reads(lambda: sparse.decode_all(frames, 500, None, fmt))) == 1
    broken = frames[3].clone()
    broken[sparse.HEADER.size:sparse.HEADER.size + 8] = torch.tensor([9, 0, 0, 0, 9, 0, 0, 0],
                                                                     dtype=torch.uint8)
    with pytest.raises(ValueError, match="strictly increasing"):
        sparse.decode_all([frames[1], broken], 500, None, fmt)
    with pytest.raises(ValueError, match="expected k=8, got k=7"):
        sparse.decode_all([frames[2]], 500, 8, fmt)


def _mixed_frames():
    g = torch.Generator().manual_seed(8)
    out = []
    for k, fmt in ((0, "fp32"), (3, "fp32"), (17, "fp32"), (5, "fp16"), (0, "fp16"),
                   (4, "mean"), (0, "mean"), (9, "mean")):
        idx = torch.randperm(500, generator=g)[:k].sort().values
        out.append((fmt, sparse.encode(idx, torch.randn(k, generator=g), 500, fmt)))
    return out


def test_decode_all_of_frames_of_any_size_on_every_path(path):
    """k=None: each frame holds what its size says; off the numpy path one host read checks
    the frames of every size together."""
    for fmt in ("fp32", "fp16", "mean"):
        frames = [f for form, f in _mixed_frames() if form == fmt]
        got = sparse.decode_all(frames, 500, None, fmt)
        for f, (idx, val) in zip(frames, got, strict=True):
            want_idx, want_val, _, _ = sparse.decode_entries(f, n=500)
            assert idx.dtype == torch.int64 and torch.equal(idx, want_idx)
            assert val.dtype == torch.float32 and torch.equal(val, want_val)
        if path != "numpy":
            reads = host_reads(lambda f=frames, m=fmt: sparse.decode_all(
                f, 500, None, m))
            assert len(reads) == 1, reads


def _mean_frame(idx, mean_bytes, n=500):
    return torch.tensor(list(sparse.HEADER.pack(n, len(idx), 3) + struct.pack(
        f"<{len(idx)}i", *idx) + mean_bytes), dtype=torch.uint8)


@pytest.mark.parametrize("frame, message", [
    (_mean_frame([1, 2], struct.pack("<f", float("inf"))), "finite mean"),
    (_mean_frame([], struct.pack("<f", 2.0)), "k = 0 to come with mean 0"),
    (_mean_frame([3], struct.pack("<f", -0.0)), "zero mean to be \\+0"),
    (_mean_frame([3, 3], struct.pack("<f", 1.0)), "strictly increasing"),
    (_mean_frame([500], struct.pack("<f", 1.0)), r"indices in \[0, 500\)"),
    (_mean_frame([1], struct.pack("<f", 1.0), n=501), "expected n=500"),
    (torch.cat([_mean_frame([1, 4], struct.pack("<f", 1.0))[:17],
                torch.tensor([9, 0, 0, 0], dtype=torch.uint8),
                _mean_frame([1, 4], struct.pack("<f", 1.0))[17:]]), "expected k=3, got k=2"),
])
def test_decode_all_of_any_size_refuses_what_decode_entries_refuses(path, frame, message):
    good = _mixed_frames()[5][1]
    with pytest.raises(ValueError, match=message):
        sparse.decode_all([good, frame], 500, None, "mean")


def test_decode_all_refuses_bytes_past_the_entries_and_another_format(path):
    fp32 = _mixed_frames()[1][1]
    with pytest.raises(ValueError, match="expected 41 bytes"):  # not a whole entry more
        sparse.decode_all([torch.cat([fp32, torch.zeros(3, dtype=torch.uint8)])], 500, None)
    with pytest.raises(ValueError, match="expected k=4, got k=3"):  # an entry more
        sparse.decode_all([torch.cat([fp32, torch.zeros(8, dtype=torch.uint8)])], 500, None)
    with pytest.raises(ValueError, match="expected format=1"):
        sparse.decode_all([fp32], 500, None, "fp16")


def test_frames_of_any_size_are_checked_together(path):
    """Off the numpy path the frames' headers, indices and values are gathered and checked at
    once: as many operations that launch a kernel for six frames as for two. A frame's first
    index may lie below the last frame's last one, but within a frame they increase, next to
    frames without entries too (at the start, between, at the end)."""
    def frame(idx, fmt="mean"):
        return sparse.encode(torch.tensor(idx, dtype=torch.int64),
                             torch.ones(len(idx)), 500, fmt)

    for fmt in ("mean", "fp32"):
        ok = [frame([], fmt), frame([7, 9], fmt), frame([2, 3, 400], fmt), frame([], fmt),
              frame([1], fmt), frame([], fmt)]
        got = sparse.decode_all(ok, 500, None, fmt)
        assert [i.tolist() for i, _ in got] == [[], [7, 9], [2, 3, 400], [], [1], []]
        assert [v.tolist() for _, v in got] == [[], [1.0, 1.0], [1.0] * 3, [], [1.0], []]
        bad = sparse.encode(torch.tensor([5, 6]), torch.ones(2), 500, fmt).clone()
        bad[17:21] = torch.tensor([6, 0, 0, 0], dtype=torch.uint8)  # 6, 6: not increasing
        for frames in ([*ok[:5], bad], [bad, *ok], [ok[1], bad, ok[5]]):
            with pytest.raises(ValueError, match="strictly increasing"):
                sparse.decode_all(frames, 500, None, fmt)
    if path == "numpy":
        return

    frames = [frame(list(range(r, 40 + r, 2))) for r in range(6)]
    counted = []
    for some in (frames[:2], frames):
        with dispatched() as ops:
            sparse.decode_all(some, 500, None, "mean")
        counted.append(len(ops))
    assert counted[0] == counted[1], counted


def test_checked_encode_sorts_shuffled_entries_on_either_side_of_numpys_sort():
    """A checked encode sorts its entries: numpy's sort below sparse._NUMPY_SORT_MAX indices
    (torch's CPU sort is 5x slower there), torch's from it. Either way the frame is that of
    the same entries given in ascending order, which are not sorted again, and a repeated
    index is refused."""
    g = torch.Generator().manual_seed(5)
    for k in (10_000, sparse._NUMPY_SORT_MAX - 1, sparse._NUMPY_SORT_MAX):
        n = 40 * k
        idx = torch.randperm(n, generator=g)[:k]
        val = torch.randn(k, generator=g)
        ascending = idx.sort()
        want = sparse.encode(ascending.values, val[ascending.indices], n, check=False)
        assert torch.equal(sparse.encode(idx, val, n), want), k
        repeated = idx.clone()
        repeated[k // 2] = repeated[k // 3]
        with pytest.raises(ValueError, match="distinct indices"):
            sparse.encode(repeated, val, n)
