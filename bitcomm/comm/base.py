"""The transport interface every collective is written against, and its byte accounting.

A :class:`Comm` moves 1-D ``torch.uint8`` tensors between ``size`` ranks. Adapters (MPI,
torch.distributed, in-process threads) implement a few private primitives; the public methods
here check arguments and count bytes, so accounting lives in one place for every transport
(the shape of mpi4py's ``pkl5``, which passes the MPI primitive into one private ``_send``).

Byte accounting
---------------
``comm.counters`` holds, per peer, the payload bytes this rank handed to the transport for that
peer (``sent``) and the bytes it received from it (``received``). A collective's documented
wire-byte formula is the sum of ``sent`` over peers; tests compare them exactly. Counting is at
the level of the exchange the collective asks for: ``alltoallv`` counts ``len(bufs[j])`` to
``j``, ``allgatherv`` counts the buffer once per other rank (a direct exchange). Transport
framing (MPI envelopes, TCP headers) is not payload and is not counted.

Timeouts
--------
Blocking waits of the in-process transport give up after ``timeout`` seconds with
``TimeoutError`` naming the peer; torch.distributed uses its process-group timeout; MPI has
none of its own, so multi-process runs are launched with ``python -m mpi4py`` (an uncaught
exception aborts every rank) and a wall-clock limit.
"""

from __future__ import annotations

import torch

__all__ = ["Comm", "Counters", "Request"]


# -- staging between the host and a GPU, for the transports -----------------------------------


def _to_gpu(src: torch.Tensor, device: torch.device) -> bool:
    return src.device.type == "cpu" and device.type == "cuda"


