"""Ok-Topk's O(k) sparse allreduce: ``Topk(sum_i Topk(acc_i))`` in under ``6k(P-1)/P`` words.

Li and Hoefler, "Near-Optimal Sparse Allreduce for Distributed Deep Learning" (PPoPP 2022),
Section 3 and Algorithm 1. Each rank ``i`` of ``P`` holds an accumulator ``acc_i`` of ``n``
elements; one call, with an :class:`OkTopkState` carried from call to call:

1. **Local selection.** ``L_i = {j : |acc_i[j]| >= th_i, acc_i[j] != 0}``. Every ``tau_prime``
   calls ``th_i`` is the exact k-th largest ``|acc_i|`` (so ``|L_i| = k`` without ties), or
   SIDCo's fitted threshold with ``local_fit``; in between it is reused.
2. **Space repartition** every ``tau`` calls: each rank proposes ``P - 1`` boundaries that cut
   its sorted ``L_i`` into equal counts (the first index of each chunk; an even split of
   ``[0, n)`` when ``|L_i| < P``); every rank averages the proposals (an allgather of int64,
   floored: the same on every rank). Region ``j`` is ``[b_j, b_{j+1})`` and rank ``j`` owns it.
3. **Split and reduce.** An all-to-all of entry counts, then ``P - 1`` steps in which rank ``i``
   sends its entries in region ``(i + s) mod P`` to that region's owner and receives from
   ``(i - s) mod P`` (destination rotation: no rank is everyone's target at once), at most
   ``throttle`` sends in flight. The owner adds the pieces in rank order, so the bits of a sum
   depend on neither arrival order, throttle nor boundaries (the paper overlaps each piece's
   scatter-add with the next transfer; that would make the sum's rounding depend on arrival).
4. **Global selection.** Every ``tau_prime`` calls (the same calls as 1) all reduced entries
   are allgathered (values only, in region order) and the global threshold is the exact k-th
   largest ``|value|``; in between it is reused. ``G = {j : |R[j]| >= global_th}`` over the
   reduced entries ``R``.
5. **Balance and allgatherv.** The counts ``|G ∩ region_j|`` are allgathered (on recompute calls
   every rank already has them); when balancing, the entries, seen as one sorted sequence, are
   cut into ``P`` even blocks and the pieces moved point to point to their block's rank; then an
   allgatherv of the blocks. The result equals an allgatherv of each region's ``G`` entries.
6. **Output.** ``u``: the dense float32 sum over ``G`` (the SGD divides by ``P``), identical on
   every rank, and ``indexes = L_i ∩ G``: the local entries that made it into ``u`` (Ok-Topk SGD
   zeroes only those in its residual).

Choices the paper leaves open, from the authors' public code where it settles them:

* ``feedback`` (default on): a reused local threshold is raised by 1.03 up to 5 times while more
  than ``4k/3`` entries pass it; after each call it is divided by 1.012 when fewer than ``2k/3``
  passed and multiplied by 1.012 when more than ``5k/4``; a reused global threshold is divided
  by 1.008 when fewer than ``2k/3`` entries were selected and multiplied when more than
  ``4k/3``.
* ``balance``: ``"auto"`` (the paper's rule: when the largest count exceeds 4 times the mean),
  ``"always"`` or ``"never"`` (the public code hard-wires one or the other).
* Thresholds select with ``>=`` and never select a zero entry; ties at the k-th value are all
  kept. With ``P = 1`` or fewer than ``P`` local entries the repartition falls back to an even
  split (the public code crashes on both).

Oracle: with ``R = sum_i acc_i * [j in L_i]`` (rank order), the output is ``R * [G]``; with
``tau_prime = 1`` and no feedback that is ``Topk(sum_i Topk(acc_i))``.

Wire. An entry is an index (int32 when ``n < 2**31``, else int64) and a float32 value: one
word each, 4 bytes a word with int32 indices. A piece travels as its indices then its values;
counts go as int64. Bytes a rank sends (:func:`oktopk_allreduce_bytes`, from the call's
:class:`OkTopkStats`; ``w`` the bytes of an entry)::

    24 (P-1)                 the agreement, with check
    + 8 (P-1)^2              repartition calls: P-1 proposals to each other rank
    + 8 (P-1)                the count all-to-all
    + w * pieces             entries sent to other regions' owners
    + 8 (P-1) + 4 (P-1) * reduced    recompute calls: counts and values of the own region
    + 8 (P-1)                other calls: the selected count
    + w * moved + w (P-1) * block    balancing, then the allgatherv

With balanced regions ``pieces ~ k(P-1)/P`` and ``block <= |G|/P + 1``, so the payload stays
below ``6k(P-1)/P`` words plus the counts (Section 3.1, equation 3).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch

from bitcomm.codecs import _frame, select, sidco, stream
from bitcomm.collectives import _common
from bitcomm.comm.base import Comm, Request

__all__ = ["OkTopkState", "OkTopkStats", "oktopk_allreduce", "oktopk_allreduce_bytes",
           "BALANCE", "REGIONS"]

BALANCE = ("auto", "always", "never")
"""When to balance before the allgatherv."""
REGIONS = ("balanced", "even")
"""How the index space is cut into the ranks' regions."""


