"""Experiments on emulated networks: topology x sizes x algorithms, measured against the model.

Schema (``bitcomm/configs/experiments/*.yaml``, or a file of one's own)::

    name: table1-chain                 # required
    description: free text             # optional
    topologies: [chain-16, chain-32]   # required: shipped names (bitcomm.configs) or .yaml paths
    sizes: [1M, 4M]                    # required: float32 elements per rank (K, M suffixes)
    algorithms: [ring-majority, alltoall-majority, onebit-allreduce]   # default: these three
    repeat: 3                          # timed calls per cell (median reported), after a warm-up
    scale: 250                         # optional: overrides every topology file's scale
    seed: 0                            # optional: seed of the inputs
    alpha: 0.0                         # optional: model's fixed cost per message, s
    queue: 0.5                         # optional: each shaper's queue, seconds of its rate
    window: null                       # optional: TCP receive buffer limit, seconds of the
                                       #   slowest link's rate (null: the kernel's); see
                                       #   bitcomm.netem.emulator
    congestion: reno                   # optional: the ranks' TCP congestion control

For each topology the network is built (:class:`~bitcomm.netem.emulator.Emulator`), one MPI job
runs every size and algorithm (:mod:`bitcomm.netem.worker`, ranks in their namespaces with
MPICH forced onto TCP), and the network is torn down. Each cell is then set beside the
alpha-beta model (:mod:`bitcomm.netem.model`): predicted time, the payload on the slowest link
(measured from its interface counters as ``bytes - 66 * packets``, per call, the busier
direction), and speedups over the all-to-all majority.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

from bitcomm import _names, _sizes, configs
from bitcomm.collectives import registry
from bitcomm.comm import launch
from bitcomm.netem import model as model_mod
from bitcomm.netem.emulator import CONGESTION, QUEUE, WINDOW, Emulator
from bitcomm.netem.results import Cell, Measurement
from bitcomm.netem.topology import Topology, TopologyError, direction_key, find, load

__all__ = ["Experiment", "read_file", "find_experiment", "load_experiment", "experiment_from",
           "run_experiment",
           "analyse", "cores", "MPI_ENV", "DEFAULT_ALGORITHMS", "CPU_BOUND"]

MPI_ENV = {"MPIR_CVAR_CH4_NETMOD": "ofi", "MPIR_CVAR_NOLOCAL": "1", "FI_PROVIDER": "tcp",
           "FI_TCP_MAX_SAVED_SIZE": str(64 << 20)}
"""MPICH settings that keep traffic between namespaces on their shaped links (ENVIRONMENT.md):
without them MPICH moves the bytes through shared memory and the links see nothing.

``FI_TCP_MAX_SAVED_SIZE``: the largest message libfabric's tcp provider saves when it arrives
before its receive is posted; a larger one is left in the socket until the receive is posted.
A ring rank's sends run ahead of its neighbour's receives (it does not wait for them, see
``Comm.isend``), so with the provider's default the ring's larger messages stalled their link
for a round trip each: measured on chain-32 at 4M elements, the wrap-around flow used about
0.55 of the slow link's rate in the first half of the ring with the default and about 0.75 with
64 MiB (interface counters sampled every 5 ms)."""
DEFAULT_ALGORITHMS = ("ring-majority", "alltoall-majority", "onebit-allreduce")
CPU_BOUND = 0.75
"""A cell whose ``cpu_share`` exceeds this is reported as CPU-bound.

