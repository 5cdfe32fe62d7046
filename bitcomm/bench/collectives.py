"""Collective benchmark: time, algbw, busbw, wire bytes and correctness per collective and size.

Run on every rank of a launched job (``mpiexec -n N python -m mpi4py -m bitcomm.bench.collectives``
or N torch.distributed gloo processes; ``bitcomm bench collectives`` launches either). Each rank
holds ``x_r = randn(n)`` from a generator seeded by ``(seed, r)``; each collective is warmed up
once, then timed ``repeat`` times, each time after a barrier; a rank's time is the median of its
repetitions and the reported time is the maximum over ranks (the collective ends when the last
rank has its result). Definitions as nccl-tests: ``algbw = S / t`` with S = 4n bytes (the fp32
tensor, GB = 1e9), ``busbw = algbw * 2 (N - 1) / N`` (all of these are allreduce-shaped).

``wrong`` counts, per row: elements that differ from the reference (majorities: a brute-force
count of every rank's votes, which each rank regenerates from the seeds; other collectives: rank
0's result, compared as bytes), plus 1 if any rank's counted bytes differ from the collective's
wire-byte formula. ``wire_bytes`` and ``expected_bytes`` are the largest over ranks (the ring's
uneven chunks make them differ by a few bytes). Only rank 0 returns rows.
"""

from __future__ import annotations

import dataclasses
import hashlib
import statistics
import struct
import time
from collections.abc import Callable

import torch

from bitcomm import collectives as col
from bitcomm.bench.codecs import time_call
from bitcomm.codecs import _frame, counts, sign, sparse
from bitcomm.collectives import _common
from bitcomm.comm import run_local
from bitcomm.comm.base import Comm

__all__ = ["Row", "StepRow", "run", "ring_steps", "ALGORITHMS", "DEFAULT_SIZES",
           "bench_input", "gather_floats", "mismatches", "majority_reference"]

DEFAULT_SIZES = (1 << 20, 8 << 20)
ALGORITHMS = ("ring-majority", "ring-majority-radix", "alltoall-majority", "onebit-allreduce",
              "sparse-fp32-1%", "allreduce-fp32")
"""Collectives the benchmark runs, in order."""


@dataclasses.dataclass
class Row:
    """One measured row: a collective at one size on ``ranks`` ranks."""

    collective: str
    ranks: int
    n: int
    seconds: float
    algbw: float
    busbw: float
    wire_bytes: int
    expected_bytes: int
    wrong: int
    speedup_vs_alltoall: float | None = None

    def as_dict(self) -> dict:
        """Return the row as a JSON-friendly dict."""
        return dataclasses.asdict(self)


def bench_input(seed: int, rank: int, n: int) -> torch.Tensor:
    """Return rank ``rank``'s benchmark input: ``randn(n)`` seeded by ``(seed, rank)``."""
    return torch.randn(n, generator=torch.Generator().manual_seed(seed * 1000003 + rank))


def gather_floats(comm: Comm, value: float) -> list[float]:
    """Return every rank's ``value`` (an allgather of one float64 each)."""
    mine = torch.frombuffer(bytearray(struct.pack("<d", value)), dtype=torch.uint8)
    return [struct.unpack("<d", bytes(t.tolist()))[0]
            for t in comm.allgatherv(mine, [8] * comm.size)]


def _digest(t: torch.Tensor) -> bytes:
    return hashlib.sha256(t.reshape(-1).contiguous().cpu().numpy().tobytes()).digest()


def mismatches(comm: Comm, out: torch.Tensor, reference: torch.Tensor | None) -> int:
    """Return, summed over ranks, the elements of ``out`` that differ from ``reference``.

    Without a reference every rank compares a digest of ``out`` with rank 0's (all of ``out``
    counts as wrong on a rank whose bytes differ).
    """
    if reference is not None:
        local = int((out != reference).sum().item())
    else:
        digest = torch.frombuffer(bytearray(_digest(out)), dtype=torch.uint8)
        first = comm.allgatherv(digest, [32] * comm.size)[0]
        local = 0 if torch.equal(first, digest) else out.numel()
    return int(sum(gather_floats(comm, float(local))))


