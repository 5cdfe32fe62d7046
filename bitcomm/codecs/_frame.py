"""Shared plumbing for the codecs: buffer checks, fixed-width headers, bit packing kernels.

Every codec frame is a 1-D ``torch.uint8`` tensor on the device of the data it encodes. Headers
are little-endian fixed-width fields written with :mod:`struct`; they are built on the host and
copied to the device once, so a CUDA encoder costs one small host-to-device copy per frame.

Each codec has up to three paths, chosen per tensor by :func:`backend`: numpy for CPU tensors
(``np.packbits`` is vectorised and much faster than anything expressible in torch ops on the
CPU), Triton kernels (:mod:`bitcomm.codecs._kernels`) for CUDA tensors when triton is installed,
and torch ops for everything else (CUDA without triton, other devices). All three write the same
bytes; the tests check that on the CPU by forcing the torch path, and the Triton path under
``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib.metadata
import importlib.util
import struct
import threading
import warnings

import numpy as np
import torch

__all__: list[str] = []

# Set by tests to "torch" or "triton" to run that path on CPU tensors (triton needs
# TRITON_INTERPRET=1 there).
FORCE: str | None = None
BACKENDS = ("numpy", "torch", "triton")

_INT_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


MIN_TRITON = (3, 4)
"""The oldest triton the kernels compile with (``tl.histogram`` takes a mask from 3.4 on)."""


@functools.cache
def has_triton() -> bool:
    """Say whether a triton the kernels can use is installed (it is an optional dependency).

    An older one is left unused, with a warning: its compiler would fail on the first kernel
    that needs a newer feature, in the middle of a collective.
    """
    if importlib.util.find_spec("triton") is None:
        return False
    try:
        version = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:  # another distribution (pytorch-triton)
        import triton

        version = triton.__version__
    release = tuple(int(p) for p in version.split("+")[0].split(".")[:2] if p.isdigit())
    if release < MIN_TRITON:
        warnings.warn(f"triton {version} is older than {'.'.join(map(str, MIN_TRITON))}: "
                      "bitcomm's GPU codecs run torch ops instead of its kernels (same bytes, "
                      "slower); pip install 'bitcomm[gpu]' for a newer triton",
                      RuntimeWarning, stacklevel=2)
        return False
    return True


def backend(t: torch.Tensor) -> str:
    """Return the path ``t`` takes: ``"numpy"`` (CPU), ``"triton"`` (CUDA) or ``"torch"``."""
    if FORCE is not None:
        return FORCE
    if t.device.type == "cpu":
        return "numpy"
    if t.device.type == "cuda" and has_triton():
        return "triton"
    return "torch"


def use_numpy(t: torch.Tensor) -> bool:
    """Say whether ``t`` takes the numpy fast path (CPU tensors, unless tests force another)."""
    return backend(t) == "numpy"


def use_triton(t: torch.Tensor) -> bool:
    """Say whether ``t`` takes the Triton kernels (:mod:`bitcomm.codecs._kernels`)."""
    return backend(t) == "triton"


NUMPY_FLOATS = {torch.float16: np.float16, torch.float32: np.float32, torch.float64: np.float64}
"""The float dtypes numpy has (not bfloat16, nor the float8 types), with numpy's."""


def host_array(shape: int | tuple[int, ...], dtype: torch.dtype, like: torch.Tensor, *,
               zeroed: bool = False) -> torch.Tensor:
    """Return a new tensor like ``torch.empty`` (``zeroed``: ``torch.zeros``) on ``like``'s device.

    Where ``like`` takes the numpy path and numpy has ``dtype``, numpy allocates it: on Linux
    numpy asks the kernel for transparent huge pages for arrays of 4 MiB and more, which
    torch's CPU allocator does only when ``THP_MEM_ALLOC_ENABLE=1`` was set before torch
    started, so a fresh 256 MB output faults 2 MiB at a time rather than 4 KiB (writing one
    took 17 ms against torch's 66 on a 2-core VM). The decoders' large CPU outputs come from
    here. Like any ``torch.from_numpy`` tensor it cannot be resized in place. Empty ones come
    from torch: ``torch.from_numpy`` gives an empty array a stride of 0, which ``view`` as
    another dtype refuses.
    """
    if use_numpy(like) and dtype in NUMPY_FLOATS and (shape if isinstance(shape, int)
                                                      else all(shape)):
        make = np.zeros if zeroed else np.empty
        return torch.from_numpy(make(shape, dtype=NUMPY_FLOATS[dtype]))
    make = torch.zeros if zeroed else torch.empty
    return make(shape, dtype=dtype, device=like.device)


