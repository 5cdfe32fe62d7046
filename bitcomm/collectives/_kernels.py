"""Fused Triton kernels for the majority collectives' steps on the GPU.

A ring step of :func:`bitcomm.collectives.ring_majority` is, unfused, four passes (unpack the
received counts, compare the chunk with 0, add, repack at the next width) and two host
synchronisations (the count decoder's checks). :func:`count_step` does it in one pass that reads
the received bit planes and the chunk once and writes the next planes once, adding the votes
to the counts bit-sliced (a ripple carry of whole bytes through the planes, never a count
unpacked); its last step decides and packs the 1-bit decisions instead. :func:`vote_count`
is the all-to-all majority's sum of every rank's packed votes, decided and packed, in one
pass. The payloads are the codecs' (:mod:`bitcomm.codecs.counts` fixed packing,
:mod:`bitcomm.codecs.sign` bits), byte for byte.
For :func:`bitcomm.collectives.onebit_allreduce`, :func:`sign_error` packs the signs and writes
the error feedback in one pass, :func:`weighted_votes` adds up every rank's scaled signs and
the server error, and :func:`scaled_signs` writes the result; the scales stay on the device.

Payloads arriving inside one collective come from bitcomm on the other ranks over a reliable
transport, so these kernels do not re-check them: the unfused paths flag a broken payload and
read their flags once per call at its end (:func:`bitcomm.codecs._frame.deferred`), and the
fused steps spend no host read at all.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from bitcomm.codecs._kernels import _cdiv, _load, _neg, _store, launch_tiles

__all__ = ["count_step", "vote_count", "sign_error", "weighted_votes", "scaled_signs"]

TUNING: dict[str, tuple[int, int]] = {
    # kernel: (bytes per program and plane, warps)
    "count_step": (512, 4),
    "vote_count": (512, 4),
    "sign_error": (256, 4),
    "weighted_votes": (256, 4),
    "scaled_signs": (512, 4),
}
"""Tile size and warps of each kernel's launch (any power of two is correct); chosen as
:data:`bitcomm.codecs._kernels.TUNING` says, near or below 64 registers per thread on sm_90."""


def _launch_tiles(name: str, kernel, total: int, n: int, *args, **kwargs) -> None:
    # One program per TUNING[name] bytes of the ``total`` bytes per plane; those whose 8 * BLOCK
    # elements all lie before ``n`` without masks (launch_tiles).
    block, warps = TUNING[name]
    launch_tiles(kernel, _cdiv(total, block), n // (8 * block), *args, BLOCK=block,
                 num_warps=warps, **kwargs)


TIE_CODES = {"negative": 0, "positive": 1, "alternate": 2}
"""The kernels' TIE constant for each rule of :data:`bitcomm.collectives.majority.TIES`."""


@triton.jit
def _majority(count, size, idx, tie_base, TIE: tl.constexpr):
    # 1 where more than half of the ranks vote +1; a tie decides by the tie rule: -1, +1, or
    # (alternate) +1 where the element's global index plus the phase is even (tie_base is the
    # parity of the chunk's first global index plus the phase).
    if TIE == 1:
        return (2 * count >= size).to(tl.int32)
    if TIE == 2:
        even = ((idx + tie_base) & 1) == 0
        return ((2 * count > size) | ((2 * count == size) & even)).to(tl.int32)
    return (2 * count > size).to(tl.int32)