All ranks of an emulated network share this machine's cores, while the model (like the paper's
testbed, one worker per machine) assumes the network alone sets the pace. Measured with the
slow links at 0.8 MB/s (2 cores): the 32-rank rings at 1M elements kept the cores 87-94% busy
and ran 1.12-1.24x their model, the same rings at 4M 70-72% busy and 1.07-1.08x. Halving the
rates (hetero-32 1M ring: 0.94 -> 0.68 busy, 1.24x -> 1.11x its model) is what the 32-rank
topology files do; a larger ``scale`` is the remedy on a machine with fewer cores per rank."""


@dataclasses.dataclass
class Experiment:
    """A validated experiment file."""

    name: str
    topologies: list[str]
    sizes: list[int]
    algorithms: list[str] = dataclasses.field(default_factory=lambda: list(DEFAULT_ALGORITHMS))
    repeat: int = 3
    scale: float | None = None
    seed: int = 0
    alpha: float = 0.0
    queue: float = QUEUE
    window: float | None = WINDOW
    congestion: str = CONGESTION
    description: str = ""

    def __post_init__(self) -> None:
        # results/NAME must stay inside results/, however the experiment was made
        self.name = _names.check(self.name, "experiment name")


def _size(value: object, where: str) -> int:
    try:
        return _sizes.parse(value)
    except ValueError as e:
        raise TopologyError(f"{where}: {e}") from None


def _seconds(value: object, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise TopologyError(f"{where}: expected a number of seconds > 0, got {value!r}")
    return float(value)


def read_file(path: str | Path) -> object:
    """Return the parsed YAML of an experiment file; ``TopologyError`` if it cannot be read."""
    import yaml

    path = Path(path)
    if not path.is_file():
        raise TopologyError(f"{path}: no such experiment file")
    try:
        return yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise TopologyError(f"{path}: not valid YAML: {e}") from None


def find_experiment(name: str) -> Path:
    """Return the file of experiment ``name``: a ``.yaml`` path, or a shipped experiment's name.

    ``TopologyError`` (a ``ValueError``) for neither, listing the shipped names.
    """
    try:
        return configs.find("experiments", name)
    except ValueError as e:
        raise TopologyError(str(e)) from None


def load_experiment(name: str | Path) -> Experiment:
    """Load and validate an experiment: a shipped name or a ``.yaml`` path."""
    path = find_experiment(str(name))
    return experiment_from(read_file(path), path)


def experiment_from(data: object, path: str | Path) -> Experiment:
    """Validate an experiment file's parsed ``data`` (``path`` names it in errors)."""
    if not isinstance(data, dict):
        raise TopologyError(f"{path}: expected a mapping at the top level")
    fields = {f.name for f in dataclasses.fields(Experiment)}
    extra = sorted(set(data) - fields)
    if extra:
        raise TopologyError(f"{path}: unknown keys {extra}; expected some of {sorted(fields)}")
    for key in ("name", "topologies", "sizes"):
        if key not in data:
            raise TopologyError(f"{path}: missing required key {key!r}")
    if not isinstance(data["topologies"], list) or not data["topologies"]:
        raise TopologyError(f"{path}: expected topologies to be a non-empty list")
    if not isinstance(data["sizes"], list) or not data["sizes"]:
        raise TopologyError(f"{path}: expected sizes to be a non-empty list")
    try:
        name = _names.check(data["name"], f"{path}: name")
    except ValueError as e:
        raise TopologyError(str(e)) from None
    exp = Experiment(name=name, topologies=[str(t) for t in data["topologies"]],
                     sizes=[_size(s, f"{path}: sizes[{i}]") for i, s in
                            enumerate(data["sizes"])])
    algorithms = data.get("algorithms", list(DEFAULT_ALGORITHMS))
    bad = [a for a in algorithms if not registry.is_emulated(a)]
    if bad:
        raise TopologyError(f"{path}: unknown algorithms {bad}; expected some of "
                            f"{list(registry.EMULATED)}")
    exp.algorithms = list(algorithms)
    repeat = data.get("repeat", 3)
    if isinstance(repeat, bool) or not isinstance(repeat, int) or repeat < 1:
        raise TopologyError(f"{path}: expected repeat to be an int >= 1, got {repeat!r}")
    exp.repeat = repeat
    exp.scale = None if data.get("scale") is None else float(data["scale"])
    exp.seed = int(data.get("seed", 0))
    exp.alpha = float(data.get("alpha", 0.0))
    exp.queue = _seconds(data.get("queue", QUEUE), f"{path}: queue")
    window = data.get("window", WINDOW)
    exp.window = None if window is None else _seconds(window, f"{path}: window")
    congestion = data.get("congestion", CONGESTION)
    if not isinstance(congestion, str) or not congestion.isidentifier():
        raise TopologyError(f"{path}: expected congestion to be a name like reno, bbr or cubic, "
                            f"got {congestion!r}")
    exp.congestion = congestion
    exp.description = str(data.get("description", ""))
    for t in exp.topologies:
        find(t)  # fails early, naming the missing topology
    return exp


def worker_spec(topo: Topology, net: Emulator, exp: Experiment, out: Path) -> dict:
    """Return the spec every rank of a measurement reads (written once by the parent).

    The plan (sizes, algorithms, repeat, seed, output file) for :mod:`bitcomm.netem.worker`,
    each rank's namespace for :mod:`bitcomm.netem.rankexec`, and the sending end of every link
    direction, where rank 0 reads the counters: no rank re-reads the topology or rebuilds the
    emulator's names.
    """
    return {"topology": topo.name, "ranks": topo.nodes,
            "namespaces": [net.ns(r) for r in range(topo.nodes)],
            "senders": [list(s) for s in net.senders()],
            "sizes": list(exp.sizes), "algorithms": list(exp.algorithms),
            "repeat": exp.repeat, "seed": exp.seed, "out": str(out)}


