"""Codec throughput benchmark: encode/decode GB/s of fp32 input, as ratios to anchors.

Every codec is timed on the same float32 vector (integer codecs on counts of the same length),
and in the same run a few anchors that say what the machine can do. On the CPU they are
``np.packbits(x < 0)`` (encode), ``np.unpackbits(b).astype(np.float32) * 2 - 1`` (decode) and
``x.copy()``. On a GPU (``device="cuda"``) they are the HBM read speed, ``torch.sum(x)`` (the
limit for anything that reads x once), ``x.clone()`` (read and write) and DeepSpeed 1-bit
Adam's sign path, ``x.sign().add_(1).bool()`` packed with torch ops; every codec row is a ratio
to the HBM read, and the sign encoder also to DeepSpeed's path. CPU times are
``time.perf_counter``; GPU times are CUDA events around each call (so they include any wait for
the host inside it). Throughput is always in GB/s of fp32 *input* (4 bytes per element,
GB = 1e9), so rows compare like for like; ratios within one run are what the targets are about,
since absolute numbers move with the machine's load. Each row's ratio comes from its calls
alternating with its anchor's (:func:`time_against`), so that both medians see the same machine;
the anchor rows themselves are timed alone.

Each codec's output is also checked (``wrong`` counts mismatching elements against a reference),
and a benchmark that finds a wrong result makes the CLI exit non-zero.

Each row also records the host's state while it was measured: the median of
:func:`host_probe` (a fixed piece of host work, timed just before and after the row's calls)
and, on Linux, how often the benchmark's thread was preempted and moved between CPUs. On a
GPU a call whose host work outlasts the work queued before it is timed with its host, and a
lent machine's host has run the same Python at less than half its usual speed for seconds at
a time; these say whether a row that missed its target was measured on such a host.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Iterable

import numpy as np
import torch

from bitcomm._sizes import human
from bitcomm.bench import heading
from bitcomm.codecs import _frame, counts, qsgd, redsync, sign, sparse

__all__ = ["Row", "run", "markdown", "vector", "DEFAULT_SIZES", "TARGETS", "GPU_TARGETS",
           "TARGET_SIZES", "time_call", "host_probe", "Tally", "tally", "tally_markdown", "verdict"]

DEFAULT_SIZES = (1 << 20, 16 << 20, 64 << 20)

TARGETS = {
    # (codec, op): (anchor, minimum ratio, why)
    ("sign", "encode"): ("packbits", 0.9, ">= 0.9x np.packbits(x < 0)"),
    ("sign", "decode"): ("unpackbits", 0.9, ">= 0.9x np.unpackbits(b)*2-1"),
    ("qsgd-4", "encode"): ("packbits", 0.1, ">= 0.1x the sign anchor"),
    # w-bit counts move w bits an element where the sign encoder moves one
    **{(f"counts-w{w}", "encode"): ("sign.encode", 1 / w, f">= 1/{w} of the sign encoder")
       for w in (1, 2, 3, 4)},
}
"""CPU targets checked by the benchmark (reported, never asserted in tests)."""
_CPU_ANCHOR = {"encode": "packbits", "decode": "unpackbits"}
"""The anchor of a CPU row without a target."""

_FIXED = [f"counts-w{w}" for w in (1, 2, 3, 4)]
GPU_TARGETS = {
    ("sign", "encode"): ("sum", 0.8, ">= 0.8x the HBM read"),
    ("sign", "decode"): ("sum", 0.8, ">= 0.8x the HBM read"),
    ("sign-vs-ds", "encode"): ("ds-sign", 3.0, ">= 3x DeepSpeed's sign path"),
    **{(c, op): ("sum", 0.6, ">= 0.6x the HBM read") for c in _FIXED
       for op in ("encode", "decode")},
    **{("counts-radix-m2", op): ("sum", 0.3, ">= 0.3x the HBM read")
       for op in ("encode", "decode")},
    **{(f"qsgd-{b}", "encode"): ("sum", 0.5, ">= 0.5x the HBM read") for b in qsgd.BITS},
    **{(f"qsgd-{b}", "decode"): ("sum", 0.6, ">= 0.6x the HBM read") for b in qsgd.BITS},
    ("redsync-1%", "encode"): ("sum", 0.2, ">= 0.2x the HBM read"),
    ("topk-1%", "encode"): ("sum", 0.2, ">= 0.2x the HBM read"),
}
"""GPU targets (``device="cuda"``), all ratios to the anchor named first."""

TARGET_SIZES = {"cpu": 1 << 20, "cuda": 64 << 20}
"""The smallest vector a device's targets are judged at: the sizes they were set for (the CPU's
1M-64M, the GPU's 64M and up). Below, a call's fixed host costs (checks, dispatch, an
allocation: some microseconds) outweigh its pass over memory, which is what a target measures;
such rows keep their anchor and ratio but have no target and no MISS."""


@dataclasses.dataclass
class Row:
    """One measured row: a codec operation at one size."""

    codec: str
    op: str
    n: int
    seconds: float
    gbps: float
    wire_bytes: int
    wrong: int
    anchor: str = ""
    ratio: float = float("nan")
    target: float = float("nan")
    note: str = ""
    anchor_seconds: float = float("nan")
    """The anchor's median, its calls alternating with this row's (``ratio`` is it / seconds)."""
    host_seconds: float = float("nan")
    """The median of the host's time a call, from just before it to its return.

    On the CPU the same as ``seconds``. On a GPU, where ``seconds`` is the device's, it says
    what the host spent: a call that returns without waiting (its launches queued) and takes
    the host as long as the device took is bound by its host, not by its kernels; a call that
    reads the device (a flag, a header) waits for it, and the wait is in both times.
    """
    host_probe_seconds: float = float("nan")
    """The median of :func:`host_probe`, timed three times just before this row's calls and
    three times just after: the host's speed while the row was measured."""
    preempted: int | None = None
    """How often the benchmark's thread was preempted (involuntary context switches) while the
    row was measured; None where the system does not say (not Linux)."""
    migrated: int | None = None
    """How often the benchmark's thread moved to another CPU while the row was measured (each
    move leaves its caches behind); None where the system does not say."""

    def as_dict(self) -> dict:
        """Return the row as a JSON-friendly dict."""
        return dataclasses.asdict(self)