def numpy_float(t: torch.Tensor) -> bool:
    """Say whether ``t`` takes the numpy path as floats numpy can view (not bfloat16)."""
    return use_numpy(t) and t.dtype in NUMPY_FLOATS


def rounded(value: float, a: np.ndarray) -> np.floating:
    """Return ``value`` in ``a``'s float dtype, as torch rounds a Python float it compares with.

    To nearest, and beyond the dtype's range to inf, without numpy's overflow warning.
    """
    with np.errstate(over="ignore"):
        return a.dtype.type(value)


def all_finite(t: torch.Tensor, *, as_float32: bool = False) -> bool:
    """Say whether every element of ``t`` is finite (with ``as_float32``: once cast to float32).

    On the numpy path this costs about a microsecond where torch's ``isfinite`` dispatches
    several operations (~20 us): most of a small tensor's checks. One host read either way;
    on the Triton path after one kernel (:func:`nonfinite_any`).
    """
    if numpy_float(t):
        a = t.detach().numpy()
        if as_float32 and a.dtype == np.float64:
            with np.errstate(over="ignore"):  # beyond float32's range becomes inf: the point
                a = a.astype(np.float32)
        return bool(np.isfinite(a).all())
    return not bool(nonfinite_any(t, as_float32=as_float32))


def nonfinite_any(t: torch.Tensor, *, as_float32: bool = False) -> torch.Tensor:
    """Return a 0-d bool tensor on ``t``'s device: whether ``t`` holds NaN or inf.

    With ``as_float32``, of ``t`` once cast to float32 (a float64 beyond float32's range
    becomes inf). No host read: a flag for :func:`check_later` or a device-side choice. On the
    Triton path one kernel reads ``t`` once (:func:`bitcomm.codecs._kernels.nonfinite`);
    torch's ``isfinite(t)`` and its reduction are five kernels and about five passes.
    """
    narrow = as_float32 and t.dtype == torch.float64
    if use_triton(t) and t.dtype in _FLOAT_DTYPES:
        return kernels().nonfinite(t, narrow)[int(narrow)] != 0
    if narrow:
        t = t.to(torch.float32)
    return ~torch.isfinite(t).all()


def zero_nonfinite_(t: torch.Tensor, *, as_float32: bool = False) -> torch.Tensor:
    """Set ``t``'s NaN and inf elements to +0.0 in place; return whether it had any (0-d bool).

    With ``as_float32``, the elements that are not finite once cast to float32 (a float64
    beyond float32's range too). ``t`` must be contiguous. No host read: on the Triton path one
    kernel reads ``t`` and writes only the elements it zeroes; elsewhere torch's ``isfinite``,
    a reduction and a masked fill.
    """
    if not t.is_contiguous():
        raise ValueError("zero_nonfinite_ writes in place: expected a contiguous tensor")
    narrow = as_float32 and t.dtype == torch.float64
    if use_triton(t) and t.dtype in _FLOAT_DTYPES:
        return kernels().nonfinite(t, narrow, zero=True)[int(narrow)] != 0
    bad = ~torch.isfinite(t.to(torch.float32) if narrow else t)
    t.masked_fill_(bad, 0.0)
    return bad.any()


def rows_of(bufs: list[torch.Tensor]) -> torch.Tensor:
    """Return equal-sized 1-D buffers as the rows of one 2-D tensor, copying only if needed.

    Where they lie back to back in one storage (an allgather's receive buffer, as the
    transports return it) the rows are a view of it; otherwise ``torch.stack`` copies them.
    """
    first = bufs[0]
    size = first.numel()
    if size and all(b.dim() == 1 and b.numel() == size and b.device == first.device
                    and b.dtype == first.dtype and b.stride(0) == 1
                    and b.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
                    and b.data_ptr() == first.data_ptr() + i * size * first.element_size()
                    for i, b in enumerate(bufs)):
        return first.as_strided((len(bufs), size), (size, 1))
    return torch.stack(bufs)


