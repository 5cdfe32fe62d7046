"""Majority vote of signs over ranks: All-Reducible signSGD's ring, an all-to-all, an allgather.

All three return, on every rank, ``+1`` where more than half of the ranks hold ``x >= 0`` (the sign
codec's convention), as a tensor of ``x``'s dtype, shape and device. A tie ``2 * count == size``
(only with an even number of ranks) gives ``-1`` by default, the paper's "else negative" rule;
``+1`` with ``tie="positive"``; or, with ``tie="alternate"``, ``+1`` where the element's index
in the flattened ``x`` plus ``phase`` is even and ``-1`` where it is odd. Both fixed rules bias
every tied element the same way; ``"alternate"`` with a phase that counts steps (the optimizers
and hooks pass their step number) sends a tied element up and down on alternate steps, and half
of a step's ties each way, at no cost on the wire. The vector is cut into ``size`` chunks
``[K*c//N, K*(c+1)//N)`` (any K, also K < N).

ring_majority (All-Reducible signSGD, Section 3)
    Reduce-scatter: at step ``i = 1 .. N-1`` rank ``r`` sends to ``r + 1`` the running +1 counts
    of chunk ``(r - i + 1) mod N``, a count over ``i`` ranks, packed by
    :mod:`bitcomm.codecs.counts` in ``ceil(log2(i + 1))`` bits (or radix), and adds its own
    votes to the chunk ``(r - i) mod N`` it receives. Rank ``r`` ends with the full counts of
    chunk ``(r + 1) mod N``, decides it, and an allgather of ``N - 1`` steps streams the 1-bit
    decisions around the ring (step ``i`` sends chunk ``(r + 2 - i) mod N``).

    Bytes sent by rank ``r`` (:func:`ring_majority_bytes`)::

        sum_{i=1}^{N-1} packed(L[(r-i+1) mod N], m=i)  +  sum_{i=1}^{N-1} ceil(L[(r+2-i) mod N]/8)
        + 24 * (N - 1) with check

    with ``L[c]`` the chunk lengths and ``packed`` :func:`bitcomm.codecs.counts.packed_size`.

alltoall_majority (1-bit Adam's pattern, the paper's baseline)
    Rank ``r`` owns chunk ``r``: an all-to-all sends each rank the packed signs of its chunk,
    each rank counts the votes of its chunk and decides, and an allgather returns the packed
    decisions. Bytes sent by rank ``r`` (:func:`alltoall_majority_bytes`)::

        sum_{j != r} ceil(L[j]/8)  +  (N - 1) * ceil(L[r]/8)  +  24 * (N - 1) with check

allgather_majority (signSGD with majority vote's direct exchange)
    Every rank sends its packed signs of the whole vector to every rank in one allgather, and
    each rank counts all ``N`` votes and decides every element itself. One round where the
    others take two (all-to-all) or ``2 (N - 1)`` (ring): for the small buckets of a DDP hook,
    whose cost is latency, that is the cheapest, and at ``N = 2`` it sends exactly the ring's
    bytes. Bytes sent by every rank (:func:`allgather_majority_bytes`)::

        (N - 1) * ceil(K/8)  +  24 * (N - 1) with check

Example::

    from bitcomm.comm import run_local
    x = [torch.tensor([1., -1., 2.]), torch.tensor([-1., -1., 3.]), torch.tensor([1., 1., -4.])]
    run_local(lambda comm: ring_majority(comm, x[comm.rank]), size=3)
    # every rank: tensor([ 1., -1.,  1.])
"""

from __future__ import annotations

import numpy as np
import torch

from bitcomm.codecs import _frame, bits, counts, sign
from bitcomm.collectives import _common
from bitcomm.comm.base import Comm, Request

_BYTE_RANKS = 0xFF
"""The most ranks whose vote counts add up in uint8 (more take int32)."""
_VOTE_SLICE = 1 << 16
"""Elements whose votes the CPU counts at a time (a multiple of 8: whole bytes)."""

__all__ = ["ring_majority", "ring_majority_packed", "alltoall_majority",
           "alltoall_majority_packed", "allgather_majority", "allgather_majority_packed",
           "ring_majority_bytes", "alltoall_majority_bytes", "allgather_majority_bytes", "TIES",
           "VOTES", "COLLECTIVES", "vote_for", "check_collective", "check_tie"]

