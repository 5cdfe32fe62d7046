"""The host's work a codec call on the Triton path, timed without a GPU.

Where a GPU's kernels outrun its host, a call takes as long as the host's work before its
last launch: bitcomm's Python, torch's allocations and views, Triton's launch path and its
launcher. This benchmark times that work on any machine: the codecs' Triton path runs on CPU
tensors under a stand-in Triton driver (:func:`stand_in`), whose compiled kernels do nothing
when launched. What a call costs there is its host work up to the launcher; the launcher's
own C, the CUDA driver's time and CUDA's allocator (a CPU tensor's allocation is cheaper) are
not in it, and no kernel runs, so nothing is read back that a kernel would have written.

Each call is timed with the replays of :mod:`bitcomm.codecs._launch` (launch plans and calls
recorded whole: its ``PLANS``) and without them, the anchor, round by round in the same run:
``ratio`` is the first time over the second.

:func:`stand_in` replaces Triton's active driver and its compile step for the whole process,
so the benchmark runs in a process of its own (the CLI command's), under a Triton whose
launches go by key (a release of :data:`bitcomm.codecs._launch.VERIFIED`, not under
``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator

import torch

__all__ = ["Row", "run", "stand_in", "StandInDriver", "StandInKernel", "DEFAULT_SIZES"]

DEFAULT_SIZES = (1 << 20,)


class StandInKernel:
    """A compiled kernel whose launch does nothing but, given a list, append its arguments."""

    function = object()
    packed_metadata = object()

    def __init__(self, launched: list | None):
        self.launched = launched

    def launch_metadata(self, grid, stream, *args):
        """Return what Triton would hand its launch hooks (here its grid, stream, arity)."""
        return ("metadata", grid, stream, len(args))

    def run(self, *args) -> None:
        """Launch: record ``(self, args)`` where a list was given."""
        if self.launched is not None:
            self.launched.append((self, args))


class StandInDriver:
    """A Triton driver of stream 7 on device ``device`` (0), for CPU tensors.

    ``asked``: what launches asked it for, in order ("device", "stream").
    """

    def __init__(self):
        self.device = 0
        self.asked: list[str] = []

    def get_current_device(self) -> int:
        """Return ``device``."""
        self.asked.append("device")
        return self.device

    def get_current_stream(self, device: int) -> int:
        """Return 7."""
        self.asked.append("stream")
        return 7

    def get_current_target(self):
        """Return an sm90 GPU of 32 threads a warp: what the kernels are compiled for."""
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)

    def get_active_torch_device(self) -> torch.device:
        """Return the CPU: the tensors' device."""
        return torch.device("cpu")

    def get_benchmarker(self):
        """None: nothing is timed through the driver."""
        return None

    def get_device_interface(self):
        """torch.cuda, as Triton's CUDA driver answers."""
        return torch.cuda

    def map_python_to_cpp_type(self, t):
        """Return the type itself."""
        return t


def stand_in(launched: list | None = None) -> StandInDriver:
    """Make Triton launch stand-in kernels on CPU tensors for the rest of the process.

    Triton still binds, specialises and caches each launch's arguments as on a GPU; its
    compile step hands out a :class:`StandInKernel` (appending to ``launched`` at each launch,
    where given). Returns the driver, now Triton's active one.
    """
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    active = StandInDriver()
    driver.set_active(active)

    def compiled(self, key, signature, device, *args, **kwargs):
        kernel = StandInKernel(launched)
        self.device_caches[device][0][key] = kernel
        return kernel

    JITFunction._do_compile = compiled
    return active


@dataclasses.dataclass
class Row:
    """One operation's host time a call, with the replays and without (the anchor)."""

    codec: str
    op: str
    n: int
    host_us: float
    anchor_us: float
    ratio: float

    def as_dict(self) -> dict:
        """Return the row as a JSON-friendly dict."""
        return dataclasses.asdict(self)


def _cases(n: int, seed: int) -> Iterator[tuple[str, str, Callable[[], object]]]:
    # The codecs' calls whose host work bounds them on a GPU, on a vector of n float32
    from bitcomm.codecs import _frame, _kernels, qsgd, sign, sparse

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g)
    k = max(1, n // 100)
    _frame.FORCE = "numpy"  # frames to decode, written by the numpy path
    signs, codes = sign.pack(x), qsgd.encode(x, 4, seed=1)
    _frame.FORCE = "triton"
    header = sparse.HEADER.pack(n, k, sparse.FORMATS.index("mean"))
    frame = _frame.empty_aligned_at(sparse.encoded_size(n, k, "mean"), sparse.HEADER.size,
                                    x.device)
    yield "sign", "encode", lambda: sign.pack(x)
    yield "sign", "decode", lambda: sign.unpack(signs, n)
    yield "qsgd-4", "encode", lambda: qsgd.encode(x, 4, seed=1)
    yield "qsgd-4", "decode", lambda: qsgd.decode(codes, n=n)
    yield "topk-1%", "encode", lambda: sparse.encode_top(x, k, check=False)
    # RedSync's selection and frame (its census read back would be a stand-in's garbage)
    yield "redsync-1%", "select", lambda: _kernels.top_frame(x, k, header, "mean", frame,
                                                            side=1, census=True)


def run(sizes: tuple[int, ...] = DEFAULT_SIZES, *, calls: int = 200, rounds: int = 7,
        seed: int = 0, progress: Callable[[Row], None] | None = None) -> list[Row]:
    """Time each case's host work a call at each size; return one :class:`Row` each.

    Each of ``rounds`` rounds times ``calls`` calls with the replays, then ``calls`` without;
    a row keeps each side's fastest round (the least disturbed by the rest of the machine).
    Installs :func:`stand_in` first. ``progress`` gets each row as it is made.
    """
    from bitcomm.codecs import _launch

    if not _launch._DIRECT:
        raise RuntimeError("launches go through Triton's own path here (TRITON_INTERPRET=1, "
                           "BITCOMM_DIRECT_LAUNCH=0 or a Triton release outside "
                           f"{_launch.VERIFIED}): its host work is not bitcomm's to time")
    from bitcomm.codecs import _frame

    stand_in()
    rows = []
    saved = _launch.PLANS, _frame.FORCE
    try:
        for n in sizes:
            for codec, op, call in _cases(n, seed):
                best = {True: float("inf"), False: float("inf")}
                for _ in range(rounds):
                    for plans in (True, False):
                        _launch.PLANS = plans
                        call()  # a plan or call recorded first
                        start = time.perf_counter()
                        for _ in range(calls):
                            call()
                        best[plans] = min(best[plans], (time.perf_counter() - start) / calls)
                row = Row(codec, op, n, best[True] * 1e6, best[False] * 1e6,
                          best[True] / best[False])
                rows.append(row)
                if progress is not None:
                    progress(row)
    finally:
        _launch.PLANS, _frame.FORCE = saved
    return rows

