"""Where a codec call's time goes: its kernels' device time, its host time, the gap between.

``bench codecs`` times a call from a CUDA event before it to one after it. That time holds the
Python work before each launch, the launches, every kernel, and any wait for a check read on
the host, during which the GPU idles. This profile splits one call of each codec operation
(the cases of :mod:`bitcomm.bench.codecs`) into:

* ``wall``: the call from its start to the end of its last kernel (host clock, synchronised);
* ``host``: the call until it returns to the caller (a call that reads a device value waits
  for the device inside, so its host time nears its wall time);
* ``device``: the sum of its kernels' times as ``torch.profiler`` records them (CUDA kernels,
  copies and fills on a GPU; on a CPU the torch operators' own times), and ``launches``, how
  many there were.

``wall - device`` is the time the device spent idle in the call: launch-bound where it is as
large as ``device``. Each kernel gets a row of its own (its launches and device time a call),
so a slow row of ``bench codecs`` names the kernel to look at. The profiler adds its own
overhead to the host side, so ``host`` and ``wall`` come from calls run without it.

Where the host decides (``host`` near ``wall``), ``host_functions`` adds the functions the
host spent the most of its own time in, from ``cProfile`` over further calls: each a row named
``host: FUNCTION (FILE:LINE)`` with its calls a codec call and its own microseconds a call (a
C function's, such as Triton's compiled launcher or a torch operator's binding, is the time
inside it; a Python function's excludes what it calls). cProfile's own cost falls on the
Python functions, so their times are high by about a microsecond a call each.

It is a GPU tool: on a CPU the "kernels" are torch's operators timed under the profiler, its
overhead included, and the numpy work of the numpy path is in none of them.
"""

from __future__ import annotations

import contextlib
import cProfile
import dataclasses
import os
import statistics
import time
from collections.abc import Callable, Iterable, Iterator

import torch

from bitcomm.bench.codecs import _cases, vector

__all__ = ["Row", "run", "CALL", "HOST", "DEFAULT_SIZES", "SETTABLE", "check_settings",
           "applied"]

SETTABLE = {"CANDIDATE_TILES": 1, "SMALL_TOP": 0, "SLACK": 1, "COUNT_PROGRAMS": 1,
            "LOCAL_ROOM": 0, "COUNT_STAGES": 1}
"""Constants of :mod:`bitcomm.codecs._kernels` a run may set (``settings``), each to an int of
at least the value given here: each changes how many programs or passes a selection takes,
or how many tiles' loads one keeps in flight, never its result (the tests run the kernels at
these bounds), so a profile can compare them on one GPU, where ``bench tune``'s whole-call
times would not see device time that the host's launches hide."""

DEFAULT_SIZES = (64 << 20,)
CALL = "(call)"
"""The ``name`` of each operation's summary row (its kernels' rows follow it)."""
HOST = "host: "
"""The start of the ``name`` of a host function's row (after the kernels' rows)."""


@dataclasses.dataclass
class Row:
    """One operation's summary (``name == CALL``) or one of its kernels, per call."""

    codec: str
    op: str
    n: int
    name: str
    launches: float
    device_us: float
    host_us: float = float("nan")
    wall_us: float = float("nan")

    def as_dict(self) -> dict:
        """Return the row as a JSON-friendly dict."""
        return dataclasses.asdict(self)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _clocked(fn: Callable[[], object], calls: int, device: torch.device
             ) -> tuple[float, float]:
    # median seconds until the call returns, and until its device work is done
    host, wall = [], []
    for _ in range(calls):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        host.append(time.perf_counter() - t0)
        _sync(device)
        wall.append(time.perf_counter() - t0)
    return statistics.median(host), statistics.median(wall)


def _device_times(fn: Callable[[], object], calls: int, device: torch.device
                  ) -> dict[str, tuple[int, float]]:
    # kernel (or, on a CPU, operator) name -> (launches, self microseconds) over `calls` calls
    cuda = device.type == "cuda"
    activities = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(calls):
            fn()
        _sync(device)
    kind = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
    out = {}
    for evt in prof.key_averages():
        if evt.device_type != kind:
            continue
        if cuda:
            us = getattr(evt, "self_device_time_total", None)
            if us is None:  # torch before 2.4
                us = evt.self_cuda_time_total
        else:
            us = evt.self_cpu_time_total
        out[evt.key] = (int(evt.count), float(us))
    return out


def _host_times(fn: Callable[[], object], calls: int, device: torch.device
                ) -> dict[str, tuple[int, float]]:
    # host function -> (calls, own seconds) over `calls` calls, from cProfile
    prof = cProfile.Profile()
    prof.enable()
    try:
        for _ in range(calls):
            fn()
    finally:
        prof.disable()
    _sync(device)
    # Summed by name: distinct functions may share one (each Triton kernel's launcher is a
    # `__triton_launcher.launch` of its own), which pstats' table keeps only one of.
    out: dict[str, tuple[int, float]] = {}
    for entry in prof.getstats():
        code = entry.code
        if isinstance(code, str):  # a C function, by cProfile's name for it
            if code.startswith("<method 'disable' of '_lsprof.Profiler"):  # the switch off
                continue
            where = code
        else:
            path = os.path.join(*code.co_filename.split(os.sep)[-2:])
            where = f"{code.co_name} ({path}:{code.co_firstlineno})"
        count, own = out.get(where, (0, 0.0))
        out[where] = (count + entry.callcount, own + entry.inlinetime)
    return out


