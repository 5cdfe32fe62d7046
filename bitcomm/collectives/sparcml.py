"""SparCML's sparse allreduces: the exact sum of every rank's sparse vector, on every rank.

Each rank holds a vector of length ``n`` as sorted ``(indices, values)``, with any number of
entries; the result is their sum (SparCML, Renggli et al., Section 5.3), bit-identical on every
rank. Vectors travel as :mod:`bitcomm.codecs.stream` frames, sparse or dense by the stream's own
rule, so a sum that fills in switches to the dense form on the way.

Fold (SparCML, Appendix A). For ``P`` ranks, ``pof2 = 2**floor(log2 P)`` and ``rem = P - pof2``.
Ranks ``r < 2 * rem`` pair up: even ``r`` sends its stream to ``r + 1`` and sits out, odd ``r``
adds it and becomes virtual rank ``r // 2``; ranks ``r >= 2 * rem`` become ``r - rem``. The
algorithms run on the ``pof2`` virtual ranks; at the end each odd ``r < 2 * rem`` sends the
result to ``r - 1`` (the unfold).

* :func:`ssar_recursive_double` (5.3.1): in round ``t`` virtual rank ``v`` swaps its whole
  stream with ``v ^ 2**t`` and adds it. ``log2(pof2)`` rounds; latency-optimal.
* :func:`ssar_split_allgather` (5.3.2): ``[0, n)`` is split into ``pof2`` ranges, range ``j``
  being ``[j*q, (j+1)*q)`` with ``q = n // pof2`` and the last one running to ``n``; every
  virtual rank sends its part of range ``j`` (a stream of the range's length) to virtual rank
  ``j``, which adds the parts in virtual-rank order (so the bits do not depend on which arrived
  first); then a recursive-doubling allgather concatenates the ranges (densifying when the
  pairs reach the whole block's limit).
* :func:`dsar_split_allgather` (5.3.3): the same split, each owner's range dense from the
  start; then a recursive-doubling allgather of the dense ranges, or of their QSGD frames
  (:mod:`bitcomm.codecs.qsgd`, quantised once by the owner, so every rank decodes the same
  bytes).

Messages. A stream's frame size is known only to its sender, so a stream goes as an 8-byte
int64 length, then the frame. DSAR's dense ranges and QSGD frames have sizes every rank can
compute and go without a length. Nothing is sent to a rank that sits out except the unfold, and
an empty range (``n < pof2``) is a message of no bytes, which is not sent.

Bytes. What a rank sends depends on how the ranks' index sets overlap, so each ``*_bytes``
function takes every rank's index set, replays the algorithm's representation choices and
returns the bytes of every rank; it is exact (tests compare it with the transport's counters),
``24 * (P - 1)`` of it the agreement with ``check``.
"""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Callable, Sequence

import torch

from bitcomm.codecs import _frame, qsgd, stream
from bitcomm.codecs.stream import Stream
from bitcomm.collectives import _common, dense
from bitcomm.comm.base import Comm

__all__ = ["ssar_recursive_double", "ssar_split_allgather", "dsar_split_allgather",
           "ssar_recursive_double_bytes", "ssar_split_allgather_bytes",
           "dsar_split_allgather_bytes", "stream_allgather", "stream_allgather_bytes",
           "sparse_allreduce", "choose", "expected_nnz", "Choice", "ALGORITHMS", "Fold", "ranges"]

_LEN = struct.Struct("<q")


@dataclasses.dataclass(frozen=True)
class Fold:
    """Where a rank stands in the fold to a power of two (SparCML, Appendix A)."""

    rank: int
    size: int

    @property
    def pof2(self) -> int:
        """The largest power of two <= size: the virtual ranks."""
        return 1 << (self.size.bit_length() - 1)

    @property
    def rem(self) -> int:
        """The ranks folded away."""
        return self.size - self.pof2

    @property
    def vrank(self) -> int | None:
        """The virtual rank this rank plays, or ``None`` if it sits out."""
        r, rem = self.rank, self.rem
        if r < 2 * rem:
            return None if r % 2 == 0 else r // 2
        return r - rem

    def real(self, v: int) -> int:
        """Return the rank that plays virtual rank ``v``."""
        return 2 * v + 1 if v < self.rem else v + self.rem


