"""DDP hook states and hooks in-process: thread ranks (LocalComm) and stand-in buckets.

DDP itself is exercised over gloo in test_multiprocess.py; here each rank hands the hooks
objects with GradBucket's interface, so layouts, rebuilds, checkpoints and pickling can be
driven exactly.
"""

import inspect
import math
import pickle
import struct

import pytest
import torch

from bitcomm.codecs import _frame, qsgd
from bitcomm.comm import run_local
from bitcomm.train.hooks import (
    OneBitHookState,
    ParamBuffers,
    QsgdState,
    SignState,
    TopkState,
    onebit_hook,
    qsgd_hook,
    sign_majority_hook,
    topk_hook,
)

from conftest import OTHER_PATHS, forced, host_reads, needs_interpreter


class Bucket:
    """What a hook reads of ``dist.GradBucket``: a flat gradient of whole parameters."""

    def __init__(self, index, params, grads, last=True):
        self._index, self._params, self._last = index, list(params), last
        self._buffer = torch.cat([g.reshape(-1) for g in grads])

    def buffer(self):
        return self._buffer

    def index(self):
        return self._index

    def parameters(self):
        return self._params

    def is_last(self):
        return self._last


def test_param_buffers_follow_their_parameters_across_a_rebuild():
    a, b, c = torch.zeros(2), torch.zeros(3), torch.zeros(1)
    buffers = ParamBuffers()
    first = buffers.get(Bucket(0, [a, b, c], [a, b, c]))
    first.copy_(torch.tensor([1., 2., 10., 20., 30., 100.]))
    # DDP's rebuild: two buckets, parameters in another order
    one = buffers.get(Bucket(0, [c, a], [c, a], last=False))
    two = buffers.get(Bucket(1, [b], [b], last=True))
    assert one.tolist() == [100., 1., 2.]
    assert two.tolist() == [10., 20., 30.]
    assert len(buffers) == 6 and sorted(buffers._flats) == [0, 1]
    # the same layout again is the same buffer; fewer buckets drop the stale ones
    assert buffers.get(Bucket(0, [c, a], [c, a], last=False)) is one
    merged = buffers.get(Bucket(0, [a, b, c], [a, b, c], last=True))
    assert merged.tolist() == [1., 2., 10., 20., 30., 100.]
    assert sorted(buffers._flats) == [0] and len(buffers) == 6


def test_param_buffers_refuse_a_bucket_its_parameters_do_not_fill():
    """A hook's buffers follow whole parameters: a gradient longer or shorter than the
    bucket's parameters (not a dense bucket DDP makes) is refused, naming the bucket."""
    a, b = torch.zeros(2), torch.zeros(3)
    for grads in ([torch.zeros(6)], [torch.zeros(4)]):
        with pytest.raises(ValueError, match=r"bucket 1's parameters to fill its \d gradient"):
            ParamBuffers().get(Bucket(1, [a, b], grads))


def test_param_buffers_state_dict_goes_back_by_parameter_number():
    a, b = torch.zeros(2), torch.zeros(1)
    saved = ParamBuffers()
    saved.get(Bucket(0, [a, b], [a, b])).copy_(torch.tensor([1., 2., 3.]))
    sd = saved.state_dict()
    assert set(sd) == {0, 1}
    # a new run numbers the parameters in the order its first bucket shows them
    a2, b2 = torch.zeros(2), torch.zeros(1)
    fresh = ParamBuffers()
    fresh.load_state_dict(sd)
    assert fresh.get(Bucket(0, [a2, b2], [a2, b2])).tolist() == [1., 2., 3.]
    with pytest.raises(TypeError, match="parameter number"):
        fresh.load_state_dict({"0:3": torch.zeros(3)})


def test_param_buffers_replace_takes_the_new_tensor_as_the_parameters_values():
    """replace() makes the new tensor the bucket's buffer (no copy), frees the old one, and
    the parameters' values follow it into a checkpoint and across a rebuild."""
    import gc
    import weakref

    a, b, empty = torch.zeros(2), torch.zeros(3), torch.zeros(0)
    buffers = ParamBuffers()
    old = buffers.get(Bucket(0, [a, b, empty], [a, b, empty]))
    old.copy_(torch.tensor([1., 2., 3., 4., 5.]))
    new = torch.tensor([10., 20., 30., 40., 50.])
    buffers.replace(old, new)
    assert buffers.get(Bucket(0, [a, b, empty], [a, b, empty])) is new
    assert old.tolist() == [1., 2., 3., 4., 5.]  # untouched: nothing was copied
    gone = weakref.ref(old)
    del old
    gc.collect()
    assert gone() is None  # no view of the parameters keeps the old buffer alive
    assert {k: v.tolist() for k, v in buffers.state_dict().items()} == {
        0: [10., 20.], 1: [30., 40., 50.], 2: []}
    assert len(buffers) == 5
    # replaced again before anything reads the views: the latest tensor counts
    newer = torch.tensor([6., 7., 8., 9., 0.])
    buffers.replace(new, newer)
    one = buffers.get(Bucket(0, [b], [b], last=False))
    two = buffers.get(Bucket(1, [a], [a], last=True))
    assert one.tolist() == [8., 9., 0.] and two.tolist() == [6., 7.]
    # the old layout's buffer is no longer the bucket's: replace copies into it, as a write
    # into it would, and the parameters keep their values
    buffers.replace(newer, torch.ones(5))
    assert newer.tolist() == [1.] * 5
    assert buffers.get(Bucket(0, [b], [b], last=False)).tolist() == [8., 9., 0.]
    with pytest.raises(TypeError, match="float32"):
        buffers.replace(one, one.double())
    with pytest.raises(ValueError, match="shape"):
        buffers.replace(one, torch.zeros(4))
    with pytest.raises(ValueError, match="contiguous"):
        buffers.replace(one, torch.zeros(6)[::2])


