"""Emulated networks: topologies (YAML), namespaces shaped with tc, MPI jobs across them.

Sits above the collectives; nothing below imports it. Needs root and iproute2 to build
networks; :mod:`~bitcomm.netem.topology` alone needs neither. The names below are its front
door (what the CLI uses); the modules hold the rest.
"""

from bitcomm.netem import model, report
from bitcomm.netem.emulator import (
    CONGESTION,
    PREFIX,
    QUEUE,
    WINDOW,
    Emulator,
    EmulatorError,
    requirements,
    sweep,
)
from bitcomm.netem.experiment import (
    CPU_BOUND,
    Experiment,
    experiment_from,
    find_experiment,
    load_experiment,
    read_file,
    run_experiment,
)
from bitcomm.netem.linkcheck import check_links
from bitcomm.netem.results import Cell, Measurement
from bitcomm.netem.topology import Topology, TopologyError, find, load

__all__ = [
    "model",
    "report",
    "CONGESTION",
    "PREFIX",
    "QUEUE",
    "WINDOW",
    "Emulator",
    "EmulatorError",
    "requirements",
    "sweep",
    "CPU_BOUND",
    "Experiment",
    "find_experiment",
    "load_experiment",
    "read_file",
    "experiment_from",
    "run_experiment",
    "check_links",
    "Cell",
    "Measurement",
    "Topology",
    "TopologyError",
    "find",
    "load",
]
