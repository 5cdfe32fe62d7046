"""Optimizers of bitcomm.train against hand-computed steps, resumption, and checks."""

import io
import math

import pytest
import torch
from test_collectives import onebit_reference

from bitcomm.codecs import qsgd, sidco
from bitcomm.collectives import sparse_allgather
from bitcomm.comm import run_local
from bitcomm.train import (
    QSGDSGD,
    RGC,
    ErrorFeedback,
    MajoritySignSGD,
    OkTopkSGD,
    OneBitAdam,
    SIDCoSGD,
    SparCMLSGD,
)
from bitcomm.train.sparcml_sgd import bucket_topk


def _param(*values):
    return torch.nn.Parameter(torch.tensor(values, dtype=torch.float32))


def _grad(p, *values):
    p.grad = torch.tensor(values, dtype=torch.float32)


# -- error feedback -------------------------------------------------------------------------------

def test_error_feedback_keeps_what_was_dropped():
    fb = ErrorFeedback()
    c = fb.compensate("w", torch.tensor([0.3, -1.2]))
    assert c.tolist() == pytest.approx([0.3, -1.2])
    fb.update("w", c, torch.tensor([0.0, -1.0]))
    assert fb.residuals["w"].tolist() == pytest.approx([0.3, -0.2])
    assert fb.compensate("w", torch.tensor([0.1, 0.1])).tolist() == pytest.approx([0.4, -0.1])
    saved = fb.state_dict()
    other = ErrorFeedback()
    other.load_state_dict(saved)
    fb.residuals["w"].zero_()  # the saved copy does not alias the live residual
    assert other.residuals["w"].tolist() == pytest.approx([0.3, -0.2])
    with pytest.raises(ValueError, match="shape"):
        other.compensate("w", torch.zeros(3))
    with pytest.raises(TypeError):
        other.load_state_dict({"w": [1.0]})


# -- MajoritySignSGD ------------------------------------------------------------------------------

@pytest.mark.parametrize("collective", ["auto", "ring", "alltoall", "allgather"])
def test_majority_sign_sgd_two_workers_tie_goes_negative(collective):
    grads = [(0.5, -2.0), (0.3, 1.0)]

    def fn(c):
        p = _param(1.0, 1.0)
        opt = MajoritySignSGD([p], c, lr=0.1, momentum=0.0, collective=collective,
                              tie="negative")
        _grad(p, *grads[c.rank])
        opt.step()
        return p.detach().tolist()

    for out in run_local(fn, 2, timeout=30):
        assert out == pytest.approx([0.9, 1.1])


@pytest.mark.parametrize("collective", ["auto", "ring", "alltoall", "allgather"])
def test_majority_sign_sgd_default_tie_is_unbiased(collective):
    """Two workers with opposite gradients tie on every element. The default tie sends
    alternate elements up and down, and flips with each step: back to the start after two."""
    def fn(c):
        p = _param(0.0, 0.0, 0.0)
        opt = MajoritySignSGD([p], c, lr=0.1, momentum=0.0, collective=collective)
        seen = []
        for _ in range(2):
            _grad(p, *([1.0, -2.0, 3.0] if c.rank == 0 else [-1.0, 2.0, -3.0]))
            opt.step()
            seen.append(p.detach().tolist())
        return seen

    for first, second in run_local(fn, 2, timeout=30):
        assert first == pytest.approx([-0.1, 0.1, -0.1])  # votes +1, -1, +1
        assert second == pytest.approx([0.0, 0.0, 0.0])


@pytest.mark.parametrize("collective", ["auto", "ring", "alltoall", "allgather"])
def test_signum_momentum_by_hand(collective):
    # one worker, beta 0.5: m1 = [0.5, -0.5] -> votes [+1, -1]; m2 = 0.5 m1 + 0.5 [-2, 0.2]
    # = [-0.75, -0.15] -> votes [-1, -1]; lr 0.1 from [0, 0]: [-0.1, 0.1] then [0.0, 0.2]
    def fn(c):
        p = _param(0.0, 0.0)
        opt = MajoritySignSGD([p], c, lr=0.1, momentum=0.5, collective=collective)
        _grad(p, 1.0, -1.0)
        opt.step()
        first = p.detach().tolist()
        _grad(p, -2.0, 0.2)
        opt.step()
        return first, p.detach().tolist(), opt.state[p]["momentum_buffer"].tolist()

    first, second, m = run_local(fn, 1, timeout=30)[0]
    assert first == pytest.approx([-0.1, 0.1])
    assert second == pytest.approx([0.0, 0.2])
    assert m == pytest.approx([-0.75, -0.15])


def test_majority_of_three_workers_over_two_tensors_and_groups():
    # element-wise majorities of three workers' signs; the second group has its own lr
    g = [((1.0, -1.0), (2.0,)), ((1.0, 1.0), (-2.0,)), ((-1.0, 1.0), (-3.0,))]

    def fn(c):
        a, b = _param(0.0, 0.0), _param(0.0)
        opt = MajoritySignSGD([{"params": [a]}, {"params": [b], "lr": 1.0}], c, lr=0.1,
                              momentum=0.0)
        _grad(a, *g[c.rank][0])
        _grad(b, *g[c.rank][1])
        opt.step()
        return a.detach().tolist() + b.detach().tolist()

    for out in run_local(fn, 3, timeout=30):
        assert out == pytest.approx([-0.1, -0.1, 1.0])


# -- OneBitAdam -----------------------------------------------------------------------------------