def measure(topo: Topology, exp: Experiment,
            progress: Callable[[str], None] = print, timeout: float = 3600
            ) -> list[Measurement]:
    """Build ``topo``, run every size and algorithm of ``exp`` on it, tear it down; return rows."""
    with launch.job_dir("exp") as tmp, \
            Emulator(topo, queue=exp.queue, window=exp.window, congestion=exp.congestion) as net:
        out = tmp / "rows.json"
        spec = tmp / "spec.json"
        spec.write_text(json.dumps(worker_spec(topo, net, exp, out)))
        cmd = [launch.mpiexec(), "-n", str(topo.nodes), sys.executable, "-m",
               "bitcomm.netem.rankexec", str(spec), sys.executable, "-m", "mpi4py", "-m",
               "bitcomm.netem.worker", str(spec)]
        env = dict(os.environ, **MPI_ENV, OMP_NUM_THREADS="1")
        launch.run_job([(cmd, env)], timeout=timeout, what=f"the MPI job on {topo.name}",
                       progress=progress)
        return [Measurement.from_dict(d) for d in json.loads(out.read_text())]


def cores() -> int:
    """Return the CPU cores this process (and so every rank of an experiment) may run on."""
    return len(os.sched_getaffinity(0))


def analyse(topo: Topology, rows: list[Measurement], alpha: float = 0.0,
            ncores: int | None = None, seed: int = 0) -> list[Cell]:
    """Set each measured row beside the model; add speedups over the all-to-all majority.

    ``cpu_share`` is the ranks' CPU time per call over what ``ncores`` cores (default: this
    machine's, :func:`cores`) offer in the call's time. Every rank of an experiment shares
    them, so a cell near 1 measured the CPU rather than the links: see :data:`CPU_BOUND`.
    """
    ncores = cores() if ncores is None else ncores
    slow = topo.slowest_link()
    cells = []
    for row in rows:
        pred = model_mod.predict(topo, row.algorithm, row.n, alpha=alpha, seed=seed)
        measured = {}
        for forward in (True, False):
            nbytes, packets = row.link_bytes[direction_key(slow.index, forward)]
            measured[forward] = model_mod.payload_from_counters(nbytes, packets)
        busier = max((True, False), key=lambda d: pred.link_payload(slow.index, d))
        modelled = pred.link_payload(slow.index, busier)
        bound = max(pred.link_payload(slow.index, d) for d in (True, False)) / slow.rate
        cells.append(Cell(
            topology=topo.name, ranks=topo.nodes, n=row.n, algorithm=row.algorithm,
            seconds=row.seconds, times=row.times, model_seconds=pred.seconds,
            time_vs_model=row.seconds / pred.seconds, slow_link=f"{slow.a}-{slow.b}",
            slow_link_rate=slow.rate, slow_link_payload=measured[busier],
            model_slow_link_payload=modelled,
            payload_vs_model=measured[busier] / modelled if modelled else float("nan"),
            bandwidth_bound_seconds=bound,
            time_vs_bound=row.seconds / bound if bound else float("nan"),
            wrong=row.wrong, cpu_seconds=row.cpu_seconds,
            cpu_share=row.cpu_seconds / (ncores * row.seconds),
            # losses, per call: what the shapers dropped (all links / the slowest link's two
            # directions) and what TCP resent and timed out on, over all ranks
            drops=sum(row.drops.values()),
            slow_link_drops=sum(row.drops.get(direction_key(slow.index, d), 0)
                                for d in (True, False)),
            tcp_retrans=row.tcp_retrans, tcp_timeouts=row.tcp_timeouts))
    by = {(c.n, c.algorithm): c for c in cells}
    for c in cells:
        base = by.get((c.n, "alltoall-majority"))
        if base:
            c.speedup = base.seconds / c.seconds
            c.model_speedup = base.model_seconds / c.model_seconds
            c.speedup_vs_model = c.speedup / c.model_speedup
    return cells


def run_experiment(exp: Experiment, progress: Callable[[str], None] = print) -> list[Cell]:
    """Measure and analyse every topology of ``exp``; return all cells."""
    cells = []
    for name in exp.topologies:
        path = find(name)
        topo = load(path, scale=exp.scale)
        progress(f"# {topo.name}: {topo.nodes} ranks, slowest link "
                 f"{topo.slowest_link().rate / 1e6:.3f} MB/s (scale 1/{topo.scale:g})")
        rows = measure(topo, exp, progress)
        cells.extend(analyse(topo, rows, exp.alpha, seed=exp.seed))
    return cells