def one_bucket_steps(hook, make_state, grads, held, steps, size=2):
    """Run ``steps`` steps of ``hook`` on one bucket of one parameter on ``size`` thread ranks,
    ``grads(rank, step)`` its gradient; return, per rank and step, the output, the state's
    buffer ``held`` of the bucket after the step, and a copy of its values."""
    def rank_fn(comm):
        state, got = make_state(comm), []
        p = torch.zeros(grads(0, 0).numel())
        for step in range(steps):
            bucket = Bucket(0, [p], [grads(comm.rank, step)])
            out = hook(state, bucket).wait()
            buffer = getattr(state, held).get(bucket)
            got.append((out, buffer, buffer.clone()))
        state.close()
        return got
    return run_local(rank_fn, size=size)


def randn_grads(n, dtype=torch.float32):
    """Gradients of ``n`` elements drawn from a seed of the rank and the step."""
    return lambda rank, step: torch.randn(
        n, generator=torch.Generator().manual_seed(10 * rank + step)).to(dtype)


@pytest.mark.parametrize("hook, make_state, held", [
    (sign_majority_hook, lambda c: SignState(c, momentum=0.9, overlap=False), "momenta"),
    (qsgd_hook, lambda c: QsgdState(c, seed=3, overlap=False), "residuals"),
    (topk_hook, lambda c: TopkState(c, density=0.1, overlap=False), "residuals"),
    (onebit_hook, lambda c: OneBitHookState(c, overlap=False), "worker_errors")])
def test_hooks_take_their_new_buffers_rather_than_copying_them(hook, make_state, held):
    """A step's momentum, residual or worker error becomes the bucket's buffer as computed:
    the buffer of the step before is left as it was (a copy into it would have overwritten
    it)."""
    for seen in one_bucket_steps(hook, make_state, randn_grads(300), held, 3):
        for (_, before, kept), (_, after, _) in zip(seen[:-1], seen[1:], strict=True):
            assert after is not before
            assert torch.equal(before, kept)


def run_hook(hook, make_state, grads_of_rank, size=2, steps=1, layouts=None):
    """Run ``steps`` iterations of ``hook`` on thread ranks; return each rank's outputs."""
    def rank_fn(comm):
        state = make_state(comm)
        params = [torch.zeros(g.numel()) for g in grads_of_rank(0, 0)]
        outs = []
        for step in range(steps):
            grads = grads_of_rank(comm.rank, step)
            buckets = (layouts or (lambda s, p, g: [Bucket(0, p, g)]))(step, params, grads)
            # as DDP does: every bucket's hook is called before any future is waited for
            futures = [hook(state, bk) for bk in buckets]
            outs.append([f.wait() for f in futures])
        state.close()
        return outs, state
    return run_local(rank_fn, size=size)


@pytest.mark.parametrize("overlap", [True, False])
def test_qsgd_hook_without_feedback_is_the_mean_of_the_workers_quantised_gradients(overlap):
    """error_feedback=False: each step's bucket becomes the rank-order mean of the workers'
    frames as qsgd.decode reads them (rank r of step t rounding with seed + t * N + r), and
    no residual is kept."""
    size, n, seed = 3, 300, 7
    grads = randn_grads(n)
    res = run_hook(qsgd_hook, lambda c: QsgdState(c, bits=2, bucket_size=64, seed=seed,
                                                  error_feedback=False, overlap=overlap),
                   lambda r, t: [grads(r, t)], size=size, steps=2)
    for step in range(2):
        decoded = [qsgd.decode(qsgd.encode(grads(r, step), 2, 64, seed=seed + step * size + r))[0]
                   for r in range(size)]
        want = (decoded[0] + decoded[1] + decoded[2]) / size
        for outs, state in res:
            assert torch.equal(outs[step][0], want), step
            assert not state.error_feedback and len(state.residuals) == 0


def opposite(rank, step):
    return [torch.tensor([1., -2., 3.]) * (1 if rank == 0 else -1), torch.tensor([0.5])]


@pytest.mark.parametrize("overlap", [True, False])
def test_hooks_agree_on_every_rank_with_and_without_overlap(overlap):
    def grads(rank, step):
        g = torch.Generator().manual_seed(10 * rank + step)
        return [torch.randn(5, generator=g), torch.randn(3, generator=g)]

    for hook, make in ((sign_majority_hook, lambda c: SignState(c, overlap=overlap)),
                       (onebit_hook, lambda c: OneBitHookState(c, overlap=overlap)),
                       (qsgd_hook, lambda c: QsgdState(c, overlap=overlap)),
                       (topk_hook, lambda c: TopkState(c, density=0.5, overlap=overlap))):
        res = run_hook(hook, make, grads, size=3, steps=3)
        for step in range(3):
            assert torch.equal(res[0][0][step][0], res[1][0][step][0]), hook.__name__
            assert torch.equal(res[0][0][step][0], res[2][0][step][0]), hook.__name__


def test_sign_hook_default_tie_is_unbiased():
    """The first three elements of ``opposite`` tie (the last is +0.5 on both workers): by
    default a tie alternates by element index and by iteration, so they are neither all -1 nor
    all +1, and flip at the next step."""
    res = run_hook(sign_majority_hook, lambda c: SignState(c), opposite, steps=2)
    for outs, _ in res:
        assert outs[0][0].tolist() == [1., -1., 1., 1.]
        assert outs[1][0].tolist() == [-1., 1., -1., 1.]
    negative = run_hook(sign_majority_hook, lambda c: SignState(c, tie="negative"), opposite)
    assert negative[0][0][0][0].tolist() == [-1., -1., -1., 1.]


def test_overlap_and_blocking_give_the_same_bits():
    def grads(rank, step):
        g = torch.Generator().manual_seed(10 * rank + step)
        return [torch.randn(70, generator=g)]

    fast = run_hook(qsgd_hook, lambda c: QsgdState(c, bits=4, bucket_size=16), grads, steps=4)
    slow = run_hook(qsgd_hook, lambda c: QsgdState(c, bits=4, bucket_size=16, overlap=False),
                    grads, steps=4)
    for step in range(4):
        assert torch.equal(fast[0][0][step][0], slow[0][0][step][0])


def test_a_failure_on_the_thread_reaches_the_future_on_every_rank():
    def rank_fn(comm):
        state = SignState(comm, collective="ring" if comm.rank == 0 else "alltoall")
        fut = sign_majority_hook(state, Bucket(0, [torch.zeros(2)], [torch.ones(2)]))
        with pytest.raises(ValueError, match="expected the same collective"):
            fut.wait()
        state.close()
        return True

    assert run_local(rank_fn, size=2) == [True, True]


