"""Triton kernels for the codecs' GPU path: each writes the same bytes as the numpy path.

One kernel per codec operation, launched from the codec's ``triton`` branch (CUDA tensors when
triton is installed; CPU tensors under ``TRITON_INTERPRET=1`` in the tests). They are written for
memory speed: every input byte is read once, in wide tiles, and sizes arrive as arguments, so a
launch never waits for the device.

* :func:`momentum`: the optimizers' and hooks' ``beta * m + (1 - beta) * g``, torch's bits, in
  one read of ``m`` and ``g``.
* :func:`sign_pack` / :func:`sign_unpack`: a ``[BLOCK, 8]`` tile of elements per ``BLOCK`` bytes;
  a byte is the sum of its eight shifted ``x >= 0`` bits. :func:`partial_sums`: the float64
  block sums behind a scaled frame's RMS or mean-abs scale.
* :func:`planes_pack` / :func:`planes_unpack`: :mod:`bitcomm.codecs.bits` planes, all ``W``
  planes of a tile from one read of the values; with ``G > 1`` a value is a base-``(m + 1)`` group
  of ``G`` counts (:mod:`bitcomm.codecs.counts` radix), composed or split inside the kernel
  (split by ``_radix_unpack_kernel``, one code per lane).
* :func:`qsgd_codes` / :func:`qsgd_decode`: the whole qsgd encoder (bucket max, the counter
  hash of :mod:`bitcomm.codecs._rng`, fixed-point stochastic rounding, packing, the header) in
  one pass when the bucket is a power of two up to :data:`MAX_FUSED_BUCKET` (into a frame
  of its own: :func:`qsgd_frame`); otherwise with per-bucket factors computed by torch. The
  decoder multiplies each level by its bucket's step, computed in the same pass for a
  power-of-two bucket (else by :func:`qsgd_steps`, then :func:`qsgd_values`);
  :func:`qsgd_mean` decodes many frames at once and writes only their mean.
* :func:`sparse_scatter`: a sparse frame's entries written into their dense vector, its rules
  checked in the same pass; :func:`sparse_frame`: a frame written from its entries (or from a
  vector at its indices), the header, indices and values or a float64 mean in one pass over
  them, checked in it.
* :func:`sidco_stage`: one stage of :mod:`bitcomm.codecs.sidco`'s fits, the float64 sums of
  the scores scaled by the largest (of a later stage's exceedances) in one read.
* :func:`score_stats` / :func:`count_above` / :func:`indices_above`: the passes of
  :mod:`bitcomm.codecs.select`'s threshold searches (mean, max and finiteness; how many scores
  exceed each of a few dozen thresholds; the indices of those above the chosen one, whose
  number the counts gave, written without a host read), computing RedSync's one-sided scores
  ``max(+-x, 0)`` as they read ``x``.
* :func:`top_indices`: the exact top-k by radix selection on the scores' order-preserving
  integer keys (one 256-bin histogram pass per key byte, the digit chosen on the device), over
  candidates gathered in index order: from 2**18 scores the keys at or above a bound read off a
  sample (:mod:`~bitcomm.codecs._bracket`), else, after two bytes, the keys that share or beat
  the k-th largest's. The passes and the writing of the chosen indices read only those: two or
  three reads of ``x``, no sort and no host read. From a sampled bound its count pass can
  also find NaN / inf in ``x``, and its writing pass count the positive scores chosen
  (``census``): a caller's check and RedSync's count of the side's sign, without a read of
  their own. Up to
  :data:`SMALL_TOP` scores (a DDP bucket's) the whole selection is one program.

Decoders also set a one-element flag when the payload breaks a rule (non-zero padding, a count
above ``m``, a radix code out of range): one reduction per program, one store if it is set. The
codec turns a set flag into its usual ``ValueError`` by re-running its torch path, so messages
are the same on every path. The end of a payload (padding, the last partial tile) is the last
program's business only: the bit-plane and sign decoders launch their full tiles without masks
or padding checks and the last tile apart (:func:`launch_tiles`).

Tile sizes and warps are in :data:`TUNING`. Tiles are addressed by global int64 offsets: on an
H100, 32-bit offsets from a 64-bit base with masks against the tile's remaining length made sign
unpack slower (0.35 of the HBM read instead of 0.57 at 64M elements, in separate runs), most
likely because triton cannot prove such a mask constant over a vector and splits the accesses.

Floating-point results match the CPU bit for bit because every operation is one correctly
rounded IEEE operation in the same order: ``div_rn`` for the reciprocal (Triton's ``/`` is an
approximate division on GPUs) and launches with ``enable_fp_fusion=False`` (a multiply followed
by an add must not become one fused multiply-add, which rounds once instead of twice).
"""

from __future__ import annotations

import functools
import math
import struct

import numpy as np
import torch
import triton
import triton.language as tl

from bitcomm.codecs import _bracket, _frame, _rng
from bitcomm.codecs._launch import launch, replayed, replays

__all__ = ["launch", "launch_tiles", "nonfinite", "momentum", "sign_pack", "sign_unpack",
           "partial_sums", "planes_pack", "planes_unpack", "qsgd_codes", "qsgd_frame",
           "qsgd_decode", "qsgd_steps", "qsgd_values", "qsgd_mean", "score_stats", "count_above",
           "Runs", "kth_largest", "top_indices", "indices_above", "sidco_stage", "SIDCO_KINDS",
           "MAX_FUSED_BUCKET", "DIGIT", "SLACK", "sparse_scatter", "SPARSE_VALUES",
           "sparse_frame", "SPARSE_ENCODES", "SMALL_TOP"]

MAX_FUSED_BUCKET = 4096
"""Largest qsgd bucket whose scale the encoder computes inside the quantising pass."""

TUNING: dict[str, tuple[int, int]] = {
    # kernel: (bytes per program and plane -- elements for qsgd_codes and partial_sums, codes
    # for radix_unpack --, warps)
    "sign_pack": (1024, 4),
    "sign_unpack": (512, 4),
    "partial_sums": (8192, 4),
    "sidco_stage": (1024, 4),  # elements, as float64
    "nonfinite": (4096, 4),  # elements of 32 bits or fewer (half as many of float64)
    "momentum": (2048, 4),  # elements
    "planes_pack": (1024, 4),
    # the range check's reduction keeps a tile's values live: 80 registers at 1024 (sm_90)
    "planes_pack_checked": (512, 4),
    "radix_pack": (128, 4),
    "planes_unpack": (128, 4),
    "radix_unpack": (512, 4),
    # elements; a program codes a tile and its partner 2**15 elements on from one hash each
    # (_pair_random16): at 4 warps the tiles' values took 64-119 registers (sm_90; triton
    # 3.6: 72-149), at 8 40-64
    "qsgd_codes": (2048, 8),
    # elements a warp; a bucket's max is a reduction: inside one warp, buckets of up to 512
    # compiled to 25.5 instructions an element at 4 bits (64 registers), 33.8 with 2048
    # elements on 4 warps (a reduction across warps through shared memory; 92) (sm_90). A
    # larger bucket takes a warp a 512 elements, up to 8 (a bucket of 4096: 64 registers;
    # on 4 warps 128, triton 3.6: 168)
    "qsgd_codes_fused": (512, 1),
    "qsgd_values": (1024, 4),
    # code bytes: a thread computes the step of every bucket of its program's tile (four byte
    # loads and a division each), so fewer threads a tile do less of it: at 4 warps a bucket
    # of 512 cost 24 instructions an element at 4 bits, at 2 warps 16.5 (sm_90)
    "qsgd_decode": (1024, 2),
    "qsgd_mean": (1024, 4),  # elements: a sum and a kept value each, in registers
    # entries; each is some 83 instructions (its index, the one before it and its value put
    # together byte by byte, masked): at 1024, 48-64 registers (sm_90), at 512 32
    "sparse_scatter": (512, 4),
    "sparse_frame": (1024, 4),  # entries: 19-31 instructions each, 32-48 registers (sm_90)
    # elements a tile; a lane keeps its four sums over its program's run of tiles: 63-64
    # registers at 1024 (sm_90), 118 at 2048
    "score_stats": (1024, 4),
    "score_totals": (1024, 4),  # score_stats' rows a step of its one program
    "key_digits": (1024, 4),  # elements per tile
    "top_write": (1024, 4),  # elements, fewer than 2**16
    # elements a tile of the one program: 16 warps keep 4096 loads in flight, at 77-78
    # registers (sm_90; at 8 warps 106-142, at 2048 elements float64 spilled)
    "small_top": (4096, 16),
}
"""Tile size and warps of each kernel's launch; any power of two from 8 is correct (the tests
run the kernels at the smallest sizes too).

The tiles were chosen offline (``bitcomm bench kernels``) to keep each kernel near or below 64
registers per thread on sm_90, without spills: 128 threads at 64 registers let 8 programs (32
warps) share an SM, enough to hide the latency of one warp's dependent integer operations. On
an H100 the plain bit-plane decoder at 1024 bytes a program read 1.00, 0.72, 0.56-0.69 and
0.42-0.52 of the HBM read for 1, 2, 3 and 4 planes, at 32, 111-127, 168 and 254 registers and
about 20, 32-36, 34 and 44 instructions an element: the ratio tracked the registers more than
the instructions. Kernels already at or below 64 registers keep the tiles measured there.
``bitcomm bench codecs --device cuda`` is the measurement of a change; ``bitcomm bench tune``
times each entry against half and twice its tile and warps."""


