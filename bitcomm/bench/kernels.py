"""What the Triton kernels compile to for an NVIDIA GPU, measured without one.

Triton compiles a kernel for a named architecture with no GPU present: its bundled ``ptxas``
writes the machine code (SASS) and ``cuobjdump`` lists it. :func:`run` does that for every
kernel configuration the codecs and collectives launch on vectors of ``n`` elements, with the
argument types and alignment that a launch on such vectors specialises on (meta tensors stand
for the data), and reports for each:

* ``registers`` and ``stack``: registers per thread, and bytes of per-thread stack. A stack is
  registers spilled to local memory; every spilled value costs a round trip through the cache
  hierarchy, which can make a memory-bound kernel many times slower.
* ``per_element``: SASS instructions per element and lane: the program's instruction count
  times its threads, over the elements the program covers (fp32 inputs for encoders, outputs
  for decoders, counts for the count codecs). The count is static: loops are unrolled
  (``tl.static_range``), except the loops over ranks of ``vote_count`` and ``weighted_votes``,
  counted once, and the loop over tiles of the kernels in :data:`_STRIDED` (the span of
  their longest backward branch), counted once a tile, the code around it once a program,
  and the loop over frames of the kernels in :data:`_REPEATED`, counted once a frame (the
  kept frame's store, made in one frame only, counted in each).
  A launch of one program (a decoder's last tile with ``EDGE=True``) is counted per
  element of the whole vector, so its figures are near 0.
  The radix selection's kernels that run after its candidates are gathered read a tile of
  them or, when none were gathered, of the vector: both branches are in the static count,
  which is therefore that of neither.
* ``loads`` and ``stores``: global memory instructions per element and lane, the same way.

Why instructions per element: an H100 SXM issues at most about 33e12 lane-instructions a second
(132 SMs, 4 schedulers of 32 lanes each, 1.98 GHz), and reads its memory at about 3e12 bytes a
second (``torch.sum`` measured 2968 GB/s), that is 742e9 float32 elements. A kernel that spends
more than about 45 instructions per float32 element therefore runs out of issue slots before it
runs out of memory bandwidth. This is an estimate from data-sheet figures, not a timing: the
GPU benchmark (``bitcomm bench codecs --device cuda``) is the measurement.
"""

from __future__ import annotations

import contextlib
import math
import multiprocessing
import os
import re
import subprocess
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass

import torch

__all__ = ["KernelRow", "run", "cases", "available", "ARCH"]

ARCH = 90
"""Compute capability compiled for by default: 90, the H100 the GPU figures come from."""


@dataclass
class KernelRow:
    """One kernel configuration as compiled for ``arch``."""

    case: str
    kernel: str
    config: str
    arch: int
    programs: int
    warps: int
    registers: int
    stack: int
    instructions: int
    per_element: float
    loads: float
    stores: float

    def as_dict(self) -> dict:
        """Return the row as a dict (for JSON and CSV)."""
        return asdict(self)


def available() -> str | None:
    """Return why kernels cannot be compiled here (no triton, no CUDA tools), or ``None``."""
    try:
        import triton  # noqa: F401
        from triton._C.libtriton import native_specialize_impl  # noqa: F401
        from triton.backends.compiler import BaseBackend, GPUTarget  # noqa: F401
        from triton.compiler import ASTSource  # noqa: F401
    except ImportError as e:
        return f"triton's offline compiler is not importable ({e})"
    if not os.path.exists(_cuobjdump()):
        return f"triton has no cuobjdump at {_cuobjdump()}"
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "TRITON_INTERPRET=1 makes the kernels interpreted functions; unset it to compile"
    return None


def _cuobjdump() -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                        "cuobjdump")