_MIN_SECONDS = 0.25  # small sizes repeat until this much time is spent, for a stable median
# A GPU left idle, even briefly (the CPU-side checks between measurements), runs at low clocks
# for a while: on an H100 a 64M-element torch.sum measured 1874 GB/s after a single warm-up call
# in one run and 2650 in another where the GPU had just been busy. Each measurement first keeps
# it busy this long.
_GPU_WARM_SECONDS = 0.1


def time_call(fn: Callable[[], object], repeat: int, device: torch.device | str = "cpu"
              ) -> float:
    """Return the median seconds of ``fn()`` after a warm-up.

    The benchmarks' one timing loop (``_timings``, which :func:`time_against` runs on two
    functions and ``run`` reads the host's times from) for one function. It runs at least
    ``repeat`` times, and more (up to 50) until ``_MIN_SECONDS`` are spent. On a CUDA device
    each call is bracketed by CUDA events and the device is synchronised before reading them, so
    the time is the GPU's; the warm-up there repeats ``fn`` for ``_GPU_WARM_SECONDS`` (at most
    1000 calls) so the clocks are up. Each timed call there starts behind a write of a scratch
    buffer of at least four times the L2 cache (:func:`_flush_bytes`), as
    ``triton.testing.do_bench`` does: the call's inputs come from HBM, not from the L2 where its
    last call left them (an 8M-element ring chunk, 33 MB, fits an H200's L2), and the host's
    work up to the call's first launch (Python, then Triton's launcher: tens of microseconds,
    which a 10-microsecond kernel would be timed with on an idle GPU) overlaps the write, as it
    overlaps earlier work in a training step. What the GPU waits for inside the call (a host
    read, a launch slower than the kernel before it) stays in the time.
    """
    return _timings([fn], repeat, device)[0][0]