def _cdiv(total: int, per: int) -> int:
    # ceil(total / per) for the launches' host arithmetic. triton.cdiv is a plain function in
    # some releases and a constexpr function in others (3.9), whose argument unwrapping costs
    # microseconds of host time a call, on every launch.
    return -(-total // per)


def _grid(total: int, per: int) -> tuple[int]:
    return (max(1, _cdiv(total, per)),)


def _config(name: str) -> tuple[int, dict]:
    block, warps = TUNING[name]
    return block, {"num_warps": warps}


# --- shared pieces ---------------------------------------------------------------------------


@triton.jit
def _neg(x):
    # -x of a float, its sign flipped at zero too (-(+0.0) is -0.0, as in torch): Triton
    # before 3.8 (torch 2.11 ships 3.6) compiles unary minus on floats as 0 - x, which gives
    # +0.0. A product by -1 is exact and keeps x's dtype.
    return x * -1.0


@triton.jit
def _load(ptr, live, other, EDGE: tl.constexpr):
    # A tile's load: masked by `live` in the last tile only (EDGE), whose lanes may lie past
    # the end; a full tile's needs no mask (launch_tiles).
    if EDGE:
        value = tl.load(ptr, mask=live, other=other)
    else:
        value = tl.load(ptr)
    return value


@triton.jit
def _store(ptr, value, live, EDGE: tl.constexpr):
    # A tile's store, masked as _load masks.
    if EDGE:
        tl.store(ptr, value, mask=live)
    else:
        tl.store(ptr, value)


@triton.jit
def _flag(flags_ptr, bad):
    # Record a broken rule: one reduction over the program's tile, one store if it is set.
    # (A store from each lane that sees one, masked, costs a predicated store and its address
    # for every element.)
    hit = tl.max(bad.to(tl.int32))
    tl.store(flags_ptr, hit, mask=hit != 0)


def _flag_buffer(checked: bool, device: torch.device) -> torch.Tensor | None:
    # A kernel's flag, zeroed; None where no payload of the size can break a rule, so that
    # the caller reads nothing (a host read waits for the device). The kernel then takes
    # its output for the flag's pointer: it stores a flag only where a rule is broken.
    return torch.zeros(1, dtype=torch.int32, device=device) if checked else None


@triton.jit
def _le_bytes(ptr, live, WIDTH: tl.constexpr, EDGE: tl.constexpr):
    # The little-endian integer of the WIDTH bytes at each of ptr (uint8 pointers of any
    # alignment: the fields behind a frame's header, 14 bytes for qsgd and 17 for sparse, lie
    # off their alignment): int32 for up to 4 bytes, else int64. Loads masked by `live` with
    # EDGE only, as _load masks them.
    if WIDTH > 4:
        word = tl.zeros(ptr.shape, dtype=tl.int64)
        for b in tl.static_range(WIDTH):
            word |= _load(ptr + b, live, 0, EDGE).to(tl.int64) << (8 * b)
    else:
        word = tl.zeros(ptr.shape, dtype=tl.int32)
        for b in tl.static_range(WIDTH):
            word |= _load(ptr + b, live, 0, EDGE).to(tl.int32) << (8 * b)
    return word


HEAD_WORDS = ("head0", "head1")
"""The header-word arguments of the kernels that write a frame's header (_store_head).

A launch makes an int argument equal to 1 a compile-time constant (a Python int in the kernel,
with no ``.to``) and compiles a variant for it, and one for a multiple of 16. Arguments that
carry data (header words, a float's bits, k, qsgd's stream key) are left unspecialised
(``do_not_specialize``): any value may be 1 or a multiple of 16 (a key drawn from a generator
once in sixteen draws), and a value is no reason for another compile."""


@triton.jit
def _head_bytes(head0, head1):
    # The 16 bytes of head0 then head1, little-endian: a header of up to 16 bytes.
    h = tl.arange(0, 16)
    word = tl.where(h < 8, head0.to(tl.int64), head1.to(tl.int64))
    return ((word >> (8 * (h % 8))) & 255).to(tl.uint8)


@triton.jit
def _store_head(ptr, head0, head1, HEAD: tl.constexpr):
    # A frame's first HEAD (<= 16) bytes: head0's, then head1's.
    h = tl.arange(0, 16)
    tl.store(ptr + h, _head_bytes(head0, head1), mask=h < HEAD)


@triton.jit
def _head_differs(ptr, head0, head1, HEAD: tl.constexpr):
    # Whether a frame's first HEAD (<= 16) bytes differ from head0's, then head1's.
    h = tl.arange(0, 16)
    mine = h < HEAD
    got = tl.load(ptr + h, mask=mine, other=0)
    return mine & (got != _head_bytes(head0, head1))


@triton.jit(do_not_specialize=HEAD_WORDS)
def _head_kernel(ptr, head0, head1, HEAD: tl.constexpr):
    _store_head(ptr, head0, head1, HEAD)


def _head_words(data: bytes) -> tuple[int, int]:
    # A header of up to 16 bytes as the two words _store_head takes, read as signed int64:
    # triton would type an int argument in [2**63, 2**64) as uint64. It types one in
    # [2**31, 2**32) as uint32 and a smaller one as int32; the kernel widens each to int64
    # before it shifts.
    if len(data) > 16:
        raise ValueError(f"expected a header of at most 16 bytes, got {len(data)}")
    return struct.unpack("<qq", data.ljust(16, b"\0"))


def launch_tiles(kernel, tiles: int, full: int, *args, **kwargs) -> None:
    """Launch a kernel over ``tiles`` tiles, the ``full`` ones apart from the last one.

    The ``full`` tiles, whose elements all lie before the end, run as ``EDGE=False`` programs
    without masks or padding checks; the rest (one tile at most) as ``EDGE=True``. The kernel
    takes the index of its first tile after ``args``. Compiled for sm_90 (``bitcomm bench
    kernels``), masks and checks of the end in every program made sign decode 24 instructions
    an element, a full tile without them 7.5; the plain-plane decoder 22-49 for 1 to 4 planes,
    6-18 without; the radix decoder 34-58, 26-48 without.
    """
    if full:
        launch(kernel, (full,), *args, 0, EDGE=False, **kwargs)
    if tiles > full:
        launch(kernel, (tiles - full,), *args, full, EDGE=True, **kwargs)


# --- finiteness (every codec's and collective's input check) ---------------------------------

_EXPONENT = {torch.float16: (torch.int16, 0x7C00), torch.bfloat16: (torch.int16, 0x7F80),
             torch.float32: (torch.int32, 0x7F800000),
             torch.float64: (torch.int64, 0x7FF0000000000000)}
"""Each float dtype's integer view and exponent mask: all ones is inf or NaN."""


@triton.jit
def _nonfinite_kernel(bits_ptr, flags_ptr, n, EXP: tl.constexpr, NARROW: tl.constexpr,
                      ZERO: tl.constexpr, BLOCK: tl.constexpr):
    # flags[0]: an element is NaN or inf (its exponent bits all ones); with NARROW (float64
    # bits) flags[1]: one is not finite once rounded to float32 (NaN, inf, or beyond its range).
    # With ZERO the flagged elements (of flags[1] with NARROW) become +0.0 in place: a store
    # only where one is flagged, so a finite vector is still only read.
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    bits = tl.load(bits_ptr + i, mask=i < n, other=0)
    bad = (bits & EXP) == EXP
    _flag(flags_ptr, bad)
    if NARROW:
        y = bits.to(tl.float64, bitcast=True).to(tl.float32).to(tl.int32, bitcast=True)
        bad = (y & 0x7F800000) == 0x7F800000
        _flag(flags_ptr + 1, bad)
    if ZERO:  # the padding lanes load 0, which is finite: no mask of the end needed
        tl.store(bits_ptr + i, tl.zeros_like(bits), mask=bad)


def nonfinite(x: torch.Tensor, narrow: bool = False, zero: bool = False) -> torch.Tensor:
    """Return int32 ``[bad, bad_as_float32]`` on ``x``'s device, flags of NaN or inf.

    ``bad`` is non-zero where ``x`` holds NaN or inf, ``bad_as_float32`` (with ``narrow``,
    float64 ``x``) where it does once rounded to float32; it stays 0 without ``narrow``. One
    read of ``x`` and no host read, where torch's ``isfinite(x).all()`` is five kernels and
    about five passes of traffic. With ``zero`` (a contiguous ``x``) the elements it flags
    (with ``narrow``: those not finite as float32) are set to +0.0 in place, in the same read.
    """
    if x.dtype not in _EXPONENT:
        raise TypeError(f"expected a floating-point tensor, got {x.dtype}")
    if narrow and x.dtype != torch.float64:
        raise ValueError(f"narrow takes float64, got {x.dtype}")
    if zero and not x.is_contiguous():
        raise ValueError("zero writes in place: expected a contiguous tensor")
    flags = torch.zeros(2, dtype=torch.int32, device=x.device)
    n = x.numel()
    if n:
        view, exp = _EXPONENT[x.dtype]
        block, opts = _config("nonfinite")
        block //= max(1, x.element_size() // 4)  # the same bytes a tile: float64's registers
        launch(_nonfinite_kernel, _grid(n, block), x.detach().reshape(-1).view(view), flags, n,
               EXP=exp, NARROW=narrow, ZERO=zero, BLOCK=block, **opts)
    return flags


# --- momentum (the optimizers' and hooks' running average) ---------------------------------


@triton.jit
def _momentum_kernel(m_ptr, g_ptr, out_ptr, beta, keep, n, BLOCK: tl.constexpr):
    # out = beta * m + keep * g, rounded as torch's m.mul(beta).add_(g, alpha=keep) rounds it:
    # the product, then one fused multiply-add (what torch's add with alpha is on CPU and CUDA).
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = i < n
    m = tl.load(m_ptr + i, mask=live, other=0.0)
    g = tl.load(g_ptr + i, mask=live, other=0.0).to(tl.float32)
    tl.store(out_ptr + i, tl.fma(g, keep, m * beta), mask=live)


def momentum(m: torch.Tensor, g: torch.Tensor, beta: float, out: torch.Tensor) -> None:
    """Write ``beta * m + (1 - beta) * g`` into ``out`` (which may be ``m``) in one pass.

    ``m`` and ``out`` are contiguous float32, ``g`` a contiguous float tensor of their length,
    rounded to float32 as it is read (a 16-bit gradient needs no widened copy). The two
    coefficients are float32, as torch rounds a Python scalar for float32 tensors.
    """
    if m.dtype != torch.float32 or out.dtype != torch.float32:
        raise TypeError(f"expected float32 momentum and output, got {m.dtype} and {out.dtype}")
    if g.dtype not in _EXPONENT:
        raise TypeError(f"expected a floating-point gradient, got {g.dtype}")
    if not (m.numel() == g.numel() == out.numel()):
        raise ValueError(f"expected momentum, gradient and output of one length, got "
                         f"{m.numel()}, {g.numel()} and {out.numel()}")
    if not (m.is_contiguous() and g.is_contiguous() and out.is_contiguous()):
        raise ValueError("expected contiguous momentum, gradient and output")
    n = m.numel()
    if n:
        block, opts = _config("momentum")
        launch(_momentum_kernel, _grid(n, block), m, g.detach(), out, float(beta),
               1.0 - float(beta), n, BLOCK=block, enable_fp_fusion=False, **opts)


# --- sign ---------------------------------------------------------------------------------------


@triton.jit
def _sign_pack_kernel(x_ptr, out_ptr, n, nbytes, BLOCK: tl.constexpr, WIDEN: tl.constexpr):
    ob = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    j = tl.arange(0, 8)
    idx = ob[:, None] * 8 + j[None, :]
    # Padding elements load as -1, which packs as a zero bit.
    x = tl.load(x_ptr + idx, mask=idx < n, other=-1.0)
    if WIDEN:  # 16-bit floats compare as float32 (exact; the interpreter needs it for bf16)
        x = x.to(tl.float32)
    byte = tl.sum((x >= 0).to(tl.int32) << (7 - j)[None, :], axis=1)
    tl.store(out_ptr + ob, byte.to(tl.uint8), mask=ob < nbytes)


def sign_pack(x: torch.Tensor) -> torch.Tensor:
    """Return ``np.packbits(x >= 0)`` of a contiguous 1-D float tensor, on its device."""
    n = x.numel()
    nbytes = (n + 7) // 8
    out = torch.empty(nbytes, dtype=torch.uint8, device=x.device)
    if nbytes:
        block, opts = _config("sign_pack")
        launch(_sign_pack_kernel, _grid(nbytes, block), x, out, n, nbytes, BLOCK=block,
               WIDEN=x.element_size() == 2, **opts)
    return out


@triton.jit
def _sign_unpack_kernel(buf_ptr, out_ptr, scale, n, nbytes, flags_ptr, first,
                        BLOCK: tl.constexpr, EDGE: tl.constexpr):
    ob = (first + tl.program_id(0)).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    j = tl.arange(0, 8)
    idx = ob[:, None] * 8 + j[None, :]
    byte = _load(buf_ptr + ob, ob < nbytes, 0, EDGE).to(tl.int32)
    bit = (byte[:, None] >> (7 - j)[None, :]) & 1
    # scale * +-1 is exact, so a scaled frame decodes to exactly +-scale.
    val = tl.where(bit != 0, scale, _neg(scale)).to(out_ptr.dtype.element_ty)
    _store(out_ptr + idx, val, idx < n, EDGE)
    if EDGE:
        _flag(flags_ptr, (bit != 0) & (idx >= n))  # set padding bits


@functools.lru_cache(maxsize=64)
def _rounded_scale(scale: float, sign: float, dtype: torch.dtype) -> float:
    # +-scale rounded to the output dtype here, as torch rounds scale * (+-1): the kernel's
    # store is then exact whatever rounding its conversion uses (the interpreter truncates
    # float32 to bfloat16; compiled kernels round to nearest). Cached: the majorities unpack
    # +-1 several times a call, and the conversion costs a few microseconds of host time.
    # `sign` keeps -0.0 apart from 0.0, which compare (and hash) equal.
    return float(torch.tensor(scale, dtype=torch.float32).to(dtype))


def sign_unpack(buf: torch.Tensor, n: int, dtype: torch.dtype, scale: float = 1.0, *,
                out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Return ``(values, flags)``: ``n`` values ``+-scale`` of ``dtype``; flags mark bad padding.

    ``out`` (contiguous, ``n`` elements) receives the values instead of a new tensor. ``flags``
    is ``None`` when ``n`` is a multiple of 8: no padding bits, nothing to check or wait for.
    """
    nbytes = buf.numel()
    if out is None:
        out = torch.empty(n, dtype=dtype, device=buf.device)
    scale = _rounded_scale(scale, math.copysign(1.0, scale), out.dtype)
    flags = _flag_buffer(n % 8 != 0, buf.device)
    if nbytes:
        block, opts = _config("sign_unpack")
        launch_tiles(_sign_unpack_kernel, _grid(nbytes, block)[0], n // (8 * block), buf, out,
                      scale, n, nbytes, out if flags is None else flags, BLOCK=block, **opts)
    return out, flags


@triton.jit
def _partial_sums_kernel(x_ptr, out_ptr, n, SQUARES: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    i = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + i, mask=i < n, other=0.0).to(tl.float64)
    tl.store(out_ptr + pid, tl.sum(x * x if SQUARES else tl.abs(x), axis=0))


def partial_sums(x: torch.Tensor, squares: bool) -> torch.Tensor:
    """Return float64 partial sums of ``x**2`` (or ``|x|``) over blocks of ``x``: one read of x.

    The scale of a scaled sign frame is their sum; float64 keeps it the same float32 value
    whatever the order of the additions (up to vanishingly rare rounding ties).
    """
    n = x.numel()
    block, opts = _config("partial_sums")
    grid = _grid(n, block)
    out = torch.empty(grid[0], dtype=torch.float64, device=x.device)
    launch(_partial_sums_kernel, grid, x, out, n, SQUARES=squares, BLOCK=block, **opts)
    return out


# --- SIDCo's fitting stages (bitcomm.codecs.sidco) -------------------------------------------

SIDCO_KINDS = ("exponential", "pareto", "gamma")
"""What a SIDCo stage sums (:func:`sidco_stage`): the kinds of fit it feeds."""


@triton.jit(do_not_specialize=("top_bits", "eta_bits"))
def _sidco_stage_kernel(x_ptr, top_ptr, top_bits, eta_bits, out_ptr, n, KIND: tl.constexpr,
                        FIRST: tl.constexpr, WIDEN: tl.constexpr, BLOCK: tl.constexpr):
    # One program's row of a stage's sums over y = x / top (float64, correctly rounded; the
    # first stage's top is read from top_ptr, where the range pass left it): the first stage
    # takes every y, a later one those with y >= eta. Row: count, least y, largest y (a later
    # stage's: the first's range is the range pass's), then for KIND 0 (exponential) the sum
    # of z = y - eta; 1 (pareto) the tile's mean of z and its squared deviations from that
    # mean (combined across tiles by Chan et al.'s update); 2 (gamma) the count, sum and sum
    # of logs of the positive y. A later stage's top and every stage's eta arrive as their
    # float64 bits (a float argument would be float32).
    pid = tl.program_id(0)
    i = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = i < n
    x = tl.load(x_ptr + i, mask=live, other=0.0)
    if WIDEN:  # 16-bit floats widen through float32 (exact; the interpreter needs it for bf16)
        x = x.to(tl.float32)
    eta = eta_bits.to(tl.int64).to(tl.float64, bitcast=True)
    if FIRST:
        top = tl.load(top_ptr).to(tl.float64)
    else:
        top = top_bits.to(tl.int64).to(tl.float64, bitcast=True)
    y = x.to(tl.float64) / top  # float64 "/" is div.rn.f64: correctly rounded
    if FIRST:
        taken = live
    else:
        taken = live & (y >= eta)
    count = tl.sum(taken.to(tl.int32), axis=0).to(tl.float64)
    row = out_ptr + pid.to(tl.int64) * 6
    tl.store(row, count)
    if not FIRST:  # the first stage's range is the range pass's
        tl.store(row + 1, tl.min(tl.where(taken, y, float("inf")), axis=0))
        tl.store(row + 2, tl.max(tl.where(taken, y, -float("inf")), axis=0))
    z = tl.where(taken, y - eta, 0.0)
    if KIND == 0:
        tl.store(row + 3, tl.sum(z, axis=0))
    elif KIND == 1:
        mean = tl.sum(z, axis=0) / tl.maximum(count, 1.0)
        dev = tl.where(taken, z - mean, 0.0)
        tl.store(row + 3, mean)
        tl.store(row + 4, tl.sum(dev * dev, axis=0))
    else:
        pos = taken & (y > 0)
        tl.store(row + 3, tl.sum(pos.to(tl.int32), axis=0).to(tl.float64))
        tl.store(row + 4, tl.sum(tl.where(pos, y, 0.0), axis=0))
        tl.store(row + 5, tl.sum(tl.log(tl.where(pos, y, 1.0)), axis=0))


def _float64_bits(value: float) -> int:
    # A float64 as the signed integer of its bits: a kernel argument that keeps every bit.
    return int(np.array(float(value), dtype=np.float64).view(np.int64))


def sidco_stage(x: torch.Tensor, kind: str, top: torch.Tensor | float, eta: float = 0.0
                ) -> torch.Tensor:
    """Return a SIDCo stage's float64 sums over ``y = x / top`` on ``x``'s device: one read.

    ``x``: contiguous float scores; ``top``: the first stage's largest score as a 0-d device
    tensor (every ``y`` is taken), or a later stage's as a float (the ``y >= eta`` are
    taken). Returns ``[count, least, largest, *sums]`` (``least`` and ``largest`` of a later
    stage's ``y``; 0 in the first, whose range the caller has read to give ``top``), the sums
    of :data:`SIDCO_KINDS`' ``kind`` over ``z = y - eta``: ``[sum]`` (exponential),
    ``[mean, squared deviations]`` (pareto), ``[positive count, their sum, their sum of
    logs]`` of ``y`` (gamma). ``y`` is each score's correctly rounded float64 quotient, as
    the numpy path divides; nothing the size of ``x`` is written (per program a row of six
    float64, added up by torch).
    """
    if kind not in SIDCO_KINDS:
        raise ValueError(f"expected kind in {SIDCO_KINDS}, got {kind!r}")
    if x.dtype not in _EXPONENT or not x.is_contiguous():
        raise TypeError(f"expected contiguous float scores, got {x.dtype}")
    first = isinstance(top, torch.Tensor)
    n = x.numel()
    block, opts = _config("sidco_stage")
    grid = _grid(n, block)
    rows = torch.zeros((grid[0], 6), dtype=torch.float64, device=x.device)
    k = SIDCO_KINDS.index(kind)
    if n:
        launch(_sidco_stage_kernel, grid, x.detach().reshape(-1), top if first else rows,
               0 if first else _float64_bits(top), _float64_bits(eta), rows, n, KIND=k,
               FIRST=first, WIDEN=x.element_size() == 2, BLOCK=block, enable_fp_fusion=False,
               **opts)
    count = rows[:, 0].sum()
    ends = [rows[:, 1].min(), rows[:, 2].max()]
    if k == 0:
        sums = [rows[:, 3].sum()]
    elif k == 1:
        # Chan, Golub and LeVeque: the tiles' means and squared deviations, combined exactly
        mean = (rows[:, 0] * rows[:, 3]).sum() / count.clamp(min=1)  # none taken: 0
        spread = rows[:, 4].sum() + (rows[:, 0] * (rows[:, 3] - mean) ** 2).sum()
        sums = [mean, spread]
    else:
        sums = [rows[:, 3].sum(), rows[:, 4].sum(), rows[:, 5].sum()]
    return torch.stack([count, *ends, *sums])


# --- bit planes (bits, counts fixed and radix) ------------------------------------------------


@triton.jit
def _planes_pack_kernel(v_ptr, out_ptr, flags_ptr, n, ncodes, nb, base, limit, W: tl.constexpr,
                        G: tl.constexpr, CHECK: tl.constexpr, BLOCK: tl.constexpr):
    # CHECK: flag a value (a count, with G > 1) outside [0, limit], compared in its own dtype
    # before any narrowing, so that no wide value wraps into range.
    ob = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    j = tl.arange(0, 8)
    ci = ob[:, None] * 8 + j[None, :]  # code index inside a plane
    bad = tl.zeros([BLOCK, 8], dtype=tl.int1)
    if G == 1:
        raw = tl.load(v_ptr + ci, mask=ci < n, other=0)
        if CHECK:
            bad = (raw < 0) | (raw > limit)
        code = raw.to(tl.int32)
    else:
        # Horner's rule over the group, first count most significant; padding counts are 0.
        code = tl.zeros([BLOCK, 8], dtype=tl.int32)
        for d in tl.static_range(G):
            e = ci * G + d
            raw = tl.load(v_ptr + e, mask=e < n, other=0)
            if CHECK:
                bad |= (raw < 0) | (raw > limit)
            code = code * base + raw.to(tl.int32)
    code = tl.where(ci < ncodes, code, 0)
    # Every plane of the tile from the one read above, most significant plane first.
    for row in tl.static_range(W):
        bit = (code >> (W - 1 - row)) & 1
        byte = tl.sum(bit << (7 - j)[None, :], axis=1)
        tl.store(out_ptr + row * nb + ob, byte.to(tl.uint8), mask=ob < nb)
    if CHECK:
        _flag(flags_ptr, bad)


def planes_pack(v: torch.Tensor, width: int, group: int = 1, base: int = 0, *,
                limit: int | None = None, out: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Pack integers (or radix groups of ``group`` base-``base`` counts) into ``width`` planes.

    Returns ``(payload, flags)``. With ``limit`` the same pass checks every value (every
    count) against ``[0, limit]`` and ``flags`` (one int32) is set if one lies outside: the
    range check without a pass of its own (a reduction of its own reads the input once more,
    and its host read before the packing leaves the GPU idle). Else ``flags`` is None. The
    flag is :func:`bitcomm.codecs._frame.clean_flag`'s: the caller reads it (``raise_if``)
    before it returns.
    ``out`` (contiguous uint8, ``width * nb`` bytes) receives the payload.
    """
    n = v.numel()
    ncodes = -(-n // group)
    nb = (ncodes + 7) // 8
    if out is None:
        out = torch.empty(width * nb, dtype=torch.uint8, device=v.device)
    flags = None if limit is None else _frame.clean_flag(v.device)
    if nb:
        block, opts = _config("radix_pack" if group > 1 else "planes_pack_checked"
                              if limit is not None else "planes_pack")
        # One launch with masks everywhere: for sm_90 a mask-free launch of the full tiles
        # compiled to more instructions an element, not fewer (`bitcomm bench kernels`).
        launch(_planes_pack_kernel, _grid(nb, block), v, out, out if flags is None else flags,
               n, ncodes, nb, base, 0 if limit is None else limit, W=width, G=group,
               CHECK=limit is not None, BLOCK=block, **opts)
    return out, flags


@triton.jit
def _planes_unpack_kernel(buf_ptr, out_ptr, n, nb, maxval, flags_ptr, first, W: tl.constexpr,
                          RANGE: tl.constexpr, BLOCK: tl.constexpr, EDGE: tl.constexpr):
    ob = (first + tl.program_id(0)).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    j = tl.arange(0, 8)
    ci = ob[:, None] * 8 + j[None, :]
    code = tl.zeros([BLOCK, 8], dtype=tl.int32)
    for row in tl.static_range(W):
        byte = _load(buf_ptr + row * nb + ob, ob < nb, 0, EDGE).to(tl.int32)
        code |= ((byte[:, None] >> (7 - j)[None, :]) & 1) << (W - 1 - row)
    live = ci < n
    _store(out_ptr + ci, code.to(out_ptr.dtype.element_ty), live, EDGE)
    # Rule 1 (the last tile): padding bits after the last code are zero; rule 2 (RANGE): a
    # count at most m (values of a full width cannot be out of range).
    if EDGE:
        bad = (code != 0) & ~live
        if RANGE:
            bad |= live & (code > maxval)
        _flag(flags_ptr, bad)
    elif RANGE:
        _flag(flags_ptr, code > maxval)


@triton.jit
def _radix_unpack_kernel(buf_ptr, out_ptr, n, ncodes, nb, limit, flags_ptr, first,
                         W: tl.constexpr, G: tl.constexpr, BASE: tl.constexpr,
                         SMALL: tl.constexpr, BLOCK: tl.constexpr, EDGE: tl.constexpr):
    # One code per lane, a 1-D tile of BLOCK codes. Split from the plain planes' [bytes, 8]
    # tile, the digits compiled to a stack of 1.4-5.8 KB per thread on sm_90 (registers
    # spilled to local memory; `bitcomm bench kernels`), and decoded at 0.04 of an H100's HBM
    # read.
    c = (first + tl.program_id(0)).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    if SMALL:  # every digit index fits in int32
        c = c.to(tl.int32)
    byte_i = c >> 3
    shift = 7 - (c & 7).to(tl.int32)
    code = tl.zeros([BLOCK], dtype=tl.int32)
    for row in tl.static_range(W):
        byte = _load(buf_ptr + row * nb + byte_i, byte_i < nb, 0, EDGE)
        code |= ((byte.to(tl.int32) >> shift) & 1) << (W - 1 - row)
    # Rule 2: a code below base**G; at the end, rule 1: padding bits after the last code are
    # zero, and rule 3: padding counts after n are zero.
    if EDGE:
        live = c < ncodes
        bad = ((code != 0) & ~live) | (live & (code >= limit))
    else:
        bad = code >= limit
    # BASE is a constant, so a digit is a multiply-high and a shift, not a division.
    u = code.to(tl.uint32)
    for d in tl.static_range(G - 1, -1, -1):
        e = c * G + d
        digit = u % BASE
        u = u // BASE
        value = digit.to(out_ptr.dtype.element_ty)
        if EDGE:
            bad |= live & (e >= n) & (digit != 0)
        _store(out_ptr + e, value, e < n, EDGE)
    _flag(flags_ptr, bad)


def planes_unpack(buf: torch.Tensor, n: int, width: int, dtype: torch.dtype, *, group: int = 1,
                  base: int = 0, maxval: int | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Return ``(values, flags)`` from ``width`` planes; inverse of :func:`planes_pack`.

    ``maxval`` (plain values only) flags a decoded value above it; for radix groups a code at or
    above ``base**group`` is flagged, as are non-zero padding bits and padding counts.
    ``flags`` is ``None`` where no payload of this size breaks a rule: plain values of the full
    width (no ``maxval`` below ``2**width - 1``) with ``n`` a multiple of 8.
    """
    ncodes = -(-n // group)
    nb = (ncodes + 7) // 8
    out = torch.empty(n, dtype=dtype, device=buf.device)
    full = (1 << width) - 1
    maxval = full if maxval is None else maxval
    flags = _flag_buffer(group > 1 or maxval < full or n % 8 != 0, buf.device)
    if not nb:
        return out, flags
    if group > 1:
        block, opts = _config("radix_unpack")
        tiles = _grid(ncodes, block)[0]
        # a full tile's codes are all before ncodes and its counts all before n
        launch_tiles(_radix_unpack_kernel, tiles, n // (group * block), buf, out, n, ncodes,
                      nb, base**group, flags, W=width, G=group, BASE=base,
                      SMALL=tiles * block * group < 2**31, BLOCK=block, **opts)
        return out, flags
    block, opts = _config("planes_unpack")
    launch_tiles(_planes_unpack_kernel, _grid(nb, block)[0], n // (8 * block), buf, out, n,
                  nb, maxval, out if flags is None else flags, W=width, RANGE=maxval < full,
                  BLOCK=block, **opts)
    return out, flags


# --- qsgd -------------------------------------------------------------------------------------


@triton.jit
def _pair_random16(base, local, key):
    # The stream values (bitcomm.codecs._rng) of elements base + local and 2**15 elements on,
    # for a tile that starts at a multiple of its power-of-two size of at most 2**15 elements
    # in the first half of a 2**16-element block. The stream hashes index j = block * 2**15 +
    # (p mod 2**15) of element p in its block, and takes the low 16 bits of the full hash in
    # the block's first half, the high 16 in its second: the tile and its partner 2**15 on
    # share each hash, which one pass of the tile's j gives both (lowbias32 without its last
    # xorshift, whose effect is folded into taking the halves). Their j run on from one
    # scalar without crossing a multiple of 2**31: the key's mixing with j's high bits and
    # the first j are the program's scalars. key: the 32-bit key as a signed int32; base:
    # int64; local: int32 offsets below the tile's size.
    j0 = (base >> 16) * 32768 + (base & 0x7FFF)
    kp = ((key ^ ((j0 >> 31) * 0x27D4EB2F)) & 0xFFFFFFFF).to(tl.uint32)
    h = ((j0 & 0x7FFFFFFF).to(tl.int32) + local).to(tl.uint32) ^ kp
    h ^= h >> 16
    h = h * tl.cast(0x7FEB352D, tl.uint32)
    h ^= h >> 15
    h = h * tl.cast(0x846CA68B, tl.uint32)
    high = h >> 16
    return ((h ^ high) & 0xFFFF).to(tl.int32), high.to(tl.int32)


def _shift(bucket: int) -> int:
    """log2 of a power-of-two bucket (its index is a shift), -1 for any other (a division)."""
    return bucket.bit_length() - 1 if bucket & (bucket - 1) == 0 else -1


@triton.jit(do_not_specialize=(*HEAD_WORDS, "key"))
def _qsgd_codes_kernel(x_ptr, out_ptr, scales_ptr, factors_ptr, flags_ptr, head_ptr, head0,
                       head1, n, nbytes, nbuckets, bucket, key, S: tl.constexpr,
                       BITS: tl.constexpr, ROW: tl.constexpr, ROWS: tl.constexpr,
                       FUSED: tl.constexpr, SHIFT: tl.constexpr, SMALL: tl.constexpr,
                       FLAGS: tl.constexpr, HEAD: tl.constexpr):
    # A program's two tiles of ROWS rows of ROW elements (a power of two of at most 2**15):
    # one in the first half of a 2**16-element block of the stream, its partner 2**15
    # elements on, whose stream values come from the same hashes (_pair_random16): each
    # hash serves two elements. A block's tiles are its first half's, paired; a last block
    # of at most 2**15 elements has programs for its tiles alone, whose partners lie past n
    # (masked). With HEAD, program 0 also writes the frame's header (_store_head).
    TILE: tl.constexpr = ROWS * ROW
    HALF: tl.constexpr = 32768 // TILE  # tiles in a block's half: programs a block
    pid = tl.program_id(0).to(tl.int64)
    if HEAD > 0:
        if pid == 0:
            _store_head(head_ptr, head0, head1, HEAD)
    base = (pid // HALF) * 65536 + (pid % HALF) * TILE
    PER: tl.constexpr = 8 // BITS
    C: tl.constexpr = ROW // PER
    rl = tl.arange(0, ROWS)
    c = tl.arange(0, C)
    j = tl.arange(0, PER)
    local = (rl[:, None, None] * C + c[None, :, None]) * PER + j[None, None, :]
    low, high = _pair_random16(base, local, key)
    _qsgd_half(x_ptr, out_ptr, scales_ptr, factors_ptr, flags_ptr, n, nbytes, nbuckets,
               bucket, base, local, low, S, BITS, ROW, ROWS, FUSED, SHIFT, SMALL, FLAGS)
    _qsgd_half(x_ptr, out_ptr, scales_ptr, factors_ptr, flags_ptr, n, nbytes, nbuckets,
               bucket, base + 32768, local, high, S, BITS, ROW, ROWS, FUSED, SHIFT, SMALL,
               FLAGS)


@triton.jit
def _qsgd_half(x_ptr, out_ptr, scales_ptr, factors_ptr, flags_ptr, n, nbytes, nbuckets, bucket,
               base, local, random, S: tl.constexpr, BITS: tl.constexpr, ROW: tl.constexpr,
               ROWS: tl.constexpr, FUSED: tl.constexpr, SHIFT: tl.constexpr,
               SMALL: tl.constexpr, FLAGS: tl.constexpr):
    # The codes of the tile of ROWS rows of ROW elements from `base` (int64), its elements
    # addressed by int32 offsets `local`, its stream values `random`; past n, nothing.
    PER: tl.constexpr = 8 // BITS
    C: tl.constexpr = ROW // PER
    TILE: tl.constexpr = ROWS * ROW
    rl = tl.arange(0, ROWS)
    c = tl.arange(0, C)
    j = tl.arange(0, PER)
    live = local < tl.minimum(n - base, TILE).to(tl.int32)
    if FUSED:  # rows loaded flat, then split by code: at 4 bits [ROWS, C, 2] loads 8 bytes
        # at a time, flat rows 16 (the split is a relabelling of registers)
        flat = rl[:, None] * ROW + tl.arange(0, ROW)[None, :]
        x = tl.load(x_ptr + base + flat, mask=flat < tl.minimum(n - base, TILE).to(tl.int32),
                    other=0.0).to(tl.float32)
        x = tl.reshape(x, (ROWS, C, PER))
    else:
        x = tl.load(x_ptr + base + local, mask=live, other=0.0).to(tl.float32)
    a = tl.abs(x)
    if FUSED:
        # A row is one bucket: its scale is its max |x|, NaN if it holds a NaN (as aminmax).
        # One integer reduction finds both: the bits of a float >= 0 order as the float, and
        # every NaN's bits (sign cleared by abs) lie above those of inf.
        r = base // ROW + rl
        top = tl.max(tl.max(a.to(tl.int32, bitcast=True), axis=2), axis=1)
        scale = tl.where(top > 0x7F800000, float("nan"), top.to(tl.float32, bitcast=True))
        tl.store(scales_ptr + r, scale, mask=r < nbuckets)
        if FLAGS:  # a scale of inf or NaN: the encoder refuses it
            _flag(flags_ptr, top >= 0x7F800000)
        # float32(1 / scale) * float32(s * 2**16), 0 for a zero scale (qsgd._factors).
        safe = tl.where(scale > 0, scale, 1.0)
        factor = tl.where(scale > 0, tl.math.div_rn(1.0, safe) * (S * 65536.0), 0.0)
        f = factor[:, None, None]
    else:  # a power-of-two bucket is a shift (SHIFT >= 0), any other a division
        if SMALL:  # every element index fits in int32
            idx = base.to(tl.int32) + local
        else:
            idx = base + local
        b = idx >> SHIFT if SHIFT >= 0 else idx // bucket
        f = tl.load(factors_ptr + b, mask=live, other=0.0)
    t = (a * f + 0.5).to(tl.int32)  # two roundings: the launch turns off fused multiply-add
    level = tl.minimum((t + random) >> 16, S)
    sign = (x.to(tl.int32, bitcast=True) >> 31) & 1
    # Elements past n load as 0.0: level 0 and sign 0, so their code is 0 without a mask.
    code = (sign << (BITS - 1)) | level
    byte = tl.sum(code << (8 - BITS * (j + 1))[None, None, :], axis=2)
    first = base // PER  # the tile's first code byte
    ob = rl[:, None] * C + c[None, :]
    tl.store(out_ptr + first + ob, byte.to(tl.uint8),
             mask=ob < tl.minimum(nbytes - first, TILE // PER).to(tl.int32))


def qsgd_codes(x: torch.Tensor, bits: int, bucket: int, key: int, scales: torch.Tensor,
               factors: torch.Tensor | None, *, out: torch.Tensor | None = None,
               flags: torch.Tensor | None = None,
               header: tuple[torch.Tensor, bytes] | None = None) -> torch.Tensor:
    """Return the packed qsgd codes of ``x``; with ``factors=None`` also write ``scales``.

    ``factors=None`` needs a power-of-two ``bucket <= MAX_FUSED_BUCKET`` (the bucket max is
    taken in the same pass); otherwise ``factors`` holds each bucket's ``s * 2**16 / scale``.
    ``out`` (contiguous uint8, ``ceil(n * bits / 8)`` bytes) receives the codes. ``flags``
    (one int32, zero; with ``factors=None``) is set when a scale is not finite: the scales'
    check without a pass of its own. ``header``: ``(frame, data)``, the frame whose first
    bytes the kernel sets to ``data`` (at most 16 bytes), where a copy from the host would
    take a pinned buffer and a launch of its own.
    """
    if flags is not None and factors is not None:
        raise ValueError("flags are set by the fused encoder only (factors=None)")
    return _qsgd_codes(x, bits, bucket, _rng._signed32(key), scales, factors, out, flags,
                       header)


def qsgd_frame(x: torch.Tensor, bits: int, bucket: int, key: int, header: bytes,
               flags: torch.Tensor) -> torch.Tensor:
    """Return the qsgd frame of ``x``: ``header``, each bucket's max as its scale, the codes.

    The fused pass of :func:`qsgd_codes` (a power-of-two ``bucket`` of 8 to
    :data:`MAX_FUSED_BUCKET`) writes all three into a new frame whose codes start 16-byte
    aligned; ``flags`` (one int32, zero) is set where a scale is not finite.
    """
    word = _rng._signed32(key)  # as the kernel takes it
    n = x.numel()
    if n == 0 or not replays():
        return _qsgd_frame(x, bits, bucket, word, header, flags)
    # An allocation, its views and one launch, fixed by these and the stream key (which the
    # kernel leaves unspecialised): the call replays whole, the key given
    inputs = (x, flags)
    plan = (qsgd_frame, n, x.dtype, x.device, bits, bucket, header, x.data_ptr() % 16,
            flags.data_ptr() % 16, TUNING["qsgd_codes_fused"])
    return replayed(plan, inputs, lambda: _qsgd_frame(x, bits, bucket, word, header, flags),
                    {"key": word})


def _qsgd_frame(x: torch.Tensor, bits: int, bucket: int, word: int, header: bytes,
                flags: torch.Tensor) -> torch.Tensor:
    # qsgd_frame with the stream key as the kernel takes it (`word`): the scales lie behind
    # the header, where the aligned codes start they end, so they are 4-byte aligned too
    n = x.numel()
    start = len(header) + 4 * (-(-n // bucket))
    frame = _frame.empty_aligned_at(start + (n * bits + 7) // 8, start, x.device)
    scales = frame[len(header) : start].view(torch.float32)
    _qsgd_codes(x, bits, bucket, word, scales, None, frame[start:], flags, (frame, header))
    return frame


def _qsgd_codes(x: torch.Tensor, bits: int, bucket: int, word: int, scales: torch.Tensor,
                factors: torch.Tensor | None, out: torch.Tensor | None,
                flags: torch.Tensor | None, header: tuple[torch.Tensor, bytes] | None
                ) -> torch.Tensor:
    # qsgd_codes with the stream key as the kernel takes it (`word`, a signed int32)
    n = x.numel()
    nbytes = (n * bits + 7) // 8
    if out is None:
        out = torch.empty(nbytes, dtype=torch.uint8, device=x.device)
    if n == 0:
        if header is not None:
            launch(_head_kernel, (1,), header[0], *_head_words(header[1]),
                   HEAD=len(header[1]), num_warps=1)
        return out
    fused = factors is None
    if fused:  # a bucket a row; the buckets of one warp's elements, or one bucket on 2-8 warps
        per, warps = TUNING["qsgd_codes_fused"]
        tile, opts = max(per, bucket), {"num_warps": min(8 * warps, max(warps, bucket // per))}
    else:
        tile, opts = _config("qsgd_codes")
    row = bucket if fused else 1024
    rows = max(1, tile // row)  # a tile of a power of two <= 2**15 elements (_pair_random16)
    size = rows * row
    # a program a tile of each block's first half (and its partner in the second), and in a
    # last block of at most 2**15 elements one a tile there
    blocks, rest = divmod(n, 65536)
    half = 32768 // size
    grid = (blocks * half + min(half, -(-rest // size)),)
    head0, head1 = _head_words(b"" if header is None else header[1])
    launch(_qsgd_codes_kernel, grid, x, out, scales, scales if fused else factors,
           scales if flags is None else flags, out if header is None else header[0], head0,
           head1, n, nbytes, scales.numel(), bucket, word,
           S=(1 << (bits - 1)) - 1, BITS=bits, ROW=row, ROWS=rows, FUSED=fused,
           SHIFT=_shift(bucket), SMALL=n + 65536 < 2**31, FLAGS=flags is not None,
           HEAD=0 if header is None else len(header[1]), enable_fp_fusion=False, **opts)
    return out


@triton.jit
def _bf16_bits(x):
    # float32 -> bfloat16 rounded to nearest, ties to even, as torch does, on the bits (finite
    # x): the interpreter's own conversion truncates.
    u = x.to(tl.uint32, bitcast=True)
    u += 0x7FFF + ((u >> 16) & 1)
    return (u >> 16).to(tl.uint16).to(tl.int16, bitcast=True)


@triton.jit
def _qsgd_tile(first, SMALL: tl.constexpr, BLOCK: tl.constexpr, PER: tl.constexpr):
    # A decoding program's code bytes (ob) and the elements they hold (idx: [BLOCK, PER]).
    ob = (first + tl.program_id(0)).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    if SMALL:  # every element index fits in int32
        ob = ob.to(tl.int32)
    j = tl.arange(0, PER)
    return ob, ob[:, None] * PER + j[None, :]


@triton.jit
def _qsgd_decoded(codes_ptr, steps_ptr, ob, idx, n, nbytes, bucket, BITS: tl.constexpr,
                  SHIFT: tl.constexpr, EDGE: tl.constexpr):
    # The float32 values sign * (level * step) of the codes in bytes ob of one frame.
    PER: tl.constexpr = 8 // BITS
    S: tl.constexpr = (1 << (BITS - 1)) - 1
    j = tl.arange(0, PER)
    byte = _load(codes_ptr + ob, ob < nbytes, 0, EDGE).to(tl.int32)
    code = (byte[:, None] >> (8 - BITS * (j + 1))[None, :]) & ((1 << BITS) - 1)
    # A power-of-two bucket is a shift, any other a division: with the division in int64
    # the kernel compiled to 24-68 instructions an element, with the shift in int32 to 13-26
    # (`bitcomm bench kernels`). An H100 timed a shift of int64 indices no faster than the
    # division, so the GPU benchmark has the last word.
    b = idx >> SHIFT if SHIFT >= 0 else idx // bucket
    step = _load(steps_ptr + b, idx < n, 0.0, EDGE)
    val = (code & S).to(tl.float32) * step
    return tl.where((code >> (BITS - 1)) != 0, _neg(val), val)


@triton.jit
def _qsgd_values_kernel(codes_ptr, steps_ptr, out_ptr, n, nbytes, bucket, first,
                        BITS: tl.constexpr, SHIFT: tl.constexpr, SMALL: tl.constexpr,
                        BLOCK: tl.constexpr, BF16: tl.constexpr, EDGE: tl.constexpr):
    ob, idx = _qsgd_tile(first, SMALL, BLOCK, 8 // BITS)
    val = _qsgd_decoded(codes_ptr, steps_ptr, ob, idx, n, nbytes, bucket, BITS, SHIFT, EDGE)
    if BF16:  # out_ptr is an int16 view of the bfloat16 result
        val = _bf16_bits(val)
    else:
        val = val.to(out_ptr.dtype.element_ty)
    _store(out_ptr + idx, val, idx < n, EDGE)


def qsgd_values(codes: torch.Tensor, n: int, bits: int, bucket: int, steps: torch.Tensor,
                dtype: torch.dtype) -> torch.Tensor:
    """Return ``sign * level * step[bucket]`` of ``n`` packed qsgd codes, as ``dtype``."""
    out = torch.empty(n, dtype=dtype, device=codes.device)
    nbytes = codes.numel()
    bf16 = dtype == torch.bfloat16
    if n:
        block, opts = _config("qsgd_values")
        tiles = _grid(nbytes, block)[0]
        per = block * (8 // bits)  # elements a tile
        launch_tiles(_qsgd_values_kernel, tiles, n // per, codes, steps,
                      out.view(torch.int16) if bf16 else out, n, nbytes, bucket, BITS=bits,
                      SHIFT=_shift(bucket), SMALL=tiles * per < 2**31, BLOCK=block, BF16=bf16,
                      enable_fp_fusion=False, **opts)
    return out


@triton.jit(do_not_specialize=HEAD_WORDS)
def _qsgd_decode_kernel(frame_ptr, scales_ptr, codes_ptr, out_ptr, flags_ptr, n, nbytes, nb,
                        pad, head0, head1, first, BITS: tl.constexpr, LOG_BUCKET: tl.constexpr,
                        HEAD: tl.constexpr, HEADER: tl.constexpr, WORDS: tl.constexpr,
                        ROWS: tl.constexpr, BYTES: tl.constexpr, SMALL: tl.constexpr,
                        BF16: tl.constexpr, EDGE: tl.constexpr):
    # One frame's values with its steps and its rules in the same pass. A program's ROWS *
    # BYTES code bytes are ROWS whole buckets of 2**LOG_BUCKET elements (BYTES bytes each) or,
    # with ROWS 1, part of one: its steps are ROWS scales, divided once and flagged if not
    # finite or below 0. With WORDS the scales lie 4-byte aligned (scales_ptr is int32: an
    # encoder's frame, whose aligned codes they end at) and each is one load; otherwise each
    # is put together from its four bytes. The one EDGE program also checks the padding bits
    # (`pad`) of the last code byte; with HEADER the first tile's program flags a header
    # other than head0's and head1's bytes. The values are _qsgd_decoded's, to the bit. The
    # codes come by a pointer of their own (codes_ptr, into the frame): an encoder's frame
    # starts them 16-byte aligned, which Triton then knows and loads them 16 bytes at a
    # time, where through frame_ptr plus an offset it loads each byte alone.
    PER: tl.constexpr = 8 // BITS
    S: tl.constexpr = (1 << (BITS - 1)) - 1
    tile = (first + tl.program_id(0)).to(tl.int64)
    if HEADER:
        if tile == 0:
            _flag(flags_ptr, _head_differs(frame_ptr, head0, head1, HEAD))
    row = tl.arange(0, ROWS)
    b = ((tile * (ROWS * BYTES * PER)) >> LOG_BUCKET) + row
    live = b < nb
    if WORDS:
        bits = _load(scales_ptr + b, live, 0, EDGE)
    else:
        bits = _le_bytes(scales_ptr + 4 * b, live, 4, EDGE)
    scale = bits.to(tl.float32, bitcast=True)
    _flag(flags_ptr, live & (((bits & 0x7F800000) == 0x7F800000) | (scale < 0)))
    if S == 1:  # 2 bits: scale / 1 is the scale itself
        step = scale
    else:
        step = tl.math.div_rn(scale, S * 1.0)
    ob = tile * (ROWS * BYTES) + row[:, None] * BYTES + tl.arange(0, BYTES)[None, :]
    if SMALL:  # every element index fits in int32
        ob = ob.to(tl.int32)
    j = tl.arange(0, PER)
    idx = ob[:, :, None] * PER + j[None, None, :]
    byte = _load(codes_ptr + ob, ob < nbytes, 0, EDGE).to(tl.int32)
    code = (byte[:, :, None] >> (8 - BITS * (j + 1))[None, None, :]) & ((1 << BITS) - 1)
    val = (code & S).to(tl.float32) * step[:, None, None]
    val = tl.where((code >> (BITS - 1)) != 0, _neg(val), val)
    if BF16:  # out_ptr is an int16 view of the bfloat16 result
        val = _bf16_bits(val)
    else:
        val = val.to(out_ptr.dtype.element_ty)
    _store(out_ptr + idx, val, idx < n, EDGE)
    if EDGE:
        tl.store(flags_ptr, 1, mask=(tl.load(codes_ptr + nbytes - 1) & pad) != 0)


def qsgd_decode(frame: torch.Tensor, head: int, n: int, bits: int, bucket: int,
                dtype: torch.dtype, flags: torch.Tensor, header: bytes | None = None
                ) -> torch.Tensor:
    """Return the values of the qsgd frame ``frame`` (uint8, exactly the frame) as ``dtype``.

    The frame holds ``n`` (> 0 with ``header``) elements of ``bits`` in buckets of ``bucket``
    behind a ``head``-byte header; a scale that is not finite or below 0, a set padding bit,
    or with ``header`` (``head`` bytes) a header other than it, sets ``flags`` (one int32,
    zero). Where the bucket is a power of two of at least a code byte's elements, one pass
    computes each program's steps and its values (a step launch fewer, and no steps in
    memory); otherwise :func:`qsgd_steps` then :func:`qsgd_values`.
    """
    nb = -(-n // bucket)
    per_byte = 8 // bits
    shift = _shift(bucket)
    if shift < 0 or bucket < per_byte:
        steps = qsgd_steps(frame.view(1, -1), head, nb, n, bits,
                           None if header is None else _frame.host_bytes(header, frame.device),
                           flags)
        return qsgd_values(frame[head + 4 * nb :], n, bits, bucket, steps.view(-1), dtype)
    if n == 0 or not replays():
        return _qsgd_decode(frame, head, n, bits, bucket, dtype, flags, header, shift)
    # One allocation and one or two launches, fixed by these: the call replays whole
    # (_launch.replay), the header's words part of the key
    inputs = (frame, flags)
    plan = (qsgd_decode, n, dtype, frame.device, head, bits, bucket, header,
            frame.data_ptr() % 16, flags.data_ptr() % 16, TUNING["qsgd_decode"])
    return replayed(plan, inputs,
                    lambda: _qsgd_decode(frame, head, n, bits, bucket, dtype, flags, header,
                                         shift))


def _qsgd_decode(frame: torch.Tensor, head: int, n: int, bits: int, bucket: int,
                 dtype: torch.dtype, flags: torch.Tensor, header: bytes | None, shift: int
                 ) -> torch.Tensor:
    # qsgd_decode's one pass, its bucket a power of two (log2: shift) of whole code bytes
    per_byte = 8 // bits
    nb = -(-n // bucket)
    out = torch.empty(n, dtype=dtype, device=frame.device)
    if n:
        block, opts = _config("qsgd_decode")  # code bytes a tile
        nbytes = (n * bits + 7) // 8
        per_bucket = bucket // per_byte  # code bytes a bucket
        rows = max(1, block // per_bucket)
        per = block * per_byte  # elements a tile
        tiles = _grid(nbytes, block)[0]
        used = (n * bits) % 8
        bf16 = dtype == torch.bfloat16
        scales = frame[head : head + 4 * nb]
        words = scales.data_ptr() % 4 == 0 and scales.storage_offset() % 4 == 0
        launch_tiles(_qsgd_decode_kernel, tiles, n // per, frame,
                     scales.view(torch.int32) if words else scales, frame[head + 4 * nb :],
                     out.view(torch.int16) if bf16 else out, flags, n, nbytes, nb,
                     (1 << (8 - used)) - 1 if used else 0,
                     *_head_words(header or b""), BITS=bits, LOG_BUCKET=shift, HEAD=head,
                     HEADER=header is not None, WORDS=words, ROWS=rows, BYTES=block // rows,
                     SMALL=tiles * per < 2**31, BF16=bf16, enable_fp_fusion=False, **opts)
    return out


@triton.jit
def _qsgd_steps_kernel(rows_ptr, header_ptr, steps_ptr, flags_ptr, stride, nb, size, pad,
                       S: tl.constexpr, HEAD: tl.constexpr, HEADER: tl.constexpr,
                       BLOCK: tl.constexpr):
    # Program (block of buckets, frame r): each bucket's step, scale / s correctly rounded,
    # and the frame's rules: every scale finite and >= 0 (-0.0 is), and, in each frame's
    # first block, the padding bits of its last byte (those of `pad`) zero and with HEADER
    # its header equal to header_ptr's. A frame's scales lie 4-byte unaligned behind its
    # HEAD-byte header: each is put together from its four bytes. The blocks are the grid's
    # first axis, which may be long (a bucket of 1 is a scale an element); the frames the
    # second, at most 65535.
    r = tl.program_id(1).to(tl.int64)
    row = rows_ptr + r * stride
    j = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = j < nb
    at = row + HEAD + 4 * j
    bits = _le_bytes(at, live, 4, True)
    scale = bits.to(tl.float32, bitcast=True)
    tl.store(steps_ptr + r * nb + j, tl.math.div_rn(scale, S * 1.0), mask=live)
    _flag(flags_ptr, live & (((bits & 0x7F800000) == 0x7F800000) | (scale < 0)))
    if tl.program_id(0) == 0:
        if HEADER:
            h = tl.arange(0, 16)
            mine = h < HEAD
            _flag(flags_ptr, tl.load(row + h, mask=mine, other=0)
                  != tl.load(header_ptr + h, mask=mine, other=0))
        tl.store(flags_ptr, 1, mask=(tl.load(row + size - 1) & pad) != 0)


def qsgd_steps(rows: torch.Tensor, head: int, nb: int, n: int, bits: int,
               header: torch.Tensor | None, flags: torch.Tensor) -> torch.Tensor:
    """Return float32 ``[frames, nb]``: each qsgd frame's steps (``scale / s``); check it.

    ``rows``: the frames, one a row (uint8, ``n`` elements of ``bits`` each in ``nb``
    buckets); a scale that is not finite or below 0, a set padding bit, or with ``header``
    (``head`` bytes) a frame's header other than it, sets ``flags`` (one int32, zero). One
    launch for every frame's checks and steps (up to :data:`MAX_GRID_Y` frames a launch),
    where torch takes a dozen.
    """
    frames = rows.shape[0]
    steps = torch.empty((frames, nb), dtype=torch.float32, device=rows.device)
    block = 1024  # scales: a few per 512 elements
    used = (n * bits) % 8
    for lo in range(0, frames, MAX_GRID_Y):  # the frames are the grid's second axis
        part = rows[lo : lo + MAX_GRID_Y]
        launch(_qsgd_steps_kernel, (max(1, _cdiv(nb, block)), part.shape[0]), part,
               part if header is None else header, steps[lo:], flags, rows.stride(0), nb,
               rows.shape[1], (1 << (8 - used)) - 1 if n and used else 0,
               S=(1 << (bits - 1)) - 1, HEAD=head, HEADER=header is not None, BLOCK=block,
               enable_fp_fusion=False, num_warps=4)
    return steps


MAX_GRID_Y = 65535
"""The most programs a CUDA grid's second axis holds."""


@triton.jit
def _qsgd_mean_kernel(rows_ptr, steps_ptr, mean_ptr, kept_ptr, x_ptr, n, nbytes, stride, off,
                      frames, divisor, nb, keep, bucket, first, BITS: tl.constexpr,
                      SHIFT: tl.constexpr, SMALL: tl.constexpr, BLOCK: tl.constexpr,
                      KEEP: tl.constexpr, EDGE: tl.constexpr):
    # Each frame's values of this tile (its codes at `off` in its row of rows_ptr, its steps in
    # its row of steps_ptr), added in frame order from +0.0 as torch adds decoded vectors, then
    # divided by `divisor`, the number of frames (correctly rounded); KEEP 1 writes frame
    # `keep`'s values too, KEEP 2 x less them (x_ptr's float32, as torch subtracts). The rows'
    # pointers advance a row an iteration: 64-bit pointer arithmetic, where a row's index times
    # the stride could overflow 32 bits.
    ob, idx = _qsgd_tile(first, SMALL, BLOCK, 8 // BITS)
    acc = tl.zeros(idx.shape, dtype=tl.float32)
    codes_ptr = rows_ptr + off
    for r in range(frames):
        val = _qsgd_decoded(codes_ptr, steps_ptr, ob, idx, n, nbytes, bucket, BITS, SHIFT, EDGE)
        acc += val
        if KEEP != 0:
            if r == keep:
                if KEEP == 2:
                    val = _load(x_ptr + idx, idx < n, 0.0, EDGE) - val
                _store(kept_ptr + idx, val, idx < n, EDGE)
        codes_ptr += stride
        steps_ptr += nb
    _store(mean_ptr + idx, tl.math.div_rn(acc, divisor), idx < n, EDGE)


def qsgd_mean(rows: torch.Tensor, off: int, n: int, bits: int, bucket: int,
              steps: torch.Tensor, keep: int | None = None, residual_of: torch.Tensor | None = None,
              out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Return the float32 mean of the frames' values and, with ``keep``, that frame's values.

    ``rows``: the frames, one a row (uint8, contiguous), their packed codes from byte ``off``;
    ``steps``: float32 ``[frames, buckets]``, each bucket's step. Each frame's values are
    :func:`qsgd_values`'s, added in row order from +0.0 and divided by the number of rows:
    the bits of torch adding the decoded vectors then dividing by a tensor. One pass reads
    every frame's codes once; no frame's values are written but the kept one's. With
    ``residual_of`` (contiguous float32, ``n`` elements, and ``keep``) the second result is
    ``residual_of`` less the kept values instead, in the same pass. ``out`` (contiguous float32,
    ``n`` elements) receives the mean instead of a new tensor.
    """
    frames = rows.shape[0]
    if not frames:
        raise ValueError("expected at least one frame")
    if residual_of is not None and (keep is None or residual_of.dtype != torch.float32
                                    or residual_of.numel() != n
                                    or not residual_of.is_contiguous()):
        raise ValueError("residual_of takes keep and a contiguous float32 tensor of n elements")
    mean = torch.empty(n, dtype=torch.float32, device=rows.device) if out is None else out
    kept = None if keep is None else torch.empty_like(mean)
    if n:
        nbytes = (n * bits + 7) // 8
        per, opts = _config("qsgd_mean")  # elements a tile
        block = per // (8 // bits)  # code bytes a tile
        tiles = _grid(nbytes, block)[0]
        launch_tiles(_qsgd_mean_kernel, tiles, n // per, rows, steps, mean,
                     mean if kept is None else kept,
                     mean if residual_of is None else residual_of.detach(), n, nbytes,
                     rows.stride(0), off, frames, float(frames), steps.stride(0),
                     -1 if keep is None else keep, bucket, BITS=bits, SHIFT=_shift(bucket),
                     SMALL=tiles * per < 2**31, BLOCK=block,
                     KEEP=0 if keep is None else 1 if residual_of is None else 2,
                     enable_fp_fusion=False, **opts)
    return mean, kept


# --- sparse frames (bitcomm.codecs.sparse) -------------------------------------------------


@triton.jit
def _sparse_scatter_kernel(frame_ptr, out_ptr, flags_ptr, n, k, values_at, HEAD: tl.constexpr,
                           IW: tl.constexpr, VALUES: tl.constexpr, BLOCK: tl.constexpr):
    # Entries [program * BLOCK ...) of a sparse frame written into the zeroed dense
    # out_ptr (float32 or float64): each value at its index. The frame's rules are flagged: an
    # index outside [0, n) or not above the one before it (the previous tile's last included),
    # a value (VALUES 0: float32, 1: float16) that is not finite, or (VALUES 3) a shared mean
    # that is not finite or is -0.0. Out-of-range indices write nothing; a refused frame's
    # other writes go to a vector its caller never sees.
    # Every tile masked: the entries are a sliver of the vector, where a launch of its own
    # for the last tile (launch_tiles) would cost more than the masks save.
    j = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = j < k
    at = frame_ptr + HEAD + IW * j
    i = _le_bytes(at, live, IW, True).to(tl.int64)
    before = _le_bytes(at - IW, live & (j > 0), IW, True).to(tl.int64)
    bad = (i < 0) | (i >= n) | ((j > 0) & (i <= before))
    if VALUES == 0:
        bits = _le_bytes(frame_ptr + values_at + 4 * j, live, 4, True)
        bad |= (bits & 0x7F800000) == 0x7F800000
        value = bits.to(tl.float32, bitcast=True)
    elif VALUES == 1:
        bits = _le_bytes(frame_ptr + values_at + 2 * j, live, 2, True)
        bad |= (bits & 0x7C00) == 0x7C00
        value = bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    else:
        bits = _le_bytes(frame_ptr + values_at + 0 * j, live, 4, True)  # one word, every lane
        bad |= ((bits & 0x7F800000) == 0x7F800000) | (bits == -2147483648)  # inf, NaN, -0.0
        value = bits.to(tl.float32, bitcast=True)
    _flag(flags_ptr, live & bad)
    ok = live & (i >= 0) & (i < n)
    tl.store(out_ptr + i, value.to(out_ptr.dtype.element_ty), mask=ok)


SPARSE_VALUES = {"fp32": 0, "fp16": 1, "mean": 3}
"""The value formats :func:`sparse_scatter` reads, by their code in the kernel."""


def sparse_scatter(frame: torch.Tensor, n: int, k: int, head: int, values: str,
                   out: torch.Tensor, flags: torch.Tensor) -> None:
    """Write the ``k`` entries of a sparse frame into ``out``, zeroed, and check them.

    ``frame``: uint8, the frame (its ``head``-byte header, ``k`` indices of an ``n``-vector,
    int32 below 2**31 else int64, then the values: ``values`` one of :data:`SPARSE_VALUES`).
    ``out``: the dense ``n``-vector, float32 or float64, zeros; each value goes to its index
    (a store: the indices of an accepted frame are distinct). An index outside ``[0, n)`` or
    not above the one before it, a value that is not finite or a mean of -0.0 sets ``flags``
    (one int32, zero). One launch.
    """
    if k:
        block, opts = _config("sparse_scatter")
        iw = 4 if n < 2**31 else 8
        launch(_sparse_scatter_kernel, _grid(k, block), frame, out, flags, n, k, head + iw * k,
               HEAD=head, IW=iw, VALUES=SPARSE_VALUES[values], BLOCK=block, **opts)


@triton.jit(do_not_specialize=HEAD_WORDS)
def _sparse_frame_kernel(idx_ptr, val_ptr, frame_ptr, ids_ptr, out_ptr, sums_ptr, flags_ptr,
                         head0, head1, n, k, CODE: tl.constexpr, VALUES: tl.constexpr,
                         CHECK: tl.constexpr, GATHER: tl.constexpr, BLOCK: tl.constexpr):
    # Entries [program * BLOCK ...) of a sparse frame, every tile masked as the scatter's:
    # each index (int64 in idx_ptr) to ids_ptr, the frame's index field as int32 or int64,
    # and its value (val_ptr's at the entry, or with GATHER at the index: val_ptr is then the
    # dense vector) to out_ptr as float32 (VALUES 0) or float16 (1), or (3) the tile's
    # float64 sum of the values to sums_ptr, for _sparse_mean_kernel; program 0 writes the
    # header (an index outside [0, n) gathers nothing). With CHECK the rules the numpy path
    # checks are flagged: an index outside [0, n) or not above the one before it, a value
    # not finite once float32 (a float64 beyond its range), or, for float16, above FP16_MAX.
    tile = tl.program_id(0)
    if tile == 0:
        _store_head(frame_ptr, head0, head1, 16)
        tl.store(frame_ptr + 16 + tl.arange(0, 1), tl.full([1], CODE, tl.uint8))
    j = tile.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = j < k
    i = tl.load(idx_ptr + j, mask=live, other=0).to(tl.int64)
    if GATHER:  # unchecked indices too: an index outside the vector must not address memory
        v = tl.load(val_ptr + i, mask=live & (i >= 0) & (i < n), other=0.0)
    else:
        v = tl.load(val_ptr + j, mask=live, other=0.0)
    tl.store(ids_ptr + j, i.to(ids_ptr.dtype.element_ty), mask=live)
    if VALUES == 3:
        tl.store(sums_ptr + tile, tl.sum(v.to(tl.float64), 0))
    else:
        tl.store(out_ptr + j, v.to(out_ptr.dtype.element_ty), mask=live)
    if CHECK:
        before = tl.load(idx_ptr + j - 1, mask=live & (j > 0), other=-1).to(tl.int64)
        wide = v.to(tl.float32)
        bad = (i < 0) | (i >= n) | (i <= before) | (tl.abs(wide) == float("inf"))
        bad |= wide != wide
        if VALUES == 1:
            bad |= tl.abs(wide) > 65504.0
        _flag(flags_ptr, live & bad)


@triton.jit
def _sparse_mean_kernel(sums_ptr, out_ptr, tiles, k, CHUNK: tl.constexpr):
    # One program: the tiles' float64 sums added in tile order, divided by k and rounded
    # once to the float32 the frame carries. The sum starts from +0.0, so values of -0.0
    # alone give +0.0, as torch's mean does (a frame's mean is never -0.0).
    total = tl.zeros([CHUNK], dtype=tl.float64)
    for start in range(0, tiles, CHUNK):
        t = start + tl.arange(0, CHUNK)
        total += tl.load(sums_ptr + t, mask=t < tiles, other=0.0)
    mean = tl.sum(total, 0) / k
    tl.store(out_ptr, mean.to(tl.float32))


SPARSE_ENCODES = {"fp32": 0, "fp16": 1, "mean": 3}
"""The value formats :func:`sparse_frame` writes, by their code in the kernel."""


def sparse_frame(idx: torch.Tensor, val: torch.Tensor, header: bytes, values: str,
                 frame: torch.Tensor, flags: torch.Tensor | None, *, gather: bool = False
                 ) -> None:
    """Write a sparse frame of the ``k`` entries ``(idx[j], val[j])`` into ``frame``.

    ``idx``: int64, ``val``: float, both contiguous and of ``k >= 1`` elements (with
    ``gather``, ``val`` is the dense vector and the entries ``(idx[j], val[idx[j]])``; an index
    outside it reads nothing). ``header``:
    the frame's 17 bytes (``n``, ``k``, the value format's code); ``frame``: uint8 of the
    frame's size, whose index field (byte 17 on) is aligned for its indices (int32 below
    ``2**31``, else int64). ``values``: one of :data:`SPARSE_ENCODES`; for ``"mean"`` the
    tiles' float64 sums are added in a second, one-program launch. ``flags``: one int32,
    zero, that the rules of ``sparse.encode``'s check set (``None``: no check). One launch,
    and one more for a mean.
    """
    k, n = idx.numel(), int.from_bytes(header[:8], "little")
    iw = 4 if n < 2**31 else 8
    at = len(header)
    ids = frame[at : at + iw * k].view(torch.int32 if iw == 4 else torch.int64)
    code = SPARSE_ENCODES[values]
    out = frame[at + iw * k :].view(torch.float16 if code == 1 else torch.float32)
    block, opts = _config("sparse_frame")
    tiles = _cdiv(k, block)
    # the tiles' sums of a mean; other frames' kernels never touch the pointer
    sums = torch.empty(tiles, dtype=torch.float64, device=frame.device) if code == 3 else out
    launch(_sparse_frame_kernel, (tiles,), idx, val, frame, ids, out, sums,
           out if flags is None else flags, *_head_words(header[:16]), n, k, CODE=header[16],
           VALUES=code, CHECK=flags is not None, GATHER=gather, BLOCK=block, **opts)
    if code == 3:
        launch(_sparse_mean_kernel, (1,), sums, out, tiles, k, CHUNK=1024, num_warps=4)


# --- selection (bitcomm.codecs.select) ---------------------------------------------------------


@triton.jit
def _side_scores(x, SIDE: tl.constexpr):
    # The scores a selector ranks: x itself (SIDE 0), max(x, 0) / max(-x, 0) of a signed
    # vector (RedSync's top and bottom sides) or |x| (SIDE 2, top-k by magnitude), so the
    # scores are never written to memory. NaN stays NaN, as torch's clamp keeps it.
    if SIDE == 1:
        return tl.maximum(x, 0.0, propagate_nan=tl.PropagateNan.ALL)
    if SIDE == -1:
        return tl.maximum(_neg(x), 0.0, propagate_nan=tl.PropagateNan.ALL)
    if SIDE == 2:
        return tl.abs(x)
    return x


@triton.jit
def _score_stats_kernel(x_ptr, out_ptr, n, SIDE: tl.constexpr, BLOCK: tl.constexpr):
    # A fixed number of programs, each taking a run of tiles (_span) and writing one row:
    # its lanes keep their own sums and maxima over the run, reduced once at its end. The
    # fewer rows, the shorter _score_totals_kernel's walk over them, which one program makes
    # in series.
    # 16-bit scores widen to float32, exactly, as _order_key widens them: triton 3.6.0
    # refuses _side_scores of 16-bit floats (its branches' results differ in dtype).
    WIDE: tl.constexpr = x_ptr.dtype.element_ty == tl.float64
    lo, hi = _span(n, BLOCK)
    total = tl.zeros([BLOCK], dtype=tl.float64)
    top = tl.full([BLOCK], -float("inf"), tl.float64 if WIDE else tl.float32)
    bad = tl.zeros([BLOCK], dtype=tl.int32)
    positive = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(lo, hi, BLOCK):
        i = start + tl.arange(0, BLOCK)
        live = i < n
        x = tl.load(x_ptr + i, mask=live, other=0.0).to(tl.float64 if WIDE else tl.float32)
        nonfinite = (x != x) | (tl.abs(x) == float("inf"))
        s = tl.where(nonfinite, 0.0, _side_scores(x, SIDE))
        # Only the sum needs float64 (exact conversions of every float dtype); the max and
        # the check stay in single precision where the scores are.
        total += s.to(tl.float64)
        top = tl.maximum(top, tl.where(live, s, -float("inf")))
        bad |= nonfinite.to(tl.int32)
        positive += (s > 0).to(tl.int32)
    row = out_ptr + tl.program_id(0) * 4
    tl.store(row, tl.sum(total, axis=0))
    tl.store(row + 1, tl.max(top, axis=0).to(tl.float64))
    tl.store(row + 2, tl.max(bad, axis=0).to(tl.float64))
    tl.store(row + 3, tl.sum(positive, axis=0).to(tl.float64))


def score_stats(x: torch.Tensor, side: int = 0) -> torch.Tensor:
    """Return float64 ``[sum, max, bad, positive]`` of the scores of ``x``, on its device.

    The scores are ``x`` (``side=0``), ``max(x, 0)`` (1), ``max(-x, 0)`` (-1) or ``|x|`` (2);
    ``bad`` is 1 if ``x`` holds NaN or inf (those elements are left out of the sum, the max
    and the count); ``positive`` counts the scores above 0. One read of ``x`` and no host
    read: at most :data:`COUNT_PROGRAMS` programs sum their runs of tiles in float64 (exact
    for counts below 2**53), then one program adds their rows, in the same order every call.
    """
    parts = _score_parts(x, side)
    out = torch.empty(4, dtype=torch.float64, device=x.device)
    rows, warps = TUNING["score_totals"]
    launch(_score_totals_kernel, (1,), parts, out, parts.shape[0], out, out, x.numel(), 0,
           ROWS=rows, BOUNDS=False, T=1, NARROW=False, num_warps=warps)
    return out


def _score_parts(x: torch.Tensor, side: int) -> torch.Tensor:
    # score_stats' pass over x: [sum, max, bad, positive] of each program's run of tiles.
    n = x.numel()
    block, opts = _config("score_stats")
    grid = (_programs(n, "score_stats"),)  # a run of tiles a program
    parts = torch.empty((grid[0], 4), dtype=torch.float64, device=x.device)
    launch(_score_stats_kernel, grid, x, parts, n, SIDE=side, BLOCK=block, **opts)
    return parts


def stats_and_counts(x: torch.Tensor, coefs: list[float] | np.ndarray, side: int = 0
                     ) -> tuple[torch.Tensor, int, Runs]:
    """:func:`score_stats`, then :func:`count_above` of thresholds made from it on the device.

    The thresholds are ``0.0`` and ``mean + c * (top - mean)`` for each ``c`` of ``coefs``
    (float64, ascending, each >= 0), ``mean`` and ``top`` the scores' mean and max: those
    RedSync's searches count first, which the host would compute from the statistics it had
    read. Here one program computes them after the statistics, in the host's float64
    operations, so the statistics and the counts come back in one host read instead of two.
    Float32 and float64 scores. Returns ``(out, t, runs)``: ``out`` float64 ``[sum, max, bad,
    positive]``, then ``t`` counts, of which ``out[5 + j]`` is how many scores exceed
    threshold ``j`` (in ascending order, 0.0 first), then the thresholds as the count
    compared with them, which the caller checks against its own; ``runs`` as
    :func:`count_above`'s.
    """
    _check_compared(x)
    m = len(coefs) + 1
    levels = _levels(m)
    t = 1 << levels
    parts = _score_parts(x, side)
    out = torch.empty(4 + t + m, dtype=torch.float64, device=x.device)
    bounds = torch.empty(t - 1, dtype=x.dtype, device=x.device)
    device_coefs = _frame.to_device(torch.from_numpy(np.asarray(coefs, dtype=np.float64)),
                                    x.device) if len(coefs) else out
    rows, warps = TUNING["score_totals"]
    launch(_score_totals_kernel, (1,), parts, out, parts.shape[0], device_coefs, bounds,
           x.numel(), m, ROWS=rows, BOUNDS=True, T=t, NARROW=x.dtype == torch.float32,
           enable_fp_fusion=False, num_warps=warps)
    return out, t, _count(x, bounds, out[4 : 4 + t], levels, side, True)[1]


@triton.jit(do_not_specialize=("n", "m"))
def _score_totals_kernel(parts_ptr, out_ptr, programs, coefs_ptr, bounds_ptr, n, m,
                         ROWS: tl.constexpr, BOUNDS: tl.constexpr, T: tl.constexpr,
                         NARROW: tl.constexpr):
    # One program: the totals of score_stats' rows, ROWS rows a step in a fixed order (the
    # same sums every call). One launch where torch took five (four column reductions and
    # a stack), each costing the host about what a kernel does. With BOUNDS (stats_and_counts)
    # it then writes the count pass's bounds: 0.0, then mean + c * (top - mean) for each of
    # the m - 1 coefficients, mean = sum / n, in float64 one operation at a time (the launch
    # disables contraction into fused multiply-adds) as the host computes them, rounded to
    # float32 with NARROW as numpy rounds them; +inf in the rest of bounds_ptr's T - 1 words.
    # Their float64 values go to out_ptr[4 + T:], and out_ptr[4:4 + T] is zeroed for the
    # count pass's float64 counts.
    r = tl.arange(0, ROWS)
    total = tl.zeros([ROWS], dtype=tl.float64)
    top = tl.full([ROWS], -float("inf"), tl.float64)
    bad = tl.zeros([ROWS], dtype=tl.float64)
    positive = tl.zeros([ROWS], dtype=tl.float64)
    for first in range(0, programs, ROWS):
        row = parts_ptr + (first + r) * 4
        live = first + r < programs
        total += tl.load(row, mask=live, other=0.0)
        top = tl.maximum(top, tl.load(row + 1, mask=live, other=-float("inf")))
        bad = tl.maximum(bad, tl.load(row + 2, mask=live, other=0.0))
        positive += tl.load(row + 3, mask=live, other=0.0)
    total = tl.sum(total, axis=0)
    top = tl.max(top, axis=0)
    tl.store(out_ptr, total)
    tl.store(out_ptr + 1, top)
    tl.store(out_ptr + 2, tl.max(bad, axis=0))
    tl.store(out_ptr + 3, tl.sum(positive, axis=0))
    if BOUNDS:
        mean = total / n.to(tl.float64)  # float64 division: correctly rounded (div.rn.f64)
        j = tl.arange(0, T)
        c = tl.load(coefs_ptr + j - 1, mask=(j >= 1) & (j < m), other=0.0)
        bound = tl.where(j == 0, 0.0, mean + c * (top - mean))
        if NARROW:
            bound = bound.to(tl.float32)
        bound = tl.where(j < m, bound, float("inf"))
        tl.store(bounds_ptr + j, bound, mask=j < T - 1)
        tl.store(out_ptr + 4 + j, tl.zeros([T], dtype=tl.float64))
        tl.store(out_ptr + 4 + T + j, bound.to(tl.float64), mask=j < m)


@triton.jit
def _count_above_kernel(x_ptr, bounds_ptr, counts_ptr, rows_ptr, n, SIDE: tl.constexpr,
                        T: tl.constexpr, LOG: tl.constexpr, ROWS: tl.constexpr,
                        BLOCK: tl.constexpr):
    # A fixed number of programs, each taking a run of tiles (as _gather_kernel's programs
    # do) and adding its T counts to the result once: one program per tile would pile
    # millions of atomic additions onto the same T addresses. A program's count i is of its
    # scores with i or more bounds below them (the suffix sums of where they fall), so that
    # count j + 1 is of those above bounds[j], with no pass over the counts afterwards. With
    # ROWS each program also writes its own T counts, its row of rows_ptr.
    acc = tl.zeros([T], dtype=tl.int32)
    lo, hi = _span(n, BLOCK)
    for start in range(lo, hi, BLOCK):
        i = start + tl.arange(0, BLOCK)
        live = i < n
        s = _side_scores(tl.load(x_ptr + i, mask=live, other=0.0), SIDE)
        # pos = how many of the T - 1 sorted bounds (padded with +inf) lie below s: a binary
        # search whose probes are loads of a small array that stays in cache.
        pos = tl.zeros([BLOCK], dtype=tl.int32)
        for level in tl.static_range(LOG):
            half = T >> (level + 1)
            bound = tl.load(bounds_ptr + pos + (half - 1))
            pos = tl.where(bound < s, pos + half, pos)
        acc += tl.histogram(pos, T, mask=live)
    acc = tl.cumsum(acc, 0, reverse=True)
    # float64 counts (stats_and_counts') are exact integers, so their sums take any order
    tl.atomic_add(counts_ptr + tl.arange(0, T), acc.to(counts_ptr.dtype.element_ty))
    if ROWS:
        tl.store(rows_ptr + tl.program_id(0) * T + tl.arange(0, T), acc)


COUNT_PROGRAMS = 4096
"""Programs of :func:`count_above` at most (each adds its counts once)."""


class Runs:
    """What each program of :func:`count_above` counted: for :func:`indices_above`.

    ``rows[p, i]``: how many scores of program ``p``'s run of tiles have ``i`` or more of the
    bounds below them. The gathering pass of :func:`indices_above` takes the same runs, so the
    scores above ``bounds[j]`` in each run, ``rows[:, j + 1]``, are where its runs start,
    without a count of its own (a read of ``x`` less).
    """

    def __init__(self, rows: torch.Tensor):
        self.rows = rows

    def above(self, j: int) -> torch.Tensor:
        """Return the int32 count of each run's scores above ``bounds[j]`` (a view)."""
        return self.rows[:, j + 1]


def count_above(x: torch.Tensor, bounds: torch.Tensor | np.ndarray, side: int = 0, *,
                runs: bool = False) -> torch.Tensor | tuple[torch.Tensor, Runs]:
    """Return int32 ``c`` with ``c[j]`` = how many scores exceed ``bounds[j]``, on the device.

    ``bounds``: ascending, of the scores' dtype (float32 or float64), a tensor on ``x``'s
    device or a numpy array (padded on the host and copied once, as a search that computes
    its thresholds there has them); scores as in :func:`score_stats`. One read of ``x``;
    integer counts, so the same on every device and in any order of the atomic additions.
    With ``runs``, also each program's counts (:class:`Runs`), which :func:`indices_above`
    can start from.
    """
    _check_compared(x)
    m = len(bounds)
    levels = _levels(m)
    t = 1 << levels
    if isinstance(bounds, np.ndarray):
        padded = np.full(t - 1, np.inf, dtype=bounds.dtype)
        padded[:m] = bounds
        padded = _frame.to_device(torch.from_numpy(padded), x.device)
    else:
        padded = torch.full((t - 1,), float("inf"), dtype=bounds.dtype, device=x.device)
        padded[:m] = bounds
    hist, rows = _count(x, padded, torch.zeros(t, dtype=torch.int32, device=x.device), levels,
                        side, runs)
    # scores above bounds[j] are those with j + 1 or more bounds below them
    counts = hist[1 : m + 1]
    return (counts, rows) if runs else counts


def _check_compared(x: torch.Tensor) -> None:
    if x.dtype not in (torch.float32, torch.float64):  # the kernel compares in x's dtype
        raise TypeError(f"expected float32 or float64 scores, got {x.dtype}")


def _levels(m: int) -> int:
    # The count pass's binary-search levels for m bounds: T = 2**levels > m, room for each.
    return max(1, m.bit_length())


def _count(x: torch.Tensor, padded: torch.Tensor, hist: torch.Tensor, levels: int, side: int,
           runs: bool) -> tuple[torch.Tensor, Runs | None]:
    # count_above's pass: into hist (zeroed, 2**levels counts, int32 or float64), and with
    # runs each program's counts.
    t = 1 << levels
    n = x.numel()
    block, opts = _config("key_digits")  # the tiles and runs of indices_above's gathering
    grid = (_programs(n),)
    # without runs, hist stands in for the rows it does not write: a pointer of memory
    rows = (torch.empty if n else torch.zeros)((grid[0], t), dtype=torch.int32,
                                               device=x.device) if runs else hist
    if n:
        launch(_count_above_kernel, grid, x, padded, hist, rows, n, SIDE=side, T=t, LOG=levels,
               ROWS=runs, BLOCK=block, **opts)
    return hist, Runs(rows) if runs else None


# --- exact top-k by radix selection (bitcomm.codecs.select) ------------------------------------

DIGIT = 8
"""Bits of the key that one :func:`top_indices` counting pass settles (256 counters)."""

SLACK = 64
"""The candidates gathered after two digits have room for ``k + n // SLACK`` keys."""

LOCAL_ROOM = 2
"""How many times its share of the candidates' room a program of a sampled bound's count pass
keeps of the keys it counts (with their indices), for the gathering pass to copy instead of
reading x a second time; 0: it keeps none, and the gathering reads x.

A program whose keys at or above the bound outnumber its stretch (``LOCAL_ROOM *
ceil(room / programs)``, an even share of the room when LOCAL_ROOM is 1) reads its run of x
again, so a vector whose large scores crowd into a few runs costs a read of those runs, as
without it. The stretches take ``LOCAL_ROOM`` times the room's keys and their indices, 8
bytes a key (16 for float64 scores): 27 MB at 64M float32 scores and k = 1% (1.7M keys of
room). To measure another value: ``bitcomm bench profile --device cuda --codecs topk-1% --set
LOCAL_ROOM=N`` (the count_at_least and gather rows)."""

COUNT_STAGES = 1
"""Tiles whose loads a program of the count pass of a gathering above a floor (a sampled
top-k's, :func:`indices_above`'s) keeps in flight: Triton's ``num_stages`` of its loop. At 1
its loads go out a tile at a time, each waited for before the tile's work.

The pass reads x once with little work a tile beside its loads: under triton 3.6 (the GPU
image's), at sm_90, a tile of 1024 float32 takes its loop 252 instructions (31.5 an element)
and 5 barriers, at 56 registers (RedSync's census: 256, 71): some 9 programs an SM by their
registers, about 36 KB of loads in flight at once; on an H200 it read at 0.73 of
``torch.sum``'s speed (106 us at 64M, the largest kernel of a top-k). From 2 on the loads go
through shared memory (``cp.async``) that many tiles ahead, for more instructions (273 and
288 a tile at 2 and 3; the census's 276 and 300), 4 or 8 KB of shared memory a program and
registers as before.
Which wins is for a GPU to time: ``bitcomm bench profile --device cuda --sizes 64M --codecs
topk-1%,redsync-1% --set COUNT_STAGES=3`` (the count_at_least rows), which
``tools/gpu-check.sh``'s profile step runs."""

CANDIDATE_TILES = 8
"""Tiles of the candidates' room a program of the digit passes takes after a sampled bound.

Every program of a pass first settles the digit above from the last histogram (a chain of
dependent loads and a scan of 256 counts) and the busy ones add 256 counts to it: cost a
program pays whether or not its run holds a candidate. On an H200, the four passes of a top-k
of 1% of 64M float32 scores (k = 671K, 1.7M keys of room) took 119 us at 4096 programs
(one per tile of x), 118 at 2048, 74 at 1024, 60 at 512, 54 at 256, 61 at 128 and 96 at 64,
the same indices each time; a program per 8 tiles of room gives 210 there. Where the sample
misled and no candidate was gathered, these programs read all of x, with fewer of them than
its count pass had (a slower pass, in a case the sample's margin makes rare). To measure it at
another value: ``bitcomm bench profile --device cuda --codecs topk-1% --set
CANDIDATE_TILES=N`` (the key_digits rows)."""


@triton.jit
def _order_key(x, SIDE: tl.constexpr, WIDE: tl.constexpr):
    # A signed integer whose order is the order of the score: the float's bits with the
    # magnitude bits of negative scores flipped. -0.0 becomes +0.0 first, since the two compare
    # equal; 16-bit floats widen to float32, which keeps their order. Every NaN, of either
    # sign, gets the largest key, above +inf's, as the numpy and torch paths rank NaN.
    # The sides' scores are never negative, so their keys need no flip: |x|'s bits (the sign
    # cleared: -0.0 is +0.0), or the signed maximum of (+-x)'s bits and 0 (a negative x,
    # -0.0 too, is a negative integer), one or two operations an element where the float
    # operations and the general case's flip took four or five.
    if WIDE:
        x = x.to(tl.float64)
    else:  # widened before any comparison: the interpreter compares bfloat16 wrongly
        if x.dtype == tl.bfloat16:  # by its bits: the interpreter's cast flushes subnormals
            x = (x.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)
        x = x.to(tl.float32)
    INT: tl.constexpr = tl.int64 if WIDE else tl.int32
    MAGNITUDE: tl.constexpr = 0x7FFFFFFFFFFFFFFF if WIDE else 0x7FFFFFFF
    SIGN: tl.constexpr = -0x8000000000000000 if WIDE else -0x80000000
    if SIDE == 0:
        b = tl.where(x == 0, 0.0, x).to(INT, bitcast=True)
        b ^= (b >> (63 if WIDE else 31)) & MAGNITUDE
    elif SIDE == 2:
        b = tl.abs(x).to(INT, bitcast=True)
    elif SIDE == 1:
        b = tl.maximum(x.to(INT, bitcast=True), 0)
    else:  # -x's bits: the sign bit flipped
        b = tl.maximum(x.to(INT, bitcast=True) ^ SIGN, 0)
    return tl.where(x != x, MAGNITUDE, b)


@triton.jit
def _counted(key, NAN: tl.constexpr):
    # Whether a key takes part: with NAN every key; without, not NaN's (the largest key),
    # for indices_above, whose count (count_above's) holds no NaN.
    if NAN:
        return key == key
    if key.dtype == tl.int64:
        return key != 0x7FFFFFFFFFFFFFFF
    return key != 0x7FFFFFFF


@triton.jit
def _span(total, BLOCK: tl.constexpr):
    # This program's share of `total` elements: a run of whole tiles, the runs in program
    # order, so that what the programs gather run by run lies in index order.
    per = tl.cdiv(tl.cdiv(total, BLOCK), tl.num_programs(0)) * BLOCK
    lo = tl.program_id(0).to(tl.int64) * per
    return lo, tl.minimum(lo + per, total)


@triton.jit
def _source(m_ptr, n, BLOCK: tl.constexpr, PASS: tl.constexpr):
    # What a kernel after the gathering reads: the m gathered candidates, or the n keys of x
    # if none were gathered (m = 0) or the k-th largest key was settled at the sampled bound
    # (m = -1); and this program's span of it. A counting pass (PASS) reads nothing once the
    # key is settled.
    m = tl.load(m_ptr)
    gathered = m > 0
    total = tl.where(gathered, m, n)
    lo, hi = _span(total, BLOCK)
    if PASS:
        hi = tl.where(m < 0, lo, hi)
    return gathered, total, lo, hi


@triton.jit
def _tile_keys(x_ptr, keys_ptr, start, total, gathered, SIDE: tl.constexpr, WIDE: tl.constexpr,
               BLOCK: tl.constexpr, R: tl.constexpr):
    # The keys of the tile at `start`: the gathered candidates' (a uniform branch per tile),
    # or those of x's scores; laid out as _rows_of(start, BLOCK, R).
    j = _rows_of(start, BLOCK, R)
    live = j < total
    if gathered:
        key = tl.load(keys_ptr + j, mask=live, other=0)
    else:
        key = _order_key(tl.load(x_ptr + j, mask=live, other=0.0), SIDE, WIDE)
    return j, live, key


@triton.jit
def _settle(hist_ptr, state_ptr, SHIFT: tl.constexpr, TOP: tl.constexpr, WIDE: tl.constexpr):
    # The k-th largest key's digit at SHIFT, from its pass's histogram (hist_ptr) and the state
    # before it (state_ptr: the prefix of the digits settled so far, and the rank r of the
    # k-th largest among the keys that share it). Every program of the kernel that needs the
    # digit settles it alike (256 counts, cached); program 0 writes the next state row.
    counts = tl.load(hist_ptr + 255 - tl.arange(0, 256))  # from the largest digit down
    digit, rank = _kth_bin(counts, tl.load(state_ptr + 1), TOP)
    if WIDE:
        bits = digit.to(tl.int64) << SHIFT
    else:  # a top digit shifted into an int32's sign bit gives a negative key, sign-extended
        bits = (digit.to(tl.int32) << SHIFT).to(tl.int64)
    prefix = tl.load(state_ptr) | bits
    if tl.program_id(0) == 0:
        tl.store(state_ptr + 2, prefix)
        tl.store(state_ptr + 3, rank)
    return prefix


@triton.jit
def _kth_bin(counts, r, TOP: tl.constexpr):
    # The digit of the r-th largest key, from the 256 counts of a digit's histogram ordered
    # from the largest digit down, and the key's rank among the keys of its digit: the
    # digits whose running count stays below r hold only keys that rank before it. With TOP
    # the counts are the top digit's with its sign bit flipped (so that negative keys order
    # below positive ones), and the digit found is flipped back.
    ahead = tl.cumsum(counts, 0) < r
    digit = 255 - tl.sum(ahead.to(tl.int32), 0)
    if TOP:
        digit = digit ^ 128
    return digit, r - tl.sum(tl.where(ahead, counts, 0), 0)


@triton.jit
def _chosen(above, tie, taken, need, BLOCK: tl.constexpr):
    # Which keys of a tile are chosen, and each chosen key's slot among the tile's: every key
    # above the k-th largest, and its ties in index order while fewer than `need` are taken
    # (`taken` by the tiles before). One scan for both running counts: ties in the high half,
    # keys above in the low (a tile holds fewer than 2**16 elements).
    both = tl.cumsum((tie.to(tl.int32) << 16) | above.to(tl.int32), 0)
    # per-element arithmetic in int32: the ties this tile may still take, at most BLOCK
    room = tl.minimum(tl.maximum(need - taken, 0), BLOCK).to(tl.int32)
    ties = both >> 16  # the tile's ties up to here, inclusive
    chosen = above | (tie & (ties <= room))
    return chosen, (both & 0xFFFF) + tl.minimum(ties, room) - 1


@triton.jit
def _key_digits_kernel(x_ptr, keys_ptr, hist_ptr, state_ptr, m_ptr, rows_ptr, n,
                       SIDE: tl.constexpr, WIDE: tl.constexpr, SHIFT: tl.constexpr,
                       TOP: tl.constexpr, ROWS: tl.constexpr, FIRST: tl.constexpr,
                       SETTLE: tl.constexpr, SETTLE_TOP: tl.constexpr, BLOCK: tl.constexpr):
    # The histogram of the key digit at SHIFT among the keys whose higher digits equal those
    # of the k-th largest key (the prefix); over the gathered candidates once there are some
    # (m_ptr > 0), else over x. With SETTLE the kernel first settles the digit above, from the
    # previous pass's histogram (the row before hist_ptr) and state row (state_ptr), else
    # state_ptr's row holds the prefix. Each program takes a run of tiles and adds its 256
    # counts once: one program per tile would pile millions of atomic additions onto the same
    # 256 addresses. With ROWS a program also writes its counts, and how many of its keys lie
    # above the group, for the gathering pass.
    if SETTLE:
        prefix = _settle(hist_ptr - 256, state_ptr, SHIFT + 8, SETTLE_TOP, WIDE)
    else:
        prefix = tl.load(state_ptr)
    if FIRST:  # before the candidates are gathered
        gathered = False
        total = n
        lo, hi = _span(n, BLOCK)
    else:
        gathered, total, lo, hi = _source(m_ptr, n, BLOCK, True)
    acc = tl.zeros([256], dtype=tl.int32)
    outside = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(lo, hi, BLOCK):
        _, live, key = _tile_keys(x_ptr, keys_ptr, start, total, gathered, SIDE, WIDE, BLOCK,
                                  1)
        digit = ((key >> SHIFT) & 255).to(tl.int32)
        if TOP:  # the sign bit: negative keys come first
            acc += tl.histogram(digit ^ 128, 256, mask=live)
        else:
            high = key >> (SHIFT + 8)
            mine = prefix.to(key.dtype) >> (SHIFT + 8)
            acc += tl.histogram(digit, 256, mask=live & (high == mine))
            if ROWS:
                outside += (live & (high > mine)).to(tl.int32)
    if hi > lo:  # the candidates may fill a quarter of the programs: the rest add nothing
        tl.atomic_add(hist_ptr + tl.arange(0, 256), acc.to(tl.int64))
    if ROWS:
        row = rows_ptr + tl.program_id(0) * 257
        tl.store(row + tl.arange(0, 256), acc)
        tl.store(row + 256, tl.sum(outside, 0))


@triton.jit
def _kth_value_kernel(hist_ptr, state_ptr, m_ptr, out_ptr, WIDE: tl.constexpr):
    # One program: the last digit of the k-th largest key, and the score whose key it is
    # (float64, or float32 for 32-bit and 16-bit scores).
    tl.store(out_ptr, _key_score(_kth_key(hist_ptr, state_ptr, m_ptr, WIDE), WIDE))


@triton.jit
def _key_score(key, WIDE: tl.constexpr):
    # The score whose order key (_order_key) is `key`: float64, or float32 for 32-bit and
    # 16-bit scores; +0.0 for both zeros, and the one NaN's key gives a NaN.
    if WIDE:
        bits = key.to(tl.int64)
        score = (bits ^ ((bits >> 63) & 0x7FFFFFFFFFFFFFFF)).to(tl.float64, bitcast=True)
    else:
        bits = key.to(tl.int32)
        score = (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)
    return score


@triton.jit
def _kth_key(hist_ptr, state_ptr, m_ptr, WIDE: tl.constexpr):
    # The k-th largest key: its last digit settled from the last pass (state_ptr: the row
    # before it), or, when the gathering settled it at the sampled bound (m = -1), the next
    # state row as the gathering wrote it.
    if tl.load(m_ptr) < 0:
        key = tl.load(state_ptr + 2)
    else:
        key = _settle(hist_ptr, state_ptr, 0, False, WIDE)
    return key


@triton.jit
def _gathered_counts_kernel(hist_ptr, state_ptr, rows_ptr, counts_ptr, SHIFT: tl.constexpr,
                            TOP: tl.constexpr, WIDE: tl.constexpr):
    # Settles the digit at SHIFT (the ROWS pass's), then: how many keys each program of that
    # pass will gather, those above the group (the row's last count) and the group's whose
    # digit is the k-th's or above.
    digit = ((_settle(hist_ptr, state_ptr, SHIFT, TOP, WIDE) >> SHIFT) & 255).to(tl.int32)
    row = rows_ptr + tl.program_id(0) * 257
    j = tl.arange(0, 256)
    c = tl.sum(tl.where(j >= digit, tl.load(row + j), 0), 0) + tl.load(row + 256)
    tl.store(counts_ptr + tl.program_id(0), c.to(tl.int64))


@triton.jit
def _sample_bound_kernel(x_ptr, work_ptr, words, at, step, r, k, rank_at,
                         SIDE: tl.constexpr, WIDE: tl.constexpr, M: tl.constexpr,
                         HASH: tl.constexpr, WORK: tl.constexpr):
    # First the selection's work buffer (`words` words, the bound's at `at`): all zeros but
    # its first rank, k, at `rank_at`; the bound's word is left to its own store, so that no
    # two threads write one word.
    w = tl.arange(0, WORK)
    tl.store(work_ptr + w, tl.where(w == rank_at, k, 0).to(tl.int64),
             mask=(w < words) & (w != at))
    # One program: the r-th largest key of the stratified sample of _bracket.positions (the
    # same positions, computed here), rounded down to its sign, exponent and first 7 (float32)
    # or 8 (float64) mantissa bits: a bound a few more keys reach, for half the search. The
    # search goes bit by bit from the top: the largest such key that at least r sampled keys
    # reach, each step adding the next bit when that many still reach it. The bound stays
    # inside the key's range, so nothing overflows.
    s = tl.arange(0, M).to(tl.int64)
    pos = s * step + ((((s * HASH) & 0xFFFFFFFF) >> 16) * step >> 16)
    key = _order_key(tl.load(x_ptr + pos), SIDE, WIDE)
    if WIDE:
        lowest = -9223372036854775808
    else:
        lowest = -2147483648
    bound = tl.where(tl.sum((key >= 0).to(tl.int32), 0) >= r, 0, lowest).to(key.dtype)
    for bit in tl.static_range(62 if WIDE else 30, 43 if WIDE else 15, -1):
        t = bound + (1 << bit)
        bound = tl.where(tl.sum((key >= t).to(tl.int32), 0) >= r, t, bound)
    tl.store(work_ptr + at, bound.to(tl.int64))


@triton.jit
def _rows_of(start, BLOCK: tl.constexpr, R: tl.constexpr):
    # The positions of the tile at `start`: as [BLOCK // R, R] rows of R (R > 1), else flat.
    # A running count over rows is a scan of one count a row and one along each row, where
    # one scan over the flat tile compiled, under triton 3.6.0, to a warp scan for each
    # element a thread holds (the gathering pass: 62 instructions an element, 36 as rows of
    # 4 float32, sm_90).
    if R > 1:
        i = start + tl.arange(0, BLOCK // R)[:, None] * R + tl.arange(0, R)[None, :]
    else:
        i = start + tl.arange(0, BLOCK)
    return i


@triton.jit
def _slots(take, R: tl.constexpr):
    # Each taken element's slot among a tile's taken elements (the running count, less one)
    # in index order, the tile as _rows_of(..., R) lays it out; and the counts whose sum is
    # how many are taken (a row's, or each element's in a flat tile).
    if R > 1:
        counts = tl.sum(take.to(tl.int32), 1)
        slot = (tl.cumsum(counts, 0) - counts)[:, None] + tl.cumsum(take.to(tl.int32), 1) - 1
    else:
        counts = take.to(tl.int32)
        slot = tl.cumsum(counts, 0) - 1
    return slot, counts


@triton.jit
def _gather_kernel(x_ptr, state_ptr, m_ptr, ends_ptr, keys_ptr, idx_ptr, settled_ptr, local_ptr,
                   cap, groups_ptr, ng, n, need, room, SIDE: tl.constexpr, WIDE: tl.constexpr,
                   SHIFT: tl.constexpr, KEYS: tl.constexpr, SCORES: tl.constexpr,
                   NAN: tl.constexpr, STRICT: tl.constexpr, LOCAL: tl.constexpr,
                   PACK: tl.constexpr, GROUP: tl.constexpr, BLOCK: tl.constexpr):
    # The candidates: every key whose digits from SHIFT up are at least those of the key in
    # state_ptr (the k-th largest's prefix, or a sampled bound: a superset of the top k when
    # there are at least `need` of them), with its index (and, with KEYS, the key, or with
    # SCORES too the score whose key it is, in the scores' float dtype), each
    # program's run at the end of the runs before it (ends: the running sum of the programs'
    # counts), so in index order; their number goes to m_ptr. Nothing when they are fewer
    # than `need` or would not fit in `room`: m stays 0 and the passes go on reading x. NaN
    # as _counted says.
    # With STRICT (a sampled bound; the programs' counts of the keys strictly above it follow
    # theirs in the same running sum, so a run of them ends at its sum less the first total),
    # when the keys at the bound overflow the room: the keys above it are the candidates if
    # `need` of them fit; if fewer than `need` lie above it, the `need`-th largest key is the
    # bound itself, which goes with the ties still to take to settled_ptr (the last state
    # row), m to -1, and no pass reads anything until the writing passes read x.
    # With LOCAL (and GROUP; the count pass's, floor's keys and their indices in local_ptr,
    # `cap` a program) a program whose keys at or above floor's all fit in its stretch copies its
    # run from there (or the part of it above floor, with STRICT) instead of reading x.
    # With GROUP (> 0) ends_ptr holds the programs' counts themselves, and groups_ptr the
    # sums of each GROUP programs' (_count_at_least_kernel's GROUP; ng of them a half): a
    # program adds up those before its own and its group's counts before it, where a running
    # sum of the counts would be a scan of its own between the two passes.
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    if GROUP > 0:
        reached = _total(groups_ptr, ng, GROUP)
    else:
        reached = tl.load(ends_ptr + programs - 1)  # all the keys at or above the floor
    total = reached
    fits = (total >= need) & (total <= room)
    if STRICT:
        if GROUP > 0:
            strict = _total(groups_ptr + ng, ng, GROUP)
        else:
            strict = tl.load(ends_ptr + 2 * programs - 1) - reached
        above = (total > room) & (strict >= need) & (strict <= room)
        if (total > room) & (strict < need) & (pid == 0):
            tl.store(settled_ptr, tl.load(state_ptr))
            tl.store(settled_ptr + 1, need - strict)
            tl.store(m_ptr, -1)
        total = tl.where(above, strict, total)
        col = above.to(tl.int32)  # which half of ends holds the runs' counts
    else:
        col = 0
    if fits | (col == 1):
        if pid == 0:  # (before the loops: nothing is kept live across them for it)
            tl.store(m_ptr, total)
        floor = (tl.load(state_ptr) >> SHIFT) + col
        if GROUP > 0:
            at = _before(ends_ptr + col * programs, groups_ptr + col * ng, pid, GROUP)
        else:
            at = tl.load(ends_ptr + col * programs + pid - 1, mask=(pid > 0) | (col == 1),
                         other=0) - col * reached
        # The tile as rows of 16 bytes, a load each (_rows_of): 8 16-bit, 4 32-bit or 2
        # 64-bit scores.
        R: tl.constexpr = 128 // x_ptr.dtype.element_ty.primitive_bitwidth
        if LOCAL:  # (with GROUP: ends_ptr holds each program's count)
            mine = tl.load(ends_ptr + pid)
            if mine <= cap:
                base = pid.to(tl.int64) * cap
                behind = programs.to(tl.int64) * cap
                for start in range(0, mine, BLOCK):
                    if PACK:  # a key and its index a word (_count_at_least_kernel's PACK)
                        j = _rows_of(start, BLOCK, R)
                        live = j < mine
                        both = tl.load(local_ptr + base + j, mask=live, other=0)
                        key = (both >> 32).to(tl.int32)
                        i = both.to(tl.int32)
                    else:
                        j, live, key = _tile_keys(x_ptr, local_ptr + base, start, mine, True,
                                                  SIDE, WIDE, BLOCK, R)
                        key = key.to(tl.int64 if WIDE else tl.int32)  # int64 where n > 2**31
                        i = tl.load(local_ptr + behind + base + j, mask=live, other=0)
                    at = _gathered(keys_ptr, idx_ptr, at, i, live, key, floor, SHIFT, KEYS,
                                   SCORES, NAN, WIDE, R)
            else:
                _gather_run(x_ptr, keys_ptr, idx_ptr, at, floor, n, SIDE, WIDE, SHIFT, KEYS,
                            SCORES, NAN, BLOCK, R)
        else:
            _gather_run(x_ptr, keys_ptr, idx_ptr, at, floor, n, SIDE, WIDE, SHIFT, KEYS, SCORES,
                        NAN, BLOCK, R)


@triton.jit
def _total(groups_ptr, ng, GROUP: tl.constexpr):
    # the sum of ng (at most GROUP) int64 group sums
    r = tl.arange(0, GROUP)
    return tl.sum(tl.load(groups_ptr + r, mask=r < ng, other=0), 0)


@triton.jit
def _before(counts_ptr, groups_ptr, pid, GROUP: tl.constexpr):
    # the sum of the int64 counts of the programs before `pid`: the sums of the groups (of
    # GROUP programs, at most GROUP groups) before its own, and its group's counts before it
    g = pid // GROUP
    r = tl.arange(0, GROUP)
    own = tl.load(counts_ptr + g * GROUP + r, mask=r < pid - g * GROUP, other=0)
    return tl.sum(own + tl.load(groups_ptr + r, mask=r < g, other=0), 0)


@triton.jit
def _gather_run(x_ptr, keys_ptr, idx_ptr, at, floor, n, SIDE: tl.constexpr, WIDE: tl.constexpr,
                SHIFT: tl.constexpr, KEYS: tl.constexpr, SCORES: tl.constexpr,
                NAN: tl.constexpr, BLOCK: tl.constexpr, R: tl.constexpr):
    # _gather_kernel's writes of this program's run of x, from `at` on.
    lo, hi = _span(n, BLOCK)
    for start in range(lo, hi, BLOCK):
        i, live, key = _tile_keys(x_ptr, x_ptr, start, n, False, SIDE, WIDE, BLOCK, R)
        at = _gathered(keys_ptr, idx_ptr, at, i, live, key, floor, SHIFT, KEYS, SCORES, NAN,
                       WIDE, R)


@triton.jit
def _gathered(keys_ptr, idx_ptr, at, i, live, key, floor, SHIFT: tl.constexpr,
              KEYS: tl.constexpr, SCORES: tl.constexpr, NAN: tl.constexpr, WIDE: tl.constexpr,
              R: tl.constexpr):
    # _gather_kernel's writes of a tile (positions i, keys `key`, as _rows_of(..., R) lays
    # them out) from `at` on; returns where the next tile's go.
    take = live & ((key >> SHIFT) >= floor.to(key.dtype)) & _counted(key, NAN)
    slot, counts = _slots(take, R)  # int32 offsets from the run's end
    tl.store(idx_ptr + at + slot, i.to(idx_ptr.dtype.element_ty), mask=take)
    if SCORES:
        tl.store(keys_ptr + at + slot, _key_score(key, WIDE), mask=take)
    elif KEYS:
        tl.store(keys_ptr + at + slot, key, mask=take)
    return at + tl.sum(counts, 0)


@triton.jit
def _against_kth(x_ptr, keys_ptr, kth, start, total, gathered, SIDE: tl.constexpr,
                 WIDE: tl.constexpr, BLOCK: tl.constexpr):
    # A tile's positions, and which of its keys lie above the k-th largest and which equal it.
    j, live, key = _tile_keys(x_ptr, keys_ptr, start, total, gathered, SIDE, WIDE, BLOCK, 1)
    kth = kth.to(key.dtype)
    return j, live & (key > kth), live & (key == kth)


@triton.jit
def _chosen_counts_kernel(x_ptr, keys_ptr, hist_ptr, state_ptr, m_ptr, counts_ptr, groups_ptr,
                          ng, n, SIDE: tl.constexpr, WIDE: tl.constexpr, GROUP: tl.constexpr,
                          BLOCK: tl.constexpr):
    # Settles the last digit (from the last pass's histogram and the state before it; or
    # takes the key the gathering settled at the sampled bound), then counts, over this
    # program's run (of the candidates, or of x), the keys above the k-th largest
    # (counts_ptr[pid]) and those equal to it (counts_ptr[programs + pid]), and adds both to
    # its group's sums (groups_ptr[pid // GROUP] and groups_ptr[ng + pid // GROUP], zeroed),
    # from which _chosen_write_kernel's programs find where their runs' indices go, as
    # _gather_kernel does from _count_at_least_kernel's: no scan between the two launches.
    # A program without a run (most of them when the candidates are a few tiles a program
    # would have of x) settles nothing and adds nothing: it only writes its zero counts. The
    # first program always has a run, and it writes the settled key for the writing pass.
    gathered, total, lo, hi = _source(m_ptr, n, BLOCK, False)
    above_n = tl.zeros([BLOCK], dtype=tl.int32)
    ties_n = tl.zeros([BLOCK], dtype=tl.int32)
    if lo < hi:
        kth = _kth_key(hist_ptr, state_ptr, m_ptr, WIDE)
        for start in range(lo, hi, BLOCK):
            _, above, tie = _against_kth(x_ptr, keys_ptr, kth, start, total, gathered, SIDE,
                                         WIDE, BLOCK)
            above_n += above.to(tl.int32)
            ties_n += tie.to(tl.int32)
    pid = tl.program_id(0)
    a = tl.sum(above_n, 0).to(tl.int64)
    t = tl.sum(ties_n, 0).to(tl.int64)
    tl.store(counts_ptr + pid, a)
    tl.store(counts_ptr + tl.num_programs(0) + pid, t)
    if lo < hi:
        tl.atomic_add(groups_ptr + pid // GROUP, a)
        tl.atomic_add(groups_ptr + ng + pid // GROUP, t)


@triton.jit(do_not_specialize=HEAD_WORDS)
def _chosen_write_kernel(x_ptr, keys_ptr, idx_ptr, state_ptr, m_ptr, counts_ptr, groups_ptr,
                         out_ptr, census_ptr, frame_ptr, ids_ptr, vals_ptr, head0, head1, ng, n,
                         SIDE: tl.constexpr, WIDE: tl.constexpr, CENSUS: tl.constexpr,
                         VALUES: tl.constexpr, CODE: tl.constexpr, GROUP: tl.constexpr,
                         BLOCK: tl.constexpr):
    # Every key above the k-th largest, and the first `need` keys equal to it in index order,
    # written in index order: a program's chosen indices follow those of the programs before
    # it (_before of _chosen_counts_kernel's counts and group sums, keys above and ties
    # apart), and a tile's those of the tiles before it in the run. With CENSUS (scores that
    # are never negative) program 0 also writes to census_ptr[1] how many of the k chosen
    # are positive: all k (the keys above plus `need` ties) when the k-th largest is,
    # else those above it, the k-th largest being 0 -- from counts this pass has, where the
    # count pass would take 4 operations an element to count them as it reads x.
    # VALUES < 0: the indices go to out_ptr (int64). Else they and x's values at them are a
    # sparse frame's entries (_entries_at), with its header, instead: no int64 indices for a
    # frame's kernel to read back. A mean's values (VALUES 3) are this program's float64 sum
    # instead, to vals_ptr[program] (every program's, zero without a run), for
    # _sparse_mean_kernel to add up in program order.
    pid = tl.program_id(0)
    if CENSUS:
        if pid == 0:
            above = _total(groups_ptr, ng, GROUP)
            ties = tl.load(state_ptr + 1)
            tl.store(census_ptr + 1, tl.where(tl.load(state_ptr) > 0, above + ties, above))
    if VALUES >= 0:
        if pid == 0:
            _sparse_head(frame_ptr, head0, head1, CODE)
    gathered, total, lo, hi = _source(m_ptr, n, BLOCK, False)
    summed = tl.zeros([], dtype=tl.float64)
    if lo < hi:  # a program without a run has nothing to place
        kth = tl.load(state_ptr)
        need = tl.load(state_ptr + 1)
        above_at = _before(counts_ptr, groups_ptr, pid, GROUP)
        ties_at = _before(counts_ptr + tl.num_programs(0), groups_ptr + ng, pid, GROUP)
        for start in range(lo, hi, BLOCK):
            j, above, tie = _against_kth(x_ptr, keys_ptr, kth, start, total, gathered, SIDE,
                                         WIDE, BLOCK)
            chosen, slot = _chosen(above, tie, ties_at, need, BLOCK)
            first = above_at + tl.minimum(ties_at, need)  # chosen by the tiles before
            if gathered:
                i = tl.load(idx_ptr + j, mask=chosen, other=0).to(tl.int64)
            else:
                i = j
            if VALUES < 0:
                tl.store(out_ptr + first + slot, i, mask=chosen)
            else:
                v = _entries_at(x_ptr, ids_ptr, vals_ptr, first + slot, i, chosen, VALUES)
                if VALUES == 3:
                    summed += tl.sum(v.to(tl.float64), 0)
            above_at += tl.sum(above.to(tl.int32), 0)
            ties_at += tl.sum(tie.to(tl.int32), 0)
    if VALUES == 3:
        tl.store(vals_ptr + pid, summed)


@triton.jit
def _sparse_head(frame_ptr, head0, head1, CODE: tl.constexpr):
    # A sparse frame's 17-byte header: n and k (head0, head1), then the value format's code.
    _store_head(frame_ptr, head0, head1, 16)
    tl.store(frame_ptr + 16 + tl.arange(0, 1), tl.full([1], CODE, tl.uint8))


@triton.jit
def _entries_at(x_ptr, ids_ptr, vals_ptr, at, i, chosen, VALUES: tl.constexpr):
    # The chosen entries of a sparse frame, at their places `at`: each index i (the frame's
    # int32 index field, ids_ptr) and x's value there, in the frame's float (vals_ptr's;
    # not for a mean, VALUES 3). Returns those values (0.0 where not chosen).
    tl.store(ids_ptr + at, i.to(tl.int32), mask=chosen)
    v = tl.load(x_ptr + i, mask=chosen, other=0.0)
    if VALUES != 3:
        tl.store(vals_ptr + at, v.to(vals_ptr.dtype.element_ty), mask=chosen)
    return v


class _Selection:
    """The device buffers of one radix selection of ``k`` among ``n`` keys.

    ``hist[p]``: pass ``p``'s histogram (256 counts). ``state[p]``: the prefix of the k-th
    largest key once ``p`` digits are settled, and its rank among the keys that share that
    prefix (the ties at the k-th largest still to take once every digit is); both are tuples of
    1-D views of ``work``. ``m``: how many candidates were gathered into ``keys`` and ``idx``
    (0: none; room for ``k + n // SLACK``; -1: the k-th largest key is the sampled bound, in
    ``state[digits]``, and no pass counts). ``bound``: the key of the sampled bound, when the
    selection starts from one. ``census``: int64 ``[bad, positive]``, to which the sampled
    path's count pass adds whether its programs found NaN or inf
    (:func:`_count_at_least_kernel`'s CENSUS) and its writing pass writes ``positive``.
    ``groups``: the sampled count pass's sums of its programs' counts by groups (its GROUP),
    the gathering's running sums, or None. ``chosen``: ``chosen`` words (maybe none) for the
    writing passes' group sums (:func:`_chosen_counts_kernel`). All zeros but ``state[0]``'s
    rank, ``k``, in one buffer (``work``): two launches, or none where the selection starts
    from a sampled bound (``plan``, :func:`_sampling`'s), whose one-program kernel writes
    them. ``sampled``: whether it does (its count pass reads all of ``x``).

    The passes' scratch, left uninitialised: ``counts`` (int64, ``2 * programs`` from a
    sampled bound, each program's run at and above it then strictly above it, else
    ``programs``, the two-digit gathering's runs), ``kept`` (the keys and indices each program
    of a sampled count pass keeps, ``local`` of them, :func:`_gather_at_least`'s) or ``rows``
    (int32, 257 a program: the two-digit pass's counts; on the sampled path, which writes
    none, ``idx`` in their place), and for the caller ``writes`` int64 words and
    ``sums`` float64 ones. Every buffer of the selection is a view of one allocation, each
    16-byte aligned: an allocation on a GPU takes the host some microseconds (6 of the H200's
    a ``torch.empty``), a view about one, and a top-k's buffers are seven.
    """

    def __init__(self, x: torch.Tensor, k: int, plan: tuple[int, int] | None, programs: int,
                 chosen: int = 0, writes: int = 0, sums: int = 0):
        n = x.numel()
        wide = x.dtype == torch.float64
        self.digits = (64 if wide else 32) // DIGIT
        d = self.digits
        self.sampled = sampled = plan is not None
        groups = 2 * _cdiv(programs, _group(programs)) if sampled else 0
        at = d * 256 + 2 * (d + 1)  # the bound's word, behind the histograms and states
        room = min(n, k + n // SLACK)
        self.local = LOCAL_ROOM * _cdiv(room, programs) if sampled else 0
        # int32 keys and indices where they fit: half the bytes and cheaper arithmetic
        narrow, narrow_idx = not wide, n <= 2**31
        pack = narrow and narrow_idx  # a kept key and its index in one int64 word
        sizes = [at + 4 + groups + chosen,
                 _cdiv(room, 2) if narrow else room, _cdiv(room, 2) if narrow_idx else room,
                 2 * programs if sampled else programs,
                 (1 if pack else 2) * programs * self.local if sampled
                 else _cdiv(programs * 257, 2),
                 writes, sums]
        sizes = [size + (size & 1) for size in sizes]  # 16 bytes a part
        scratch = torch.empty(sum(sizes), dtype=torch.int64, device=x.device)
        # split_with_sizes: Tensor.split's Python wrapper costs the host 2 us a call
        work, keys, idx, self.counts, kept, self.writes, spare = scratch.split_with_sizes(sizes)
        self.work = work
        # Every view of work in one split: each view is a torch call of 1-2 us of the host's
        # time, and a call of top_indices took 19 of them (rows of 2-D views), some 35 us where
        # the split takes 19 (a 2-core VM's host, on whose CPU tensors views cost as on CUDA
        # ones).
        parts = work.split_with_sizes([256] * d + [2] * (d + 1) + [1, 1, 2, groups, chosen])
        self.hist, self.state = parts[:d], parts[d : 2 * d + 1]
        self.bound, self.m, self.census = parts[2 * d + 1 : 2 * d + 4]
        self.groups = parts[2 * d + 4] if groups else None
        self.chosen = parts[2 * d + 5]
        self.rank_at = d * 256 + 1  # state[0][1]'s word in work
        self.bound_at = at
        if not sampled:
            work.zero_()
            self.state[0][1:].fill_(k)  # one fill kernel on the device, no copy from the host
        # ``room`` keys and indices; their parts may hold a few more, which no pass reads
        self.room = room
        self.keys = keys.view(torch.int32) if narrow else keys
        self.idx = idx.view(torch.int32) if narrow_idx else idx
        self.kept = kept if sampled else None
        self.rows = self.idx if sampled else kept.view(torch.int32)
        self.sums = spare.view(torch.float64) if sums else None


def _group(programs: int) -> int:
    # The programs of a sampled bound's count pass whose counts it adds up in one word
    # (atomically, _count_at_least_kernel's GROUP): the least power of 2 whose square covers
    # them, so that each program of the gathering finds where its run starts from one load
    # of at most GROUP counts and one of at most GROUP sums, where a running sum of the counts
    # would be a scan between the two passes (a torch call of the host's and two launches).
    group = 2
    while group * group < programs:
        group *= 2
    return group


def _sampling(n: int, k: int) -> tuple[int, int] | None:
    # The sample's stride and the rank of the bound in it, if the expected number of keys at
    # or above the bound leaves half the slack of the room for the sample's error; else None.
    if n < _bracket.MIN_N:
        return None
    step, r = n // _bracket.SAMPLE, _bracket.rank(n, k)
    return None if r * step > k + n // (2 * SLACK) else (step, r)


def _sampled(x: torch.Tensor, k: int, side: int, sel: _Selection, census: bool, step: int,
             r: int) -> None:
    # Gathers the keys at or above the sampled bound of _bracket (their number to sel.m when
    # they are k or more and fit), or those strictly above it when the keys at it overflow
    # the room, or settles the k-th largest key at the bound when fewer than k lie above it
    # (a mass of equal scores, such as exact zeros: m = -1). `sel`: not zeroed; the bound's
    # kernel writes its work buffer first. `census`: whether the count pass looks for NaN and
    # inf (into sel.census, _count_at_least_kernel's CENSUS).
    work = sel.work
    launch(_sample_bound_kernel, (1,), x, work, work.numel(), sel.bound_at, step, r, k,
           sel.rank_at, SIDE=side, WIDE=x.dtype == torch.float64, M=_bracket.SAMPLE,
           HASH=_bracket.HASH, WORK=1 << (work.numel() - 1).bit_length(), num_warps=16)
    _gather_at_least(x, sel.bound, sel.m, sel.counts, sel.idx, k, sel.room, side,
                     keys=sel.keys, nan=True, settled=sel.state[sel.digits],
                     census=sel.census if census else None, local=sel.local, kept=sel.kept,
                     groups=sel.groups)


def _gather_at_least(x: torch.Tensor, floor: torch.Tensor, m: torch.Tensor,
                     counts: torch.Tensor, idx: torch.Tensor, need: int, room: int, side: int,
                     *, keys: torch.Tensor | None = None, scores: bool = False, nan: bool,
                     settled: torch.Tensor | None = None, known: bool = False,
                     census: torch.Tensor | None = None, local: int = 0,
                     kept: torch.Tensor | None = None, groups: torch.Tensor | None = None
                     ) -> None:
    # The indices (and, given `keys`, the keys, or with `scores` the scores whose keys they
    # are, in `keys` of x's dtype) of every key at or above floor's, in index
    # order, when there are `need` to `room` of them (their number to m): a count of each
    # program's run (an element of `counts` a program), then the gathering pass. `nan`:
    # whether NaN's key takes part (_counted). Given `settled` (a state row; `counts` then
    # holds twice the programs), the keys strictly above floor's are counted too, after the
    # others, for _gather_kernel's STRICT: one 1-D running sum covers both, where a GPU scans
    # the columns of a [programs, 2] tensor one thread a column.
    # `known`: `counts` holds the runs' counts already (no counting pass). `census`: the
    # zeroed [bad, positive] to whose `bad` the counting pass adds whether it found NaN or
    # inf (_count_at_least_kernel's CENSUS), or None. `local`: keys a program the counting
    # pass keeps (with their indices) for the gathering to copy instead of reading x again
    # (_count_at_least_kernel's LOCAL), or 0; with `groups` only, and `kept` their room (int64,
    # a word each key and index where both are 32-bit, two words otherwise, a program's
    # `local` after another's).
    # `groups`: zeroed words for the counting pass's sums of the programs' counts by groups
    # (2 * ceil(programs / _group(programs)), with `settled`), from which the gathering adds
    # up where each run starts (_gather_kernel's GROUP), or None: a running sum of `counts`
    # (a scan).
    n, wide = x.numel(), x.dtype == torch.float64
    block, opts = _config("key_digits")
    strict = settled is not None
    grid = (counts.shape[0] // (2 if strict else 1),)
    grouped = groups is not None and not known
    local = local if grouped else 0  # the gathering reads a program's count from its word
    group = _group(grid[0]) if grouped else 0
    ng = _cdiv(grid[0], group) if grouped else 0
    kept = kept if local else idx
    # int32 keys and indices: one int64 word each key and its index (the kernels' PACK), else
    # two int64 words
    pack = not wide and n <= 2**31
    if not known:
        launch(_count_at_least_kernel, grid, x, floor, counts,
               counts if census is None else census, kept, local,
               groups if grouped else counts, ng, n, SIDE=side, WIDE=wide, NAN=nan,
               STRICT=strict, CENSUS=census is not None, LOCAL=local > 0, PACK=pack,
               GROUP=group, R=16 // x.element_size() if local else 1, STAGES=COUNT_STAGES,
               BLOCK=block, **opts)
    launch(_gather_kernel, grid, x, floor, m, counts if grouped else counts.cumsum(0),
           idx if keys is None else keys, idx, floor if settled is None else settled, kept,
           local, groups if grouped else counts, ng, n, need, room, SIDE=side, WIDE=wide,
           SHIFT=0, KEYS=keys is not None, SCORES=scores, NAN=nan, STRICT=strict,
           LOCAL=local > 0, PACK=pack, GROUP=group, BLOCK=block, **opts)


def _check_k(n: int, k: int) -> None:
    # outside, the rank would run off the counts and the writes off `out`
    if not 0 < k <= n:
        raise ValueError(f"expected 0 < k <= {n}, got k={k}")


def _radix_select(x: torch.Tensor, k: int, side: int, census: bool = False,
                  chosen: int = 0, writes: int = 0, sums: int = 0) -> _Selection:
    # Every digit of the k-th largest key but the last, settled on the device; the last pass's
    # histogram is left for the caller's next kernel to settle. From 2**18 scores the keys at or
    # above a sampled bound are gathered first (one read of x, whose count pass keeps them
    # for the gathering to copy; a few more than k of them),
    # and every pass reads those, or x when the sample misled (fewer than k keys reach its
    # bound, or more than fit, and more than fit above it too). When the keys at the bound
    # overflow the room and fewer than k lie above it, the k-th largest key is the bound and
    # no pass reads anything. Otherwise the first two passes read x; the keys at or above
    # the k-th's first two digits are then gathered (about k of them for the usual scores)
    # and the later passes read those instead. `census`: as _sampled's; the sampled path
    # (only) looks for NaN and inf into sel.census (sel.sampled). `chosen`: zeroed words to
    # keep in sel.chosen; `writes` and `sums`: the caller's scratch words in sel.writes and
    # sel.sums (_Selection's).
    n = x.numel()
    _check_k(n, k)
    wide = x.dtype == torch.float64
    plan = _sampling(n, k)
    grid = (_programs(n),)
    sel = _Selection(x, k, plan, grid[0], chosen, writes, sums)
    block, opts = _config("key_digits")
    sampled = sel.sampled
    # the two-digit pass's counts a program (ROWS); no pass of the sampled path writes them,
    # so it passes its index buffer in their place (int32 as they are, where indices fit: the
    # kernels' signatures stay those compiled)
    rows = sel.rows
    passes = grid
    if sampled:
        _sampled(x, k, side, sel, census, *plan)
        passes = (min(grid[0], _cdiv(sel.room, CANDIDATE_TILES * block)),)
    shifts = range((sel.digits - 1) * DIGIT, -1, -DIGIT)
    for p, shift in enumerate(shifts):
        # pass p settles digit p - 1 first, except after the two-digit gathering, which did
        settle = p > 0 if sampled else p not in (0, 2)
        two_digits = not sampled and p == 1
        launch(_key_digits_kernel, passes, x, sel.keys, sel.hist[p],
               sel.state[p - 1 if settle else p], sel.m, rows, n,
               SIDE=side, WIDE=wide, SHIFT=shift, TOP=p == 0, ROWS=two_digits,
               FIRST=not sampled and p < 2, SETTLE=settle, SETTLE_TOP=p == 1, BLOCK=block,
               **opts)
        if two_digits:
            counts = sel.counts[: grid[0]]  # each program's (its part may hold one more)
            launch(_gathered_counts_kernel, grid, sel.hist[1], sel.state[1], rows, counts,
                   SHIFT=shift, TOP=False, WIDE=wide, num_warps=1)
            launch(_gather_kernel, grid, x, sel.state[2], sel.m, counts.cumsum(0), sel.keys,
                   sel.idx, sel.state[2], sel.idx, 0, counts, 0, n, 0, sel.room,
                   SIDE=side, WIDE=wide, SHIFT=shift, KEYS=True, SCORES=False, NAN=True,
                   STRICT=False, LOCAL=False, PACK=False, GROUP=0, BLOCK=block, **opts)
    return sel


def kth_largest(x: torch.Tensor, k: int, side: int = 0) -> torch.Tensor:
    """Return the ``k``-th largest score (``0 < k <= n``) as a 0-d tensor on the device.

    Scores as in :func:`score_stats`, of any float dtype; the result has ``x``'s dtype. The
    radix selection of :func:`top_indices` without its writing passes: no sort, no host read.
    """
    sel = _radix_select(x, k, side)
    d = sel.digits
    wide = x.dtype == torch.float64
    out = torch.empty((), dtype=torch.float64 if wide else torch.float32, device=x.device)
    launch(_kth_value_kernel, (1,), sel.hist[d - 1], sel.state[d - 1], sel.m, out, WIDE=wide,
           num_warps=1)
    return out.to(x.dtype)  # the keys of 16-bit floats are those of their float32 values


SMALL_TOP = 1 << 16
"""Scores up to which :func:`top_indices` runs in one program (:func:`_small_top_kernel`).

One program's passes wait on their loads tile after tile, where the radix passes spread each
over the SMs but take 9 to 11 launches (each some microseconds of the host's and the device's):
below some size the one launch wins. On an H100 (``bitcomm bench tune``, which times both
paths at 4K-128K scores; docs/results/gpu-h100.md) it won by 25x at 4K, 2.3x at 64K and tied
at 128K (1.06x); 64K scores are 16 tiles a pass."""


@triton.jit(do_not_specialize=("k", *HEAD_WORDS))
def _small_top_kernel(x_ptr, out_ptr, census_ptr, frame_ptr, ids_ptr, vals_ptr, head0, head1,
                      n, k, SIDE: tl.constexpr, WIDE: tl.constexpr, CENSUS: tl.constexpr,
                      VALUES: tl.constexpr, CODE: tl.constexpr, BLOCK: tl.constexpr):
    # The whole radix selection in one program, for a vector small enough that launches, not
    # reads, are its cost: a histogram pass over x per key digit, each digit settled in
    # registers, then one pass writes, tile after tile, the indices of the keys above the
    # k-th largest and of the first ties at it, in index order. With CENSUS the first pass
    # also writes [NaN and inf in x, positive scores up to k] (int64) to census_ptr.
    # VALUES >= 0: the indices and x's values at them are written as a sparse frame instead
    # (_chosen_write_kernel's VALUES; a mean's, VALUES 3, to vals_ptr as the frame's float32,
    # added in float64 tile by tile).
    DIGITS: tl.constexpr = 8 if WIDE else 4
    if WIDE:
        prefix = tl.zeros([], dtype=tl.int64)
    else:
        prefix = tl.zeros([], dtype=tl.int32)
    r = k.to(tl.int64)  # the k-th largest's rank among the keys that share the prefix
    for d in tl.static_range(DIGITS):
        SHIFT = (DIGITS - 1 - d) * 8
        hist = tl.zeros([256], dtype=tl.int32)
        bad = tl.zeros([BLOCK], dtype=tl.int32)
        positive = tl.zeros([BLOCK], dtype=tl.int32)
        for start in range(0, n, BLOCK):
            j = start + tl.arange(0, BLOCK)
            live = j < n
            x = tl.load(x_ptr + j, mask=live, other=0.0)
            key = _order_key(x, SIDE, WIDE)
            # counted from the largest digit down, as _kth_bin takes them; the top digit's
            # sign bit flipped too (255 - (digit ^ 128)), so that negative keys count last
            digit = ((key >> SHIFT) & 255).to(tl.int32) ^ (127 if d == 0 else 255)
            if d == 0:
                hist += tl.histogram(digit, 256, mask=live)
                if CENSUS:
                    bad += ((x != x) | (tl.abs(x) == float("inf"))).to(tl.int32)
                    positive += (key > 0).to(tl.int32)  # masked lanes' 0.0: key 0
            else:
                hist += tl.histogram(digit, 256, mask=live & (key >> (SHIFT + 8)
                                                                == prefix >> (SHIFT + 8)))
        if CENSUS and d == 0:
            tl.store(census_ptr, tl.sum(bad, 0).to(tl.int64))
            total = tl.sum(positive, 0).to(tl.int64)
            tl.store(census_ptr + 1, tl.minimum(total, k.to(tl.int64)))
        # named apart from the tiles' digits: the compiler carries a name's type round a loop
        bin, r = _kth_bin(hist, r, d == 0)
        prefix |= bin.to(prefix.dtype) << SHIFT
    # prefix is the k-th largest key; r ties at it are taken, the first in index order
    written = tl.zeros([], dtype=tl.int64)
    ties = tl.zeros([], dtype=tl.int64)
    if VALUES >= 0:
        _sparse_head(frame_ptr, head0, head1, CODE)
    summed = tl.zeros([], dtype=tl.float64)
    for start in range(0, n, BLOCK):
        j = start + tl.arange(0, BLOCK)
        live = j < n
        key = _order_key(tl.load(x_ptr + j, mask=live, other=0.0), SIDE, WIDE)
        tie = live & (key == prefix)
        chosen, slot = _chosen(live & (key > prefix), tie, ties, r, BLOCK)
        if VALUES < 0:
            tl.store(out_ptr + written + slot, j.to(tl.int64), mask=chosen)
        else:
            v = _entries_at(x_ptr, ids_ptr, vals_ptr, written + slot, j, chosen, VALUES)
            if VALUES == 3:
                summed += tl.sum(v.to(tl.float64), 0)
        written += tl.sum(chosen.to(tl.int32), 0)
        ties += tl.sum(tie.to(tl.int32), 0)
    if VALUES == 3:
        tl.store(vals_ptr, (summed / k).to(tl.float32))


def top_indices(x: torch.Tensor, k: int, side: int = 0, *, census: bool = False
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Return the ascending int64 indices of the ``k`` largest scores, ties to lower indices.

    ``0 < k <= n`` (else ``ValueError``); scores as in :func:`score_stats`, of any float
    dtype. No sort and no host read: radix selection finds the k-th largest score's key one
    8-bit digit a pass (4 passes for 32-bit and 16-bit floats, 8 for float64), each pass one
    histogram of a key digit among the keys that share the digits settled before it; the
    next kernel settles each digit on the device. The passes read candidates, a superset of
    the top k gathered in index order with their indices:

    * from :data:`~bitcomm.codecs._bracket.MIN_N` scores, when the sample's error fits the
      room (``k`` up to about 2% of ``n``), the keys at or above a bound that one program
      reads off :mod:`~bitcomm.codecs._bracket`'s sample of 16K scores (its ``rank(n, k)``-th
      largest key, rounded down to the key's first 16 bits, 20 for float64): a count pass
      over ``x`` whose programs each keep theirs (up to :data:`LOCAL_ROOM` times a share of
      the room) and a gathering pass that copies them into one run, about ``1.5 k``
      candidates at ``k = 1%``: one read of ``x`` (and of any run whose candidates overflowed
      its program's share) and 9 launches for 32-bit scores (the bound's kernel clears the
      work buffer);
    * otherwise (fewer scores, a larger ``k``) the first two passes read ``x`` and a third
      gathers the keys that share or beat the k-th largest's first two digits: about ``k``
      for the usual scores (all within a factor ``1 + 2**-7`` of the k-th largest score or
      above it, for float32), three reads of ``x`` and 11 launches.

    Up to :data:`SMALL_TOP` scores the whole selection is one launch of one program
    (:func:`_small_top_kernel`): the same passes over ``x``, each digit settled in its
    registers, then one pass that writes the indices.

    Then a count of each program's run above and at the k-th key (added into group sums as
    it goes) and the writing of each run's indices at its offset (from those sums, no scan)
    read the candidates too. When the keys at the sampled bound would outnumber
    ``k + n // SLACK`` (many tied at it, such as the exact zeros of a sparse gradient), the
    candidates are the keys strictly above it if ``k`` or more of them fit; if fewer than
    ``k`` lie above it, the k-th largest key is the bound itself: no counting pass reads
    anything, and the two writing passes read ``x`` (three reads in all). When no candidates
    are gathered, every pass reads ``x``: when fewer than ``k`` keys reach the sampled bound
    (the sample misled), or when the two-digit path's would outnumber the room (keys alike in
    their first 16 bits).

    With ``census`` (float32 and float64 scores of a side that is never negative: 1, -1 or
    2) the result is ``(indices, census)``, the census an int64 ``[bad, positive]`` on the
    device: ``bad`` is non-zero if ``x`` holds NaN or inf, ``positive`` counts the chosen
    scores above 0 (when ``bad`` is 0; ``min(k, the positive scores)``) -- a caller's
    finiteness check and RedSync's count of the side's sign. From a sampled bound the count
    pass finds ``bad`` in its read of ``x`` and the writing pass's program 0 writes
    ``positive`` from the counts above the k-th largest score; the other path reads ``x``
    once more (:func:`score_stats`).
    """
    _check_census(x, side, census)
    return _top(x, k, side, census, None)


def top_frame(x: torch.Tensor, k: int, header: bytes, values: str, frame: torch.Tensor, *,
              side: int = 2, census: bool = False) -> torch.Tensor | None:
    """Write the sparse frame of the entries of ``x`` at its ``k`` largest scores into ``frame``.

    The entries ``(i, x[i])`` of ``top_indices(x, k, side)``, in its ascending order, as
    :func:`sparse_frame` writes them with ``gather``, where the selection's writing pass
    writes them itself: no int64 indices written and read back, one launch less. ``header``:
    the frame's 17 bytes; ``values``: ``"fp32"``, ``"fp16"`` or ``"mean"`` (its code in
    :data:`SPARSE_ENCODES`; the value dtypes the frame kernel takes; a mean's float64 sums a
    program, added by a one-program launch after it as :func:`sparse_frame` adds its tiles');
    ``frame``: uint8 of the frame's size, its index field (byte 17 on) aligned; ``n < 2**31``
    (int32 indices). With ``census`` (float32 and float64 ``x``, a side that is never
    negative) return the census of ``top_indices(x, k, side, census=True)``, else None.
    """
    n = x.numel()
    if n >= 2**31:
        raise ValueError(f"top_frame writes int32 indices, so n < 2**31, got n={n}")
    if values not in ("fp32", "fp16", "mean"):
        raise ValueError(f"expected values 'fp32', 'fp16' or 'mean', got {values!r}")
    size = len(header) + 4 * k + (4 if values == "mean" else 2 * k if values == "fp16" else 4 * k)
    if frame.dtype != torch.uint8 or frame.numel() != size:
        raise ValueError(f"expected a uint8 frame of {size} bytes, got {frame.dtype} of "
                         f"{frame.numel()}")
    _check_census(x, side, census)
    got = _top(x, k, side, census, (frame, header, values))
    return got[1] if census else None


def _check_census(x: torch.Tensor, side: int, census: bool) -> None:
    if census and x.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"census takes float32 or float64 scores, got {x.dtype}")
    if census and side not in (1, -1, 2):
        raise ValueError(f"census takes the scores of side 1, -1 or 2, got side={side!r}")


def _top(x: torch.Tensor, k: int, side: int, census: bool, entries: tuple | None
         ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    # top_indices, or with `entries` (frame, header, values) top_frame: (its result, census)
    n = x.numel()
    if n <= SMALL_TOP:
        return _small_top(x, k, side, census, entries)
    if not replays():
        return _top_indices(x, k, side, census, entries)
    # Its launches follow from these alone (no host read; fresh buffers and views of them at
    # fixed offsets; a frame's alignment and header), so the ones recorded under them replay
    # (_launch.planned); from a sampled bound, whose torch ops are only the scratch's
    # allocation and views, the whole call replays (_launch.replay)
    plan = (top_indices, n, x.dtype, x.device, k, side, census, x.data_ptr() % 16 == 0,
            None if entries is None else (entries[2], entries[0].data_ptr() % 16, entries[1]),
            LOCAL_ROOM, CANDIDATE_TILES, COUNT_PROGRAMS, SLACK, COUNT_STAGES,
            TUNING["key_digits"],
            TUNING["top_write"], _bracket.SAMPLE, _bracket.MIN_N, _bracket.HASH)
    inputs = (x,) if entries is None else (x, entries[0])
    return replayed(plan, inputs, lambda: _top_indices(x, k, side, census, entries),
                    whole=_sampling(n, k) is not None)


def _written_to(x: torch.Tensor, k: int, entries: tuple | None,
                sums: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, tuple, dict, torch.Tensor | None]:
    # Where the writing pass puts the chosen: the result (int64 indices, or the frame of
    # `entries`), the kernels' frame arguments (frame, its index and value fields, the
    # header's words), their VALUES and CODE, and the frame's float32 mean for
    # _sparse_mean_kernel to write, or None. A mean's value field is that float32, or with
    # `sums` (the radix path's, a float64 a program) its programs' sums, which the mean
    # kernel adds.
    if entries is None:
        out = torch.empty(k, dtype=torch.int64, device=x.device)
        return out, (out, out, out, 0, 0), {"VALUES": -1, "CODE": 0}, None
    frame, header, values = entries
    at, code = len(header), SPARSE_ENCODES[values]
    ids = frame[at : at + 4 * k].view(torch.int32)
    vals = frame[at + 4 * k :].view(torch.float16 if code == 1 else torch.float32)
    mean = None
    if code == 3 and sums is not None:
        vals, mean = sums, vals
    return frame, (frame, ids, vals, *_head_words(header[:16])), {"VALUES": code,
                                                                  "CODE": header[16]}, mean


def _top_indices(x: torch.Tensor, k: int, side: int, census: bool, entries: tuple | None
                 ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    # _top by radix selection (more than SMALL_TOP scores)
    n = x.numel()
    block, opts = _config("top_write")
    grid = (_programs(n, "top_write"),)
    group = _group(grid[0])
    ng = _cdiv(grid[0], group)
    # the writing passes' group sums (keys above the k-th largest, and ties) in the
    # selection's work buffer, which its first launch clears; their counts a program, and a
    # mean's sums a program, in its scratch
    averaged = entries is not None and entries[2] == "mean"
    sel = _radix_select(x, k, side, census, chosen=2 * ng, writes=2 * grid[0],
                        sums=grid[0] if averaged else 0)
    d = sel.digits
    wide = x.dtype == torch.float64
    counts = sel.writes
    launch(_chosen_counts_kernel, grid, x, sel.keys, sel.hist[d - 1], sel.state[d - 1], sel.m,
           counts, sel.chosen, ng, n, SIDE=side, WIDE=wide, GROUP=group, BLOCK=block, **opts)
    out, written, codes, mean = _written_to(x, k, entries, sel.sums)
    tally = census and sel.sampled  # the count pass found NaN and inf, this pass the rest
    launch(_chosen_write_kernel, grid, x, sel.keys, sel.idx, sel.state[d], sel.m, counts,
           sel.chosen, out, sel.census if tally else out, *written, ng, n, SIDE=side,
           WIDE=wide, CENSUS=tally, **codes, GROUP=group, BLOCK=block, **opts)
    if mean is not None:  # the programs' sums, in program order
        launch(_sparse_mean_kernel, (1,), written[2], mean, grid[0], k, CHUNK=1024,
               num_warps=4)
    if not census:
        return out
    if tally:
        return out, sel.census
    stats = score_stats(x, side)[2:].to(torch.int64)
    stats[1:].clamp_(max=k)
    return out, stats


def _small_top(x: torch.Tensor, k: int, side: int, census: bool, entries: tuple | None
               ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    # _top of at most SMALL_TOP scores: one launch, one program.
    _check_k(x.numel(), k)
    out, written, codes, _ = _written_to(x, k, entries)
    tally = torch.empty(2, dtype=torch.int64, device=x.device) if census else out
    block, opts = _config("small_top")
    launch(_small_top_kernel, (1,), x, out, tally, *written, x.numel(), k, SIDE=side,
           WIDE=x.dtype == torch.float64, CENSUS=census, **codes, BLOCK=block, **opts)
    return (out, tally) if census else out


# --- indices above a threshold (RedSync's survivors; bitcomm.codecs.select) ----------------------


@triton.jit
def _count_zeros(BLOCK: tl.constexpr, R: tl.constexpr):
    # int32 zeros for counts a row of a tile laid out as _rows_of(..., BLOCK, R) lays it out
    # (a register a row instead of R), or a lane where rows are of 2 or 1 (under triton 3.9.0
    # float64's rows of 2 spilled a count pass's registers)
    if R > 2:
        z = tl.zeros([BLOCK // R], dtype=tl.int32)
    elif R == 2:
        z = tl.zeros([BLOCK // 2, 2], dtype=tl.int32)
    else:
        z = tl.zeros([BLOCK], dtype=tl.int32)
    return z


@triton.jit
def _row_counts(flags, R: tl.constexpr):
    # flags set, shaped as _count_zeros: a row's count, or each flag as 0 or 1
    if R > 2:
        c = tl.sum(flags.to(tl.int32), 1)
    else:
        c = flags.to(tl.int32)
    return c


@triton.jit
def _flat(counts, BLOCK: tl.constexpr, R: tl.constexpr):
    # counts shaped as _count_zeros, one-dimensional
    if R == 2:
        counts = tl.reshape(counts, [BLOCK])
    return counts


@triton.jit
def _count_at_least_kernel(x_ptr, floor_ptr, counts_ptr, census_ptr, local_ptr, cap, groups_ptr,
                           ng, n, SIDE: tl.constexpr, WIDE: tl.constexpr, NAN: tl.constexpr,
                           STRICT: tl.constexpr, CENSUS: tl.constexpr, LOCAL: tl.constexpr,
                           PACK: tl.constexpr, GROUP: tl.constexpr, R: tl.constexpr,
                           STAGES: tl.constexpr, BLOCK: tl.constexpr):
    # How many keys of each program's run (as _gather_kernel runs) are at least floor_ptr's
    # (NaN as _counted says); with STRICT also how many are strictly above it, in the
    # second half of counts_ptr (a program each in both halves). With CENSUS each program
    # also adds, to census_ptr's first int64 word (zeroed), 1 if its run of x holds NaN or
    # inf: a caller's finiteness check in this read instead of one of its own, with no
    # reduction to launch after it (how many of the k are positive, the census's second
    # word, follows from the writing passes' counts: _chosen_write_kernel).
    # With LOCAL each program also writes those keys, in index order, to its own stretch of
    # local_ptr (program p's at p * cap) and their indices as far again behind the programs'
    # stretches (a num_programs * cap offset), tile by tile while they fit (nothing of a tile
    # that would overflow it): _gather_kernel then copies a run that fit from there instead
    # of reading x again. With PACK (int32 keys and indices) a key and its index are one
    # int64 word, the key in its high half: one store an element instead of two, and its
    # address computed once. The tile is then laid out as rows of R (_rows_of), the
    # gathering's layout for its running counts. With GROUP
    # (> 0) each program also adds its counts to its group's sums in groups_ptr (zeroed; the
    # groups of GROUP programs, ng a half, the strict counts' in the second half).
    floor = tl.load(floor_ptr)
    lo, hi = _span(n, BLOCK)
    # the counts a row (_count_zeros)
    acc = _count_zeros(BLOCK, R)
    over = _count_zeros(BLOCK, R)
    # the census: x * 0 + spoiled, one fused multiply-add an element, is +-0 for finite x
    # and NaN once x is NaN or inf (testing the exponent bits takes two operations an
    # element, and a row's maximum)
    spoiled = tl.zeros([BLOCK // R, R] if R > 1 else [BLOCK],
                       dtype=tl.float64 if WIDE else tl.float32)
    base = tl.program_id(0).to(tl.int64) * cap
    behind = tl.num_programs(0).to(tl.int64) * cap
    at = tl.zeros([], dtype=tl.int32)  # keys kept so far (LOCAL)
    for start in tl.range(lo, hi, BLOCK, num_stages=STAGES):  # COUNT_STAGES
        if CENSUS:  # x itself: -inf has the score 0 on the top side, so keys cannot tell
            i = _rows_of(start, BLOCK, R)
            live = i < n
            x = tl.load(x_ptr + i, mask=live, other=0.0)  # masked lanes: 0.0, finite
            key = _order_key(x, SIDE, WIDE)
            spoiled = tl.fma(x, 0.0, spoiled)
        else:
            i, live, key = _tile_keys(x_ptr, x_ptr, start, n, False, SIDE, WIDE, BLOCK, R)
        counted = live & _counted(key, NAN)
        take = counted & (key >= floor.to(key.dtype))
        if STRICT:
            over += _row_counts(counted & (key > floor.to(key.dtype)), R)
        if LOCAL:  # `at` counts them
            slot, runs = _slots(take, R)
            got = tl.sum(runs, 0)
            # a tile that would overflow the stretch writes nothing: past it the stretch is
            # never read (the gathering reads the run of x). A mask, not a branch: the GPU
            # image's Triton fails to compile the branch for 16-bit scores' rows of 8.
            put = tl.where(at + got <= cap, take, False)
            if PACK:  # an index below 2**31: its int64 has nothing in the high half
                tl.store(local_ptr + base + at + slot, (key.to(tl.int64) << 32) | i.to(tl.int64),
                         mask=put)
            else:
                tl.store(local_ptr + base + at + slot, key.to(local_ptr.dtype.element_ty),
                         mask=put)
                tl.store(local_ptr + behind + base + at + slot,
                         i.to(local_ptr.dtype.element_ty), mask=put)
            at += got
        else:
            acc += _row_counts(take, R)
    if LOCAL:
        count = at.to(tl.int64)
    else:
        count = tl.sum(_flat(acc, BLOCK, R), 0).to(tl.int64)
    tl.store(counts_ptr + tl.program_id(0), count)
    if GROUP > 0:
        tl.atomic_add(groups_ptr + tl.program_id(0) // GROUP, count)
    if STRICT:
        strict = tl.sum(_flat(over, BLOCK, R), 0).to(tl.int64)
        tl.store(counts_ptr + tl.num_programs(0) + tl.program_id(0), strict)
        if GROUP > 0:
            tl.atomic_add(groups_ptr + ng + tl.program_id(0) // GROUP, strict)
    if CENSUS:
        spoiled = tl.sum(tl.reshape(spoiled, [BLOCK]), 0)
        tl.atomic_add(census_ptr, (spoiled != spoiled).to(tl.int64))


def _key_of(threshold: float, wide: bool) -> int:
    # The order key (as _order_key makes it) of threshold rounded to the scores' dtype, as a
    # comparison with the scores rounds it.
    with np.errstate(over="ignore"):  # beyond float32: inf, as the comparison makes it
        rounded = np.array(threshold, dtype=np.float64).astype(np.float64 if wide
                                                                 else np.float32)
    if rounded == 0:
        return 0  # -0.0 ranks with +0.0
    bits = int(rounded.view(np.int64 if wide else np.int32))
    width = 64 if wide else 32
    return bits ^ ((bits >> (width - 1)) & ((1 << (width - 1)) - 1))


def _programs(n: int, tiles: str = "key_digits") -> int:
    # The programs of the passes that take runs of tiles over n scores (TUNING[tiles]'s).
    return min(COUNT_PROGRAMS, _grid(n, _config(tiles)[0])[0])


def indices_above(x: torch.Tensor, threshold: float, count: int, side: int = 0, *,
                  runs: torch.Tensor | None = None, scores: bool = False
                  ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Return the ascending int64 indices of the ``count`` scores above ``threshold``.

    Scores as in :func:`score_stats`, float32 or float64; ``threshold`` is rounded to their
    dtype, as a comparison with them rounds it, and ``count`` is how many exceed it
    (:func:`count_above` counts them alike). No host read, where ``torch.nonzero`` waits for
    the device to learn its size: one pass counts each program's run of tiles, a second
    writes each run's indices after the runs before it. ``runs``: those counts already, from
    :meth:`Runs.above` of the :func:`count_above` that counted ``threshold``; then only the
    writing pass reads ``x``. With ``scores`` also return those scores (of the side, in
    ``x``'s dtype; +0.0 for -0.0), written beside their indices by the same pass: the
    scores at the indices without a second, scattered read of ``x``.
    """
    out = torch.empty(count, dtype=torch.int64, device=x.device)
    values = torch.empty(count, dtype=x.dtype, device=x.device) if scores else None
    n = x.numel()
    if count == 0:
        return out if values is None else (out, values)
    wide = x.dtype == torch.float64
    # [the least key above the threshold, a slot for the number written]
    aux = torch.full((2,), _key_of(threshold, wide) + 1, dtype=torch.int64, device=x.device)
    if runs is None:
        counts = torch.empty(_programs(n), dtype=torch.int64, device=x.device)
    elif runs.shape != (_programs(n),):
        raise ValueError(f"expected runs of {_programs(n)} programs, got shape "
                         f"{tuple(runs.shape)}")
    else:
        counts = runs
    _gather_at_least(x, aux, aux[1:], counts, out, count, count, side, keys=values,
                     scores=scores, nan=False, known=runs is not None)
    return out if values is None else (out, values)