@functools.cache  # an import statement a call costs a codec call's host half a microsecond
def kernels():
    """Return :mod:`bitcomm.codecs._kernels`, imported on first use (it imports triton)."""
    from bitcomm.codecs import _kernels

    return _kernels


def raise_if(flags: torch.Tensor | None, fallback) -> None:
    """Call ``fallback()`` (which raises the precise error) if any kernel flag is set.

    The one host synchronisation of a Triton decoder: its kernels only flag a broken rule, and
    the torch path, re-run on the bad input, says which rule with the usual message. Inside
    :func:`deferred` the read waits for the end of the block. ``None``: no rule could be
    broken (the kernel wrapper knew from the sizes), nothing to read.
    """
    if flags is None:
        return
    if flags.numel() == 1:  # read as it is: a reduction would be one more kernel to wait for
        check_later(flags.reshape(()), fallback)
    elif flags.numel():
        check_later(flags.any(), fallback)


_PENDING: contextvars.ContextVar[list | None] = contextvars.ContextVar("bitcomm_checks",
                                                                       default=None)


def check_later(flag: torch.Tensor, fallback) -> None:
    """Call ``fallback()`` (which raises the precise error) if the bool tensor ``flag`` is set.

    At once (a host read, which waits for a GPU), or, inside :func:`deferred`, at the end of
    the block with every other flag of it in one read.
    """
    pending = _PENDING.get()
    if pending is not None:
        pending.append((flag, fallback))
    elif read_flag(flag):
        fallback()
        raise AssertionError("a payload was flagged that the precise check accepted")


_CLEAN = threading.local()


def clean_flag(device: torch.device) -> torch.Tensor:
    """Return a zeroed int32 flag on ``device`` for a kernel whose caller reads it at once.

    The call that takes it must read it with :func:`read_flag` or :func:`check_later` (or
    :func:`raise_if`) before it returns, whatever the flag's value. Outside a :func:`deferred`
    block this is the thread's own flag for the device, reused while every read finds it
    clear (a kernel stores into it only where a rule is broken, and a read that finds it set
    retires it): no zeroing launch a call, which on an H200's host took 12 us where an
    allocation alone takes 4. Inside a block, whose reads wait for its end, a new one each
    time.
    """
    if _PENDING.get() is not None:
        return torch.zeros(1, dtype=torch.int32, device=device)
    flags = getattr(_CLEAN, "flags", None)
    if flags is None:
        flags = _CLEAN.flags = {}
    flag = flags.get(device)
    if flag is None:
        flag = flags[device] = torch.zeros(1, dtype=torch.int32, device=device)
    return flag


def read_flag(flag: torch.Tensor) -> bool:
    """Read ``flag`` (a host read: it waits for the device); retire it if it is set.

    A set flag of :func:`clean_flag` leaves the thread's table, so that the next call gets a
    zeroed one.
    """
    if not bool(flag):
        return False
    flags = getattr(_CLEAN, "flags", {})
    kept = flags.get(flag.device)
    if kept is not None and kept.data_ptr() == flag.data_ptr():  # flag may be a view of it
        del flags[flag.device]
    return True


def deferring() -> bool:
    """Say whether :func:`check_later` defers here: inside a :class:`deferred` block.

    A decoder that would read its checks before handing out indices may then hand them out
    clamped into range instead (they address only memory they may until the block's read
    raises), and leave its flags to the block.
    """
    return _PENDING.get() is not None


def deferred_here():
    """Return a :class:`deferred` block, or, inside one already, a block that does nothing.

    For code whose flags may wait for whichever block encloses it: one read for all.
    """
    return contextlib.nullcontext() if deferring() else deferred()