@contextlib.contextmanager
def _recorded() -> Iterator[list]:
    """Record the launches of the codec and collective kernels instead of running them.

    Every launch goes through :func:`bitcomm.codecs._kernels.launch` (the collective steps'
    through its ``launch_tiles``).
    """
    from bitcomm.codecs import _kernels as codec_kernels

    calls: list = []

    def record(kernel, grid, *args, **kwargs) -> None:
        calls.append((kernel, grid, args, kwargs))

    saved = codec_kernels.launch
    codec_kernels.launch = record
    try:
        yield calls
    finally:
        codec_kernels.launch = saved


def cases(n: int) -> list[tuple[str, int, Callable[[], object]]]:
    """Return ``(name, elements, launch)`` for each benchmarked kernel configuration.

    ``launch()`` calls the wrapper that a codec or collective step calls on ``n``-element
    vectors (meta tensors: nothing is allocated); ``elements`` is what its programs cover.
    """
    from bitcomm.codecs import _frame, counts, qsgd, sparse
    from bitcomm.codecs import _kernels as k
    from bitcomm.collectives import _kernels as steps

    def meta(size: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device="meta")

    def encoded_frame(bits: int, bucket: int) -> torch.Tensor:
        # a frame laid out as qsgd.encode allocates it: its codes 16-byte aligned
        start = qsgd.HEADER.size + 4 * -(-n // bucket)
        return _frame.empty_aligned_at(qsgd.encoded_size(n, bits, bucket), start, "meta")

    x, nb = meta(n, torch.float32), (n + 7) // 8
    out: list[tuple[str, int, Callable[[], object]]] = [
        ("sign encode fp32", n, lambda: k.sign_pack(x)),
        ("sign encode bf16", n, lambda: k.sign_pack(meta(n, torch.bfloat16))),
        ("sign decode", n, lambda: k.sign_unpack(meta(nb, torch.uint8), n, torch.float32)),
        ("sign-scaled scale", n, lambda: k.partial_sums(x, True)),
        # every checked call's input check; float64 also as float32 (a float32 collective's)
        ("finiteness check fp32", n, lambda: k.nonfinite(x)),
        ("finiteness check fp64 as fp32", n,
         lambda: k.nonfinite(meta(n, torch.float64), narrow=True)),
        # a DDP hook's overflow screen: the check, zeroing NaN and inf in place
        ("finiteness screen fp32, zeroing", n, lambda: k.nonfinite(x, zero=True)),
        # the sign hook's and Signum's momentum, of a float32 and of a bfloat16 gradient
        ("momentum fp32", n, lambda: k.momentum(x, x, 0.9, x)),
        ("momentum of bf16", n, lambda: k.momentum(x, meta(n, torch.bfloat16), 0.9, x)),
    ]
    for m in (1, 2, 3, 7, 15, 255, 65535):
        w = counts.width(m)
        dtype = torch.uint8 if m <= 255 else torch.int32
        if m == (1 << w) - 1:  # the encoder depends on the width only; checked, as pack is
            out.append((f"counts-w{w} encode", n,
                        lambda w=w, m=m, d=dtype: k.planes_pack(meta(n, d), w, limit=m)))
        out.append((f"counts-w{w} decode (m={m})", n,
                    lambda w=w, m=m, d=dtype: k.planes_unpack(meta(w * nb, torch.uint8), n, w,
                                                              d, maxval=m)))
    for m in (2, 4, 5, 8, 10, 12):
        g, b = counts.radix_group(m)
        size = counts.packed_size(n, m, "radix")
        out += [(f"counts-radix-m{m} encode", n,
                 lambda g=g, b=b, m=m: k.planes_pack(meta(n, torch.uint8), b, g, m + 1,
                                                     limit=m)),
                (f"counts-radix-m{m} decode", n,
                 lambda g=g, b=b, m=m, size=size: k.planes_unpack(
                     meta(size, torch.uint8), n, b, torch.uint8, group=g, base=m + 1))]
    for bits in qsgd.BITS:
        for bucket in (qsgd.DEFAULT_BUCKET, 4096, 1000):
            scales = meta(-(-n // bucket), torch.float32)
            factors = None if bucket & (bucket - 1) == 0 else scales
            # writing the frame's header too, as qsgd.encode launches it
            out.append((f"qsgd-{bits} encode, bucket {bucket}", n,
                        lambda b=bits, s=scales, f=factors, bk=bucket:
                        k.qsgd_codes(x, b, bk, 12345, s, f, flags=None if f is not None
                                     else meta(1, torch.int32),
                                     header=(meta(qsgd.HEADER.size, torch.uint8),
                                             qsgd.HEADER.pack(n, b, 0, bk)))))
            # one pass for a power-of-two bucket; else the steps kernel, then the values'
            out.append((f"qsgd-{bits} decode, bucket {bucket}", n,
                        lambda b=bits, bk=bucket: k.qsgd_decode(
                            encoded_frame(b, bk), qsgd.HEADER.size, n, b, bk, torch.float32,
                            meta(1, torch.int32))))
        # a decode with n given, of a layout decoded before: the header checked in the pass
        out.append((f"qsgd-{bits} decode, known header", n,
                    lambda b=bits, bk=qsgd.DEFAULT_BUCKET: k.qsgd_decode(
                        encoded_frame(b, bk), qsgd.HEADER.size, n, b, bk, torch.float32,
                        meta(1, torch.int32), header=qsgd.HEADER.pack(n, b, 0, bk))))
        steps_ = meta(-(-n // qsgd.DEFAULT_BUCKET), torch.float32)
        # qsgd_allgather's mean of 8 ranks' frames, keeping this rank's values, after their
        # checks and steps
        size = qsgd.encoded_size(n, bits)
        out.append((f"qsgd-{bits} checks and steps of 8 frames", n,
                    lambda b=bits, size=size: k.qsgd_steps(
                        meta(8 * size, torch.uint8).view(8, size), qsgd.HEADER.size,
                        -(-n // qsgd.DEFAULT_BUCKET), n, b, meta(qsgd.HEADER.size, torch.uint8),
                        meta(1, torch.int32))))
        out.append((f"qsgd-{bits} mean of 8 frames", n,
                    lambda b=bits, size=size, s=steps_: k.qsgd_mean(
                        meta(8 * size, torch.uint8).view(8, size), size - (n * b + 7) // 8, n,
                        b, qsgd.DEFAULT_BUCKET, s.expand(8, -1), keep=3)))
        if bits == 4:  # qsgd_hook's error feedback: the residual in place of the kept values
            out.append((f"qsgd-{bits} mean of 8 frames, residual", n,
                        lambda b=bits, size=size, s=steps_: k.qsgd_mean(
                            meta(8 * size, torch.uint8).view(8, size), size - (n * b + 7) // 8,
                            n, b, qsgd.DEFAULT_BUCKET, s.expand(8, -1), keep=3,
                            residual_of=meta(n, torch.float32))))
    # SIDCo's stages: the first over every score (its largest read on the device), a later
    # one over the exceedances of eta, taken as it reads
    out += [(f"sidco {kind} stage, {which}", n,
             lambda kind=kind, top=top, first=first: k.sidco_stage(x, kind, top,
                                                                   0.0 if first else 0.25))
            for kind, which, first, top in (
                ("exponential", "first", True, meta(1, torch.float32)[0]),
                ("pareto", "first", True, meta(1, torch.float32)[0]),
                ("gamma", "first", True, meta(1, torch.float32)[0]),
                ("pareto", "later", False, 1.5))]
    # a sparse frame's entries into their dense vector (the figures are per entry)
    entries = max(1, n // 100)
    out += [(f"sparse 1% decode, {values} values", entries,
             lambda values=values: k.sparse_scatter(
                 meta(17 + 8 * entries, torch.uint8), n, entries, 17, values, x,
                 meta(1, torch.int32)))
            for values in ("fp32", "mean")]
    # and a frame of entries: given ones, checked, or read at a top-k's indices (fp32) or
    # RedSync's (its mean) from the vector; the index field aligned as the encoder allocates it
    out += [(f"sparse 1% encode, {values} values, {how}", entries,
             lambda values=values, how=how: k.sparse_frame(
                 meta(entries, torch.int64), x if how == "gathered" else meta(entries,
                                                                              torch.float32),
                 sparse.HEADER.pack(n, entries, sparse.FORMATS.index(values)), values,
                 meta(15 + 17 + 8 * entries, torch.uint8)[15:],
                 meta(1, torch.int32) if how == "checked" else None, gather=how == "gathered"))
            for values, how in (("fp32", "checked"), ("fp32", "gathered"),
                                ("mean", "gathered"))]
    out += [("redsync-1% mean, max, check, count", n, lambda: k.score_stats(x, 1)),
            ("redsync-1% counts of 63 bounds", n,
             lambda: k.count_above(x, meta(63, torch.float32), 1, runs=True)),
            # the trimmed search's: its thresholds made from the statistics on the device
            ("redsync-1% statistics, then counts of 6 bounds", n,
             lambda: k.stats_and_counts(x, [0.0, 0.2, 0.4, 0.6, 0.8], 1)),
            # from the runs of the counting pass, as the searches write their survivors
            ("redsync-1% survivors", n, lambda: k.indices_above(
                x, 2.0, n // 100, 1, runs=meta(k._programs(n), torch.int64))),
            # the trimmed search's: their scores beside them, for the top-k among them
            ("redsync-1% survivors and their scores", n, lambda: k.indices_above(
                x, 2.0, n // 100, 1, runs=meta(k._programs(n), torch.int64), scores=True)),
            ("top-k 1% fp32", n, lambda: k.top_indices(x, max(1, n // 100))),
            ("top-k 1% fp32, top side", n, lambda: k.top_indices(x, max(1, n // 100), 1)),
            # RedSync's checked top-k: the count pass also finds NaN / inf, the writing pass
            # counts the positive
            ("top-k 1% fp32, top side, census", n,
             lambda: k.top_indices(x, max(1, n // 100), 1, census=True)),
            # the same with its count pass's loads three tiles ahead (a setting to time)
            ("top-k 1% fp32, top side, census, COUNT_STAGES=3", n, lambda: _applied(
                {"COUNT_STAGES": 3}, lambda: k.top_indices(x, max(1, n // 100), 1,
                                                           census=True))),
            ("top-k 1% fp32, magnitude", n, lambda: k.top_indices(x, max(1, n // 100), 2)),
            # sparse.encode_top's: the writing pass writes the frame's entries (fp32 values),
            # unchecked and checked (the count pass finds NaN / inf)
            *((f"top-k 1% fp32, magnitude, frame{', census' if census else ''}", n,
               lambda census=census: k.top_frame(
                   x, entries, sparse.HEADER.pack(n, entries, 0), "fp32",
                   meta(15 + 17 + 8 * entries, torch.uint8)[15:], census=census))
              for census in (False, True)),
            # redsync.encode's: the entries and the programs' sums of a mean frame
            ("top-k 1% fp32, top side, census, mean frame", n, lambda: k.top_frame(
                x, entries, sparse.HEADER.pack(n, entries, 3), "mean",
                meta(15 + 17 + 4 * entries + 4, torch.uint8)[15:], side=1, census=True)),
            ("top-k 1% fp64", n, lambda: k.top_indices(meta(n, torch.float64),
                                                       max(1, n // 100))),
            # an AMP gradient's: 16-bit scores take the gathering's flat tiles
            ("top-k 1% bf16, magnitude", n, lambda: k.top_indices(meta(n, torch.bfloat16),
                                                                  max(1, n // 100), 2)),
            # beyond the sampled bound's reach: the two-digit gathering
            ("top-k 10% fp32", n, lambda: k.top_indices(x, max(1, n // 10), 2)),
            # a DDP bucket's 32K scores: the whole selection in one program (SMALL_TOP)
            ("top-k 1% fp32 of 32K, one program", 1 << 15,
             lambda: k.top_indices(meta(1 << 15, torch.float32), 327, 2)),
            ("top-k 1% fp64 of 32K, one program, census", 1 << 15,
             lambda: k.top_indices(meta(1 << 15, torch.float64), 327, 1, census=True))]
    ranks = 8
    chunk = -(-n // ranks)  # the first ranks' chunks: a partial last tile when n is odd
    cb = (chunk + 7) // 8
    xc = meta(chunk, torch.float32)
    for w_in, w_out in ((0, 1), (1, 2), (2, 3), (3, 4)):
        out.append((f"ring step {w_in}->{w_out} bits", chunk,
                    lambda i=w_in, o=w_out: steps.count_step(
                        meta(i * cb, torch.uint8) if i else None, xc, i, o)))
    out += [
        ("ring last step (decide)", chunk,
         lambda: steps.count_step(meta(3 * cb, torch.uint8), xc, 3, 1, decide=ranks)),
        ("alltoall vote count", chunk,
         lambda: steps.vote_count(meta(ranks * cb, torch.uint8).view(ranks, cb), chunk)),
        ("onebit sign+error", n,  # 1-bit Adam's buffer: the vector padded to whole bytes
         lambda: steps.sign_error(meta(8 * nb, torch.float32), meta(1, torch.float32)[0],
                                  meta(8 * nb, torch.float32))),
        ("onebit weighted votes", chunk,
         lambda: steps.weighted_votes(meta(ranks * cb, torch.uint8).view(ranks, cb),
                                      meta(ranks, torch.float32), xc)),
        ("onebit scaled signs", n,
         lambda: steps.scaled_signs(meta(nb, torch.uint8), meta(ranks, torch.float32), n,
                                    chunk)),
    ]
    return out


def _applied(settings: dict[str, int], call: Callable[[], object]) -> object:
    """Return ``call()`` made under ``bench profile --set``'s ``settings``.

    For a setting that a profile times on a GPU: its kernels are compiled here as that run
    launches them.
    """
    from bitcomm.bench.profile import applied

    with applied(settings):
        return call()


_STRIDED = ("_count_above_kernel", "_key_digits_kernel", "_gather_kernel",
            "_chosen_counts_kernel", "_chosen_write_kernel", "_count_at_least_kernel",
            "_score_stats_kernel")
"""Kernels whose programs loop over several tiles of the vector."""

_REPEATED = {"_qsgd_mean_kernel": "frames"}
"""Kernels whose outermost loop runs once per item of an argument (named): frames."""

_OPCODE = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)[.\w]*\s*([^;]*)")


def _compile(kernel, args: tuple, kwargs: dict, arch: int):
    """Compile one recorded launch for ``sm_<arch>`` as the launch would specialise it."""
    import triton
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend, GPUTarget
    from triton.compiler import ASTSource

    kwargs = dict(kwargs)
    options = {key: kwargs.pop(key) for key in ("num_warps", "enable_fp_fusion")
               if key in kwargs}
    signature, constexprs, attrs = {}, {}, {}
    values = list(args) + [kwargs[p.name] for p in kernel.params[len(args):]]
    for i, (param, value) in enumerate(zip(kernel.params, values, strict=True)):
        if param.is_constexpr:
            signature[param.name], constexprs[param.name] = "constexpr", value
            continue
        kind, key = native_specialize_impl(BaseBackend, value, False,
                                           not param.do_not_specialize, True)
        signature[param.name] = kind
        if kind == "constexpr":  # an int equal to 1, or None
            constexprs[param.name] = value
        elif key == "D":
            attrs[(i,)] = [["tt.divisibility", 16]]
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options), {
        name: value for name, value in constexprs.items()
        if kernel.params[kernel.arg_names.index(name)].is_constexpr}


def _machine_code(cubin: bytes) -> tuple[Counter, Counter, int, int]:
    """Return a one-kernel cubin's SASS opcode counts, its registers and its stack bytes.

    The second value counts the opcodes of its outermost loop (the span of its longest
    backward branch; empty without one).
    """
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        tool = _cuobjdump()
        sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True,
                              check=True, timeout=120).stdout
        usage = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True,
                               check=True, timeout=120).stdout
    finally:
        os.unlink(f.name)
    code = [(int(m.group(1), 16), m.group(2), m.group(3)) for line in sass.splitlines()
            if (m := _OPCODE.match(line))]
    ops = Counter(op for _, op, _ in code)
    loops = [(int(jump.group(1), 16), at) for at, op, target in code
             if op == "BRA" and (jump := re.match(r"0x([0-9a-f]+)", target))
             and int(jump.group(1), 16) < at]
    first, last = max(loops, key=lambda span: span[1] - span[0], default=(1, 0))
    loop = Counter(op for at, op, _ in code if first <= at <= last)
    regs = re.search(r"REG:(\d+)", usage)
    stack = re.search(r"STACK:(\d+)", usage)
    if not (ops and regs and stack):
        raise RuntimeError(f"could not read cuobjdump's listing of the kernel:\n{usage}")
    return ops, loop, int(regs.group(1)), int(stack.group(1))


def run(n: int = 1 << 26, *, arch: int = ARCH, only: str | None = None,
        progress: Callable[[KernelRow], None] | None = None, jobs: int = 1) -> list[KernelRow]:
    """Compile every case of :func:`cases` (names containing ``only``) and return its rows.

    With ``jobs`` above 1 that many processes compile the cases (spawned: each imports torch
    and triton once; two threads compiled no faster than one in a trial); the rows come back
    in the cases' order either way, each case's as soon as it and those before it are done.
    """
    why = available()
    if why:
        raise RuntimeError(why)
    chosen = [(n, arch, i) for i, (name, _, _) in enumerate(cases(n))
              if only is None or only in name]
    rows: list[KernelRow] = []
    with contextlib.ExitStack() as stack:
        if jobs > 1 and len(chosen) > 1:
            pool = stack.enter_context(
                multiprocessing.get_context("spawn").Pool(min(jobs, len(chosen))))
            done = pool.imap(_case_rows, chosen)
        else:
            done = map(_case_rows, chosen)
        for part in done:
            for row in part:
                rows.append(row)
                if progress:
                    progress(row)
    return rows


def _case_rows(task: tuple[int, int, int]) -> list[KernelRow]:
    """Return the rows of case ``index`` of :func:`cases` at ``n`` compiled for ``arch``."""
    n, arch, index = task
    name, elements, launch = cases(n)[index]
    rows = []
    with _recorded() as calls:
        launch()
    for kernel, grid, args, kwargs in calls:
        compiled, config = _compile(kernel, args, kwargs, arch)
        ops, loop, regs, stack = _machine_code(compiled.asm["cubin"])
        threads = 32 * compiled.metadata.num_warps
        executed = Counter(ops)  # what a program runs
        covered = elements
        if kernel.fn.__name__ in _STRIDED:  # the tile loop runs once a tile
            tiles = -(-elements // (grid[0] * kwargs["BLOCK"]))
            executed.update({op: count * (tiles - 1) for op, count in loop.items()})
            covered = min(elements, grid[0] * tiles * kwargs["BLOCK"])
        if kernel.fn.__name__ in _REPEATED:  # the loop runs once an item (a frame)
            items = args[kernel.arg_names.index(_REPEATED[kernel.fn.__name__])]
            executed.update({op: count * (items - 1) for op, count in loop.items()})
        programs = math.prod(grid)  # a grid of frames x blocks for qsgd_steps
        lanes = threads * programs / covered  # lane-instructions per instruction per element
        row = KernelRow(
            case=name, kernel=kernel.fn.__name__.strip("_").removesuffix("_kernel"),
            config=" ".join(f"{key}={value}" for key, value in config.items()),
            arch=arch, programs=programs, warps=compiled.metadata.num_warps,
            registers=regs, stack=stack, instructions=sum(ops.values()),
            per_element=sum(executed.values()) * lanes, loads=executed["LDG"] * lanes,
            stores=executed["STG"] * lanes)
        rows.append(row)
    return rows
