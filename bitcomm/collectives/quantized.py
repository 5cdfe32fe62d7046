"""Dense QSGD exchange: every rank's whole tensor as one qsgd frame, averaged everywhere.

The data-parallel QSGD step of SparCML (Section 6): each rank
quantises its full gradient stochastically (:mod:`bitcomm.codecs.qsgd`, 2/4/8 bits, one fp32
scale per bucket) and the frames, all the same length, go to every rank in one ``allgatherv``;
each rank decodes them and adds them in rank order (bit-identical sums), then divides by ``N``
(:func:`bitcomm.codecs.qsgd.mean_all`: with triton, one pass over every frame's codes).

Bytes sent per rank (:func:`qsgd_allgather_bytes`)::

    (N - 1) * qsgd.encoded_size(n, bits, bucket)   + 24 * (N - 1) with check

Example: 1000 float32 elements, 4 bits, buckets of 512, 4 ranks: the frame is a 14-byte header,
two fp32 scales and 500 bytes of codes (522 bytes), so each rank sends 3 * 522 + 72 = 1638
bytes against 12000 + 72 for the fp32 allreduce's direct exchange.
"""

from __future__ import annotations

import torch

from bitcomm.codecs import _frame, qsgd
from bitcomm.collectives import _common
from bitcomm.comm.base import Comm

__all__ = ["qsgd_allgather", "qsgd_allgather_bytes"]


def qsgd_allgather(comm: Comm, x: torch.Tensor, *, bits: int = 4,
                   bucket: int = qsgd.DEFAULT_BUCKET, seed: int | None = None,
                   check: bool = True, residual: bool = False,
                   out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(mean, sent)``: the mean over ranks of the quantised ``x``, and this rank's.

    ``sent`` is this rank's quantised ``x`` as every receiver decodes it (for error feedback).
    Both are float32 with ``x``'s shape; ``mean`` is identical on every rank.

    Args:
        comm: the transport.
        x: float tensor, the same number of elements on every rank.
        bits: 2, 4 or 8 bits per element.
        bucket: elements per qsgd bucket.
        seed: rank ``r`` quantises with ``seed + r`` (independent, reproducible streams);
            ``None`` draws from torch's default generator.
        check: agree on the input first (raises on every rank for bad input).
        residual: return ``x - sent`` (``x`` as float32; what quantisation left out, error
            feedback's next residual) in place of ``sent``, the same bits as subtracting
            them; with triton it is written in the mean's pass, where ``sent`` would be
            written there and read back.
        out: where to write the mean (a contiguous float32 tensor of ``x``'s shape and
            device; ``x`` itself may be given), returned in its place.

    """
    def validate(v: torch.Tensor) -> None:
        qsgd.check_config(bits, bucket, "max")
        qsgd.check_seed(seed)
        _common.check_out(out, x, torch.float32)

    # The seed is left out of the call's fingerprint: ranks offset it anyway.
    v = _common.prepare(comm, x, check, "qsgd_allgather", float32=True,
                        options={"bits": bits, "bucket": bucket}, validate=validate)
    n = v.numel()
    # The encoder's scale check and the frames' checks are read once, together, at the end (on
    # a device, one wait per call): values are only added. A rank whose scales are not finite
    # sends its frame anyway, so every rank raises instead of waiting for it.
    with _frame.deferred(handover=True):
        frame = qsgd.encode(v, bits, bucket, seed=None if seed is None else seed + comm.rank)
        frames = (comm.allgatherv(frame, [frame.numel()] * comm.size) if comm.size > 1
                  else [frame])
        # Every frame must hold n values of this layout (a bad one is a ValueError), added in
        # rank order (the same sum on every rank); this rank's own is decoded as the peers
        # decode it (for error feedback). The frames as received: where the transport gave
        # them back to back in one buffer (this rank's too), they are read there, uncopied.
        # x has been encoded: out may be x, unless the residual still reads x as it is
        # written (then from a copy).
        less = v.float() if residual else None
        if less is not None and out is not None and (
                less.untyped_storage().data_ptr() == out.untyped_storage().data_ptr()):
            less = less.clone()
        mean, sent = qsgd.mean_all([f.to(v.device) for f in frames], n, bits, bucket,
                                   keep=comm.rank, residual_of=less,
                                   out=None if out is None else out.view(-1))
    return mean.reshape(x.shape) if out is None else out, sent.reshape(x.shape)


def qsgd_allgather_bytes(n: int, size: int, *, bits: int = 4, bucket: int = qsgd.DEFAULT_BUCKET,
                         check: bool = True) -> int:
    """Return the bytes each rank sends in :func:`qsgd_allgather` of ``n`` elements."""
    return (size - 1) * qsgd.encoded_size(n, bits, bucket) + _common.control_bytes(size, check)
