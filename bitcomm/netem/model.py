"""The alpha-beta model: predicted time and bytes per link of a collective on a topology.

A collective's byte schedule is *traced*, not re-derived: the collective runs once on the
in-process transport with ``LocalComm.trace`` on, which records every message each rank sends in
order. The k-th message of every rank forms phase k: the collectives are lock-step (ring steps,
pairwise all-to-all rounds), so phase k's messages travel at the same time and phase k + 1 starts
when the slowest of them has arrived. This is exactly the pattern ``MPIComm(native=False)`` puts
on the wire, so the model and the emulated run cannot drift apart.

For phase k the model routes every message along :meth:`Topology.route_links` and adds up the
bytes per link direction; the phase takes ``alpha + max over link directions of bytes / rate``
(concurrent flows share a link's rate), and the collective the sum over phases (RedSync,
000_10f5b8196955b2ac.txt, Appendix B, with per-link rather than per-node bandwidth).

Latency: each phase also pays the path latency of its longest message (link delays plus one
1514-byte frame serialised per hop, store and forward) plus a fixed ``alpha`` per phase.

Bytes on a link: interface counters see TCP payload plus 66 bytes of Ethernet/IPv4/TCP headers
(with timestamps) per frame, data or ACK. :func:`payload_from_counters` recovers the payload as
``bytes - 66 * packets``, which is what the model's per-link payload is compared with (it then
includes MPI's own small per-message headers and any retransmissions).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from bitcomm import collectives as col
from bitcomm.comm.local import LocalComm, run_local
from bitcomm.netem.topology import Topology

__all__ = ["ALGORITHMS", "Prediction", "trace", "predict", "payload_from_counters", "FRAME",
           "HEADER"]

FRAME = 1514
"""Largest Ethernet frame on the veths (MTU 1500 + 14)."""
HEADER = 66
"""Ethernet + IPv4 + TCP (with timestamps) header bytes of every frame."""


def _ring(comm: LocalComm, x: torch.Tensor, check: bool = True) -> object:
    return col.ring_majority(comm, x, check=check)


def _ring_radix(comm: LocalComm, x: torch.Tensor, check: bool = True) -> object:
    return col.ring_majority(comm, x, packing="radix", check=check)


def _alltoall(comm: LocalComm, x: torch.Tensor, check: bool = True) -> object:
    return col.alltoall_majority(comm, x, check=check)


def _onebit(comm: LocalComm, x: torch.Tensor, check: bool = True) -> object:
    return col.onebit_allreduce(comm, x, col.OneBitState(x.numel(), comm.size), check=check)


ALGORITHMS: dict[str, Callable[..., object]] = {
    "ring-majority": _ring,
    "ring-majority-radix": _ring_radix,
    "alltoall-majority": _alltoall,
    "onebit-alltoall": _onebit,
}
"""The collectives the experiments compare, by the names the CLI uses.

Each is ``fn(comm, x, check=True)``; experiments time them with ``check=False`` (see
:func:`trace`)."""


def trace(algorithm: str, n: int, size: int) -> list[list[tuple[int, int, int]]]:
    """Return the phases of ``algorithm`` on ``n`` float32 elements and ``size`` ranks.

    Each phase is a list of ``(src, dst, nbytes)`` messages.
    """
    if algorithm not in ALGORITHMS:
        raise ValueError(f"expected algorithm in {sorted(ALGORITHMS)}, got {algorithm!r}")
    fn = ALGORITHMS[algorithm]

    def traced(comm: LocalComm) -> list[tuple[int, int]]:
        comm.trace = []
        # Message sizes of these collectives depend on n and size only, not on the values.
        # Traced without the input agreement (check=False), as the experiments time them: it is
        # bitcomm's guard against bad input, not part of the papers' algorithms, and its N - 1
        # latency-bound rounds are checked once, in each measurement's warm-up call.
        fn(comm, torch.randn(n, generator=torch.Generator().manual_seed(comm.rank)),
           check=False)
        return comm.trace

    traces = run_local(traced, size, timeout=600)
    depth = max((len(t) for t in traces), default=0)
    return [[(r, *traces[r][k]) for r in range(size) if k < len(traces[r])]
            for k in range(depth)]


@dataclasses.dataclass
class Prediction:
    """What the model predicts for one collective on one topology."""

    algorithm: str
    n: int
    seconds: float
    phases: int
    payload: dict[tuple[int, bool], int]  # (link index, a_to_b) -> payload bytes
    bottleneck: tuple[int, bool]  # the link direction that sets the most phase times

    def link_payload(self, link: int, a_to_b: bool) -> int:
        """Return the modelled payload bytes of one link direction."""
        return self.payload.get((link, a_to_b), 0)


def payload_from_counters(nbytes: float, packets: float) -> float:
    """Return the TCP payload behind an interface's byte and packet counts."""
    return nbytes - HEADER * packets


def predict(topo: Topology, algorithm: str, n: int, *, alpha: float = 0.0,
            phases: list[list[tuple[int, int, int]]] | None = None) -> Prediction:
    """Return the model's time and per-link payload for ``algorithm`` on ``topo``.

    Args:
        topo: the topology (rates already scaled).
        algorithm: a name from :data:`ALGORITHMS`.
        n: float32 elements per rank.
        alpha: fixed cost per phase in seconds (software and latency), added to each phase.
        phases: a schedule from :func:`trace` to reuse (traced when omitted).

    """
    phases = trace(algorithm, n, topo.nodes) if phases is None else phases
    routes: dict[tuple[int, int], list] = {}
    total: dict[tuple[int, bool], int] = {}
    seconds = 0.0
    votes: dict[tuple[int, bool], int] = {}
    for msgs in phases:
        load: dict[tuple[int, bool], int] = {}
        for src, dst, nbytes in msgs:
            if (src, dst) not in routes:
                routes[(src, dst)] = topo.route_links(src, dst)
            for link, forward in routes[(src, dst)]:
                key = (link.index, forward)
                load[key] = load.get(key, 0) + nbytes
        for key, nbytes in load.items():
            total[key] = total.get(key, 0) + nbytes
        if load:
            worst = max(load, key=lambda k: load[k] / topo.links[k[0]].rate)
            latency = max(sum(link.delay + FRAME / link.rate for link, _ in routes[(s, d)])
                          for s, d, _ in msgs)
            seconds += alpha + latency + load[worst] / topo.links[worst[0]].rate
            votes[worst] = votes.get(worst, 0) + 1
    bottleneck = max(votes, key=votes.get) if votes else (0, True)
    return Prediction(algorithm, n, seconds, len(phases), total, bottleneck)