def ranges(n: int, parts: int) -> list[tuple[int, int]]:
    """Return the split of ``[0, n)`` into ``parts`` ranges (SparCML, Appendix A).

    Each holds ``n // parts`` positions; the last one takes the remainder too.
    """
    q = n // parts
    return [(j * q, (j + 1) * q if j < parts - 1 else n) for j in range(parts)]


# -- messages -------------------------------------------------------------------------------


def _frame_message(s: Stream) -> tuple[torch.Tensor, torch.Tensor]:
    frame = stream.encode(s)
    return torch.frombuffer(bytearray(_LEN.pack(frame.numel())), dtype=torch.uint8), frame


def _swap(comm: Comm, s: Stream, peer: int, n: int, checks: list | None = None) -> Stream:
    """Exchange streams of length ``n`` with ``peer``; return the peer's.

    ``checks``: leave the check of the peer's frame to the caller's next read (see
    :func:`bitcomm.codecs.stream.decode_all`).
    """
    length, frame = _frame_message(s)
    theirs = comm.sendrecv(length, peer, torch.empty(_LEN.size, dtype=torch.uint8), peer)
    size = _read_length(theirs, peer, n)
    got = comm.sendrecv(frame, peer, torch.empty(size, dtype=torch.uint8, device=frame.device),
                        peer)
    return stream.decode_all([got], n, checks=checks)[0]


def _send_stream(comm: Comm, s: Stream, peer: int) -> None:
    length, frame = _frame_message(s)
    comm.send(length, peer)
    comm.send(frame, peer)


def _recv_frame(comm: Comm, peer: int, n: int, device: torch.device) -> torch.Tensor:
    size = _read_length(comm.recv(torch.empty(_LEN.size, dtype=torch.uint8), peer), peer, n)
    return comm.recv(torch.empty(size, dtype=torch.uint8, device=device), peer)


def _recv_stream(comm: Comm, peer: int, n: int, device: torch.device,
                 checks: list | None = None) -> Stream:
    return stream.decode_all([_recv_frame(comm, peer, n, device)], n, checks=checks)[0]


def _read_length(buf: torch.Tensor, peer: int, n: int) -> int:
    return _bounded(_LEN.unpack(bytes(buf.tolist()))[0], peer, n)


def _bounded(size: int, peer: int, n: int) -> int:
    # Bounded before anything is allocated: a stream of length n takes at most its dense form
    # (a sparse one is smaller by the switch rule).
    if not stream.HEADER.size <= size <= stream.HEADER.size + 4 * n:
        raise ValueError(f"rank {peer} announced a stream frame of {size} bytes, beyond "
                         f"{stream.HEADER.size}..{stream.HEADER.size + 4 * n} for a stream of "
                         f"length {n}")
    return size


def _swap_bytes(comm: Comm, mine: torch.Tensor, peer: int, size: int) -> torch.Tensor:
    """Exchange byte blocks of known sizes with ``peer`` (a side with no bytes sends nothing)."""
    out = torch.empty(size, dtype=torch.uint8, device=mine.device)
    if mine.numel() and size:
        return comm.sendrecv(mine, peer, out, peer)
    if mine.numel():
        comm.send(mine, peer)
    elif size:
        comm.recv(out, peer)
    return out


# -- the agreement and the fold ---------------------------------------------------------------