@triton.jit
def _count_step_kernel(recv_ptr, x_ptr, out_ptr, n, nb, size, tie_base, first,
                       W_IN: tl.constexpr, W_OUT: tl.constexpr, DECIDE: tl.constexpr,
                       TIE: tl.constexpr, WIDEN: tl.constexpr, BLOCK: tl.constexpr,
                       EDGE: tl.constexpr):
    # Bit-sliced: a byte of a plane holds one bit of 8 elements' counts, so adding this
    # rank's votes (a byte of 8 of them) to the counts is a ripple-carry addition of bytes, two
    # operations a plane for 8 elements, and the majority a comparison of the sum's bits with
    # a constant, as cheap; unpacking each count, adding and repacking cost several operations
    # an element a plane. Only the votes are packed element by element (as sign_pack packs).
    ob = (first + tl.program_id(0)).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    j = tl.arange(0, 8)
    shifts = (7 - j)[None, :]
    idx = ob[:, None] * 8 + j[None, :]
    live = idx < n
    x = _load(x_ptr + idx, live, -1.0, EDGE)  # padding lanes vote 0
    if WIDEN:  # 16-bit floats compare as float32 (exact)
        x = x.to(tl.float32)
    carry = tl.sum((x >= 0).to(tl.int32) << shifts, axis=1)  # this rank's votes
    if EDGE:  # the padding bits of the last byte stay 0, whatever the received ones hold
        mask = tl.sum(live.to(tl.int32) << shifts, axis=1)
    else:
        mask = 255
    inside = ob < nb
    if DECIDE:
        # the majority, count > c, bit by bit from the least significant up: where the sum's
        # bit differs from c's it decides, else the bits below do; `eq` holds count == c.
        # c < size <= 2 ** (W_IN + 1) (count_step checks): its bits are the sum's
        if TIE == 1:  # 2 * count >= size
            c = (size + 1) // 2 - 1
        else:  # 2 * count > size
            c = size // 2
        above = carry & 0
        eq = above | 255
        for b in tl.static_range(W_IN + 1):
            if b < W_IN:
                plane = _load(recv_ptr + (W_IN - 1 - b) * nb + ob, inside, 0, EDGE).to(tl.int32)
                bit = plane ^ carry
                carry = plane & carry
            else:
                bit = carry
            differs = bit ^ (((c >> b) & 1) * 255)
            above = (bit & differs) | (above & (differs ^ 255))
            eq = eq & (differs ^ 255)
        if TIE == 2:  # a tie (an even size's half) goes up at the even global indices
            # elements 0, 2, 4, 6 of the byte (bits 0xAA), or 1, 3, 5, 7 (0x55)
            even = 0x55 + 0x55 * (1 - (tie_base & 1))
            above = above | (eq & even & ((1 - (size & 1)) * 255))
        _store(out_ptr + ob, (above & mask).to(tl.uint8), inside, EDGE)
    else:
        for b in tl.static_range(W_IN):  # from the least significant plane, the last row
            plane = _load(recv_ptr + (W_IN - 1 - b) * nb + ob, inside, 0, EDGE).to(tl.int32)
            if b < W_OUT:
                _store(out_ptr + (W_OUT - 1 - b) * nb + ob, ((plane ^ carry) & mask).to(tl.uint8),
                       inside, EDGE)
            carry = plane & carry
        for b in tl.static_range(W_IN, W_OUT):  # the carry, then zeros
            _store(out_ptr + (W_OUT - 1 - b) * nb + ob, (carry & mask).to(tl.uint8), inside,
                   EDGE)
            carry = carry & 0


def count_step(received: torch.Tensor | None, x: torch.Tensor, w_in: int, w_out: int, *,
               decide: int = 0, tie: str = "negative", tie_base: int = 0) -> torch.Tensor:
    """Return the planes of ``received + (x >= 0)`` at ``w_out`` bits (``counts`` fixed packing).

    Args:
        received: ``w_in`` planes of counts over the ranks so far, or ``None`` (``w_in = 0``).
        x: this rank's chunk (contiguous float tensor).
        w_in: planes in ``received``.
        w_out: planes to write (1 with ``decide``).
        decide: the number of ranks: write the majority decision bits instead of counts (at
            most ``2 ** (w_in + 1)``, beyond what the received counts and this rank's vote
            could reach: ``ValueError``).
        tie: with ``decide``, the tie rule (:data:`bitcomm.collectives.majority.TIES`).
        tie_base: with ``tie="alternate"``, the global index of ``x[0]`` plus the phase (only
            its parity matters).

    """
    if decide > 1 << (w_in + 1):
        raise ValueError(f"expected at most {1 << (w_in + 1)} ranks for {w_in} received planes, "
                         f"got decide={decide}")
    n = x.numel()
    nb = (n + 7) // 8
    out = torch.empty(w_out * nb, dtype=torch.uint8, device=x.device)
    if nb:
        _launch_tiles("count_step", _count_step_kernel, nb, n,
                      x if received is None else received, x, out, n, nb, max(decide, 1),
                      tie_base % 2, W_IN=w_in, W_OUT=w_out, DECIDE=bool(decide),
                      TIE=TIE_CODES[tie], WIDEN=x.element_size() == 2)
    return out


