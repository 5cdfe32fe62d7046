import inspect
import itertools
import math

import numpy as np
import pytest
import torch

from bitcomm.codecs import select, sidco
from bitcomm.codecs.sidco import StageControl

from conftest import OTHER_PATHS, VIEWS, forced, host_reads, needs_interpreter


def test_worked_example_of_the_module_docstring():
    s = torch.tensor([4.0, 3, 2, 1, 0, 0, 0, 0])
    # mean of s / 4 is 10 / 32; eta = 4 * 0.3125 * ln 4
    assert sidco.threshold(s, 0.25) == pytest.approx(4 * 0.3125 * math.log(4), rel=1e-12)
    assert sidco.sidco(s, 2).tolist() == [0, 1, 2]


def test_pareto_moments_by_hand():
    # s / 4 = [0.25, 0.5, 0.75, 1]: mean 0.625, variance 0.078125, mu^2 / s2 = 5,
    # xi = (1 - 5) / 2 = -2, beta = 0.625 * 6 / 2 = 1.875; at delta 0.5:
    # eta = 1.875 / -2 * (0.5**2 - 1) = 0.703125 of the largest, 2.8125
    s = torch.tensor([1.0, 2, 3, 4])
    assert sidco.threshold(s, 0.5, "pareto") == pytest.approx(2.8125, rel=1e-12)
    assert sidco.sidco(s, 2, "pareto").tolist() == [2, 3]
    # [0, 2] / 2: mean 0.5, variance 0.25, mu^2 / s2 = 1, so xi = 0: the Pareto is the
    # exponential of mean beta = 0.5, whose delta-tail starts at beta * ln(1 / delta) of the
    # largest (the closed form's limit as xi -> 0, where it would divide by zero)
    two = torch.tensor([0.0, 2.0])
    assert sidco.threshold(two, 0.1, "pareto") == pytest.approx(math.log(10), rel=1e-15)
    assert sidco.threshold(two, 0.1, "pareto") == sidco.threshold(two, 0.1, "exponential")


def test_exponential_second_stage_fits_the_shifted_exceedances_by_hand():
    # delta 1/16 in 2 stages: stage 1 at 0.25, stage 2 at (1/16 / 0.25) = 0.25.
    s = torch.tensor([8.0, 4, 2, 1, 1, 1, 1, 0])
    y = [v / 8 for v in s.tolist()]
    eta1 = sum(y) / 8 * math.log(4)
    over = [v - eta1 for v in y if v >= eta1]
    eta2 = eta1 + sum(over) / len(over) * math.log(4)
    assert sidco.threshold(s, 1 / 16, "exponential", 2) == pytest.approx(8 * eta2, rel=1e-12)


def test_gamma_threshold_is_the_exact_quantile_of_the_closed_form_fit():
    special = pytest.importorskip("scipy.special")
    g = torch.Generator().manual_seed(0)
    s = torch.empty(10000).exponential_(1.0, generator=g) ** 2  # heavier than exponential
    y = s.double() / float(s.max())
    mu = float(y.mean())
    t = math.log(mu) - float(y.log().mean())
    alpha = (3 - t + math.sqrt((t - 3) ** 2 + 24 * t)) / (12 * t)
    for delta in (0.1, 0.01, 0.001):
        want = float(s.max()) * mu / alpha * special.gammaincinv(alpha, 1 - delta)
        assert sidco.threshold(s, delta, "gamma-pareto") == pytest.approx(want, rel=1e-9)