def test_onebit_adam_one_worker_by_hand():
    # warm-up: m = 0.05, v = 0.00025, p = 1 - 0.1 * 0.05 / sqrt(0.00025)
    # then compression with one worker: P = 8 elements, the 1-bit average of [m, 0 x 7] (all
    # signs +1) is rms = |m| / sqrt(8); v stays frozen.
    def fn(c):
        p = _param(1.0)
        opt = OneBitAdam([p], c, lr=0.1, eps=0.0, freeze_step=1)
        _grad(p, 0.5)
        opt.step()
        warm = p.item()
        assert opt.compressing
        _grad(p, 0.5)
        opt.step()
        return warm, p.item(), opt.state[p]["exp_avg_sq"].item(), opt.onebit.worker_error

    warm, after, v, werr = run_local(fn, 1, timeout=30)[0]
    assert warm == pytest.approx(1 - 0.1 * 0.05 / math.sqrt(0.00025), rel=1e-6)
    m2 = 0.9 * 0.05 + 0.1 * 0.5
    m_avg = m2 / math.sqrt(8)
    assert v == pytest.approx(0.00025, rel=1e-6)
    assert after == pytest.approx(warm - 0.1 * m_avg / math.sqrt(0.00025), rel=1e-5)
    assert werr.tolist() == pytest.approx([m2 - m_avg] + [-m_avg] * 7, rel=1e-5)


def _many_params(rank, step):
    """Two groups of parameters (one bfloat16, one without a gradient) and rank's gradients."""
    gen = torch.Generator().manual_seed(100 * step + rank)
    shapes = [(300,), (2, 2), (50, 10), (400,), (1,)]
    grads = [torch.randn(s, generator=gen) for s in shapes]
    grads[1] = None  # no gradient on any rank: no step, no state
    grads[2] = grads[2].to(torch.bfloat16)
    return shapes, grads


def _many_groups(shapes):
    ps = [torch.nn.Parameter(torch.linspace(-1, 1, math.prod(s)).reshape(s)) for s in shapes]
    ps[2] = torch.nn.Parameter(ps[2].detach().to(torch.bfloat16))
    return ps, [{"params": ps[:3], "lr": 0.1, "weight_decay": 0.01},
                {"params": ps[3:], "lr": 0.05}]


def _run_many(make, steps=2, size=3):
    def fn(c):
        ps, groups = _many_groups(_many_params(0, 0)[0])
        opt = make(groups, c)
        for t in range(steps):
            for p, g in zip(ps, _many_params(c.rank, t)[1], strict=True):
                p.grad = g
            opt.step()
        return [p.detach().clone() for p in ps]
    return run_local(fn, size)


_HYPER = [(0.1, 0.01)] * 3 + [(0.05, 0.0)] * 2
"""(lr, weight_decay) of each of _many_groups' parameters."""


def _by_hand(update):
    """_many_groups' parameters after two steps of ``update(i, p, lr, wd, grads)`` (every
    rank's gradient of parameter i) on each parameter with a gradient."""
    ps, _ = _many_groups(_many_params(0, 0)[0])
    for t in range(2):
        grads = [_many_params(r, t)[1] for r in range(3)]
        for i, (p, (lr, wd)) in enumerate(zip(ps, _HYPER, strict=True)):
            if grads[0][i] is not None:
                with torch.no_grad():
                    update(i, p, lr, wd, [g[i] for g in grads])
    return ps


def _assert_same_params(got, want):
    for rank_ps in got:
        for a, b in zip(rank_ps, want, strict=True):
            assert a.dtype == b.dtype and torch.equal(a, b.detach()), (a, b)


def test_signum_steps_every_parameter_as_its_own_formula():
    """Parameters of two groups, one bfloat16 and one without a gradient: each moves by
    -lr * majority(sign(m)) with m = beta * m + (1 - beta) * (g + wd * p) computed with
    torch's ops for that tensor alone, bit for bit, whether the optimizer goes through
    torch's multi-tensor ops or not."""
    got = _run_many(lambda groups, c: MajoritySignSGD(groups, c, lr=0.1, momentum=0.9))
    shapes, _ = _many_params(0, 0)
    ms = [[torch.zeros(s) for s in shapes] for _ in range(3)]

    def update(i, p, lr, wd, grads):
        for r, g in enumerate(grads):
            g = g.float() + wd * p.float() if wd else g.float()
            ms[r][i] = ms[r][i].mul(0.9).add_(g, alpha=1 - 0.9)
        votes = sum(torch.where(ms[r][i] >= 0, 1.0, -1.0) for r in range(3))
        p.add_(torch.where(votes > 0, 1.0, -1.0).to(p.dtype), alpha=-lr)

    _assert_same_params(got, _by_hand(update))
    assert torch.equal(got[0][1], torch.linspace(-1, 1, 4).reshape(2, 2))  # never moved
    assert any(not torch.equal(a, b) for a, b in zip(got[0], _many_groups(shapes)[0],
                                                      strict=True))


def test_onebit_adam_warm_up_steps_every_parameter_as_its_own_formula():
    """As above for OneBitAdam's dense warm-up: Adam without bias correction on the float32
    mean (summed in rank order, as LocalComm's allreduce adds), per tensor, bit for bit."""
    got = _run_many(lambda groups, c: OneBitAdam(groups, c, lr=0.1, freeze_step=10))
    shapes, _ = _many_params(0, 0)
    m = [torch.zeros(s) for s in shapes]
    v = [torch.zeros(s) for s in shapes]

    def update(i, p, lr, wd, grads):
        g = grads[0].float().clone()
        for other in grads[1:]:
            g += other.float()
        g.div_(3)
        m[i] = m[i].mul(0.9).add_(g, alpha=1 - 0.9)
        v[i] = v[i].mul(0.999).addcmul_(g, g, value=1 - 0.999)
        step = m[i] / (v[i].sqrt() + 1e-8)
        if wd:
            step += wd * p.float()
        p.add_(step.to(p.dtype), alpha=-lr)

    _assert_same_params(got, _by_hand(update))


