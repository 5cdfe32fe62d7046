"""SparCML sparse streams: the frame, the dense switch, sums, concatenation and parts."""

import struct

import numpy as np
import pytest
import torch

from bitcomm.codecs import stream


def test_worked_example_sparse_frame():
    s = stream.from_entries(torch.tensor([2, 5]), torch.tensor([-2.0, 1.0]), 8)
    assert not s.dense and s.nnz == 2
    golden = bytes.fromhex("0800000000000000" "0200000000000000" "00" "0200000005000000"
                           "000000c00000803f")
    frame = stream.encode(s)
    assert bytes(frame.tolist()) == golden and stream.encoded_size(8, 2, False) == 33
    back, used = stream.decode(frame)
    assert used == 33 and torch.equal(back.indices, torch.tensor([2, 5]))
    assert torch.equal(back.to_dense(), torch.tensor([0, 0, -2.0, 0, 0, 1, 0, 0]))


def test_worked_example_dense_frame():
    s = stream.from_entries(torch.tensor([2, 3]), torch.tensor([-2.0, 1.0]), 4)
    assert s.dense and s.nnz == 4
    golden = bytes.fromhex("0400000000000000" "0400000000000000" "01" "00000000" "00000000"
                           "000000c0" "0000803f")
    assert bytes(stream.encode(s).tolist()) == golden
    back, used = stream.decode(torch.tensor(list(golden + b"\x99"), dtype=torch.uint8))
    assert used == 33 and back.dense
    assert torch.equal(back.values, torch.tensor([0, 0, -2.0, 1.0]))