@pytest.mark.parametrize("overlap", [True, False])
def test_an_overflow_on_one_rank_gives_nan_on_every_rank_and_keeps_the_buffers(overlap):
    """What DDP's allreduce does with an inf, so GradScaler skips the step on every rank."""
    makes = {sign_majority_hook: lambda c: SignState(c, momentum=0.5, overlap=overlap),
             onebit_hook: lambda c: OneBitHookState(c, overlap=overlap),
             qsgd_hook: lambda c: QsgdState(c, bits=4, bucket_size=4, overlap=overlap),
             topk_hook: lambda c: TopkState(c, density=0.5, overlap=overlap)}
    for hook, make in makes.items():
        def rank_fn(comm, hook=hook, make=make):
            state, p = make(comm), torch.zeros(6)
            grads = torch.tensor([1., -2., 3., 0.5, -1., 2.]) * (comm.rank + 1)
            hook(state, Bucket(0, [p], [grads])).wait()
            def buffers():
                sd = state.state_dict()
                return {(name, k): t for name in type(state)._buffers
                        for k, t in sd[name].items()}

            before = buffers()
            bad = grads.clone()
            if comm.rank == 1:
                bad[2] = float("inf")
            out = hook(state, Bucket(0, [p], [bad])).wait()
            after = buffers()
            kept = before.keys() == after.keys() and all(
                torch.equal(before[k], after[k]) for k in before)
            return bool(out.isnan().all()), kept

        assert run_local(rank_fn, size=2) == [(True, True), (True, True)], hook.__name__


def test_onebit_freeze_step_averages_exactly_then_compresses():
    res = run_hook(onebit_hook, lambda c: OneBitHookState(c, freeze_step=2), opposite, steps=3)
    outs = res[0][0]
    # warm-up: the exact mean of opposite gradients is zero, the bias gradient's is 0.5
    for step in (0, 1):
        assert outs[step][0].tolist() == [0., 0., 0., 0.5]
    assert res[0][1].iteration == 3
    # compressed: signs times a scale, not the exact mean
    assert outs[2][0].tolist() != [0., 0., 0., 0.5]


def test_onebit_warm_up_averages_through_the_transports_allreduce(monkeypatch):
    """DDP's own average while 1-bit Adam warms up: one allreduce of the bucket, whose
    transport's algorithm moves 2(N-1)/N of it a rank on a ring, not a gather of every rank's
    bucket (N - 1 of them): N/2 times the traffic, 4x at 8 ranks."""
    from bitcomm.comm.local import LocalComm

    calls = []
    allreduce, allgatherv = LocalComm.allreduce, LocalComm.allgatherv

    def counted(name, real):
        def method(self, *args):
            calls.append(name)
            return real(self, *args)
        return method

    monkeypatch.setattr(LocalComm, "allreduce", counted("allreduce", allreduce))
    monkeypatch.setattr(LocalComm, "allgatherv", counted("allgatherv", allgatherv))
    res = run_hook(onebit_hook, lambda c: OneBitHookState(c, freeze_step=1, check=False,
                                                          overlap=False), opposite)
    assert calls == ["allreduce"] * 2
    assert [r[0][0][0].tolist() for r in res] == [[0., 0., 0., 0.5]] * 2


def test_topk_residual_follows_the_parameters_across_a_rebuild():
    # step 0: one bucket [a, b]; step 1: two buckets [b] and [a] (DDP's rebuild)
    def layouts(step, params, grads):
        if step == 0:
            return [Bucket(0, params, grads)]
        return [Bucket(0, [params[1]], [grads[1]], last=False),
                Bucket(1, [params[0]], [grads[0]], last=True)]

    def grads(rank, step):
        return [torch.tensor([4., 1., 2.]), torch.tensor([3.])] if step == 0 else \
            [torch.zeros(3), torch.zeros(1)]

    res = run_hook(topk_hook, lambda c: TopkState(c, density=0.25), grads, size=1, steps=2,
                   layouts=layouts)
    outs, state = res[0]
    assert outs[0][0].tolist() == [4., 0., 0., 0.]  # top-1 of [4, 1, 2, 3]
    # the residual [0, 1, 2 | 3] moved with its parameters: b's 3 is now bucket 0's top-1
    assert outs[1][0].tolist() == [3.]
    assert outs[1][1].tolist() == [0., 0., 2.]
    assert len(state.residuals) == 4


def test_onebit_server_errors_of_buckets_a_rebuild_removed_are_dropped():
    """Server errors are kept per bucket index: after DDP's rebuild into fewer buckets, the
    last bucket's call drops those of the indices that no longer exist, and bucket 0's is
    made again for its new length (its worker error follows the parameters)."""
    def layouts(step, params, grads):
        if step == 0:
            return three_buckets(step, params, grads)
        return [Bucket(0, params, grads, last=True)]

    res = run_hook(onebit_hook, lambda c: OneBitHookState(c, freeze_step=0), step_grads,
                   size=2, steps=2, layouts=layouts)
    for outs, state in res:
        assert len(outs[0]) == 3 and len(outs[1]) == 1
        assert sorted(state.server_errors) == [0]
        assert state.server_errors[0].numel == 40 + 24 + 16
        assert len(state.worker_errors) == 80  # each parameter's once


