import contextlib
import os
import sys
from pathlib import Path

import pytest
import torch

CUDA = torch.cuda.is_available()
# Without a GPU the Triton kernels run in triton's interpreter on CPU tensors. It must be chosen
# before any kernel is defined, and bitcomm imports its kernels only on first use.
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import bitcomm  # noqa: E402
from bitcomm.codecs import _frame  # noqa: E402

# Awkward sizes from the issue: 0, 1, 7, 8, 9 and 2**k +- 1.
AWKWARD = [0, 1, 7, 8, 9, 15, 16, 17, 63, 65, 255, 257, 1023, 1025, 4095, 4097]

needs_cuda = pytest.mark.skipif(not CUDA, reason="no CUDA device on this machine")
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
needs_interpreter = pytest.mark.skipif(
    not (_frame.has_triton() and INTERPRETED),
    reason="the Triton path runs on CPU tensors only under TRITON_INTERPRET=1 (on a GPU "
           "machine tests/test_cuda.py runs the kernels on CUDA tensors)")
# The paths other than numpy that a codec can take on CPU tensors (triton: in the interpreter).
OTHER_PATHS = ["torch", pytest.param("triton", marks=[needs_interpreter, pytest.mark.triton])]


@contextlib.contextmanager
def forced(path):
    """Run the body on codec path ``path`` ("numpy", "torch" or "triton") for CPU tensors."""
    if path not in _frame.BACKENDS:  # e.g. an entry of OTHER_PATHS, which is a pytest.param
        raise TypeError(f"expected a path in {_frame.BACKENDS}, got {path!r}")
    old = _frame.FORCE
    _frame.FORCE = None if path == "numpy" else path
    try:
        yield
    finally:
        _frame.FORCE = old


VIEWS = frozenset({"empty", "empty_strided", "new_empty", "view", "_unsafe_view", "slice",
                   "select", "detach", "alias", "lift_fresh", "as_strided", "unsqueeze",
                   "expand", "split", "split_with_sizes", "unbind"})
"""Torch operations that make a view or an allocation: no kernel launch on a device."""


@contextlib.contextmanager
def dispatched(paused=lambda: False, counted=frozenset()):
    """Record the torch operations dispatched in the block that launch a kernel on a device.

    Yields the list their names go to, in order: not :data:`VIEWS` (but those in
    ``counted``), and none while ``paused()`` is true (an interpreted kernel's own).
    """
    from torch.utils._python_dispatch import TorchDispatchMode

    names: list[str] = []
    quiet = VIEWS - set(counted)

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.__name__.split(".")[0]
            if name not in quiet and not paused():
                names.append(name)
            return func(*args, **(kwargs or {}))

    with Ops():
        yield names


def ops_on_the_triton_path(fn) -> list[str]:
    """Run fn on the Triton path; return the kernels it launches and the torch ops it
    dispatches that launch one (select too), in order. The interpreter's own torch ops while
    a kernel runs are not fn's, and are left out."""
    from bitcomm.codecs import _kernels

    inside = []
    original = _kernels.launch

    def launch(kernel, *a, **k):
        ops.append(kernel.fn.__name__)
        inside.append(True)
        try:
            original(kernel, *a, **k)
        finally:
            inside.pop()

    with pytest.MonkeyPatch.context() as mp, forced("triton"), \
            dispatched(lambda: bool(inside), counted={"select"}) as ops:
        mp.setattr(_kernels, "launch", launch)
        fn()
    return ops


SCANS = ("cumsum", "cumsum_", "cumprod", "cumprod_", "cummax", "cummin", "logcumsumexp")
"""Torch's scans, as functions of torch and methods of tensors."""


@contextlib.contextmanager
def serial_scans():
    """Record the scans called in the block that a GPU runs row by row: ``(op, shape, dim)``.

    A scan over the whole of a tensor (its numel equals the scanned dimension's size) is one
    device-wide parallel scan on CUDA (cub's). Any other gives each row to one thread (a
    scan over an outer dimension: a walk down the column, one dependent load a step) or to
    one block (the innermost): a scan down the 65536 rows of a ``(65536, 2)`` tensor is
    65536 dependent steps, which fits the milliseconds the exact top-k took on an H200 when
    it scanned its per-tile counts that way. On the CPU the same calls are
    made, so recording them here shows what the GPU path would run. The functions are
    patched, not traced by a dispatch mode, so that ranks run as threads are seen too.
    """
    seen: list[tuple[str, tuple[int, ...], int]] = []
    saved = []
    for owner in (torch, torch.Tensor):
        for name in SCANS:
            original = getattr(owner, name, None)
            if original is None:
                continue

            def spy(t, *a, _original=original, _name=name, **k):
                dim = a[0] if a else k["dim"]
                if t.dim() and t.numel() != t.shape[dim]:
                    seen.append((_name, tuple(t.shape), dim % t.dim()))
                return _original(t, *a, **k)

            saved.append((owner, name, original))
            setattr(owner, name, spy)
    try:
        yield seen
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)


