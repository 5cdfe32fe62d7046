"""The collectives that the benchmark, the emulated experiments, the model and the CLI run.

A :class:`Collective` says how to call the collective on a rank's input, the bytes its documented
formula says a rank sends, and how a result is checked: the majorities against an independent
brute-force count of every rank's votes, the others for byte-identity across ranks (the promise
every bitcomm collective makes). Adding a collective to the comparisons is one entry in
:data:`COLLECTIVES`.

The standard input of rank ``r`` is :func:`standard_input` (``randn(n)`` seeded by the seed and
``r``), so any rank can regenerate every other rank's input for a reference.

>>> from bitcomm.comm import run_local
>>> ring = get("ring-majority")
>>> out = run_local(lambda c: ring(c, standard_input(0, c.rank, 10)), 3)
>>> torch.equal(out[0], ring.reference(0, 3, 10))
True
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import statistics
import time
from collections.abc import Callable

import torch

from bitcomm.codecs import select
from bitcomm.codecs import sparse as sparse_codec
from bitcomm.collectives import dense, majority, oktopk, onebit, sparcml, sparse
from bitcomm.comm.base import Comm
from bitcomm.comm.local import run_local

__all__ = ["Collective", "COLLECTIVES", "EMULATED", "DENSITY", "get", "is_emulated",
           "standard_input", "sparse_input", "skewed", "mismatches", "Timing", "time_calls",
           "combine"]


@dataclasses.dataclass(frozen=True)
class Collective:
    """How to run, account for and check one collective on float32 tensors of ``n`` elements.

    Attributes:
        name: the one name used by the CLI, the benchmark, experiment files and results.
        summary: one line for listings.
        run: ``run(comm, x, state, check)`` -> the result tensor (``state`` from
            :meth:`new_state`, kept across calls, or ``None``).
        wire_bytes: ``wire_bytes(n, size, rank, check)`` -> the bytes rank ``rank`` sends, by
            the collective's documented formula.
        is_majority: the result is the sign majority of the ranks' inputs (ties -> -1).
        state: ``state(n, size, device)`` -> per-rank state for stateful collectives.
        emulated: the network model can trace it and the emulated experiments compare it: its
            messages are point-to-point (a native allreduce is not), and their sizes depend on
            n and size, or on the standard inputs' seed as well (``input_bytes``).
        input_bytes: for collectives whose bytes depend on the values (the sparse ones):
            ``input_bytes(n, size, rank, check, seed)`` -> the bytes rank ``rank`` sends on
            the standard inputs of ``seed``; ``wire_bytes`` is then that at seed 0.
        primed: its first call on a state sets up what later calls reuse (Ok-Topk's thresholds
            and regions), so the call that is measured, counted and traced is the second on
            the same state: the benchmark, the emulated experiments and the model make one
            call first, untimed.

    """

    name: str
    summary: str
    run: Callable[[Comm, torch.Tensor, object, bool], torch.Tensor]
    wire_bytes: Callable[[int, int, int, bool], int]
    is_majority: bool = False
    state: Callable[[int, int, torch.device | str], object] | None = None
    emulated: bool = False
    input_bytes: Callable[[int, int, int, bool, int], int] | None = None
    primed: bool = False

    def new_state(self, n: int, size: int, device: torch.device | str = "cpu") -> object:
        """Return a fresh per-rank state (``None`` for stateless collectives)."""
        return None if self.state is None else self.state(n, size, device)

    def __call__(self, comm: Comm, x: torch.Tensor, *, state: object = None,
                 check: bool = True) -> torch.Tensor:
        """Run on this rank; a stateful collective without ``state`` gets a fresh one."""
        if state is None:
            state = self.new_state(x.numel(), comm.size, x.device)
        return self.run(comm, x, state, check)

    def expected_bytes(self, n: int, size: int, rank: int, check: bool = True,
                       seed: int = 0) -> int:
        """Return the bytes rank ``rank`` sends in one call, by the documented formula.

        ``seed`` is that of the standard inputs, for collectives whose bytes depend on them.
        """
        if self.input_bytes is not None:
            return self.input_bytes(n, size, rank, check, seed)
        return self.wire_bytes(n, size, rank, check)

    def reference(self, seed: int, size: int, n: int) -> torch.Tensor | None:
        """Return the independent reference result for the standard inputs, or ``None``.

        Majorities: a brute-force count of every rank's regenerated votes (ties give -1).
        Others have no closed-form reference; their check is byte-identity across ranks.
        """
        if not self.is_majority:
            return None
        votes = torch.zeros(n, dtype=torch.int32)
        for r in range(size):
            votes += standard_input(seed, r, n) >= 0
        return torch.where(2 * votes > size, 1.0, -1.0)


def standard_input(seed: int, rank: int, n: int) -> torch.Tensor:
    """Return rank ``rank``'s input: ``randn(n)`` (float32) seeded by ``(seed, rank)``."""
    return torch.randn(n, generator=torch.Generator().manual_seed(seed * 1000003 + rank))


