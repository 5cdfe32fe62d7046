"""1-bit Adam's compressed allreduce, with DeepSpeed's semantics.

Same algorithm and arithmetic as ``CompressedBackend.compressed_allreduce`` in DeepSpeed 0.17.x
(``deepspeed/runtime/comm/``), the all-to-all scheme All-Reducible signSGD compares against:

1. pad ``x`` with zeros to the state's length ``P`` (a multiple of ``8 * N``) and add the
   worker error; worker scale ``= ||buf||_2 / sqrt(P)``; worker error ``= buf - scale * sign``
   with ``sign(0) = +1``;
2. all-to-all of the packed signs (chunk ``j`` of ``P / N`` elements to rank ``j``), each
   message followed by the sender's worker scale (4 bytes, float32);
3. rank ``r`` averages its chunk, ``sum_j sign_j * (scale_j / N)``, adds its server error, takes
   server scale ``= RMS`` of the chunk and updates the server error the same way;
4. allgather of the packed server signs, followed by the server scale; chunk ``j`` of the
   output is ``server_scale_j * sign_j``; the padding is cut off and ``x``'s shape restored.

DeepSpeed sends the scales by separate allgathers; here they ride at the end of the sign
messages (the same bytes), so a call takes two exchanges rather than four: with small tensors
(a DDP bucket) the exchanges' latency, not their bytes, is the cost.

One exchange: with ``OneBitState(..., collective="allgather")`` every rank sends all its packed
worker signs (and its worker scale) to every rank and then plays the server of every chunk:
steps 3 and 4 run on every rank for every chunk, in the same float operations, so each rank
holds the whole server error (``P`` elements, chunk ``j`` equal to rank ``j``'s under the
all-to-all) and the output is the all-to-all's, bit for bit. It sends ``(N - 1) * (P / 8 + 4)``
bytes: at 2 ranks the all-to-all's sign bytes with one scale fewer (``P / 8 + 4`` against
``P / 8 + 8``), in one round instead of two; above 2 ranks more, as ``(N - 1) * P / 8`` outgrows
``2 * (N - 1) * P / (8 * N)``. :func:`collective_for` picks it at 2 ranks (``"auto"``).

The signs go on the wire in the sign codec's convention (:func:`bitcomm.codecs.sign.pack_mask`),
but the scaled sign is DeepSpeed's, not :func:`bitcomm.codecs.sign.encode_scaled`'s: a float32
norm that stays on the device (no host synchronisation per step) over the padded length, and
NaN votes +1 (``NaN + 1`` is truthy), so the arithmetic matches DeepSpeed's bit for bit.
``encode_scaled`` makes a self-describing frame with a float64-accumulated scale and refuses
NaN.

Bytes sent per rank (:func:`onebit_allreduce_bytes`), with ``N`` ranks and ``P`` padded elements::

    2 * (N - 1) * P / (8 * N)   signs, phase 1 and 2       (allgather: (N - 1) * P / 8)
    + 2 * 4 * (N - 1)           worker and server scales   (allgather: 4 * (N - 1))
    + 24 * (N - 1)              with check
"""

from __future__ import annotations

import math

import numpy as np
import torch

from bitcomm.codecs import _frame, _jit, sign
from bitcomm.collectives import _common
from bitcomm.comm.base import Comm

__all__ = ["OneBitState", "onebit_allreduce", "onebit_allreduce_bytes", "padded_length",
           "COLLECTIVES", "collective_for"]

COLLECTIVES = ("auto", "alltoall", "allgather")
"""What ``collective=`` accepts: the exchange of :func:`onebit_allreduce`, or ``"auto"``."""


def collective_for(collective: object, size: int) -> str:
    """Return the exchange ``collective`` names for ``size`` ranks.

    ``"auto"`` is ``"allgather"`` at 2 ranks, where it sends the all-to-all's sign bytes in
    one round instead of two, and ``"alltoall"`` otherwise, where the allgather's
    ``(N - 1) * P / 8`` bytes outgrow it. Raises ``ValueError`` for a name not in
    :data:`COLLECTIVES`.
    """
    if collective not in COLLECTIVES:
        raise ValueError(f"expected collective in {COLLECTIVES}, got {collective!r}")
    if collective == "auto":
        return "allgather" if size <= 2 else "alltoall"
    return collective


