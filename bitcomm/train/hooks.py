"""DDP communication hooks: compressed gradient exchange inside ``DistributedDataParallel``.

Register with ``ddp.register_comm_hook(state, hook)``; DDP then calls ``hook(state, bucket)``
for each gradient bucket instead of its fp32 allreduce, and uses the tensor the returned future
holds as the bucket's gradient (every rank gets the same one). Each hook has a state class of
its own, holding the transport (a :class:`~bitcomm.comm.torchdist.TorchComm`: gloo on CPU, NCCL
on GPU), the hook's options and its per-bucket buffers:

=========================  ==========================  ======================================
hook                       state                       the bucket's gradient becomes
=========================  ==========================  ======================================
``sign_majority_hook``     :class:`SignState`          the workers' majority sign (+-1) of the
                                                       gradient, or of the momentum (Signum)
``onebit_hook``            :class:`OneBitHookState`    1-bit Adam's compressed average (worker
                                                       and server error feedback)
``qsgd_hook``              :class:`QsgdState`          the mean of the workers' QSGD frames,
                                                       optionally with error feedback
``topk_hook``              :class:`TopkState`          the sum of each worker's top-k of its
                                                       residual, / N (RedSync's RGC without
                                                       momentum correction)
=========================  ==========================  ======================================

Results in the bucket
---------------------
A float32 bucket's result is written into the bucket's own buffer, which the future then
holds, as DDP's allreduce does with its result: with ``gradient_as_bucket_view=True`` DDP's
gradients are views of that buffer, and DDP copies a hook's result into them only when it is
another tensor (a read and a write of the bucket). Other dtypes get a new tensor: the
exchanges compute in float32.

Overlap
-------
A hook returns at once with a future of work that runs on a thread of the state's own (and, for
CUDA buckets, on a CUDA stream of its own that first waits for the bucket's gradients), the way
PyTorch's ``allreduce_hook`` returns the future of an asynchronous allreduce: the rest of the
backward pass goes on while a bucket is compressed and exchanged, and DDP waits for the futures
at the end of backward. Buckets are exchanged one at a time in the order DDP hands them over,
which is the same on every rank. ``overlap=False`` runs the exchange inside the hook instead.

The thread sends point-to-point messages on the state's process group while the autograd thread
may use DDP's (with ``find_unused_parameters=True`` DDP allreduces a bitmap after the last
bucket). gloo keeps the two apart; with NCCL, give the state a group of its own
(``TorchComm(dist.new_group())``) so the two threads never queue work on one communicator.

Buffers across DDP's bucket rebuild
-----------------------------------
DDP regroups its buckets once after the first iteration. Momentum, residuals and worker errors
are therefore kept per parameter (a view into the bucket's flat buffer) and carried into the new
buckets when the layout changes, so nothing is lost or left behind under a stale key. Parameters
are numbered in the order the hooks first see them, which is the same in every run of the same
model and bucket sizes: that number is the key in :meth:`state_dict`. The sign, qsgd and top-k
hooks compute a bucket's next momentum or residual into a new tensor, which becomes the bucket's
buffer once the step is agreed (:meth:`ParamBuffers.replace`), rather than being copied into the
old one: a read and a write of the bucket fewer, and a refused step leaves the old buffer as is.

Overflow and loss scaling: one agreement per step
-------------------------------------------------
With ``check=True`` (the default) the ranks agree once per training step, after its last
bucket, instead of once per bucket: each bucket is exchanged without the collectives' own
agreement (a rank whose bucket holds NaN or inf, or a float64 beyond float32's range, sends
a finite stand-in: zeros; on a device those elements are zeroed in the bucket's buffer itself,
which the step's all-NaN result replaces anyway, as DDP's own allreduce hook works in it), the
buckets' futures and buffer updates are held, and the last bucket's exchange is followed by
one 24-byte record per rank saying whether any of the rank's buckets overflowed, with the
hook's options and the step's bucket lengths. If any rank overflowed, every bucket of the step
becomes all-NaN on every rank and every buffer stays as it was; that is what DDP's own
allreduce hands a ``torch.amp.GradScaler``, which then skips the step everywhere and backs off.
Otherwise the buffers take their updates and the futures complete. On a GPU the step's overflow
flags are one host read, and the checks the exchanges make of what they sent and received
(qsgd's frames, an unfused majority's payloads, the top-k hook's sparse frames) come back in it
rather than in a read per bucket; a corrupt payload fails every bucket of the step on every
rank (the receiving rank with the decoder's error, through the agreement), and the buffers stay
as they were. A bucket layout the state has not seen before (the first step, DDP's rebuild) is
exchanged with the collective's own agreement as well, so ranks with different options or
lengths raise on every rank before its bytes move.
DDP calls a step's hooks before it waits for any of their futures; code that calls a hook by
hand must do the same, since a bucket's future completes only after the step's last bucket.
Until then the state holds each bucket's next buffer values (about one float32 copy of the
step's gradients), so that a refused step can leave the buffers as they were.
With ``check=False`` nothing is agreed and each future completes on its own: a sign or top-k
exchange turns an overflow into finite values, and the scaler never hears of it.

Stated tolerance: with 8 bits, buckets of 64 and error feedback, ``qsgd_hook`` keeps a small
MLP's parameters within 0.02 of the fp32 allreduce run after 30 SGD steps on 2 workers (the
test measures about 0.001), and its final loss within 10%.

Example::

    ddp = DistributedDataParallel(model)
    ddp.register_comm_hook(SignState(TorchComm(), momentum=0.9), sign_majority_hook)
"""