@pytest.mark.parametrize("collective", ["auto", "alltoall"])
def test_onebit_adam_two_workers_against_the_reference(collective):
    """At 2 ranks ``auto`` is the one-round allgather; both exchanges follow DeepSpeed."""
    gs = [torch.tensor([[0.5, -1.0, 2.0], [0.1, 0.0, -0.3]]),
          torch.tensor([[1.5, 1.0, -2.0], [0.3, 0.2, -0.1]])]
    steps, lr, b1, b2, eps = 4, 0.01, 0.9, 0.999, 1e-8

    def fn(c):
        p = torch.nn.Parameter(torch.ones(2, 3))
        opt = OneBitAdam([p], c, lr=lr, eps=eps, freeze_step=2, collective=collective)
        for t in range(steps):
            p.grad = gs[c.rank] * (t + 1)
            opt.step()
        return p.detach(), opt.onebit.collective

    got = run_local(fn, 2, timeout=30)
    out = [p for p, _ in got]
    assert got[0][1] == ("alltoall" if collective == "alltoall" else "allgather")
    assert torch.equal(out[0], out[1])
    # reference: dense Adam on the mean for 2 steps, then local momentum + 1-bit average
    p = torch.ones(6)
    m, v = torch.zeros(6), torch.zeros(6)
    werr = [torch.zeros(16), torch.zeros(16)]  # P = 2 * lcm(2, 8) = 16
    serr = [torch.zeros(8), torch.zeros(8)]
    for t in range(steps):
        g = [x.reshape(-1) * (t + 1) for x in gs]
        if t < 2:
            mean = (g[0] + g[1]) / 2
            m = b1 * m + (1 - b1) * mean
            v = b2 * v + (1 - b2) * mean * mean
        else:
            m = onebit_reference([b1 * m + (1 - b1) * g[r] for r in range(2)], werr, serr)
        p = p - lr * (m / (v.sqrt() + eps))
    torch.testing.assert_close(out[0].reshape(-1), p, rtol=1e-5, atol=1e-6)


# -- QSGDSGD --------------------------------------------------------------------------------------

def test_qsgd_sgd_two_workers_against_the_codec():
    gs = [torch.linspace(-1, 1, 20), torch.linspace(2, -0.5, 20)]
    lr, mom, bits, bucket, seed = 0.1, 0.5, 2, 8, 11

    def fn(c):
        p = torch.nn.Parameter(torch.zeros(20))
        opt = QSGDSGD([p], c, lr=lr, momentum=mom, bits=bits, bucket=bucket,
                      error_feedback=True, seed=seed)
        for t in range(3):
            p.grad = gs[c.rank] * (t + 1)
            opt.step()
        return p.detach(), opt.feedback.residuals["flat"]

    out = run_local(fn, 2, timeout=30)
    assert torch.equal(out[0][0], out[1][0])
    p, buf = torch.zeros(20), torch.zeros(20)
    err = [torch.zeros(20), torch.zeros(20)]
    for t in range(3):
        sent = []
        for r in range(2):
            comp = gs[r] * (t + 1) + err[r]
            q = qsgd.decode(qsgd.encode(comp, bits, bucket, seed=seed + t * 2 + r))[0]
            err[r] = comp - q
            sent.append(q)
        buf = mom * buf + (sent[0] + sent[1]) / 2
        p = p - lr * buf
    torch.testing.assert_close(out[0][0], p, rtol=1e-6, atol=1e-6)
    for r in range(2):
        torch.testing.assert_close(out[r][1], err[r], rtol=1e-6, atol=1e-6)


# -- resumption and configuration -----------------------------------------------------------------

def _make(kind, params, comm):
    if kind == "signum":
        return MajoritySignSGD(params, comm, lr=0.01, momentum=0.9)
    if kind == "onebit":
        return OneBitAdam(params, comm, lr=0.01, freeze_step=2)
    if kind == "rgc":
        return RGC(params, comm, lr=0.05, density=0.4, compress_threshold=2, quantize=True)
    if kind == "sparcml":
        return SparCMLSGD(params, comm, lr=0.05, momentum=0.9, k=1, bucket=2, bits=4, seed=3)
    if kind == "oktopk":
        return OkTopkSGD(params, comm, lr=0.05, momentum=0.9, weight_decay=0.01, density=0.4,
                         tau=2, tau_prime=2)
    if kind == "sidco":
        return SIDCoSGD(params, comm, lr=0.05, density=0.4, compress_threshold=2, dist="sidco-p")
    return QSGDSGD(params, comm, lr=0.05, momentum=0.9, bits=4, error_feedback=True, seed=3)


@pytest.mark.parametrize("kind", ["signum", "onebit", "qsgd", "rgc", "sparcml", "sidco",
                                  "oktopk"])
def test_state_dict_round_trip_resumes_bit_identically(kind):
    def batches(rank, t):
        g = torch.Generator().manual_seed(100 * t + rank)
        return torch.randn(16, 5, generator=g), torch.randn(16, 1, generator=g)

    def train(model, opt, steps):
        for t in steps:
            x, y = batches(opt.comm.rank, t)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()

    def fn(c):
        torch.manual_seed(0)
        model = torch.nn.Linear(5, 1)
        opt = _make(kind, model.parameters(), c)
        train(model, opt, range(3))
        # through bytes, like a checkpoint file (state_dict() shares the live tensors)
        buf = io.BytesIO()
        torch.save((model.state_dict(), opt.state_dict()), buf)
        buf.seek(0)
        saved = torch.load(buf)
        train(model, opt, range(3, 6))
        straight = [t.clone() for t in model.parameters()]
        torch.manual_seed(1)  # different init: everything must come from the checkpoint
        again = torch.nn.Linear(5, 1)
        again.load_state_dict(saved[0])
        opt2 = _make(kind, again.parameters(), c)
        opt2.load_state_dict(saved[1])
        train(again, opt2, range(3, 6))
        return straight, list(again.parameters())

    for straight, resumed in run_local(fn, 2, timeout=60):
        for a, b in zip(straight, resumed, strict=True):
            assert torch.equal(a, b)


