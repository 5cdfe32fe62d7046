"""Launching the codecs' Triton kernels with less of the host's time a launch.

``kernel[grid](*args)`` runs Triton's ``JITFunction.run`` on every call: it types and
specialises each argument, builds and hashes a cache key from the list, reads its knobs and
looks the compiled kernel up. With a stand-in driver on a 2-core VM (whose Python ran a sign
encode's host work in the 30 us the lent H200's host took) that is 10-17 us a launch, some 40%
of a one-launch codec's host time and about 130 us of a top-k's nine launches; on a GPU whose
kernels outrun the host, the device waits for it.

:func:`launch` keeps the compiled kernel that such a launch returned under a key of what
Triton's specialisation reads from the arguments, and launches it directly the next time the
key recurs, with the arguments and stream Triton's own launch would pass, and its hooks
where any are set (Triton passes its hook chains even when empty, which the launcher then
calls for nothing, with metadata made for them; ``tests/test_launch.py`` holds the two
launches equal, call for call, under the Triton releases it verifies). Triton specialises an
argument on its type alone, and further:

- a tensor on its dtype and whether its address is a multiple of 16 bytes;
- an int on its width (int32, int64 or uint64 by its value), and, unless the kernel leaves it
  unspecialised, on whether it is 1 (then a compile-time constant) or a multiple of 16;
- a keyword argument (a ``tl.constexpr`` or a compile option) on its value.

The key holds each of those (ints a little finer: int32, uint32, int64 or uint64, each with
both tests), so two launches with one key get one compiled kernel; a key never seen goes
through ``kernel[grid]``, which compiles or finds the kernel as usual. Triton's knobs that
enter its compile options (``debug``, instrumentation) are taken as they were when a key was
first launched; the launch hooks (profilers') are read at every launch. Only releases whose
specialisation is known to be that one take this path (:data:`VERIFIED`); others, the
interpreter (``TRITON_INTERPRET=1``), and arguments of other types always go through
``kernel[grid]``; so does every launch where the environment has ``BITCOMM_DIRECT_LAUNCH=0``
when bitcomm's kernels are first imported: a way back to Triton's own launch, to tell whether
a wrong result comes from this path, without a change to the code.

A caller whose launches follow from a few of its inputs goes further: :func:`planned` replays
the launches recorded under a key of those, and a call that made only allocations, views and
launches is recorded whole, for :func:`replay` to make again from the new inputs' addresses
and the values of any scalars the kernels leave unspecialised (a top-k from a sampled bound:
nine launches in 12-14 us of a 2-core VM's host, 70-76 without the replays; qsgd's encoder,
its stream key given, and its decoder: ``bitcomm bench host``).
"""

from __future__ import annotations

import math
import os
import threading

import torch
import triton
from torch.utils._python_dispatch import TorchDispatchMode
from triton.runtime import driver

try:  # triton 3.4 and newer; the direct launch is taken only under VERIFIED releases
    from triton import knobs
    from triton.knobs import HookChain
except ImportError:
    knobs = HookChain = None

__all__ = ["launch", "planned", "replay", "replayed", "replays", "MISSED", "VERIFIED", "LIMIT",
           "PLANS"]

VERIFIED = ("3.6.", "3.9.")
"""Triton releases whose argument specialisation ``tests/test_launch.py`` checked against this
module's key: the GPU image's (3.6) and the dev extra's (3.9)."""

LIMIT = 4096
"""Compiled kernels kept by key; past it the table starts again (a key never seen costs one
launch through Triton's own path)."""

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
_INTERPRETER_LOCK = threading.Lock()
_DIRECT = (knobs is not None and not _INTERPRETED and triton.__version__.startswith(VERIFIED)
           and os.environ.get("BITCOMM_DIRECT_LAUNCH") != "0")
_KERNELS: dict[tuple, tuple] = {}

PLANS = os.environ.get("BITCOMM_PLANS") != "0"
"""Whether :func:`planned` and :func:`replay` replay recorded launches and calls (False: every
launch goes by key; ``BITCOMM_PLANS=0`` in the environment when bitcomm's kernels are first
imported, to time a call's host work without them or to tell whether a wrong result comes
from a replay)."""

_PLANS: dict[tuple, tuple[int, list]] = {}  # key: (the device, the steps)
_CALLS: dict[tuple, _Call] = {}  # key: a call recorded whole (planned with inputs)
_LOCAL = threading.local()  # the plan of this thread's innermost `with planned(...)`

MISSED = object()
"""What :func:`replay` returns where it has no call to replay: the caller runs its own."""