@pytest.mark.parametrize("n, limit", [(1, 1), (2, 1), (3, 2), (4, 2), (5, 3), (1000, 500),
                                      (1 << 31, (1 << 33) // 12 + 1)])
def test_the_switch_is_where_pairs_stop_being_smaller(n, limit):
    # nnz pairs of (iw + 4) bytes against 4n dense bytes; iw = 4 below 2**31, 8 from there
    assert stream.sparse_limit(n) == limit
    width = 4 if n < 1 << 31 else 8
    assert (limit - 1) * (width + 4) < 4 * n <= limit * (width + 4)


def test_from_entries_switches_at_the_limit():
    n = 10  # limit 5
    four = stream.from_entries(torch.arange(4) * 2, torch.ones(4), n)
    five = stream.from_entries(torch.arange(5) * 2, torch.ones(5), n)
    assert not four.dense and five.dense
    assert torch.equal(five.to_dense(), torch.tensor([1.0, 0] * 5))
    assert stream.empty(0).dense and stream.from_entries(torch.empty(0, dtype=torch.int64),
                                                         torch.empty(0), 0).dense


@pytest.mark.parametrize("indices, values, message", [
    ([3, 1], [1.0, 2.0], "a decrease at position 1"),
    ([1, 1], [1.0, 2.0], "a duplicate at position 1"),
    ([1, 10], [1.0, 2.0], r"indices in \[0, 10\), got 10"),
    ([-1, 2], [1.0, 2.0], r"got -1"),
    ([1, 2], [1.0, float("nan")], "finite"),
    ([1, 2], [1.0], "as many values"),
])
def test_bad_entries_are_refused(indices, values, message):
    with pytest.raises(ValueError, match=message):
        stream.from_entries(torch.tensor(indices), torch.tensor(values), 10)


def test_bad_kinds_are_type_errors():
    with pytest.raises(TypeError):
        stream.from_entries(torch.tensor([1.0]), torch.tensor([1.0]), 10)
    with pytest.raises(TypeError):
        stream.from_entries(torch.tensor([1]), torch.tensor([1]), 10)


def _sparse(n, pairs):
    idx = torch.tensor(sorted(pairs), dtype=torch.int64)
    return stream.from_entries(idx, torch.tensor([float(pairs[i]) for i in sorted(pairs)]), n)


def test_add_merges_below_the_bound_and_adds_equal_indices():
    a, b = _sparse(20, {1: 1, 4: 2, 9: 3}), _sparse(20, {4: 10, 5: 20})
    s = stream.add(a, b)
    # |H1| + |H2| = 5 < 10: merged; index 4 in both adds; 4 pairs held
    assert not s.dense
    assert s.indices.tolist() == [1, 4, 5, 9] and s.values.tolist() == [1, 12, 20, 3]
    assert torch.equal(stream.add(b, a).values, s.values)


def test_add_densifies_on_the_bound_not_the_union():
    # limit 5 at n = 10: 3 + 2 pairs reach it although their union is 3
    a, b = _sparse(10, {1: 1, 2: 2, 3: 3}), _sparse(10, {1: 1, 2: 1})
    s = stream.add(a, b)
    assert s.dense and s.to_dense().tolist() == [0, 2, 3, 3, 0, 0, 0, 0, 0, 0]


def test_a_cancelled_entry_stays():
    s = stream.add(_sparse(20, {3: 2}), _sparse(20, {3: -2}))
    assert s.indices.tolist() == [3] and s.values.tolist() == [0.0]


def test_add_with_a_dense_stream_is_dense_and_symmetric_in_bits():
    g = torch.Generator().manual_seed(0)
    d = stream.from_dense(torch.randn(50, generator=g))
    sp = stream.from_entries(torch.tensor([0, 7, 49]), torch.randn(3, generator=g), 50)
    one, two = stream.add(d, sp), stream.add(sp, d)
    assert one.dense and torch.equal(one.values, two.values)
    expected = d.values.clone()
    expected[[0, 7, 49]] += sp.values
    assert torch.equal(one.values, expected)
    with pytest.raises(ValueError, match="same length"):
        stream.add(d, stream.empty(49))


def test_add_of_sparse_streams_matches_a_reference_to_the_bit():
    """Two sparse streams' sum on the numpy path: the union of their indices, each slot 0 plus
    the first stream's value plus the second's in float32 (so a lone -0.0 becomes +0.0, and a
    cancellation stays as +0.0), against a dict written here; empty operands too."""
    g = torch.Generator().manual_seed(7)
    for n, na, nb in ((1000, 40, 60), (1000, 0, 30), (1000, 30, 0), (1000, 0, 0),
                      (100_000, 5000, 3000), (50, 1, 1)):
        a_idx = torch.randperm(n, generator=g)[:na].sort().values
        b_idx = torch.cat([a_idx[: na // 2], torch.randperm(n, generator=g)[:nb - na // 2]])
        b_idx = torch.unique(b_idx)[:nb]
        a_val = torch.randint(-2, 3, (a_idx.numel(),), generator=g).float() / 4
        b_val = torch.randint(-2, 3, (b_idx.numel(),), generator=g).float() / 4
        a_val[a_val == 0] = -0.0
        a, b = stream.from_entries(a_idx, a_val, n), stream.from_entries(b_idx, b_val, n)
        want: dict[int, np.float32] = {}
        for idx, val in ((a_idx, a_val), (b_idx, b_val)):
            for i, v in zip(idx.tolist(), val.numpy(), strict=True):
                want[i] = np.float32(want.get(i, np.float32(0.0)) + v)
        s = stream.add(a, b)
        assert not s.dense
        assert s.indices.tolist() == sorted(want)
        expected = np.array([want[i] for i in sorted(want)], dtype=np.float32)
        assert s.values.numpy().view(np.int32).tolist() == expected.view(np.int32).tolist()


def test_add_all_sums_left_to_right():
    parts = [_sparse(100, {i: i + 1, 50: 1}) for i in range(5)]
    s = stream.add_all(parts)
    assert s.indices.tolist() == [0, 1, 2, 3, 4, 50] and s.values.tolist() == [1, 2, 3, 4, 5, 5]


def test_concat_offsets_the_parts_and_densifies_on_the_whole_length():
    a, b = _sparse(6, {1: 1}), _sparse(4, {0: 2})
    s = stream.concat([a, b])
    assert s.n == 10 and s.indices.tolist() == [1, 6] and s.values.tolist() == [1, 2]
    # 3 + 2 pairs reach the limit 5 of the whole 10
    c = stream.concat([_sparse(6, {0: 1, 2: 1, 4: 1}), _sparse(4, {0: 2, 3: 2})])
    assert c.dense and c.to_dense().tolist() == [1, 0, 1, 0, 1, 0, 2, 0, 0, 2]
    d = stream.concat([stream.from_dense(torch.ones(2)), _sparse(8, {7: 3})])
    assert d.dense and d.to_dense().tolist() == [1, 1, 0, 0, 0, 0, 0, 0, 0, 3]


def test_part_rebases_and_chooses_by_its_own_length():
    s = _sparse(100, {3: 1, 10: 2, 11: 3, 40: 4})
    p = stream.part(s, 10, 40)
    assert p.n == 30 and p.indices.tolist() == [0, 1] and p.values.tolist() == [2, 3]
    q = stream.part(s, 9, 12)  # 2 pairs in 3: dense
    assert q.dense and q.values.tolist() == [0, 2, 3]
    assert stream.part(s, 50, 50).n == 0
    parts = [stream.part(s, lo, hi) for lo, hi in ((0, 10), (10, 40), (40, 100))]
    assert torch.equal(stream.concat(parts).to_dense(), s.to_dense())
    with pytest.raises(ValueError, match="lo <= hi"):
        stream.part(s, 5, 4)


def _frame(n, nnz, dense, body=b""):
    return torch.tensor(list(struct.pack("<qqB", n, nnz, dense) + body), dtype=torch.uint8)


@pytest.mark.parametrize("frame, message", [
    (_frame(8, 4, 0, bytes(32)), "0 <= nnz < 4"),  # at the limit, a sparse frame is refused
    (_frame(8, 1, 0, struct.pack("<if", 8, 1.0)), "indices in"),
    (_frame(8, 2, 0, struct.pack("<iiff", 3, 3, 1.0, 1.0)), "duplicate"),
    (_frame(8, 1, 0, struct.pack("<if", 1, float("inf"))), "finite"),
    (_frame(8, 2, 0, struct.pack("<ii", 1, 2)), "truncated"),
    (_frame(2, 3, 1, bytes(8)), "nnz to be n=2"),
    (_frame(2, 2, 1, bytes(4)), "truncated"),
    (_frame(2, 2, 2, bytes(8)), "dense flag"),
    (_frame(-1, 0, 1), "n >= 0"),
])
def test_corrupt_frames_are_refused(frame, message):
    with pytest.raises(ValueError, match=message):
        stream.decode(frame)


def test_decode_allocates_no_more_than_the_frame_justifies():
    # a dense frame's length is backed by its bytes (checked before allocating); a sparse
    # header claiming a huge n without its bytes needs the caller's n
    with pytest.raises(ValueError, match="truncated"):
        stream.decode(_frame(1 << 40, 1 << 40, 1, bytes(16)))
    huge = _frame(1 << 40, 0, 0)
    with pytest.raises(ValueError, match="more than a 17-byte frame can justify"):
        stream.decode(huge)
    s, _ = stream.decode(huge, n=1 << 40)
    assert s.n == 1 << 40 and s.nnz == 0
    with pytest.raises(ValueError, match="expected n=5"):
        stream.decode(_frame(4, 4, 1, bytes(16)), n=5)


def test_wide_indices_above_2_31():
    n = (1 << 31) + 10
    s = stream.from_entries(torch.tensor([0, n - 1]), torch.tensor([1.0, 2.0]), n)
    frame = stream.encode(s)
    assert frame.numel() == 17 + 2 * 8 + 2 * 4
    back, _ = stream.decode(frame, n=n)
    assert back.indices.tolist() == [0, n - 1]


@pytest.mark.parametrize("n, size, want", [
    (8, 17 + 32, (8, True)),    # dense: 4n bytes of values
    (8, 17 + 3 * 8, (3, False)),  # 3 pairs of 8 bytes
    (8, 17, (0, False)),        # an empty sparse stream
    (0, 17, (0, True)),         # length 0 is dense
    (8, 17 + 4 * 8, (8, True)),  # 4 pairs would be at the limit: that size is the dense one
    (8, 17 + 5, None), (8, 16, None), (8, 17 + 5 * 8, None),
    ((1 << 31) + 10, 17 + 2 * 12, (2, False)),  # int64 indices above 2**31
])
def test_a_frames_size_fixes_its_layout(n, size, want):
    assert stream.layout(n, size) == want


def _streams_for_decode_all():
    return [_sparse(100, {3: 1.5, 10: -2.0, 99: 3.0}), stream.empty(100),
            stream.from_dense(torch.arange(100.0) - 50), _sparse(100, {0: 4.0})]


def test_decode_all_gives_decodes_streams_on_every_path(path):
    frames = [stream.encode(s) for s in _streams_for_decode_all()]
    got = stream.decode_all(frames, 100)
    for s, f, g in zip(_streams_for_decode_all(), frames, got, strict=True):
        d, _ = stream.decode(f, n=100)
        assert g.n == 100 and g.dense == s.dense == d.dense
        assert torch.equal(g.values, s.values)
        if not s.dense:
            assert torch.equal(g.indices, s.indices)
    assert stream.decode_all([], 100) == []
    zero = stream.decode_all([stream.encode(stream.empty(0))], 0)[0]
    assert zero.n == 0 and zero.dense and zero.values.numel() == 0


@pytest.mark.parametrize("frame, message", [
    (_frame(9, 1, 0, struct.pack("<if", 2, 1.0)), "expected n=8"),
    (_frame(8, 2, 0, struct.pack("<if", 2, 1.0)), "truncated"),  # the header claims 2 pairs
    (_frame(8, 8, 0, bytes(32)), "0 <= nnz < 4"),  # the dense size with a sparse flag
    (_frame(8, 8, 2, bytes(32)), "dense flag"),
    (_frame(8, 1, 0, struct.pack("<if", 8, 1.0)), "indices in"),
    (_frame(8, 1, 0, struct.pack("<if", -1, 1.0)), "indices in"),
    (_frame(8, 2, 0, struct.pack("<iiff", 3, 2, 1.0, 1.0)), "decrease"),
    (_frame(8, 1, 0, struct.pack("<if", 1, float("nan"))), "finite"),
    (_frame(8, 8, 1, struct.pack("<8f", *[0.0] * 7, float("inf"))), "finite"),
    (_frame(8, 0, 0, bytes(3)), "expected 17 bytes"),  # bytes past the stream
    (_frame(8, 1, 0, struct.pack("<if", 1, 1.0) + bytes(8)), "expected 25 bytes"),
])
def test_decode_all_refuses_what_decode_refuses_on_every_path(path, frame, message):
    good = stream.encode(_sparse(8, {1: 2.0}))
    with pytest.raises(ValueError, match=message):
        stream.decode_all([good, frame], 8)


def test_split_gives_each_part_with_one_search(path):
    s = _sparse(100, {3: 1, 10: 2, 11: 3, 40: 4, 99: 5})
    bounds = [(0, 10), (10, 40), (9, 12), (40, 100), (50, 50), (0, 100)]
    for got, (lo, hi) in zip(stream.split(s, bounds), bounds, strict=True):
        want = stream.part(s, lo, hi)
        assert got.n == want.n == hi - lo and got.dense == want.dense
        assert torch.equal(got.to_dense(), s.to_dense()[lo:hi])
    dense = stream.from_dense(torch.arange(10.0))
    assert [p.values.tolist() for p in stream.split(dense, [(0, 3), (3, 10)])] == [
        [0, 1, 2], [3, 4, 5, 6, 7, 8, 9]]
    assert stream.split(s, []) == []
    with pytest.raises(ValueError, match="lo <= hi"):
        stream.split(s, [(0, 10), (5, 4)])


def test_decode_all_reads_the_host_once_off_the_numpy_path():
    from conftest import forced, host_reads

    frames = [stream.encode(s) for s in _streams_for_decode_all()]
    with forced("torch"):
        reads = host_reads(lambda: stream.decode_all(frames, 100))
        assert len(reads) == 1, reads
        per_frame = host_reads(lambda: [stream.decode(f, n=100) for f in frames])
    # decode reads each header (a copy and a view: two calls) and each frame's rules
    assert len(per_frame) > 2 * len(frames)


def test_add_all_off_the_numpy_path_is_pairwise_add_with_one_read():
    """Off the numpy path (CUDA) three or more sparse streams merge with one host read at the
    end; the sum is the pairwise one from the left, to the bit (-0.0 and cancellations too)
    and dense from the same sum on: never, at the first sum, at a later one, or on the bound
    although the union stays below it."""
    from conftest import forced, host_reads

    g = torch.Generator().manual_seed(5)

    def random_streams(n, count, nnz):
        out = []
        for _ in range(count):
            idx = torch.randperm(n, generator=g)[:nnz].sort().values
            val = torch.randint(-3, 4, (nnz,), generator=g).float() / 2  # ties, zeros
            val[val == 0] = -0.0
            out.append(stream.from_entries(idx, val, n))
        return out

    # n = 10: sparse below 5 pairs. 2 + 2 and then 2 + 1 pairs stay below, the sum cancels;
    # 2 + 3 pairs reach 5 at the second sum although the union is 3
    cancels = [_sparse(10, {1: 1, 2: 2}), _sparse(10, {1: 1, 2: 1}), _sparse(10, {2: -3})]
    on_bound = cancels[:2] + [_sparse(10, {1: 1, 2: 1, 3: 1})]
    cases = [random_streams(1000, 3, 40), random_streams(1000, 8, 30),  # stays sparse
             random_streams(100, 3, 30),  # dense at the first sum (30 + 30 >= 50)
             random_streams(100, 6, 12),  # dense at a later sum
             random_streams(1000, 2, 40), random_streams(1000, 3, 1000 // 4),  # two; overlaps
             [stream.empty(1000), *random_streams(1000, 2, 30), stream.empty(1000)],
             [stream.empty(1000)] * 3, cancels, on_bound]
    for streams in cases:
        with forced("numpy"):
            want = streams[0]
            for s in streams[1:]:
                want = stream.add(want, s)
        with forced("torch"):
            got = stream.add_all(streams)
            reads = host_reads(lambda s=streams: stream.add_all(s))
        assert len(reads) == 1, reads
        assert got.dense == want.dense and got.n == want.n
        assert torch.equal(got.values.view(torch.int32), want.values.view(torch.int32))
        if not got.dense:
            assert torch.equal(got.indices, want.indices)
    with forced("torch"):
        kept, dense = stream.add_all(cancels), stream.add_all(on_bound)
    assert kept.indices.tolist() == [1, 2] and kept.values.tolist() == [2.0, 0.0]
    assert dense.dense and dense.values.tolist() == [0, 3, 4, 1, 0, 0, 0, 0, 0, 0]
    with forced("torch"), pytest.raises(ValueError, match="same length"):
        stream.add_all([_sparse(10, {1: 1}), _sparse(10, {2: 1}), _sparse(11, {3: 1})])