def test_configuration_is_checked_up_front():
    def fn(c):
        p = [_param(1.0)]
        with pytest.raises(TypeError, match="Comm"):
            MajoritySignSGD(p, object())
        with pytest.raises(ValueError, match="collective"):
            MajoritySignSGD(p, c, collective="tree")
        with pytest.raises(ValueError, match="momentum"):
            MajoritySignSGD(p, c, momentum=1.0)
        with pytest.raises(ValueError, match="lr"):
            OneBitAdam(p, c, lr=0.0)
        with pytest.raises(ValueError, match="freeze_step"):
            OneBitAdam(p, c, freeze_step=0)
        with pytest.raises(ValueError, match="betas"):
            OneBitAdam(p, c, betas=(0.9,))
        with pytest.raises(ValueError, match="collective"):
            OneBitAdam(p, c, collective="ring")
        with pytest.raises(ValueError, match="bits"):
            QSGDSGD(p, c, bits=3)
        with pytest.raises(ValueError, match="bucket"):
            QSGDSGD(p, c, bucket=0)
        opt = QSGDSGD(p, c)
        with pytest.raises(ValueError, match="bitcomm"):
            opt.load_state_dict(torch.optim.SGD(p, lr=0.1).state_dict())
        with pytest.raises(ValueError, match="error_feedback"):
            opt.load_state_dict(QSGDSGD(p, c, error_feedback=True).state_dict())
        return True

    assert run_local(fn, 1, timeout=30) == [True]


def test_a_nan_gradient_raises_on_every_worker():
    def fn(c):
        p = _param(1.0, 2.0)
        opt = MajoritySignSGD([p], c, lr=0.1)
        _grad(p, float("nan") if c.rank == 1 else 1.0, 1.0)
        opt.step()

    out = run_local(fn, 2, timeout=30, return_exceptions=True)
    assert all(isinstance(e, ValueError) and "NaN" in str(e) for e in out)


# -- RGC ------------------------------------------------------------------------------------------

def test_rgc_one_worker_top_k_with_residual_by_hand():
    # density 0.5 of 4 elements: k = 2. Step 1: V = g = [0.1, -3, 2, 0.5] -> sends -3 and 2,
    # keeps V = [0.1, 0, 0, 0.5]. Step 2: V += [1, 0, 0, 0.2] = [1.1, 0, 0, 0.7] -> sends both.
    def fn(c):
        p = _param(0.0, 0.0, 0.0, 0.0)
        opt = RGC([p], c, lr=0.1, momentum=0.0, density=0.5, compress_threshold=0)
        _grad(p, 0.1, -3.0, 2.0, 0.5)
        opt.step()
        first, res1 = p.detach().tolist(), opt.state[p]["residual"].tolist()
        _grad(p, 1.0, 0.0, 0.0, 0.2)
        opt.step()
        return first, res1, p.detach().tolist(), opt.state[p]["residual"].tolist()

    first, res1, second, res2 = run_local(fn, 1, timeout=30)[0]
    assert first == pytest.approx([0.0, 0.3, -0.2, 0.0])
    assert res1 == pytest.approx([0.1, 0.0, 0.0, 0.5])
    assert second == pytest.approx([-0.11, 0.3, -0.2, -0.07])
    assert res2 == pytest.approx([0.0, 0.0, 0.0, 0.0])


def test_rgc_momentum_correction_and_masking_by_hand():
    # momentum 0.5, k = 1 of 2. Step 1: U = [1, 0.2], V = [1, 0.2] -> sends element 0,
    # masks U and V there: U = [0, 0.2], V = [0, 0.2]. Step 2 with g = [0.1, 0.1]:
    # U = [0.1, 0.2], V = [0.1, 0.4] -> sends element 1 (0.4).
    def fn(c):
        p = _param(0.0, 0.0)
        opt = RGC([p], c, lr=1.0, momentum=0.5, density=0.5, compress_threshold=0)
        _grad(p, 1.0, 0.2)
        opt.step()
        _grad(p, 0.1, 0.1)
        opt.step()
        s = opt.state[p]
        return p.detach().tolist(), s["momentum"].tolist(), s["residual"].tolist()

    w, u, v = run_local(fn, 1, timeout=30)[0]
    assert w == pytest.approx([-1.0, -0.4])
    assert u == pytest.approx([0.1, 0.0])
    assert v == pytest.approx([0.1, 0.0])


def test_rgc_mean_quantization_alternates_sides():
    # k = 2 of 4; step 1 sends the two largest positives (3, 2) as their mean 2.5, step 2 the
    # two most negative of V = [0, -1, 0, -4] + 0 as their mean -2.5.
    def fn(c):
        p = _param(0.0, 0.0, 0.0, 0.0)
        opt = RGC([p], c, lr=1.0, momentum=0.0, density=0.5, compress_threshold=0,
                  quantize=True)
        _grad(p, 3.0, -1.0, 2.0, -4.0)
        opt.step()
        first = p.detach().tolist()
        _grad(p, 0.0, 0.0, 0.0, 0.0)
        opt.step()
        return first, p.detach().tolist(), opt.state[p]["residual"].tolist()

    first, second, res = run_local(fn, 1, timeout=30)[0]
    assert first == pytest.approx([-2.5, 0.0, -2.5, 0.0])
    assert second == pytest.approx([-2.5, 2.5, -2.5, 2.5])
    assert res == pytest.approx([0.0, 0.0, 0.0, 0.0])