def test_state_dict_resumes_a_hook_bit_identically():
    def grads(rank, step):
        g = torch.Generator().manual_seed(10 * rank + step)
        return [torch.randn(40, generator=g), torch.randn(9, generator=g)]

    for hook, make in ((qsgd_hook, lambda c: QsgdState(c, bits=2, bucket_size=8)),
                       (topk_hook, lambda c: TopkState(c, density=0.2)),
                       (sign_majority_hook, lambda c: SignState(c, momentum=0.5)),
                       (onebit_hook, lambda c: OneBitHookState(c))):
        def rank_fn(comm, hook=hook, make=make):
            params = [torch.zeros(40), torch.zeros(9)]
            state = make(comm)
            outs = []
            for step in range(4):
                if step == 2:  # checkpoint, then resume in a fresh state and fresh parameters
                    sd = state.state_dict()
                    state = make(comm)
                    state.load_state_dict(sd)
                    params = [torch.zeros(40), torch.zeros(9)]
                outs.append(hook(state, Bucket(0, params, grads(comm.rank, step))).wait())
            return outs

        def straight(comm, hook=hook, make=make):
            params, state = [torch.zeros(40), torch.zeros(9)], make(comm)
            return [hook(state, Bucket(0, params, grads(comm.rank, s))).wait() for s in range(4)]

        resumed, plain = run_local(rank_fn, size=2), run_local(straight, size=2)
        if hook is onebit_hook:
            # the server error is the bucket's and is not in the checkpoint: steps 0-1 match
            assert all(torch.equal(a, b) for a, b in zip(resumed[0][:2], plain[0][:2],
                                                         strict=True))
            continue
        for a, b in zip(resumed[0], plain[0], strict=True):
            assert torch.equal(a, b), hook.__name__


def test_state_dict_of_another_kind_or_options_is_refused():
    def rank_fn(comm):
        sd = QsgdState(comm, bits=8).state_dict()
        with pytest.raises(ValueError, match="QsgdState"):
            TopkState(comm).load_state_dict(sd)
        with pytest.raises(ValueError, match="options"):
            QsgdState(comm, bits=4).load_state_dict(sd)
        return True

    assert run_local(rank_fn, size=1) == [True]


def test_pickling_leaves_the_transport_out_with_a_warning():
    def rank_fn(comm):
        state = TopkState(comm, density=0.5)
        a = torch.zeros(4)
        topk_hook(state, Bucket(0, [a], [torch.tensor([1., -3., 2., 0.5])])).wait()
        with pytest.warns(UserWarning, match="not picklable"):
            blob = pickle.dumps(state)
        back = pickle.loads(blob)
        assert back.comm is None and back.density == 0.5
        assert back.residuals.state_dict()[0].tolist() == [1., 0., 0., 0.5]
        with pytest.raises(RuntimeError, match="set state.comm"):
            topk_hook(back, Bucket(0, [a], [torch.zeros(4)]))
        back.comm = comm
        # the kept residual goes out next: the top-2 of [1, 0, 0, 0.5]
        b = torch.zeros(4)  # numbered afresh: the unpickled state knows no parameter by id
        assert topk_hook(back, Bucket(0, [b], [torch.zeros(4)])).wait().tolist() == \
            [1., 0., 0., 0.5]
        return True

    assert run_local(rank_fn, size=1) == [True]


def test_each_state_takes_only_its_own_options():
    def rank_fn(comm):
        with pytest.raises(TypeError, match="bits"):
            TopkState(comm, bits=2)
        with pytest.raises(TypeError, match="density"):
            QsgdState(comm, density=0.1)
        with pytest.raises(TypeError, match="expected a TopkState, got QsgdState"):
            topk_hook(QsgdState(comm), Bucket(0, [torch.zeros(1)], [torch.zeros(1)]))
        with pytest.raises(ValueError, match="freeze_step"):
            OneBitHookState(comm, freeze_step=-1)
        with pytest.raises(ValueError, match="expected collective in"):
            OneBitHookState(comm, collective="ring")
        with pytest.raises(ValueError, match="tie"):
            SignState(comm, tie="up")
        with pytest.raises(ValueError, match=r"expected bits in \(2, 4, 8\), got 3"):
            QsgdState(comm, bits=3)
        for size in (0, True, 64.0):
            with pytest.raises(ValueError, match="bucket_size to be an int >= 1"):
                QsgdState(comm, bucket_size=size)
        with pytest.raises(TypeError, match="seed to be an int, got float"):
            QsgdState(comm, seed=1.0)
        with pytest.raises(ValueError, match="method in .* got 'exact'"):
            TopkState(comm, method="exact")
        return True

    assert run_local(rank_fn, size=1) == [True]


def three_buckets(step, params, grads):
    """Three buckets of one parameter each, the last one last."""
    return [Bucket(i, [p], [g], last=i == 2) for i, (p, g) in enumerate(zip(params, grads,
                                                                             strict=True))]


def step_grads(rank, step):
    g = torch.Generator().manual_seed(10 * rank + step)
    return [torch.randn(40, generator=g), torch.randn(24, generator=g), torch.randn(16,
                                                                                   generator=g)]


@pytest.mark.parametrize("size", [2, 3])
def test_a_step_of_known_buckets_makes_one_agreement(size):
    """Once a bucket layout has been agreed on, each bucket is only its exchange, and the step
    adds one 24-byte record per peer after its last bucket; the first step also runs each
    collective's own agreement (one more record per bucket and peer)."""
    # each bucket's messages without any agreement: the ring's 2(N-1) steps go to the next
    # rank; 1-bit's all-to-all and allgather, and qsgd's and top-k's allgather, to every peer
    def exchanges(hook, rank):
        if hook is sign_majority_hook:
            return [(rank + 1) % size] * 2 * (size - 1)
        peers = [d for d in range(size) if d != rank]
        # allgather_vote and onebit_allgather: 1, as qsgd and top-k
        return peers * (2 if hook is onebit_hook else 1)

    def allgather_vote(state, bucket):  # the one-round majority: one message per peer
        return sign_majority_hook(state, bucket)

    def onebit_allgather(state, bucket):  # every rank serving every chunk: one round
        return onebit_hook(state, bucket)

    makes = {sign_majority_hook: lambda c: SignState(c, momentum=0.5, collective="ring"),
             onebit_hook: lambda c: OneBitHookState(c, collective="alltoall"),
             onebit_allgather: lambda c: OneBitHookState(c, collective="allgather"),
             qsgd_hook: lambda c: QsgdState(c, bits=4, bucket_size=8),
             topk_hook: lambda c: TopkState(c, density=0.25),
             allgather_vote: lambda c: SignState(c, momentum=0.5, collective="allgather")}
    for hook, make in makes.items():
        def rank_fn(comm, hook=hook, make=make):
            state = make(comm)
            params = [torch.zeros(40), torch.zeros(24), torch.zeros(16)]
            traces = []
            for step in range(3):
                comm.trace = []
                futures = [hook(state, bk) for bk in three_buckets(
                    step, params, step_grads(comm.rank, step))]
                outs = [f.wait() for f in futures]
                traces.append(list(comm.trace))
            state.close()
            return traces, outs

        got = run_local(rank_fn, size=size)
        for rank, (traces, outs) in enumerate(got):
            peers = [d for d in range(size) if d != rank]
            for step, trace in enumerate(traces):
                agreements = 4 if step == 0 else 1
                expect = 3 * exchanges(hook, rank) + agreements * peers
                assert sorted(d for d, _, _ in trace) == sorted(expect), (hook.__name__, step)
                records = [b for _, b, _ in trace if b == 24]
                assert len(records) >= agreements * len(peers), hook.__name__
            assert all(torch.equal(a, b) for a, b in zip(outs, got[0][1], strict=True))