# No "from __future__ import annotations": DDP checks that the hook's ``bucket`` annotation
# is dist.GradBucket itself, not a string.
import concurrent.futures
import math
import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.futures import Future

from bitcomm.codecs import _frame, qsgd
from bitcomm.codecs._frame import all_finite, use_numpy, zero_nonfinite_
from bitcomm.collectives import (
    NonFiniteError,
    OneBitState,
    allreduce,
    onebit_allreduce,
    qsgd_allgather,
    sparse_allgather,
)
from bitcomm.collectives._common import prepare
from bitcomm.collectives.majority import check_collective, check_tie, vote_for
from bitcomm.collectives.onebit import collective_for, padded_length
from bitcomm.comm.base import Comm
from bitcomm.train._common import check_comm, check_range, float32_operand, momentum

__all__ = ["SignState", "OneBitHookState", "QsgdState", "TopkState", "ParamBuffers",
           "sign_majority_hook", "onebit_hook", "qsgd_hook", "topk_hook"]


class ParamBuffers:
    """Float32 buffers of gradient buckets that belong to the buckets' parameters.

    :meth:`get` returns a bucket's flat buffer, zero for parameters never seen. Each parameter's
    stretch of it is remembered, so when DDP regroups the parameters into different buckets the
    values move with their parameters, and buffers of buckets that no longer exist are dropped.
    """

    __slots__ = ("_number", "_views", "_layouts", "_flats", "_unviewed")

    def __init__(self) -> None:
        self._number: dict[int, int] = {}          # id(parameter) -> its number
        self._views: dict[int, torch.Tensor] = {}  # number -> its values (a view, or loaded)
        self._layouts: dict[int, tuple[int, ...]] = {}  # bucket index -> parameter numbers
        self._flats: dict[int, torch.Tensor] = {}  # bucket index -> flat buffer
        # bucket index -> (number, offset, length) of the parameters whose views were dropped
        # when its flat buffer was replaced; they are cut again from it when next needed
        self._unviewed: dict[int, list[tuple[int, int, int]]] = {}

    def numbers(self, bucket: dist.GradBucket) -> tuple[int, ...]:
        """Return the numbers of ``bucket``'s parameters (new ones are numbered on first sight)."""
        out = []
        for p in bucket.parameters():
            out.append(self._number.setdefault(id(p), len(self._number)))
        return tuple(out)

    def get(self, bucket: dist.GradBucket, length: int | None = None) -> torch.Tensor:
        """Return ``bucket``'s float32 buffer of ``length`` (default: the bucket's) elements.

        Elements past the bucket's own (padding) are zero whenever the layout changes.
        """
        g = bucket.buffer()
        index, numbers = bucket.index(), self.numbers(bucket)
        if self._layouts.get(index) == numbers:
            return self._flats[index]
        self._view_all()
        params = bucket.parameters()
        if sum(p.numel() for p in params) != g.numel():
            raise ValueError(f"expected bucket {index}'s parameters to fill its {g.numel()} "
                             "gradient elements (a dense bucket of whole parameters)")
        flat = torch.zeros(g.numel() if length is None else length, dtype=torch.float32,
                           device=g.device)
        at = 0
        for number, p in zip(numbers, params, strict=True):
            piece = flat[at:at + p.numel()]
            old = self._views.get(number)
            if old is not None:
                piece.copy_(old.reshape(-1))
            self._views[number] = piece
            at += p.numel()
        self._layouts[index], self._flats[index] = numbers, flat
        if bucket.is_last():
            for stale in [i for i in self._flats if i > index]:
                del self._flats[stale], self._layouts[stale]
        return flat

    def replace(self, old: torch.Tensor, new: torch.Tensor) -> None:
        """Make ``new`` the values of ``old``, a buffer :meth:`get` returned, without a copy.

        ``new`` (float32, ``old``'s length and device, contiguous) becomes the bucket's buffer
        that :meth:`get` returns from then on, and its parameters' values; the caller must not
        write to it otherwise. A hook that computes a bucket's next values into a new tensor
        saves the copy's read and write (8 bytes an element). If ``old`` is no longer the
        bucket's buffer (DDP regrouped the parameters since), ``new`` is copied into it, which
        its parameters no longer see, as they would not see a write to it.
        """
        if not isinstance(new, torch.Tensor) or new.dtype != torch.float32:
            raise TypeError(f"expected a float32 tensor, got "
                            f"{getattr(new, 'dtype', type(new).__name__)}")
        if new.shape != old.shape or new.device != old.device or not new.is_contiguous():
            raise ValueError(f"expected a contiguous tensor of shape {tuple(old.shape)} on "
                             f"{old.device}, got {tuple(new.shape)} on {new.device}")
        index = next((i for i, flat in self._flats.items() if flat is old), None)
        if index is None:
            old.copy_(new)
            return
        if new is old:
            return
        # The parameters' views into the old buffer would keep it alive: drop them, and cut
        # them from the new one when they are read (a layout change, a checkpoint).
        # (Positions by storage offset: an empty parameter's view has no data pointer.)
        storage, start = old.untyped_storage().data_ptr(), old.storage_offset()
        dropped = self._unviewed.setdefault(index, [])
        for number in self._layouts[index]:
            view = self._views.get(number)
            if (view is not None and view.device == old.device
                    and view.untyped_storage().data_ptr() == storage
                    and 0 <= view.storage_offset() - start <= old.numel()):
                dropped.append((number, view.storage_offset() - start, view.numel()))
                del self._views[number]
        self._flats[index] = new

    def _view_all(self) -> None:
        # Cut the views that replace() dropped from their buckets' current buffers.
        for index, dropped in self._unviewed.items():
            flat = self._flats[index]
            for number, at, length in dropped:
                self._views[number] = flat[at:at + length]
        self._unviewed.clear()

    def state_dict(self) -> dict[int, torch.Tensor]:
        """Return a copy of every parameter's values, by parameter number."""
        self._view_all()
        return {n: v.clone() for n, v in self._views.items()}

    def load_state_dict(self, state: dict[int, torch.Tensor]) -> None:
        """Restore values saved by :meth:`state_dict`; they go into the buckets as they come."""
        if not isinstance(state, dict) or not all(
                isinstance(k, int) and isinstance(v, torch.Tensor) for k, v in state.items()):
            raise TypeError("expected a dict of parameter number -> tensor from "
                            "ParamBuffers.state_dict()")
        self._views = {k: v.clone() for k, v in state.items()}
        self._layouts, self._flats, self._unviewed = {}, {}, {}

    def __getstate__(self) -> dict:
        # Parameters are known by id() only within this process: keep the values by number,
        # as load_state_dict would, and number the parameters again on first sight.
        return {"views": self.state_dict()}

    def __setstate__(self, state: dict) -> None:
        self._number = {}
        self.load_state_dict(state["views"])

    def __len__(self) -> int:
        """Return the number of elements held (every parameter's, counted once)."""
        self._view_all()
        return sum(v.numel() for v in self._views.values())