def majority_reference(seed: int, size: int, n: int) -> torch.Tensor:
    """Return the brute-force majority of every rank's :func:`bench_input` (ties give -1)."""
    votes = torch.zeros(n, dtype=torch.int32)
    for r in range(size):
        votes += bench_input(seed, r, n) >= 0
    return torch.where(2 * votes > size, 1.0, -1.0)


def _cases(comm: Comm, x: torch.Tensor) -> dict[str, tuple[Callable[[], torch.Tensor], int]]:
    n, size, rank = x.numel(), comm.size, comm.rank
    k = max(1, n // 100)
    state = col.OneBitState(n, size)
    frame = sparse.encoded_size(n, k, "fp32")
    return {
        "ring-majority": (lambda: col.ring_majority(comm, x),
                          col.ring_majority_bytes(n, size, rank)),
        "ring-majority-radix": (lambda: col.ring_majority(comm, x, packing="radix"),
                                col.ring_majority_bytes(n, size, rank, packing="radix")),
        "alltoall-majority": (lambda: col.alltoall_majority(comm, x),
                              col.alltoall_majority_bytes(n, size, rank)),
        "onebit-allreduce": (lambda: col.onebit_allreduce(comm, x, state),
                             col.onebit_allreduce_bytes(n, size)),
        "sparse-fp32-1%": (lambda: col.sparse_allgather(comm, x, k)[0],
                           col.sparse_allgather_bytes(frame, size)),
        "allreduce-fp32": (lambda: col.allreduce(comm, x), col.allreduce_bytes(n, size)),
    }


def run(comm: Comm, sizes: tuple[int, ...] = DEFAULT_SIZES, *, repeat: int = 3, seed: int = 0,
        algorithms: tuple[str, ...] = ALGORITHMS,
        progress: Callable[[Row], None] | None = None) -> list[Row] | None:
    """Benchmark ``algorithms`` at ``sizes`` on every rank; return the rows on rank 0.

    Args:
        comm: the transport (every rank calls this with the same arguments).
        sizes: float32 element counts.
        repeat: timed repetitions (median per rank) after one warm-up.
        seed: seed of the inputs.
        algorithms: names from :data:`ALGORITHMS`.
        progress: called on rank 0 with each row as soon as it is measured.

    """
    unknown = [a for a in algorithms if a not in ALGORITHMS]
    if unknown:
        raise ValueError(f"expected algorithms from {ALGORITHMS}, got {unknown}")
    rows: list[Row] = []
    for n in sizes:
        x = bench_input(seed, comm.rank, n)
        cases = _cases(comm, x)
        majority = (majority_reference(seed, comm.size, n)
                    if any("majority" in a for a in algorithms) else None)
        measured: dict[str, Row] = {}
        for name in algorithms:
            fn, expected = cases[name]
            comm.counters.reset()
            out = fn()  # warm-up, also the checked result
            sent = comm.counters.total_sent
            reference = majority if "majority" in name else None
            wrong = mismatches(comm, out, reference)
            wrong += int(sum(gather_floats(comm, float(sent != expected))))
            times = []
            for _ in range(repeat):
                comm.barrier()
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            seconds = max(gather_floats(comm, statistics.median(times)))
            algbw = 4 * n / seconds / 1e9 if seconds > 0 else 0.0
            row = Row(name, comm.size, n, seconds, algbw,
                      algbw * 2 * (comm.size - 1) / comm.size,
                      int(max(gather_floats(comm, float(sent)))),
                      int(max(gather_floats(comm, float(expected)))), wrong)
            measured[name] = row
            if comm.rank == 0:
                rows.append(row)
        base = measured.get("alltoall-majority")
        for row in measured.values():
            if base is not None and row.seconds > 0:
                row.speedup_vs_alltoall = base.seconds / row.seconds
        if comm.rank == 0 and progress is not None:
            for row in measured.values():
                progress(row)
    return rows if comm.rank == 0 else None


@dataclasses.dataclass
class StepRow:
    """One kernel of one rank's :func:`~bitcomm.collectives.ring_majority`, or a whole call.

    ``moved`` is the bytes the kernel reads and writes, ``hbm_seconds`` the time they take at
    the HBM read speed measured in the same run (``torch.sum``), and ``vs_hbm`` = seconds /
    hbm_seconds. The ``rank-total`` row sums one rank's kernels; ``wire_seconds`` is the time
    that rank's wire bytes take at the stated link rate. The ``call`` row is a whole call with
    every rank a thread of this process on one device.
    """

    what: str
    ranks: int
    n: int
    count: int
    seconds: float
    moved: int
    hbm_seconds: float
    vs_hbm: float
    wire_bytes: int = 0
    wire_seconds: float = float("nan")

    def as_dict(self) -> dict:
        """Return the row as a JSON-friendly dict."""
        return dataclasses.asdict(self)


def ring_steps(n: int, size: int, *, device: str | torch.device = "cuda", repeat: int = 10,
               link_gbps: float = 100.0, seed: int = 0) -> list[StepRow]:
    """Time the fused kernels one rank runs in a ``size``-rank ring majority of ``n`` elements.

    Rank 0's chunks, in order: the first step (votes packed as 1-bit counts), the middle steps
    (received counts + votes, repacked one plane wider when the width grows), the deciding step,
    and the ``size`` unpacks of decisions into the +-1 result. Needs the Triton path (a CUDA
    device with triton; CPU tensors under ``TRITON_INTERPRET=1`` with the path forced).
    """
    device = torch.device(device)
    x = bench_input(seed, 0, n).to(device)
    if not _frame.use_triton(x):
        raise RuntimeError("ring_steps times the Triton kernels: expected a CUDA device with "
                           "triton installed")
    from bitcomm.collectives import _kernels  # imports triton
    hbm = 4 * n / time_call(lambda: torch.sum(x), repeat, device)  # bytes per second
    unpack = _frame.kernels().sign_unpack
    lengths = [hi - lo for lo, hi in _common.bounds(n, size)]
    gen = torch.Generator().manual_seed(seed)
    rows: list[StepRow] = []

    def add(what: str, length: int, fn, moved: int) -> None:
        t = time_call(fn, repeat, device)
        rows.append(StepRow(what, size, n, length, t, moved, moved / hbm, t * hbm / moved))

    def received(length: int, i: int) -> torch.Tensor:
        c = torch.randint(0, i + 1, (length,), generator=gen).to(device)
        return counts.pack(c, i)

    length = lengths[0]
    add("step 1", length, lambda: _kernels.count_step(None, x[:length], 0, 1),
        4 * length + (length + 7) // 8)
    for i in range(1, size):
        c = (0 - i) % size
        chunk = x[sum(lengths[:c]) : sum(lengths[: c + 1])]
        got = received(chunk.numel(), i)
        w_in, last = counts.width(i), i == size - 1
        w_out = 1 if last else counts.width(i + 1)
        moved = got.numel() + 4 * chunk.numel() + w_out * ((chunk.numel() + 7) // 8)
        if last:
            add("decide", chunk.numel(),
                lambda g=got, ch=chunk, w=w_in: _kernels.count_step(g, ch, w, 1, decide=size),
                moved)
        else:
            add(f"step {i + 1}", chunk.numel(),
                lambda g=got, ch=chunk, a=w_in, b=w_out: _kernels.count_step(g, ch, a, b), moved)
    out = torch.empty(n, dtype=torch.float32, device=device)
    decisions = sign.pack(x)
    lo = 0
    for c, length in enumerate(lengths):
        part, piece = out[lo : lo + length], decisions[: (length + 7) // 8]
        add(f"unpack {c}", length, lambda p=piece, o=part, m=length: unpack(
            p, m, torch.float32, out=o), (length + 7) // 8 + 4 * length)
        lo += length
    total = sum(r.seconds for r in rows)
    moved = sum(r.moved for r in rows)
    wire = col.ring_majority_bytes(n, size, 0, check=False)
    rows.append(StepRow("rank-total", size, n, n, total, moved, moved / hbm, total * hbm / moved,
                        wire, wire * 8 / (link_gbps * 1e9)))
    xs = [bench_input(seed, r, n).to(device) for r in range(size)]

    def call() -> None:
        run_local(lambda comm: col.ring_majority(comm, xs[comm.rank], check=False), size)

    t = time_call(call, max(1, repeat // 5), device)
    rows.append(StepRow("call", size, n, n, t, moved * size, moved * size / hbm,
                        t * hbm / (moved * size), wire, wire * 8 / (link_gbps * 1e9)))
    return rows