def test_rgc_two_workers_sparse_and_dense_layers_against_a_reference():
    torch.manual_seed(0)
    big = [torch.randn(40) for _ in range(2)]
    small = [torch.randn(3) for _ in range(2)]
    lr, mom, k = 0.1, 0.9, 4  # density 0.1 of 40

    def fn(c):
        w, b = torch.nn.Parameter(torch.zeros(40)), torch.nn.Parameter(torch.zeros(3))
        opt = RGC([w, b], c, lr=lr, momentum=mom, density=0.1, compress_threshold=10)
        for t in range(3):
            w.grad, b.grad = big[c.rank] * (t + 1), small[c.rank] * (t + 1)
            opt.step()
        return w.detach(), b.detach()

    out = run_local(fn, 2, timeout=30)
    assert torch.equal(out[0][0], out[1][0]) and torch.equal(out[0][1], out[1][1])
    w, b, buf = torch.zeros(40), torch.zeros(3), torch.zeros(3)
    u, v = [torch.zeros(40), torch.zeros(40)], [torch.zeros(40), torch.zeros(40)]
    for t in range(3):
        total = torch.zeros(40)
        for r in range(2):
            u[r] = mom * u[r] + big[r] * (t + 1)
            v[r] = v[r] + u[r]
            idx = torch.topk(v[r].abs(), k).indices
            total[idx] += v[r][idx]
            v[r][idx] = 0
            u[r][idx] = 0
        w = w - lr * total / 2
        buf = mom * buf + (small[0] + small[1]) * (t + 1) / 2
        b = b - lr * buf
    torch.testing.assert_close(out[0][0], w, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out[0][1], b, rtol=1e-6, atol=1e-6)


def test_rgc_selection_follows_the_layer_size():
    def fn(c):
        opt = RGC([_param(1.0)], c, thresholds=(100, 1000), compress_threshold=10)
        with pytest.raises(ValueError, match="density"):
            RGC([_param(1.0)], c, density=0.0)
        with pytest.raises(ValueError, match="thresholds"):
            RGC([_param(1.0)], c, thresholds=(10, 5))
        return [opt.method(n) for n in (50, 100, 999, 1000)], opt.compressed(torch.zeros(11))

    methods, big = run_local(fn, 1, timeout=30)[0]
    assert methods == ["topk", "trimmed", "trimmed", "threshold"] and big


def test_sidco_sgd_sends_what_crosses_the_threshold_and_keeps_the_rest_by_hand():
    # density 0.25 of 8: k = 2. The exponential threshold of V = g = [4, 3, 2, 1, 0, 0, 0, 0]
    # is 4 * (10 / 32) * ln 4 = 1.73 (the sidco module's worked example): 4, 3 and 2 go, 1 stays.
    # Two workers with the same gradient: the mean is the sent entries themselves.
    def fn(c):
        p = _param(*[0.0] * 8)
        opt = SIDCoSGD([p], c, lr=0.5, density=0.25, compress_threshold=0, dist="sidco-e")
        _grad(p, 4.0, 3.0, 2.0, 1.0, 0.0, 0.0, 0.0, 0.0)
        opt.step()
        return p.detach().tolist(), opt.state[p]["residual"].tolist(), opt.state[p]["sidco"]

    for w, res, control in run_local(fn, 2, timeout=30):
        assert w == pytest.approx([-2.0, -1.5, -1.0, 0, 0, 0, 0, 0])
        assert res == pytest.approx([0, 0, 0, 1.0, 0, 0, 0, 0])
        assert control == {"stages": 1, "sum": 1.5, "calls": 1}  # 3 selected for k = 2


def test_oktopk_sgd_two_workers_by_hand():
    # k = ceil(0.5 * 4) = 2 of a flat buffer [w (3), b (1)]. Step 1: worker 0 acc = [4, 1, 0, 3],
    # worker 1 acc = [2, 0, 5, 1]; local top-2: {0, 3} and {0, 2}. R = [6, 0, 5, 3]; global
    # top-2: {0, 2}. u / 2 = [3, 0, 2.5, 0]. Residuals: worker 0 keeps [0, 1, 0, 3] (3 was
    # selected locally but not globally), worker 1 keeps [0, 0, 0, 1].
    grads = {0: ([4.0, 1.0, 0.0], [3.0]), 1: ([2.0, 0.0, 5.0], [1.0])}

    def fn(c):
        w, b = _param(0.0, 0.0, 0.0), _param(0.0)
        opt = OkTopkSGD([w, b], c, lr=0.1, density=0.5, tau_prime=1, feedback=False)
        w.grad, b.grad = torch.tensor(grads[c.rank][0]), torch.tensor(grads[c.rank][1])
        opt.step()
        first = w.detach().tolist() + b.detach().tolist()
        res = opt.state[w]["residual"].tolist() + opt.state[b]["residual"].tolist()
        b.grad = None  # b frozen: its residual waits and it does not move
        w.grad = torch.zeros(3)
        opt.step()
        return first, res, w.detach().tolist() + b.detach().tolist(), \
            opt.state[b]["residual"].tolist(), opt.collective.last.selected

    (f0, r0, s0, rb0, sel), (f1, r1, s1, rb1, _) = run_local(fn, 2, timeout=30)
    assert f0 == f1 == pytest.approx([-0.3, 0.0, -0.25, 0.0])
    assert r0 == pytest.approx([0.0, 1.0, 0.0, 3.0]) and r1 == pytest.approx([0, 0, 0, 1.0])
    # step 2: acc_0 = [0, 1, 0, (b frozen: 0)], acc_1 = [0, 0, 0, 0] -> only w[1] = 1 goes
    assert s0 == s1 == pytest.approx([-0.3, -0.05, -0.25, 0.0])
    assert rb0 == [3.0] and rb1 == [1.0] and sel == 1


def test_oktopk_sgd_warmup_steps_are_dense_sgd():
    def fn(c):
        w = _param(0.0, 0.0)
        opt = OkTopkSGD([w], c, lr=1.0, density=0.5, warmup=1)
        w.grad = torch.tensor([1.0, 3.0]) * (c.rank + 1)
        opt.step()
        return w.detach().tolist(), opt.state[w]["residual"].tolist()

    for w, res in run_local(fn, 2, timeout=30):
        assert w == pytest.approx([-1.5, -4.5]) and res == [0.0, 0.0]