def time_against(fn: Callable[[], object], anchor: Callable[[], object], repeat: int,
                 device: torch.device | str = "cpu") -> tuple[float, float]:
    """Return the median seconds of ``fn()`` and of ``anchor()``, their calls alternating.

    A ratio of two medians taken minutes apart moves with whatever the machine did in between
    (on a 2-core VM the ``np.unpackbits`` anchor's 64M-element median read 122 to 395 ms in
    runs of the same code, while the sign decoder's stayed at 150 ms); taken call for call,
    each pair sees the same machine. Otherwise as :func:`time_call`.
    """
    (t, _), (a, _) = _timings([fn, anchor], repeat, device)
    return t, a


def _flush_bytes(device: torch.device) -> int:
    """Return the bytes of the scratch write before each timed CUDA call (:func:`time_call`).

    Four times the device's L2 cache, and at least 256 MiB: on an H100 or H200 some 70
    microseconds of writing (256 MiB at 3.5-4 TB/s, an estimate), longer than the host's work
    before most codecs' first launch.
    """
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0)
    return max(256 << 20, 4 * int(l2))


_PROBE_ROUNDS = 64


def host_probe() -> float:
    """Return the seconds the host takes for a fixed piece of work: a gauge of its speed.

    The work is what a codec call's host work is made of, without a device: Python calls and
    torch's dispatch of small CPU tensor ops (an allocation, a slice, a view), 64 times over
    (some 150 us on a 2-core VM). Timed around a benchmark row's calls, it tells a slow row
    measured on a slow host from a slow row on a fast one.
    """
    base = torch.empty(4 * _PROBE_ROUNDS + 8, dtype=torch.uint8)
    t0 = time.perf_counter()
    for i in range(_PROBE_ROUNDS):
        _probed(torch.empty(16, dtype=torch.uint8), base[4 * i : 4 * i + 8].view(torch.int32), i)
    return time.perf_counter() - t0


def _probed(made: torch.Tensor, view: torch.Tensor, i: int) -> tuple:
    # a call with the attribute reads and the small tuple a codec's Python makes
    return (made.numel(), view.dtype, i % 16 == 0)


def _sched_counts() -> tuple[int, int] | None:
    """Return this thread's involuntary context switches and CPU migrations so far.

    From Linux's ``/proc/thread-self/status`` and ``/proc/thread-self/sched``; None where
    either cannot be read or lacks its field (another system, a kernel without scheduler
    statistics).
    """
    try:
        with open("/proc/thread-self/status") as f:
            status = f.read()
        with open("/proc/thread-self/sched") as f:
            sched = f.read()
    except OSError:
        return None
    switches = migrations = None
    for line in status.splitlines():
        if line.startswith("nonvoluntary_ctxt_switches:"):
            switches = int(line.split(":")[1])
    for line in sched.splitlines():
        if line.startswith("se.nr_migrations"):
            migrations = int(line.split(":")[1])
    if switches is None or migrations is None:
        return None
    return switches, migrations


_PROBES = 3


def _measured(fns: list[Callable[[], object]], repeat: int, device: torch.device
              ) -> tuple[list[tuple[float, float]], dict]:
    # _timings of fns, and the Row fields of the host's state meanwhile: host_probe_seconds
    # (the median of _PROBES probes just before the calls and _PROBES just after: none among
    # them, so that the timed loop is the one rows were always timed by), preempted, migrated
    probes = [host_probe() for _ in range(_PROBES)]
    before = _sched_counts()
    timings = _timings(fns, repeat, device)
    after = _sched_counts()
    probes += [host_probe() for _ in range(_PROBES)]
    state = {"host_probe_seconds": statistics.median(probes)}
    if before is not None and after is not None:
        state |= {"preempted": after[0] - before[0], "migrated": after[1] - before[1]}
    return timings, state


