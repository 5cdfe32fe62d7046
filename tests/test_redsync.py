import pytest
import torch

from bitcomm.codecs import redsync, select

from conftest import OTHER_PATHS, forced, host_reads, unhex


def test_golden_worked_example():
    x = torch.tensor([0.5, -3.0, 2.0, 1.0, -1.0])
    frame = redsync.encode(x, 2, "top")
    assert frame.tolist() == unhex(
        "05 00 00 00 00 00 00 00 | 02 00 00 00 00 00 00 00 | 03 | 02 00 00 00 03 00 00 00 |"
        "00 00 c0 3f")
    dense, used = redsync.decode(frame)
    assert dense.tolist() == [0, 0, 1.5, 1.5, 0] and used == 29
    dense, _ = redsync.decode(redsync.encode(x, 2, "bottom"))
    assert dense.tolist() == [0, -2, 0, 0, -2]


@pytest.mark.parametrize("method", select.METHODS)
@pytest.mark.parametrize("side", redsync.SIDES)
def test_selects_same_signed_extremes_and_their_mean(method, side):
    x = torch.randn(50_000, generator=torch.Generator().manual_seed(4))
    k = 500
    idx, val, n, used = redsync.decode_entries(redsync.encode(x, k, side, method))
    assert n == x.numel() and used == redsync.encoded_size(n, idx.numel())
    signed = x if side == "top" else -x
    assert bool((signed[idx] > 0).all())
    if method == "threshold":
        assert k <= idx.numel() <= 2 * k
    elif method in select.SIDCO:  # a one-stage fit of a clamped Gaussian: near k, not at it
        assert k / 5 <= idx.numel() <= 5 * k
    else:
        assert idx.tolist() == torch.topk(signed, k).indices.sort().values.tolist()
    mean = float(x[idx].double().mean())
    assert val.tolist() == pytest.approx([mean] * idx.numel(), rel=1e-6)
    chosen = torch.zeros_like(x, dtype=torch.bool)
    chosen[idx] = True
    assert float(signed[chosen].min()) >= float(signed[~chosen].max())


def test_fewer_elements_of_the_side_than_k():
    x = torch.tensor([-1.0, 2.0, -3.0, 0.0, 4.0])
    idx, val, _, _ = redsync.decode_entries(redsync.encode(x, 4, "top"))
    assert idx.tolist() == [1, 4] and val.tolist() == [3.0, 3.0]  # zero is never sent
    frame = redsync.encode(-torch.ones(6).abs(), 3, "top")
    idx, val, n, used = redsync.decode_entries(frame)
    assert idx.numel() == 0 and n == 6 and used == redsync.encoded_size(6, 0) == 21
    assert redsync.decode(frame)[0].abs().sum() == 0


def test_bad_input():
    with pytest.raises(ValueError, match="finite"):
        redsync.encode(torch.tensor([1.0, float("inf")]), 1)
    with pytest.raises(ValueError, match="side in"):
        redsync.encode(torch.ones(3), 1, "left")
    with pytest.raises(ValueError, match="method in"):
        redsync.encode(torch.ones(3), 1, method="sort")
    with pytest.raises(TypeError, match="floating-point"):
        redsync.encode(torch.ones(3, dtype=torch.int32), 1)
    with pytest.raises(ValueError, match="k >= 0"):
        redsync.encode(torch.ones(3), -2)


@pytest.mark.parametrize("p, method, reads", [
    ("torch", "trimmed", (4, 3)), ("torch", "threshold", (4, 3)), ("torch", "topk", (2, 2)),
    *[pytest.param(*OTHER_PATHS[1].values, method, reads, marks=OTHER_PATHS[1].marks)
      for method, reads in [("trimmed", (1, 1)), ("threshold", (1, 1)), ("topk", (1, 1))]]])
def test_encodes_with_few_host_reads_off_the_numpy_path(p, method, reads):
    """Off the numpy path (CUDA) each read waits for the device. A search on the Triton path
    reads mean, max and finiteness together with the counts of its first thresholds, which
    the device makes from them (1): the survivors' number is among the counts, so they are
    written without a read, and all of them have the side's sign. When fewer than k values
    have it, the search falls back to the exact top-k, and the count of positive scores,
    fetched with the first counts, says how many of those to send.
    The exact top-k reads once, its check with that count. The torch path reads finiteness on
    its own, then the survivors' number (torch.nonzero) unless a search falls back, or for
    the exact top-k the number of those of the side's sign."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(20_000, generator=g)
    few = -x.abs()
    few[torch.randperm(20_000, generator=g)[:50]] = 1.0  # 50 of the bottom side's sign
    for v, want_reads in zip((x, -few), reads, strict=True):
        with forced("numpy"):
            want = redsync.encode(v, 200, "bottom", method)
        with forced(p):
            seen = host_reads(lambda v=v: redsync.encode(v, 200, "bottom", method))
            got = redsync.encode(v, 200, "bottom", method)
        assert len(seen) == want_reads, seen
        assert torch.equal(got, want)
    assert redsync.decode_entries(got)[0].numel() == 50