def test_sidco_selectors_take_rank_own_stages_without_disagreeing():
    """Each rank adapts its stages to its own counts, so the agreement must not compare them."""
    torch.manual_seed(0)
    xs = [torch.randn(2000) for _ in range(2)]

    def fn(c):
        return sparse_allgather(c, xs[c.rank], 20, method="sidco-p",
                                options={"stages": 1 + c.rank})[1][0]

    sent = run_local(fn, 2, timeout=30)
    for r in range(2):
        want = sidco.sidco(xs[r].abs(), 20, "pareto", 1 + r)
        assert torch.equal(sent[r], want)


def test_sidco_sgd_refuses_a_non_sidco_selector():
    def fn(c):
        with pytest.raises(ValueError, match="dist"):
            SIDCoSGD([_param(1.0)], c, dist="topk")
        with pytest.raises(ValueError, match="method"):
            RGC([_param(1.0)], c, method="sort")
        return RGC([_param(1.0)], c, method="sidco-gp").method(10**7)

    assert run_local(fn, 1, timeout=30) == ["sidco-gp"]


def test_step_with_a_closure_returns_its_loss():
    def fn(c):
        p = _param(1.0, -1.0)
        opt = QSGDSGD([p], c, lr=0.1, bits=8)

        def closure():
            opt.zero_grad()
            loss = (p * p).sum()
            loss.backward()
            return loss

        loss = opt.step(closure)
        return loss.item(), p.detach().tolist()

    loss, p = run_local(fn, 1, timeout=30)[0]
    assert loss == pytest.approx(2.0)
    # the gradient 2p = [2, -2] is exact in 8-bit qsgd (each value is its bucket's max)
    assert p == pytest.approx([0.8, -0.8])


@pytest.mark.parametrize("kind", ["signum", "qsgd", "onebit", "rgc", "sparcml", "sidco",
                                  "oktopk"])
def test_a_parameter_without_a_gradient_does_not_move(kind):
    """torch.optim.SGD skips a parameter whose grad is None; so does every bitcomm optimizer."""
    def make(params, comm):
        if kind == "signum":
            return MajoritySignSGD(params, comm, lr=0.01, momentum=0.5, weight_decay=0.1)
        if kind == "qsgd":
            return QSGDSGD(params, comm, lr=0.1, momentum=0.9, weight_decay=0.1, bits=4,
                           bucket=8, seed=1)
        if kind == "rgc":  # 5 and 6 elements go sparsely, 2 and 3 densely
            return RGC(params, comm, lr=0.1, momentum=0.9, weight_decay=0.1, density=0.5,
                       compress_threshold=4)
        if kind == "sparcml":
            return SparCMLSGD(params, comm, lr=0.1, momentum=0.9, weight_decay=0.1, k=2,
                              bucket=4)
        if kind == "sidco":
            return SIDCoSGD(params, comm, lr=0.1, momentum=0.9, weight_decay=0.1, density=0.5,
                            compress_threshold=4)
        if kind == "oktopk":
            return OkTopkSGD(params, comm, lr=0.1, momentum=0.9, weight_decay=0.1,
                             density=0.5, tau_prime=2)
        return OneBitAdam(params, comm, lr=0.01, weight_decay=0.1, freeze_step=2)

    def worker(comm):
        live, small = torch.nn.Parameter(torch.ones(5)), torch.nn.Parameter(torch.ones(2))
        frozen, big = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(6))
        opt = make([live, frozen, small, big], comm)
        for step in range(4):  # warm-up and compressed steps of OneBitAdam both
            opt.zero_grad()
            live.grad = torch.linspace(-1, 1, 5) * (comm.rank + 1) + step
            small.grad = torch.tensor([1.0, -1.0])
            opt.step()
        return [p.detach().clone() for p in (live, small, frozen, big)], \
            len(opt.state[frozen]) + len(opt.state[big])

    for (live, small, frozen, big), frozen_state in run_local(worker, size=2):
        assert not torch.equal(live, torch.ones(5)) and not torch.equal(small, torch.ones(2))
        assert torch.equal(frozen, torch.ones(3)) and torch.equal(big, torch.ones(6))
        assert frozen_state == 0


def test_qsgd_feedback_keeps_a_frozen_parameters_residual_unsent_until_it_has_a_gradient():
    """With error feedback, a parameter without a gradient sends nothing and its residual
    waits as it was (zero where it never had one), while the others' residuals move on."""
    def worker(comm):
        a, b = torch.nn.Parameter(torch.zeros(8)), torch.nn.Parameter(torch.zeros(8))
        # one bucket holds both: a frozen residual sent would change a's scale and its codes
        opt = QSGDSGD([a, b], comm, lr=0.1, bits=2, bucket=16, error_feedback=True, seed=5)
        grads = torch.linspace(-1, 1, 8) * (comm.rank + 1)
        kept = []
        for has_b in (False, True, False, True):  # b frozen first, then every other step
            opt.zero_grad()
            a.grad = grads.clone()
            if has_b:  # its 40s round to 0 or 100: a residual far above a's values
                b.grad = torch.tensor([100.0] + [40.0] * 7)
            before = b.detach().clone()
            opt.step()
            residual = opt.feedback.residuals["flat"]
            kept.append((residual[:8].clone(), residual[8:].clone(),
                         torch.equal(b.detach(), before)))
        # step 2 (b frozen) by hand: a's gradient plus its residual, beside zeros where b's
        # waiting residual is not sent, quantised with rank r's seed of that step (5 + 2N + r)
        compensated = torch.cat([grads + kept[1][0], torch.zeros(8)])
        frame = qsgd.encode(compensated, 2, 16, seed=5 + 2 * comm.size + comm.rank)
        sent, _ = qsgd.decode(frame)
        return kept, compensated[:8] - sent[:8]

    for kept, a2_by_hand in run_local(worker, size=2):
        (a0, b0, still0), (a1, b1, still1), (a2, b2, still2), (a3, b3, still3) = kept
        assert torch.equal(a2, a2_by_hand)
        assert still0 and still2 and not still1 and not still3  # b moves only with a gradient
        assert torch.equal(b0, torch.zeros(8))  # never had a gradient: no residual
        assert b1.abs().sum() > 0  # 2-bit quantisation of b's gradient left one
        assert torch.equal(b2, b1)  # frozen: unsent and unchanged
        assert not torch.equal(b3, b2)  # with a gradient again it was sent and moved on
        assert not torch.equal(a1, a2)  # a's residual moves at every step


