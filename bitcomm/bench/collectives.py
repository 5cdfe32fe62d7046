"""Collective benchmark: time, algbw, busbw, wire bytes and correctness per collective and size.

Run on every rank of a launched job (``mpiexec -n N python -m mpi4py -m bitcomm.bench.collectives``
or N torch.distributed gloo processes; ``bitcomm bench collectives`` launches either). The
collectives are :data:`bitcomm.collectives.registry.COLLECTIVES`; rank r's input is
:func:`~bitcomm.collectives.registry.standard_input`. Each collective is warmed up once (that
call's result and bytes are checked), then timed ``repeat`` times by
:func:`~bitcomm.collectives.registry.time_calls`: a call's time is its slowest rank's, and the
row reports the median over calls and its min and max. Definitions as nccl-tests:
``algbw = S / t`` with S = 4n bytes (the fp32 tensor, GB = 1e9),
``busbw = algbw * 2 (N - 1) / N`` (all of these are allreduce-shaped).

``wrong`` counts, per row: elements that differ from the reference (majorities: a brute-force
count of every rank's votes, which each rank regenerates from the seeds; other collectives: rank
0's result, compared as bytes), plus 1 for every rank whose counted bytes differ from the
collective's wire-byte formula. ``wire_bytes`` and ``expected_bytes`` are the largest over ranks
(the ring's uneven chunks make them differ by a few bytes). Only rank 0 returns rows.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable

import torch

from bitcomm import collectives as col
from bitcomm._sizes import human
from bitcomm.bench import heading
from bitcomm.bench.codecs import time_against
from bitcomm.codecs import _frame, counts, sign
from bitcomm.collectives import _common, registry
from bitcomm.comm import run_local
from bitcomm.comm.base import Comm

__all__ = ["Row", "StepRow", "SyncRow", "run", "ring_steps", "syncs", "count_syncs", "sync_sites",
           "steady_call", "markdown", "steps_markdown", "DEFAULT_SIZES"]

DEFAULT_SIZES = (1 << 20, 8 << 20)


@dataclasses.dataclass
class Row:
    """One measured row: a collective at one size on ``ranks`` ranks.

    ``seconds`` is the median over calls of each call's slowest rank; ``seconds_min`` and
    ``seconds_max`` the extremes of the same per-call times.
    """

    collective: str
    ranks: int
    n: int
    seconds: float
    algbw: float
    busbw: float
    wire_bytes: int
    expected_bytes: int
    wrong: int
    seconds_min: float = float("nan")
    seconds_max: float = float("nan")
    speedup_vs_alltoall: float | None = None

    def as_dict(self) -> dict:
        """Return the row as a JSON-friendly dict."""
        return dataclasses.asdict(self)


def run(comm: Comm, sizes: tuple[int, ...] = DEFAULT_SIZES, *, repeat: int = 3, seed: int = 0,
        algorithms: tuple[str, ...] = tuple(registry.COLLECTIVES),
        progress: Callable[[Row], None] | None = None,
        device: torch.device | str = "cpu") -> list[Row] | None:
    """Benchmark ``algorithms`` at ``sizes`` on every rank; return the rows on rank 0.

    Args:
        comm: the transport (every rank calls this with the same arguments).
        sizes: float32 element counts.
        repeat: timed calls after one warm-up.
        seed: seed of the inputs.
        algorithms: names from :data:`bitcomm.collectives.registry.COLLECTIVES`.
        progress: called on rank 0 with each row as soon as it is measured.
        device: where the inputs live (a CUDA device for NCCL).

    """
    specs = [registry.get(a) for a in algorithms]
    rows: list[Row] = []
    for n in sizes:
        x = registry.standard_input(seed, comm.rank, n).to(device)
        measured: dict[str, Row] = {}
        for spec in specs:
            state = spec.new_state(n, comm.size, device)
            comm.counters.reset()
            out = spec(comm, x, state=state)  # warm-up, also the checked result
            if spec.primed:  # the measured call is one that reuses what the first set up
                comm.counters.reset()
                out = spec(comm, x, state=state)
            sent = comm.counters.total_sent
            expected = spec.expected_bytes(n, comm.size, comm.rank, seed=seed)
            wrong = registry.mismatches(comm, out, spec.reference(seed, comm.size, n))
            timing = registry.combine(comm, registry.time_calls(
                comm, lambda spec=spec, state=state, x=x: spec(comm, x, state=state), repeat))
            every = comm.allgather_floats([sent, expected])
            wrong += sum(int(a != b) for a, b in every)
            seconds = timing.median
            algbw = 4 * n / seconds / 1e9 if seconds > 0 else 0.0
            row = Row(spec.name, comm.size, n, seconds, algbw,
                      algbw * 2 * (comm.size - 1) / comm.size,
                      int(max(a for a, _ in every)), int(max(b for _, b in every)), wrong,
                      *timing.spread[::2])
            measured[spec.name] = row
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
    the HBM read speed of ``torch.sum`` over the whole vector, timed in calls alternating with
    the kernel's (``sum_seconds``: that sum's median), and ``vs_hbm`` = seconds / hbm_seconds.
    The ``rank-total`` row sums one rank's kernels (their seconds and their hbm_seconds);
    ``wire_seconds`` is the time that rank's wire bytes take at the stated link rate. The
    ``call`` row is a whole call with every rank a thread of this process on one device; the
    ``vote count`` row the all-to-all majority's kernel on the same chunk (:func:`ring_steps`).
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
    sum_seconds: float = float("nan")

    def as_dict(self) -> dict:
        """Return the row as a JSON-friendly dict."""
        return dataclasses.asdict(self)


def ring_steps(n: int, size: int, *, device: str | torch.device = "cuda", repeat: int = 10,
               link_gbps: float = 100.0, seed: int = 0) -> list[StepRow]:
    """Time the fused kernels one rank runs in a ``size``-rank ring majority of ``n`` elements.

    Rank 0's chunks, in order: the first step (votes packed as 1-bit counts), the middle steps
    (received counts + votes, repacked one plane wider when the width grows), the deciding step,
    and the ``size`` unpacks of decisions into the +-1 result; then the ``rank-total`` and
    ``call`` rows, and last the kernel :func:`~bitcomm.collectives.alltoall_majority` runs on
    rank 0's chunk instead of those steps (``vote count``: every rank's packed votes counted,
    decided and packed). Needs the Triton path (a CUDA device with triton; CPU tensors under
    ``TRITON_INTERPRET=1`` with the path forced).
    """
    device = torch.device(device)
    x = registry.standard_input(seed, 0, n).to(device)
    if not _frame.use_triton(x):
        raise RuntimeError("ring_steps times the Triton kernels: expected a CUDA device with "
                           "triton installed")
    from bitcomm.collectives import _kernels  # imports triton
    unpack = _frame.kernels().sign_unpack
    lengths = [hi - lo for lo, hi in _common.bounds(n, size)]
    gen = torch.Generator().manual_seed(seed)
    rows: list[StepRow] = []

    def timed(what: str, length: int, fn, moved: int, calls: int = repeat, **wire) -> StepRow:
        # the HBM read speed from torch.sum's calls alternating with fn's: a GPU left idle
        # between measurements clocks down, and an anchor timed once would carry that
        t, s = time_against(fn, lambda: torch.sum(x), calls, device)
        hbm_seconds = moved * s / (4 * n)
        return StepRow(what, size, n, length, t, moved, hbm_seconds, t / hbm_seconds,
                       sum_seconds=s, **wire)

    def add(what: str, length: int, fn, moved: int) -> None:
        rows.append(timed(what, length, fn, moved))

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
    at_hbm = sum(r.hbm_seconds for r in rows)
    wire = col.ring_majority_bytes(n, size, 0, check=False)
    wire_seconds = wire * 8 / (link_gbps * 1e9)
    rows.append(StepRow("rank-total", size, n, n, total, moved, at_hbm, total / at_hbm,
                        wire, wire_seconds))
    xs = [registry.standard_input(seed, r, n).to(device) for r in range(size)]

    def call() -> None:
        run_local(lambda comm: col.ring_majority(comm, xs[comm.rank], check=False), size)

    rows.append(timed("call", n, call, moved * size, max(1, repeat // 5), wire_bytes=wire,
                      wire_seconds=wire_seconds))
    # alltoall_majority's one kernel on the same chunk: every rank's packed votes, counted
    length = lengths[0]
    nb = (length + 7) // 8
    votes = torch.randint(0, 256, (size, nb), generator=gen, dtype=torch.uint8).to(device)
    add("vote count", length, lambda: _kernels.vote_count(votes, length), (size + 1) * nb)
    return rows


@dataclasses.dataclass
class SyncRow:
    """The host synchronisations of one call of a collective, per rank, on a GPU.

    Every rank is a thread of this process on one device (:class:`~bitcomm.comm.LocalComm`:
    no transport staging), the call is made with ``check=False`` (the agreement's own read
    left out) after a warm-up call and, for primed collectives, the priming one; ``syncs`` is
    the count torch reports over all ranks, divided by the ranks.
    """

    collective: str
    ranks: int
    n: int
    syncs: float

    def as_dict(self) -> dict:
        """Return the row as a JSON-friendly dict."""
        return dataclasses.asdict(self)


def count_syncs(fn: Callable[[], object]) -> int:
    """Return the host synchronisations torch reports while ``fn()`` runs on CUDA devices."""
    return len(sync_sites(fn))


def sync_sites(fn: Callable[[], object]) -> list[str]:
    """Return ``"file:line"`` of each host synchronisation torch reports while ``fn()`` runs.

    ``torch.cuda.set_sync_debug_mode("warn")`` makes every synchronising CUDA call (a read of
    a device value, ``nonzero``, a blocking copy such as one from pageable host memory) warn,
    from the Python line that made it; the warnings of every thread are gathered, then the
    mode is set back to its default.
    """
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    # the mode's own notice, given once a process, also says "synchronizing"
    return [f"{w.filename}:{w.lineno}" for w in caught
            if "called a synchronizing CUDA operation" in str(w.message)]


def syncs(n: int, size: int, *, device: str | torch.device = "cuda", seed: int = 0,
          algorithms: tuple[str, ...] = tuple(registry.COLLECTIVES)) -> list[SyncRow]:
    """Count each collective's host synchronisations per call on ``size`` ranks of ``n`` floats.

    Every rank runs as a thread on ``device`` (see :class:`SyncRow`).
    """
    device = torch.device(device)
    xs = [registry.standard_input(seed, r, n).to(device) for r in range(size)]
    return [SyncRow(name, size, n, count_syncs(steady_call(name, xs)) / size)
            for name in algorithms]


def steady_call(name: str, xs: list[torch.Tensor]) -> Callable[[], None]:
    """Return a call of collective ``name`` on inputs ``xs``, each rank a thread, warmed up.

    The call runs without the agreement (``check=False``), each rank with its own state, after
    one call that compiled the kernels and primed the collectives that need it.
    """
    spec = registry.get(name)
    size = len(xs)
    states = [spec.new_state(xs[0].numel(), size, xs[0].device) for _ in range(size)]

    def call() -> None:
        run_local(lambda comm: spec(comm, xs[comm.rank], state=states[comm.rank], check=False),
                  size)

    call()
    return call


def markdown(rows: list[Row], config: dict, command: str) -> str:
    """Return the rows as the docs' Markdown table, headed by its date, machine and command.

    One line a collective and size: the median call time with the fastest and slowest call,
    bus bandwidth, the bytes a rank sent, wrong results and the speedup over the all-to-all
    majority.
    """
    out = heading(config, command) + [
        "| ranks | size (fp32 elements) | collective | time (ms), median [min, max] | "
        "busbw (GB/s) | wire bytes / rank | #wrong | speedup vs all-to-all |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        speed = "" if r.speedup_vs_alltoall is None else f"{r.speedup_vs_alltoall:.2f}"
        out.append(f"| {r.ranks} | {human(r.n)} | {r.collective} | {r.seconds * 1e3:.1f} "
                   f"[{r.seconds_min * 1e3:.1f}, {r.seconds_max * 1e3:.1f}] | {r.busbw:.3f} | "
                   f"{r.wire_bytes} | {r.wrong} | {speed} |")
    return "\n".join(out) + "\n"


def steps_markdown(rows: list[StepRow], config: dict, command: str) -> str:
    """Return :func:`ring_steps`' rows as a Markdown table, headed like :func:`markdown`'s.

    One line a kernel of one rank's ring (then the rank's total, a whole call and the
    all-to-all's vote count): its time, the bytes it moves and their time at the HBM read
    speed, and the wire time where known.
    """
    out = heading(config, command) + [
        "| ranks | size | kernel | elements | time (ms) | bytes moved | at HBM speed (ms) | "
        "time / HBM | wire bytes | wire (ms) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        wire = "" if r.wire_seconds != r.wire_seconds else f"{r.wire_seconds * 1e3:.3f}"
        out.append(f"| {r.ranks} | {human(r.n)} | {r.what} | {r.count} | "
                   f"{r.seconds * 1e3:.3f} | {r.moved} | {r.hbm_seconds * 1e3:.3f} | "
                   f"{r.vs_hbm:.2f} | {r.wire_bytes or ''} | {wire} |")
    return "\n".join(out) + "\n"