@triton.jit
def _vote_count_kernel(votes_ptr, out_ptr, n, nb, size, tie_base, first, TIE: tl.constexpr,
                       BYTES: tl.constexpr, BLOCK: tl.constexpr, EDGE: tl.constexpr):
    ob = (first + tl.program_id(0)).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    j = tl.arange(0, 8)
    shifts = (7 - j)[None, :]
    idx = ob[:, None] * 8 + j[None, :]
    if BYTES:
        # Fewer than 256 ranks: every element's count in a byte of its own, four an int32
        # (SWAR), so that a rank costs about one operation an element instead of three and
        # the decision a few a byte of votes. A vote byte's halves spread their bit i to byte
        # i (4-bit copies 7 bits apart, which never overlap): elements 0-3 of a vote byte are
        # `high`'s bytes 3-0, elements 4-7 `low`'s.
        ones = 0x01010101
        high = tl.zeros([BLOCK], dtype=tl.int32)
        low = tl.zeros([BLOCK], dtype=tl.int32)
        for r in range(size):
            byte = _load(votes_ptr + r * nb + ob, ob < nb, 0, EDGE).to(tl.int32)
            high += ((byte >> 4) * 0x204081) & ones
            low += ((byte & 15) * 0x204081) & ones
        high = _byte_majority(high, size, tie_base, TIE)
        low = _byte_majority(low, size, tie_base, TIE)
        # each word's four decision bits (bytes 0-3's lowest bits) side by side: the
        # multiplier's four copies put byte t's bit at bit 24 + t, and no other bits meet
        out = ((((high * 0x01020408) >> 24) & 15) << 4) | (((low * 0x01020408) >> 24) & 15)
        if EDGE:  # the padding bits of the last byte stay 0
            out = out & tl.sum((idx < n).to(tl.int32) << shifts, axis=1)
    else:
        count = tl.zeros([BLOCK, 8], dtype=tl.int32)
        for r in range(size):
            byte = _load(votes_ptr + r * nb + ob, ob < nb, 0, EDGE).to(tl.int32)
            count += (byte[:, None] >> shifts) & 1
        bit = _majority(count, size, idx, tie_base, TIE)
        if EDGE:  # the padding bits of the last byte stay 0
            bit = tl.where(idx < n, bit, 0)
        out = tl.sum(bit << shifts, axis=1)
    _store(out_ptr + ob, out.to(tl.uint8), ob < nb, EDGE)


@triton.jit
def _byte_majority(counts, size, tie_base, TIE: tl.constexpr):
    # _majority of four counts of fewer than 256 ranks, a byte each of an int32, as 1 or 0 in
    # the byte's lowest bit: count > c where its byte plus 127 - c reaches 128. c <= 127 and
    # count - c <= 128, so no byte carries into the next; count == c where count + 128 - c
    # does, which passes 255 only at 255 ranks, whose odd size has no tie to take. Byte b
    # holds an element of the parity of 3 - b (the vote byte's elements 0-3 or 4-7 from the
    # top down).
    ones = 0x01010101
    if TIE == 1:  # 2 * count >= size
        c = (size + 1) // 2 - 1
    else:  # 2 * count > size
        c = size // 2
    above = ((counts + (127 - c) * ones) >> 7) & ones
    if TIE == 2:  # a tie (an even size's half) goes up at the even global indices
        tie = (((counts + (128 - c) * ones) >> 7) & ones) ^ above  # count == c
        even = 0x00010001 << (8 * (1 - (tie_base & 1)))  # bytes 3 and 1, or 2 and 0
        above = above | (tie & even & ((1 - (size & 1)) * ones))
    return above


def vote_count(votes: torch.Tensor, n: int, *, tie: str = "negative", tie_base: int = 0
               ) -> torch.Tensor:
    """Return the packed majority of ``size`` rows of packed votes (``votes``: size x nb).

    ``tie`` and ``tie_base`` as in :func:`count_step`.
    """
    size, nb = votes.shape
    out = torch.empty(nb, dtype=torch.uint8, device=votes.device)
    if nb:
        _launch_tiles("vote_count", _vote_count_kernel, nb, n, votes, out, n, nb, size,
                      tie_base % 2, TIE=TIE_CODES[tie], BYTES=size < 256)
    return out


# --- onebit_allreduce -------------------------------------------------------------------------


@triton.jit
def _sign_error_kernel(buf_ptr, scale_ptr, err_ptr, out_ptr, nb, first, BLOCK: tl.constexpr,
                       EDGE: tl.constexpr):
    ob = (first + tl.program_id(0)).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    j = tl.arange(0, 8)
    idx = ob[:, None] * 8 + j[None, :]
    x = _load(buf_ptr + idx, idx < nb * 8, 0.0, EDGE)
    # DeepSpeed's x.sign().add_(1).bool(): true for x >= 0, and for NaN (NaN + 1 is truthy).
    bit = (x >= 0) | (x != x)
    scale = tl.load(scale_ptr)
    error = x - tl.where(bit, scale, _neg(scale))
    byte = tl.sum(bit.to(tl.int32) << (7 - j)[None, :], axis=1).to(tl.uint8)
    _store(err_ptr + idx, error, idx < nb * 8, EDGE)
    _store(out_ptr + ob, byte, ob < nb, EDGE)


