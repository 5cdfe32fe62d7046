import dataclasses

import pytest
import torch

from bitcomm.collectives.oktopk import OkTopkState, oktopk_allreduce, oktopk_allreduce_bytes
from bitcomm.comm import run_local

from conftest import forced, host_reads, needs_interpreter


def _accs(size: int, n: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g) for _ in range(size)]


def _top(a: torch.Tensor, k: int) -> torch.Tensor:
    """Indices (ascending) of the k largest |a| among its nonzero entries."""
    nz = torch.nonzero(a).reshape(-1)
    if k >= nz.numel():
        return nz
    return nz[torch.topk(a[nz].abs(), k).indices].sort().values


def oracle(accs: list[torch.Tensor], k: int, ths: list[float] | None = None,
           global_th: float | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """R = sum_i acc_i [j in L_i] in rank order; G its top k (or |R| >= global_th); u = R[G]."""
    n = accs[0].numel()
    r = torch.zeros(n)
    present = torch.zeros(n, dtype=torch.bool)
    locals_ = []
    for i, a in enumerate(accs):
        li = _top(a, k) if ths is None else torch.nonzero((a.abs() >= ths[i]) & (a != 0)
                                                           ).reshape(-1)
        r.index_add_(0, li, a[li])
        present[li] = True
        locals_.append(li)
    where = torch.nonzero(present).reshape(-1)
    if global_th is None:
        g = where[torch.topk(r[where].abs(), min(k, where.numel())).indices]
    else:
        g = where[r[where].abs() >= global_th]
    u = torch.zeros(n)
    u[g] = r[g]
    chosen = torch.zeros(n, dtype=torch.bool)
    chosen[g] = True
    return u, [li[chosen[li]] for li in locals_]


@pytest.mark.parametrize("size", [1, 2, 3, 4, 5, 8])
def test_one_call_is_topk_of_the_sum_of_topk_on_every_rank(size):
    n, k = 1001, 37
    accs = _accs(size, n, seed=size)

    def fn(c):
        state = OkTopkState(tau_prime=1, feedback=False)
        u, idx = oktopk_allreduce(c, accs[c.rank], k, state)
        return u, idx, state.last, c.counters.total_sent

    out = run_local(fn, size, timeout=60)
    want, want_idx = oracle(accs, k)
    for r, (u, idx, stats, sent) in enumerate(out):
        assert torch.equal(u, want), r
        assert torch.equal(idx, want_idx[r]), r
        assert stats.local == k and stats.selected == k
        assert sent == oktopk_allreduce_bytes(size, n, stats)


@pytest.mark.parametrize("balance", ["always", "never", "auto"])
@pytest.mark.parametrize("throttle", [1, 4])
@pytest.mark.parametrize("boundaries", [None, "low", "high", "odd", "even"])
def test_the_result_does_not_depend_on_boundaries_throttle_or_balance(balance, throttle,
                                                                       boundaries):
    size, n, k = 5, 600, 40
    accs = _accs(size, n, seed=7)
    preset = {None: None, "low": [0, 0, 0, 0], "high": [n, n, n, n], "odd": [5, 7, 300, 599]}

    def fn(c):
        state = OkTopkState(tau_prime=1, feedback=False, throttle=throttle, balance=balance,
                            regions="even" if boundaries == "even" else "balanced")
        if boundaries not in (None, "even"):  # not a repartition call: the preset is used
            state.iteration, state.boundaries = 1, preset[boundaries]
        u, idx = oktopk_allreduce(c, accs[c.rank], k, state)
        return u, idx, state.last, c.counters.total_sent, state.boundaries

    out = run_local(fn, size, timeout=60)
    want, want_idx = oracle(accs, k)
    # every entry sent to another region's owner is received there
    assert sum(o[2].pieces for o in out) == sum(o[2].received for o in out)
    if boundaries == "even":
        assert out[0][4] == [120, 240, 360, 480] and not out[0][2].repartitioned
    for r, (u, idx, stats, sent, _) in enumerate(out):
        assert torch.equal(u, want) and torch.equal(idx, want_idx[r])
        assert stats.balanced == (balance == "always" or (
            balance == "auto" and boundaries in ("low", "high")))  # all in one region
        assert sent == oktopk_allreduce_bytes(size, n, stats)


def test_reused_thresholds_select_by_value_on_the_next_call():
    size, n, k = 4, 800, 30
    first, second = _accs(size, n, seed=1), _accs(size, n, seed=2)

    def fn(c):
        state = OkTopkState(tau_prime=4, tau=4, feedback=False)
        oktopk_allreduce(c, first[c.rank], k, state)
        ths = (state.local_th, state.global_th)
        u, idx = oktopk_allreduce(c, second[c.rank], k, state)
        return ths, u, idx, state.last

    out = run_local(fn, size, timeout=60)
    ths = [o[0][0] for o in out]
    global_th = out[0][0][1]
    assert all(o[0][1] == global_th for o in out)
    want, want_idx = oracle(second, k, ths, global_th)
    for r, (_, u, idx, stats) in enumerate(out):
        assert not stats.recomputed and not stats.repartitioned
        assert torch.equal(u, want) and torch.equal(idx, want_idx[r])


def test_feedback_moves_reused_thresholds_as_the_reference_does():
    # one rank: acc = 1..100; k = 10 -> th = 91. Next call with 2 * acc: 55 pass 91 (> 4k/3),
    # so th rises by 1.03 five times (105.5): 48 pass, still > 5k/4 after, so th *= 1.012.
    acc = torch.arange(1.0, 101.0)

    def fn(c):
        state = OkTopkState(tau_prime=8)
        oktopk_allreduce(c, acc, 10, state)
        th1 = state.local_th
        oktopk_allreduce(c, 2 * acc, 10, state)
        return th1, state.local_th, state.last.local

    th1, th2, local = run_local(fn, 1, timeout=30)[0]
    assert th1 == 91.0
    assert th2 == pytest.approx(91.0 * 1.03 ** 5 * 1.012)
    assert local == sum(1 for v in range(1, 101) if 2 * v >= 91 * 1.03 ** 5)


def test_the_payload_stays_within_6k_words_while_the_allgather_grows():
    """Section 3.1: per rank, pieces + balancing + allgatherv stay under 6k(P-1)/P words (an
    entry is two 4-byte words); allgathering every rank's top-k sends 2k(P-1) words."""
    n, k = 8192, 64
    for size in (4, 8):
        accs = _accs(size, n, seed=size)

        def fn(c, accs=accs):
            state = OkTopkState(tau_prime=1, feedback=False, balance="always")
            oktopk_allreduce(c, accs[c.rank], k, state)
            s = state.last
            return 2 * (s.pieces + s.moved + (size - 1) * s.block)

        words = run_local(fn, size, timeout=60)
        assert max(words) <= 6 * k * (size - 1) / size, (size, words)
        assert max(words) < 2 * k * (size - 1)


def test_fewer_local_entries_than_ranks_and_zero_k():
    size, n = 4, 50
    accs = [torch.zeros(n) for _ in range(size)]
    accs[2][7] = 3.0  # one nonzero entry in all: fewer than P selected on every rank

    def fn(c):
        state = OkTopkState()
        u, idx = oktopk_allreduce(c, accs[c.rank], 5, state)
        z, zi = oktopk_allreduce(c, accs[c.rank], 0, OkTopkState())
        return u, idx, state.boundaries, z, zi

    for r, (u, idx, bounds, z, zi) in enumerate(run_local(fn, size, timeout=60)):
        assert u.tolist() == accs[2].tolist()
        assert idx.tolist() == ([7] if r == 2 else [])
        assert bounds == [12, 25, 37]  # the even split every rank proposed
        assert not z.any() and zi.numel() == 0


def test_bad_input_raises_on_every_rank():
    def fn(c):
        errors = []
        for acc, k, state in [
            (torch.ones(8), 9 if c.rank == 1 else 2, OkTopkState()),
            (torch.ones(8), 2, OkTopkState(balance="sometimes" if c.rank == 0 else "auto")),
            (torch.ones(8) if c.rank else torch.ones(8, dtype=torch.int64), 2, OkTopkState()),
            (torch.ones(8), 2, OkTopkState(iteration=c.rank)),  # diverged state
            (torch.ones(8), 2, OkTopkState(iteration=1, boundaries=[5, 3])),  # not sorted
            (torch.ones(8), 2, OkTopkState(iteration=1, boundaries=[3, 9])),  # beyond n
        ]:
            try:
                oktopk_allreduce(c, acc, k, state)
                errors.append(None)
            except (TypeError, ValueError) as e:
                errors.append(type(e).__name__)
        return errors

    out = run_local(fn, 3, timeout=60)
    assert out[0] == out[1] == out[2] == ["ValueError", "ValueError", "TypeError", "ValueError",
                                          "ValueError", "ValueError"]


@pytest.mark.parametrize("options, kind, message", [
    ({"tau": 2.0}, TypeError, "tau to be an int, got float"),
    ({"tau_prime": True}, TypeError, "tau_prime to be an int, got bool"),
    ({"throttle": 0}, ValueError, "throttle >= 1, got 0"),
    ({"regions": "even-ish"}, ValueError, "regions in"),
    ({"raise_step": 2}, ValueError, r"raise_step in \[1, 2\), got 2"),
    ({"raise_tries": -1}, ValueError, "raise_tries to be an int >= 0, got -1"),
    ({"raise_tries": 1.5}, ValueError, "raise_tries to be an int >= 0, got 1.5"),
    ({"local_stages": 0}, ValueError, "local_stages to be an int >= 1, got 0"),
    ({"local_stages": True}, ValueError, "local_stages to be an int >= 1, got True"),
])
def test_a_state_option_out_of_range_is_refused_naming_it(options, kind, message):
    with pytest.raises(kind, match=message):
        OkTopkState(**options).check()
    with pytest.raises(kind, match=message):
        run_local(lambda c: oktopk_allreduce(c, torch.ones(8), 2, OkTopkState(**options)), 2,
                  timeout=30)


def test_state_round_trips():
    s = OkTopkState(tau=3, iteration=5, local_th=0.5, global_th=0.25, boundaries=[4, 9])
    t = OkTopkState()
    t.load_state_dict(s.state_dict())
    assert dataclasses.asdict(t) == dataclasses.asdict(s)


def test_a_call_that_selected_nothing_recomputes_on_the_next():
    """All-zero accumulators leave infinite thresholds; the next call must not reuse them."""
    def fn(c):
        state = OkTopkState(tau_prime=32)
        u, _ = oktopk_allreduce(c, torch.zeros(20), 3, state)
        first = (state.local_th, state.global_th, bool(u.any()))
        x = torch.arange(20.0) * (c.rank + 1)
        u, idx = oktopk_allreduce(c, x, 3, state)
        return first, u, idx, state.last.recomputed

    for first, u, idx, recomputed in run_local(fn, 2, timeout=30):
        assert first == (float("inf"), float("inf"), False)
        assert recomputed and idx.tolist() == [17, 18, 19]
        assert u.tolist() == [0.0] * 17 + [51.0, 54.0, 57.0]


def test_a_sidco_fit_can_set_the_local_threshold():
    # the sidco module's worked example: the exponential threshold of [4, 3, 2, 1, 0, 0, 0, 0] at
    # k = 2 is 1.73, so three entries are selected locally; the global top-2 keeps 4 and 3
    acc = torch.tensor([4.0, 3, 2, 1, 0, 0, 0, 0])

    def fn(c):
        state = OkTopkState(local_fit="exponential")
        u, idx = oktopk_allreduce(c, acc, 2, state)
        return u.tolist(), idx.tolist(), state.last.local, state.local_th

    u, idx, local, th = run_local(fn, 1, timeout=30)[0]
    # three passed, above 5k/4: the feedback raises the kept threshold by 1.012 for next time
    assert local == 3 and th == pytest.approx(1.7328679513998633 * 1.012)
    assert u == [4.0, 3.0, 0, 0, 0, 0, 0, 0] and idx == [0, 1]


def test_the_feedback_factors_are_options():
    acc = torch.arange(1.0, 101.0)

    def fn(c):
        state = OkTopkState(tau_prime=8, raise_step=1.1, raise_tries=1, local_step=1.5)
        oktopk_allreduce(c, acc, 10, state)
        oktopk_allreduce(c, 2 * acc, 10, state)
        with pytest.raises(ValueError, match="local_step"):
            oktopk_allreduce(c, acc, 10, OkTopkState(local_step=0.5))
        with pytest.raises(ValueError, match="local_fit"):
            oktopk_allreduce(c, acc, 10, OkTopkState(local_fit="normal"))
        return state.local_th

    # one raise to 100.1: 50 of 2 * (1..100) pass (> 5k/4), so the correction multiplies by 1.5
    assert run_local(fn, 1, timeout=30)[0] == pytest.approx(91.0 * 1.1 * 1.5)


def test_a_corrupt_piece_raises_naming_the_lowest_rank_that_sent_one(monkeypatch):
    """Every piece a step received is checked together, before its indices address memory."""
    from bitcomm.collectives import oktopk

    size, n, k = 3, 300, 60
    accs = _accs(size, n, seed=4)
    real = oktopk._pack
    monkeypatch.setattr(oktopk, "_pack", lambda idx, val, n_: real(idx + n_, val, n_))

    def fn(c):
        try:
            oktopk_allreduce(c, accs[c.rank], k, OkTopkState(regions="even"), check=False)
        except ValueError as e:
            return str(e)
        return None

    out = run_local(fn, size, timeout=30)
    for rank, message in enumerate(out):
        lowest = min(r for r in range(size) if r != rank)
        assert message is not None and f"rank {lowest} sent indices outside" in message, out


@pytest.mark.parametrize("size", [2, 3, 4])
@pytest.mark.parametrize("path", ["torch", pytest.param(
    "triton", marks=[needs_interpreter, pytest.mark.triton])])
def test_a_call_reads_the_host_as_often_at_any_number_of_ranks(size, path):
    """On CUDA each host read waits for the device. A call that reuses its thresholds reads
    the local selection's counts by region, the pieces' counts, its own region's reduced count
    with the checks of the pieces received, every rank's global count, and the count of local
    entries that made it with the checks of all gathered entries: 5 reads whatever the ranks,
    none per piece. Recomputing the thresholds adds the regions' sizes (6: the thresholds come
    back with the counts), repartitioning the averaged boundaries with their cuts (7)."""
    n, k = 2000, 40
    accs = _accs(size, n, seed=5)
    states = [OkTopkState(tau_prime=2, tau=4) for _ in range(size)]

    def call():
        return run_local(lambda c: oktopk_allreduce(c, accs[c.rank], k, states[c.rank],
                                                    check=False), size)

    with forced(path):
        for recomputed, repartitioned, want in [(True, True, 7), (False, False, 5),
                                                (True, False, 6)]:
            reads = host_reads(call)
            assert all(s.last.recomputed == recomputed for s in states)
            assert all(s.last.repartitioned == repartitioned for s in states)
            assert len(reads) == want * size, reads
    # the reads did not change what the call computes: Topk(sum_i Topk(acc_i)) at tau' = 1
    exact = [OkTopkState(tau_prime=1) for _ in range(size)]
    with forced(path):
        got = run_local(lambda c: oktopk_allreduce(c, accs[c.rank], k, exact[c.rank]), size)
    u, local = oracle(accs, k)
    for r, (out, idx) in enumerate(got):
        assert torch.equal(out, u) and torch.equal(idx, local[r])


def test_indices_of_a_mask_whose_count_is_known(monkeypatch):
    """``_frame.indices_of`` gives torch.nonzero's indices (numpy's on the CPU) without
    reading the count back off the numpy path; a torch without ``nonzero_static`` for the
    device takes torch.nonzero, the same indices."""
    from bitcomm.codecs import _frame

    g = torch.Generator().manual_seed(3)
    masks = [torch.zeros(0, dtype=torch.bool), torch.zeros(9, dtype=torch.bool),
             torch.ones(9, dtype=torch.bool), torch.rand(1001, generator=g) > 0.9]
    for mask in masks:
        want = torch.nonzero(mask).reshape(-1)
        for path in ("numpy", "torch"):
            with forced(path):
                got = _frame.indices_of(mask, int(mask.sum()))
            assert got.dtype == torch.int64 and torch.equal(got, want), path
        with forced("torch"):
            assert host_reads(lambda m=mask: _frame.indices_of(m, 0)) == []

    def missing(*args, **kwargs):
        raise NotImplementedError("Could not run 'aten::nonzero_static' with arguments from "
                                  "the 'CUDA' backend")

    monkeypatch.setattr(torch, "nonzero_static", missing)
    assert torch.equal(_frame.indices_of(masks[-1], 7), torch.nonzero(masks[-1]).reshape(-1))


def test_the_kth_largest_on_the_numpy_path_is_the_sorted_kth():
    """The exact thresholds on a CPU come from select's numpy top-k (its sampled bracket above
    2**18 values): the k-th of the values sorted in descending order, with ties, zeros and
    every numpy float dtype."""
    from bitcomm.collectives.oktopk import _kth_largest

    g = torch.Generator().manual_seed(31)
    n = (1 << 18) + 5
    mags = [torch.randn(n, generator=g).abs(), torch.randint(0, 40, (n,), generator=g) / 8.0]
    mags[0][torch.rand(n, generator=g) < 0.995] = 0  # the k-th largest ties among zeros
    for a in mags:
        for dtype in (torch.float32, torch.float16, torch.float64):
            v = a.to(dtype)
            ranked = v.sort(descending=True).values
            for k in (1, 2621, n // 100 * 3, n - 1):
                got = _kth_largest(v, k)
                assert got.dtype == dtype and got.item() == ranked[k - 1].item(), (dtype, k)