# the torch ops that allocate; any op but those and views makes a call not replayable whole
_ALLOCATIONS = frozenset([torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default])


class _Call:
    # A call recorded whole: the device index its launches went to, the device of its
    # inputs, its allocations (shape, dtype) in order and their addresses modulo 16 (a view
    # at a recorded offset keeps its alignment only from an allocation aligned alike: a
    # frame's aligned payload), each launch as (the compiled kernel's launcher, grid,
    # function, metadata, its parameters' values with None for each pointer and scalar, the
    # pointers as (parameter, source, byte offset), the scalars as (parameter, name)), where
    # a source is an input's index or len(inputs) plus an allocation's, and its result
    # (_described).
    __slots__ = ("device", "where", "made", "aligned", "steps", "result")

    def __init__(self, device: int, where: torch.device, made: list, aligned: list,
                 steps: list, result):
        self.device, self.where, self.made, self.aligned = device, where, made, aligned
        self.steps, self.result = steps, result


class _Watch(TorchDispatchMode):
    # The torch ops of a call being recorded whole: the tensors it allocates, in order, and
    # whether it ran any op but an allocation or a view (a kernel of torch's, or a read of
    # the device, which a replay of its launches alone would miss).
    def __init__(self):
        super().__init__()
        self.made: list[torch.Tensor] = []
        self.other = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in _ALLOCATIONS:
            self.made.append(out)
        elif not func.is_view:
            self.other = True
        return out


class _Plan:
    # One `with planned(key)`: the steps it replays (from an earlier run under key) or records
    # (each launch's compiled kernel, parameters after the given ones, kernel and keywords),
    # the device they were launched on (taken from the first launch: making a plan asks the
    # driver nothing), the stream a replay launches on (asked for at its first launch), how
    # many it has taken, and the plan it is nested in.
    # With `inputs` (a call to record whole), also the names of its scalars, the watch of
    # its torch ops, each launch's step of a _Call (None once one cannot be), and its
    # result's description.
    __slots__ = ("key", "steps", "at", "recorded", "replay", "broken", "device", "stream",
                 "outer", "inputs", "scalars", "watch", "whole", "result")

    def __init__(self, key: tuple, entry: tuple[int, list] | None,
                 inputs: tuple[torch.Tensor, ...] | None = None, scalars: tuple[str, ...] = ()):
        self.key, self.outer = key, None
        self.recorded = self.replay = entry is not None
        self.device, self.steps = entry if self.recorded else (None, [])
        self.at = 0
        self.broken = False
        self.stream = None
        self.inputs, self.scalars = inputs, scalars
        self.watch = None if inputs is None else _Watch()
        self.whole: list | None = [] if inputs is not None else None
        self.result = None

    def __enter__(self) -> _Plan:
        self.outer = getattr(_LOCAL, "plan", None)
        _LOCAL.plan = self
        if self.watch is not None:
            self.watch.__enter__()
        return self

    def __exit__(self, kind, value, tb) -> None:
        _LOCAL.plan = self.outer
        if self.watch is not None:
            self.watch.__exit__(kind, value, tb)
            # every scalar a replay is given must be one a launch takes
            taken = {name for step in self.whole or () for _, name in step[6]}
            if (kind is None and not self.broken and not self.watch.other and self.whole
                    and self.result is not None and taken == set(self.scalars)):
                if len(_CALLS) >= LIMIT:
                    _CALLS.clear()
                where = self.inputs[0].device
                made = [(tuple(t.shape), t.dtype) for t in self.watch.made]
                aligned = [t.data_ptr() % 16 for t in self.watch.made]
                _CALLS[self.key] = _Call(self.device, where, made, aligned, self.whole,
                                         self.result)
            self.watch = None  # its allocations go with it
        if self.recorded:
            if self.broken or self.at != len(self.steps):  # another sequence: record anew
                _PLANS.pop(self.key, None)
        elif not self.broken and kind is None and self.steps:
            if len(_PLANS) >= LIMIT:
                _PLANS.clear()
            _PLANS[self.key] = (self.device, self.steps)

    def returns(self, result) -> None:
        """Keep where the call's ``result`` lies (a call recorded whole returns it again)."""
        if self.watch is not None:
            self.result = _described(result, self.inputs + tuple(self.watch.made))


class _Unplanned:
    # planned() where launches do not go by key
    def __enter__(self) -> _Unplanned:
        return self

    def __exit__(self, kind, value, tb) -> None:
        return None

    def returns(self, result) -> None:
        return None


_UNPLANNED = _Unplanned()


