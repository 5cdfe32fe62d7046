"""SparCML's sparse allreduces: exact sums, bit-identical ranks, bytes, the paper's bounds."""

import math
import re

import pytest
import torch

from bitcomm.codecs import stream
from bitcomm.collectives import sparcml
from bitcomm.comm import run_local

from conftest import forced, host_reads, needs_interpreter

SSAR = ("ssar_recursive_double", "ssar_split_allgather")
ALL = (*SSAR, "dsar_split_allgather", "stream_allgather")
SIZES = (1, 2, 3, 4, 5, 6, 7, 8, 9, 16)


def index_sets(kind, size, n, k, seed):
    """Sorted index sets of ``k`` entries per rank (fewer where noted), by pattern."""
    g = torch.Generator().manual_seed(seed)
    if kind == "overlapping":  # every rank the same set
        common = torch.randperm(n, generator=g)[:k].sort().values
        return [common.clone() for _ in range(size)]
    if kind == "disjoint":  # rank r takes k of r, r + size, ..., spread over [0, n)
        out = []
        for r in range(size):
            mine = torch.arange(n)[r::size]
            step = max(1, mine.numel() // max(k, 1))
            out.append(mine[::step][:k])
        return out
    if kind == "empty-ranks":  # even ranks hold nothing
        return [torch.randperm(n, generator=g)[:k].sort().values if r % 2 else
                torch.empty(0, dtype=torch.int64) for r in range(size)]
    return [torch.randperm(n, generator=g)[:k].sort().values for _ in range(size)]


def integer_values(sets, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(-9, 10, (len(ix),), generator=g).float() for ix in sets]


def brute_sum(sets, values, n):
    total = torch.zeros(n, dtype=torch.float64)
    for ix, v in zip(sets, values, strict=True):
        total[ix] += v.double()
    return total


def run(name, sets, values, n, **kw):
    fn = getattr(sparcml, name)

    def job(c):
        c.counters.reset()
        out = fn(c, sets[c.rank], values[c.rank], n, **kw)
        return out, c.counters.total_sent

    return run_local(job, len(sets), timeout=60)


def frame_bytes(out):
    if isinstance(out, torch.Tensor):
        return bytes(out.contiguous().view(torch.uint8).tolist())
    return bytes(stream.encode(out).tolist())


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("name", ALL)
def test_exact_sum_bit_identical_and_the_bytes_formula(name, size):
    # 1001 is divisible by no size above 1 but 7; fewer cases at many ranks, for time
    lengths = (1, 7, 100, 1001) if size < 8 else (7, 1001)
    for n in lengths:
        for density in (0.0, 0.01, 0.1, 0.3, 0.6, 1.0) if size < 8 else (0.0, 0.01, 0.3, 1.0):
            k = min(n, math.ceil(density * n))
            for kind in ("random", "overlapping", "disjoint", "empty-ranks"):
                seed = size * 1000 + n + int(density * 100)
                sets = index_sets(kind, size, n, k, seed)
                values = integer_values(sets, seed)
                results = run(name, sets, values, n)
                want = brute_sum(sets, values, n)
                first = frame_bytes(results[0][0])
                formula = getattr(sparcml, name + "_bytes")(sets, n)
                for rank, (out, sent) in enumerate(results):
                    dense = out if isinstance(out, torch.Tensor) else out.to_dense()
                    # integer-valued floats: any summation order gives the exact sum
                    assert torch.equal(dense.double(), want), (name, size, n, density, kind)
                    assert frame_bytes(out) == first  # the same bits, and the same frame
                    assert sent == formula[rank], (name, size, n, density, kind, rank)


@pytest.mark.parametrize("name", ALL)
def test_random_floats_within_rounding(name):
    size, n = 6, 5000
    sets = index_sets("random", size, n, 300, 7)
    g = torch.Generator().manual_seed(1)
    values = [torch.randn(len(ix), generator=g) for ix in sets]
    results = run(name, sets, values, n)
    want = brute_sum(sets, values, n)
    outs = [o if isinstance(o, torch.Tensor) else o.to_dense() for o, _ in results]
    assert torch.allclose(outs[0].double(), want, atol=1e-5)
    assert all(torch.equal(o.view(torch.int32), outs[0].view(torch.int32)) for o in outs)


def test_ssar_results_switch_to_dense_once_the_sum_fills_in():
    n = 1000
    sparse_sets = index_sets("overlapping", 4, n, 50, 0)  # the sum keeps 50 entries
    filled = index_sets("disjoint", 4, n, 200, 0)  # the sum has 800 >= 500
    for name in (*SSAR, "stream_allgather"):
        out, _ = run(name, sparse_sets, integer_values(sparse_sets, 0), n)[0]
        assert not out.dense and out.nnz == 50
        out, _ = run(name, filled, integer_values(filled, 0), n)[0]
        assert out.dense


# -- the paper's bounds on the bytes (Section 5.3), P a power of two, k entries per rank ----

PAIR = 8  # an int32 index and a float32 value
OVERHEAD = 8 + stream.HEADER.size  # a stream message: its length, then the frame's header


def test_recursive_doubling_sends_between_log2p_k_and_p_minus_1_k_pairs():
    size, n, k = 8, 100_000, 500
    for kind, pairs in (("overlapping", 3 * k), ("disjoint", (size - 1) * k), ("random", None)):
        sets = index_sets(kind, size, n, k, 3)
        for r, (_, sent) in enumerate(run("ssar_recursive_double", sets,
                                          integer_values(sets, 3), n)):
            payload = sent - 24 * (size - 1) - 3 * OVERHEAD  # 3 rounds
            assert payload % PAIR == 0
            if pairs is not None:  # the two extremes reach the bounds
                assert payload == pairs * PAIR, (kind, r)
            assert 3 * k * PAIR <= payload <= (size - 1) * k * PAIR


def test_split_allgather_sends_between_2_p_minus_1_over_p_k_and_p_k_pairs():
    # n = P * k * 16: the disjoint sets put exactly k / P of each rank's entries in each range
    size, n, k = 8, 8 * 800 * 16, 800
    low, high = 2 * (size - 1) / size * k, size * k
    messages = (size - 1) + 3  # one part to each other rank, then 3 allgather rounds
    for kind in ("random", "overlapping", "disjoint"):
        sets = index_sets(kind, size, n, k, 4)
        for _, sent in run("ssar_split_allgather", sets, integer_values(sets, 4), n):
            payload = sent - 24 * (size - 1) - messages * OVERHEAD
            assert payload % PAIR == 0
            # the lower bound needs every range's share of the k to be k / P exactly
            assert 0.9 * low * PAIR <= payload <= high * PAIR, kind


def test_dsar_sends_the_split_plus_p_minus_1_over_p_of_the_dense_vector():
    size, n, k = 8, 8000, 100
    sets = index_sets("random", size, n, k, 5)
    for rank, (_, sent) in enumerate(run("dsar_split_allgather", sets,
                                         integer_values(sets, 5), n)):
        split = sum(OVERHEAD + PAIR * int(((sets[rank] >= lo) & (sets[rank] < hi)).sum())
                    for j, (lo, hi) in enumerate(sparcml.ranges(n, size)) if j != rank)
        assert sent == 24 * (size - 1) + split + 4 * n * (size - 1) // size


def test_the_fold_sends_the_left_out_ranks_their_result():
    # 6 ranks: 0 and 2 sit out; they send their stream once and receive the result once
    size, n = 6, 1000
    sets = index_sets("random", size, n, 10, 6)
    res = run("ssar_recursive_double", sets, integer_values(sets, 6), n)
    frame = stream.encode(res[0][0]).numel()
    for r in (0, 2):
        assert res[r][1] == 24 * (size - 1) + OVERHEAD + PAIR * 10
    # rank 1 receives rank 0's stream, and at the end sends it the 4 ranks' result
    assert res[1][1] - 24 * (size - 1) >= 8 + frame


# -- quantised DSAR ------------------------------------------------------------------------


def test_quantised_dsar_is_identical_everywhere_bounded_and_unbiased():
    size, n, bits, bucket = 5, 3000, 4, 128
    sets = index_sets("random", size, n, 600, 8)
    g = torch.Generator().manual_seed(2)
    values = [torch.randn(len(ix), generator=g) for ix in sets]
    exact = brute_sum(sets, values, n).float()
    levels = 2 ** (bits - 1) - 1
    mean = torch.zeros(n, dtype=torch.float64)
    seeds = 100
    for seed in range(seeds):
        results = run("dsar_split_allgather", sets, values, n, bits=bits, bucket=bucket,
                      seed=seed)
        outs = [o for o, _ in results]
        assert all(torch.equal(o.view(torch.int32), outs[0].view(torch.int32)) for o in outs)
        if seed == 0:
            # each owner's buckets: within one level of the bucket's max |x|
            for lo, hi in sparcml.ranges(n, 4):
                for b in range(lo, hi, bucket):
                    e = min(b + bucket, hi)
                    scale = float(exact[b:e].abs().max())
                    assert float((outs[0][b:e] - exact[b:e]).abs().max()) <= scale / levels + 1e-6
            formula = sparcml.dsar_split_allgather_bytes(sets, n, bits=bits, bucket=bucket)
            assert [sent for _, sent in results] == formula
        mean += outs[0].double()
    mean /= seeds
    # unbiased: the mean over seeds closes in on the exact sum (std of one level / sqrt(100))
    scale = exact.abs().max().item()
    assert float((mean - exact.double()).abs().max()) < 0.35 * scale / levels
    assert float((mean - exact.double()).abs().mean()) < 0.05 * scale / levels


# -- bad input -----------------------------------------------------------------------------


def _bad(size, bad_rank, make_bad, name, **kw):
    fn = getattr(sparcml, name)

    def job(c):
        ix, v, n = torch.tensor([1, 4, 6]), torch.tensor([1.0, 2.0, 3.0]), 10
        if c.rank == bad_rank:
            ix, v, n = make_bad(ix, v, n)
        return fn(c, ix, v, n, **kw)

    return run_local(job, size, return_exceptions=True, timeout=20)


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("make_bad, kind, message", [
    (lambda ix, v, n: (torch.tensor([4, 1, 6]), v, n), ValueError, "a decrease at position 1"),
    (lambda ix, v, n: (torch.tensor([1, 4, 4]), v, n), ValueError, "a duplicate at position 2"),
    (lambda ix, v, n: (torch.tensor([1, 4, 10]), v, n), ValueError, r"in \[0, 10\), got 10"),
    (lambda ix, v, n: (ix, v, 11), ValueError, r"same length n on every rank, got \[10, 10, 11"),
    (lambda ix, v, n: (ix, torch.tensor([1.0, float("inf"), 3.0]), n), ValueError,
     r"NaN or inf on rank\(s\) \[2\]"),
    (lambda ix, v, n: (ix, v.to(torch.int32), n), TypeError, r"rank\(s\) \[2\]"),
    (lambda ix, v, n: (ix.float(), v, n), TypeError, r"rank\(s\) \[2\]"),
    (lambda ix, v, n: (ix, v[:2], n), ValueError, "as many values as indices"),
    (lambda ix, v, n: (ix.tolist(), v, n), TypeError, "indices to be an integer torch.Tensor"),
    (lambda ix, v, n: (ix, v, 10.0), TypeError, "n to be an int, got float"),
    (lambda ix, v, n: (ix, v, True), TypeError, "n to be an int, got bool"),
    (lambda ix, v, n: (ix, v, -1), ValueError, "n >= 0, got -1"),
])
def test_bad_input_raises_on_every_rank(name, make_bad, kind, message):
    out = _bad(3, 2, make_bad, name)
    # every rank raises the same type naming rank 2; rank 2 also says what is wrong
    assert all(isinstance(e, kind) for e in out), out
    assert re.search(message, str(out[2])), out[2]
    assert all("[2]" in str(e) for e in out[:2]) or "[10, 10, 11]" in str(out[0]), out


def test_lengths_that_differ_are_named_by_rank_and_one_that_is_no_length_as_none():
    def job(c):
        n = [10, 11, 10.0][c.rank]
        return sparcml.ssar_split_allgather(c, torch.tensor([1, 4]), torch.ones(2), n)

    out = run_local(job, 3, return_exceptions=True, timeout=20)
    assert all(isinstance(e, ValueError) and "got [10, 11, None] (by rank)" in str(e)
               for e in out), out


def test_bad_quantisation_settings_raise_on_every_rank():
    out = _bad(3, 1, lambda ix, v, n: (ix, v, n), "dsar_split_allgather", bits=3)
    assert all(isinstance(e, ValueError) and "bits" in str(e) for e in out), out


def test_an_announced_length_is_bounded_before_anything_is_allocated():
    def length(v):
        return torch.tensor(list(v.to_bytes(8, "little", signed=True)), dtype=torch.uint8)

    # a stream of length 10 takes at most its dense frame: 17 + 40 bytes
    assert sparcml._read_length(length(57), 1, 10) == 57
    for bad in (3, 58, 1 << 50, -1):
        with pytest.raises(ValueError, match=f"announced a stream frame of {bad} bytes"):
            sparcml._read_length(length(bad), 1, 10)


def test_fold_and_ranges():
    f = [sparcml.Fold(r, 6) for r in range(6)]
    assert f[0].pof2 == 4 and f[0].rem == 2
    assert [x.vrank for x in f] == [None, 0, None, 1, 2, 3]
    assert [f[0].real(v) for v in range(4)] == [1, 3, 4, 5]
    assert sparcml.ranges(10, 4) == [(0, 2), (2, 4), (4, 6), (6, 10)]
    assert sparcml.ranges(3, 4) == [(0, 0), (0, 0), (0, 0), (0, 3)]


# -- the choice ------------------------------------------------------------------------------


def test_choose_prices_each_algorithm_by_alpha_and_beta():
    # 2 ranks, n = 1000, k = 10. Messages (alpha = 1, beta = 0): a stream is 2 (its length,
    # its frame); recursive doubling 1 round; the allgather 1 stream per other rank; the split
    # 1 stream, then 1 round of streams (SSAR) or of a dense range (DSAR); allreduce 2 log2 P
    c = sparcml.choose(1000, 10, 2, alpha=1.0, beta=0.0)
    assert c.seconds == {"ssar_recursive_double": 2, "ssar_split_allgather": 4,
                         "dsar_split_allgather": 3, "stream_allgather": 2, "allreduce": 2}
    # bytes (alpha = 0, beta = 1): a stream of m pairs is 8 + 17 + 8m; E[K] = 19.9
    c = sparcml.choose(1000, 10, 2, alpha=0.0, beta=1.0)
    assert c.expected_nnz == pytest.approx(1000 * (1 - 0.99 ** 2))
    want = {"ssar_recursive_double": 105, "stream_allgather": 8 + 105,
            "ssar_split_allgather": 65 + 25 + 8 * 19.9 / 2, "dsar_split_allgather": 65 + 2000,
            "allreduce": 4000}
    assert c.seconds == pytest.approx(want)
    assert c.algorithm == "ssar_recursive_double"


@pytest.mark.parametrize("k, beta, algorithm", [
    (100, 1 / 12.5e9, "ssar_recursive_double"),  # small data: latency-optimal
    (50_000, 1 / 12.5e6, "dsar_split_allgather"),  # E[K] = 56% of n: fills in
    (250_000, 1 / 12.5e9, "dsar_split_allgather"),
    (600_000, 1 / 12.5e9, "allreduce"),  # dense input: the dense allreduce
])
def test_choose_follows_the_papers_orderings(k, beta, algorithm):
    assert sparcml.choose(1_000_000, k, 16, beta=beta).algorithm == algorithm


@pytest.mark.parametrize("algorithm", ["auto", *sparcml.ALGORITHMS])
def test_sparse_allreduce_runs_the_named_or_chosen_algorithm(algorithm):
    size, n = 5, 400
    sets = index_sets("random", size, n, 4, 9)
    sets[3] = sets[3][:1]  # ranks differ in k: the choice uses the largest
    values = integer_values(sets, 9)

    def job(c):
        return sparcml.sparse_allreduce(c, sets[c.rank], values[c.rank], n,
                                        algorithm=algorithm)

    out = run_local(job, size, timeout=60)
    want = brute_sum(sets, values, n)
    assert all(torch.equal(o.double(), want) for o, _ in out)
    if algorithm == "auto":
        c = out[0][1]
        assert all(o[1] == c for o in out)  # the same choice on every rank
        assert c.k == 4 and c.algorithm == sparcml.choose(n, 4, size).algorithm
    else:
        assert all(ch is None for _, ch in out)
    with pytest.raises(ValueError, match="expected algorithm 'auto' or one of"):
        run_local(lambda c: sparcml.sparse_allreduce(c, sets[0], values[0], n,
                                                     algorithm="ring"), 1)


@pytest.mark.parametrize("density", [0.001, 0.01, 0.05, 0.25])
def test_the_experiments_inputs_fill_in_as_e_k_says(density):
    """The registry's sparse inputs (each rank's top share of randn) have nearly uniform
    indices: their union, the reduced result's support, is E[K] = n(1 - (1 - d)^P) to 2%."""
    from bitcomm.collectives import registry

    n, size = 1 << 16, 16
    union = torch.zeros(n, dtype=torch.bool)
    for r in range(size):
        idx, _ = registry.sparse_input(registry.standard_input(0, r, n), density)
        union[idx] = True
    k = idx.numel()
    assert int(union.sum()) == pytest.approx(sparcml.expected_nnz(n, k, size), rel=0.02)


@pytest.mark.parametrize("name", ALL)
def test_without_the_agreement_bad_entries_still_raise_here(name):
    """check=False: the rank's own entries are checked once, non-finite values included."""
    fn = getattr(sparcml, name)
    for ix, v, message in [(torch.tensor([1, 3]), torch.tensor([1.0, float("nan")]), "finite"),
                           (torch.tensor([3, 1]), torch.ones(2), "decrease"),
                           (torch.tensor([1, 10]), torch.ones(2), "indices in")]:
        with pytest.raises(ValueError, match=message):
            run_local(lambda c, ix=ix, v=v: fn(c, ix, v, 10, check=False), 1)


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("path", ["torch", pytest.param(
    "triton", marks=[needs_interpreter, pytest.mark.triton])])
def test_the_codec_reads_the_host_once_per_round_on_a_device(size, path):
    """On CUDA each host read waits for the device. The stream codec reads the rank's entries'
    rules once, each received round's frames once together (not each header and each frame's
    rules), a split's bounds once, and the size of a sum of sparse streams (two, the received
    parts or every rank's stream) once at its end, with the check of the frames it adds
    (CPU tensors on the paths a CUDA tensor takes)."""
    import inspect

    from bitcomm.codecs import _frame

    lines, first = inspect.getsourcelines(_frame.read_checked)
    shared = range(first, first + len(lines))  # the read a sum shares with its frames' check
    n = 4000
    sets = index_sets("random", size, n, 200, 5)
    values = integer_values(sets, 5)
    rounds = size.bit_length() - 1
    # per rank: its entries, then the rounds of frames it receives (recursive doubling reads
    # each frame's check with its merge's size); the split-allgathers split (one search, one
    # round of received parts: SSAR checks them with their sum) before their rounds, and
    # DSAR's rounds carry dense ranges, which are not streams; the allgather checks every
    # rank's frame with their sum
    per_rank = {"ssar_recursive_double": 1 + rounds, "ssar_split_allgather": 3 + rounds,
                "dsar_split_allgather": 3, "stream_allgather": 2}
    # besides the agreement's two (the input's finiteness, every rank's record), the frame
    # lengths, in host memory here (over NCCL each is a wait): one per frame received from one
    # peer, one for all of an allgather's
    lengths = {"ssar_recursive_double": rounds, "ssar_split_allgather": size - 1 + rounds,
               "dsar_split_allgather": size - 1, "stream_allgather": 1}
    for name, want in per_rank.items():
        with forced("numpy"):
            expect = run(name, sets, values, n)
        with forced(path):
            reads = host_reads(lambda name=name: run(name, sets, values, n))
            got = run(name, sets, values, n)
        in_codec = [r for r in reads if r[1].endswith("stream.py")
                    or r[1].endswith("_frame.py") and r[2] in shared]
        assert len(in_codec) == size * want, (name, in_codec)
        rest = [r for r in reads if r not in in_codec]
        assert len(rest) == size * (2 + lengths[name]), (name, rest)
        for (a, _), (b, _) in zip(got, expect, strict=True):
            assert frame_bytes(a) == frame_bytes(b)


@pytest.mark.parametrize("n", [4000, 4001])
def test_quantised_dsar_checks_its_scales_and_the_gathered_frames_with_one_read(n):
    """The owner's encoder flags its scales, the gathered QSGD frames (one per range, of one
    or two lengths) are flagged too, and one host read at the end checks them all."""
    size = 4
    sets = index_sets("random", size, n, 200, 6)
    values = [v + 0.5 for v in integer_values(sets, 6)]
    with forced("numpy"):
        expect = run("dsar_split_allgather", sets, values, n, bits=4, seed=3)
    with forced("torch"):
        reads = host_reads(lambda: run("dsar_split_allgather", sets, values, n,
                                                    bits=4, seed=3, check=False))
        got = run("dsar_split_allgather", sets, values, n, bits=4, seed=3)
    quantised = [r for r in reads if not r[1].endswith(("stream.py", "sparcml.py"))]
    assert len(quantised) == size, quantised
    for (a, _), (b, _) in zip(got, expect, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("path", ["numpy", "torch"])
def test_quantised_dsar_raises_an_overflowed_range_on_every_rank(path):
    """check=False: two ranks' finite values sum to inf in one range. Its owner's scale is not
    finite, yet its frame goes out, and every rank raises instead of waiting for it."""
    n = 400
    sets = [torch.tensor([5]), torch.tensor([5]), torch.tensor([300]), torch.tensor([300])]
    values = [torch.tensor([3e38]), torch.tensor([3e38]), torch.ones(1), torch.ones(1)]
    with forced(path):
        out = run_local(lambda c: sparcml.dsar_split_allgather(
            c, sets[c.rank], values[c.rank], n, bits=4, seed=1, check=False), 4,
            return_exceptions=True, timeout=20)
    assert all(isinstance(e, ValueError) for e in out), out
    owner = [r for r, e in enumerate(out) if "non-finite max scale inf" in str(e)]
    assert len(owner) == 1, out
    assert all("corrupt qsgd frame: expected a finite scale" in str(e)
               for r, e in enumerate(out) if r != owner[0]), out


@pytest.mark.parametrize("name, size", [("ssar_recursive_double", 2),
                                        ("ssar_recursive_double", 4),
                                        ("ssar_split_allgather", 4), ("stream_allgather", 3)])
@pytest.mark.parametrize("path", ["numpy", "torch"])
def test_a_corrupt_stream_frame_raises_its_own_error_where_it_is_summed(name, size, path,
                                                                        monkeypatch):
    """Off the numpy path a received frame's check is read with the size of the sum it goes
    into; until then its indices only sort within the sum's buffer. An index beyond the
    vector (here n, the sum's filler index) still raises the decoder's own error on every
    rank that received one, before the sum is used."""
    from bitcomm.codecs import stream as stream_codec

    n = 4000
    sets = index_sets("random", size, n, 50, 2)
    values = integer_values(sets, 2)
    real = stream_codec.encode

    def corrupt(s):
        frame = real(s)
        if not s.dense and s.nnz:  # the last index becomes s.n: out of [0, s.n)
            width = stream_codec.index_width(s.n)
            at = 17 + (s.nnz - 1) * width
            frame[at:at + width] = torch.tensor(list(s.n.to_bytes(width, "little")),
                                                dtype=torch.uint8)
        return frame

    monkeypatch.setattr(stream_codec, "encode", corrupt)
    with forced(path):
        out = run_local(lambda c: getattr(sparcml, name)(c, sets[c.rank], values[c.rank], n,
                                                         check=False),
                        size, timeout=30, return_exceptions=True)
    for e in out:
        assert isinstance(e, ValueError) and "corrupt stream frame: expected indices" in str(e)