def run(sizes: Iterable[int] = DEFAULT_SIZES, device: str | torch.device = "cpu",
        codecs: Iterable[str] | None = None, calls: int = 5, seed: int = 0,
        progress: Callable[[Row], None] | None = None,
        settings: dict[str, int] | None = None, host_functions: int = 0) -> list[Row]:
    """Profile each codec operation at each size; return its summary row, then its kernels'.

    Args:
        sizes: element counts of the float32 test vector.
        device: ``"cpu"`` or a CUDA device.
        codecs: the names of :mod:`bitcomm.bench.codecs`' cases to profile (all by default);
            an unknown name is a ``ValueError``.
        calls: calls per measurement (medians of the host clocks, sums of the profile / calls).
        seed: seed of the test data.
        progress: called with each row as soon as it is measured.
        settings: :data:`SETTABLE` constants and their values for the run (the module's
            values are put back after it); a name not there, or a value below its bound, is a
            ``ValueError`` before any work.
        host_functions: how many host functions' rows to add after each operation's kernels,
            those with the most own time first (0: none).

    """
    device = torch.device(device)
    wanted = None if codecs is None else list(codecs)
    if isinstance(calls, bool) or not isinstance(calls, int) or calls < 1:
        raise ValueError(f"expected calls to be an int >= 1, got {calls!r}")
    if (isinstance(host_functions, bool) or not isinstance(host_functions, int)
            or host_functions < 0):
        raise ValueError(f"expected host_functions to be an int >= 0, got {host_functions!r}")
    settings = check_settings(settings)
    if wanted is not None:  # refused before any vector is made
        known = [c[0] for c in _cases(torch.zeros(8), 8, seed)]
        unknown = sorted(set(wanted) - set(known))
        if unknown:
            raise ValueError(f"unknown codec(s) {unknown}; expected some of {known}")
    rows = []
    with applied(settings):
        for row in _profiled(sizes, device, wanted, calls, seed, host_functions):
            rows.append(row)
            if progress is not None:
                progress(row)
    return rows


def check_settings(settings: dict[str, int] | None) -> dict[str, int]:
    """Return ``settings`` as a dict, each a :data:`SETTABLE` name with an int in its bound.

    Else a ``ValueError`` naming the setting.
    """
    settings = dict(settings or {})
    for name, value in settings.items():
        if name not in SETTABLE:
            raise ValueError(f"unknown setting {name!r}; expected one of {sorted(SETTABLE)}")
        if isinstance(value, bool) or not isinstance(value, int) or value < SETTABLE[name]:
            raise ValueError(f"expected {name} to be an int >= {SETTABLE[name]}, got {value!r}")
    return settings


@contextlib.contextmanager
def applied(settings: dict[str, int]) -> Iterator[None]:
    """Set :data:`SETTABLE` constants of :mod:`bitcomm.codecs._kernels` for the block.

    Each back to its value at the end. ``settings`` as :func:`check_settings` returns them.
    """
    if not settings:
        yield
        return
    from bitcomm.codecs import _kernels

    kept = {name: getattr(_kernels, name) for name in settings}
    try:
        for name, value in settings.items():
            setattr(_kernels, name, value)
        yield
    finally:
        for name, value in kept.items():
            setattr(_kernels, name, value)


def _profiled(sizes: Iterable[int], device: torch.device, wanted: list[str] | None,
              calls: int, seed: int, host_functions: int) -> Iterator[Row]:
    for n in sizes:
        x = vector(n, seed, device)
        for codec, enc, dec, _ in _cases(x, n, seed):
            if wanted is not None and codec not in wanted:
                continue
            frame = enc()
            for op, fn in (("encode", enc), ("decode", lambda d=dec, f=frame: d(f))):
                fn()  # warm-up: compilation, caches, the allocator's blocks
                _sync(device)
                host, wall = _clocked(fn, calls, device)
                kernels = _device_times(fn, calls, device)
                yield Row(codec, op, n, CALL, sum(c for c, _ in kernels.values()) / calls,
                          sum(us for _, us in kernels.values()) / calls, host * 1e6, wall * 1e6)
                for name, (count, us) in sorted(kernels.items(), key=lambda kv: -kv[1][1]):
                    yield Row(codec, op, n, name, count / calls, us / calls)
                if host_functions:
                    spent = _host_times(fn, calls, device)
                    for name, (count, own) in sorted(spent.items(),
                                                     key=lambda kv: -kv[1][1])[:host_functions]:
                        yield Row(codec, op, n, HOST + name, count / calls, float("nan"),
                                  own / calls * 1e6)