def replays() -> bool:
    """Return whether launches and calls recorded under a key replay here (:func:`planned`).

    Where they do not, a caller need not build its key.
    """
    return _DIRECT and PLANS


def planned(key: tuple, inputs: tuple[torch.Tensor, ...] | None = None,
            scalars: tuple[str, ...] = ()):
    """Return a context in which this thread's launches follow the plan recorded under ``key``.

    For a caller whose launches are fixed by a few of its inputs (a top-k's by the vector's
    length, dtype and 16-byte alignment, ``k``, the side and its module's settings: its
    buffers are fresh allocations and views of them at fixed offsets, and nothing is read
    back from the device), ``key`` holds those inputs. The first run under a key records
    each launch's compiled kernel; later runs launch the recorded kernels in order, without
    :func:`launch`'s key of each launch's arguments (a few microseconds each on a 2-core
    VM's host, more on a GPU machine's), and on the device and stream its first launch found
    (a caller's launches under one key are one call, which switches neither; asking the
    driver is a microsecond or two a launch). A launch of another kernel, with other keywords
    than recorded (a setting the key missed), or a first launch on another device, ends the
    replay: it and the rest go by key, and the plan is recorded again next time. A no-op where
    launches do not go by key.

    With ``inputs`` (the call's tensor arguments), the call is also recorded whole, for
    :func:`replay` to make again without running the caller's Python: the context's
    ``returns(result)`` says what the call returns. It is recorded where its torch ops were
    only allocations and views (no kernel of torch's, no read of the device), every tensor a
    launch took lay in an input or in one of those allocations, and ``result`` does too (or
    is None, or a tuple of those). ``scalars``: names of kernel parameters whose values a
    replay is given (``replay``'s ``scalars``), each one a launch takes as a positional
    argument and the kernel leaves unspecialised (``do_not_specialize``: any value takes the
    compiled kernel), else the call is not recorded whole; every other argument's value is
    taken as the key fixes it.
    """
    if not replays():
        return _UNPLANNED
    entry = _PLANS.get(key)
    # a call is watched while its launches are first recorded, not at every replay
    return _Plan(key, entry, inputs if entry is None and key not in _CALLS else None, scalars)


def replay(key: tuple, inputs: tuple[torch.Tensor, ...], scalars: dict | None = None):
    """Make the call recorded whole under ``key`` again on ``inputs``; else return MISSED.

    Its allocations are made again (the shapes and dtypes recorded), and each launch of the
    recorded call goes to the compiled kernel's launcher directly, its pointers the same
    offsets into the inputs and the new allocations: no Python of the caller's, no tensor
    views, no key a launch, and addresses the launcher takes as they are (a tensor costs it
    a call of ``data_ptr`` and a query of the driver). The result is rebuilt where it lay.
    MISSED too where a new allocation's address lies otherwise modulo 16 than its record's
    (no allocator of torch's does that: views at the recorded offsets would be misaligned).
    ``key`` must hold whatever fixes the call's launches beyond the inputs' addresses
    (sizes, dtypes, the inputs' 16-byte alignment, settings), as for :func:`planned`. Not
    with Triton's launch hooks set (a profiler's, which read the tensors): MISSED.
    ``scalars``: the values of the parameters named in :func:`planned`'s ``scalars``, by name.
    """
    call = _CALLS.get(key) if PLANS else None
    if call is None or _hooks() != (None, None):
        return MISSED
    active = driver.active
    device = active.get_current_device()
    if device != call.device:
        return MISSED
    stream = active.get_current_stream(device)
    made = [torch.empty(shape, dtype=dtype, device=call.where) for shape, dtype in call.made]
    owned = [t.data_ptr() for t in made]
    if [at % 16 for at in owned] != call.aligned:  # CUDA's allocator aligns to 512 bytes
        return MISSED
    bases = [t.data_ptr() for t in inputs] + owned
    for run, grid, function, metadata, values, pointers, named in call.steps:
        full = list(values)
        for at, source, offset in pointers:
            full[at] = bases[source] + offset
        for at, name in named:
            full[at] = scalars[name]
        run(grid[0], grid[1], grid[2], stream, function, metadata, None, None, None, *full)
    return _rebuilt(call.result, inputs, made)


def replayed(key: tuple, inputs: tuple[torch.Tensor, ...], call, scalars: dict | None = None,
             whole: bool = True):
    """Return ``call()``'s result, made again by :func:`replay` where one was recorded whole.

    Otherwise ``call()`` runs under :func:`planned` for the next call under ``key``, and with
    ``whole`` is recorded whole where it qualifies. ``scalars``: the values a replay is
    given, by parameter name, as for :func:`replay`.
    """
    got = replay(key, inputs, scalars)
    if got is not MISSED:
        return got
    with planned(key, inputs if whole else None, tuple(scalars or ())) as recording:
        got = call()
        recording.returns(got)
    return got