def _prepare(comm: Comm, name: str, indices: object, values: object, n: object, check: bool,
             options: dict | None = None, validate: Callable[[], None] | None = None) -> Stream:
    """Agree on the call and return this rank's input as a stream (raises on every rank)."""
    def check_input(v: torch.Tensor) -> None:
        count = _common_n(n)
        if not isinstance(indices, torch.Tensor):
            raise TypeError(f"expected indices to be an integer torch.Tensor, got "
                            f"{type(indices).__name__}")
        if indices.dtype.is_floating_point or indices.dtype in (torch.bool, torch.complex64,
                                                                torch.complex128):
            raise TypeError(f"expected indices to be an integer tensor, got {indices.dtype}")
        # With the agreement, finiteness is its own check (a NonFiniteError on every rank).
        # Every rule is checked here, once: the stream is made without checking them again.
        stream.check_entries(indices.detach().reshape(-1).to(v.device), v, count,
                             finite=not check)
        if validate is not None:
            validate()

    length = n if isinstance(n, int) and not isinstance(n, bool) and n >= 0 else -2
    v = _common.prepare(comm, values, check, name, float32=True, options=options,
                        validate=check_input, length=length)
    return stream.from_entries(indices.detach().reshape(-1).to(v.device), v, n, check=False)


def _common_n(n: object) -> int:
    if isinstance(n, bool) or not isinstance(n, int):
        raise TypeError(f"expected n to be an int, got {type(n).__name__}")
    if n < 0:
        raise ValueError(f"expected n >= 0, got {n}")
    return n


def _fold(comm: Comm, fold: Fold, s: Stream) -> Stream | None:
    """Fold the ranks to ``pof2``: return the stream of this virtual rank, None if it sits out."""
    if fold.rank < 2 * fold.rem:
        if fold.rank % 2 == 0:
            _send_stream(comm, s, fold.rank + 1)
            return None
        # the frame's check is read with the sum's size (one host read on a GPU)
        checks: list = []
        theirs = _recv_stream(comm, fold.rank - 1, s.n, s.values.device, checks)
        return stream.add(theirs, s, checks=checks)
    return s


# -- the algorithms ---------------------------------------------------------------------------


def ssar_recursive_double(comm: Comm, indices: torch.Tensor, values: torch.Tensor, n: int, *,
                          check: bool = True) -> Stream:
    """Return the sum of every rank's sparse vector by recursive doubling (SSAR, 5.3.1).

    Args:
        comm: the transport.
        indices: this rank's positions: an integer tensor, strictly increasing, in ``[0, n)``.
        values: their float values (computed in float32), one per index, finite.
        n: the vector's length, the same on every rank.
        check: agree on the call first (bad input on any rank raises on every rank).

    Returns:
        the sum as a :class:`~bitcomm.codecs.stream.Stream`, identical on every rank.

    """
    s = _prepare(comm, "ssar_recursive_double", indices, values, n, check)
    fold = Fold(comm.rank, comm.size)
    mine = _fold(comm, fold, s)
    if mine is not None:
        v, mask = fold.vrank, 1
        while mask < fold.pof2:
            checks: list = []  # the frame's check, read with the sum's size
            theirs = _swap(comm, mine, fold.real(v ^ mask), n, checks)
            # lower virtual rank first: both sides compute the same sum
            lower, upper = (mine, theirs) if v < v ^ mask else (theirs, mine)
            mine = stream.add(lower, upper, checks=checks)
            mask <<= 1
    return _unfold(comm, fold, mine, n, s.values.device)


def _unfold(comm: Comm, fold: Fold, result: Stream | None, n: int,
            device: torch.device) -> Stream:
    if fold.rank < 2 * fold.rem:
        if result is None:
            return _recv_stream(comm, fold.rank + 1, n, device)
        _send_stream(comm, result, fold.rank - 1)
    assert result is not None
    return result


