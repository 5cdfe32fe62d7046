"""What an emulated experiment records: the one place that names every result key.

A :class:`Measurement` is what the ranks measured for one collective at one size on one topology
(rank 0 writes them as JSON for the parent); :func:`bitcomm.netem.experiment.analyse` sets each
beside the network model as a :class:`Cell`, which the reports read and ``results.json`` holds
(:meth:`Cell.as_dict`, the same keys as the attributes). Link directions are keyed by
:func:`bitcomm.netem.topology.direction_key`; every per-call figure is per timed call.
"""

from __future__ import annotations

import dataclasses

__all__ = ["Measurement", "Cell", "LinkCheck"]


@dataclasses.dataclass
class Measurement:
    """One collective at one size on one topology, as the ranks measured it.

    Attributes:
        topology: the topology's name.
        ranks: the number of ranks.
        n: float32 elements per rank.
        algorithm: the collective's registry name.
        times: each timed call's seconds (its slowest rank's).
        seconds: the median of ``times``.
        wrong: ranks whose warm-up result differed from the reference.
        cpu_seconds: CPU seconds per call, summed over ranks (median over calls).
        link_bytes: per direction: ``[bytes, packets]`` the sending end put on the wire per call.
        drops: per direction: packets its shaper dropped per call.
        tcp_retrans: TCP segments all ranks resent per call.
        tcp_timeouts: TCP retransmission timeouts of all ranks per call.

    """

    topology: str
    ranks: int
    n: int
    algorithm: str
    times: list[float]
    seconds: float
    wrong: int
    cpu_seconds: float
    link_bytes: dict[str, list[float]]
    drops: dict[str, float]
    tcp_retrans: float
    tcp_timeouts: float

    def as_dict(self) -> dict:
        """Return the fields as a JSON-ready dict."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> Measurement:
        """Return the measurement :meth:`as_dict` wrote (``TypeError`` naming a missing key)."""
        return cls(**data)


@dataclasses.dataclass
class Cell:
    """A :class:`Measurement` beside the model's prediction, as the reports show it.

    Attributes:
        topology, ranks, n, algorithm, seconds, times, wrong, cpu_seconds, tcp_retrans,
            tcp_timeouts: as in :class:`Measurement`.
        model_seconds: the model's time per call; ``time_vs_model`` is ``seconds`` over it.
        slow_link: the slowest link's ends, ``"a-b"``; ``slow_link_rate`` its rate in B/s.
        slow_link_payload: TCP payload bytes per call on its busier direction (by the model);
            ``model_slow_link_payload`` the model's, ``payload_vs_model`` their ratio.
        bandwidth_bound_seconds: the slowest link's busier direction's payload over its rate;
            ``time_vs_bound`` is ``seconds`` over it.
        cpu_share: ``cpu_seconds`` over what the machine's cores offer in ``seconds`` (over
            :data:`bitcomm.netem.experiment.CPU_BOUND`, the cell measured the CPU).
        drops: packets all shapers dropped per call; ``slow_link_drops`` the slowest link's.
        speedup: the all-to-all majority's seconds over this cell's, at the same size
            (``None`` without an all-to-all cell); ``model_speedup`` the model's,
            ``speedup_vs_model`` their ratio.

    """

    topology: str
    ranks: int
    n: int
    algorithm: str
    seconds: float
    times: list[float]
    model_seconds: float
    time_vs_model: float
    slow_link: str
    slow_link_rate: float
    slow_link_payload: float
    model_slow_link_payload: float
    payload_vs_model: float
    bandwidth_bound_seconds: float
    time_vs_bound: float
    wrong: int
    cpu_seconds: float
    cpu_share: float
    drops: float
    slow_link_drops: float
    tcp_retrans: float
    tcp_timeouts: float
    speedup: float | None = None
    model_speedup: float | None = None
    speedup_vs_model: float | None = None

    def as_dict(self) -> dict:
        """Return the fields as a JSON-ready dict (the rows of ``results.json``)."""
        return dataclasses.asdict(self)


@dataclasses.dataclass
class LinkCheck:
    """One link measured with iperf3 by ``bitcomm topo check`` (``links-NAME.json``).

    Attributes:
        link: the link's index; ``a`` and ``b`` its ends.
        pair: the ranks ``[sender, receiver]`` whose route has this link as its bottleneck.
        rate: the configured (scaled) rate, B/s.
        goodput: TCP payload received per second.
        ratio: ``goodput / rate`` (at most 0.956: TCP payload of a full frame).

    """

    link: int
    a: int | str
    b: int | str
    pair: list[int]
    rate: float
    goodput: float
    ratio: float

    def as_dict(self) -> dict:
        """Return the fields as a JSON-ready dict."""
        return dataclasses.asdict(self)