def _located(t: torch.Tensor, sources: tuple[torch.Tensor, ...]) -> tuple[int, int] | None:
    # (source, byte offset) of a contiguous tensor lying within one of `sources`, or None
    if not t.is_contiguous():
        return None
    at = t.data_ptr()
    end = at + t.numel() * t.element_size()
    for i, source in enumerate(sources):
        base = source.data_ptr()
        if base <= at and end <= base + source.numel() * source.element_size():
            return i, at - base
    return None


def _described(result, sources: tuple[torch.Tensor, ...]):
    # Where `result` lies, for _rebuilt: None; a tensor as (source, element offset, dtype,
    # shape), a source itself as its index; a tuple of those. None if it does not lie in
    # the sources.
    if result is None:
        return ("none",)
    if isinstance(result, tuple):
        parts = [_described(r, sources) for r in result]
        return None if None in parts else ("tuple", parts)
    if not isinstance(result, torch.Tensor):
        return None
    for i, source in enumerate(sources):
        if result is source:
            return ("source", i)
    place = _located(result, sources)
    if place is None or place[1] % result.element_size():
        return None
    source, offset = place
    whole = sources[source]
    if (offset == 0 and whole.dtype == result.dtype and whole.shape == result.shape
            and whole.is_contiguous()):
        return ("source", source)  # the source itself, as a view or as the op's own result
    if whole.numel() * whole.element_size() % result.element_size():
        return None
    return ("view", source, offset // result.element_size(), result.dtype,
            tuple(result.shape))


def _rebuilt(described, inputs: tuple[torch.Tensor, ...], made: list[torch.Tensor]):
    # The result _described gave, from this call's inputs and allocations
    kind = described[0]
    if kind == "none":
        return None
    if kind == "tuple":
        return tuple(_rebuilt(part, inputs, made) for part in described[1])
    source = described[1]
    t = inputs[source] if source < len(inputs) else made[source - len(inputs)]
    if kind == "source":
        return t
    _, _, offset, dtype, shape = described
    flat = t if t.dim() == 1 else t.view(-1)
    flat = flat if t.dtype == dtype else flat.view(dtype)
    if len(shape) == 1:  # a frame: one view, not two
        return flat[offset : offset + shape[0]]
    return flat[offset : offset + math.prod(shape)].view(shape)


def launch(kernel, grid: tuple[int, ...], *args, **kwargs) -> None:
    """Launch ``kernel`` on ``grid`` with ``args`` and ``kwargs`` as ``kernel[grid]`` would.

    Under ``TRITON_INTERPRET=1`` launches are serialised: the interpreter swaps the language's
    functions for numpy ones while a kernel runs, so two threads (ranks of ``run_local``) must
    not interpret at once. Compiled launches need no lock.
    """
    if _INTERPRETED:
        with _INTERPRETER_LOCK:
            kernel[grid](*args, **kwargs)
        return
    if not _DIRECT:
        kernel[grid](*args, **kwargs)
        return
    plan = getattr(_LOCAL, "plan", None)
    if plan is not None and plan.replay:
        at = plan.at
        if at < len(plan.steps):
            compiled, tail, recorded, keywords = plan.steps[at]
            if recorded is kernel and keywords == kwargs:
                stream = plan.stream
                if stream is None:  # the replay's first launch
                    active = driver.active
                    device = active.get_current_device()
                    if device == plan.device:
                        stream = plan.stream = active.get_current_stream(device)
                if stream is not None:
                    plan.at = at + 1
                    _run(compiled, grid, args + tail, stream)
                    return
        plan.replay, plan.broken = False, True
    active = driver.active
    device = active.get_current_device()
    key = _key(kernel, device, args, kwargs)
    try:
        known = None if key is None else _KERNELS.get(key)
    except TypeError:  # an unhashable keyword value
        key = known = None
    if known is None:
        compiled = kernel[grid](*args, **kwargs)
        if key is not None and compiled is not None and not hasattr(compiled, "result"):
            if len(_KERNELS) >= LIMIT:
                _KERNELS.clear()
            known = _KERNELS[key] = (compiled, _tail(kernel, len(args), kwargs), kernel)
        if plan is not None and not plan.broken:
            _record(plan, known, kwargs, device, grid, args)
        return
    if plan is not None and not plan.broken:
        _record(plan, known, kwargs, device, grid, args)
    compiled, tail, _ = known
    _run(compiled, grid, args + tail, active.get_current_stream(device))