@pytest.mark.parametrize("path,overlap", [
    ("numpy", True), ("numpy", False), ("torch", True),
    pytest.param("triton", True, marks=[needs_interpreter, pytest.mark.triton])])
def test_an_overflow_in_one_bucket_skips_the_whole_step_on_every_rank(path, overlap):
    """Rank 1's middle bucket holds an inf in the third step: every bucket of that step is NaN
    on every rank, every buffer is as it was after the second step, and the fourth step then
    gives what it gives when the third step never happened. Off the numpy path (a GPU's: torch
    or Triton, run here on CPU tensors) the overflow is found on the device, read once per step."""
    makes = {sign_majority_hook: lambda c: SignState(c, momentum=0.5, overlap=overlap),
             onebit_hook: lambda c: OneBitHookState(c, overlap=overlap),
             qsgd_hook: lambda c: QsgdState(c, bits=4, bucket_size=8, overlap=overlap),
             topk_hook: lambda c: TopkState(c, density=0.25, overlap=overlap)}
    for hook, make in makes.items():
        def rank_fn(comm, hook=hook, make=make, overflow=True):
            state = make(comm)
            params = [torch.zeros(40), torch.zeros(24), torch.zeros(16)]
            outs, snapshots = [], {}
            for step in (0, 1, 2, 3) if overflow else (0, 1, 3):
                grads = step_grads(comm.rank, step)
                if step == 2 and comm.rank == 1:
                    grads[1][5] = float("inf")
                futures = [hook(state, bk) for bk in three_buckets(step, params, grads)]
                outs.append([f.wait() for f in futures])
                if step in (1, 2):
                    # the parameters' buffers, and 1-bit's server errors (the buckets')
                    servers = [one.server_error.clone() for one in
                               getattr(state, "server_errors", {}).values()]
                    snapshots[step] = (state.state_dict(), servers)
            state.close()
            if not overflow:
                return outs
            before, after = snapshots[1], snapshots[2]
            kept = all(torch.equal(before[0][name][k], after[0][name][k])
                       for name in type(state)._buffers for k in before[0][name])
            kept = kept and len(before[1]) == len(after[1]) and all(
                torch.equal(a, b) for a, b in zip(before[1], after[1], strict=True))
            return outs, kept

        with forced(path):
            got = run_local(rank_fn, size=2)
        for outs, kept in got:
            assert kept, hook.__name__
            assert all(bool(o.isnan().all()) for o in outs[2]), hook.__name__
            assert not any(bool(o.isnan().any()) for step in (0, 1, 3) for o in outs[step])
        if hook in (onebit_hook, topk_hook):
            # their results depend on nothing but the buffers and the gradients (sign's tie
            # phase and qsgd's seeds follow the call count): the skipped step left no trace
            with forced(path):
                clean = run_local(lambda c, hook=hook, make=make: rank_fn(c, hook, make, False),
                                  2)
            for a, b in zip(got[0][0][3], clean[0][2], strict=True):
                assert torch.equal(a, b), hook.__name__


@pytest.mark.parametrize("path", ["torch", pytest.param(
    "triton", marks=[needs_interpreter, pytest.mark.triton])])
def test_off_the_numpy_path_a_step_reads_its_overflow_once(path):
    """On a GPU each host read waits for the device: a step of known buckets checks them for
    NaN and inf on the device and reads the result once, at its agreement, however many
    buckets it has (CPU tensors on the paths a CUDA tensor takes)."""
    def reads(buckets):
        state = SignState(run_local(lambda c: c, 1)[0], overlap=False)
        params = [torch.zeros(8) for _ in range(buckets)]

        def step(k):
            grads = [torch.randn(8, generator=torch.Generator().manual_seed(k + i))
                     for i in range(buckets)]
            futures = [sign_majority_hook(state, Bucket(i, [p], [g], last=i == buckets - 1))
                       for i, (p, g) in enumerate(zip(params, grads, strict=True))]
            assert all(not bool(f.wait().isnan().any()) for f in futures)

        step(0)  # first sight of the layout: each bucket's collective agrees on its own
        with forced(path):
            seen = host_reads(lambda: step(1))
        state.close()
        return seen

    one, six = reads(1), reads(6)
    assert len(six) == len(one), six
    # the step's read: its overflow flags, with any checks its exchanges left (none here)
    lines, first = inspect.getsourcelines(_frame.read_checked)
    assert [name for name, file, line in six if file == _frame.__file__
            and first <= line < first + len(lines)] == ["tolist"], six