def test_rgc_sends_nothing_for_a_sparse_parameter_that_no_rank_has_a_gradient_for():
    def worker(comm, with_b):
        a, b = torch.nn.Parameter(torch.ones(10)), torch.nn.Parameter(torch.ones(10))
        opt = RGC([a, b], comm, lr=0.1, density=0.2, compress_threshold=4)
        a.grad = torch.arange(10.0)
        if with_b:
            b.grad = torch.arange(10.0)
        comm.counters.reset()
        opt.step()
        return comm.counters.total_sent

    alone = run_local(lambda c: worker(c, False), size=2)
    both = run_local(lambda c: worker(c, True), size=2)
    # one sparse frame fewer: the exchange of b is left out on every rank
    assert 0 < alone[0] < both[0] and alone[1] < both[1]


@pytest.mark.parametrize("kind", [MajoritySignSGD, QSGDSGD, OneBitAdam, RGC, SparCMLSGD,
                                  SIDCoSGD, OkTopkSGD])
def test_ranks_that_differ_in_which_parameters_have_gradients_raise_on_every_rank(kind):
    def worker(comm):
        a, b = torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(4))
        opt = kind([a, b], comm, lr=0.01)
        a.grad = torch.ones(4)
        if comm.rank == 0:
            b.grad = torch.ones(4)  # the same element count either way: only the mask differs
        # SparCMLSGD lays out only the parameters with gradients: the lengths differ first
        with pytest.raises(ValueError, match="same collective with the same options|"
                                             "same length n on every rank"):
            opt.step()
        return torch.equal(a.detach(), torch.ones(4))

    assert run_local(worker, size=2) == [True, True]


# -- loss scaling ---------------------------------------------------------------------------------

def _linear():
    # the same on every thread rank (the global RNG is shared between threads)
    model = torch.nn.Linear(4, 2)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return model


def _amp_run(kind, comm, scaler, steps=4, overflow_at=1):
    """Train a Linear on rank-own batches under ``scaler``; rank 0's gradients overflow at one
    step. Return the parameters after each step and the scaler's scale after each update."""
    model = _linear()
    opt = _make(kind, model.parameters(), comm)
    params, scales = [], []
    for t in range(steps):
        g = torch.Generator().manual_seed(10 * t + comm.rank)
        x, y = torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)
        opt.zero_grad()
        scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
        if t == overflow_at and comm.rank == 0:
            model.weight.grad[0, 0] = float("inf")
        scaler.step(opt)
        scaler.update()
        params.append([p.detach().clone() for p in model.parameters()])
        scales.append(float(scaler.get_scale()))
    return params, scales


@pytest.mark.parametrize("kind", ["signum", "onebit", "qsgd", "rgc", "sparcml", "sidco",
                                  "oktopk"])
def test_an_overflow_on_one_rank_skips_the_step_on_every_rank(kind):
    """A per-rank GradScaler skips step() where its own gradients overflowed; the optimizers
    take the flag from the scaler instead and agree on it, so no rank steps and none falls out
    of step with the others."""
    def fn(c):
        return _amp_run(kind, c, torch.amp.GradScaler("cpu", init_scale=2.0 ** 8))

    (p0, s0), (p1, s1) = run_local(fn, 2, timeout=20)
    for t in range(4):
        for a, b in zip(p0[t], p1[t], strict=True):
            assert torch.equal(a, b), (kind, t)
    for a, b in zip(p0[0], p0[1], strict=True):
        assert torch.equal(a, b)  # the overflowing step moved nothing
    assert not all(torch.equal(a, b) for a, b in zip(p0[1], p0[2], strict=True))
    assert s0[1] == 2.0 ** 7 and s1[1] == 2.0 ** 8  # each scaler saw only its own overflow