def _timings(fns: list[Callable[[], object]], repeat: int, device: torch.device | str
             ) -> list[tuple[float, float]]:
    # Each function's median time a call and its host's median time a call (Row.host_seconds),
    # the functions' calls alternating.
    device = torch.device(device)
    for fn in fns:
        fn()  # warm-up: first-touch page faults, kernel compilation and lazy initialisation
    times: list[list[float]] = [[] for _ in fns]
    hosts: list[list[float]] = [[] for _ in fns]
    cuda = device.type == "cuda"
    if cuda:
        scratch = torch.empty(_flush_bytes(device), dtype=torch.uint8, device=device)
        # The events go on the stream looked up here: Event.record() without one looks it up
        # each time, a few microseconds of the host's that would fall between a call's return
        # and its end event, inside the time of a call that waits for the device.
        stream = torch.cuda.current_stream(device)
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(1000):
            if time.perf_counter() - t0 >= _GPU_WARM_SECONDS:
                break
            for fn in fns:
                fn()
            torch.cuda.synchronize(device)
    while len(times[0]) < repeat or (sum(map(sum, times)) < _MIN_SECONDS and len(times[0]) < 50):
        for fn, spent, host in zip(fns, times, hosts, strict=True):
            if cuda:
                start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
                torch.cuda.synchronize(device)
                scratch.zero_()  # evicts the L2; fn is launched while it runs
                start.record(stream)
                t0 = time.perf_counter()
                fn()
                t1 = time.perf_counter()
                end.record(stream)
                host.append(t1 - t0)
                end.synchronize()
                spent.append(start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                spent.append(time.perf_counter() - t0)
                host.append(spent[-1])
    return [(statistics.median(spent), statistics.median(host))
            for spent, host in zip(times, hosts, strict=True)]


def _cases(x: torch.Tensor, n: int, seed: int):
    """Yield (codec, encode, decode, check) for every benchmarked codec at length n."""
    gen = torch.Generator().manual_seed(seed)
    ref_sign = torch.where(x >= 0, 1.0, -1.0)
    device = x.device

    def sign_check(out):
        return int((out != ref_sign).sum())

    yield "sign", (lambda: sign.pack(x)), (lambda f: sign.unpack(f, n)), sign_check
    yield ("sign-scaled", (lambda: sign.encode_scaled(x)),
           (lambda f: sign.decode_scaled(f, n=n)[0]),
           lambda out: int((torch.sign(out) != ref_sign).sum()))
    for m in (1, 3, 7, 15):
        c = torch.randint(0, m + 1, (n,), generator=gen, dtype=torch.uint8).to(device)
        w = counts.width(m)
        yield (f"counts-w{w}", (lambda c=c, m=m: counts.pack(c, m)),
               (lambda f, m=m: counts.unpack(f, n, m)),
               lambda out, c=c: int((out != c).sum()))
    c = torch.randint(0, 3, (n,), generator=gen, dtype=torch.uint8).to(device)
    yield ("counts-radix-m2", (lambda: counts.pack(c, 2, "radix")),
           (lambda f: counts.unpack(f, n, 2, "radix")), lambda out: int((out != c).sum()))
    for b in qsgd.BITS:
        s = (1 << (b - 1)) - 1
        bound = x.abs().max() / s * 1.0001

        def qcheck(out, bound=bound):
            return int(((out - x).abs() > bound).sum())

        yield (f"qsgd-{b}", (lambda b=b: qsgd.encode(x, b, seed=seed)),
               (lambda f: qsgd.decode(f, n=n)[0]), qcheck)
    k = max(1, n // 100)
    # RedSync's codec as it selects by default (the exact top-k), and with its trimmed search
    # (Algorithm 2, which RedSync itself uses for layers of 128 KB to 4 MB)
    for name, method in (("redsync-1%", "topk"), ("redsync-trimmed-1%", "trimmed")):
        yield (name, (lambda m=method: redsync.encode(x, k, "top", m)),
               (lambda f: redsync.decode(f, n=n)[0]),
               lambda out: int(((out > 0).sum() != k)))

    # the frame of select_abs(x, k)'s entries (its writing pass writes them on the GPU)
    yield ("topk-1%", (lambda: sparse.encode_top(x, k, check=False)),
           (lambda f: sparse.decode(f, n=n)[0]),
           lambda out: int((out != 0).sum() != k))
    idx = torch.topk(x.abs(), k).indices
    vals = x[idx]
    yield ("sparse-fp32-1%", (lambda: sparse.encode(idx, vals, n)),
           (lambda f: sparse.decode(f, n=n)[0]),
           lambda out: int((out[idx] != vals).sum()))


def vector(n: int, seed: int, device: torch.device | str) -> torch.Tensor:
    """Return the benchmarks' float32 test vector of ``n`` normal values on ``device``.

    Made on the CPU and moved, so every device codes the same values.
    """
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)).to(device)