# What a bucket's work hands back besides its result: settle(keep) applies the bucket's buffer
# updates (keep=True) or leaves the buffers as they were (keep=False), once the step is agreed.
Settle = Callable[[bool], None]
Work = Callable[[torch.Tensor, bool], tuple[torch.Tensor, Settle | None]]


class _Step:
    """The buckets of the step in progress: held until the agreement after its last bucket."""

    __slots__ = ("held", "overflow", "finite", "checks")

    def __init__(self) -> None:
        # (future, result or None where the collective found an overflow, settle, gradient)
        self.held: list[tuple[Future, torch.Tensor | None, Settle | None, torch.Tensor]] = []
        self.overflow = False
        # off the numpy path: whether every bucket so far was finite, a 0-dim bool on the device
        self.finite: torch.Tensor | None = None
        # the exchanges' unread checks of what they received (see _frame.collect)
        self.checks: list = []

    def screen(self, g: torch.Tensor) -> torch.Tensor:
        """Return ``g`` with every NaN and inf set to zero, noting whether it had any.

        The hooks exchange float32, so a float64 beyond float32's range counts as an inf.
        Zeros are a stand-in every codec accepts, and a step with an overflow hands back
        all-NaN results, so nothing of ``g``'s values outlives the step. On the numpy path the
        check is a microsecond's host read, and a bucket that fails it becomes zeros. On a
        device the flag stays there (a host read per bucket would wait for the device each
        time) and is folded into one read at the step's agreement; the zeros are written into
        ``g`` in place, in the check's own read (a finite bucket is read once, not copied).
        """
        if use_numpy(g):
            if all_finite(g, as_float32=True):
                return g
            self.overflow = True
            return torch.zeros_like(g)
        finite = ~zero_nonfinite_(g, as_float32=True)
        self.finite = finite if self.finite is None else self.finite & finite
        return g

    def overflowed(self) -> bool:
        """Say whether a bucket of this step held a NaN or inf (one host read off numpy).

        The exchanges' held checks come back in the same read; a broken one raises its
        precise error.
        """
        infinite = None if self.finite is None else (~self.finite).reshape(1)
        got = _frame.read_checked(self.checks, infinite)
        return self.overflow or bool(got and got[0])

    def drop(self, error: BaseException | None = None) -> None:
        """Leave every held bucket's buffers as they were; fail the futures with ``error``."""
        for fut, _, settle, _ in self.held:
            if settle is not None:
                settle(False)
            if error is not None:
                fut.set_exception(error)
        self.held = []