@pytest.mark.parametrize("path", OTHER_PATHS)
@pytest.mark.parametrize("kind", ["qsgd", "ring", "topk"])
def test_off_the_numpy_path_the_exchanges_checks_ride_on_the_steps_read(kind, path):
    """qsgd_allgather, the unfused majorities and sparse_allgather check what they received
    with one read at the end of a call. Under check=True a step's futures wait for its
    agreement anyway, so those checks are read there, with the overflow flags: a step reads
    the host as often with six buckets as with one (3 ranks, 1001 elements a bucket: the
    ring's payloads are padded; top-k's frames hold fp32 values)."""
    make = {"qsgd": (qsgd_hook, lambda c: QsgdState(c, bits=4, bucket_size=64, overlap=False)),
            "ring": (sign_majority_hook,
                     lambda c: SignState(c, collective="ring", overlap=False)),
            "topk": (topk_hook, lambda c: TopkState(c, density=0.05, overlap=False))}[kind]

    def reads(buckets):
        def rank_fn(comm):
            hook, state = make[0], make[1](comm)
            params = [torch.zeros(1001) for _ in range(buckets)]

            def step(k):
                grads = [torch.randn(1001, generator=torch.Generator().manual_seed(
                    100 * k + 10 * i + comm.rank)) for i in range(buckets)]
                futures = [hook(state, Bucket(i, [p], [g], last=i == buckets - 1))
                           for i, (p, g) in enumerate(zip(params, grads, strict=True))]
                return [f.wait() for f in futures]

            step(0)  # the layout's own agreements
            return state, step

        with forced(path):
            ranks = run_local(rank_fn, 3)
            got = []
            seen = host_reads(lambda: got.extend(
                run_local(lambda c: ranks[c.rank][1](1), 3)))
        for state, _ in ranks:
            state.close()
        assert all(torch.equal(a, b) for a, b in zip(got[0], got[1], strict=True))
        assert all(bool(torch.isfinite(t).all()) for t in got[0])
        return seen

    one, six = reads(1), reads(6)
    assert len(six) == len(one), six


def test_a_corrupt_frame_in_a_held_step_fails_it_on_every_rank_with_its_error():
    """Rank 1's qsgd frame reaches rank 0 with a NaN scale (corrupted on the way) in the
    second step's first bucket: its check is read at the step's agreement, so every rank
    fails every bucket of the step (the receiving rank with the decoder's error, the sender
    naming that rank), no residual changes, and the next step goes on in step on every
    rank."""
    def rank_fn(comm):
        state = QsgdState(comm, bits=4, bucket_size=8, overlap=False)
        params = [torch.zeros(40), torch.zeros(24)]
        honest = comm.allgatherv
        bad = {"on": False}

        def allgatherv(buf, sizes):
            got = honest(buf, sizes)
            if bad["on"] and comm.rank == 0 and buf.numel() == qsgd.encoded_size(40, 4, 8):
                got = list(got)
                got[1] = got[1].clone()
                got[1][qsgd.HEADER.size:qsgd.HEADER.size + 4] = torch.tensor(
                    list(struct.pack("<f", float("nan"))), dtype=torch.uint8)
                bad["on"] = False
            return got

        comm.allgatherv = allgatherv

        def step(k):
            grads = [torch.randn(p.numel(), generator=torch.Generator().manual_seed(
                10 * k + comm.rank)) for p in params]
            futures = [qsgd_hook(state, Bucket(i, [p], [g], last=i == 1))
                       for i, (p, g) in enumerate(zip(params, grads, strict=True))]
            out = []
            for f in futures:
                try:
                    out.append(f.wait())
                except ValueError as e:
                    out.append(e)
            return out

        step(0)
        before = state.state_dict()["residuals"]
        bad["on"] = True
        failed = step(1)
        after = state.state_dict()["residuals"]
        then = step(2)
        state.close()
        return failed, before, after, then

    with forced("torch"):
        out = run_local(rank_fn, 2)
    for rank, (failed, before, after, then) in enumerate(out):
        assert all(isinstance(e, ValueError) for e in failed), failed
        assert all("invalid arguments on rank(s) [0]" in str(e) for e in failed), failed
        if rank == 0:
            assert all("corrupt qsgd frame: expected a finite scale >= 0 in bucket 0" in str(e)
                       for e in failed), failed
        assert len(before) == 2 and all(bool(v.any()) for v in before.values())  # step 0's
        assert before.keys() == after.keys()
        assert all(torch.equal(before[k], after[k]) for k in before)
        assert all(isinstance(t, torch.Tensor) and bool(torch.isfinite(t).all()) for t in then)
    assert all(torch.equal(a, b) for a, b in zip(out[0][3], out[1][3], strict=True))


def test_a_step_that_never_reaches_its_last_bucket_is_dropped():
    """Backward stopped after bucket 0 (an exception in the user's code): the next step's bucket
    0 fails the held future instead of leaving it pending, and leaves the residual alone."""
    def rank_fn(comm):
        state = TopkState(comm, density=0.25, overlap=False)
        params = [torch.zeros(40), torch.zeros(24), torch.zeros(16)]
        warm = [topk_hook(state, bk) for bk in three_buckets(0, params, step_grads(0, 0))]
        [f.wait() for f in warm]
        before = state.state_dict()["residuals"]
        stray = topk_hook(state, three_buckets(1, params, step_grads(comm.rank, 1))[0])
        futures = [topk_hook(state, bk) for bk in three_buckets(2, params, step_grads(0, 2))]
        with pytest.raises(RuntimeError, match="new step began"):
            stray.wait()
        [f.wait() for f in futures]
        return all(torch.isfinite(t).all() for t in before.values())

    assert run_local(rank_fn, size=2) == [True, True]


def test_the_sign_hook_votes_by_allgather_at_two_ranks_and_by_ring_above():
    """collective="auto" (the default): at 2 ranks the allgather sends the ring's bytes in one
    message per bucket instead of two; at 3 ranks the ring's (N - 1) steps each way."""
    from bitcomm.collectives.majority import allgather_majority, ring_majority, vote_for

    assert vote_for("auto", 2) is allgather_majority and vote_for("auto", 3) is ring_majority
    with pytest.raises(ValueError, match="expected collective in"):
        vote_for("tree", 2)

    for size, per_bucket in ((2, 1), (3, 4)):
        def rank_fn(comm):
            state, p = SignState(comm), torch.zeros(100)
            grads = torch.randn(100, generator=torch.Generator().manual_seed(comm.rank))
            hook_bucket = Bucket(0, [p], [grads])
            sign_majority_hook(state, hook_bucket).wait()  # first sight: agreed on
            comm.trace = []
            out = sign_majority_hook(state, hook_bucket).wait()
            state.close()
            return out, len(comm.trace)

        got = run_local(rank_fn, size=size)
        records = size - 1  # the step's agreement, one record per peer
        assert all(n == per_bucket + records for _, n in got), got
        assert all(torch.equal(out, got[0][0]) for out, _ in got)