def read_checked(checks: list, values: torch.Tensor | None = None) -> list:
    """Return ``values.tolist()`` read with the flags of ``checks`` in one host read.

    ``checks``: ``(flag, fallback)`` pairs as :func:`check_later` takes, whose flags nobody has
    read yet; the first one set has its ``fallback()`` raise the precise error. ``values``: a
    1-D integer tensor on the flags' device (``None``: only the flags).
    """
    if not checks:
        return [] if values is None else values.tolist()
    flags = torch.stack([flag.reshape(()).to(torch.int64) for flag, _ in checks])
    got = (flags if values is None else torch.cat([flags, values.to(torch.int64)])).tolist()
    for (_, fallback), bad in zip(checks, got, strict=False):
        if bad:
            fallback()
            raise AssertionError("a payload was flagged that the precise check accepted")
    return got[len(checks):]


class deferred:  # noqa: N801 - used as a function: `with _frame.deferred():`
    """Check the flags that :func:`check_later` gets inside the block together, at its end.

    For a collective whose steps decode payloads and only add, compare and repack what they
    hold (no decoded value addresses memory): a flag per step would be a host read per step.
    On a broken rule the block's first flagged payload raises its precise error. Per thread
    (and task): blocks in other threads do not see each other's flags. A class rather than a
    generator-based context manager: it wraps every small collective call on the CPU, and
    the generator form measurably slowed those calls with ranks as threads.

    ``handover``: the block ends its call's use of what it checked (the call returns values
    only), so a caller that waits anyway may take the flags: inside :class:`collect` they go to
    the collector's list instead of being read here.
    """

    __slots__ = ("_token", "_handover")

    def __init__(self, *, handover: bool = False) -> None:
        self._handover = handover

    def __enter__(self) -> None:
        self._token = _PENDING.set([])

    def __exit__(self, kind, value, traceback) -> None:
        pending = _PENDING.get()
        _PENDING.reset(self._token)
        if kind is not None or not pending:
            return  # an error inside the block is not masked by the checks
        # Only the outermost block hands over: an enclosing one reads what it holds.
        into = _COLLECTED.get() if self._handover and _PENDING.get() is None else None
        if into is not None:
            into.extend(pending)
            return
        bad = torch.stack([f.reshape(()).to(torch.bool) for f, _ in pending])
        if bool(bad.any()):  # the block's one host read
            # The precise check runs at once even inside an enclosing block: it must raise.
            inner = _PENDING.set(None)
            try:
                pending[bad.cpu().tolist().index(True)][1]()
            finally:
                _PENDING.reset(inner)
            raise AssertionError("a payload was flagged that the precise check accepted")


_COLLECTED: contextvars.ContextVar[list | None] = contextvars.ContextVar("bitcomm_collected",
                                                                         default=None)


class collect:  # noqa: N801 - used as a function: `with _frame.collect(checks):`
    """Take the flags of the ``deferred(handover=True)`` blocks inside into ``checks``.

    ``checks`` gets ``(flag, fallback)`` pairs, unread, for the caller's :func:`read_checked`.
    For a caller that holds the calls' results until a later read anyway (a DDP hook's step
    waits for its agreement): their checks ride on that read. Blocks without ``handover``
    (a decoder whose indices address memory next) still read at their end. Per thread.
    """

    __slots__ = ("_checks", "_token")

    def __init__(self, checks: list) -> None:
        self._checks = checks

    def __enter__(self) -> list:
        self._token = _COLLECTED.set(self._checks)
        return self._checks

    def __exit__(self, kind, value, traceback) -> None:
        _COLLECTED.reset(self._token)