def sign_error(buf: torch.Tensor, scale: torch.Tensor, error: torch.Tensor) -> torch.Tensor:
    """Return the packed signs of ``buf`` and write ``buf - scale * sign`` into ``error``.

    1-bit Adam's compression step in one pass; ``buf.numel()`` is a multiple of 8 and
    ``scale`` a 0-dim float32 tensor on the device (read there, never on the host).
    """
    nb = buf.numel() // 8
    out = torch.empty(nb, dtype=torch.uint8, device=buf.device)
    if nb:
        _launch_tiles("sign_error", _sign_error_kernel, nb, nb * 8, buf, scale, error, out, nb)
    return out


@triton.jit
def _weighted_votes_kernel(votes_ptr, weights_ptr, err_ptr, out_ptr, nb, size, first,
                           BLOCK: tl.constexpr, EDGE: tl.constexpr):
    ob = (first + tl.program_id(0)).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    j = tl.arange(0, 8)
    idx = ob[:, None] * 8 + j[None, :]
    acc = tl.zeros([BLOCK, 8], dtype=tl.float32)
    for r in range(size):  # ranks in order, as torch's sum over them
        byte = _load(votes_ptr + r * nb + ob, ob < nb, 0, EDGE).to(tl.int32)
        w = tl.load(weights_ptr + r)
        acc += tl.where(((byte[:, None] >> (7 - j)[None, :]) & 1) != 0, w, _neg(w))
    acc += _load(err_ptr + idx, idx < nb * 8, 0.0, EDGE)
    _store(out_ptr + idx, acc, idx < nb * 8, EDGE)


def weighted_votes(votes: torch.Tensor, weights: torch.Tensor, error: torch.Tensor
                   ) -> torch.Tensor:
    """Return ``sum_r (+-1)_r * weights[r] + error`` for ``votes`` (size x nb packed signs)."""
    size, nb = votes.shape
    out = torch.empty(nb * 8, dtype=torch.float32, device=votes.device)
    if nb:
        _launch_tiles("weighted_votes", _weighted_votes_kernel, nb, nb * 8, votes, weights,
                      error, out, nb, size)
    return out


@triton.jit
def _scaled_signs_kernel(packed_ptr, scales_ptr, out_ptr, n, nbytes, chunk, first,
                         BLOCK: tl.constexpr, EDGE: tl.constexpr, WHOLE: tl.constexpr):
    tile = (first + tl.program_id(0)).to(tl.int64)
    ob = tile * BLOCK + tl.arange(0, BLOCK)
    j = tl.arange(0, 8)
    idx = ob[:, None] * 8 + j[None, :]
    byte = _load(packed_ptr + ob, ob < nbytes, 0, EDGE).to(tl.int32)
    if WHOLE:  # chunks of a tile or more: the tile meets two chunks at most, one division
        c = tile * BLOCK * 8 // chunk
        end = (c + 1) * chunk
        here = tl.load(scales_ptr + c)
        after = tl.load(scales_ptr + c + 1, mask=end < n, other=0.0)
        scale = tl.where(idx < end, here, after)
    else:
        scale = _load(scales_ptr + idx // chunk, idx < n, 0.0, EDGE)
    val = tl.where(((byte[:, None] >> (7 - j)[None, :]) & 1) != 0, scale, _neg(scale))
    _store(out_ptr + idx, val, idx < n, EDGE)


def scaled_signs(packed: torch.Tensor, scales: torch.Tensor, n: int, chunk: int,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """Return the first ``n`` of ``scales[i // chunk] * (+-1)_i`` for packed signs ``packed``.

    ``out`` (contiguous float32, ``n`` elements) receives them instead of a new tensor.
    """
    if out is None:
        out = torch.empty(n, dtype=torch.float32, device=packed.device)
    nbytes = packed.numel()
    if n:
        block = TUNING["scaled_signs"][0]
        _launch_tiles("scaled_signs", _scaled_signs_kernel, _cdiv(n, 8), n, packed,
                      scales, out, n, nbytes, chunk, WHOLE=chunk >= 8 * block)
    return out