def _split(comm: Comm, fold: Fold, mine: Stream, bounds: list[tuple[int, int]],
           checks: list | None = None) -> list[Stream]:
    """Send each virtual rank its range of ``mine``; return the parts of this rank's range.

    The parts come in virtual-rank order, this rank's own included. ``checks``: leave the
    received frames' check to the caller's next read.
    """
    v = fold.vrank
    mine_by_range = stream.split(mine, bounds)
    sends = []
    for s in range(1, fold.pof2):
        dest = (v + s) % fold.pof2
        length, frame = _frame_message(mine_by_range[dest])
        peer = fold.real(dest)
        sends += [comm.isend(length, peer), comm.isend(frame, peer)]
    lo, hi = bounds[v]
    sources = [(v - s) % fold.pof2 for s in range(1, fold.pof2)]
    frames = [_recv_frame(comm, fold.real(u), hi - lo, mine.values.device) for u in sources]
    parts: list[Stream] = [mine_by_range[v]] * fold.pof2
    for u, got in zip(sources, stream.decode_all(frames, hi - lo, checks=checks), strict=True):
        parts[u] = got
    for r in sends:
        r.wait()
    return parts


def ssar_split_allgather(comm: Comm, indices: torch.Tensor, values: torch.Tensor, n: int, *,
                         check: bool = True) -> Stream:
    """Return the sum of every rank's sparse vector by split and allgather (SSAR, 5.3.2).

    Arguments and result as :func:`ssar_recursive_double`.
    """
    s = _prepare(comm, "ssar_split_allgather", indices, values, n, check)
    fold = Fold(comm.rank, comm.size)
    mine = _fold(comm, fold, s)
    result = None
    if mine is not None:
        bounds = ranges(n, fold.pof2)
        checks: list = []  # the parts' check, read with their sum's sizes
        owned = stream.add_all(_split(comm, fold, mine, bounds, checks), checks=checks)
        v, mask = fold.vrank, 1
        while mask < fold.pof2:
            # blocks of mask ranges: this rank's starts at range v & ~(mask - 1)
            peer = v ^ mask
            base = peer & ~(mask - 1)
            length = bounds[min(base + mask, fold.pof2) - 1][1] - bounds[base][0]
            theirs = _swap(comm, owned, fold.real(peer), length)
            owned = stream.concat([owned, theirs] if v < peer else [theirs, owned])
            mask <<= 1
        result = owned
    return _unfold(comm, fold, result, n, s.values.device)