@pytest.mark.parametrize("path", ["numpy", "torch", pytest.param(
    "triton", marks=[needs_interpreter, pytest.mark.triton])])
def test_a_float64_gradient_beyond_float32s_range_is_an_overflow_in_every_step(path):
    """The hooks exchange float32: a float64 gradient of 1e300 is an inf once cast, so it
    skips its step as an inf does, in a held step (a known layout) as in the first."""
    makes = {sign_majority_hook: lambda c: SignState(c, overlap=False),
             qsgd_hook: lambda c: QsgdState(c, bits=4, bucket_size=8, overlap=False),
             topk_hook: lambda c: TopkState(c, density=0.25, overlap=False)}
    for hook, make in makes.items():
        def rank_fn(comm, hook=hook, make=make):
            state, p = make(comm), torch.zeros(16, dtype=torch.float64)
            outs = []
            for step in range(3):
                g = torch.linspace(-1, 1, 16, dtype=torch.float64) * (comm.rank + step + 1)
                if step in (0, 2) and comm.rank == 1:
                    g[3] = 1e300
                out = hook(state, Bucket(0, [p], [g])).wait()
                outs.append((out.dtype, bool(out.isnan().all()), bool(out.isnan().any())))
            state.close()
            return outs

        with forced(path):
            got = run_local(rank_fn, size=2)
        for outs in got:
            assert outs == [(torch.float64, True, True), (torch.float64, False, False),
                            (torch.float64, True, True)], (hook.__name__, path)


@pytest.mark.parametrize("path", ["torch", pytest.param(
    "triton", marks=[needs_interpreter, pytest.mark.triton])])
def test_off_the_numpy_path_the_screen_zeroes_in_place_and_flags_on_the_device(path):
    """A held step's bucket is screened without a copy: its NaN, inf and (float64) beyond
    float32's range become +0.0 in the bucket itself, the rest stays bit for bit, and the
    overflow is a device flag read at the agreement; a finite bucket is left as it was."""
    from bitcomm.train.hooks import _Step

    g = torch.linspace(-3, 3, 5000, dtype=torch.float64)
    finite = g.clone()
    bad = g.clone()
    bad[[0, 17, 4999]] = torch.tensor([float("nan"), -float("inf"), 1e300], dtype=g.dtype)
    with forced(path):
        step = _Step()
        assert step.screen(finite) is finite and torch.equal(finite, g)
        assert bool(step.finite) and not step.overflow
        assert step.screen(bad) is bad
        assert not bool(step.finite) and not step.overflow  # the flag is the device's
    expect = g.clone()
    expect[[0, 17, 4999]] = 0.0
    assert torch.equal(bad.view(torch.int64), expect.view(torch.int64))


@pytest.mark.parametrize("path", ["numpy", "torch", pytest.param(
    "triton", marks=[needs_interpreter, pytest.mark.triton])])
def test_qsgd_hook_error_feedback_keeps_what_quantisation_left_out(path):
    """Each step a worker sends c = g + e quantised (rank r's stream: seed + call * N + r),
    its residual becomes c less its decoded frame, bit for bit, and the result is the frames'
    decoded mean (worked out here from the codec by hand)."""
    size, n, seed = 2, 20, 4
    grads = randn_grads(n)
    with forced(path):
        got = one_bucket_steps(qsgd_hook, lambda c: QsgdState(
            c, bits=2, bucket_size=8, seed=seed, overlap=False), grads, "residuals", 2, size)
    residual = [torch.zeros(n) for _ in range(size)]
    for step in range(2):
        sent = []
        for r in range(size):
            c = grads(r, step) + residual[r]
            frame = qsgd.encode(c, 2, 8, seed=seed + step * size + r)
            sent.append(qsgd.decode(frame)[0])
            residual[r] = c - sent[r]
        mean = (sent[0] + sent[1]) / 2
        for r in range(size):
            out, _, kept = got[r][step]
            assert torch.equal(out, mean), (step, r)
            assert torch.equal(kept.view(torch.int32), residual[r].view(torch.int32)), (step, r)


@pytest.mark.parametrize("path", ["numpy", "torch", pytest.param(
    "triton", marks=[needs_interpreter, pytest.mark.triton])])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("collective", ["allgather", "ring", "alltoall"])
def test_sign_hook_votes_a_16_bit_gradient_without_widening_it(path, dtype, collective,
                                                               monkeypatch):
    """Without momentum a 16-bit bucket goes to the vote as it is, with no widened copy, and
    the result is its float32 cast's (signed zeros and subnormals included), in its dtype."""
    from bitcomm.train import hooks

    size, n = 3, 2000
    voted, vote_for = [], hooks.vote_for

    def recording(name, ranks):
        vote = vote_for(name, ranks)

        def wrapped(comm, x, **kwargs):
            voted.append(x.dtype)
            return vote(comm, x, **kwargs)
        return wrapped

    def grad(rank):
        g = torch.randn(n, generator=torch.Generator().manual_seed(rank)).to(dtype)
        g[:4] = torch.tensor([0.0, -0.0, 1e-7, -1e-7]).to(dtype)  # zeros and subnormals
        return g

    def rank_fn(comm, widen):
        state = SignState(comm, collective=collective, overlap=False)
        g = grad(comm.rank)
        out = sign_majority_hook(state, Bucket(0, [torch.zeros(n)], [g.float() if widen else g]))
        state.close()
        return out.wait()

    with forced(path):
        want = run_local(lambda c: rank_fn(c, True), size=size)
        monkeypatch.setattr(hooks, "vote_for", recording)
        got = run_local(lambda c: rank_fn(c, False), size=size)
    assert voted == [dtype] * size
    for out, expect in zip(got, want, strict=True):
        assert out.dtype == dtype and torch.equal(out.float(), expect)