def _moved(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Return ``t`` on ``device`` (itself if there); a host tensor goes to a GPU without a wait.

    From pinned memory: from pageable memory the copy would first wait for the device. The
    pinned block is not reused before the copy is done (PyTorch's host allocator records the
    copy's stream).
    """
    if t.device == device:
        return t
    if _to_gpu(t, device):
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _copy_into(out: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """Copy ``src`` into ``out`` and return it.

    To a GPU from the host without a wait, as :func:`_moved` does.
    """
    if _to_gpu(src, out.device):
        return out.copy_(src.pin_memory(), non_blocking=True)
    return out.copy_(src)


def _joined(bufs: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Return ``bufs`` concatenated on ``device``: one copy where they share a device.

    From a GPU to the host that is one wait rather than one a buffer.
    """
    if len({b.device for b in bufs}) == 1:
        return _moved(torch.cat(bufs), device)
    return torch.cat([_moved(b, device) for b in bufs])


def _parts(recv: torch.Tensor, sizes: list[int], device: torch.device) -> list[torch.Tensor]:
    """Return ``recv`` split into ``sizes`` on ``device``: one copy for all the parts.

    To the host that is one wait for the device rather than one a rank.
    """
    return list(_moved(recv, device).split(sizes))


class Request:
    """A send in flight (see :meth:`Comm.isend`); :meth:`wait` completes it.

    Holds the buffers the transport still reads from, so they stay alive until it is done.
    """

    def __init__(self, wait: object = None, keep: object = None):
        self._wait = wait
        self._keep = keep

    def wait(self) -> None:
        """Block until the transport is done with the send's buffer (idempotent)."""
        if self._wait is not None:
            wait, self._wait = self._wait, None
            wait()
        self._keep = None

    @staticmethod
    def wait_all(requests: list[Request]) -> None:
        """Wait for every request in ``requests``, in order."""
        for r in requests:
            r.wait()


class Counters:
    """Bytes sent to and received from each peer since the last :meth:`reset`."""

    __slots__ = ("sent", "received")

    def __init__(self, size: int):
        self.sent = [0] * size
        self.received = [0] * size

    def reset(self) -> None:
        """Zero every count."""
        for i in range(len(self.sent)):
            self.sent[i] = 0
            self.received[i] = 0

    @property
    def total_sent(self) -> int:
        """Return the bytes sent to all peers."""
        return sum(self.sent)

    @property
    def total_received(self) -> int:
        """Return the bytes received from all peers."""
        return sum(self.received)

    def __repr__(self) -> str:
        return f"Counters(sent={self.sent}, received={self.received})"


def _check_bytes(buf: object, name: str) -> torch.Tensor:
    if not isinstance(buf, torch.Tensor):
        raise TypeError(f"expected {name} to be a torch.Tensor, got {type(buf).__name__}")
    if buf.dtype != torch.uint8 or buf.dim() != 1:
        raise TypeError(f"expected {name} to be a 1-D uint8 tensor, got {buf.dtype} with shape "
                        f"{tuple(buf.shape)}")
    return buf if buf.is_contiguous() else buf.contiguous()


class Comm:
    """A group of ``size`` ranks exchanging uint8 tensors; subclasses supply the primitives.

    Subclasses implement ``_sendrecv``, ``_send``, ``_recv``, ``_alltoallv``, ``_allgatherv``,
    ``_allreduce`` and ``_barrier``. The default ``_alltoallv`` and ``_allgatherv`` are built from
    ``_sendrecv`` in ``size - 1`` rounds (round ``r`` sends to ``rank + r`` and receives from
    ``rank - r``), which works for uneven sizes on every transport.
    """

    def __init__(self, rank: int, size: int, device: torch.device | str = "cpu"):
        if size < 1 or not 0 <= rank < size:
            raise ValueError(f"expected 0 <= rank < size, got rank={rank}, size={size}")
        self.rank = rank
        self.size = size
        self.device = torch.device(device)
        self.counters = Counters(size)

    # -- public, counted ---------------------------------------------------------------------

    def _check_peer(self, peer: int, name: str) -> int:
        if not 0 <= peer < self.size or peer == self.rank:
            raise ValueError(f"expected {name} to be another rank in 0..{self.size - 1}, "
                             f"got {peer} on rank {self.rank}")
        return peer

    def send(self, buf: torch.Tensor, dest: int) -> None:
        """Send ``buf`` to ``dest`` (blocking)."""
        buf = _check_bytes(buf, "buf")
        self._send(buf, self._check_peer(dest, "dest"))
        self.counters.sent[dest] += buf.numel()

    def isend(self, buf: torch.Tensor, dest: int) -> Request:
        """Start sending ``buf`` to ``dest``; return a :class:`Request` to wait on.

        ``buf`` must not change until the request completes. A collective that waits only for
        what it receives keeps its outgoing link busy while it waits: a ring step's message
        goes out while the rank is already receiving the next one, instead of the rank
        stalling for the transport to confirm every send (MPI over TCP completes a large send
        only once the receiver has taken it, which costs a round trip per ring step).
        """
        buf = _check_bytes(buf, "buf")
        req = self._isend(buf, self._check_peer(dest, "dest"))
        self.counters.sent[dest] += buf.numel()
        return req

    def recv(self, out: torch.Tensor, source: int) -> torch.Tensor:
        """Receive exactly ``out.numel()`` bytes from ``source`` into ``out``; return it."""
        out = _check_bytes(out, "out")
        self._recv(out, self._check_peer(source, "source"))
        self.counters.received[source] += out.numel()
        return out

    def sendrecv(self, buf: torch.Tensor, dest: int, out: torch.Tensor, source: int
                 ) -> torch.Tensor:
        """Send ``buf`` to ``dest`` while receiving ``out.numel()`` bytes from ``source``."""
        buf, out = _check_bytes(buf, "buf"), _check_bytes(out, "out")
        self._sendrecv(buf, self._check_peer(dest, "dest"), out,
                       self._check_peer(source, "source"))
        self.counters.sent[dest] += buf.numel()
        self.counters.received[source] += out.numel()
        return out

    def shift(self, buf: torch.Tensor, dest: int, out: torch.Tensor, source: int) -> Request:
        """One step of a pattern where every rank calls ``shift`` at once (a ring step).

        Sends ``buf`` to ``dest`` and receives exactly ``out.numel()`` bytes from ``source``
        into ``out``, filled on return; the returned :class:`Request` completes the send
        (``buf`` must not change until it does). By default this is :meth:`isend` then
        :meth:`recv`, so the send can still be in flight during the next step; a transport
        whose collectives cost less than its point-to-point messages runs the step as one
        collective instead (then every rank of the group must call it, as a ring's steps do).
        """
        buf, out = _check_bytes(buf, "buf"), _check_bytes(out, "out")
        req = self._shift(buf, self._check_peer(dest, "dest"), out,
                          self._check_peer(source, "source"))
        self.counters.sent[dest] += buf.numel()
        self.counters.received[source] += out.numel()
        return req

    def alltoallv(self, bufs: list[torch.Tensor], sizes: list[int]) -> list[torch.Tensor]:
        """Send ``bufs[j]`` to rank ``j``; return what each rank sent here (``sizes[j]`` bytes).

        ``bufs[rank]`` is returned as is, without being counted.
        """
        if len(bufs) != self.size or len(sizes) != self.size:
            raise ValueError(f"expected {self.size} buffers and sizes, got {len(bufs)} and "
                             f"{len(sizes)}")
        bufs = [_check_bytes(b, f"bufs[{j}]") for j, b in enumerate(bufs)]
        out = self._alltoallv(bufs, [int(s) for s in sizes])
        for j in range(self.size):
            if j != self.rank:
                self.counters.sent[j] += bufs[j].numel()
                self.counters.received[j] += out[j].numel()
        return out

    def allgatherv(self, buf: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
        """Give ``buf`` to every rank; return every rank's buffer (``sizes[j]`` bytes each)."""
        buf = _check_bytes(buf, "buf")
        if len(sizes) != self.size or sizes[self.rank] != buf.numel():
            raise ValueError(f"expected {self.size} sizes with sizes[{self.rank}] = "
                             f"{buf.numel()}, got {list(sizes)}")
        out = self._allgatherv(buf, [int(s) for s in sizes])
        for j in range(self.size):
            if j != self.rank:
                self.counters.sent[j] += buf.numel()
                self.counters.received[j] += out[j].numel()
        return out

    def allgather_floats(self, values: list[float] | tuple[float, ...]) -> list[list[float]]:
        """Return every rank's ``values`` (the same count on every rank), as float64.

        For small bookkeeping (timings, counts, digests) between ranks: one :meth:`allgatherv`
        of ``8 * len(values)`` bytes, counted like any other exchange.
        """
        return self._allgather_words([float(v) for v in values], torch.float64)

    def allgather_ints(self, values: list[int] | tuple[int, ...]) -> list[list[int]]:
        """Return every rank's ``values`` (the same count on every rank), as int64.

        As :meth:`allgather_floats`, for sizes and counts beyond float64's exact integers: each
        value travels as 8 little-endian bytes. ``OverflowError`` if one does not fit.
        """
        ints = [int(v) for v in values]
        bad = [v for v in ints if not -(1 << 63) <= v < 1 << 63]
        if bad:
            raise OverflowError(f"expected values that int64 holds, got {bad[0]}")
        return self._allgather_words(ints, torch.int64)

    def _allgather_words(self, values: list, dtype: torch.dtype) -> list[list]:
        mine = torch.tensor(values, dtype=dtype).reshape(-1)
        nbytes = 8 * mine.numel()
        got = self.allgatherv(mine.view(torch.uint8), [nbytes] * self.size)
        if not nbytes:
            return [[] for _ in got]
        # one read of every rank's values (on a GPU transport, one wait)
        return torch.cat(got).view(dtype).reshape(self.size, -1).tolist()

    def allreduce(self, x: torch.Tensor) -> torch.Tensor:
        """Return the elementwise sum of ``x`` over ranks through the transport's native op.

        Counted as ``x``'s bytes once to every other rank (what a direct exchange moves); the
        native algorithm may move a different amount.
        """
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"expected x to be a torch.Tensor, got {type(x).__name__}")
        x = x.contiguous()
        out = self._allreduce(x)
        nbytes = x.numel() * x.element_size()
        for j in range(self.size):
            if j != self.rank:
                self.counters.sent[j] += nbytes
                self.counters.received[j] += nbytes
        return out

    def barrier(self) -> None:
        """Wait until every rank reaches the barrier."""
        self._barrier()

    # -- defaults built on _sendrecv ---------------------------------------------------------

    def _alltoallv(self, bufs: list[torch.Tensor], sizes: list[int]) -> list[torch.Tensor]:
        out: list[torch.Tensor] = [torch.empty(0)] * self.size
        out[self.rank] = bufs[self.rank]
        for r in range(1, self.size):
            dest, source = (self.rank + r) % self.size, (self.rank - r) % self.size
            recv = torch.empty(sizes[source], dtype=torch.uint8, device=bufs[dest].device)
            out[source] = self._sendrecv(bufs[dest], dest, recv, source)
        return out

    def _allgatherv(self, buf: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
        return self._alltoallv([buf] * self.size, sizes)

    def _shift(self, buf: torch.Tensor, dest: int, out: torch.Tensor, source: int) -> Request:
        req = self._isend(buf, dest)
        self._recv(out, source)
        return req

    # -- what adapters provide ---------------------------------------------------------------

    def _send(self, buf: torch.Tensor, dest: int) -> None:
        raise NotImplementedError

    def _recv(self, out: torch.Tensor, source: int) -> torch.Tensor:
        raise NotImplementedError

    def _isend(self, buf: torch.Tensor, dest: int) -> Request:
        raise NotImplementedError

    def _sendrecv(self, buf: torch.Tensor, dest: int, out: torch.Tensor, source: int
                  ) -> torch.Tensor:
        raise NotImplementedError

    def _allreduce(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _barrier(self) -> None:
        raise NotImplementedError