def dsar_split_allgather(comm: Comm, indices: torch.Tensor, values: torch.Tensor, n: int, *,
                         bits: int | None = None, bucket: int = qsgd.DEFAULT_BUCKET,
                         seed: int | None = None, check: bool = True) -> torch.Tensor:
    """Return the sum of every rank's sparse vector, dense (DSAR split-allgather, 5.3.3).

    Args:
        comm: the transport.
        indices: this rank's positions: an integer tensor, strictly increasing, in ``[0, n)``.
        values: their float values (computed in float32), one per index, finite.
        n: the vector's length, the same on every rank.
        bits: ``None`` for exact float32 ranges, or 2, 4 or 8: each owner quantises its reduced
            range with QSGD before the allgather (SparCML, Section 6), and every rank, the owner
            included, decodes the same frames.
        bucket: elements per QSGD scale.
        seed: the owner of range ``j``, rank ``r``, quantises with ``seed + r``; ``None`` draws
            from torch's default generator.
        check: agree on the call first (bad input on any rank raises on every rank).

    Returns:
        the float32 sum, length ``n``, identical on every rank.

    """
    def validate() -> None:
        if bits is not None:
            qsgd.check_config(bits, bucket, "max")
        qsgd.check_seed(seed)

    s = _prepare(comm, "dsar_split_allgather", indices, values, n, check,
                 options={"bits": bits, "bucket": bucket if bits is not None else None},
                 validate=validate)
    fold = Fold(comm.rank, comm.size)
    mine = _fold(comm, fold, s)
    bounds = ranges(n, fold.pof2)

    def block_bytes(lo: int, hi: int) -> int:
        if bits is None:
            return 4 * (bounds[hi - 1][1] - bounds[lo][0])
        return sum(_range_bytes(*bounds[j], bits, bucket) for j in range(lo, hi))

    # The owner's QSGD scale check and the gathered frames' checks are read once, at the end
    # (values are only decoded, never used as positions): one host read, not one per range
    # length and one for the encoder; and an owner whose sum overflowed still sends its frame,
    # so every rank raises rather than waits. The streams of the split check theirs at once.
    with _frame.deferred(handover=True):
        payload = None
        if mine is not None:
            v = fold.vrank
            lo, hi = bounds[v]
            owned = torch.zeros(hi - lo, dtype=torch.float32, device=s.values.device)
            for p in _split(comm, fold, mine, bounds):
                owned = stream.add(Stream(hi - lo, None, owned), p).values
            if bits is None:
                payload = owned.contiguous().view(torch.uint8)
            else:
                payload = _encode_range(owned, bits, bucket, seed, comm.rank)
            mask = 1
            while mask < fold.pof2:
                peer = v ^ mask
                base = peer & ~(mask - 1)
                theirs = _swap_bytes(comm, payload, fold.real(peer), block_bytes(base, base + mask))
                payload = torch.cat([payload, theirs] if v < peer else [theirs, payload])
                mask <<= 1
        if fold.rank < 2 * fold.rem:
            if payload is None:
                payload = torch.empty(block_bytes(0, fold.pof2), dtype=torch.uint8,
                                      device=s.values.device)
                if payload.numel():
                    comm.recv(payload, fold.rank + 1)
            elif payload.numel():
                comm.send(payload, fold.rank - 1)
        if bits is None:
            return payload.view(torch.float32).clone()
        frames = payload.split([_range_bytes(lo, hi, bits, bucket) for lo, hi in bounds])
        out: list[torch.Tensor] = [payload[:0]] * len(bounds)
        # The ranges have at most two lengths: the frames of each are checked together.
        for length in sorted({hi - lo for lo, hi in bounds}):
            which = [j for j, (lo, hi) in enumerate(bounds) if hi - lo == length]
            got = qsgd.decode_all([frames[j] for j in which], length, bits, bucket)
            for j, values_ in zip(which, got, strict=True):
                out[j] = values_
        return torch.cat(out)


def _range_bytes(lo: int, hi: int, bits: int, bucket: int) -> int:
    return qsgd.encoded_size(hi - lo, bits, bucket)


def _encode_range(owned: torch.Tensor, bits: int, bucket: int, seed: int | None,
                  rank: int) -> torch.Tensor:
    return qsgd.encode(owned, bits, bucket, seed=None if seed is None else seed + rank)


# -- bytes ------------------------------------------------------------------------------------


def _replay_streams(index_sets: Sequence[torch.Tensor], n: int) -> list[Stream]:
    return [stream.from_entries(torch.as_tensor(ix, dtype=torch.int64),
                                torch.ones(len(ix)), n) for ix in index_sets]


def _message(s: Stream) -> int:
    return _LEN.size + s.encoded_size()


def _replay_fold(size: int, streams: list[Stream], sent: list[int]) -> dict[int, Stream]:
    """Fold the replayed streams: add the fold's messages to ``sent``; return them by vrank."""
    rem = Fold(0, size).rem
    by_v = {}
    for r in range(size):
        f = Fold(r, size)
        if r < 2 * rem and r % 2 == 0:
            sent[r] += _message(streams[r])
        elif f.vrank is not None:
            by_v[f.vrank] = stream.add(streams[r - 1], streams[r]) if r < 2 * rem else streams[r]
    return by_v


def _replay_doubling(fold: Fold, by_v: dict[int, Stream], sent: list[int],
                     combine: Callable[[Stream, Stream], Stream]) -> Stream:
    """Replay the recursive-doubling rounds (``combine(lower, upper)``); return the result."""
    mask = 1
    while mask < fold.pof2:
        nxt = {}
        for v, s in by_v.items():
            sent[fold.real(v)] += _message(s)
            other = by_v[v ^ mask]
            nxt[v] = combine(s, other) if v < v ^ mask else combine(other, s)
        by_v, mask = nxt, mask << 1
    return by_v[0]


