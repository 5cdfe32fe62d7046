"""The registry of collectives: calls, byte formulas, references and the one timing loop."""

import pytest
import torch

from bitcomm.collectives import registry
from bitcomm.comm import run_local


def _measured(spec, c, seed, n):
    """Return the call the benchmarks measure on rank ``c`` (after a first call on the same
    state for a primed collective): its result, the bytes it sent and the state."""
    x = registry.standard_input(seed, c.rank, n)
    state = spec.new_state(n, c.size)
    if spec.primed:
        spec(c, x, state=state)
    c.counters.reset()
    return spec(c, x, state=state), c.counters.total_sent, state


@pytest.mark.parametrize("name", list(registry.COLLECTIVES))
@pytest.mark.parametrize("size,n", [(1, 17), (3, 1001), (4, 4096)])
def test_every_collective_sends_its_formula_and_agrees(name, size, n):
    spec = registry.get(name)

    def rank(c):
        out, sent, _ = _measured(spec, c, 5, n)
        return out, sent, spec.expected_bytes(n, c.size, c.rank, seed=5)

    results = run_local(rank, size)
    for out, sent, expected in results:
        assert sent == expected
        assert torch.equal(out.view(torch.uint8), results[0][0].view(torch.uint8))
    if spec.is_majority:
        # The majority written out here, not by the registry: +1 where more than half vote +1.
        votes = sum((registry.standard_input(5, r, n) >= 0).int() for r in range(size))
        assert torch.equal(results[0][0], torch.where(2 * votes > size, 1.0, -1.0))
        assert torch.equal(spec.reference(5, size, n), results[0][0])
    else:
        assert spec.reference(5, size, n) is None


def test_standard_input_depends_on_seed_and_rank():
    a = registry.standard_input(1, 0, 64)
    assert a.dtype == torch.float32 and a.shape == (64,)
    assert torch.equal(a, registry.standard_input(1, 0, 64))
    assert not torch.equal(a, registry.standard_input(1, 1, 64))
    assert not torch.equal(a, registry.standard_input(2, 0, 64))


def test_get_names_the_choices():
    with pytest.raises(ValueError, match="ring-majority"):
        registry.get("ring")
    with pytest.raises(ValueError, match="expected a collective in"):
        registry.get("allreduce", emulated=True)  # the native allreduce is not traceable
    assert registry.get("onebit-allreduce", emulated=True).name == "onebit-allreduce"
    assert set(registry.EMULATED) < set(registry.COLLECTIVES)


def test_mismatches_counts_against_a_reference_and_across_ranks():
    def rank(c):
        good = torch.ones(10)
        ref = registry.mismatches(c, good, torch.ones(10))
        off = registry.mismatches(c, good, torch.cat([torch.ones(7), -torch.ones(3)]))
        same = registry.mismatches(c, good, None)
        differs = registry.mismatches(c, good * (2 if c.rank == 2 else 1), None)
        return ref, off, same, differs

    for ref, off, same, differs in run_local(rank, 3):
        assert (ref, off, same) == (0, 9, 0)  # 3 wrong on each of 3 ranks
        assert differs == 10  # only rank 2's bytes differ from rank 0's


def test_allgather_floats_returns_every_rank_in_order():
    out = run_local(lambda c: c.allgather_floats([c.rank + 0.5, -c.rank, 1e300]), 4)
    expected = [[r + 0.5, -r, 1e300] for r in range(4)]
    assert all(got == expected for got in out)


def test_allgather_ints_returns_every_rank_in_order_beyond_floats_exact_range():
    big = (1 << 63) - 1  # float64 would round it to 2**63
    out = run_local(lambda c: (c.allgather_ints([c.rank, -(1 << 62) - 1, big]), c.counters), 3)
    expected = [[r, -(1 << 62) - 1, big] for r in range(3)]
    assert all(got == expected for got, _ in out)
    assert all(sum(counters.sent) == 2 * 24 for _, counters in out)
    assert run_local(lambda c: c.allgather_ints([]), 2) == [[[], []], [[], []]]
    with pytest.raises(OverflowError, match="int64 holds, got 9223372036854775808"):
        run_local(lambda c: c.allgather_ints([1 << 63]), 1)


def test_combine_takes_the_slowest_rank_per_call_and_sums_cpu():
    def rank(c):
        wall = [0.1 * (c.rank + 1), 0.5 if c.rank == 0 else 0.2]
        return registry.combine(c, (wall, [1.0, 2.0]))

    for timing in run_local(rank, 3):
        assert timing.seconds == [pytest.approx(0.3), 0.5]
        assert timing.cpu_seconds == [3.0, 6.0]
        assert timing.spread == (pytest.approx(0.3), pytest.approx(0.4), 0.5)


def test_time_calls_runs_each_call_after_a_barrier():
    calls = []

    def rank(c):
        wall, cpu = registry.time_calls(c, lambda: calls.append(c.rank), 4)
        return len(wall), len(cpu), all(t >= 0 for t in wall + cpu)

    assert run_local(rank, 2) == [(4, 4, True)] * 2
    assert sorted(calls) == [0] * 4 + [1] * 4


