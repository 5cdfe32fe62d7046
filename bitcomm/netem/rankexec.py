"""Start one MPI rank inside its network namespace: ``python -m bitcomm.netem.rankexec SPEC CMD``.

Hydra (MPICH's ``mpiexec``) starts every rank on this host with ``PMI_RANK`` set and its PMI
connection as an inherited descriptor, so a rank can move into its namespace before the program
starts and still join the job. ``SPEC`` is the measurement's JSON spec
(:func:`bitcomm.netem.experiment.worker_spec`); its ``namespaces`` list names each rank's. The
program replaces this process (``exec``, no shell).
"""

from __future__ import annotations

import json
import os
import sys


def main(argv: list[str] | None = None) -> None:
    """Exec ``ip netns exec <namespace of PMI_RANK> CMD...``."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) < 2:
        sys.exit("usage: python -m bitcomm.netem.rankexec SPEC.json CMD [ARGS...]")
    rank = os.environ.get("PMI_RANK")
    if rank is None:
        sys.exit("rankexec: expected PMI_RANK in the environment (run under MPICH's mpiexec)")
    with open(args[0]) as fh:
        names = json.load(fh)["namespaces"]
    if not 0 <= int(rank) < len(names):
        sys.exit(f"rankexec: rank {rank} has no namespace in {args[0]} ({len(names)} listed)")
    os.execvp("ip", ["ip", "netns", "exec", names[int(rank)], *args[1:]])


if __name__ == "__main__":
    main()