def _anchors(x: torch.Tensor) -> dict[str, Callable[[], object]]:
    if x.device.type == "cuda":
        return {
            "sum": lambda: torch.sum(x),
            "clone": lambda: x.clone(),
            # DeepSpeed 1-bit Adam: x.sign().add_(1).bool(), then packed (with torch ops here).
            "ds-sign": lambda: _frame.packbits(x.sign().add_(1).bool()),
        }
    a = x.numpy()
    packed = np.packbits(a < 0)
    return {
        "packbits": lambda: np.packbits(a < 0),
        "unpackbits": lambda: np.unpackbits(packed).astype(np.float32) * 2 - 1,
        "copy": lambda: a.copy(),
    }


def run(sizes: Iterable[int] = DEFAULT_SIZES, repeat: int = 3, seed: int = 0,
        progress: Callable[[Row], None] | None = None, device: str | torch.device = "cpu"
        ) -> list[Row]:
    """Measure every codec and the anchors at each size; return the rows.

    Args:
        sizes: element counts of the float32 test vector.
        repeat: timed repetitions per measurement (median reported) after one warm-up.
        seed: seed of the test data and of qsgd's randomness.
        progress: called with each row as soon as it is measured.
        device: ``"cpu"`` or a CUDA device (the data is generated on the CPU and moved there,
            so every device codes the same vector).

    """
    device = torch.device(device)
    gpu = device.type == "cuda"
    targets = GPU_TARGETS if gpu else TARGETS
    rows: list[Row] = []

    def emit(row: Row) -> None:
        rows.append(row)
        if progress is not None:
            progress(row)

    for n in sizes:
        x = vector(n, seed, device)
        anchors = _anchors(x)
        for name, fn in anchors.items():  # each alone, for its own GB/s
            [(t, host)], state = _measured([fn], repeat, device)
            emit(Row("anchor", name, n, t, 4 * n / t / 1e9, 0, 0, host_seconds=host, **state))
        for codec, enc, dec, check in _cases(x, n, seed):
            if codec == "sign":
                anchors["sign.encode"] = enc  # what the CPU's counts encoders are held to
            frame = enc()
            out = dec(frame)
            wrong = check(out)
            for op, fn in (("encode", enc), ("decode", lambda d=dec, f=frame: d(f))):
                names = [codec]
                if gpu and codec == "sign" and op == "encode":
                    names.append("sign-vs-ds")  # the same encoder against DeepSpeed's path
                for name in names:
                    anchor, minimum, why = targets.get(
                        (name, op), ("sum" if gpu else _CPU_ANCHOR[op], float("nan"), ""))
                    if n < TARGET_SIZES[device.type]:
                        minimum, why = float("nan"), ""
                    [(t, host), (against, _)], state = _measured([fn, anchors[anchor]],
                                                                 repeat, device)
                    emit(Row(name, op, n, t, 4 * n / t / 1e9, int(frame.numel()), wrong,
                             anchor, against / t, minimum, why, against, host, **state))
    return rows