def padded_length(n: int, size: int) -> int:
    """Return ``n`` rounded up to a multiple of ``size * lcm(size, 8)`` (DeepSpeed's padding)."""
    unit = size * math.lcm(size, 8)
    return -(-n // unit) * unit


class OneBitState:
    """Error-feedback buffers of one tensor: worker error (P) and server error.

    Args:
        numel: elements of the tensor that will be reduced.
        size: number of ranks.
        device: where the buffers live.
        length: padded length P; by default :func:`padded_length`. Must be a multiple of 8 * N.
        collective: the exchange, ``"alltoall"`` (DeepSpeed's: the server error is the rank's
            chunk, P / N elements), ``"allgather"`` (one round: every rank serves every chunk
            and holds all P) or ``"auto"`` (:func:`collective_for`).

    """

    __slots__ = ("numel", "size", "collective", "worker_error", "server_error")

    def __init__(self, numel: int, size: int, device: torch.device | str = "cpu", *,
                 length: int | None = None, collective: str = "alltoall"):
        if numel < 0 or size < 1:
            raise ValueError(f"expected numel >= 0 and size >= 1, got {numel} and {size}")
        length = padded_length(numel, size) if length is None else length
        if length < numel or length % (8 * size):
            raise ValueError(f"expected a padded length >= {numel} and a multiple of 8 * size = "
                             f"{8 * size}, got {length}")
        self.numel = numel
        self.size = size
        self.collective = collective_for(collective, size)
        served = length if self.collective == "allgather" else length // size
        self.worker_error = torch.zeros(length, dtype=torch.float32, device=device)
        self.server_error = torch.zeros(served, dtype=torch.float32, device=device)

    def state_dict(self) -> dict:
        """Return the buffers, for checkpoints."""
        return {"numel": self.numel, "size": self.size, "collective": self.collective,
                "worker_error": self.worker_error.clone(),
                "server_error": self.server_error.clone()}

    def load_state_dict(self, state: dict) -> None:
        """Restore buffers saved by :meth:`state_dict` (of the same size and collective)."""
        if (state["numel"], state["size"]) != (self.numel, self.size):
            raise ValueError(f"expected a state for numel={self.numel}, size={self.size}, got "
                             f"numel={state['numel']}, size={state['size']}")
        # Without the key, a state is DeepSpeed's layout, the all-to-all's.
        saved = state.get("collective", "alltoall")
        if saved != self.collective:
            raise ValueError(f"expected a state of the {self.collective!r} collective, got one "
                             f"of {saved!r} (its server error covers other chunks)")
        self.worker_error.copy_(state["worker_error"])
        self.server_error.copy_(state["server_error"])


def _signs(t: torch.Tensor) -> torch.Tensor:
    # DeepSpeed's t.sign().add_(1).bool(): true for t >= 0 (-0.0 included) and for NaN, which is
    # what "not below zero" says, in two passes over bools instead of three over floats.
    return torch.lt(t, 0).logical_not_()


def _plus_minus(bool_signs: torch.Tensor) -> torch.Tensor:
    # DeepSpeed's signs.float().add_(-0.5).mul_(2.0): exactly +1.0 where true, else -1.0. On a
    # CPU numpy's cast and two passes take a third of torch's time for the same floats.
    if bool_signs.numel() and _frame.use_numpy(bool_signs):
        out = bool_signs.numpy().astype(np.float32)
        out *= 2
        out -= 1
        return torch.from_numpy(out)
    return bool_signs.float().add_(-0.5).mul_(2.0)


def _sign_error(t: torch.Tensor, scale: torch.Tensor, error: torch.Tensor) -> torch.Tensor:
    """Return the packed signs of ``t`` and write ``error = t - scale * sign`` (DeepSpeed).

    ``scale``: a float32 0-dim tensor. On the numpy path, with a finite scale, ``scale * sign``
    is ``scale`` with its sign bit set where ``t < 0``, which is the product to the bit: two
    passes instead of five, and the bits of ``t < 0`` are packed and inverted.
    """
    if t.numel() and _frame.use_numpy(t) and _finite(scale):
        a = t.numpy()
        if _compiled(t):
            pos, neg = _with_sign_bit(scale.reshape(1).numpy())
            packed = np.empty((t.numel() + 7) // 8, dtype=np.uint8)
            _onebit_cpu().sign_error(a, pos[0], neg[0], error.numpy(), packed)
            return torch.from_numpy(packed)
        negative = np.less(a, 0)
        scaled = np.left_shift(negative.view(np.uint8), 31, dtype=np.uint32)
        scaled |= scale.numpy().view(np.uint32)
        np.subtract(a, scaled.view(np.float32), out=error.numpy())
        packed = np.invert(np.packbits(negative))
        if t.numel() % 8:  # padding bits stay zero
            packed[-1] &= 0xFF << (8 - t.numel() % 8) & 0xFF
        return torch.from_numpy(packed)
    signs = _signs(t)
    torch.sub(t, scale * _plus_minus(signs), out=error)
    return sign.pack_mask(signs)


def _scaled_signs(payload: torch.Tensor, rows: int, cols: int, scales: torch.Tensor
                  ) -> torch.Tensor:
    """Return the ``(rows, cols)`` float32 signs of ``payload``, row ``r`` times ``scales[r]``.

    As :func:`_sign_error`, a finite scale on the numpy path takes its sign bit from the sign
    instead of being multiplied by +-1: the same floats, with no +-1 tensor in between.
    """
    if rows * cols and _frame.use_numpy(payload) and _finite(scales):
        buf = _frame.as_buffer(payload, "payload")
        _frame.check_padding(buf, rows * cols, "sign", "payload")
        if cols % 8 == 0 and _compiled(buf, rows * cols):
            out = np.empty((rows, cols), dtype=np.float32)
            _onebit_cpu().scaled_signs(buf.numpy(), *_with_sign_bit(scales.numpy()), out)
            return torch.from_numpy(out)
        negative = np.unpackbits(buf.numpy(), count=rows * cols).reshape(rows, cols)
        np.bitwise_xor(negative, 1, out=negative)
        out = np.left_shift(negative, 31, dtype=np.uint32)
        out |= scales.numpy().view(np.uint32)[:, None]
        return torch.from_numpy(out.view(np.float32))
    signs = _plus_minus(sign.unpack_mask(payload, rows * cols)).reshape(rows, cols)
    return signs.mul_(scales.reshape(rows, 1))


def _compiled(t: torch.Tensor, n: int | None = None) -> bool:
    # Whether the numpy path's loops over n values (t's by default) run compiled
    # (bitcomm.collectives._onebit_cpu; _jit.worth), for contiguous float32 or bytes.
    return (t.is_contiguous() and t.dtype in (torch.float32, torch.uint8)
            and _jit.worth(t.numel() if n is None else n))


def _onebit_cpu():  # noqa: ANN202 - the module, imported when a call first needs numba
    from bitcomm.collectives import _onebit_cpu

    return _onebit_cpu


def _with_sign_bit(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    # The float32 scales as they are, and with their sign bit set: scale * +1 and scale * -1
    # to the bit for finite scales (see _sign_error).
    pos = np.ascontiguousarray(scales, dtype=np.float32)
    return pos, (pos.view(np.uint32) | np.uint32(1 << 31)).view(np.float32)


def _finite(scales: torch.Tensor) -> bool:
    # Only on the numpy path, whose scales are in host memory: no wait.
    return bool(np.isfinite(scales.numpy()).all())


def _rms(t: torch.Tensor) -> torch.Tensor:
    # DeepSpeed: torch.linalg.norm(t) / np.sqrt(t.numel()), a float32 0-dim tensor.
    return torch.linalg.norm(t) / np.sqrt(t.numel())


def onebit_allreduce(comm: Comm, x: torch.Tensor, state: OneBitState, *, check: bool = True,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """Return the 1-bit compressed average of ``x`` over ranks, updating ``state``'s errors.

    The new errors are new tensors, bound to ``state.worker_error`` and ``state.server_error``
    when the call returns: they are written where the call computed the values they are
    taken from, and the old tensors are left as they were, so a caller that keeps them can go
    back to them (a DDP hook's refused step) without a copy. A call that raises leaves
    ``state`` as it was.

    Args:
        comm: the transport.
        x: float tensor with ``state.numel`` elements.
        state: this tensor's :class:`OneBitState` (one per rank).
        check: agree on the input first (raises on every rank for bad input).
        out: where to write the result (a contiguous float32 tensor of ``x``'s shape and
            device; ``x`` itself may be given), returned in its place.

    Returns:
        float32 tensor of ``x``'s shape, identical on every rank.

    """
    def validate(v: torch.Tensor) -> None:
        if not isinstance(state, OneBitState):
            raise TypeError(f"expected state to be a OneBitState, got {type(state).__name__}")
        if v.numel() != state.numel or state.size != comm.size:
            raise ValueError(f"expected a state for numel={v.numel()}, size={comm.size}, got "
                             f"numel={state.numel}, size={state.size}")
        _common.check_out(out, x, torch.float32)

    # The padded length sets every message's size, and the collective its rounds: ranks must
    # agree on both.
    mine = ((state.worker_error.numel(), state.collective) if isinstance(state, OneBitState)
            else (None, None))
    v = _common.prepare(comm, x, check, "onebit_allreduce", float32=True,
                        options={"length": mine[0], "collective": mine[1]}, validate=validate)
    length, k = state.worker_error.numel(), v.numel()
    # The padded x plus the worker error: v + e, then 0 + e past x (e + 0.0 is the same float,
    # -0.0 becoming +0.0), in one pass instead of zeroing, copying and adding.
    buf = _frame.host_array(length, torch.float32, v)  # the new worker error (huge pages)
    torch.add(v.reshape(-1), state.worker_error[:k], out=buf[:k])
    torch.add(state.worker_error[k:], 0.0, out=buf[k:])
    worker_scale = _rms(buf)
    # buf becomes the new worker error (each element written where it was read). x has been
    # read into buf: out may be x.
    one_round = state.collective == "allgather"
    if _frame.use_triton(v):
        result, server_error = (_fused_allgather if one_round else _fused)(
            comm, x, v, state, buf, worker_scale, out)
    else:
        result, server_error = (_allgather if one_round else _alltoall)(
            comm, x, v, state, _sign_error(buf, worker_scale, buf), worker_scale)
        if out is not None:  # the padded output's first elements, copied
            out.view(-1).copy_(result.reshape(-1))
            result = out
    state.worker_error, state.server_error = buf, server_error
    return result


def _alltoall(comm: Comm, x: torch.Tensor, v: torch.Tensor, state: OneBitState,
              packed: torch.Tensor, worker_scale: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    # Returns the output and the new server error (the compensated chunk, in place).
    size = comm.size
    chunk = state.worker_error.numel() // size
    nbytes = chunk // 8
    got, scales = _exchange(comm, [packed[j * nbytes : (j + 1) * nbytes] for j in range(size)],
                            worker_scale, nbytes)
    # Chunks are whole bytes (multiples of 8 elements): every rank's signs unpack in one call.
    received = _scaled_signs(torch.cat(got), size, chunk, scales.mul_(1 / size))
    compensated = received.sum(0)
    compensated.add_(state.server_error)
    server_scale = _rms(compensated)
    mine = _sign_error(compensated, server_scale, compensated)

    every, server_scales = _exchange(comm, mine, server_scale, nbytes)
    out = _scaled_signs(torch.cat(every), size, chunk, server_scales).flatten()
    return out[:v.numel()].reshape(x.shape), compensated


def _allgather(comm: Comm, x: torch.Tensor, v: torch.Tensor, state: OneBitState,
               packed: torch.Tensor, worker_scale: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    # Every rank serves every chunk: the all-to-all's server step, chunk by chunk on the same
    # (size, chunk) tensors, so the floats and their order are the all-to-all's. Returns the
    # output and the new server error.
    size, length = comm.size, state.worker_error.numel()
    chunk = length // size
    nbytes = chunk // 8
    got, scales = _exchange(comm, packed, worker_scale, length // 8)
    weights = scales.mul_(1 / size)
    out = _frame.host_array((size, chunk), torch.float32, v)
    server_error = _frame.host_array(state.server_error.numel(), torch.float32, v)
    for j in range(size):
        error = server_error[j * chunk : (j + 1) * chunk]
        # (rank, element): every rank's signs of chunk j, weighted, as the server receives them
        chunk_signs = torch.cat([g[j * nbytes : (j + 1) * nbytes] for g in got])
        compensated = _scaled_signs(chunk_signs, size, chunk, weights).sum(0)
        compensated.add_(state.server_error[j * chunk : (j + 1) * chunk])
        server_scale = _rms(compensated)
        mine = _sign_error(compensated, server_scale, error)
        # What the all-to-all's receivers make of the server's signs and its float32 scale.
        out[j] = _scaled_signs(mine, 1, chunk, server_scale.reshape(1))[0]
    return out.flatten()[: v.numel()].reshape(x.shape), server_error


def _fused(comm: Comm, x: torch.Tensor, v: torch.Tensor, state: OneBitState, buf: torch.Tensor,
           worker_scale: torch.Tensor, out: torch.Tensor | None = None
           ) -> tuple[torch.Tensor, torch.Tensor]:
    # The same exchange and arithmetic with one kernel per compress / decompress step
    # (bitcomm.collectives._kernels); nothing is read back to the host. Writes the new worker
    # error into buf; returns the output and the new server error.
    from bitcomm.collectives import _kernels

    size = comm.size
    chunk = state.worker_error.numel() // size
    nbytes = chunk // 8  # chunks are multiples of 8 elements: byte-aligned slices of one pack
    packed = _kernels.sign_error(buf, worker_scale, buf)
    got, weights = _exchange(comm, [packed[j * nbytes : (j + 1) * nbytes] for j in range(size)],
                             worker_scale, nbytes)
    compensated = _kernels.weighted_votes(torch.stack(got), weights.mul_(1 / size),
                                          state.server_error)
    server_scale = _rms(compensated)
    mine = _kernels.sign_error(compensated, server_scale, compensated)
    every, server_scales = _exchange(comm, mine, server_scale, nbytes)
    result = _kernels.scaled_signs(torch.cat(every), server_scales, v.numel(), chunk,
                                   None if out is None else out.view(-1))
    return result.reshape(x.shape) if out is None else out, compensated


def _fused_allgather(comm: Comm, x: torch.Tensor, v: torch.Tensor, state: OneBitState,
                     buf: torch.Tensor, worker_scale: torch.Tensor,
                     out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    # _fused's kernels with every rank serving every chunk (see _allgather).
    from bitcomm.collectives import _kernels

    size, length = comm.size, state.worker_error.numel()
    chunk, nbytes = length // size, length // (8 * size)
    packed = _kernels.sign_error(buf, worker_scale, buf)
    got, weights = _exchange(comm, packed, worker_scale, length // 8)
    weights = weights.mul_(1 / size)
    votes = torch.stack(got)
    served, scales = [], []
    server_error = torch.empty_like(state.server_error)
    for j in range(size):
        error = server_error[j * chunk : (j + 1) * chunk]
        compensated = _kernels.weighted_votes(
            votes[:, j * nbytes : (j + 1) * nbytes].contiguous(), weights,
            state.server_error[j * chunk : (j + 1) * chunk])
        scales.append(_rms(compensated).reshape(1))
        served.append(_kernels.sign_error(compensated, scales[-1], error))
    result = _kernels.scaled_signs(torch.cat(served), torch.cat(scales), v.numel(), chunk,
                                   None if out is None else out.view(-1))
    return result.reshape(x.shape) if out is None else out, server_error


def _exchange(comm: Comm, packed: torch.Tensor | list[torch.Tensor], scale: torch.Tensor,
              nbytes: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Send ``packed[j]`` and then ``scale`` (float32) to each rank ``j``, in one message.

    One tensor for ``packed`` goes to every rank (an allgather). Returns the ``nbytes`` sign
    bytes from each rank and the (size,) float32 scales, in rank order, on ``scale``'s device
    (no host synchronisation).
    """
    one = isinstance(packed, torch.Tensor)
    device = (packed if one else packed[0]).device
    tail = scale.reshape(1).to(torch.float32).view(torch.uint8).to(device)
    if one:
        got = comm.allgatherv(torch.cat([packed, tail]), [nbytes + 4] * comm.size)
    else:
        got = comm.alltoallv([torch.cat([p, tail]) for p in packed], [nbytes + 4] * comm.size)
    scales = torch.cat([g[nbytes:].to(scale.device) for g in got]).view(torch.float32)
    return [g[:nbytes] for g in got], scales


def onebit_allreduce_bytes(numel: int, size: int, *, length: int | None = None,
                           check: bool = True, collective: str = "alltoall") -> int:
    """Return the bytes each rank sends in :func:`onebit_allreduce` (the same on every rank)."""
    length = padded_length(numel, size) if length is None else length
    if size == 1:
        return 0
    if collective_for(collective, size) == "allgather":
        signs = (size - 1) * (length // 8 + 4)
    else:
        signs = 2 * (size - 1) * (length // (8 * size) + 4)
    return signs + _common.control_bytes(size, check)