def broken_order(idx: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Return whether the non-empty indices ``idx`` leave ``[lo, hi)`` or fail to increase.

    A bool tensor on ``idx``'s device (no host read), for callers that read many checks at
    once: strictly increasing indices are in range when the first and the last are.
    """
    return (idx[0] < lo) | (idx[-1] >= hi) | (idx[1:] <= idx[:-1]).any()


def indices_of(mask: torch.Tensor, count: int) -> torch.Tensor:
    """Return ``torch.nonzero(mask)`` of a 1-D mask whose ``count`` the host already knows.

    ``torch.nonzero`` reads the count back to size its output (on a GPU, a wait); given the
    count, ``torch.nonzero_static`` does not. CUDA builds of torch before 2.6 lack it for CUDA
    tensors and take ``torch.nonzero``: the same indices, with the wait. On the numpy path
    ``np.flatnonzero`` finds them in about 2/3 of the time.
    """
    if use_numpy(mask) and mask.dim() == 1:
        found = np.flatnonzero(mask.numpy())
        if found.size == count:
            return torch.from_numpy(found)
    try:
        return torch.nonzero_static(mask, size=count).reshape(-1)
    except NotImplementedError:
        return torch.nonzero(mask).reshape(-1)


def _check_tensor(x: object, name: str) -> None:
    # A codec reads the elements: sparse layouts and tensors without storage (the meta device)
    # have none to read, which torch would report as RuntimeError or NotImplementedError.
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"expected {name} to be a torch.Tensor, got {type(x).__name__}")
    if x.layout != torch.strided:
        raise TypeError(f"expected {name} to be a dense tensor, got layout {x.layout}")
    if x.device.type == "meta":
        raise TypeError(f"expected {name} to hold data, got a tensor on the meta device")


def check_float(x: object, name: str = "x") -> torch.Tensor:
    """Return ``x`` flattened if it is a dense floating-point tensor, else raise ``TypeError``."""
    _check_tensor(x, name)
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"expected {name} to be a floating-point tensor, got dtype {x.dtype}")
    return _flat(x)


def check_int(x: object, name: str = "x") -> torch.Tensor:
    """Return ``x`` flattened if it is a dense integer tensor, else raise ``TypeError``."""
    _check_tensor(x, name)
    if x.dtype not in _INT_DTYPES:
        raise TypeError(f"expected {name} to be an integer tensor, got dtype {x.dtype}")
    return _flat(x)


def _flat(x: torch.Tensor) -> torch.Tensor:
    # x as a 1-D tensor outside autograd. A 1-D tensor that autograd does not track (a DDP
    # bucket, a received frame) is returned as it is: a detach and a reshape are two torch
    # calls, 2-3 us of the host's time that a one-kernel codec call spends on nothing else.
    if x.dim() == 1 and not x.requires_grad:
        return x
    return x.detach().reshape(-1)


def check_count(value: object, name: str) -> int:
    """Return ``value`` as an ``int`` in [0, 2**63), or raise ``TypeError``/``ValueError``.

    ``OverflowError`` above: counts travel in int64 header fields.
    """
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"expected {name} to be an int, got {type(value).__name__}")
    if value < 0:
        raise ValueError(f"expected {name} >= 0, got {value}")
    if value >= 2**63:
        raise OverflowError(f"expected {name} < 2**63 (an int64 header field), got {value}")
    return int(value)


MIN_DECODE_LIMIT = 1 << 16
"""Elements any frame may decode to without the caller stating a length."""
MAX_ELEMENTS_PER_BYTE = 4096
"""Beyond :data:`MIN_DECODE_LIMIT`, elements a decoder may produce per byte of its frame when the
caller states no length. A payload byte holds at most 8 elements (1-bit signs), so only outputs
that no payload backs (zero counts, the zeros of a densified sparse frame) can reach it: a sparse
frame of 8-byte entries stands for densities down to 1/512 of its length, and a caller that
expects a sparser one passes ``n``."""


def check_length(n: int, frame_bytes: int, expected: object, codec: str,
                 field: str = "n") -> None:
    """Raise unless a header's element count ``n`` may be allocated.

    With ``expected`` (callers that know the length, such as the collectives) ``n`` must equal
    it; without, ``n`` may be at most ``max(MIN_DECODE_LIMIT, MAX_ELEMENTS_PER_BYTE *
    frame_bytes)``, so a corrupt or hostile header cannot make a tiny frame allocate gigabytes.
    ``ValueError`` names the field; a non-int ``expected`` is a ``TypeError``.
    """
    if expected is not None:
        if check_count(expected, field) != n:
            raise ValueError(f"corrupt {codec} frame: expected {field}={expected}, got "
                             f"{field}={n}")
        return
    limit = max(MIN_DECODE_LIMIT, MAX_ELEMENTS_PER_BYTE * frame_bytes)
    if n > limit:
        raise ValueError(f"{codec} frame: header {field}={n} is more than a {frame_bytes}-byte "
                         f"frame can justify ({limit} elements); pass {field}= with the "
                         f"length you expect to accept it")


def as_buffer(buf: object, name: str = "frame") -> torch.Tensor:
    """Return ``buf`` as a contiguous 1-D uint8 tensor.

    ``buf``: a 1-D uint8 tensor, a 1-D uint8 numpy array (shared where contiguous), or bytes,
    bytearray or memoryview (copied to the CPU). A frame is one row of bytes: a tensor or an
    array of more dimensions is a ``ValueError``, not read in its memory order.
    """
    if isinstance(buf, (bytes, bytearray, memoryview)):
        return torch.frombuffer(bytearray(buf), dtype=torch.uint8)
    if isinstance(buf, np.ndarray):
        if buf.dtype != np.uint8:
            raise TypeError(f"expected {name} to hold uint8, got numpy dtype {buf.dtype}")
        if buf.ndim != 1:
            raise ValueError(f"expected {name} to be 1-D, got shape {buf.shape}")
        return torch.from_numpy(np.ascontiguousarray(buf))
    if not isinstance(buf, torch.Tensor):
        raise TypeError(f"expected {name} to be a uint8 tensor or bytes, got {type(buf).__name__}")
    if buf.dtype != torch.uint8:
        raise TypeError(f"expected {name} to be a uint8 tensor, got dtype {buf.dtype}")
    if buf.dim() != 1:
        raise ValueError(f"expected {name} to be 1-D, got shape {tuple(buf.shape)}")
    return buf.contiguous()


def need(buf: torch.Tensor, end: int, codec: str, field: str) -> None:
    """Raise ``ValueError`` unless ``buf`` holds at least ``end`` bytes (for ``field``)."""
    if buf.numel() < end:
        raise ValueError(
            f"truncated {codec} frame: {field} needs bytes up to offset {end}, "
            f"got a buffer of {buf.numel()} bytes"
        )


def read_struct(buf: torch.Tensor, offset: int, fmt: struct.Struct, codec: str, field: str):
    """Unpack ``fmt`` from ``buf[offset:]``, raising ``ValueError`` if the buffer is short."""
    need(buf, offset + fmt.size, codec, field)
    raw = buf[offset : offset + fmt.size].cpu().numpy().tobytes()
    return fmt.unpack(raw)


def host_bytes(data: bytes, device: torch.device | str) -> torch.Tensor:
    """Return ``data`` as a uint8 tensor on ``device`` (copied as :func:`to_device` copies)."""
    return to_device(torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else
                     _empty_u8(), device)


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """Return the host tensor ``t`` on ``device``, without waiting for a GPU.

    To a GPU the copy goes from pinned memory: one from pageable memory waits for the device as
    a read does, and every encoder writes its header this way. (The pinned block is not reused
    before the copy is done: PyTorch's host allocator records it.)
    """
    if t.numel() and torch.device(device).type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def check_header(buf: torch.Tensor, fmt: struct.Struct, names: tuple[str, ...],
                 want: tuple, codec: str) -> None:
    """Raise ``ValueError`` naming the first field of ``buf``'s header that is not ``want``'s.

    For callers that know the layout of every frame they receive (a collective's): a frame
    that decodes, but as another layout, is as corrupt as one that does not.
    """
    got = read_struct(buf, 0, fmt, codec, "header")
    for field, expected, value in zip(names, want, got, strict=True):
        if expected != value:
            raise ValueError(f"corrupt {codec} frame: expected {field}={expected}, got "
                             f"{field}={value}")


@functools.lru_cache(maxsize=128)
def header_on(device: torch.device, fmt: struct.Struct, fields: tuple) -> torch.Tensor:
    """Return ``fmt.pack(*fields)`` as uint8 on ``device``, made once per value.

    A header to compare frames with on the device, copied there once per layout rather than
    once per call. Never written to.
    """
    return host_bytes(fmt.pack(*fields), device)


def _empty_u8() -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8)


ALIGN = 16
"""Bytes of alignment a Triton kernel needs to move 16 bytes a lane in one instruction."""


def empty_aligned_at(size: int, offset: int, device: torch.device | str) -> torch.Tensor:
    """Return an uninitialised uint8 tensor of ``size`` bytes whose byte ``offset`` is aligned.

    For a kernel that writes the payload of a frame behind its header: Triton specialises a
    pointer on 16-byte alignment, and through a misaligned one every byte is its own store
    (``bitcomm bench kernels``: 8-bit qsgd codes written at a frame's offset 14 took 1.06 store
    instructions an element instead of 0.125). The tensor is a view ``ALIGN - 1`` bytes into a
    slightly larger buffer.
    """
    buf = torch.empty(size + ALIGN - 1, dtype=torch.uint8, device=device)
    pad = -(buf.data_ptr() + offset) % ALIGN
    return buf[pad : pad + size]


def empty_frame(header: bytes, payload: int, device: torch.device | str
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(frame, payload_view)``: ``header`` then ``payload`` bytes left uninitialised.

    For an encoder whose kernel writes its payload into the frame itself, where a payload
    made apart and concatenated behind the header would be copied once more. The payload
    starts :data:`ALIGN`-aligned (:func:`empty_aligned_at`).
    """
    frame = empty_aligned_at(len(header) + payload, len(header), device)
    frame[: len(header)] = host_bytes(header, device)
    return frame, frame[len(header):]


def float_bytes(t: torch.Tensor) -> torch.Tensor:
    """Return the little-endian bytes of a contiguous fp16/fp32/int32/int64 tensor as uint8."""
    t = t.contiguous().reshape(-1)
    if t.numel() <= 1 and t.stride(-1) != 1:
        # a slice of 0 or 1 elements counts as contiguous with any stride, which view() refuses
        t = torch.empty_like(t, memory_format=torch.contiguous_format).copy_(t)
    return t.view(torch.uint8)


def from_bytes(buf: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Reinterpret a uint8 slice as ``dtype`` (copying when it is misaligned for ``dtype``)."""
    itemsize = dtype.itemsize
    if buf.numel() == 0:
        return torch.empty(0, dtype=dtype, device=buf.device)
    if buf.storage_offset() % itemsize:
        buf = buf.clone()
    return buf.view(dtype)


# --- bit packing kernels (MSB-first inside a byte, zero padding) -------------------------------

_BIT_WEIGHTS = {}


def _weights(device: torch.device) -> torch.Tensor:
    w = _BIT_WEIGHTS.get(device)
    if w is None:
        w = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8, device=device)
        _BIT_WEIGHTS[device] = w
    return w


def packbits(bits: torch.Tensor) -> torch.Tensor:
    """Pack the last dimension of a 0/1 (or bool) tensor MSB-first, zero-padding to whole bytes.

    The torch-only twin of ``np.packbits(bits, axis=-1)``; returns uint8 of shape
    ``(..., ceil(n / 8))``.
    """
    n = bits.shape[-1]
    pad = (-n) % 8
    b = bits.to(torch.uint8)
    if pad:
        b = torch.nn.functional.pad(b, (0, pad))
    b = b.reshape(*b.shape[:-1], -1, 8)
    # Each byte is a dot product with [128, ..., 1]; uint8 arithmetic cannot overflow here.
    return (b * _weights(b.device)).sum(-1, dtype=torch.uint8)


def unpackbits(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Unpack the last dimension MSB-first into 0/1 uint8, keeping the first ``n`` bits."""
    shifts = torch.arange(7, -1, -1, dtype=torch.uint8, device=packed.device)
    bits = (packed.unsqueeze(-1) >> shifts) & 1
    return bits.reshape(*packed.shape[:-1], -1)[..., :n]


def check_padding(rows: torch.Tensor, n: int, codec: str, field: str) -> None:
    """Raise ``ValueError`` unless the padding bits after ``n`` bits of every row are zero.

    ``rows`` is ``(planes, ceil(n / 8))`` uint8 (or 1-D for a single row of bits).
    """
    rem = n % 8
    if rem == 0 or rows.numel() == 0:
        return
    last = rows.reshape(-1, rows.shape[-1])[:, -1]
    mask = (1 << (8 - rem)) - 1
    if use_numpy(last) and not (last.numpy() & mask).any():
        return  # the common case, in numpy's microsecond

    def explain() -> None:
        row = int(torch.nonzero(last & mask)[0, 0])
        raise ValueError(
            f"corrupt {codec} frame: {field} padding bits must be zero, got last byte "
            f"0x{int(last[row].item()):02x} in row {row} with n={n}"
        )

    check_later((last & mask).any(), explain)