@dataclasses.dataclass(frozen=True)
class OkTopkStats:
    """What one call selected and moved (for the byte count and the selection quality).

    Attributes:
        local: entries this rank selected, ``|L_i|``.
        selected: entries of the result, ``|G|`` (the same on every rank).
        recomputed: the thresholds were recomputed exactly in this call.
        repartitioned: the region boundaries were recomputed in this call.
        balanced: the entries were balanced before the allgatherv.
        pieces: entries this rank sent to other regions' owners.
        received: entries this rank received from other ranks for its region.
        reduced: entries of this rank's region after the reduction.
        moved: entries this rank sent while balancing.
        block: entries this rank contributed to the allgatherv.

    """

    local: int
    selected: int
    recomputed: bool
    repartitioned: bool
    balanced: bool
    pieces: int
    received: int
    reduced: int
    moved: int
    block: int


@dataclasses.dataclass
class OkTopkState:
    """Ok-Topk's state for one accumulator, carried from call to call (Algorithm 1).

    The options must be equal on every rank; the thresholds and boundaries are kept equal by
    the algorithm where they must be (``global_th``, ``boundaries``) and per rank where not
    (``local_th``). The agreement compares the shared part on every call.

    Attributes:
        tau: calls between space repartitions (the paper's 64).
        tau_prime: calls between exact thresholds (the paper's 32; 128 for BERT).
        throttle: sends in flight during split and reduce (``min(throttle, P - 1)``).
        balance: ``"auto"``, ``"always"`` or ``"never"``.
        regions: ``"balanced"`` (repartitioned every ``tau`` calls from the selected indices)
            or ``"even"`` (``[0, n)`` cut into equal ranges, never repartitioned: the naive
            split the paper compares against).
        feedback: adjust reused thresholds by the selected counts (the public code's rules,
            with the factors below).
        raise_step: factor a reused local threshold is raised by while over 4k/3 pass (1.03).
        raise_tries: at most this many raises per call (5).
        local_step: factor of the local threshold's correction after a call (1.012).
        global_step: factor of the global threshold's correction after a call (1.008).
        local_fit: ``None`` (the exact k-th largest ``|acc|``) or a SIDCo fit
            (:data:`bitcomm.codecs.sidco.DISTRIBUTIONS`) for the local threshold on recompute
            calls: one pass instead of a top-k.
        local_stages: SIDCo's stage count for ``local_fit``.
        iteration: calls so far.
        local_th: this rank's local threshold.
        global_th: the global threshold (equal on every rank).
        boundaries: the ``P - 1`` inner region boundaries (equal on every rank).
        last: what the last call selected and moved.

    """

    tau: int = 64
    tau_prime: int = 32
    throttle: int = 4
    balance: str = "auto"
    regions: str = "balanced"
    feedback: bool = True
    raise_step: float = 1.03
    raise_tries: int = 5
    local_step: float = 1.012
    global_step: float = 1.008
    local_fit: str | None = None
    local_stages: int = 1
    iteration: int = 0
    local_th: float | None = None
    global_th: float | None = None
    boundaries: list[int] | None = None
    last: OkTopkStats | None = None

    def check(self) -> None:
        """Raise ``ValueError``/``TypeError`` for options outside their ranges."""
        for name in ("tau", "tau_prime", "throttle"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"expected {name} to be an int, got {type(v).__name__}")
            if v < 1:
                raise ValueError(f"expected {name} >= 1, got {v}")
        if self.balance not in BALANCE:
            raise ValueError(f"expected balance in {BALANCE}, got {self.balance!r}")
        if self.regions not in REGIONS:
            raise ValueError(f"expected regions in {REGIONS}, got {self.regions!r}")
        for name in ("raise_step", "local_step", "global_step"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 1 <= v < 2:
                raise ValueError(f"expected {name} in [1, 2), got {v!r}")
        if isinstance(self.raise_tries, bool) or not isinstance(self.raise_tries, int) \
                or self.raise_tries < 0:
            raise ValueError(f"expected raise_tries to be an int >= 0, got {self.raise_tries!r}")
        if self.local_fit is not None and self.local_fit not in sidco.DISTRIBUTIONS:
            raise ValueError(f"expected local_fit None or one of {sidco.DISTRIBUTIONS}, got "
                             f"{self.local_fit!r}")
        if isinstance(self.local_stages, bool) or not isinstance(self.local_stages, int) \
                or self.local_stages < 1:
            raise ValueError(f"expected local_stages to be an int >= 1, got "
                             f"{self.local_stages!r}")

    def state_dict(self) -> dict:
        """Return the state to resume from (``last`` is not kept)."""
        d = dataclasses.asdict(self)
        d.pop("last")
        return d

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` returned."""
        for key, value in state.items():
            setattr(self, key, list(value) if key == "boundaries" and value is not None
                    else value)

    def _shared(self) -> dict[str, object]:
        return {"tau": self.tau, "tau_prime": self.tau_prime, "balance": self.balance,
                "regions": self.regions,
                "feedback": self.feedback, "iteration": self.iteration,
                "factors": (self.raise_step, self.raise_tries, self.local_step,
                            self.global_step), "local_fit": (self.local_fit, self.local_stages),
                "global_th": self.global_th, "boundaries": self.boundaries}


def _entry_bytes(n: int) -> int:
    return stream.index_width(n) + 4


def oktopk_allreduce_bytes(size: int, n: int, stats: OkTopkStats, *, check: bool = True) -> int:
    """Return the bytes one rank sent in a call that reported ``stats`` (module docstring)."""
    if size == 1:
        return 0
    p1, w = size - 1, _entry_bytes(n)
    total = _common.control_bytes(size, check) + 8 * p1 + w * stats.pieces
    if stats.repartitioned:
        total += 8 * p1 * p1
    total += 8 * p1 + (4 * p1 * stats.reduced if stats.recomputed else 0)
    return total + w * stats.moved + w * p1 * stats.block


# -- pieces of the call -----------------------------------------------------------------------


def _kth_largest(a: torch.Tensor, k: int) -> torch.Tensor:
    """Return the threshold keeping the k largest of ``a`` (non-negative), on ``a``'s device.

    All of them if fewer; none (``inf``) if ``k`` is 0 or ``a`` is empty. No host read.
    """
    if a.numel() == 0 or k == 0:
        return torch.full((), math.inf, dtype=a.dtype, device=a.device)
    if k >= a.numel():
        return a.min()
    if _frame.use_triton(a):  # radix selection: torch.topk sorts a long vector on a GPU
        return _frame.kernels().kth_largest(a, k)
    if _frame.numpy_float(a):  # select's numpy path: 8M values, k = 1%: 8 ms, topk 134 ms
        return a[select.topk(a, k, check=False)].min()
    return torch.topk(a, k, sorted=False).values.min()


def _local_threshold(mag: torch.Tensor, nonzero: torch.Tensor, k: int) -> torch.Tensor:
    """Return the k-th largest nonzero ``mag`` on the device; the least one if fewer."""
    kth = _kth_largest(mag, k)  # among zeros too: positive exactly when k values are
    least = torch.where(nonzero, mag, math.inf).min() if mag.numel() else kth
    return torch.where(kth > 0, kth, least)


def _edges(counts: list[int]) -> list[int]:
    """Return the offsets at which the regions' ``counts`` of entries start, and the end."""
    edges = [0]
    for c in counts:
        edges.append(edges[-1] + c)
    return edges


def _local(mag: torch.Tensor, k: int, state: OkTopkState, recompute: bool,
           bounds: list[int] | None) -> tuple[torch.Tensor, list[int] | None]:
    """Return ``L_i`` (ascending int64) and, given the region ``bounds``, its cuts at them.

    One host read per try (on a GPU, one wait): a recomputed threshold and the count in each
    region come back together, and the count sizes the indices without another read.
    """
    n = mag.numel()
    # On the numpy path a threshold on the host selects in one comparison: mag >= th > 0, or
    # mag > 0 when th <= 0 (torch's and numpy's scalars both round to mag's dtype).
    host = _frame.numpy_float(mag)
    fit = recompute or state.local_th is None or math.isinf(state.local_th)
    exact = fit and (state.local_fit is None or k == 0)  # a threshold computed on the device
    nonzero = mag > 0 if exact or not host else None  # for every mask but the host's
    computed = None
    if fit:
        if exact:
            computed = _local_threshold(mag, nonzero, k)
        else:
            state.local_th = sidco.threshold(mag, min(1.0, k / n), state.local_fit,
                                             state.local_stages, check=False)
    regions = list(zip([0, *bounds], [*bounds, n], strict=True)) if bounds is not None \
        else [(0, n)]
    tries = state.raise_tries if state.feedback and not recompute else 0
    while True:
        if computed is None and host:
            a, th = mag.numpy(), state.local_th
            mask = torch.from_numpy(np.greater(a, 0) if th <= 0 else
                                    np.greater_equal(a, _frame.rounded(th, a)))
        else:
            mask = nonzero & (mag >= (state.local_th if computed is None else computed))
        # count_nonzero: a bool sum promotes through int64, several times slower on a CPU
        counts = torch.stack([torch.count_nonzero(mask[a:b]) for a, b in regions]).to(
            torch.float64)
        if computed is not None:
            counts = torch.cat([computed.to(torch.float64).reshape(1), counts])
        got = counts.tolist()
        if computed is not None:
            state.local_th, computed = got.pop(0), None
        found = [int(c) for c in got]
        if tries == 0 or 3 * sum(found) <= 4 * k:
            break
        tries -= 1
        state.local_th *= state.raise_step
    local = _frame.indices_of(mask, sum(found))
    return local, _edges(found) if bounds is not None else None


def _repartition(comm: Comm, local: torch.Tensor, n: int) -> tuple[list[int], list[int]]:
    """Return the averaged region boundaries and the cuts of ``local`` at them.

    Each rank proposes the first index of each of ``P`` equal chunks of ``local`` (an even
    split of ``[0, n)`` when ``|local| < P``). The proposals' check, their floored mean and
    the cuts come back in one host read.
    """
    size, m = comm.size, local.numel()
    firsts = [j * (n if m < size else m) // size for j in range(1, size)]
    at = _frame.to_device(torch.tensor(firsts, dtype=torch.int64), local.device)
    mine = at if m < size else local[at]
    got = comm.allgatherv(mine.view(torch.uint8), [8 * (size - 1)] * size)
    props = torch.stack([g.to(local.device).view(torch.int64) for g in got])
    bad = ((props < 0) | (props > n)).any().reshape(1).to(torch.int64)
    # floor of the mean of non-decreasing proposals: non-decreasing, the same on every rank
    bounds = props.sum(0) // size
    read = torch.cat([bad, bounds, torch.searchsorted(local, bounds)]).tolist()
    if read[0]:
        raise ValueError(f"oktopk_allreduce: a rank proposed a region boundary outside [0, {n}]")
    return read[1:size], [0, *read[size:], m]


def _pack(idx: torch.Tensor, val: torch.Tensor, n: int) -> torch.Tensor:
    itype = torch.int32 if stream.index_width(n) == 4 else torch.int64
    return torch.cat([idx.to(itype).view(torch.uint8), val.contiguous().view(torch.uint8)])


def _unpack(buf: torch.Tensor, count: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Return a received piece's indices and values, unchecked (see :func:`_checks`)."""
    iw = stream.index_width(n)
    itype = torch.int32 if iw == 4 else torch.int64
    return buf[: iw * count].view(itype).to(torch.int64), buf[iw * count:].view(torch.float32)


def _checks(pieces: list[tuple[int, torch.Tensor, int, int]]) -> list:
    """Return the checks of received ``(peer, indices, lo, hi)`` pieces, unread.

    ``(flag, fallback)`` pairs for :func:`bitcomm.codecs._frame.read_checked`: the indices
    must increase within ``[lo, hi)`` (an empty piece breaks nothing). The pieces come in rank
    order, so the first one flagged names the lowest peer that sent a broken piece.
    """
    def refuse(peer: int, lo: int, hi: int):  # noqa: ANN202 - a fallback that raises
        def fallback() -> None:
            raise ValueError(f"oktopk_allreduce: rank {peer} sent indices outside [{lo}, {hi}) "
                             "or out of order")
        return fallback

    return [(_frame.broken_order(idx, lo, hi), refuse(peer, lo, hi))
            for peer, idx, lo, hi in pieces if idx.numel()]


def _counts(comm: Comm, mine: list[int]) -> list[int]:
    """All-to-all of one int64 count per rank."""
    bufs = [torch.tensor([c], dtype=torch.int64).view(torch.uint8) for c in mine]
    got = comm.alltoallv(bufs, [8] * comm.size)
    return torch.cat(got).view(torch.int64).tolist()


def _allgather_counts(comm: Comm, mine: torch.Tensor) -> list[int]:
    """Allgather of one int64 count (a 1-element tensor, on the device or the host)."""
    got = comm.allgatherv(mine.to(torch.int64).reshape(1).view(torch.uint8), [8] * comm.size)
    return torch.cat([g.to(mine.device) for g in got]).view(torch.int64).tolist()


def _checked(counts: list[int], limit: int, what: str) -> list[int]:
    bad = [r for r, c in enumerate(counts) if not 0 <= c <= limit]
    if bad:
        raise ValueError(f"oktopk_allreduce: rank(s) {bad} announced {what} beyond 0..{limit} "
                         f"entries")
    return counts


def _split_and_reduce(comm: Comm, idx: torch.Tensor, val: torch.Tensor, bounds: list[int],
                      edges: list[int], n: int, throttle: int
                      ) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """Send region ``j``'s entries, ``idx[edges[j]:edges[j + 1]]``, to rank ``j``; add up.

    The own region's pieces are added in rank order.

    Returns the own region's reduced entries, the entries sent to others and those received.
    The received pieces' checks come back with the reduced count in one host read; until then
    their indices are clamped into the region, so a broken piece addresses no memory outside
    it (and the call raises before it sends anything more).
    """
    size, rank = comm.size, comm.rank
    parts = [(idx[edges[j]:edges[j + 1]], val[edges[j]:edges[j + 1]]) for j in range(size)]
    lo, hi = ([0, *bounds][rank], [*bounds, n][rank])
    counts = _checked(_counts(comm, [p[0].numel() for p in parts]), hi - lo, "a piece of")
    w = _entry_bytes(n)
    got: dict[int, tuple[torch.Tensor, torch.Tensor]] = {rank: parts[rank]}
    steps = list(range(1, size))
    for at in range(0, len(steps), throttle):
        batch = steps[at:at + throttle]
        sends: list[Request] = []
        for s in batch:
            dest = (rank + s) % size
            if parts[dest][0].numel():
                sends.append(comm.isend(_pack(*parts[dest], n), dest))
        for s in batch:
            src = (rank - s) % size
            if counts[src]:
                buf = comm.recv(torch.empty(w * counts[src], dtype=torch.uint8,
                                            device=val.device), src)
                got[src] = _unpack(buf, counts[src], n)
        Request.wait_all(sends)
    received = [(r, got[r][0], lo, hi) for r in sorted(got) if r != rank]
    dense = torch.zeros(hi - lo, dtype=torch.float32, device=val.device)
    present = torch.zeros(hi - lo, dtype=torch.bool, device=val.device)
    for r in range(size):  # rank order: the bits do not depend on arrival
        if r in got and got[r][0].numel():
            slot = (got[r][0] - lo).clamp_(0, hi - lo - 1)
            dense.index_add_(0, slot, got[r][1])
            present.index_fill_(0, slot, True)  # present[slot] = True copies from the host
    (count,) = _frame.read_checked(_checks(received), torch.count_nonzero(present).reshape(1))
    where = _frame.indices_of(present, count)
    pieces = sum(p[0].numel() for j, p in enumerate(parts) if j != rank)
    return where + lo, dense[where], pieces, sum(c for r, c in enumerate(counts) if r != rank)


def _balance(comm: Comm, idx: torch.Tensor, val: torch.Tensor, counts: list[int], n: int
             ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Move entries so that rank j holds block j of the virtual concatenation; return it."""
    size, rank = comm.size, comm.rank
    offsets = [sum(counts[:r]) for r in range(size + 1)]
    total = offsets[-1]
    blocks = _common.bounds(total, size)
    mine_lo, mine_hi = offsets[rank], offsets[rank + 1]
    w = _entry_bytes(n)
    sends: list[Request] = []
    moved = 0
    for j, (b_lo, b_hi) in enumerate(blocks):
        lo, hi = max(mine_lo, b_lo), min(mine_hi, b_hi)
        if j != rank and lo < hi:
            a, b = lo - mine_lo, hi - mine_lo
            sends.append(comm.isend(_pack(idx[a:b], val[a:b], n), j))
            moved += hi - lo
    b_lo, b_hi = blocks[rank]
    out_i, out_v = [], []
    received: list[tuple[int, torch.Tensor, int, int]] = []
    for h in range(size):
        lo, hi = max(offsets[h], b_lo), min(offsets[h + 1], b_hi)
        if lo >= hi:
            continue
        if h == rank:
            a, b = lo - mine_lo, hi - mine_lo
            out_i.append(idx[a:b])
            out_v.append(val[a:b])
        else:
            buf = comm.recv(torch.empty(w * (hi - lo), dtype=torch.uint8, device=val.device), h)
            i, v = _unpack(buf, hi - lo, n)
            received.append((h, i, 0, n))
            out_i.append(i)
            out_v.append(v)
    Request.wait_all(sends)
    _frame.read_checked(_checks(received))
    if not out_i:
        return idx[:0], val[:0], moved
    return torch.cat(out_i), torch.cat(out_v), moved


def _allgatherv_entries(comm: Comm, idx: torch.Tensor, val: torch.Tensor, counts: list[int],
                        n: int) -> tuple[torch.Tensor, torch.Tensor,
                                         list[tuple[int, torch.Tensor, int, int]]]:
    """Return every rank's entries, in rank order, and the received pieces to check.

    The pieces are not checked here: the caller reads their checks (:func:`_checks`) with
    its own count. Until then the indices are clamped into ``[0, n)``, so a broken piece addresses
    no memory outside the result.
    """
    w = _entry_bytes(n)
    got = comm.allgatherv(_pack(idx, val, n), [w * c for c in counts])
    parts = [(idx, val) if r == comm.rank else _unpack(g.to(val.device), counts[r], n)
             for r, g in enumerate(got)]
    received = [(r, p[0], 0, n) for r, p in enumerate(parts) if r != comm.rank]
    every = torch.cat([p[0] for p in parts])
    return every.clamp_(0, max(n - 1, 0)), torch.cat([p[1] for p in parts]), received


# -- the collective ---------------------------------------------------------------------------


def oktopk_allreduce(comm: Comm, acc: torch.Tensor, k: int, state: OkTopkState, *,
                     check: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Return Ok-Topk's sparse allreduce of ``acc`` and the local entries it used.

    Args:
        comm: the transport.
        acc: this rank's accumulator (float; computed in float32), the same length everywhere.
        k: the target count of local and global selections, ``0 <= k <= n``.
        state: the :class:`OkTopkState` of this accumulator; updated in place.
        check: agree on the call first: bad input, options or diverged state (iteration,
            global threshold, boundaries) on any rank raise on every rank.

    Returns:
        ``(u, indexes)``: the float32 sum of the globally selected entries (``acc``'s shape,
        identical on every rank) and this rank's selected indices (ascending int64) that are
        in it.

    """
    def validate(v: torch.Tensor) -> None:
        state.check()
        count = _frame.check_count(k, "k")
        if count > v.numel():
            raise ValueError(f"expected 0 <= k <= {v.numel()} elements, got k={k}")
        b = state.boundaries
        if b is not None and (len(b) != comm.size - 1
                              or any(isinstance(x, bool) or not isinstance(x, int) for x in b)
                              or any(not 0 <= x <= v.numel() for x in b)
                              or any(x > y for x, y in zip(b, b[1:], strict=False))):
            raise ValueError(f"expected {comm.size - 1} non-decreasing int boundaries in "
                             f"[0, {v.numel()}] in the state, got {b}")

    if not isinstance(state, OkTopkState):
        raise TypeError(f"expected state to be an OkTopkState, got {type(state).__name__}")
    options = {"k": k, **state._shared()}
    v = _common.prepare(comm, acc, check, "oktopk_allreduce", float32=True, options=options,
                        validate=validate).to(torch.float32)
    n, size = v.numel(), comm.size
    t = state.iteration + 1
    # a global threshold that selected nothing (every reduced value zero) is recomputed too
    recompute = (t - 1) % state.tau_prime == 0 or state.global_th is None or \
        math.isinf(state.global_th)
    repartition = state.regions == "balanced" and ((t - 1) % state.tau == 0
                                                    or state.boundaries is None)
    if state.regions == "even":
        state.boundaries = [j * n // size for j in range(1, size)]

    # One host read (on a GPU, one wait) at each step whose sizes the next one needs: the
    # local selection, the pieces' counts, the reduced region, the global counts and the
    # result's share of the local entries; each brings back the checks made since the last.
    split = None if repartition and size > 1 else (state.boundaries if size > 1 else [])
    local, edges = _local(v.abs(), k, state, recompute, split)
    if repartition:
        if size > 1:
            state.boundaries, edges = _repartition(comm, local, n)
        else:
            state.boundaries = []
    bounds = state.boundaries
    if size > 1:
        r_idx, r_val, pieces, received = _split_and_reduce(
            comm, local, v[local], bounds, edges, n, min(state.throttle, size - 1))
    else:
        r_idx, r_val, pieces, received = local, v[local], 0, 0
    mag = r_val.abs()
    if recompute:
        sizes = (_checked(_allgather_counts(comm, torch.tensor([r_idx.numel()])), n,
                          "a region of") if size > 1 else [r_idx.numel()])
        if size > 1:
            got = comm.allgatherv(r_val.contiguous().view(torch.uint8), [4 * c for c in sizes])
            every = [g.to(v.device).view(torch.float32).abs() for g in got]
        else:
            every = [mag]
        th = _kth_largest(torch.cat(every), k)
        read = torch.cat([th.to(torch.float64).reshape(1), torch.stack(
            [torch.count_nonzero(e >= th) for e in every]).to(torch.float64)]).tolist()
        state.global_th, counts = read[0], [int(c) for c in read[1:]]
        keep = _frame.indices_of(mag >= state.global_th, counts[comm.rank])
    else:
        over = mag >= state.global_th
        chosen_here = torch.count_nonzero(over)
        counts = (_checked(_allgather_counts(comm, chosen_here), n, "a selection of")
                  if size > 1 else [int(chosen_here)])
        keep = _frame.indices_of(over, counts[comm.rank])
    g_idx, g_val = r_idx[keep], r_val[keep]
    total = sum(counts)
    balanced = size > 1 and (state.balance == "always" or (
        state.balance == "auto" and max(counts) * size > 4 * total))
    moved = 0
    gathered: list[tuple[int, torch.Tensor, int, int]] = []
    if size > 1:
        if balanced:
            g_idx, g_val, moved = _balance(comm, g_idx, g_val, counts, n)
            counts = [hi - lo for lo, hi in _common.bounds(total, size)]
        block = g_idx.numel()
        all_idx, all_val, gathered = _allgatherv_entries(comm, g_idx, g_val, counts, n)
    else:
        block, all_idx, all_val = 0, g_idx, g_val
    u = torch.zeros(n, dtype=torch.float32, device=v.device)
    u[all_idx] = all_val
    chosen = torch.zeros(n, dtype=torch.bool, device=v.device)
    chosen.index_fill_(0, all_idx, True)  # chosen[all_idx] = True copies from the host
    mine = chosen[local]
    (count,) = _frame.read_checked(_checks(gathered), torch.count_nonzero(mine).reshape(1))
    indexes = local[_frame.indices_of(mine, count)]

    if state.feedback:
        m = local.numel()
        if 3 * m < 2 * k:
            state.local_th /= state.local_step
        elif 4 * m > 5 * k:
            state.local_th *= state.local_step
        if not recompute:
            if 3 * total < 2 * k:
                state.global_th /= state.global_step
            elif 3 * total > 4 * k:
                state.global_th *= state.global_step
    state.iteration = t
    state.last = OkTopkStats(local=local.numel(), selected=total, recomputed=recompute,
                             repartitioned=repartition and size > 1, balanced=balanced,
                             pieces=pieces, received=received, reduced=r_idx.numel(),
                             moved=moved, block=block)
    return u.reshape(acc.shape), indexes