def _replay_unfold(fold: Fold, result: Stream, sent: list[int]) -> None:
    for r in range(1, 2 * fold.rem, 2):
        sent[r] += _message(result)


def ssar_recursive_double_bytes(index_sets: Sequence[torch.Tensor], n: int, *,
                                check: bool = True) -> list[int]:
    """Return the bytes each rank sends in :func:`ssar_recursive_double`, by rank.

    Rank ``r`` holds the positions ``index_sets[r]`` of a vector of length ``n``.
    """
    size = len(index_sets)
    sent = [0] * size
    fold = Fold(0, size)
    by_v = _replay_fold(size, _replay_streams(index_sets, n), sent)
    _replay_unfold(fold, _replay_doubling(fold, by_v, sent, stream.add), sent)
    return [b + _common.control_bytes(size, check) for b in sent]


def _replay_split(index_sets: Sequence[torch.Tensor], n: int, sent: list[int]
                  ) -> tuple[Fold, list[tuple[int, int]], dict[int, Stream]]:
    """Replay fold and split; return the owned range streams by vrank."""
    size = len(index_sets)
    by_v = _replay_fold(size, _replay_streams(index_sets, n), sent)
    fold = Fold(0, size)
    bounds = ranges(n, fold.pof2)
    owned = {}
    for v in range(fold.pof2):
        parts = []
        for u in range(fold.pof2):
            p = stream.part(by_v[u], *bounds[v])
            if u != v:
                sent[fold.real(u)] += _message(p)
            parts.append(p)
        owned[v] = stream.add_all(parts)
    return fold, bounds, owned


def ssar_split_allgather_bytes(index_sets: Sequence[torch.Tensor], n: int, *,
                               check: bool = True) -> list[int]:
    """Return the bytes each rank sends in :func:`ssar_split_allgather`, by rank.

    Arguments as :func:`ssar_recursive_double_bytes`.
    """
    size = len(index_sets)
    sent = [0] * size
    fold, _, owned = _replay_split(index_sets, n, sent)
    result = _replay_doubling(fold, owned, sent, lambda lower, upper: stream.concat([lower,
                                                                                   upper]))
    _replay_unfold(fold, result, sent)
    return [b + _common.control_bytes(size, check) for b in sent]


def dsar_split_allgather_bytes(index_sets: Sequence[torch.Tensor], n: int, *,
                               bits: int | None = None, bucket: int = qsgd.DEFAULT_BUCKET,
                               check: bool = True) -> list[int]:
    """Return the bytes each rank sends in :func:`dsar_split_allgather`, by rank.

    Arguments as :func:`ssar_recursive_double_bytes`, and the call's ``bits`` and ``bucket``.
    """
    size = len(index_sets)
    sent = [0] * size
    fold, bounds, _ = _replay_split(index_sets, n, sent)

    def range_bytes(j: int) -> int:
        lo, hi = bounds[j]
        return 4 * (hi - lo) if bits is None else _range_bytes(lo, hi, bits, bucket)

    for v in range(fold.pof2):
        mask = 1
        while mask < fold.pof2:
            base = v & ~(mask - 1)
            sent[fold.real(v)] += sum(range_bytes(j) for j in range(base, base + mask))
            mask <<= 1
    total = sum(range_bytes(j) for j in range(fold.pof2))
    for r in range(1, 2 * fold.rem, 2):
        sent[r] += total
    return [b + _common.control_bytes(size, check) for b in sent]


# -- RedSync's allgather on streams, and the choice among them ------------------------------


