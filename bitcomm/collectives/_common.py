"""Shared pieces of the collectives: chunk bounds and the up-front agreement on the call.

The agreement is one allgather of a 24-byte record per rank: the int64 element count, an int64
status word and an int64 fingerprint of the call (the collective's name and every option that
shapes its bytes or its result). The status word's low 8 bits are the status (0 fine, 1 not a
floating-point tensor, 2 holds NaN or inf, 3 holds a float64 value beyond float32's range where
the collective computes in float32, 4/5/6 an argument refused with
``ValueError``/``TypeError``/``OverflowError``); its high bits carry the byte length of the
rank's first message where only the sender knows it (a sparse frame, see
:func:`prepare_sized`), so that length needs no round of its own. Every rank reads the
same table and so raises the same exception type, before any payload moves, for bad input or
arguments on any rank and for ranks that call different collectives or pass different options;
without it the others would block, or read a peer's bytes with the wrong layout. It costs
``CONTROL_BYTES * (size - 1)`` sent bytes per rank; ``check=False`` skips it, and then every
rank must pass ``check=False``, and only local checks run (a bad rank raises alone).

A caller that flattens several tensors into one call can make the ranks agree on more than the
call itself: inside ``with agree_on(value)`` every collective's fingerprint also covers
``value`` (say, which parameters had a gradient), so ranks that disagree on it raise instead of
exchanging vectors of different layouts.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import struct
from collections.abc import Callable, Iterator, Mapping

import torch

from bitcomm.codecs import _frame
from bitcomm.comm.base import Comm

__all__ = ["NonFiniteError", "agree_on"]

CONTROL_BYTES = 24
_RECORD = struct.Struct("<qqq")
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_OK, _NOT_FLOAT, _NON_FINITE, _TOO_BIG = 0, 1, 2, 3
_STATUS_BITS = 8  # the status word: status | payload length << 8
# The statuses of arguments that a collective's validation refused, by exception type.
_ARGUMENT_ERRORS = {4: ValueError, 5: TypeError, 6: OverflowError}


_AGREED: contextvars.ContextVar[tuple] = contextvars.ContextVar("bitcomm_agreed", default=())


class NonFiniteError(ValueError):
    """Some rank's input holds NaN or inf: raised on every rank by the agreement.

    A ``ValueError``, so callers that catch those keep working; a DDP hook catches this one to
    hand back a non-finite bucket on every rank, which is how a loss scaler learns of the
    overflow.
    """


@contextlib.contextmanager
def agree_on(value: object) -> Iterator[None]:
    """Make every collective called inside also agree that all ranks passed an equal ``value``.

    ``value`` is compared by ``repr`` (as options are); ranks that pass different values raise
    ``ValueError`` on every rank at the first collective, before its payload moves. Nests.
    """
    token = _AGREED.set((*_AGREED.get(), value))
    try:
        yield
    finally:
        _AGREED.reset(token)


def bounds(n: int, size: int) -> list[tuple[int, int]]:
    """Return the ``size`` chunks ``[n*c//size, n*(c+1)//size)`` of ``n`` elements."""
    return [(n * c // size, n * (c + 1) // size) for c in range(size)]


def control_bytes(size: int, check: bool) -> int:
    """Return the bytes one rank sends for the agreement (0 without ``check``)."""
    return CONTROL_BYTES * (size - 1) if check else 0


def fingerprint(name: str, options: Mapping[str, object]) -> int:
    """Return a signed 64-bit digest of a call: the collective's name and its options.

    Options are compared by ``repr``, so any value with a deterministic ``repr`` (ints, strings,
    frozen dataclasses) can be one; Python's own ``hash`` is salted per process and cannot.
    """
    text = repr((name, sorted(options.items())))
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little",
                          signed=True)


def check_out(out: object, x: torch.Tensor, dtype: torch.dtype) -> None:
    """Check a collective's ``out`` (``None``, or where it writes its result).

    ``out`` must be a contiguous tensor of ``x``'s shape and device and of the result's
    ``dtype``; it may be ``x`` itself, since a collective reads all of its input before it
    writes its result. Raises ``TypeError`` (not a tensor, another dtype) or ``ValueError``;
    called from a collective's validation, so the error is raised on every rank.
    """
    if out is None:
        return
    if not isinstance(out, torch.Tensor) or out.dtype != dtype:
        raise TypeError(f"expected out to be a {dtype} tensor, got "
                        f"{getattr(out, 'dtype', type(out).__name__)}")
    if out.shape != x.shape or out.device != x.device or not out.is_contiguous():
        raise ValueError(f"expected out to be a contiguous tensor of shape {tuple(x.shape)} on "
                         f"{x.device}, got shape {tuple(out.shape)} on {out.device}"
                         f"{'' if out.is_contiguous() else ', not contiguous'}")


def result_buffer(out: torch.Tensor | None, n: int, dtype: torch.dtype,
                  like: torch.Tensor, *, zeroed: bool = False) -> torch.Tensor:
    """Return the flat tensor a collective writes its result into: ``out``'s elements, or new.

    A new one is on ``like``'s device, and on the CPU path numpy's where numpy has the dtype
    (:func:`bitcomm.codecs._frame.host_array`: huge pages, so a fresh 32 MB result is written
    in a quarter of the time). ``zeroed``: filled with zeros (a new one allocated so, from
    pages the kernel hands out zeroed, not written twice).
    """
    if out is None:
        return _frame.host_array(n, dtype, like, zeroed=zeroed)
    return out.view(-1).zero_() if zeroed else out.view(-1)


def _status_of(error: BaseException) -> int:
    # the validation raises only these types; an exception of two of them reports the narrower
    return next(s for s, kind in sorted(_ARGUMENT_ERRORS.items(), reverse=True)
                if isinstance(error, kind))


def prepare(comm: Comm, x: object, check: bool, name: str, *, float32: bool = False,
            options: Mapping[str, object] | None = None,
            validate: Callable[[torch.Tensor], None] | None = None,
            length: int | None = None) -> torch.Tensor:
    """Return ``x`` flattened after every rank agreed that the call is the same and valid.

    Args:
        comm: the transport.
        x: the caller's input.
        check: run the agreement; without it only the local checks run (a bad rank raises
            alone, and a mismatched call may hang or return garbage).
        name: the collective's name, for messages and the fingerprint.
        float32: the collective computes in float32, so a float64 value beyond float32's range
            is refused.
        options: the call's settings that must be equal on every rank (by ``repr``); leave out
            what may differ (a seed the collective offsets by rank).
        validate: checks of the other arguments, called with the flattened float tensor before
            anything is sent; the ``ValueError``, ``TypeError`` or ``OverflowError`` it raises is
            raised on every rank.
        length: the length every rank must agree on, where it is not ``x``'s own (a sparse
            vector's ``n``, while its values differ in number between ranks); negative where
            this rank's length argument is not a length, which ``validate`` must then refuse.

    Raises on every rank, the first that applies: ``TypeError`` if any rank's input is not a
    floating-point tensor; ``ValueError`` if the lengths differ; the exception type of the
    lowest rank whose arguments ``validate`` refused (that rank's message included where it was
    raised); ``ValueError`` if ranks called with different names or options, if any rank holds
    NaN or inf or, with ``float32``, a float64 value that float32 cannot hold (it would become
    inf after the cast).

    """
    return _agree(comm, x, check, name, float32, options, validate, length, None)[0]


def prepare_sized(comm: Comm, x: object, check: bool, name: str,
                  payload: Callable[[torch.Tensor], int], *, float32: bool = False,
                  options: Mapping[str, object] | None = None,
                  validate: Callable[[torch.Tensor], None] | None = None,
                  length: int | None = None) -> tuple[torch.Tensor, list[int] | None]:
    """:func:`prepare`, also returning every rank's ``payload(x)`` by rank.

    ``payload`` runs on the flattened input once it passed the local checks (validated and
    finite), before anything is sent: it builds the rank's first message and returns its byte
    length (an int >= 0). Its ``ValueError``/``TypeError``/``OverflowError`` is raised on every
    rank, as the validation's is. With ``check`` the lengths travel in the agreement's records
    (no extra bytes); without it ``payload`` still runs, nothing is exchanged and the lengths
    come back as ``None``, for the caller to exchange.
    """
    return _agree(comm, x, check, name, float32, options, validate, length, payload)


def _agree(comm: Comm, x: object, check: bool, name: str, float32: bool,
           options: Mapping[str, object] | None,
           validate: Callable[[torch.Tensor], None] | None, length: int | None,
           payload: Callable[[torch.Tensor], int] | None
           ) -> tuple[torch.Tensor, list[int] | None]:
    is_float = isinstance(x, torch.Tensor) and x.dtype in _FLOATS
    flat = x.detach().reshape(-1) if is_float else None
    error: BaseException | None = None
    if is_float and validate is not None:
        try:
            validate(flat)
        except (ValueError, TypeError, OverflowError) as e:
            error = e
    if not check:
        if not is_float:
            raise TypeError(f"{name}: expected a floating-point torch.Tensor, got "
                            f"{_describe(x)} on rank {comm.rank}")
        if error is not None:
            raise error
        if payload is not None:
            payload(flat)
        return flat, None
    status = _OK if is_float else _NOT_FLOAT
    n = (x.numel() if length is None else length) if isinstance(x, torch.Tensor) else -1
    if error is not None:
        status = _status_of(error)
    elif status == _OK and n:
        # One pass over x: float64 input to a float32 collective is checked as float32, which
        # also catches NaN and inf; only a failing check looks again to say which it was.
        wide = float32 and x.dtype == torch.float64
        if not _frame.all_finite(x, as_float32=wide):
            status = _TOO_BIG if wide and _frame.all_finite(x) else _NON_FINITE
    nbytes = 0
    if payload is not None and status == _OK:
        try:
            nbytes = int(payload(flat))
        except (ValueError, TypeError, OverflowError) as e:
            error, status = e, _status_of(e)
    options = dict(options or {})
    if _AGREED.get():
        options["agree_on"] = _AGREED.get()
    word = status | nbytes << _STATUS_BITS
    mine = torch.frombuffer(bytearray(_RECORD.pack(n, word, fingerprint(name, options))),
                            dtype=torch.uint8)
    records = comm.allgatherv(mine, [CONTROL_BYTES] * comm.size) if comm.size > 1 else [mine]
    # One read for every rank's record (over NCCL they come back from the GPU together).
    raw = bytes(torch.cat([r.reshape(-1) for r in records]).tolist())
    table = [_RECORD.unpack(raw[i:i + CONTROL_BYTES]) for i in range(0, len(raw), CONTROL_BYTES)]
    lengths = [w >> _STATUS_BITS for _, w, _ in table]
    table = [(c, w & ((1 << _STATUS_BITS) - 1), f) for c, w, f in table]
    bad = [r for r, (_, s, _) in enumerate(table) if s == _NOT_FLOAT]
    if bad:
        what = _describe(x) if comm.rank in bad else "see that rank"
        raise TypeError(f"{name}: expected a floating-point torch.Tensor on every rank, got "
                        f"something else on rank(s) {bad} (here: {what})")
    sizes = [c for c, _, _ in table]
    # A negative length is a rank's word that its own length argument was refused: its
    # validation error, raised below, says what is wrong where a mismatch would not.
    if len({c for c in sizes if c >= 0}) > 1:
        what = "number of elements" if length is None else "length n"
        shown = [c if c >= 0 else None for c in sizes]
        raise ValueError(f"{name}: expected the same {what} on every rank, got {shown} (by "
                         "rank)")
    bad = [r for r, (_, s, _) in enumerate(table) if s in _ARGUMENT_ERRORS]
    if bad:
        kind = _ARGUMENT_ERRORS[table[bad[0]][1]]
        here = f"here: {error}" if error is not None else f"see rank {bad[0]}"
        raise kind(f"{name}: invalid arguments on rank(s) {bad} ({here})") from error
    calls: dict[int, list[int]] = {}
    for r, (_, _, f) in enumerate(table):
        calls.setdefault(f, []).append(r)
    if len(calls) > 1:
        here = ", ".join(f"{k}={v!r}" for k, v in options.items())
        raise ValueError(f"{name}: expected the same collective with the same options on every "
                         f"rank, got {len(calls)} different calls, by rank: "
                         f"{' / '.join(map(str, calls.values()))} (here: {name}({here}))")
    bad = [r for r, (_, s, _) in enumerate(table) if s == _NON_FINITE]
    if bad:
        raise NonFiniteError(f"{name}: expected finite values, got NaN or inf on rank(s) {bad}")
    bad = [r for r, (_, s, _) in enumerate(table) if s == _TOO_BIG]
    if bad:
        raise ValueError(f"{name}: expected values that float32 (its arithmetic) can hold, got a "
                         f"float64 beyond float32's range on rank(s) {bad}")
    return flat, (lengths if payload is not None else None)


def _describe(x: object) -> str:
    if isinstance(x, torch.Tensor):
        return f"a tensor of dtype {x.dtype}"
    return type(x).__name__