def _record(plan: _Plan, known: tuple | None, kwargs: dict, device: int,
            grid: tuple[int, ...], args: tuple) -> None:
    # A recording plan's next step, or its end where the launch had no key or went to
    # another device than the plan's first launch; for a call recorded whole, the launch's
    # step of its _Call too, unless a tensor it takes lies outside the call's inputs and
    # allocations
    if plan.device is None:
        plan.device = device
    if known is None or device != plan.device:
        plan.broken = True
        return
    plan.steps.append((*known, dict(kwargs)))
    if plan.whole is None:
        return
    compiled, tail, kernel = known
    sources = plan.inputs + tuple(plan.watch.made)
    values, pointers, named = list(args + tail), [], []
    for at, value in enumerate(values):
        if isinstance(value, torch.Tensor):
            place = _located(value, sources)
            if place is None:
                plan.whole = None
                return
            pointers.append((at, *place))
            values[at] = None
        elif at < len(args) and kernel.params[at].name in plan.scalars:
            if not kernel.params[at].do_not_specialize:  # its value may pick another kernel
                plan.whole = None
                return
            named.append((at, kernel.params[at].name))
            values[at] = None
    grid = (grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1)
    plan.whole.append((compiled.run, grid, compiled.function, compiled.packed_metadata,
                       tuple(values), tuple(pointers), tuple(named)))


def _run(compiled, grid: tuple[int, ...], full: tuple, stream: int) -> None:
    # Launch a compiled kernel with every parameter's value (`full`) as Triton's launch does.
    grid_1 = grid[1] if len(grid) > 1 else 1
    grid_2 = grid[2] if len(grid) > 2 else 1
    enter, leave = _hooks()
    # the launch metadata is read by the hooks alone, so it is only made for them: a call
    # and a dict less a launch
    metadata = (None if enter is None and leave is None
                else compiled.launch_metadata(grid, stream, *full))
    compiled.run(grid[0], grid_1, grid_2, stream, compiled.function, compiled.packed_metadata,
                 metadata, enter, leave, *full)


def _hooks() -> tuple:
    # Triton's launch enter and exit hooks, each None where it is a chain with no hook in it:
    # the launcher calls a hook that is not None (a Python call each launch, which an empty
    # chain spends on nothing), and Triton makes the launch metadata for it
    enter, leave = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
    if isinstance(enter, HookChain) and not enter.calls:
        enter = None
    if isinstance(leave, HookChain) and not leave.calls:
        leave = None
    return enter, leave


def _key(kernel, device: int, args: tuple, kwargs: dict) -> tuple | None:
    # What Triton's specialisation reads from the arguments (the module docstring), or None
    # where an argument is of a type it is not known for, or where hooks run before each launch
    # (Triton's own launch runs them). A tensor adds its dtype and whether its address is a
    # multiple of 16; an int one code (its width, and whether it is 1 or a multiple of 16);
    # any other argument its class. The dtypes and classes mark where each argument's entries
    # start, so two lists of arguments of other kinds never give one key. Keywords add their
    # values and classes (True == 1 as a dict key). The kernel by id: module-level kernels live
    # as long as the process, and each entry holds its kernel.
    if getattr(kernel, "pre_run_hooks", True):  # hooks, or no JITFunction
        return None
    parts = [id(kernel), device]
    add = parts.append
    for a in args:
        cls = a.__class__
        if cls is int:
            if -0x80000000 <= a <= 0x7FFFFFFF:
                width = 0
            elif 0 <= a <= 0xFFFFFFFF:
                width = 3
            elif -0x8000000000000000 <= a <= 0x7FFFFFFFFFFFFFFF:
                width = 6
            else:
                width = 9
            add(width + (0 if a == 1 else 1 if a % 16 == 0 else 2))
        elif cls is torch.Tensor or isinstance(a, torch.Tensor):
            add(a.dtype)
            add(a.data_ptr() % 16 == 0)
        elif cls is bool or cls is float or a is None:
            add(cls)
        else:
            return None
    add(tuple(kwargs.items()))
    add(tuple(map(type, kwargs.values())))
    return tuple(parts)


def _tail(kernel, given: int, kwargs: dict) -> tuple:
    # The values of the kernel's parameters after the `given` positional ones, in order: a
    # keyword argument's, else the parameter's default (Triton launches with every one).
    tail = []
    for param in kernel.params[given:]:
        name = param.name
        if name in kwargs:
            tail.append(kwargs[name])
        else:
            tail.append(param.default)
    return tuple(tail)