def _samples(name: str, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    u = torch.rand(n, generator=g, dtype=torch.float64).clamp_(1e-300, 1)
    if name == "laplace":
        return (-u.log()).float()  # |Laplace| is exponential
    if name == "gauss":
        return torch.randn(n, generator=g).abs()
    raise AssertionError(name)


@pytest.mark.parametrize("dist", sidco.DISTRIBUTIONS)
@pytest.mark.parametrize("stages", [1, 2, 3])
def test_every_fit_hits_k_on_laplace_gradients(dist, stages):
    """|Laplace| is exponential, which every fit can represent: the count is near k."""
    s = _samples("laplace", 1 << 18)
    k = (1 << 18) // 100
    got = sidco.sidco(s, k, dist, stages).numel()
    assert 0.9 * k <= got <= 1.1 * k


def test_stages_fix_the_far_tail_of_a_light_tailed_vector():
    """Section 2.4: one exponential fit of |Gaussian| at delta 0.001 is orders of magnitude
    off; three Pareto stages over the exceedances come within 20%."""
    s = _samples("gauss", 1 << 18)
    k = (1 << 18) // 1000
    assert sidco.sidco(s, k, "exponential", 1).numel() < 0.1 * k
    assert 0.8 * k <= sidco.sidco(s, k, "pareto", 3).numel() <= 1.2 * k


def test_guards():
    zeros = torch.zeros(10)
    assert sidco.sidco(zeros, 3).numel() == 0 and sidco.threshold(zeros, 0.1) == math.inf
    assert sidco.sidco(torch.empty(0), 3).numel() == 0
    equal = torch.full((10,), 2.0)
    for dist in sidco.DISTRIBUTIONS:  # no fit separates equal values: all of them
        assert sidco.sidco(equal, 3, dist, 3).tolist() == list(range(10)), dist
    x = torch.tensor([5.0, 1, 1, 1, 1, 1, 1, 1])
    assert sidco.sidco(x, 0).numel() == 0
    assert sidco.sidco(x, 8).tolist() == list(range(8))
    # the exceedances over stage 1 all equal 5: stage 2 has zero variance and keeps stage 1
    assert sidco.sidco(x, 1, "pareto", 3).tolist() == [0]
    gaps = torch.tensor([0.0, 0, 0, 0, 3, 0, 0, 7])  # zeros in the log of the gamma fit
    assert sidco.sidco(gaps, 1, "gamma-pareto").tolist() in ([7], [4, 7])


def test_bad_input():
    x = torch.ones(8)
    for k in (0, 1, 2):  # no fit at k = 0 or n, and the scores are still checked
        with pytest.raises(ValueError, match="finite"):
            sidco.sidco(torch.tensor([1.0, float("nan")]), k)
    with pytest.raises(TypeError, match="delta to be a number, got str"):
        sidco.threshold(x, "0.1")
    with pytest.raises(ValueError, match="period to be an int >= 1"):
        sidco.StageControl(period=0)
    with pytest.raises(ValueError, match="non-negative"):
        sidco.threshold(torch.tensor([1.0, -1.0]), 0.5)
    with pytest.raises(ValueError, match="delta"):
        sidco.threshold(x, 0.0)
    with pytest.raises(ValueError, match="dist"):
        sidco.threshold(x, 0.5, "normal")
    with pytest.raises(ValueError, match="stages"):
        sidco.threshold(x, 0.5, stages=0)
    with pytest.raises(TypeError, match="stages"):
        sidco.threshold(x, 0.5, stages=1.5)
    with pytest.raises(TypeError):
        sidco.sidco(torch.ones(4, dtype=torch.int32), 1)


def test_stage_control_means_over_the_whole_period():
    """Four calls at 0.9 k and one at 1.6 k average 1.04 k: no change. (Algorithm 1 as printed
    sums the first Q - 1 and divides by Q, 0.72 k, and would add a stage.)"""
    c = StageControl(stages=2)
    for ratio in (0.9, 0.9, 0.9, 0.9, 1.6):
        c.update(round(100 * ratio), 100, 100_000)
    assert c.stages == 2


def test_stage_control_moves_one_stage_per_period_within_bounds():
    c = StageControl(stages=2)
    for _ in range(4):
        assert c.update(300, 100, 100_000) == 2  # nothing moves before the period ends
    assert c.update(300, 100, 100_000) == 1  # too many: one stage fewer
    for _ in range(5):
        c.update(300, 100, 100_000)
    assert c.stages == 1  # never below one
    for _ in range(100):
        c.update(0, 100, 100_000)  # k_hat = 0 counts as too few
    assert c.stages == sidco.max_stages(100 / 100_000) == 10
    assert c.update(5, 0, 100) == 10  # k = 0 is not recorded
    again = StageControl()
    again.load_state_dict(c.state_dict())
    assert again == c


def test_select_dispatches_by_name_with_options():
    s = _samples("gauss", 4096)
    for name, dist in select.SIDCO.items():
        assert torch.equal(select.select(s, 40, name, stages=2),
                           sidco.sidco(s, 40, dist, 2))
    with pytest.raises(TypeError):
        select.select(s, 40, "sidco-e", eps=0.1)


def test_benchmark_vectors_have_the_tails_they_are_named_for():
    from bitcomm.bench.select import sample

    n = 1 << 16
    kurt = {}
    for dist in ("laplace", "gauss", "t3"):
        x = sample(dist, n).double()
        assert x.numel() == n and not torch.equal(x.float(), sample(dist, n, draw=1))
        assert torch.equal(x.float(), sample(dist, n))  # seeded
        kurt[dist] = float(((x - x.mean()) ** 4).mean() / x.var() ** 2)
    # excess kurtosis: 0 (Gauss), 3 (Laplace), infinite for t with 3 degrees (large in sample)
    assert 2.8 < kurt["gauss"] < 3.2 and 5 < kurt["laplace"] < 7 and kurt["t3"] > 10
    with pytest.raises(ValueError, match="dist"):
        sample("cauchy", 10)


@pytest.mark.parametrize("check", [False, True])
@pytest.mark.parametrize("dist", ["exponential", "pareto"])
@pytest.mark.parametrize("stages, reads", [(1, 2), (3, 6)])
def test_each_stage_reads_the_host_once_off_the_numpy_path(dist, stages, reads, check):
    """On a device a stage's range, scale and moments come back in one read, and the range
    checks the scores (NaN and inf reach it, and negative scores its least); a later stage
    also keeps only the exceedances (a mask: one more), and the selection is one."""
    s = torch.randn(20_000, generator=torch.Generator().manual_seed(0)).abs()
    with forced("numpy"):
        want = sidco.sidco(s, 200, dist, stages)
    with forced("torch"):
        seen = host_reads(lambda: sidco.sidco(s, 200, dist, stages, check=check))
        got = sidco.sidco(s, 200, dist, stages)
    assert len(seen) == reads, seen
    assert torch.equal(got, want)


@pytest.mark.parametrize("path", ["numpy", *OTHER_PATHS])
@pytest.mark.parametrize("bad, problem", [(math.nan, "finite"), (math.inf, "finite"),
                                          (-math.inf, "finite"), (-1.0, "non-negative")])
def test_both_paths_check_the_scores(path, bad, problem):
    """Every path refuses NaN, inf and negative scores for every fit, from the range it reads
    anyway (the numpy path's min and max, the torch and Triton paths' first stage read)."""
    s = torch.rand(1000, generator=torch.Generator().manual_seed(0))
    s[517] = bad
    with forced(path):
        for dist in sidco.DISTRIBUTIONS:
            with pytest.raises(ValueError, match=problem):
                sidco.threshold(s, 0.01, dist)
            with pytest.raises(ValueError, match=problem):
                sidco.sidco(s, 10, dist, 2)
        sidco.threshold(s, 0.01, check=False)  # unchecked: no exception


def _vectors():
    g = torch.Generator().manual_seed(3)
    sparse = torch.randn(100_000, generator=g).abs() * (torch.rand(100_000, generator=g) < 0.1)
    return {
        "laplace": _samples("laplace", 300_001),
        "gauss": torch.randn(200_003, generator=g).abs(),
        "sparse": sparse,  # 90% zeros: the gamma fit's positive share
        "ties": torch.randint(0, 5, (70_001,), generator=g).float(),
        "float16": torch.randn(50_000, generator=g).abs().half(),
        "float64, huge": torch.randn(50_000, generator=g, dtype=torch.float64).abs() * 1e200,
        "gaps": torch.tensor([0.0, 0, 0, 0, 3, 0, 0, 7]),
        "one positive value": torch.tensor([0.0, 2, 2, 0, 2]),
    }


def test_the_numpy_and_torch_paths_fit_alike():
    """The numpy path sums a chunk at a time, the torch path over the whole vector: the same
    thresholds to rounding, and the same selections, for every fit and stage count."""
    _assert_fits_alike("torch", None, itertools.product((1, 2, 4), (0.1, 0.01, 0.001)))


def _assert_fits_alike(path, length, cases):
    # Each vector (its first `length` scores), fit and (stages, delta) of cases: the numpy
    # path's threshold to rounding on `path`, and its selection.
    cases = list(cases)
    for name, v in _vectors().items():
        v = v[:length]
        for dist in sidco.DISTRIBUTIONS:
            for stages, delta in cases:
                k = max(1, int(delta * v.numel()))
                got = {}
                for p in ("numpy", path):
                    with forced(p):
                        got[p] = (sidco.threshold(v, delta, dist, stages),
                                  sidco.sidco(v, k, dist, stages))
                case = (name, dist, stages, delta)
                assert got["numpy"][0] == pytest.approx(got[path][0], rel=1e-12), case
                assert torch.equal(got["numpy"][1], got[path][1]), case


@pytest.mark.parametrize("path", ["numpy", *OTHER_PATHS])
def test_the_fits_leave_the_scores_as_they_are(path):
    """The torch path scales a float64 copy in place: float64 scores must be copied too."""
    for dtype in (torch.float32, torch.float64):
        s = _samples("laplace", 10_000).to(dtype)
        before = s.clone()
        with forced(path):
            for dist in sidco.DISTRIBUTIONS:
                sidco.sidco(s, 100, dist, 3)
        assert torch.equal(s, before), dtype


@needs_interpreter
@pytest.mark.triton
def test_the_triton_path_fits_as_the_numpy_path_does():
    """The Triton path divides each score by the largest in float64 as the numpy path does
    and sums a tile at a time: the same thresholds to rounding and the same selections, for
    every fit, at one and several stages (shorter vectors: the interpreter is slow)."""
    _assert_fits_alike("triton", 10_000, [(1, 0.01), (3, 0.01), (2, 0.001)])


@needs_interpreter
@pytest.mark.triton
@pytest.mark.parametrize("dist", sidco.DISTRIBUTIONS)
def test_a_triton_stage_is_one_read_and_writes_nothing_the_size_of_the_scores(dist):
    """On a GPU each stage is one kernel over the scores and one host read: no float64 copy,
    no exceedance mask (whose size would be one more read); the largest tensor a fit makes is
    its tiles' rows of sums."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from bitcomm.codecs import _kernels

    n = 20_000
    s = _samples("laplace", n)
    with forced("numpy"):
        want = sidco.threshold(s, 0.01, dist, 3)
    sizes, inside, original = [], [], _kernels.launch

    class Sizes(TorchDispatchMode):  # the interpreter's own copies while a kernel runs left out
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if not inside and func.__name__.split(".")[0] not in VIEWS:
                sizes.extend(t.numel() for t in (out if isinstance(out, (list, tuple))
                                                 else [out]) if isinstance(t, torch.Tensor))
            return out

    def launch(*a, **k):
        inside.append(True)
        try:
            original(*a, **k)
        finally:
            inside.pop()

    with forced("triton"):
        seen = host_reads(lambda: sidco.threshold(s, 0.01, dist, 3))
        with pytest.MonkeyPatch.context() as mp, Sizes():
            mp.setattr(_kernels, "launch", launch)
            got = sidco.threshold(s, 0.01, dist, 3)
    assert sizes
    assert got == pytest.approx(want, rel=1e-12)
    # one a stage (the gamma fit's inverse works on host floats: CPU tensors, no device read)
    lines, first = inspect.getsourcelines(sidco._gamma_inverse)
    assert len([line for _, _, line in seen if not first <= line < first + len(lines)]) == 3, \
        seen
    assert max(sizes) <= 6 * -(-n // 1024), max(sizes)


def test_the_pareto_variance_is_exact_to_float64():
    """Chunks' means and squared deviations combined pairwise: the variance of scores that
    are quarters (sums exact in float64) is the exact rational variance, rounded."""
    from fractions import Fraction

    v = _vectors()["ties"]  # 0..4: y = v / 4
    y = [Fraction(int(a), 4) for a in v.tolist()]
    mean = sum(y) / len(y)
    var = sum((a - mean) ** 2 for a in y) / len(y)
    got = sidco._moments(v.numpy(), 4.0, 0.0, "pareto")
    assert got == [float(mean), float(var)]
    want = 4 * sidco._pareto(float(mean), float(var), 0.01)
    assert sidco.threshold(v, 0.01, "pareto") == want


def test_the_numpy_path_writes_nothing_the_size_of_the_vector():
    """A float64 copy of 2**20 float32 scores would take 8 MiB; the numpy path converts 64K
    of them at a time."""
    import tracemalloc

    s = _samples("laplace", 1 << 20)
    for dist in sidco.DISTRIBUTIONS:
        tracemalloc.start()
        try:
            sidco.threshold(s, 0.01, dist, 1)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 2 << 20, (dist, peak)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_the_floor_of_a_kept_stage_is_the_least_value_whose_quotient_reaches_eta(dtype):
    """Later stages keep src / scale >= eta by comparing src with a floor in its own dtype:
    it must be the least value of that dtype whose float64 quotient reaches eta."""
    rng = np.random.default_rng(0)
    for _ in range(2000):
        scale = float(dtype(rng.uniform(0.1, 100)))
        eta = float(rng.uniform(0, 1.2))
        v = sidco._floor(eta, scale, dtype)
        assert v.dtype == dtype
        assert np.float64(v) / scale >= eta, (eta, scale, v)
        below = np.nextafter(v, dtype(-np.inf))
        assert not np.float64(below) / scale >= eta, (eta, scale, v)
    # a value exactly at the boundary: eta = v / scale itself
    scale, v = 3.0, dtype(1.7)
    assert sidco._floor(float(np.float64(v) / scale), scale, dtype) == v
    # nothing reaches NaN: no floor, and the stage compares quotients (none kept)
    assert sidco._floor(math.nan, 2.0, dtype) is None
    assert sidco._kept(np.ones(5, dtype=dtype), 2.0, math.nan).size == 0
