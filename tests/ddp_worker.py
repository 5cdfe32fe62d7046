"""One rank of the DDP hook test (started by test_multiprocess.py, gloo, 2 processes).

Trains the same small regression with DistributedDataParallel twice per hook: once with DDP's
own fp32 allreduce and once with the hook, from the same initial weights on the same batches,
and prints one JSON line per hook: losses of both runs and the largest parameter difference.
"""

import json
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from bitcomm.comm.launch import world
from bitcomm.train.hooks import HookState, onebit_hook, qsgd_hook, sign_majority_hook, topk_hook

STEPS = 30


def batches(rank, steps):
    g = torch.Generator().manual_seed(1234)
    w_true = torch.randn(16, 1, generator=g)
    out = []
    for t in range(steps):
        gt = torch.Generator().manual_seed(1000 * t + rank)
        x = torch.randn(32, 16, generator=gt)
        out.append((x, x @ w_true + 0.01 * torch.randn(32, 1, generator=gt)))
    return out


def train(hook, state, opt_kind, rank):
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(),
                                    torch.nn.Linear(32, 1)))
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
        "qsgd8": (qsgd_hook, HookState(comm, bits=8, bucket_size=64, error_feedback=True), "sgd"),
        "onebit": (onebit_hook, HookState(comm), "sgd"),
        "topk": (topk_hook, HookState(comm, density=0.1), "sgd"),
        "sign": (sign_majority_hook, HookState(comm, momentum=0.9), "sign"),
        "sign-alltoall": (sign_majority_hook, HookState(comm, momentum=0.9, collective="alltoall"),
                          "sign"),
    }
    for name, (hook, state, kind) in cases.items():
        losses, params = train(hook, state, kind, rank)
        diff = max((a - b).abs().max().item() for a, b in zip(params, base_params, strict=True))
        # parameters identical across ranks: gather a checksum
        digest = torch.tensor([sum(p.double().sum().item() for p in params)], dtype=torch.float64)
        every = [torch.zeros(1, dtype=torch.float64) for _ in range(dist.get_world_size())]
        dist.all_gather(every, digest)
        print(json.dumps({"rank": rank, "hook": name, "first": losses[0],
                          "last": sum(losses[-5:]) / 5, "base_last": sum(base_losses[-5:]) / 5,
                          "max_param_diff": diff,
                          "same_on_ranks": all(e.item() == every[0].item() for e in every)}),
              flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # Every result is printed and the process group is gone. Skip the interpreter's teardown:
    # in about one CI run in three (2026-11-22), rank 0 aborted there with "terminate called
    # without an active exception" (a C++ thread destroyed while joinable, after all work),
    # which the exit-code check would report as a failed hook. Not yet traced; see issue notes.
    sys.stdout.flush()
    os._exit(0)
