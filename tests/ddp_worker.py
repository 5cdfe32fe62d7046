"""One rank of the DDP hook test (started by test_multiprocess.py, gloo, 2 processes).

Trains the same small regression with DistributedDataParallel twice per hook: once with DDP's
own fp32 allreduce and once with the hook, from the same initial weights on the same batches,
and prints one JSON line per hook: losses of both runs, the largest parameter difference, and
what the hook's state holds after DDP's bucket rebuild. Then one line on overlap: how long the
hook took to return while the other rank was still busy, and whether its future was done.
"""

import json
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from bitcomm.comm.launch import finish, world
from bitcomm.train.hooks import (
    OneBitHookState,
    QsgdState,
    SignState,
    TopkState,
    onebit_hook,
    qsgd_hook,
    sign_majority_hook,
    topk_hook,
)

STEPS = 30
BUCKET_MB = 0.0002  # 52 floats: the 577 parameters, one bucket at step 1, then rebuilt as 2


def batches(rank, steps):
    g = torch.Generator().manual_seed(1234)
    w_true = torch.randn(16, 1, generator=g)
    out = []
    for t in range(steps):
        gt = torch.Generator().manual_seed(1000 * t + rank)
        x = torch.randn(32, 16, generator=gt)
        out.append((x, x @ w_true + 0.01 * torch.randn(32, 1, generator=gt)))
    return out


def train(hook, state, opt_kind, rank, view=False):
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(),
                                    torch.nn.Linear(32, 1)), bucket_cap_mb=BUCKET_MB,
                gradient_as_bucket_view=view)
    if hook is not None:
        model.register_comm_hook(state, hook)
    opt = (torch.optim.SGD(model.parameters(), lr=0.01) if opt_kind == "sign"
           else torch.optim.SGD(model.parameters(), lr=0.05))
    losses = []
    for x, y in batches(rank, STEPS):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, [p.detach().clone() for p in model.parameters()]


def main():
    comm = world("gloo", timeout=30)
    rank = dist.get_rank()
    base_losses, base_params = train(None, None, "sgd", rank)
    cases = {
        "qsgd8": (qsgd_hook, QsgdState(comm, bits=8, bucket_size=64, error_feedback=True), "sgd"),
        "qsgd8-blocking": (qsgd_hook, QsgdState(comm, bits=8, bucket_size=64, overlap=False),
                           "sgd"),
        "onebit": (onebit_hook, OneBitHookState(comm), "sgd"),
        "topk": (topk_hook, TopkState(comm, density=0.1), "sgd"),
        "sign": (sign_majority_hook, SignState(comm, momentum=0.9), "sign"),
        "sign-alltoall": (sign_majority_hook, SignState(comm, momentum=0.9, collective="alltoall"),
                          "sign"),
    }
    finals = {}
    for name, (hook, state, kind) in cases.items():
        losses, params = train(hook, state, kind, rank)
        finals[name] = params
        held = [getattr(state, b) for b in type(state)._buffers]
        diff = max((a - b).abs().max().item() for a, b in zip(params, base_params, strict=True))
        # parameters identical across ranks: gather a checksum
        digest = torch.tensor([sum(p.double().sum().item() for p in params)], dtype=torch.float64)
        every = [torch.zeros(1, dtype=torch.float64) for _ in range(dist.get_world_size())]
        dist.all_gather(every, digest)
        print(json.dumps({"rank": rank, "hook": name, "first": losses[0],
                          "last": sum(losses[-5:]) / 5, "base_last": sum(base_losses[-5:]) / 5,
                          "max_param_diff": diff,
                          "same_on_ranks": all(e.item() == every[0].item() for e in every),
                          "held": [len(b) for b in held],
                          "buckets": [len(b._flats) for b in held],
                          "params": sum(p.numel() for p in params)}),
              flush=True)
    same = all(torch.equal(a, b) for a, b in zip(finals["qsgd8"], finals["qsgd8-blocking"],
                                                 strict=True))
    print(json.dumps({"rank": rank, "qsgd_overlap_equals_blocking": same}), flush=True)
    # With gradient_as_bucket_view the gradients are the buckets the hooks write their results
    # into: the same training, bit for bit.
    for name, make in {"qsgd8": lambda: QsgdState(comm, bits=8, bucket_size=64),
                       "onebit": lambda: OneBitHookState(comm),
                       "topk": lambda: TopkState(comm, density=0.1),
                       "sign": lambda: SignState(comm, momentum=0.9)}.items():
        hook, _, kind = cases[name]
        _, viewed = train(hook, make(), kind, rank, view=True)
        same = all(torch.equal(a, b) for a, b in zip(viewed, finals[name], strict=True))
        print(json.dumps({"rank": rank, "bucket_view": name, "same": same}), flush=True)
    for name, (hook, make) in {"sign": (sign_majority_hook, lambda: SignState(comm)),
                               "onebit": (onebit_hook, lambda: OneBitHookState(comm)),
                               "qsgd": (qsgd_hook, lambda: QsgdState(comm)),
                               "topk": (topk_hook, lambda: TopkState(comm))}.items():
        overflow(name, hook, make(), rank)
    overlap(comm, rank)
    dist.destroy_process_group()


def overflow(name, hook, state, rank):
    """Three steps under a GradScaler; in the second, one of rank 1's parameters gets an inf.

    Prints, per step, whether every gradient was NaN, whether the parameters moved and the
    scaler's scale, and a checksum of the final parameters.
    """
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(),
                                    torch.nn.Linear(32, 1)), bucket_cap_mb=BUCKET_MB)
    model.register_comm_hook(state, hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    first = model.module[0].weight
    steps = []
    for t, (x, y) in enumerate(batches(rank, 3)):
        handle = (first.register_hook(lambda g: g * float("inf"))
                  if t == 1 and rank == 1 else None)
        opt.zero_grad()
        before = [p.detach().clone() for p in model.parameters()]
        scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
        all_nan = all(bool(p.grad.isnan().all()) for p in model.parameters())
        scaler.step(opt)
        scaler.update()
        moved = any(not torch.equal(a, p) for a, p in zip(before, model.parameters(),
                                                          strict=True))
        steps.append({"all_nan": all_nan, "moved": moved, "scale": scaler.get_scale()})
        if handle is not None:
            handle.remove()
    digest = sum(p.double().sum().item() for p in model.parameters())
    print(json.dumps({"rank": rank, "overflow": name, "steps": steps, "digest": digest}),
          flush=True)


def overlap(comm, rank):
    """Time the hook's return while rank 1 starts its backward 0.5 s late."""
    state = SignState(comm)
    seen = []

    def timed(s, bucket):
        t0 = time.perf_counter()
        fut = sign_majority_hook(s, bucket)
        seen.append((time.perf_counter() - t0, fut.done()))
        return fut

    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(16, 1))
    model.register_comm_hook(state, timed)
    x, y = batches(rank, 1)[0]
    loss = torch.nn.functional.mse_loss(model(x), y)
    if rank == 1:
        time.sleep(0.5)
    t0 = time.perf_counter()
    loss.backward()
    print(json.dumps({"rank": rank, "hook_return_s": seen[0][0], "done_at_return": seen[0][1],
                      "backward_s": time.perf_counter() - t0}), flush=True)


if __name__ == "__main__":
    main()
    finish()  # skips the interpreter's teardown, where a gloo rank can abort after its work