def markdown(rows: list[Row], config: dict, command: str) -> str:
    """Return the rows as the docs' Markdown table, headed by its date, machine and command.

    One line a codec operation (anchors first), one column a size: GB/s of fp32 input and, in
    brackets, the ratio to the anchor named in ``vs`` (the target's anchor where there is one).
    ``config``: what the command saved with the rows (its ``time``, the machine's facts).
    """
    sizes = list(dict.fromkeys(r.n for r in rows))
    lines: dict[tuple[str, str], dict[int, Row]] = {}
    for r in rows:
        lines.setdefault((r.codec, r.op), {})[r.n] = r
    out = heading(config, command) + [
        "| codec | op | vs | " + " | ".join(human(n) for n in sizes) + " | target |",
        "|---|---|---|" + "---|" * len(sizes) + "---|"]
    for (codec, op), by_size in lines.items():
        first = next(iter(by_size.values()))
        cells = []
        for n in sizes:
            r = by_size.get(n)
            if r is None:
                cells.append("-")
            elif codec == "anchor" or r.ratio != r.ratio:  # an anchor, or no ratio (NaN)
                cells.append(f"{r.gbps:.2f}")
            else:
                cells.append(f"{r.gbps:.2f} ({r.ratio:.2f})")
        # The target of the sizes that have one; where smaller ones have none, from which size.
        judged = [n for n in sizes if n in by_size and by_size[n].target == by_size[n].target]
        target = "" if not judged else f">= {by_size[judged[0]].target:.2f}"
        if judged and any(n in by_size and n < min(judged) for n in sizes):
            target += f" from {human(min(judged))}"
        vs = "" if codec == "anchor" else first.anchor
        out.append(f"| {codec} | {op} | {vs} | " + " | ".join(cells) + f" | {target} |")
    return "\n".join(out) + "\n"


@dataclasses.dataclass
class Tally:
    """One codec operation at one size over several runs of this benchmark (:func:`tally`)."""

    codec: str
    op: str
    n: int
    anchor: str
    target: float
    values: list[float | None]
    """Each run's ratio (an anchor's row: its GB/s); None where the run has no such row, NaN
    where it has one without a ratio (which misses any target)."""
    probes: list[float | None] = dataclasses.field(default_factory=list)
    """Each run's :attr:`Row.host_probe_seconds` of the row; None where the run has no such row
    or its row has no probe (a run saved before rows had one)."""
    preempted: list[int | None] = dataclasses.field(default_factory=list)
    """Each run's :attr:`Row.preempted` of the row; None where the run or its system gave none."""
    migrated: list[int | None] = dataclasses.field(default_factory=list)
    """Each run's :attr:`Row.migrated` of the row; None where the run or its system gave none."""

    @property
    def runs(self) -> int:
        """Return how many runs have the row."""
        return sum(v is not None for v in self.values)

    @property
    def met(self) -> int:
        """Return how many runs met the target (0 without one)."""
        return sum(v is not None and v >= self.target for v in self.values)

    def missed(self, run: int) -> bool:
        """Say whether run ``run`` (from 0) has the row and missed the target."""
        value = self.values[run]
        return self.target == self.target and value is not None and not value >= self.target

    def as_dict(self) -> dict:
        """Return the tally as a JSON-friendly dict, with ``runs`` and ``met``.

        ``values`` hold None for NaN too (strict JSON); ``present`` says which runs have the
        row.
        """
        return dataclasses.asdict(self) | {
            "values": [None if v is None or v != v else v for v in self.values],
            "probes": [None if v is None or v != v else v for v in self.probes],
            "present": [v is not None for v in self.values], "runs": self.runs,
            "met": self.met}


