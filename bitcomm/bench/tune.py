"""Each Triton kernel's tile and warps against its neighbours, timed on a GPU.

The tiles and warps in ``TUNING`` (:data:`bitcomm.codecs._kernels.TUNING`,
:data:`bitcomm.collectives._kernels.TUNING`) were chosen offline from registers and instruction
counts (``bitcomm bench kernels``); which is fastest is for the GPU to say. For each setting
this benchmark times an operation that launches the kernel (a codec's encode or decode of the
benchmark vector, a collective's step, a check, a small top-k) with each neighbouring
configuration: half and twice the tile at the same warps, half and twice the warps at the same
tile. Each tried call alternates with a call of the configuration in the code
(:func:`~bitcomm.bench.codecs.time_against`), so the speedup (the code's median over the tried
one's) sees the same machine, and each output is compared with the one the code's
configuration gives: any power-of-two tile is meant to give the same bytes, and ``same`` says
whether it did (where a float sum feeds the output, a scaled sign frame's scale, another tile
adds in another order, which can move a rounding tie: such a ``same`` of False is a difference
of one bit, not a broken kernel).

:data:`~bitcomm.codecs._kernels.SMALL_TOP` gets rows of its own: at each size, the top-k in one
program against the radix passes, alternating, so that the threshold can sit where the one
program stops winning.

It needs the Triton path: a CUDA device (or CPU tensors under ``TRITON_INTERPRET=1`` with the
path forced, as the tests run it, where the times mean nothing).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Iterator

import torch

from bitcomm._sizes import human
from bitcomm.bench import heading
from bitcomm.bench.codecs import _cases, time_against, vector
from bitcomm.codecs import _frame, counts, qsgd

__all__ = ["Row", "run", "markdown", "neighbours", "settings", "SETTINGS", "UNSWEPT",
           "SMALL_TOP_SIZES"]

SETTINGS: dict[str, str] = {
    # the settings of the operations furthest below their targets first, so that a run cut
    # off by its deadline has measured them
    "qsgd_decode": "qsgd-4 decode",
    "qsgd_codes_fused": "qsgd-4 encode",
    "key_digits": "topk-1% encode",
    "top_write": "topk-1% encode",
    "score_stats": "redsync-trimmed-1% encode",
    "score_totals": "redsync-trimmed-1% encode",
    "count_step": "ring step 6 of 8",
    "planes_pack_checked": "counts-w2 encode",
    "planes_unpack": "counts-w2 decode",
    "sparse_frame": "sparse-fp32-1% encode",
    "sparse_scatter": "sparse-fp32-1% decode",
    "small_top": "top-k 1% of 32K",
    "radix_pack": "counts-radix-m2 encode",
    "radix_unpack": "counts-radix-m2 decode",
    "sign_pack": "sign encode",
    "sign_unpack": "sign decode",
    # the checks and steps of the collectives and DDP hooks
    "nonfinite": "finiteness check",
    "momentum": "momentum",
    "qsgd_mean": "qsgd-4 mean of 8 frames",
    "vote_count": "alltoall vote count of 8",
    "sign_error": "onebit sign+error",
    "weighted_votes": "onebit weighted votes of 8",
    "scaled_signs": "onebit scaled signs of 8",
    "partial_sums": "sign-scaled encode",
    "planes_pack": "counts-w2 encode, unchecked",
    "qsgd_codes": "qsgd-4 encode, bucket 1000",
    "qsgd_values": "qsgd-4 decode, bucket 1000",
}
"""Each ``TUNING`` entry swept, and the operation timed for it: every entry but those of
:data:`UNSWEPT`."""

UNSWEPT = {
    "sidco_stage": "its result is float64 sums, which another tile adds in another order: "
                   "no output to hold equal",
}
"""The ``TUNING`` entries :func:`run` leaves alone, and why."""

SMALL_TOP_SIZES = (4 << 10, 8 << 10, 16 << 10, 32 << 10, 64 << 10, 128 << 10)
"""The vector lengths at which the one-program top-k is timed against the radix passes."""

_MAX_WARPS = 16


@dataclasses.dataclass
class Row:
    """One tried configuration of a setting, timed call for call against another.

    ``setting``: the ``TUNING`` entry (or ``"SMALL_TOP"``); ``case``: the operation timed;
    ``n``: the length of the benchmark vector (the case names the part of it some operations
    take: a ring step's chunk, the small top-k's 32K) or of SMALL_TOP's scores; ``tried`` and
    ``against``: the two configurations (``"1024x4"``: a tile of 1024, 4 warps; for SMALL_TOP
    ``"one program"`` and ``"radix passes"``); ``seconds`` and ``against_seconds``: their
    medians, alternating; ``speedup``: ``against_seconds / seconds`` (above 1: the tried one
    is faster); ``same``: whether both gave the same output.
    """

    setting: str
    case: str
    n: int
    tried: str
    against: str
    seconds: float
    against_seconds: float
    speedup: float
    same: bool

    def as_dict(self) -> dict:
        """Return the row as a JSON-friendly dict."""
        return dataclasses.asdict(self)


def neighbours(block: int, warps: int) -> list[tuple[int, int]]:
    """Return the configurations next to ``(block, warps)``.

    Half and twice the tile (at least 8), then half and twice the warps (1 to 16), each with
    the other kept.
    """
    tried = [(block // 2, warps), (block * 2, warps), (block, warps // 2), (block, warps * 2)]
    return [(b, w) for b, w in tried if b >= 8 and 1 <= w <= _MAX_WARPS]


def settings(only: Iterable[str] | None = None) -> list[str]:
    """Return the settings :func:`run` sweeps for ``only`` (all, by default).

    Names of :data:`SETTINGS` and ``"SMALL_TOP"``; an unknown one is a ``ValueError``.
    """
    known = list(SETTINGS) + ["SMALL_TOP"]
    wanted = known if only is None else list(only)
    unknown = sorted(set(wanted) - set(known))
    if unknown:
        raise ValueError(f"unknown setting(s) {unknown}; expected some of {known}")
    return wanted


def _tables() -> dict[str, dict[str, tuple[int, int]]]:
    # every TUNING entry, by name, and the dict that holds it (codecs' and collectives')
    from bitcomm.codecs import _kernels as codec_kernels
    from bitcomm.collectives import _kernels as step_kernels

    out = {name: codec_kernels.TUNING for name in codec_kernels.TUNING}
    out.update({name: step_kernels.TUNING for name in step_kernels.TUNING})
    return out


def _operations(x: torch.Tensor, n: int, seed: int, wanted: set[str]
                ) -> dict[str, Callable[[], object]]:
    # The timed call of each wanted case. Decodes decode a frame their encoder made once.
    ops: dict[str, Callable[[], object]] = {}
    for codec, enc, dec, _ in _cases(x, n, seed):
        if f"{codec} encode" in wanted:
            ops[f"{codec} encode"] = enc
        if f"{codec} decode" in wanted:
            frame = enc()
            ops[f"{codec} decode"] = lambda d=dec, f=frame: d(f)
    builders = _builders(x, n, seed)
    ops.update({case: builders[case]() for case in wanted if case in builders})
    return ops


def _builders(x: torch.Tensor, n: int, seed: int) -> dict[str, Callable[[], Callable]]:
    # The operations that are not bench codecs' cases, each built only when wanted: a ring
    # or all-to-all step and 1-bit Adam's on the chunk of rank 0 of 8, the others on x.
    from bitcomm.collectives import _kernels as step_kernels

    kernels = _frame.kernels()
    gen = torch.Generator().manual_seed(seed)
    chunk = x[: -(-n // 8)]
    cb = (chunk.numel() + 7) // 8

    def random_bytes(*shape: int, high: int = 256) -> torch.Tensor:
        return torch.randint(0, high, shape, generator=gen, dtype=torch.uint8).to(x.device)

    def ring_step() -> Callable:  # a middle step: 3-plane counts of 5 ranks in, 3 out
        got = counts.pack(random_bytes(chunk.numel(), high=6), 5)
        return lambda: step_kernels.count_step(got, chunk, 3, 3)

    def small_top() -> Callable:
        small = x[: 32 << 10]
        return lambda: kernels.top_indices(small, max(1, small.numel() // 100))

    def momentum() -> Callable:
        m, out = torch.zeros_like(x), torch.empty_like(x)
        return lambda: (kernels.momentum(m, x, 0.9, out), out)[1]

    def mean_of_8() -> Callable:
        frames = [qsgd.encode(x, 4, seed=seed + r) for r in range(8)]
        return lambda: qsgd.mean_all(frames, n, 4, qsgd.DEFAULT_BUCKET)

    def sign_error() -> Callable:
        buf = x[: n - n % 8]
        error, scale = torch.empty_like(buf), buf.abs().mean()
        return lambda: (step_kernels.sign_error(buf, scale, error), error)

    def weighted_votes() -> Callable:
        votes, weights = random_bytes(8, cb), torch.rand(8, generator=gen).to(x.device)
        error = x[: 8 * cb]  # 1-bit Adam's error buffer: whole bytes of elements
        return lambda: step_kernels.weighted_votes(votes, weights, error)

    def scaled_signs() -> Callable:
        packed, scales = random_bytes((n + 7) // 8), torch.rand(8, generator=gen).to(x.device)
        return lambda: step_kernels.scaled_signs(packed, scales, n, chunk.numel())

    def unchecked_pack() -> Callable:
        c = random_bytes(n, high=4)
        return lambda: counts.pack(c, 3, check=False)

    def odd_bucket_decode() -> Callable:
        frame = qsgd.encode(x, 4, 1000, seed=seed)
        return lambda: qsgd.decode(frame, n=n)[0]

    def vote_count() -> Callable:
        votes = random_bytes(8, cb)
        return lambda: step_kernels.vote_count(votes, chunk.numel())

    return {
        "ring step 6 of 8": ring_step,
        "top-k 1% of 32K": small_top,
        "finiteness check": lambda: (lambda: kernels.nonfinite(x)),
        "momentum": momentum,
        "qsgd-4 mean of 8 frames": mean_of_8,
        "alltoall vote count of 8": vote_count,
        "onebit sign+error": sign_error,
        "onebit weighted votes of 8": weighted_votes,
        "onebit scaled signs of 8": scaled_signs,
        "counts-w2 encode, unchecked": unchecked_pack,
        "qsgd-4 encode, bucket 1000": lambda: (lambda: qsgd.encode(x, 4, 1000, seed=seed)),
        "qsgd-4 decode, bucket 1000": odd_bucket_decode,
    }


def _same(a: object, b: object) -> bool:
    if a is None or b is None:
        return a is b
    if isinstance(a, tuple):
        return isinstance(b, tuple) and len(a) == len(b) and all(map(_same, a, b))
    return isinstance(b, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype \
        and bool(torch.equal(a, b))


def _with(table: dict, name: str, config: object, fn: Callable[[], object]
          ) -> Callable[[], object]:
    # fn with table[name] at config for the call's launches, the code's value back after
    def call() -> object:
        kept = table[name]
        table[name] = config
        try:
            return fn()
        finally:
            table[name] = kept
    return call


def _label(config: tuple[int, int]) -> str:
    return f"{config[0]}x{config[1]}"


def run(n: int = 64 << 20, device: str | torch.device = "cuda", *, repeat: int = 10,
        seed: int = 0, only: Iterable[str] | None = None,
        small_top_sizes: Iterable[int] = SMALL_TOP_SIZES,
        progress: Callable[[Row], None] | None = None) -> list[Row]:
    """Time each setting's neighbours (:data:`SETTINGS`), then SMALL_TOP; return the rows.

    Args:
        n: elements of the benchmark vector (the ring step takes an eighth of it, the small
            top-k its first 32K).
        device: a CUDA device; CPU tensors only under ``TRITON_INTERPRET=1`` with the Triton
            path forced (a ``RuntimeError`` otherwise: ``TUNING`` reaches only Triton's
            launches).
        repeat: timed calls per configuration (median), after a warm-up that compiles it.
        seed: seed of the test data.
        only: the settings to sweep (names of :data:`SETTINGS`, or ``"SMALL_TOP"``); all by
            default. An unknown name is a ``ValueError``, before anything runs.
        small_top_sizes: the lengths of SMALL_TOP's rows.
        progress: called with each row as soon as it is measured.

    """
    wanted = settings(only)
    sizes = list(small_top_sizes)
    if "SMALL_TOP" in wanted and (not sizes or any(s < 1 for s in sizes)):
        raise ValueError(f"expected small_top_sizes >= 1, got {sizes}")
    device = torch.device(device)
    x = vector(n, seed, device)
    if not _frame.use_triton(x):
        raise RuntimeError("bench tune times Triton's launches: expected a CUDA device with "
                           "triton installed")
    rows = []
    for row in _swept(x, n, seed, wanted, sizes, repeat, device):
        rows.append(row)
        if progress is not None:
            progress(row)
    return rows


def _swept(x: torch.Tensor, n: int, seed: int, wanted: list[str], sizes: list[int],
           repeat: int, device: torch.device) -> Iterator[Row]:
    tables = _tables()
    ops = _operations(x, n, seed, {SETTINGS[s] for s in wanted if s in SETTINGS})
    for name in (s for s in SETTINGS if s in wanted):
        case, table = SETTINGS[name], tables[name]
        fn, current = ops[case], table[name]
        reference = fn()
        for config in neighbours(*current):
            tried = _with(table, name, config, fn)
            same = _same(tried(), reference)
            t, against = time_against(tried, fn, repeat, device)
            yield Row(name, case, x.numel(), _label(config), _label(current), t, against,
                      against / t, same)
    if "SMALL_TOP" in wanted:
        yield from _small_top(seed, sizes, repeat, device)


def _small_top(seed: int, sizes: list[int], repeat: int, device: torch.device
               ) -> Iterator[Row]:
    from bitcomm.codecs import _kernels

    for size in sizes:
        scores = vector(size, seed, device)
        k = max(1, size // 100)

        def top(scores: torch.Tensor = scores, k: int = k) -> torch.Tensor:
            return _kernels.top_indices(scores, k)

        # the module's globals are the table SMALL_TOP stands in
        one, radix = (_with(vars(_kernels), "SMALL_TOP", size, top),
                      _with(vars(_kernels), "SMALL_TOP", 0, top))
        same = _same(one(), radix())
        t, against = time_against(one, radix, repeat, device)
        yield Row("SMALL_TOP", "top-k 1%", size, "one program", "radix passes", t, against,
                  against / t, same)


def markdown(rows: list[Row], config: dict, command: str) -> str:
    """Return the rows as a Markdown table, headed by its date, machine and command.

    One line a tried configuration: the setting, the operation, the two configurations, their
    medians and the speedup; the best of each setting's, where it beats the code's, in bold.
    """
    best: dict[str, Row] = {}
    for r in rows:
        if r.same and r.speedup > 1 and (r.setting not in best
                                         or r.speedup > best[r.setting].speedup):
            best[r.setting] = r
    out = heading(config, command) + [
        "| setting | operation | n | tried | against | tried (us) | against (us) | speedup | "
        "same output |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        speedup = f"{r.speedup:.2f}" if math.isfinite(r.speedup) else "-"
        if best.get(r.setting) is r and r.setting != "SMALL_TOP":
            speedup = f"**{speedup}**"
        out.append(f"| {r.setting} | {r.case} | {human(r.n)} | {r.tried} | {r.against} | "
                   f"{r.seconds * 1e6:.1f} | {r.against_seconds * 1e6:.1f} | {speedup} | "
                   f"{'yes' if r.same else 'NO'} |")
    return "\n".join(out) + "\n"