def stream_allgather(comm: Comm, indices: torch.Tensor, values: torch.Tensor, n: int, *,
                     check: bool = True) -> Stream:
    """Return the sum of every rank's sparse vector by an allgather of every rank's stream.

    RedSync's exchange (every rank's pairs to every rank, as :func:`sparse_allgather` sends
    them) on the vectors the SparCML algorithms take: an allgather of the 8-byte frame lengths,
    one of the frames, then every rank adds them in rank order. Arguments and result as
    :func:`ssar_recursive_double`.
    """
    s = _prepare(comm, "stream_allgather", indices, values, n, check)
    if comm.size == 1:
        return s
    frame = stream.encode(s)
    sizes = [_bounded(c, r, n) for r, (c,) in enumerate(comm.allgather_ints([frame.numel()]))]
    frames = comm.allgatherv(frame, sizes)
    checks: list = []  # the frames' check, read with their sum's sizes
    return stream.add_all(stream.decode_all(frames, n, checks=checks), checks=checks)


def stream_allgather_bytes(index_sets: Sequence[torch.Tensor], n: int, *,
                           check: bool = True) -> list[int]:
    """Return the bytes each rank sends in :func:`stream_allgather`, by rank."""
    size = len(index_sets)
    return [(size - 1) * _message(s) + _common.control_bytes(size, check)
            for s in _replay_streams(index_sets, n)]


ALGORITHMS = ("ssar_recursive_double", "ssar_split_allgather", "dsar_split_allgather",
              "stream_allgather", "allreduce")
"""What :func:`sparse_allreduce` chooses among."""


def expected_nnz(n: int, k: float, size: int) -> float:
    """Return E[K], the expected entries of a sum of ``size`` vectors of ``k`` entries each.

    With the entries placed uniformly at random: ``n * (1 - (1 - k/n)**size)`` (SparCML,
    Appendix B.1).
    """
    return n * (1 - (1 - k / n) ** size) if n else 0.0


@dataclasses.dataclass(frozen=True)
class Choice:
    """What :func:`choose` picked, and why.

    Attributes:
        algorithm: the name in :data:`ALGORITHMS` with the least predicted time.
        seconds: the predicted time of each algorithm.
        expected_nnz: E[K] of the sum, from the largest rank's entries.
        k: the largest rank's entries.

    """

    algorithm: str
    seconds: dict[str, float]
    expected_nnz: float
    k: int


def _stream_cost(length: float, nnz: float) -> float:
    # a stream message: its 8-byte length, the header, then pairs or the dense block
    return _LEN.size + stream.HEADER.size + min(8 * nnz, 4 * length)