def tally(runs: list[list[dict]]) -> list[Tally]:
    """Tally the rows of several runs (each a list of :meth:`Row.as_dict`, as saved).

    One :class:`Tally` per codec operation and size, in the order the runs first give them.
    A target is judged in every run, and at 64M elements on a GPU a call that waits for its
    host moves from run to run with the host's speed, so a verdict needs several runs.
    Raises ``ValueError`` where two runs give one row other anchors or targets (runs of other
    devices, or of other code).
    """
    found: dict[tuple[str, str, int], Tally] = {}
    for i, rows in enumerate(runs):
        for row in rows:
            key = (row["codec"], row["op"], row["n"])
            target = _number(row.get("target"))
            t = found.get(key)
            if t is None:
                t = found[key] = Tally(*key, row.get("anchor") or "", target,
                                       *([None] * len(runs) for _ in range(4)))
            elif t.anchor != (row.get("anchor") or "") or not _same(t.target, target):
                raise ValueError(f"runs 1 and {i + 1} differ on {key[0]} {key[1]} at "
                                 f"{human(key[2])}: anchor {t.anchor!r} against "
                                 f"{row.get('anchor')!r}, target {t.target} against {target}")
            value = row["gbps"] if row["codec"] == "anchor" else row.get("ratio")
            t.values[i] = _number(value)
            probe = row.get("host_probe_seconds")
            t.probes[i] = None if probe is None else float(probe)
            for name in ("preempted", "migrated"):
                count = row.get(name)
                getattr(t, name)[i] = None if count is None else int(count)
    return list(found.values())


def _number(value: float | None) -> float:
    # a saved float (None where it was NaN) as a float
    return float("nan") if value is None else float(value)


def _same(a: float, b: float) -> bool:
    return a == b or (a != a and b != b)


def tally_markdown(tallies: list[Tally], configs: list[dict], names: list[str],
                   command: str) -> str:
    """Return the tallies as the docs quote them: each row's runs met and spread, the misses.

    ``configs``: each run's saved config (its ``time`` and machine); ``names``: what each run
    is called (its folder). The first table gives each codec operation at each size: how many
    runs met its target, and its lowest, median and highest ratio (an anchor's GB/s); the
    second every row that missed in some run, run by run, the misses in bold, and where the
    runs saved a host probe (:attr:`Row.host_probe_seconds`) a third the probe of those rows,
    with each run's median over all its rows, and where they saved scheduler counts
    (:attr:`Row.preempted`, :attr:`Row.migrated`) a fourth those rows' counts the same way;
    then which runs met every target.
    """
    out = heading(configs[0], command)[:-1]
    out += [f"- Run {i + 1}: {name} ({c.get('time', '?')}"
            + (f", on CPUs {c['affinity']} alone" if "affinity" in c else "") + ")"
            for i, (name, c) in enumerate(zip(names, configs, strict=True))]
    # the machines, less the CPUs a run was confined to, which its own line names
    machines = {heading({k: v for k, v in c.items() if k != "affinity"}, "")[1]
                for c in configs}
    if len(machines) > 1:
        out.append("- The runs' machines differ: " + "; ".join(sorted(machines)))
    out += ["", "| codec | op | vs | size | runs met | min / median / max | target |",
            "|---|---|---|---|---|---|---|"]
    for t in tallies:
        seen = [v for v in t.values if v is not None and v == v]
        spread = " / ".join(_cell(v, t.codec, t.target)
                            for v in (min(seen), statistics.median(seen), max(seen))
                            ) if seen else "-"
        if t.codec == "anchor":
            spread += " GB/s"
        has_target = t.target == t.target
        met = f"{t.met} of {t.runs}" if has_target else ""
        target = f">= {t.target:.2f}" if has_target else ""
        out.append(f"| {t.codec} | {t.op} | {t.anchor if t.codec != 'anchor' else ''} | "
                   f"{human(t.n)} | {met} | {spread} | {target} |")
    nruns = len(configs)
    missing = [t for t in tallies if any(t.missed(r) for r in range(nruns))]
    out.append("")
    if missing:
        out += ["The rows that missed their target in a run (misses in bold):", "",
                "| codec | op | size | " + " | ".join(f"run {r + 1}" for r in range(nruns))
                + " | target |", "|---|---|---|" + "---|" * nruns + "---|"]
        for t in missing:
            cells = ["-" if v is None else f"**{_cell(v, t.codec, t.target)}**"
                     if t.missed(r) else _cell(v, t.codec, t.target)
                     for r, v in enumerate(t.values)]
            out.append(f"| {t.codec} | {t.op} | {human(t.n)} | " + " | ".join(cells)
                       + f" | >= {t.target:.2f} |")
        out.append("")
        if any(p is not None for t in tallies for p in t.probes):
            out += _probe_table(missing, tallies, nruns)
        if any(c is not None for t in tallies for c in t.preempted + t.migrated):
            out += _sched_table(missing, tallies, nruns)
    out.append(verdict(tallies, nruns))
    return "\n".join(out) + "\n"


