import numpy as np
import pytest
import torch

from bitcomm.codecs import _bracket, select

from conftest import OTHER_PATHS, forced, host_reads, needs_interpreter, ops_on_the_triton_path


def brute_topk(s: torch.Tensor, k: int) -> list[int]:
    order = sorted(range(s.numel()), key=lambda i: (-float(s[i]), i))
    return sorted(order[:k])


@pytest.mark.parametrize("method", ["topk", "trimmed"])
def test_exact_selectors_match_brute_force_with_ties(method, path):
    """On every path (CPU, and the sync-free form a CUDA tensor takes) the same set, for every
    float dtype (the CPU selects float16, float32 and float64 scores in numpy)."""
    g = torch.Generator().manual_seed(0)
    for n in (1, 2, 9, 100, 1000):
        s = torch.randint(0, 6, (n,), generator=g).float()  # many ties
        for dtype in (torch.float32, torch.float16, torch.float64, torch.bfloat16):
            for k in (0, 1, n // 3, n - 1, n, n + 5):
                got = select.select(s.to(dtype), k, method)
                assert got.dtype == torch.int64
                assert got.tolist() == brute_topk(s, min(k, n)), (n, k, dtype)


def fast_brute_topk(a, k):
    """brute_topk for large vectors without NaN: by score descending, then index."""
    order = np.lexsort((np.arange(a.size), -a.astype(np.float64)))
    return sorted(order[:k].tolist())


def test_the_sampled_bracket_gives_the_exact_set_or_steps_aside(monkeypatch):
    """Above 2**18 scores the numpy path takes the top k from the scores above a bound read
    off a stratified sample: the exact set with ties and in every numpy dtype, and the
    partitioning path's set when the sample misleads or NaN ranks on top."""
    results = []
    real = select._bracketed
    monkeypatch.setattr(select, "_bracketed", lambda a, k: results.append(real(a, k)) or
                        results[-1])
    n = (1 << 18) + 7
    g = torch.Generator().manual_seed(5)
    for scores in (torch.randn(n, generator=g).abs(),
                   torch.randint(0, 1000, (n,), generator=g).float()):  # ties at the k-th
        for dtype in (torch.float32, torch.float16, torch.float64):
            v = scores.to(dtype)
            for k in (1, 262, 2621, n // 8):
                got = select.topk(v, k, check=False)
                assert results[-1] is not None
                assert got.tolist() == fast_brute_topk(v.numpy(), k), (dtype, k)
    # A sample that sees only the peaks: fewer than k scores reach its bound.
    peaks = torch.ones(n)
    peaks[_bracket.positions(n)] = 5.0
    got = select.topk(peaks, 20000, check=False)
    assert results[-1] is None
    assert got.tolist() == fast_brute_topk(peaks.numpy(), 20000)
    # NaN ranks on top, as in the partitioning path.
    nan = torch.randn(n, generator=g).abs()
    nan[np.arange(3, n, 997)] = float("nan")
    with_bracket = select.topk(nan, 2621, check=False)
    assert results[-1] is not None
    assert with_bracket.tolist() == fast_brute_topk(nan.nan_to_num(nan=9.0).numpy(), 2621)
    monkeypatch.setattr(_bracket, "MIN_N", n + 1)
    assert torch.equal(with_bracket, select.topk(nan, 2621, check=False))


@pytest.mark.parametrize("p", ["numpy", "torch"])
def test_unchecked_nan_ranks_above_every_score(p):
    """With check=False a NaN score ranks above every other (as np.partition and torch.topk
    put it), NaN ties going to the lower index: exactly k indices, whether the top k hold a
    few NaN or only NaN, on the numpy path (its sampled bracket too) and the torch path."""
    g = torch.Generator().manual_seed(13)
    for n, k in ((1000, 10), (1000, 100), ((1 << 18) + 1, 2621)):
        s = torch.rand(n, generator=g)
        s[torch.randperm(n, generator=g)[:40]] = float("nan")  # 40 NaN: k=10 takes only NaN
        for dtype in (torch.float32, torch.bfloat16):
            v = s.to(dtype)
            want = fast_brute_topk(v.float().nan_to_num(nan=2.0).numpy(), k)
            with forced(p):
                got = select.topk(v, k, check=False)
            assert got.tolist() == want, (p, n, k, dtype)


def test_the_sample_takes_one_score_of_each_run_at_varying_offsets():
    """positions(n): one position in each of SAMPLE runs of n // SAMPLE scores, ascending, at
    offsets that cover the columns of a row-major matrix whose rows divide the run."""
    for n in (_bracket.SAMPLE, (1 << 18) + 7, 1 << 24, 10**9 + 7):
        step = n // _bracket.SAMPLE
        pos = _bracket.positions(n)
        assert pos.dtype == np.int64 and pos.size == _bracket.SAMPLE
        assert np.array_equal(pos // step, np.arange(_bracket.SAMPLE))  # one in each run
    pos = _bracket.positions(1 << 24)  # runs of 1024: rows of 1024, 512, ..., 32 columns
    for row in (32, 256, 1024):
        assert np.unique(pos % row).size > row * 0.9, row


def test_the_bracket_holds_on_a_matrix_whose_columns_differ_in_scale(monkeypatch):
    """A gradient of 2**19 scores as rows of 32 whose first column is 100x the others: a
    strided sample (offset 0 in every run of 32) sees that column only, and its bound leaves
    fewer than k scores; the stratified sample's bound brackets the top k."""
    results = []
    real = select._bracketed
    monkeypatch.setattr(select, "_bracketed", lambda a, k: results.append(real(a, k)) or
                        results[-1])
    rows, cols = 1 << 14, 32
    g = torch.Generator().manual_seed(8)
    grad = torch.randn(rows, cols, generator=g).abs()
    grad[:, 0] *= 100
    a, k = grad.reshape(-1).numpy(), 5000
    strided = a[:: a.size // _bracket.SAMPLE]
    r = _bracket.rank(a.size, k)
    assert (a >= np.sort(strided)[-r]).sum() < k  # the premise: a strided sample misleads
    got = select.topk(grad.reshape(-1), k, check=False)
    assert results[-1] is not None
    assert got.tolist() == fast_brute_topk(a, k)


def test_the_bracket_never_partitions_a_mass_of_ties(monkeypatch):
    """numpy's introselect slows down more than 10x on a vector whose scores are mostly one value
    (ReLU gradients: most exactly 0), even when the k-th largest is elsewhere. The bracket
    partitions only candidates strictly above its bound, and none when at most k lie there
    (the k-th largest is then the bound): the exact set, ties to lower indices, found a
    slice at a time (small slices here, so that the search spans several)."""
    monkeypatch.setattr(select, "_TIE_SLICE", 4099)
    sizes = []
    real = select._top_positions
    monkeypatch.setattr(select, "_top_positions",
                        lambda a, k: sizes.append(a.size) or real(a, k))
    n = 1 << 19
    g = torch.Generator().manual_seed(9)
    for zeros, k in ((0.9, n // 100), (0.995, n // 100), (0.995, n // 8)):
        x = torch.randn(n, generator=g).abs()
        x[torch.rand(n, generator=g) < zeros] = 0
        sizes.clear()
        got = select.topk(x, k, check=False)
        assert got.tolist() == fast_brute_topk(x.numpy(), k), (zeros, k)
        assert all(size < n // 20 for size in sizes), (zeros, k, sizes)


def test_a_sides_bracket_compares_the_values_without_writing_their_scores(monkeypatch):
    """select_side and select_abs above 2**18 values on the numpy path: the top k of
    max(+-v, 0) or |v| with ties (-0.0 among them) and NaN (check=False), the scores of the
    candidates alone written; when the bound is a zero score (fewer positive scores than the
    sample's margin) the scores are written and ranked whole, with the same result."""
    sizes = []
    real = select._Scores._of
    monkeypatch.setattr(select._Scores, "_of",
                        lambda self, v: sizes.append(v.numel()) or real(self, v))
    n = (1 << 18) + 3
    g = torch.Generator().manual_seed(12)
    ties = torch.randint(-60, 61, (n,), generator=g) / 4.0
    ties[torch.rand(n, generator=g) < 0.3] = -0.0
    spread = torch.randn(n, generator=g)
    spread[::100003] = float("nan")  # too few for the sample's bound, among the candidates
    negative = -torch.rand(n, generator=g)  # 100 positive values: top side bound 0
    negative[torch.randperm(n, generator=g)[:100]] = 1.0
    for v in (ties, spread, negative):
        for side in (1, -1, "abs"):
            scores = {1: v.clamp(min=0), -1: v.neg().clamp(min=0), "abs": v.abs()}[side]
            a = scores.nan_to_num(nan=float("inf")).double().numpy()
            for k in (1, 2621, n // 8):
                sizes.clear()
                got = _select_side(v, k, side, "topk", check=False)
                assert got.tolist() == fast_brute_topk(a, k), (side, k)
                bound_zero = v is negative and side == 1
                assert (max(sizes, default=0) == n) == bound_zero, (side, k, sizes)


@pytest.mark.parametrize("path", ["torch", pytest.param(
    "triton", marks=[needs_interpreter, pytest.mark.triton])])
def test_exact_topk_reads_nothing_back_off_the_numpy_path(path):
    """The chosen set's size is k: on a device it is written without a host read."""
    s = torch.randint(0, 6, (1000,), generator=torch.Generator().manual_seed(3)).float()
    with forced(path):
        assert host_reads(lambda: select.topk(s, 300, check=False)) == []
        assert select.topk(s, 300, check=False).tolist() == brute_topk(s, 300)


def test_trimmed_equals_topk_on_continuous_data():
    s = torch.randn(200_000, generator=torch.Generator().manual_seed(1)).abs()
    for k in (1, 20, 2000, 100_000):
        assert torch.equal(select.trimmed_topk(s, k), select.topk(s, k))


def test_all_equal_scores():
    s = torch.full((50,), 3.0)
    assert select.trimmed_topk(s, 7).tolist() == list(range(7))
    assert select.threshold_search(s, 7).tolist() == list(range(7))


def test_threshold_search_contract():
    g = torch.Generator().manual_seed(2)
    s = torch.randn(100_000, generator=g).abs()
    for k in (10, 100, 1000, 10_000):
        idx = select.threshold_search(s, k)
        assert k <= idx.numel() <= 2 * k
        assert bool((idx[1:] > idx[:-1]).all())
        chosen = torch.zeros_like(s, dtype=torch.bool)
        chosen[idx] = True
        # a threshold set: everything chosen beats everything left out
        assert float(s[chosen].min()) > float(s[~chosen].max())
    # k above the count over the mean falls back to the exact top-k
    assert torch.equal(select.threshold_search(s, 90_000), select.topk(s, 90_000))


def test_results_sorted_int64():
    s = torch.rand(1000, generator=torch.Generator().manual_seed(3))
    for method in select.METHODS:
        idx = select.select(s, 50, method)
        assert idx.dtype == torch.int64
        assert bool((idx[1:] > idx[:-1]).all())


def test_bad_input():
    with pytest.raises(ValueError, match="finite scores"):
        select.topk(torch.tensor([1.0, float("nan")]), 1)
    with pytest.raises(ValueError, match="method in"):
        select.select(torch.ones(3), 1, "radix")
    with pytest.raises(ValueError, match="k >= 0, got -1"):
        select.topk(torch.ones(3), -1)
    with pytest.raises(TypeError, match="floating-point"):
        select.topk(torch.ones(3, dtype=torch.int64), 1)
    with pytest.raises(ValueError, match="eps"):
        select.trimmed_topk(torch.ones(3), 1, eps=0)
    with pytest.raises(TypeError, match="no options"):
        select.select(torch.ones(3), 1, "topk", eps=0.1)


@pytest.mark.timeout(30)
def test_fine_eps_finishes_in_a_bounded_number_of_passes():
    """Tiny eps once looped forever (threshold) or for 1/eps passes (trimmed)."""
    scores = torch.rand(1000, generator=torch.Generator().manual_seed(4))
    expect = torch.topk(scores, 900).indices.sort().values
    assert torch.equal(select.trimmed_topk(scores, 900, eps=1e-9), expect)
    got = select.threshold_search(scores, 50, eps=1e-11)
    assert 50 <= got.numel() <= 100
    assert torch.equal(got, torch.topk(scores, got.numel()).indices.sort().values)
    for fn in (select.trimmed_topk, select.threshold_search):
        with pytest.raises(ValueError, match=r"eps >= 1e-12"):
            fn(scores, 50, eps=1e-20)
    from bitcomm.codecs import redsync

    x = torch.randn(1000, generator=torch.Generator().manual_seed(5))
    assert torch.equal(redsync.encode(x, 10, "top", "trimmed", eps=1e-9),
                       redsync.encode(x, 10, "top", "topk"))


@pytest.mark.parametrize("p", OTHER_PATHS)
def test_every_path_searches_to_the_same_thresholds(p):
    """Off the numpy path the counts of the next levels' thresholds come in one read; the
    search replays the same steps on them, so it picks the same set as the numpy path."""
    g = torch.Generator().manual_seed(6)
    cases = [torch.randn(5000, generator=g).abs(), torch.rand(4097, generator=g),
             torch.randint(0, 9, (3000,), generator=g).float(),  # ties at every threshold
             torch.randn(2000, generator=g).abs().double()]
    for s in cases:
        for k in (1, 7, 100, 900):
            for eps in (1e-3, 0.05, 1e-9):
                with forced("numpy"):
                    want = select.threshold_search(s, k, eps=eps)
                with forced(p):
                    got = select.threshold_search(s, k, eps=eps)
                assert torch.equal(got, want), (s.dtype, k, eps)
            for eps in (0.2, 0.01, 0.3):
                with forced(p):
                    got = select.trimmed_topk(s, k, eps=eps)
                assert got.tolist() == brute_topk(s, k), (s.dtype, k, eps)


def _side_scores(v: torch.Tensor, side) -> torch.Tensor:
    if side == "abs":
        return v.abs()
    return v.clamp(min=0) if side > 0 else v.neg().clamp(min=0)


def _select_side(v, k, side, method, **options):
    if side == "abs":
        return select.select_abs(v, k, method, **options)
    return select.select_side(v, k, side, method, **options)


@pytest.mark.parametrize("p", ["numpy", *OTHER_PATHS])
@pytest.mark.parametrize("side", [1, -1, "abs"])
def test_a_side_selects_what_its_scores_select_on_every_path(side, p):
    """select_side(v, side) is select on max(+-v, 0), select_abs on |v|: on the Triton path
    the exact top-k and the searches compute those scores inside their passes instead of
    writing them."""
    g = torch.Generator().manual_seed(8)
    cases = [torch.randn(5000, generator=g), torch.randn(3001, generator=g).double(),
             torch.randint(-4, 5, (3000,), generator=g).float(),  # ties, zeros, both signs
             torch.randn(2000, generator=g).half()]
    for v in cases:
        scores = _side_scores(v, side)
        for k in (0, 1, 100, 900, 10_000):
            for method, options in [("trimmed", {}), ("trimmed", {"eps": 0.01}),
                                    ("threshold", {}), ("threshold", {"eps": 0.05}),
                                    ("topk", {}), ("sidco-e", {})]:
                with forced("numpy"):
                    want = select.select(scores, k, method, **options)
                with forced(p):
                    got = _select_side(v, k, side, method, **options)
                    positive = None if side == "abs" else select.select_side(
                        v, k, side, method, positive=True, **options)
                assert torch.equal(got, want), (v.dtype, k, method, options)
                # what RedSync sends: the side's sign only (zeros where k outnumbers it)
                if positive is not None:
                    assert torch.equal(positive, want[scores[want] > 0]), (v.dtype, k, method)


@pytest.mark.parametrize("p", ["numpy", *OTHER_PATHS])
def test_a_side_refuses_nan_and_inf_anywhere_in_the_vector(p):
    # -inf has the score 0 on the top side: the check is of the vector, not of its scores.
    for bad in (float("nan"), float("inf"), -float("inf")):
        v = torch.randn(1000, generator=torch.Generator().manual_seed(2))
        v[777] = bad
        for method in ("trimmed", "threshold", "topk"):
            for k in (10, 1000):
                for side in (1, "abs"):
                    with forced(p), pytest.raises(ValueError, match="finite values"):
                        _select_side(v, k, side, method)
                with forced(p), pytest.raises(ValueError, match="finite values"):
                    select.select_side(v, k, 1, method, positive=True)
    with pytest.raises(ValueError, match="side 1 or -1"):
        select.select_side(torch.ones(3), 1, 0)
    with pytest.raises(TypeError, match="only eps"):
        select.select_side(torch.ones(3), 1, 1, "trimmed", stages=2)
    with pytest.raises(TypeError, match="positive to be a bool"):
        select.select_side(torch.ones(3), 1, 1, positive=1)


@pytest.mark.parametrize("method, eps, reads", [
    ("trimmed", 0.2, 3),  # mean and max; the 5 steps' counts; the survivors
    ("threshold", 1e-3, 4),  # mean and max; 11 counts, 7 a read; the selection
])
@pytest.mark.parametrize("p", OTHER_PATHS)
def test_redsyncs_searches_read_the_host_a_few_times_off_the_numpy_path(method, eps, reads, p):
    # 100 scores of 1, 10000 of 0.5, the rest 0: no threshold keeps 150..300 of them, so the
    # threshold search halves its interval all 10 times. The Triton path reads the mean and
    # max with the first counts (their thresholds made on the device), and writes the
    # survivors or the selection, whose number is among the counts, without a read of its own.
    s = torch.cat([torch.ones(100), torch.full((10_000,), 0.5), torch.zeros(9_900)])
    if p == "triton":
        reads -= 2
    with forced(p):
        seen = host_reads(lambda: select.select(s, 150, method, check=False,
                                                              eps=eps))
        got = select.select(s, 150, method, eps=eps)
    assert len(seen) == reads, seen
    with forced("numpy"):
        assert torch.equal(got, select.select(s, 150, method, eps=eps))


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_search_reads_its_statistics_with_its_first_counts_on_the_triton_path(dtype,
                                                                               monkeypatch):
    """The searches' first thresholds, 0.0 and mean + c * (top - mean), are made on the device
    from its statistics by the host's float64 operations: the counts that come back with the
    statistics, in one read, are how many scores exceed each of the host's own thresholds
    (numpy's count, for every side). Where the device's thresholds differed from the
    host's, their counts go unused: the search fetches its own, one read more, and selects
    the same."""
    from bitcomm.codecs import _kernels

    g = torch.Generator().manual_seed(41)
    v = (torch.randn(20_000, generator=g) * 3).to(dtype)
    for side in (0, 1, -1, 2):
        for method, eps in (("trimmed", 0.2), ("threshold", 1e-3)):
            src = select._Scores(v.abs() if side == 0 else v, side)
            counts = select._Counts(src)
            with forced("triton"):
                mean, top = counts.start(True, select._first_coefs(method, eps))
            scores = src.tensor.numpy()
            want_mean = float(np.sum(scores, dtype=np.float64)) / scores.size
            assert abs(mean - want_mean) <= 1e-12 * max(1.0, abs(want_mean)) and \
                top == float(scores.max()), (side, method)
            assert len(counts.known) == 1 + len(set(select._first_coefs(method, eps)))
            for threshold, count in counts.known.items():
                bound = np.asarray(threshold, dtype=np.float64).astype(scores.dtype)
                assert count == int(np.count_nonzero(scores > bound)), (side, threshold)
    with forced("numpy"):
        want = select.select_side(v, 200, 1, "trimmed")
    with forced("triton"):
        assert len(host_reads(lambda: select.select_side(v, 200, 1, "trimmed"))) == 1
        original = _kernels.stats_and_counts

        def other(x, coefs, side):  # one of the device's thresholds one ulp off
            out, t, runs = original(x, coefs, side)
            out[4 + t + 1] = np.nextafter(out[4 + t + 1].item(), np.inf)
            return out, t, runs

        monkeypatch.setattr(_kernels, "stats_and_counts", other)
        assert len(host_reads(lambda: select.select_side(v, 200, 1, "trimmed"))) == 2
        assert torch.equal(select.select_side(v, 200, 1, "trimmed"), want)


@needs_interpreter
def test_the_exact_top_k_checks_and_counts_in_its_own_read_on_the_triton_path(small_sample,
                                                                               launched):
    """From a sampled bound the exact top-k's count pass also finds NaN / inf in v, and its
    writing pass counts the positive scores chosen: a side's checked top-k (RedSync's
    default, select_abs with check) makes no score_stats pass, and one host read, which also
    says how many of the k values have the side's sign. The same indices as the numpy path;
    NaN, inf and -inf raise. (A small sample and more room, for the interpreter.)"""
    from bitcomm.codecs import redsync

    g = torch.Generator().manual_seed(32)
    v = torch.randn(6000, generator=g)
    few = -v.abs()
    few[torch.randperm(6000, generator=g)[:30]] = 2.0  # 30 of the top side's sign, k = 60
    for x, k in ((v, 60), (few, 60), (v.double(), 60)):
        with forced("numpy"):
            want = redsync.encode(x, k, "top"), select.select_abs(x, k)
        with forced("triton"):
            launched.clear()
            seen = host_reads(lambda x=x, k=k: redsync.encode(x, k, "top"))
            assert "_count_at_least_kernel" in launched, launched
            assert "_score_stats_kernel" not in launched, launched
            assert len(seen) == 1, seen
            got = redsync.encode(x, k, "top"), select.select_abs(x, k)
            assert "_score_stats_kernel" not in launched, launched
            assert "_nonfinite_kernel" not in launched, launched  # no check of its own
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), x.dtype
    assert redsync.decode_entries(got[0])[0].numel() == 60
    with forced("numpy"):
        assert redsync.decode_entries(redsync.encode(few, 60, "top"))[0].numel() == 30
    for bad in (float("nan"), float("inf"), -float("inf")):
        w = v.clone()
        w[4321] = bad
        with forced("triton"):
            with pytest.raises(ValueError, match="finite values"):
                redsync.encode(w, 60, "top")
            with pytest.raises(ValueError, match="finite v"):
                select.select_abs(w, 60)


@needs_interpreter
@pytest.mark.parametrize("method, eps", [("trimmed", 0.2), ("threshold", 1e-3)])
@pytest.mark.parametrize("side", [0, 1, 2])
def test_the_searches_survivors_start_from_the_counting_pass_on_the_triton_path(method, eps,
                                                                               side,
                                                                               launched):
    """The pass that counted a search's thresholds also kept each program's counts, so the
    survivors (trimmed) or the selection (threshold) are written by one gathering pass: no
    count_at_least pass reads v again. The same indices as the numpy path."""
    v = torch.randn(9000, generator=torch.Generator().manual_seed(31))

    def run():
        if side == 0:
            return select.select(v.abs(), 90, method, eps=eps)
        if side == 2:
            return select.select_abs(v, 90, method, eps=eps)
        return select.select_side(v, 90, side, method, eps=eps)

    with forced("numpy"):
        want = run()
    got = []
    ops = ops_on_the_triton_path(lambda: got.append(run()))
    got = got[0]
    assert torch.equal(got, want)
    assert "_count_above_kernel" in launched and "_gather_kernel" in launched
    assert "_count_at_least_kernel" not in launched, launched
    if method == "trimmed" and side in (1, 2):  # a side's survivors' top-k: the scores the
        # survivors' pass wrote beside their indices, no gather of v at those indices
        assert ops.count("index") == 1, ops  # the survivors at the top-k's positions