@pytest.mark.parametrize("path", ["numpy", *OTHER_PATHS])
def test_hooks_hand_back_a_float32_bucket_itself_holding_the_result(path):
    """Each hook writes its exchange's result into a float32 bucket's buffer and hands that
    buffer back, as DDP's own allreduce does (DDP with gradient_as_bucket_view then copies
    nothing): the values of the exchange into a new tensor (a bucket of the same gradient
    that is not float32 gets a new tensor, rounded to its dtype)."""
    n = 500
    makes = {sign_majority_hook: lambda c: SignState(c, overlap=False),
             onebit_hook: lambda c: OneBitHookState(c, overlap=False),
             qsgd_hook: lambda c: QsgdState(c, bits=4, bucket_size=50, overlap=False),
             topk_hook: lambda c: TopkState(c, density=0.1, overlap=False)}
    for hook, make in makes.items():
        def rank_fn(comm, hook=hook, make=make):
            got = []
            for dtype in (torch.float32, torch.float64):
                state = make(comm)
                g = torch.randn(n, generator=torch.Generator().manual_seed(comm.rank))
                bucket = Bucket(0, [torch.zeros(n)], [g.to(dtype)])
                got.append((bucket.buffer(), hook(state, bucket).wait()))
                state.close()
            return got

        with forced(path):
            got = run_local(rank_fn, size=2)
        for (g32, out32), (g64, out64) in got:
            assert out32 is g32, hook.__name__
            assert out64 is not g64 and out64.dtype == torch.float64
            assert torch.equal(out32, out64.float()), hook.__name__


def test_a_float32_operand_is_a_16_bit_gradient_itself():
    """float32_operand hands 16-bit floats and float32 over as they are (torch widens them
    exactly as it adds: the bits of adding the cast) and rounds float64 to float32."""
    from bitcomm.train._common import float32_operand

    gen = torch.Generator().manual_seed(5)
    e = torch.randn(5000, generator=gen)
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        g = (torch.randn(5000, generator=gen) * 100).to(dtype)
        assert float32_operand(g) is g
        got = torch.add(e, float32_operand(g))
        assert got.dtype == torch.float32
        assert torch.equal(got.view(torch.int32), (e + g.float()).view(torch.int32)), dtype
    g = torch.tensor([1e-50, -1e-50, 1 + 2 ** -40], dtype=torch.float64)
    assert float32_operand(g).dtype == torch.float32
    assert torch.equal(float32_operand(g), g.float())


@pytest.mark.parametrize("path", ["numpy", "torch", pytest.param(
    "triton", marks=[needs_interpreter, pytest.mark.triton])])
@pytest.mark.parametrize("hook, make_state, held", [
    (qsgd_hook, lambda c: QsgdState(c, bits=4, bucket_size=64, seed=1, overlap=False),
     "residuals"),
    (topk_hook, lambda c: TopkState(c, density=0.05, overlap=False), "residuals"),
    (onebit_hook, lambda c: OneBitHookState(c, overlap=False), "worker_errors")])
def test_error_feedback_hooks_on_a_16_bit_bucket_give_its_float32_casts_bits(path, hook,
                                                                             make_state, held):
    """A bfloat16 bucket's residual (or worker error) and result over steps are those of its
    float32 cast, bit for bit (they are added to the 16-bit gradient as torch widens it)."""
    grads = randn_grads(1504, torch.bfloat16)
    with forced(path):
        want = one_bucket_steps(hook, make_state, lambda r, s: grads(r, s).float(), held, 3)
        got = one_bucket_steps(hook, make_state, grads, held, 3)
    for rank_got, rank_want in zip(got, want, strict=True):
        for (out, _, residual), (out32, _, residual32) in zip(rank_got, rank_want, strict=True):
            assert out.dtype == torch.bfloat16 and torch.equal(out, out32.bfloat16())
            assert torch.equal(residual.view(torch.int32), residual32.view(torch.int32))


@pytest.mark.parametrize("path", ["numpy", *OTHER_PATHS])
def test_topk_hook_averages_the_workers_top_k_and_keeps_the_rest(path):
    """Each step a worker adds its gradient to its residual, sends the k largest |values|, and
    keeps the rest as its residual; the result is the sum of every worker's sent entries over
    the number of workers, bit for bit (worked out here with torch.topk, k of 3 workers
    overlapping)."""
    size, n, density = 3, 200, 0.2
    k = math.ceil(density * n)
    grads = randn_grads(n)
    with forced(path):
        got = one_bucket_steps(topk_hook, lambda c: TopkState(c, density=density,
                                                                overlap=False),
                               grads, "residuals", 3, size)
    residual = [torch.zeros(n) for _ in range(size)]
    for step in range(3):
        total = torch.zeros(n)
        for r in range(size):
            v = residual[r] + grads(r, step)
            idx = torch.topk(v.abs(), k).indices
            total[idx] += v[idx]
            v[idx] = 0
            residual[r] = v
        for r in range(size):
            out, _, kept = got[r][step]
            assert torch.equal(out, total / size), (step, r)
            assert torch.equal(kept, residual[r]), (step, r)


@pytest.mark.parametrize("path", ["numpy", "torch", pytest.param(
    "triton", marks=[needs_interpreter, pytest.mark.triton])])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_sign_hook_momentum_is_signums_bit_for_bit(path, dtype):
    """Each step a worker's momentum becomes torch's ``m.mul(beta).add_(g, alpha=1 - beta)``
    of its gradient (a float16 one rounded to float32 first), bit for bit on every path, and
    the vote is on that momentum: where the two workers' momenta agree in sign, so does the
    result."""
    size, n, beta = 2, 3000, 0.9
    grads = randn_grads(n, dtype)
    with forced(path):
        got = one_bucket_steps(sign_majority_hook, lambda c: SignState(
            c, momentum=beta, overlap=False), grads, "momenta", 3, size)
    m = [torch.zeros(n) for _ in range(size)]
    for step in range(3):
        for r in range(size):
            m[r] = m[r].mul(beta).add_(grads(r, step).float(), alpha=1 - beta)
            assert torch.equal(got[r][step][2].view(torch.int32), m[r].view(torch.int32)), \
                (step, r)
        agree = (m[0] >= 0) == (m[1] >= 0)
        expect = torch.where(m[0] >= 0, 1.0, -1.0)[agree]
        for r in range(size):
            out = got[r][step][0]
            assert out.dtype == dtype and torch.equal(out[agree].float(), expect), (step, r)