def _digest(t: torch.Tensor) -> torch.Tensor:
    data = t.reshape(-1).contiguous().cpu().numpy().tobytes()
    return torch.frombuffer(bytearray(hashlib.sha256(data).digest()), dtype=torch.uint8)


def mismatches(comm: Comm, out: torch.Tensor, reference: torch.Tensor | None) -> int:
    """Return, summed over ranks, the elements of ``out`` that differ from ``reference``.

    Without a reference every rank compares a digest of ``out`` with rank 0's (all of ``out``
    counts as wrong on a rank whose bytes differ). Every rank must call it.
    """
    if reference is not None:
        local = int((out.cpu() != reference).sum().item())
    else:
        digest = _digest(out)
        first = comm.allgatherv(digest, [digest.numel()] * comm.size)[0]
        local = 0 if torch.equal(first, digest) else out.numel()
    return int(sum(v[0] for v in comm.allgather_floats([local])))


def _k(n: int) -> int:
    return max(1, n // 100)  # the sparse collective keeps the top 1%


DENSITY = 0.01
"""The share of its input each rank's sparse vector keeps, unless a name says (``NAME@5%``)."""


def _sparse_k(n: int, density: float) -> int:
    return min(n, max(1, round(density * n))) if n else 0


def sparse_input(x: torch.Tensor, density: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Return the sparse vector a SparCML collective gets from a dense input.

    The ``round(density * n)`` (at least 1) entries of largest ``|x|`` (ties to lower
    indices), by increasing index.
    """
    v = x.reshape(-1)
    idx = select.select_abs(v, _sparse_k(v.numel(), density), check=False)
    return idx, v[idx]


@functools.lru_cache(maxsize=8)
def _standard_index_sets(seed: int, size: int, n: int, density: float) -> tuple[torch.Tensor, ...]:
    return tuple(sparse_input(standard_input(seed, r, n), density)[0] for r in range(size))


def _sparcml(name: str, fn: str, summary: str, density: float) -> Collective:
    """Return a SparCML collective on the top ``density`` of every rank's input."""
    call, count = getattr(sparcml, fn), getattr(sparcml, fn + "_bytes")

    def run(comm: Comm, x: torch.Tensor, state: object, check: bool) -> torch.Tensor:
        out = call(comm, *sparse_input(x, density), x.numel(), check=check)
        return out if isinstance(out, torch.Tensor) else out.to_dense()

    def input_bytes(n: int, size: int, rank: int, check: bool, seed: int) -> int:
        return count(list(_standard_index_sets(seed, size, n, density)), n, check=check)[rank]

    label = name if density == DENSITY else f"{name}@{density:.6g}"
    return Collective(label, f"{summary} (top {density:.3%} per rank)", run,
                      lambda n, size, rank, check: input_bytes(n, size, rank, check, 0),
                      emulated=True, input_bytes=input_bytes)


_OKTOPK = {
    "oktopk": ({}, False, "Ok-Topk's O(k) sparse allreduce, thresholds reused"),
    "oktopk-skewed": ({"balance": "always"}, True,
                      "Ok-Topk on skewed inputs: balanced regions and blocks"),
    "oktopk-skewed-direct": ({"balance": "never"}, True,
                             "Ok-Topk on skewed inputs: balanced regions, direct allgatherv"),
    "oktopk-skewed-even": ({"balance": "never", "regions": "even"}, True,
                           "Ok-Topk on skewed inputs: even regions, direct allgatherv (naive)"),
}
"""Ok-Topk's registered variants: state options, whether the input is skewed, a summary."""


def skewed(x: torch.Tensor) -> torch.Tensor:
    """Return ``x`` with a position-dependent scale: ``x[j] * ((j + 0.5) / n) ** 3``.

    Every rank's largest entries then crowd towards the end of the vector, the same way on every
    rank, as real gradients' do in some layers (Ok-Topk, Section 3.1.1: the coordinates of the
    local top-k are consistent across workers at a coarse grain); an even split of the index
    space gives the last regions most of the work. Standard inputs are uniform and need no
    balancing; these do.
    """
    n = x.numel()
    pos = (torch.arange(n, dtype=torch.float64, device=x.device) + 0.5) / max(n, 1)
    return x * pos.pow(3).to(x.dtype)


def _oktopk(density: float, base: str = "oktopk") -> Collective:
    """Return an Ok-Topk variant at ``k = density * n`` (a steady call, see primed)."""
    options, skew, summary = _OKTOPK[base]

    def run(comm: Comm, x: torch.Tensor, state: object, check: bool) -> torch.Tensor:
        return oktopk.oktopk_allreduce(comm, skewed(x) if skew else x,
                                       _sparse_k(x.numel(), density), state, check=check)[0]

    def input_bytes(n: int, size: int, rank: int, check: bool, seed: int) -> int:
        return _oktopk_bytes(n, size, check, seed, density, base)[rank]

    label = base if density == DENSITY else f"{base}@{density:.6g}"
    return Collective(label, f"{summary} (top {density:.3%} per rank)", run,
                      lambda n, size, rank, check: input_bytes(n, size, rank, check, 0),
                      state=lambda n, size, device: oktopk.OkTopkState(**options),
                      emulated=True, input_bytes=input_bytes, primed=True)


@functools.lru_cache(maxsize=16)
def _oktopk_bytes(n: int, size: int, check: bool, seed: int, density: float,
                  base: str) -> list[int]:
    """Return every rank's bytes in the second Ok-Topk call on the standard inputs.

    Run on threads: they depend on how the ranks' selections overlap and on the regions the
    first call drew.
    """
    spec = _oktopk(density, base)

    def fn(comm: Comm) -> int:
        x, state = standard_input(seed, comm.rank, n), spec.new_state(n, comm.size)
        spec(comm, x, state=state, check=check)
        comm.counters.reset()
        spec(comm, x, state=state, check=check)
        return comm.counters.total_sent

    return run_local(fn, size, timeout=600)


_SPARCML = {
    "ssar-recursive-double": ("ssar_recursive_double",
                              "SparCML's sparse allreduce by recursive doubling"),
    "ssar-split-allgather": ("ssar_split_allgather",
                             "SparCML's sparse allreduce: split, then allgather of ranges"),
    "dsar-split-allgather": ("dsar_split_allgather",
                             "SparCML's split, then a dense allgather of the reduced ranges"),
    "stream-allgather": ("stream_allgather", "every rank's sparse stream to every rank, summed"),
}


COLLECTIVES: dict[str, Collective] = {c.name: c for c in (
    Collective(
        "ring-majority", "sign majority over a ring, counts in ceil(log2(i+1)) bits",
        lambda comm, x, state, check: majority.ring_majority(comm, x, check=check),
        lambda n, size, rank, check: majority.ring_majority_bytes(n, size, rank, check=check),
        is_majority=True, emulated=True),
    Collective(
        "ring-majority-radix", "ring-majority with counts in base-(i+1) groups",
        lambda comm, x, state, check: majority.ring_majority(comm, x, packing="radix",
                                                             check=check),
        lambda n, size, rank, check: majority.ring_majority_bytes(n, size, rank,
                                                                  packing="radix", check=check),
        is_majority=True, emulated=True),
    Collective(
        "alltoall-majority", "sign majority by an all-to-all of 1-bit votes (1-bit Adam's path)",
        lambda comm, x, state, check: majority.alltoall_majority(comm, x, check=check),
        lambda n, size, rank, check: majority.alltoall_majority_bytes(n, size, rank,
                                                                      check=check),
        is_majority=True, emulated=True),
    Collective(
        "allgather-majority", "sign majority from one allgather of every rank's 1-bit votes",
        lambda comm, x, state, check: majority.allgather_majority(comm, x, check=check),
        lambda n, size, rank, check: majority.allgather_majority_bytes(n, size, check=check),
        is_majority=True),
    Collective(
        "onebit-allreduce", "1-bit Adam's compressed allreduce with error feedback",
        lambda comm, x, state, check: onebit.onebit_allreduce(comm, x, state, check=check),
        lambda n, size, rank, check: onebit.onebit_allreduce_bytes(n, size, check=check),
        state=lambda n, size, device: onebit.OneBitState(n, size, device), emulated=True),
    Collective(
        "onebit-allgather", "1-bit Adam's compressed allreduce in one round: every rank serves "
        "every chunk",
        lambda comm, x, state, check: onebit.onebit_allreduce(comm, x, state, check=check),
        lambda n, size, rank, check: onebit.onebit_allreduce_bytes(
            n, size, check=check, collective="allgather"),
        state=lambda n, size, device: onebit.OneBitState(n, size, device,
                                                         collective="allgather")),
    Collective(
        "sparse-allgather", "every rank's top 1% as fp32 (index, value) pairs to every rank",
        lambda comm, x, state, check: sparse.sparse_allgather(comm, x, _k(x.numel()),
                                                              check=check)[0],
        lambda n, size, rank, check: sparse.sparse_allgather_bytes(
            sparse_codec.encoded_size(n, _k(n), "fp32"), size, check=check)),
    *(_sparcml(name, fn, summary, DENSITY) for name, (fn, summary) in _SPARCML.items()),
    _oktopk(DENSITY),
    Collective(
        "allreduce", "the dense float32 sum (the baseline)",
        lambda comm, x, state, check: dense.allreduce(comm, x, check=check),
        lambda n, size, rank, check: dense.allreduce_bytes(n, size, check=check)),
)}
"""Every collective the comparisons run, by name, in listing order."""


EMULATED = tuple(name for name, c in COLLECTIVES.items() if c.emulated)
"""Names of the collectives the model traces and the emulated experiments compare."""


def get(name: str, *, emulated: bool = False) -> Collective:
    """Return the collective called ``name``; ``ValueError`` naming the choices otherwise.

    A sparse collective (SparCML's, Ok-Topk's) takes the share of every rank's input it keeps
    after ``@``: ``ssar-split-allgather@5%`` or ``@0.05`` (default :data:`DENSITY`). With
    ``emulated=True`` only the :data:`EMULATED` ones are accepted. Ok-Topk's variants on
    :func:`skewed` inputs (``oktopk-skewed``, ``-direct``, ``-even``: the paper's Figure 7
    comparison) are found by name here and not listed in :data:`COLLECTIVES`.
    """
    choices = EMULATED if emulated else tuple(COLLECTIVES)
    base, at, density = name.partition("@") if isinstance(name, str) else (name, "", "")
    if at and base in _SPARCML:
        return _sparcml(base, _SPARCML[base][0], _SPARCML[base][1], _density(density, name))
    if base in _OKTOPK and base != "oktopk":
        return _oktopk(_density(density, name) if at else DENSITY, base)
    if at and base == "oktopk":
        return _oktopk(_density(density, name))
    if name not in choices:
        raise ValueError(f"expected a collective in {list(choices)} (SparCML's with @DENSITY, "
                         f"e.g. ssar-split-allgather@5%), got {name!r}")
    return COLLECTIVES[name]


def is_emulated(name: object) -> bool:
    """Return whether ``name`` is a collective the emulated experiments can run."""
    try:
        get(str(name), emulated=True)
    except ValueError:
        return False
    return True


def _density(text: str, name: str) -> float:
    try:
        value = float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value <= 1:
        raise ValueError(f"expected a density in (0, 1] or (0%, 100%] after '@' in {name!r}, "
                         f"got {text!r}")
    return value


@dataclasses.dataclass
class Timing:
    """Per-call times of a collective over all ranks (nccl-tests' convention).

    ``seconds[i]`` is call i's time on its slowest rank (a collective ends when the last rank
    has its result); ``cpu_seconds[i]`` its CPU time summed over ranks. Statistics are over
    calls.
    """

    seconds: list[float]
    cpu_seconds: list[float]

    @property
    def median(self) -> float:
        """Median over calls of the per-call time."""
        return statistics.median(self.seconds)

    @property
    def spread(self) -> tuple[float, float, float]:
        """(min, median, max) over calls of the per-call time."""
        return min(self.seconds), self.median, max(self.seconds)


def time_calls(comm: Comm, fn: Callable[[], object], repeat: int) -> tuple[list[float],
                                                                               list[float]]:
    """Time ``repeat`` calls of ``fn`` on this rank, each started after a barrier.

    The one timing loop of the collective benchmarks and experiments. Returns this rank's
    (wall, CPU) seconds per call; :func:`combine` turns every rank's into a :class:`Timing`
    (separately, so callers can read counters between the calls and the gathers).
    """
    wall, cpu = [], []
    for _ in range(repeat):
        comm.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return wall, cpu


def combine(comm: Comm, local: tuple[list[float], list[float]]) -> Timing:
    """Return the :class:`Timing` of every rank's :func:`time_calls` (every rank calls it)."""
    wall, cpu = local
    every = comm.allgather_floats([*wall, *cpu])
    k = len(wall)
    return Timing([max(r[i] for r in every) for i in range(k)],
                  [sum(r[k + i] for r in every) for i in range(k)])