@pytest.fixture(autouse=True)
def _no_layouts_seen():
    """Each test starts with no qsgd header remembered and no flag kept: what a decode
    launches and reads depends on the frames of its length decoded before it in the process,
    and whether a call zeroes a flag on the flags the thread's calls kept before it."""
    from bitcomm.codecs import _frame, qsgd

    qsgd._SEEN = qsgd._Layouts()
    _frame._CLEAN.__dict__.clear()


@pytest.fixture
def launched(monkeypatch):
    """The names of the Triton kernels launched while the test runs, in order (they run)."""
    from bitcomm.codecs import _kernels

    names: list[str] = []
    original = _kernels.launch
    monkeypatch.setattr(_kernels, "launch", lambda kernel, *a, **k: names.append(
        kernel.fn.__name__) or original(kernel, *a, **k))
    return names


@pytest.fixture
def small_sample(monkeypatch):
    """A sampled bound from 4096 scores on, off a sample of 256, with 4 times the room.

    So that the exact top-k's sampled path runs on vectors the interpreter takes in seconds
    (and not the one-program path of vectors that small).
    """
    from bitcomm.codecs import _bracket, _kernels

    monkeypatch.setattr(_kernels, "SMALL_TOP", 0)

    monkeypatch.setattr(_bracket, "SAMPLE", 256)
    monkeypatch.setattr(_bracket, "MIN_N", 4096)
    monkeypatch.setattr(_kernels, "SLACK", 4)


@pytest.fixture(params=["numpy", *OTHER_PATHS])
def path(request):
    """Run a test on the CPU fast path, the torch-only path and the Triton kernels."""
    with forced(request.param):
        yield request.param


def hexbytes(t: torch.Tensor) -> str:
    return " ".join(f"{b:02x}" for b in t.tolist())


def unhex(s: str) -> list[int]:
    return [int(b, 16) for b in s.replace("|", " ").split()]


_SYNCS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")


def host_reads(fn):
    """Run ``fn`` and return the tensor-to-host reads that bitcomm's own code made in it.

    On a CUDA tensor each of these waits for the device; on the CPU they are the same calls, so
    counting them here shows what the GPU path would wait for. The spies are patched in for
    the call only: the test's own patches stay as they are.
    """
    monkeypatch = pytest.MonkeyPatch()
    root = str(Path(bitcomm.__file__).parent)
    seen = []

    def record(name):
        caller = sys._getframe(2).f_code.co_filename
        if caller.startswith(root) and not caller.endswith("_kernels.py"):
            seen.append((name, caller, sys._getframe(2).f_lineno))

    # torch.nonzero's and torch.unique's output sizes depend on the data, so on CUDA they wait
    # for the device too.
    for owner, name in [(torch.Tensor, n) for n in _SYNCS] + [(torch, "nonzero"),
                                                               (torch, "unique")]:
        original = getattr(owner, name)

        def spy(*a, _original=original, _name=name, **k):
            record(_name)
            return _original(*a, **k)

        monkeypatch.setattr(owner, name, spy)
    # So does indexing with a bool mask (x[mask]): its size is the mask's count.
    getitem = torch.Tensor.__getitem__

    def masked(t, index):
        parts = index if isinstance(index, tuple) else (index,)
        if any(isinstance(p, torch.Tensor) and p.dtype == torch.bool and p.dim() for p in parts):
            record("mask")
        return getitem(t, index)

    monkeypatch.setattr(torch.Tensor, "__getitem__", masked)
    # x[mask] = ... waits for the same count; x[idx] = 0 with a Python number makes the number
    # a host tensor that index_put_ copies to the device, a blocking copy.
    setitem = torch.Tensor.__setitem__

    def assigned(t, index, value):
        parts = index if isinstance(index, tuple) else (index,)
        tensors = [p for p in parts if isinstance(p, torch.Tensor) and p.dim()]
        if any(p.dtype == torch.bool for p in tensors):
            record("mask")
        elif tensors and not isinstance(value, torch.Tensor):
            record("host scalar")
        return setitem(t, index, value)

    monkeypatch.setattr(torch.Tensor, "__setitem__", assigned)
    try:
        fn()
    finally:
        monkeypatch.undo()
    return seen