class _HookState:
    """What every hook's state holds: the transport, the agreement switch and the overlap."""

    __slots__ = ("comm", "check", "overlap", "iteration", "_pool", "_streams", "_step",
                 "_layouts")
    _buffers: tuple[str, ...] = ()  # ParamBuffers attributes that state_dict saves
    _local = ("comm", "_pool", "_streams", "_step", "_layouts")  # left out of a pickle

    def __init__(self, comm: Comm, *, check: bool, overlap: bool):
        self.comm = check_comm(comm)
        self.check, self.overlap = bool(check), bool(overlap)
        self.iteration = 0
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._streams: dict[torch.device, object] = {}
        self._step = _Step()
        # bucket index -> the layout (gradient length, parameters) its agreement covered
        self._layouts: dict[int, tuple[int, tuple[int, ...]]] = {}

    def _options(self) -> dict:
        return {}

    def state_dict(self) -> dict:
        """Return the iteration count and the buffers (by parameter number), for checkpoints."""
        sd: dict = {"kind": type(self).__name__, "iteration": self.iteration,
                    "options": self._options()}
        for name in self._buffers:
            sd[name] = getattr(self, name).state_dict()
        return sd

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` saved (from a state of the same class and options)."""
        if not isinstance(state, dict) or state.get("kind") != type(self).__name__:
            raise ValueError(f"expected a state_dict of a {type(self).__name__}, got one of "
                             f"{state.get('kind') if isinstance(state, dict) else state!r}")
        if state["options"] != self._options():
            raise ValueError(f"expected options {self._options()}, the saved state has "
                             f"{state['options']}")
        self.iteration = int(state["iteration"])
        for name in self._buffers:
            getattr(self, name).load_state_dict(state[name])

    def __getstate__(self) -> dict:
        warnings.warn(f"{type(self).__name__}: the transport (comm) is not picklable and is "
                      "left out; set state.comm after loading", stacklevel=2)
        return {k: getattr(self, k) for cls in type(self).__mro__
                for k in getattr(cls, "__slots__", ()) if k not in self._local}

    def __setstate__(self, state: dict) -> None:
        for k, v in state.items():
            setattr(self, k, v)
        self.comm, self._pool, self._streams = None, None, {}
        self._step, self._layouts = _Step(), {}

    def close(self) -> None:
        """Stop the exchange thread after the exchanges already handed to it."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def _submit(self, bucket: dist.GradBucket, work: Work) -> Future:
        """Return a future of ``work(bucket's gradient, check)``'s result, run on the thread."""
        for name in self._buffers:
            # Parameters are numbered here, in DDP's order of buckets, not the thread's.
            getattr(self, name).numbers(bucket)
        g = bucket.buffer()
        index, last = bucket.index(), bucket.is_last()
        # what the step agreement remembers per bucket index (only check=True agrees)
        layout = (g.numel(), tuple(id(p) for p in bucket.parameters())) if self.check else None
        cuda = g.device.type == "cuda"
        fut: Future = Future(devices=[g.device]) if cuda else Future()

        def run() -> None:
            if self.check:
                self._run_checked(fut, g, index, layout, last, work)
                return
            try:
                out, settle = work(g, False)
                if settle is not None:
                    settle(True)
            except BaseException as e:  # noqa: BLE001 - handed to the waiter, as DDP expects
                fut.set_exception(e)
                return
            if last:
                self.iteration += 1
            fut.set_result(out)

        if not self.overlap:
            run()
            return fut
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix=f"bitcomm-{type(self).__name__}")
        if not cuda:
            self._pool.submit(run)
            return fut
        # The gradients are written on the autograd thread's stream; the exchange runs on a
        # stream of the state's own that waits for them, and the future records its own event.
        ready = torch.cuda.Event()
        ready.record()
        stream = self._streams.setdefault(g.device, torch.cuda.Stream(g.device))

        def run_cuda() -> None:
            with torch.cuda.device(g.device), torch.cuda.stream(stream):
                stream.wait_event(ready)
                run()

        self._pool.submit(run_cuda)
        return fut

    def _run_checked(self, fut: Future, g: torch.Tensor, index: int,
                     layout: tuple[int, tuple[int, ...]], last: bool, work: Work) -> None:
        # One bucket under check=True: exchanged, then held until the step's agreement.
        step = self._step
        if index == 0 and step.held:
            # The last step's backward stopped before its last bucket: its buckets are not
            # applied, and a wait for one of them fails rather than blocks.
            step.drop(RuntimeError(f"{type(self).__name__}: a new step began before this "
                                   "bucket's step reached its last bucket"))
            step = self._step = _Step()
        try:
            if self._layouts.get(index) != layout:
                # A layout not agreed on before: the collective's own agreement covers its
                # options and length, and an overflow found there is every rank's.
                try:
                    out, settle = work(g, True)
                except NonFiniteError:
                    out, settle, step.overflow = None, None, True
                self._layouts[index] = layout
            else:
                g = step.screen(g)
                # The futures wait for the step's agreement anyway: what the exchange would
                # check with a read of its own rides on the agreement's.
                with _frame.collect(step.checks):
                    out, settle = work(g, False)
        except BaseException as e:  # noqa: BLE001 - handed to the waiters, as DDP expects
            self._step = _Step()
            step.drop(e)
            fut.set_exception(e)
            return
        step.held.append((fut, out, settle, g))
        if last:
            self._step = _Step()
            self._agree_step(step)

    def _agree_step(self, step: _Step) -> None:
        # Every rank learns whether any rank's bucket overflowed in this step; the ranks also
        # agree on the hook, its options and the step's bucket lengths.
        error: BaseException | None = None
        try:
            overflowed = step.overflowed()
        except Exception as e:  # noqa: BLE001 - a corrupt payload received, raised below
            error, overflowed = e, False

        def refuse(_: torch.Tensor) -> None:
            # A ValueError, TypeError or OverflowError reaches every rank through the
            # agreement; anything else fails this rank's futures below.
            if error is not None:
                raise error

        flag = torch.full((1,), float("nan") if overflowed else 0.0)
        options = {"options": self._options(),
                   "buckets": tuple(g.numel() for _, _, _, g in step.held)}
        try:
            prepare(self.comm, flag, True, f"{type(self).__name__} step", options=options,
                    validate=refuse)
            keep = True
        except NonFiniteError:
            keep = False
        except BaseException as e:  # noqa: BLE001 - handed to the waiters, as DDP expects
            step.drop(e)
            return
        self.iteration += 1
        for fut, out, settle, g in step.held:
            if settle is not None:
                settle(keep)
            # As DDP's allreduce would give: a loss scaler skips the step on every rank.
            fut.set_result(out if keep else torch.full_like(g, float("nan")))
        step.held = []


class SignState(_HookState):
    """State of :func:`sign_majority_hook`.

    Args:
        comm: the transport (a ``TorchComm`` over DDP's process group, or one of its own).
        momentum: Signum's beta in [0, 1); 0 votes on the raw gradient.
        collective: ``"auto"`` (the default: allgather at 2 ranks, where it sends the ring's
            bytes, else ring), ``"ring"`` (ring_majority), ``"alltoall"``
            (alltoall_majority) or ``"allgather"`` (allgather_majority: one exchange, where
            the ring takes 2(N - 1); the cheapest for small buckets).
        tie: the vote where exactly half the workers say +1: ``"alternate"`` (the default,
            unbiased: +1 where the element's index in the bucket plus the iteration is even),
            ``"negative"`` (the paper's -1) or ``"positive"``; as
            :class:`~bitcomm.train.MajoritySignSGD`.
        check: agree once per step on overflow, options and bucket lengths (the module's
            "Overflow and loss scaling").
        overlap: exchange on the state's thread while backward goes on.

    """

    __slots__ = ("momentum", "collective", "tie", "momenta")
    _buffers = ("momenta",)

    def __init__(self, comm: Comm, *, momentum: float = 0.0, collective: str = "auto",
                 tie: str = "alternate", check: bool = True, overlap: bool = True):
        super().__init__(comm, check=check, overlap=overlap)
        self.momentum = check_range("momentum", momentum, 0.0, 1.0)
        check_collective(collective)
        check_tie(tie)
        self.collective, self.tie = collective, tie
        self.momenta = ParamBuffers()

    def _options(self) -> dict:
        return {"momentum": self.momentum, "collective": self.collective, "tie": self.tie}


class OneBitHookState(_HookState):
    """State of :func:`onebit_hook`.

    The worker error is kept per parameter and follows DDP's bucket rebuild; the server error
    belongs to the bucket (to the rank's chunk of it under the all-to-all) and starts again at
    zero when the bucket changes.

    Args:
        comm: the transport.
        freeze_step: iterations that average the gradients exactly before compression starts
            (the float32 sum of :func:`~bitcomm.collectives.allreduce`, the transport's own
            allreduce, divided by the number of ranks: what DDP's allreduce hook gives, with
            its traffic, where gathering every rank's bucket would move ``N / 2`` times as
            much): DeepSpeed's warm-up (its ``freeze_step``), and the first iteration's
            buckets are DDP's provisional ones.
        collective: the exchange of :func:`~bitcomm.collectives.onebit_allreduce`:
            ``"alltoall"`` (DeepSpeed's two rounds), ``"allgather"`` (one round, every rank
            serving every chunk; the same result) or ``"auto"`` (the default: the allgather at
            2 ranks, where it sends the same sign bytes, the all-to-all above).
        check: agree once per step (as :class:`SignState`).
        overlap: exchange on the state's thread while backward goes on.

    """

    __slots__ = ("freeze_step", "collective", "worker_errors", "server_errors")
    _buffers = ("worker_errors",)

    def __init__(self, comm: Comm, *, freeze_step: int = 0, collective: str = "auto",
                 check: bool = True, overlap: bool = True):
        super().__init__(comm, check=check, overlap=overlap)
        if isinstance(freeze_step, bool) or not isinstance(freeze_step, int) or freeze_step < 0:
            raise ValueError(f"expected freeze_step to be an int >= 0, got {freeze_step!r}")
        self.freeze_step = freeze_step
        self.collective = collective_for(collective, self.comm.size)
        self.worker_errors = ParamBuffers()
        self.server_errors: dict[int, OneBitState] = {}

    def _options(self) -> dict:
        return {"freeze_step": self.freeze_step, "collective": self.collective}


class QsgdState(_HookState):
    """State of :func:`qsgd_hook`.

    Args:
        comm: the transport.
        bits: 2, 4 or 8 bits per element.
        bucket_size: elements per quantisation scale.
        seed: base seed of the stochastic rounding (each call and rank gets its own stream).
        error_feedback: re-add what quantisation dropped at the next step.
        check: agree once per step (as :class:`SignState`).
        overlap: exchange on the state's thread while backward goes on.

    """

    __slots__ = ("bits", "bucket_size", "seed", "error_feedback", "calls", "residuals")
    _buffers = ("residuals",)

    def __init__(self, comm: Comm, *, bits: int = 8, bucket_size: int = 512, seed: int = 0,
                 error_feedback: bool = True, check: bool = True, overlap: bool = True):
        super().__init__(comm, check=check, overlap=overlap)
        if bits not in qsgd.BITS:
            raise ValueError(f"expected bits in {qsgd.BITS}, got {bits!r}")
        if isinstance(bucket_size, bool) or not isinstance(bucket_size, int) or bucket_size < 1:
            raise ValueError(f"expected bucket_size to be an int >= 1, got {bucket_size!r}")
        self.bits, self.bucket_size = bits, bucket_size
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"expected seed to be an int, got {type(seed).__name__}")
        self.seed = seed
        self.error_feedback = bool(error_feedback)
        self.calls = 0
        self.residuals = ParamBuffers()

    def _options(self) -> dict:
        return {"bits": self.bits, "bucket_size": self.bucket_size, "seed": self.seed,
                "error_feedback": self.error_feedback}

    def state_dict(self) -> dict:  # noqa: D102 - the base's, plus the call count (the seeds)
        return super().state_dict() | {"calls": self.calls}

    def load_state_dict(self, state: dict) -> None:  # noqa: D102 - see state_dict
        super().load_state_dict(state)
        self.calls = int(state["calls"])


class TopkState(_HookState):
    """State of :func:`topk_hook`.

    Args:
        comm: the transport.
        density: fraction of each bucket a worker sends, in (0, 1].
        method: ``"topk"``, ``"trimmed"`` or ``"threshold"`` (RedSync's selections).
        check: agree once per step (as :class:`SignState`).
        overlap: exchange on the state's thread while backward goes on.

    """

    __slots__ = ("density", "method", "residuals")
    _buffers = ("residuals",)

    def __init__(self, comm: Comm, *, density: float = 0.01, method: str = "topk",
                 check: bool = True, overlap: bool = True):
        super().__init__(comm, check=check, overlap=overlap)
        self.density = check_range("density", density, 0.0, 1.0 + 1e-12, lo_open=True)
        if method not in ("topk", "trimmed", "threshold"):
            raise ValueError(f"expected method in ('topk', 'trimmed', 'threshold'), got "
                             f"{method!r}")
        self.method = method
        self.residuals = ParamBuffers()

    def _options(self) -> dict:
        return {"density": self.density, "method": self.method}


def _check_state(state: object, kind: type) -> None:
    if not isinstance(state, kind):
        raise TypeError(f"expected a {kind.__name__}, got {type(state).__name__}")
    if state.comm is None:
        raise RuntimeError(f"{kind.__name__} has no transport (it was unpickled): set "
                           "state.comm to a TorchComm first")


def _into(g: torch.Tensor) -> torch.Tensor | None:
    # A float32 bucket receives its exchange's float32 result in place: DDP, whose own
    # allreduce works in the bucket, then need not copy the result into it.
    return g if g.dtype == torch.float32 else None


def sign_majority_hook(state: SignState, bucket: dist.GradBucket) -> Future[torch.Tensor]:
    """Replace the bucket's gradient by the workers' majority sign (signSGD / Signum)."""
    _check_state(state, SignState)

    def work(g: torch.Tensor, check: bool) -> tuple[torch.Tensor, Settle | None]:
        m = state.momenta.get(bucket) if state.momentum else None
        if m is not None:  # into a new buffer: a refused step leaves the old one as it was
            v = momentum(m, g, state.momentum, torch.empty_like(m))
        elif g.dtype in (torch.float16, torch.bfloat16):
            v = g  # widening is exact, so the signs are the float32 cast's: no widened copy
        else:
            v = g.to(torch.float32)  # float64: the float32 cast's signs (-1e-50 becomes -0.0)
        vote = vote_for(state.collective, state.comm.size)
        # Into the bucket itself where the dtypes allow: DDP need not copy it back.
        out = vote(state.comm, v, tie=state.tie, phase=state.iteration, check=check,
                   out=g if v.dtype == g.dtype else None).to(g.dtype)
        if m is None:
            return out, None

        def settle(keep: bool) -> None:
            if keep:
                state.momenta.replace(m, v)

        return out, settle

    return state._submit(bucket, work)


def onebit_hook(state: OneBitHookState, bucket: dist.GradBucket) -> Future[torch.Tensor]:
    """Replace the bucket's gradient by 1-bit Adam's compressed average (error feedback)."""
    _check_state(state, OneBitHookState)

    def work(g: torch.Tensor, check: bool) -> tuple[torch.Tensor, Settle | None]:
        if state.iteration < state.freeze_step:  # DDP's own average: the transport's allreduce
            return allreduce(state.comm, g, check=check).div_(state.comm.size).to(g.dtype), None
        index, size = bucket.index(), state.comm.size
        # The worker error is the parameters' (it follows a rebuild); the padding's stays zero.
        # A new layout gives a new buffer, and the bucket's server error starts again.
        worker_error = state.worker_errors.get(bucket, padded_length(g.numel(), size))
        one = state.server_errors.get(index)
        if one is None or one.worker_error is not worker_error:
            one = state.server_errors[index] = OneBitState(g.numel(), size, g.device,
                                                           collective=state.collective)
            one.worker_error = worker_error
        # The collective binds new errors to the state and leaves the old ones as they were:
        # what a refused step goes back to.
        old = (one.worker_error, one.server_error)
        # a 16-bit bucket is added to the worker error as torch widens it: no widened copy
        out = onebit_allreduce(state.comm, float32_operand(g), one, check=check, out=_into(g))
        if bucket.is_last():
            for stale in [i for i in state.server_errors if i > index]:
                del state.server_errors[stale]

        def settle(keep: bool) -> None:
            if keep:
                state.worker_errors.replace(old[0], one.worker_error)
            else:
                one.worker_error, one.server_error = old

        return out.to(g.dtype), settle

    return state._submit(bucket, work)


def qsgd_hook(state: QsgdState, bucket: dist.GradBucket) -> Future[torch.Tensor]:
    """Replace the bucket's gradient by the mean of the workers' QSGD-quantised gradients."""
    _check_state(state, QsgdState)

    def work(g: torch.Tensor, check: bool) -> tuple[torch.Tensor, Settle | None]:
        if state.error_feedback:
            e = state.residuals.get(bucket)
            c = torch.add(e, float32_operand(g))
        else:
            c = g.to(torch.float32)
        # with error feedback the second result is c less what was sent: what quantisation
        # left out (with triton, written in the mean's own pass)
        mean, dropped = qsgd_allgather(state.comm, c, bits=state.bits,
                                       bucket=state.bucket_size,
                                       seed=state.seed + state.calls * state.comm.size,
                                       check=check, residual=state.error_feedback,
                                       out=_into(g))
        state.calls += 1
        if not state.error_feedback:
            return mean.to(g.dtype), None

        def settle(keep: bool) -> None:
            if keep:
                state.residuals.replace(e, dropped)

        return mean.to(g.dtype), settle

    return state._submit(bucket, work)


def topk_hook(state: TopkState, bucket: dist.GradBucket) -> Future[torch.Tensor]:
    """Replace the bucket's gradient by the workers' top-k residual entries, summed, / N."""
    _check_state(state, TopkState)

    def work(g: torch.Tensor, check: bool) -> tuple[torch.Tensor, Settle | None]:
        residual = state.residuals.get(bucket)
        v = torch.add(residual, float32_operand(g))
        k = max(1, math.ceil(state.density * v.numel()))
        mean, (idx, _) = sparse_allgather(state.comm, v, k, method=state.method, check=check,
                                          average=True, out=_into(g))
        v.index_fill_(0, idx, 0)  # v[idx] = 0 would copy the 0 from host memory, a wait

        def settle(keep: bool) -> None:
            if keep:
                state.residuals.replace(residual, v)

        return mean.to(g.dtype), settle

    return state._submit(bucket, work)
