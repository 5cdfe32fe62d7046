"""In-process transport: ``size`` ranks as threads sharing queues, for fast tests and tracing.

Each ordered pair of ranks has a FIFO queue; ``send`` puts a copy of the bytes, ``recv`` takes
the next message and checks its length. Every blocking wait polls the group's record of failed
ranks, so when a rank raises, a wait for a message it never sent stops with ``RuntimeError``
naming it (and the ranks waiting on that one stop in turn, as a dead MPI peer would be noticed),
and no wait lasts longer than ``timeout`` seconds (``TimeoutError`` naming the peer).

Example::

    from bitcomm.comm.local import run_local
    sums = run_local(lambda comm: comm.allreduce(torch.ones(3) * comm.rank), size=4)
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from bitcomm.comm.base import Comm, Request

__all__ = ["LocalComm", "LocalGroup", "run_local"]

_POLL = 0.05  # seconds between checks of the failed ranks while waiting


class LocalGroup:
    """Queues, failed ranks and timeout shared by the ranks of one in-process group."""

    __slots__ = ("size", "timeout", "queues", "failed", "_barrier")

    def __init__(self, size: int, timeout: float = 60.0):
        if size < 1:
            raise ValueError(f"expected size >= 1, got {size}")
        if not timeout > 0:
            raise ValueError(f"expected timeout > 0 seconds, got {timeout}")
        self.size = size
        self.timeout = float(timeout)
        self.queues = {(s, d): queue.SimpleQueue() for s in range(size) for d in range(size)}
        self.failed: dict[int, str] = {}  # rank -> why, in the order they failed
        self._barrier = threading.Barrier(size)

    def comm(self, rank: int) -> LocalComm:
        """Return rank ``rank``'s endpoint."""
        return LocalComm(self, rank)

    def fail(self, rank: int, error: BaseException) -> None:
        """Record that ``rank`` failed, so waits on it stop; break the barrier."""
        self.failed.setdefault(rank, f"rank {rank} failed with {type(error).__name__}: {error}")
        self._barrier.abort()


class LocalComm(Comm):
    """One rank of a :class:`LocalGroup`.

    ``trace``, when set to a list, receives ``(dest, nbytes, blocking)`` for every point-to-point
    message this rank sends, in order (all-to-all and allgather appear as their pairwise rounds,
    an allreduce as one message per peer; ``blocking`` is False for :meth:`isend`, whose sender
    goes on without waiting): the byte schedule of a collective, for the network model.
    """

    def __init__(self, group: LocalGroup, rank: int):
        super().__init__(rank, group.size)
        self.group = group
        self.trace: list[tuple[int, int, bool]] | None = None

    def _get(self, source: int, what: str) -> Any:
        q = self.group.queues[(source, self.rank)]
        deadline = time.monotonic() + self.group.timeout
        while True:
            try:
                return q.get(timeout=_POLL)
            except queue.Empty:
                # Only the source's own failure ends the wait, and only once its queue is
                # empty: another rank's failure says nothing about whether the source, still
                # running, will send (it may be between two sends of one exchange).
                if source in self.group.failed:
                    raise RuntimeError(f"rank {self.rank} stopped waiting for {what} from rank "
                                       f"{source}: {self.group.failed[source]}") from None
                if time.monotonic() > deadline:
                    raise TimeoutError(f"rank {self.rank} waited {self.group.timeout:g} s for "
                                       f"{what} from rank {source}") from None

    def _put(self, dest: int, item: Any, blocking: bool = True) -> None:
        if self.trace is not None:
            self.trace.append((dest, item.numel() * item.element_size(), blocking))
        self.group.queues[(self.rank, dest)].put(item)

    def _send(self, buf: torch.Tensor, dest: int) -> None:
        self._put(dest, buf.clone())

    def _isend(self, buf: torch.Tensor, dest: int) -> Request:
        self._put(dest, buf.clone(), blocking=False)  # queued at once: nothing to wait for
        return Request()

    def _recv(self, out: torch.Tensor, source: int) -> torch.Tensor:
        msg = self._get(source, f"{out.numel()} bytes")
        if msg.numel() != out.numel():
            raise ValueError(f"rank {self.rank} expected {out.numel()} bytes from rank {source}, "
                             f"got {msg.numel()}")
        return out.copy_(msg)

    def _sendrecv(self, buf: torch.Tensor, dest: int, out: torch.Tensor, source: int
                  ) -> torch.Tensor:
        self._send(buf, dest)  # queues never block a sender, so this cannot deadlock
        return self._recv(out, source)

    def _allreduce(self, x: torch.Tensor) -> torch.Tensor:
        # Everyone gets every operand and adds them in rank order: bit-identical results.
        for d in range(self.size):
            if d != self.rank:
                self._put(d, x.clone())
        parts = [x if s == self.rank else self._get(s, "an allreduce operand")
                 for s in range(self.size)]
        out = parts[0].clone()
        for p in parts[1:]:
            out += p
        return out

    def _barrier(self) -> None:
        try:
            self.group._barrier.wait(timeout=self.group.timeout)
        except threading.BrokenBarrierError:
            reason = next(iter(self.group.failed.values()), "timed out")
            raise RuntimeError(f"rank {self.rank} left a broken barrier: {reason}") from None


def run_local(fn: Callable[..., Any], size: int, *args: Any, timeout: float = 60.0,
              return_exceptions: bool = False, **kwargs: Any) -> list[Any]:
    """Run ``fn(comm, *args, **kwargs)`` on ``size`` thread ranks; return the results by rank.

    If any rank raises, the first failure (by time) is re-raised here after every thread has
    stopped; the other ranks stop at their next wait. With ``return_exceptions`` each rank's
    exception takes the place of its result instead.
    """
    group = LocalGroup(size, timeout)
    results: list[Any] = [None] * size
    errors: list[tuple[int, BaseException]] = []
    lock = threading.Lock()

    def worker(rank: int) -> None:
        try:
            results[rank] = fn(group.comm(rank), *args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - handed to the caller below
            results[rank] = e
            with lock:
                errors.append((rank, e))
                group.fail(rank, e)

    threads = [threading.Thread(target=worker, args=(r,), name=f"bitcomm-rank-{r}", daemon=True)
               for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors and not return_exceptions:
        raise errors[0][1]
    return results