TIES = ("negative", "positive", "alternate")
"""Tie rules for an even number of ranks: the paper's ``-1``, ``+1``, or by index and phase."""


def check_tie(tie: object, phase: object = 0) -> None:
    """Check a tie rule and its phase.

    Raises ``ValueError`` unless ``tie`` is one of :data:`TIES`, ``TypeError`` unless ``phase``
    is an int, ``ValueError`` if it is negative.
    """
    if tie not in TIES:
        raise ValueError(f"expected tie in {TIES}, got {tie!r}")
    if isinstance(phase, bool) or not isinstance(phase, int):
        raise TypeError(f"expected phase to be an int, got {type(phase).__name__}")
    if phase < 0:
        raise ValueError(f"expected phase >= 0, got {phase}")


def _check_options(tie: object, phase: object, packing: object = "fixed") -> None:
    check_tie(tie, phase)
    if packing not in counts.PACKINGS:
        raise ValueError(f"expected packing in {counts.PACKINGS}, got {packing!r}")


def _decide(total: torch.Tensor | np.ndarray, size: int, tie: str, start: int = 0,
            phase: int = 0) -> torch.Tensor | np.ndarray:
    # All-Reducible signSGD, Section 3: +1 when the count exceeds N/2, else -1. ``total``
    # counts the elements from global index ``start`` on (for the alternating tie). Counts are
    # compared with N // 2 rather than doubled, so uint8 counts of up to 255 ranks never wrap.
    # A numpy array gives a numpy array; a CPU tensor is decided by numpy too: on a DDP
    # bucket's few thousand elements torch's per-operation dispatch costs more than the work,
    # and on millions numpy's passes are faster.
    if isinstance(total, torch.Tensor) and total.numel() and _frame.use_numpy(total):
        return torch.from_numpy(_decide(total.numpy(), size, tie, start, phase))
    half = size // 2
    plus = total > half
    if size % 2 == 0 and tie == "positive":
        plus |= total == half
    elif size % 2 == 0 and tie == "alternate":
        first = (start + phase) % 2  # the elements at even global index + phase
        plus[first::2] |= total[first::2] == half
    return plus


def _plus_minus(decided: torch.Tensor, dst: torch.Tensor) -> None:
    # Write +1 where decided, else -1, into dst. A float32 CPU tensor takes numpy's passes:
    # several times torch's speed there.
    if dst.dtype == torch.float32 and decided.numel() and _frame.use_numpy(dst):
        o = dst.numpy()
        np.copyto(o, decided.numpy())
        o *= 2
        o -= 1
    else:
        dst.copy_(decided).mul_(2).sub_(1)


def _finish(x: torch.Tensor, decided: torch.Tensor, packed: bool,
            out: torch.Tensor | None = None) -> torch.Tensor:
    # The decisions as packed bytes, or as +-1 in x's dtype (into out, where given).
    if packed:
        return sign.pack_mask(decided)
    result = _common.result_buffer(out, decided.numel(), x.dtype, decided)
    _plus_minus(decided, result)
    return result.reshape(x.shape) if out is None else out