def choose(n: int, k: int, size: int, *, alpha: float = 5e-6, beta: float = 1 / 12.5e9,
           bits: int | None = None) -> Choice:
    """Predict each algorithm's time in the alpha-beta model and pick the least (5.3).

    Every rank is taken to hold ``k`` uniformly placed entries, so a sum of ``m`` of them has
    ``expected_nnz(n, k, m)`` entries; a stream costs ``8 + 17 + min(8 nnz, 4 len)`` bytes and
    two messages (its length, then its frame), and a message of ``b`` bytes costs
    ``alpha + beta * b`` seconds. The fold adds its two streams for ``P`` not a power of two;
    the dense allreduce is Rabenseifner's ``2 log2 P`` messages of ``2 (P-1)/P * 4n`` bytes in
    all.

    Under uniform indices the split-allgather never sends fewer bytes than recursive doubling
    (about ``k + K`` against ``K``) and takes more messages, so it is never chosen: it wins when
    the ranks' indices overlap (``K`` near ``k``, recursive doubling then sends ``k log2 P``),
    which E[K] does not foresee; name it where that is known.

    Args:
        n: the vector's length.
        k: the entries per rank (the largest rank's).
        size: the ranks.
        alpha: seconds per message (latency).
        beta: seconds per byte (1 / bandwidth); the defaults are 5 us and 100 Gbit/s.
        bits: DSAR's QSGD bits, or ``None`` for its exact float32 ranges.

    """
    pof2 = 1 << (size.bit_length() - 1)
    rounds = pof2.bit_length() - 1
    per = size / pof2  # real ranks behind a virtual one
    kv = expected_nnz(n, k, per) if size > pof2 else float(k)  # a virtual rank's entries
    total = expected_nnz(n, k, size)
    fold = 0.0
    if size > pof2:
        fold = 4 * alpha + beta * (_stream_cost(n, k) + _stream_cost(n, total))
    split = 2 * (pof2 - 1) * alpha + beta * (pof2 - 1) * _stream_cost(n / pof2, kv / pof2)
    seconds = {
        "ssar_recursive_double": fold + sum(
            2 * alpha + beta * _stream_cost(n, expected_nnz(n, kv, 2 ** t))
            for t in range(rounds)),
        "ssar_split_allgather": fold + split + sum(
            2 * alpha + beta * _stream_cost(2 ** t * n / pof2, 2 ** t * total / pof2)
            for t in range(rounds)),
        "dsar_split_allgather": fold + split + sum(
            alpha + beta * 2 ** t * (4 * n / pof2 if bits is None else
                                     qsgd.encoded_size(max(n // pof2, 1), bits))
            for t in range(rounds)),
        "stream_allgather": 2 * (size - 1) * alpha + beta * (size - 1) * (
            _LEN.size + _stream_cost(n, k)),
        "allreduce": (2 * rounds + (2 if size > pof2 else 0)) * alpha
        + beta * 2 * (size - 1) / size * 4 * n,
    }
    if size == 1:
        seconds = dict.fromkeys(seconds, 0.0)
    best = min(ALGORITHMS, key=lambda a: seconds[a])
    return Choice(best, seconds, total, k)


def sparse_allreduce(comm: Comm, indices: torch.Tensor, values: torch.Tensor, n: int, *,
                     algorithm: str = "auto", alpha: float = 5e-6, beta: float = 1 / 12.5e9,
                     bits: int | None = None, bucket: int = qsgd.DEFAULT_BUCKET,
                     seed: int | None = None, check: bool = True
                     ) -> tuple[torch.Tensor, Choice | None]:
    """Return the dense sum of every rank's sparse vector, by ``algorithm`` or the predicted best.

    With ``algorithm="auto"`` the ranks first allgather their entry counts (8 bytes each to
    every rank), and :func:`choose` picks from the largest with ``alpha`` and ``beta`` (give a
    topology's: its latency and 1 / its slowest rate); the choice is returned, the same on
    every rank. ``bits``, ``bucket`` and ``seed`` are DSAR's quantisation
    (:func:`dsar_split_allgather`); the dense ``allreduce`` sums the densified vectors with the
    transport's own.

    Returns:
        ``(dense float32 sum, choice or None when the algorithm was named)``.

    """
    if algorithm != "auto" and algorithm not in ALGORITHMS:
        raise ValueError(f"expected algorithm 'auto' or one of {ALGORITHMS}, got {algorithm!r}")
    choice = None
    if algorithm == "auto":
        count = indices.numel() if isinstance(indices, torch.Tensor) else 0
        k = max(c for (c,) in comm.allgather_ints([count])) if comm.size > 1 else count
        choice = choose(n if isinstance(n, int) else 0, k, comm.size, alpha=alpha, beta=beta,
                        bits=bits)
        algorithm = choice.algorithm
    if algorithm == "allreduce":
        s = _prepare(comm, "sparse_allreduce/allreduce", indices, values, n, check)
        return dense.allreduce(comm, s.to_dense(), check=False), choice
    if algorithm == "dsar_split_allgather":
        return dsar_split_allgather(comm, indices, values, n, bits=bits, bucket=bucket,
                                    seed=seed, check=check), choice
    fn = {"ssar_recursive_double": ssar_recursive_double,
          "ssar_split_allgather": ssar_split_allgather, "stream_allgather": stream_allgather}
    return fn[algorithm](comm, indices, values, n, check=check).to_dense(), choice