def test_sparcml_collectives_take_a_density_after_the_name():
    five = registry.get("ssar-split-allgather@5%")
    assert five.name == "ssar-split-allgather@0.05" and five.emulated
    assert registry.get("dsar-split-allgather@0.25").name == "dsar-split-allgather@0.25"
    assert registry.get("ssar-recursive-double").name == "ssar-recursive-double"  # 1%
    assert registry.is_emulated("stream-allgather@10%")
    assert not registry.is_emulated("allreduce") and not registry.is_emulated("ring@5%")
    for bad in ("ssar-split-allgather@0", "ssar-split-allgather@150%", "ssar-split-allgather@x"):
        with pytest.raises(ValueError, match="expected a density in"):
            registry.get(bad)
    with pytest.raises(ValueError, match="expected a collective in"):
        registry.get("ring-majority@5%")
    # the top 5% of every rank's standard input: 50 of 1000 entries, by increasing index
    idx, val = registry.sparse_input(registry.standard_input(0, 1, 1000), 0.05)
    x = registry.standard_input(0, 1, 1000)
    assert idx.numel() == 50 and bool((idx[1:] > idx[:-1]).all())
    assert torch.equal(val, x[idx])
    assert float(val.abs().min()) >= float(x.abs().sort().values[-50])

    def rank(c):
        x = registry.standard_input(3, c.rank, 1000)
        c.counters.reset()
        out = five(c, x)
        return out, c.counters.total_sent, five.expected_bytes(1000, c.size, c.rank, seed=3)

    results = run_local(rank, 3)
    want = torch.zeros(1000)
    for r in range(3):
        i, v = registry.sparse_input(registry.standard_input(3, r, 1000), 0.05)
        want[i] += v
    for out, sent, expected in results:
        assert sent == expected and torch.allclose(out, want, atol=1e-6)
    # the bytes depend on the inputs: another seed's formula differs
    assert any(five.expected_bytes(1000, 3, r, seed=4) != results[r][2] for r in range(3))


def test_oktopk_is_registered_as_a_steady_call_of_topk_of_the_sum_of_topk():
    spec = registry.get("oktopk@5%")
    assert spec.name == "oktopk@0.05" and spec.primed and spec.emulated
    assert registry.get("oktopk").summary.endswith("(top 1.000% per rank)")
    n, size, k = 1000, 4, 50

    def rank(c):
        out, sent, state = _measured(spec, c, 2, n)
        return out, state.last, sent

    results = run_local(rank, size)
    # written out here: the sum of every rank's top k by |x|, then its top k
    total = torch.zeros(n)
    for r in range(size):
        x = registry.standard_input(2, r, n)
        i = torch.topk(x.abs(), k).indices
        total[i] += x[i]
    keep = torch.topk(total.abs(), k).indices
    want = torch.zeros(n)
    want[keep] = total[keep]
    for r, (out, last, sent) in enumerate(results):
        assert not last.recomputed and not last.repartitioned
        assert torch.allclose(out, want, atol=1e-6) and torch.equal(out, results[0][0])
        assert sent == spec.expected_bytes(n, size, r, seed=2)


def test_skewed_inputs_crowd_every_ranks_top_k_towards_the_end():
    x = registry.standard_input(0, 1, 1000)
    y = registry.skewed(x)
    assert y[999] == x[999] * (999.5 / 1000) ** 3 and y[0] == x[0] * (0.5 / 1000) ** 3
    for r in range(3):
        top = torch.topk(registry.skewed(registry.standard_input(0, r, 1000)).abs(), 50).indices
        assert int((top >= 750).sum()) > 35  # the last quarter holds most of the top 5%


@pytest.mark.parametrize("name", ["oktopk-skewed", "oktopk-skewed-direct@2%",
                                  "oktopk-skewed-even@0.5%"])
def test_oktopk_variants_on_skewed_inputs_agree_and_send_their_formula(name):
    spec = registry.get(name)
    assert spec.primed and registry.is_emulated(name) and name.split("@")[0] not in \
        registry.COLLECTIVES
    n, size = 2000, 4

    def rank(c):
        out, sent, _ = _measured(spec, c, 1, n)
        return out, sent, spec.expected_bytes(n, c.size, c.rank, seed=1)

    results = run_local(rank, size)
    for out, sent, expected in results:
        assert sent == expected and torch.equal(out, results[0][0])


def test_on_skewed_inputs_balanced_regions_and_blocks_carry_less_than_the_naive_ones():
    """The paper's Figure 7 comparison, in entries: the busiest reducer and the largest
    allgatherv block of the naive variants against Ok-Topk's balanced ones."""
    n, size = 20000, 8

    def most(name):
        spec = registry.get(name)

        stats = run_local(lambda c: _measured(spec, c, 2, n)[2].last, size)
        return max(s.received for s in stats), max(s.block for s in stats)

    even, direct, balanced = (most(f"oktopk-skewed{v}@1%") for v in ("-even", "-direct", ""))
    assert even[0] > 3 * direct[0]  # even regions: the last ones reduce most entries
    assert direct[1] > balanced[1]  # balancing the blocks shrinks the largest one