def ring_majority(comm: Comm, x: torch.Tensor, *, packing: str = "fixed",
                  tie: str = "negative", phase: int = 0, check: bool = True,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """Return the elementwise majority of ``x >= 0`` over ranks, computed on a ring.

    Args:
        comm: the transport.
        x: floating-point tensor, the same number of elements on every rank.
        packing: ``"fixed"`` (the paper's ``ceil(log2(i+1))`` bits) or ``"radix"`` counts.
        tie: the result where exactly half vote +1: ``"negative"`` (-1), ``"positive"`` (+1)
            or ``"alternate"`` (+1 at even ``index + phase``, see the module docstring).
        phase: the offset of the alternating tie (an int >= 0, the same on every rank).
        check: agree on the input first (raises on every rank for bad input; see
            :mod:`bitcomm.collectives._common`).
        out: where to write the result (a contiguous tensor of ``x``'s shape, dtype and
            device; ``x`` itself may be given): a DDP hook's bucket, which DDP then need not
            copy.

    Returns:
        +-1 tensor like ``x`` (its shape and dtype; ``out`` where given), identical on every
        rank.

    """
    return _ring_majority(comm, x, packing, tie, phase, check, packed=False, out=out)


def ring_majority_packed(comm: Comm, x: torch.Tensor, *, packing: str = "fixed",
                         tie: str = "negative", phase: int = 0, check: bool = True
                         ) -> torch.Tensor:
    """Return :func:`ring_majority`'s decisions as :func:`bitcomm.codecs.sign.pack` bytes.

    ``ceil(K / 8)`` uint8 (bit 1 = +1, MSB first), for callers that send or store the
    decisions: no +-1 tensor is made. Same arguments, same wire bytes.
    """
    return _ring_majority(comm, x, packing, tie, phase, check, packed=True)


def _ring_majority(comm: Comm, x: torch.Tensor, packing: str, tie: str, phase: int,
                   check: bool, packed: bool, out: torch.Tensor | None = None
                   ) -> torch.Tensor:
    def validate(v: torch.Tensor) -> None:
        _check_options(tie, phase, packing)
        _common.check_out(out, x, x.dtype)

    v = _common.prepare(comm, x, check, "ring_majority",
                        options={"packing": packing, "tie": tie, "phase": phase},
                        validate=validate)
    size, rank, n = comm.size, comm.rank, v.numel()
    if size == 1:
        return _finish(x, _decide((v >= 0).to(torch.int32), 1, tie), packed, out)
    if packing == "fixed" and _frame.use_triton(v):
        return _ring_fused(comm, x, v, tie, phase, packed, out)
    part = _ring_chunks(n, size)
    nxt, prv = (rank + 1) % size, (rank - 1) % size

    scratch = torch.empty(-(-n // size), dtype=torch.bool, device=v.device)  # the largest chunk
    numpy_votes = _frame.numpy_float(v)
    # Counts over at most 255 ranks fit uint8: the received counts unpack to, add and repack
    # from bytes, with no widening pass or mixed-type addition.
    tally = torch.uint8 if size <= _BYTE_RANKS else torch.int32

    def votes(c: int) -> torch.Tensor:
        # One chunk at a time, when its step comes: the first message leaves after 1/N of the
        # vote work, and the rest overlaps with waiting for the ring. uint8, added into the
        # counts received, in one buffer for every step: fresh memory's first writes cost
        # more than the comparison on a CPU, and numpy's comparison is about 2.5x torch's.
        chunk = part(v, c)
        out = scratch[: chunk.numel()]
        if numpy_votes:
            np.greater_equal(chunk.numpy(), 0, out=out.numpy())
        else:
            torch.ge(chunk, 0, out=out)
        return out.view(torch.uint8)

    # Each step is a Comm.shift, which waits only for what it receives where the transport
    # sends point to point: the send of step i is still in flight while step i + 1 is received
    # and combined, so no link idles while a rank waits for the transport to confirm its send
    # (see Comm.isend). A step's message is a fresh tensor, kept alive by its request until
    # the end.
    # The received payloads' checks are flags until the end: counts are only added, compared
    # and repacked, so one host read per call checks every step (not one or two per step).
    with _frame.deferred(handover=True):
        sends: list[Request] = []
        running = votes(rank)  # step 1 sends this rank's own votes: counts over 1 rank
        for i in range(1, size):
            # All-Reducible signSGD, Section 3: counts over i ranks need ceil(log2(i+1)) bits.
            c = rank - i
            length = part(v, c).numel()
            got = torch.empty(counts.packed_size(length, i, packing), dtype=torch.uint8,
                              device=v.device)
            sends.append(comm.shift(counts.pack(running, i, packing, check=False), nxt, got, prv))
            running = counts.unpack(got, length, i, packing, dtype=tally).add_(votes(c))
        # Then the ring allgather of the 1-bit decisions (_ring_allgather); every chunk of v
        # has been read by now, so out may be x.
        decided = torch.empty(n, dtype=torch.bool, device=v.device) if packed else None
        result = None if packed else _common.result_buffer(out, n, x.dtype, v)

        def keep(c: int, chunk: torch.Tensor) -> None:
            if decided is not None:
                part(decided, c).copy_(chunk)
            else:
                _plus_minus(chunk, part(result, c))

        mine = _decide(running, size, tie, _ring_start(n, size, rank + 1), phase)
        keep(rank + 1, mine)
        _ring_allgather(comm, sign.pack_mask(mine), part, v, sends,
                        lambda c, got, length: keep(c, sign.unpack_mask(got, length)))
        Request.wait_all(sends)
    if decided is not None:
        return sign.pack_mask(decided)
    return result.reshape(x.shape) if out is None else out


def _ring_start(n: int, size: int, c: int) -> int:
    """Return the global index of chunk ``c mod size``'s first element."""
    return _common.bounds(n, size)[c % size][0]


def _ring_chunks(n: int, size: int):
    """Return ``part(t, c)``: chunk ``c mod size`` of a tensor of ``n`` elements (a view)."""
    chunks = _common.bounds(n, size)

    def part(t: torch.Tensor, c: int) -> torch.Tensor:
        lo, hi = chunks[c % size]
        return t[lo:hi]

    return part


def _ring_allgather(comm: Comm, forward: torch.Tensor, part, v: torch.Tensor,
                    sends: list[Request], keep) -> None:
    # Ring allgather of the 1-bit decisions: the paper streams back only the majority bit.
    # Step i forwards, unchanged, the packed chunk received at step i - 1 (chunk rank + 2 - i),
    # and keep(c, payload, length) writes each chunk into the result as it arrives.
    nxt, prv = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    for i in range(1, comm.size):
        c = comm.rank + 1 - i
        length = part(v, c).numel()
        got = torch.empty(sign.packed_size(length), dtype=torch.uint8, device=v.device)
        sends.append(comm.shift(forward, nxt, got, prv))
        forward = got
        keep(c, forward, length)


def _ring_fused(comm: Comm, x: torch.Tensor, v: torch.Tensor, tie: str, phase: int,
                packed: bool, out: torch.Tensor | None = None) -> torch.Tensor:
    # ring_majority's schedule with one kernel per step (bitcomm.collectives._kernels): the
    # same bytes on the wire, and no host synchronisation between the steps.
    from bitcomm.collectives import _kernels

    size, rank, n = comm.size, comm.rank, v.numel()
    unpack = _frame.kernels().sign_unpack
    v = v.contiguous()
    part = _ring_chunks(n, size)
    nxt, prv = (rank + 1) % size, (rank - 1) % size
    sends: list[Request] = []
    message = _kernels.count_step(None, part(v, rank), 0, 1)  # counts over 1 rank
    for i in range(1, size):
        c = rank - i
        length = part(v, c).numel()
        got = torch.empty(counts.packed_size(length, i), dtype=torch.uint8, device=v.device)
        sends.append(comm.shift(message, nxt, got, prv))
        # Counts over i ranks arrive in width(i) planes; this rank's votes make i + 1.
        if i < size - 1:
            message = _kernels.count_step(got, part(v, c), counts.width(i), counts.width(i + 1))
        else:
            message = _kernels.count_step(got, part(v, c), counts.width(i), 1, decide=size,
                                          tie=tie, tie_base=_ring_start(n, size, c) + phase)
    # The decisions, as +-1 (in x's dtype, or float32 to be packed at the end); the steps
    # have read v, so out may be x.
    result = _common.result_buffer(out, n, torch.float32 if packed else x.dtype, v)
    unpack(message, part(v, rank + 1).numel(), result.dtype, out=part(result, rank + 1))
    _ring_allgather(comm, message, part, v, sends, lambda c, got, length: unpack(
        got, length, result.dtype, out=part(result, c)))
    Request.wait_all(sends)
    if packed:
        return _frame.kernels().sign_pack(result)
    return result.reshape(x.shape) if out is None else out


def alltoall_majority(comm: Comm, x: torch.Tensor, *, tie: str = "negative", phase: int = 0,
                      check: bool = True, out: torch.Tensor | None = None) -> torch.Tensor:
    """Return the same majority as :func:`ring_majority`, exchanged the 1-bit Adam way.

    Args:
        comm: the transport.
        x: floating-point tensor, the same number of elements on every rank.
        tie: ``"negative"``, ``"positive"`` or ``"alternate"`` (as :func:`ring_majority`).
        phase: the offset of the alternating tie.
        check: agree on the input first.
        out: where to write the result (as :func:`ring_majority`).

    Returns:
        +-1 tensor like ``x`` (``out`` where given), identical on every rank.

    """
    return _alltoall_majority(comm, x, tie, phase, check, packed=False, out=out)


def alltoall_majority_packed(comm: Comm, x: torch.Tensor, *, tie: str = "negative",
                             phase: int = 0, check: bool = True) -> torch.Tensor:
    """Return :func:`alltoall_majority`'s decisions as :func:`bitcomm.codecs.sign.pack` bytes."""
    return _alltoall_majority(comm, x, tie, phase, check, packed=True)


def _alltoall_majority(comm: Comm, x: torch.Tensor, tie: str, phase: int, check: bool,
                       packed: bool, out: torch.Tensor | None = None) -> torch.Tensor:
    v = _prepare_vote(comm, x, check, "alltoall_majority", tie, phase, out)
    size, rank, n = comm.size, comm.rank, v.numel()
    if size == 1:
        return _finish(x, _decide((v >= 0).to(torch.int32), 1, tie), packed, out)
    chunks = _common.bounds(n, size)
    lengths = [hi - lo for lo, hi in chunks]
    sends = [sign.pack(v[lo:hi]) for lo, hi in chunks]
    mine = sign.packed_size(lengths[rank])
    got = comm.alltoallv(sends, [mine] * size)
    every_size = [sign.packed_size(length) for length in lengths]
    if _frame.use_triton(v):
        # One kernel sums the votes of every rank, decides and packs (no host sync).
        from bitcomm.collectives import _kernels

        decision = _kernels.vote_count(torch.stack(got), lengths[rank], tie=tie,
                                       tie_base=chunks[rank][0] + phase)
        every = comm.allgatherv(decision, every_size)
        result = _common.result_buffer(out, n, torch.float32 if packed else x.dtype, v)
        for p, (lo, hi) in zip(every, chunks, strict=True):
            _frame.kernels().sign_unpack(p, hi - lo, result.dtype, out=result[lo:hi])
        if packed:
            return _frame.kernels().sign_pack(result)
        return result.reshape(x.shape) if out is None else out
    # Off the numpy path every payload's padding check is a flag, read once at the end.
    with _frame.deferred(handover=True):
        decision = sign.pack_mask(_majority(got, lengths[rank], v.device, size, tie,
                                            chunks[rank][0], phase))
        every = comm.allgatherv(decision, every_size)
        decided = torch.cat([sign.unpack_mask(p, length)
                             for p, length in zip(every, lengths, strict=True)])
    return _finish(x, decided, packed, out)


def allgather_majority(comm: Comm, x: torch.Tensor, *, tie: str = "negative", phase: int = 0,
                       check: bool = True, out: torch.Tensor | None = None) -> torch.Tensor:
    """Return the same majority as :func:`ring_majority`, from one allgather of 1-bit votes.

    The arguments and the result are :func:`alltoall_majority`'s.
    """
    return _allgather_majority(comm, x, tie, phase, check, packed=False, out=out)


def allgather_majority_packed(comm: Comm, x: torch.Tensor, *, tie: str = "negative",
                              phase: int = 0, check: bool = True) -> torch.Tensor:
    """Return :func:`allgather_majority`'s decisions as :func:`bitcomm.codecs.sign.pack` bytes."""
    return _allgather_majority(comm, x, tie, phase, check, packed=True)


def _allgather_majority(comm: Comm, x: torch.Tensor, tie: str, phase: int, check: bool,
                        packed: bool, out: torch.Tensor | None = None) -> torch.Tensor:
    v = _prepare_vote(comm, x, check, "allgather_majority", tie, phase, out)
    size, n = comm.size, v.numel()
    if size == 1:
        return _finish(x, _decide((v >= 0).to(torch.int32), 1, tie), packed, out)
    every = comm.allgatherv(sign.pack(v), [sign.packed_size(n)] * size)
    if _frame.use_triton(v):
        # One kernel sums every rank's votes, decides and packs (no host sync).
        from bitcomm.collectives import _kernels

        decision = _kernels.vote_count(torch.stack(every), n, tie=tie, tie_base=phase)
        if packed:
            return decision
        result = _common.result_buffer(out, n, x.dtype, v)
        _frame.kernels().sign_unpack(decision, n, x.dtype, out=result)  # our own padding: 0
        return result.reshape(x.shape) if out is None else out
    with _frame.deferred(handover=True):  # the payloads' padding checks: one read at the end
        decided = _majority(every, n, v.device, size, tie, 0, phase)
    return _finish(x, decided, packed, out)


def _prepare_vote(comm: Comm, x: torch.Tensor, check: bool, name: str, tie: str, phase: int,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    # The agreement of the one-round and two-round majorities: the tie rule shapes the result.
    def validate(v: torch.Tensor) -> None:
        _check_options(tie, phase)
        _common.check_out(out, x, x.dtype)

    return _common.prepare(comm, x, check, name, options={"tie": tie, "phase": phase},
                           validate=validate)


def _majority(payloads: list[torch.Tensor], n: int, device: torch.device, size: int, tie: str,
              start: int, phase: int) -> torch.Tensor:
    # The decisions (bool, True = +1) from every rank's packed signs of the same n elements.
    if not (n and _frame.use_numpy(payloads[0]) and device.type == "cpu"):
        return _decide(_count_votes(payloads, n, device), size, tie, start, phase)
    # _count_votes and _decide in a few numpy calls.
    rows = torch.stack(payloads)
    _frame.check_padding(rows, n, "bits", "plane")
    return torch.from_numpy(_decide(_vote_totals(rows.numpy(), n), size, tie, start, phase))


def _vote_totals(rows: np.ndarray, n: int) -> np.ndarray:
    # Each element's +1 votes over the rows of packed signs. A slice of elements at a time:
    # the unpacked votes of every rank stay in cache instead of going to memory at a byte per
    # vote (8 ranks x 8M elements: 38 -> 5 ms), and up to 255 ranks add in uint8.
    total = np.empty(n, dtype=np.uint8 if rows.shape[0] <= _BYTE_RANKS else np.int32)
    for lo in range(0, n, _VOTE_SLICE):
        hi = min(n, lo + _VOTE_SLICE)
        votes = np.unpackbits(rows[:, lo // 8 : (hi + 7) // 8], axis=1, count=hi - lo)
        np.sum(votes, axis=0, dtype=total.dtype, out=total[lo:hi])
    return total


def _count_votes(payloads: list[torch.Tensor], n: int, device: torch.device) -> torch.Tensor:
    # The +1 votes of every rank's packed signs (int32 sums: their order does not matter).
    total = torch.zeros(n, dtype=torch.int32, device=device)
    for payload in payloads:
        total += bits.unpack(payload, n, 1, dtype=torch.int32)
    return total


def ring_majority_bytes(n: int, size: int, rank: int, *, packing: str = "fixed",
                        check: bool = True) -> int:
    """Return the bytes rank ``rank`` sends in :func:`ring_majority` of ``n`` elements."""
    _check_options("negative", 0, packing)
    if size == 1:
        return 0
    lengths = [hi - lo for lo, hi in _common.bounds(n, size)]
    total = sum(counts.packed_size(lengths[(rank - i + 1) % size], i, packing)
                for i in range(1, size))
    total += sum(sign.packed_size(lengths[(rank + 2 - i) % size]) for i in range(1, size))
    return total + _common.control_bytes(size, check)


def alltoall_majority_bytes(n: int, size: int, rank: int, *, check: bool = True) -> int:
    """Return the bytes rank ``rank`` sends in :func:`alltoall_majority` of ``n`` elements."""
    lengths = [hi - lo for lo, hi in _common.bounds(n, size)]
    total = sum(sign.packed_size(length) for j, length in enumerate(lengths) if j != rank)
    total += (size - 1) * sign.packed_size(lengths[rank])
    return total + _common.control_bytes(size, check)


def allgather_majority_bytes(n: int, size: int, *, check: bool = True) -> int:
    """Return the bytes every rank sends in :func:`allgather_majority` of ``n`` elements."""
    return (size - 1) * sign.packed_size(n) + _common.control_bytes(size, check)


VOTES = {"ring": ring_majority, "alltoall": alltoall_majority, "allgather": allgather_majority}
"""The majority collectives by the short name optimizers and hooks take (``collective=``)."""

COLLECTIVES = ("auto", *VOTES)
"""What ``collective=`` accepts: a name of :data:`VOTES`, or ``"auto"`` (:func:`vote_for`)."""


def vote_for(collective: str, size: int):  # noqa: ANN201 - one of the majority functions
    """Return the majority function named ``collective`` for ``size`` ranks.

    ``"auto"`` is :func:`allgather_majority` at 2 ranks, where it sends the ring's bytes in one
    round instead of two, and :func:`ring_majority` otherwise, where the allgather's
    ``(N - 1) * K / 8`` bytes outgrow the ring's. All give the same majority.
    """
    if check_collective(collective) == "auto":
        return allgather_majority if size <= 2 else ring_majority
    return VOTES[collective]


def check_collective(collective: object) -> str:
    """Return ``collective`` if it is one of :data:`COLLECTIVES`, else raise ``ValueError``."""
    if collective not in COLLECTIVES:
        raise ValueError(f"expected collective in {COLLECTIVES}, got {collective!r}")
    return collective
