"""Launching the codecs' Triton kernels with less of the host's time a launch.

``kernel[grid](*args)`` runs Triton's ``JITFunction.run`` on every call: it types and
specialises each argument, builds and hashes a cache key from the list, reads its knobs and
looks the compiled kernel up. With a stand-in driver on a 2-core VM (whose Python ran a sign
encode's host work in the 30 us the lent H200's host took) that is 10-17 us a launch, some 40%
of a one-launch codec's host time and about 130 us of a top-k's nine launches; on a GPU whose
kernels outrun the host, the device waits for it.

:func:`launch` keeps the compiled kernel that such a launch returned under a key of what
Triton's specialisation reads from the arguments, and launches it directly the next time the
key recurs, with the arguments, stream, metadata and hooks Triton's own launch would pass
(``tests/test_launch.py`` holds the two launches equal, call for call, under the Triton
releases it verifies). Triton specialises an argument on its type alone, and further:

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
"""

from __future__ import annotations

import contextlib
import os
import threading

import torch
import triton
from triton.runtime import driver

try:  # triton 3.4 and newer; the direct launch is taken only under VERIFIED releases
    from triton import knobs
except ImportError:
    knobs = None

__all__ = ["launch", "planned", "VERIFIED", "LIMIT", "PLANS"]

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

PLANS = True
"""Whether :func:`planned` replays recorded launches (False: every launch goes by key)."""

_PLANS: dict[tuple, tuple[int, list]] = {}  # key: (the device, the steps)
_LOCAL = threading.local()  # the plan of this thread's innermost `with planned(...)`


class _Plan:
    # One `with planned(key)`: the steps it replays (from an earlier run under key) or records
    # (each launch's compiled kernel, parameters after the given ones, kernel and keywords),
    # the device they were launched on (taken from the first launch: making a plan asks the
    # driver nothing), the stream a replay launches on (asked for at its first launch), how
    # many it has taken, and the plan it is nested in.
    __slots__ = ("key", "steps", "at", "recorded", "replay", "broken", "device", "stream",
                 "outer")

    def __init__(self, key: tuple, entry: tuple[int, list] | None):
        self.key, self.outer = key, None
        self.recorded = self.replay = entry is not None
        self.device, self.steps = entry if self.recorded else (None, [])
        self.at = 0
        self.broken = False
        self.stream = None

    def __enter__(self) -> None:
        self.outer = getattr(_LOCAL, "plan", None)
        _LOCAL.plan = self

    def __exit__(self, kind, value, tb) -> None:
        _LOCAL.plan = self.outer
        if self.recorded:
            if self.broken or self.at != len(self.steps):  # another sequence: record anew
                _PLANS.pop(self.key, None)
        elif not self.broken and kind is None and self.steps:
            if len(_PLANS) >= LIMIT:
                _PLANS.clear()
            _PLANS[self.key] = (self.device, self.steps)


_UNPLANNED = contextlib.nullcontext()  # planned() where launches do not go by key


def planned(key: tuple):
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
    """
    if not (_DIRECT and PLANS):
        return _UNPLANNED
    return _Plan(key, _PLANS.get(key))


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
            _record(plan, known, kwargs, device)
        return
    if plan is not None and not plan.broken:
        _record(plan, known, kwargs, device)
    compiled, tail, _ = known
    _run(compiled, grid, args + tail, active.get_current_stream(device))


def _record(plan: _Plan, known: tuple | None, kwargs: dict, device: int) -> None:
    # A recording plan's next step, or its end where the launch had no key or went to
    # another device than the plan's first launch
    if plan.device is None:
        plan.device = device
    if known is None or device != plan.device:
        plan.broken = True
    else:
        plan.steps.append((*known, dict(kwargs)))


def _run(compiled, grid: tuple[int, ...], full: tuple, stream: int) -> None:
    # Launch a compiled kernel with every parameter's value (`full`) as Triton's launch does.
    grid_1 = grid[1] if len(grid) > 1 else 1
    grid_2 = grid[2] if len(grid) > 2 else 1
    enter = knobs.runtime.launch_enter_hook
    # the launch metadata is None without an enter hook (CompiledKernel.launch_metadata's
    # first test), so it is only asked for with one: a call and the arguments' unpacking less
    compiled.run(grid[0], grid_1, grid_2, stream, compiled.function, compiled.packed_metadata,
                 None if enter is None else compiled.launch_metadata(grid, stream, *full),
                 enter, knobs.runtime.launch_exit_hook, *full)


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