def _median(values: list) -> float | None:
    # the median of the values that are there (not None), or None
    seen = [v for v in values if v is not None]
    return statistics.median(seen) if seen else None


def _state_table(caption: str, missing: list[Tally], tallies: list[Tally], nruns: int,
                 cell: Callable[[Tally, int], str | None], summary: Callable[[int], str]
                 ) -> list[str]:
    # Under the misses: each missed row's cell(row, run) run by run (a miss's in bold; None:
    # nothing saved, "-"), then each run's summary(run) over all its rows.
    def shown(t: Tally, r: int) -> str:
        text = cell(t, r)
        if text is None:
            return "-"
        return f"**{text}**" if t.missed(r) else text

    runs = " | ".join(f"run {r + 1}" for r in range(nruns))
    out = [caption, "", f"| codec | op | size | {runs} |", "|---|---|---|" + "---|" * nruns]
    out += [f"| {t.codec} | {t.op} | {human(t.n)} | "
            + " | ".join(shown(t, r) for r in range(nruns)) + " |" for t in missing]
    out += ["| every row | median | | " + " | ".join(summary(r) for r in range(nruns)) + " |",
            ""]
    return out


def _probe_table(missing: list[Tally], tallies: list[Tally], nruns: int) -> list[str]:
    # The host probe (us) of each row that missed somewhere and each run's median over all
    # its rows: whether the misses came with a slow host.
    def us(value: float | None) -> str | None:
        return None if value is None or value != value else f"{value * 1e6:.0f}"

    return _state_table(
        "The host probe of those rows, us (`host_probe`: a fixed piece of host work timed "
        "around the row's calls; a miss's in bold):", missing, tallies, nruns,
        lambda t, r: us(t.probes[r]),
        lambda r: us(_median([t.probes[r] for t in tallies])) or "-")


def _sched_table(missing: list[Tally], tallies: list[Tally], nruns: int) -> list[str]:
    # The benchmark thread's preemptions / moves between CPUs during each row that missed
    # somewhere and each run's medians over all its rows: whether a miss came with the
    # thread taken off its CPU or moved to another.
    def count(value: float | None) -> str:
        return "-" if value is None else f"{value:g}"

    return _state_table(
        "The benchmark thread's preemptions / moves between CPUs during those rows' calls "
        "(`preempted` / `migrated`; a miss's in bold):", missing, tallies, nruns,
        lambda t, r: f"{count(t.preempted[r])} / {count(t.migrated[r])}",
        lambda r: f"{count(_median([t.preempted[r] for t in tallies]))} / "
                  f"{count(_median([t.migrated[r] for t in tallies]))}")


def verdict(tallies: list[Tally], nruns: int) -> str:
    """Return one line: every target met in every run, or which runs met every target."""
    clean = [r + 1 for r in range(nruns) if not any(t.missed(r) for t in tallies)]
    if len(clean) == nruns:
        return f"Every target met in every run ({nruns} of {nruns})."
    return (f"Runs that met every target: {', '.join(map(str, clean)) or 'none'} "
            f"({len(clean)} of {nruns}).")


def _cell(value: float, codec: str, target: float = float("nan")) -> str:
    # a ratio to 2 decimals, or 3 where 2 would show it equal to a target it is not
    if codec == "anchor":
        return f"{value:.1f}"
    if value != target and f"{value:.2f}" == f"{target:.2f}":
        return f"{value:.3f}"
    return f"{value:.2f}"