def test_unscaling_by_the_optimizer_equals_unscaling_by_hand():
    """Under a scaler the optimizer divides the gradients by the scale itself (the scaler calls
    step() with grad_scale set): the same parameters as unscale_ before step()."""
    def fn(c):
        a = _amp_run("qsgd", c, torch.amp.GradScaler("cpu", init_scale=2.0 ** 8), overflow_at=-1)
        model = _linear()
        opt = _make("qsgd", model.parameters(), c)
        for t in range(4):
            g = torch.Generator().manual_seed(10 * t + c.rank)
            x, y = torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        return a[0][-1], [p.detach() for p in model.parameters()]

    for scaled, plain in run_local(fn, 2, timeout=60):
        for a, b in zip(scaled, plain, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_bitcomm_grad_scaler_backs_off_on_every_rank():
    from bitcomm.train import GradScaler

    def fn(c):
        return _amp_run("signum", c, GradScaler(c, "cpu", init_scale=2.0 ** 8))

    (p0, s0), (p1, s1) = run_local(fn, 2, timeout=20)
    assert s0 == s1 and s0[1] == 2.0 ** 7
    for a, b in zip(p0[-1], p1[-1], strict=True):
        assert torch.equal(a, b)


# -- SparCML ----------------------------------------------------------------------------------


def test_bucket_topk_by_hand():
    acc = torch.tensor([0.1, -5.0, 2.0, 0.0, 3.0, -1.0, 0.5, 4.0, -0.2, 0.3])
    # buckets of 4: [0.1 -5 2 0] -> 1, 2; [3 -1 .5 4] -> 4, 7; the tail [-.2 .3] -> both
    assert bucket_topk(acc, 2, 4).tolist() == [1, 2, 4, 7, 8, 9]
    assert bucket_topk(acc, 9, 4).tolist() == list(range(10))  # k beyond a bucket: all
    assert bucket_topk(torch.zeros(0), 2, 4).numel() == 0


@pytest.mark.parametrize("path", ["numpy", "torch"])
def test_bucket_topk_breaks_ties_towards_the_lower_position(path):
    """Ties at a bucket's k-th largest |acc| go to its lowest positions, in full buckets and
    the tail, whatever order torch.topk returns them in (it breaks ties its own way, and
    differently on CPU and CUDA); NaN ranks as inf. On the numpy path buckets without ties
    take a shortcut (each one's values at or above its k-th largest)."""
    import numpy as np

    from conftest import forced

    g = torch.Generator().manual_seed(4)
    ties = torch.randint(-3, 4, (512 * 9 + 300,), generator=g) / 2.0
    ties[[5, 700, 701]] = torch.tensor([float("nan"), float("inf"), float("nan")])
    spread = torch.randn(512 * 9 + 300, generator=g)
    # a bucket whose top 2 hold NaN, and one of four ties: unless NaN ranks as inf, the
    # first has none at or above its 2nd largest (NaN) and the second four, k each in all
    nan_rows = torch.tensor([float("nan"), 1.0, 2.0, 3.0, 5.0, 5.0, 5.0, 5.0])
    for acc, k, bucket in ((ties, 100, 512), (spread, 100, 512), (spread, 1, 7),
                           (nan_rows, 2, 4)):
        a = acc.abs().nan_to_num(nan=float("inf")).numpy()
        want = []
        for start in range(0, a.size, bucket):
            row = a[start:start + bucket]
            want += sorted((np.lexsort((np.arange(row.size), -row))[:k] + start).tolist())
        with forced(path):
            assert bucket_topk(acc, k, bucket).tolist() == want, (path, k, bucket)
    with forced(path):  # a leaf that asks for gradients, of any shape, as torch.topk took it
        grad = spread[:4096].clone().view(64, 64).requires_grad_()
        assert bucket_topk(grad, 3, 100).tolist() == bucket_topk(spread[:4096], 3, 100).tolist()


def test_sparcml_sgd_two_workers_by_hand():
    """Two workers, 6 elements in buckets of 3, k = 1: each sends its largest |acc| per bucket,
    keeps the rest as residual, and both apply the same mean of the sums."""
    grads = {0: [[1.0, -4.0, 2.0, 0.5, 0.1, 0.2]], 1: [[3.0, 0.0, 0.0, 0.0, 0.0, -1.0]]}

    def fn(c):
        p = torch.nn.Parameter(torch.zeros(6))
        opt = SparCMLSGD([p], c, lr=0.5, k=1, bucket=3, algorithm="ssar_recursive_double")
        p.grad = torch.tensor(grads[c.rank][0])
        opt.step()
        first = p.detach().clone()
        p.grad = torch.zeros(6)
        opt.step()  # the residual alone
        return first, p.detach().clone(), opt.state[p]["residual"].clone()

    out = run_local(fn, 2, timeout=30)
    # rank 0 sends -4 at 1 and 0.5 at 3; rank 1 sends 3 at 0 and -1 at 5
    total = torch.tensor([3.0, -4.0, 0.0, 0.5, 0.0, -1.0])
    for first, _, _ in out:
        assert torch.equal(first, -0.5 * total / 2)
    # second step: rank 0's residual [1, 0, 2, 0, .1, .2] sends 2 and .2; rank 1's [0]*5 + ...
    r0 = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.1, 0.0])
    torch.testing.assert_close(out[0][2], r0)
    assert torch.equal(out[1][2], torch.zeros(6))
    second = torch.tensor([0.0, 0.0, 2.0, 0.0, 0.0, 0.2])
    for _, after, _ in out:
        torch.testing.assert_close(after, -0.5 * (total + second) / 2)


def test_sparcml_sgd_quantised_keeps_every_rank_identical_and_reports_its_choice():
    def fn(c):
        torch.manual_seed(0)
        model = torch.nn.Linear(64, 4)
        with torch.no_grad():
            for q in model.parameters():
                q.copy_(torch.linspace(-1, 1, q.numel()).view_as(q))
        opt = SparCMLSGD(model.parameters(), c, lr=0.1, k=4, bucket=64, bits=4, seed=1)
        auto = SparCMLSGD([torch.nn.Parameter(torch.zeros(8))], c, lr=0.1, k=1, bucket=8)
        for t in range(3):
            g = torch.Generator().manual_seed(t * 10 + c.rank)
            x, y = torch.randn(16, 64, generator=g), torch.randn(16, 4, generator=g)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        auto.param_groups[0]["params"][0].grad = torch.ones(8)
        auto.step()
        return [q.detach().clone() for q in model.parameters()], opt.sent, auto.last_choice

    out = run_local(fn, 3, timeout=60)
    for params, sent, choice in out:
        for a, b in zip(params, out[0][0], strict=True):
            assert torch.equal(a, b)
        assert sent == 4 * 4 + 1 * 4  # 256 weights in 4 buckets, 4 biases in a short one
        assert choice == out[0][2] and choice.algorithm in ("ssar_recursive_double",
                                                            "stream_allgather", "allreduce")
