"""One rank of an emulated-network measurement (started by :mod:`bitcomm.netem.experiment`).

Runs under ``mpiexec`` inside its namespace (:mod:`bitcomm.netem.rankexec`) with the MPI
settings that keep traffic on the shaped links. For each size and algorithm: one warm-up call
whose result is checked (majorities against a brute-force count of every rank's votes, which each
rank regenerates from the seeds; the 1-bit allreduce for byte-identity across ranks) and which
runs the collectives' input agreement (``check=True``), then ``repeat`` timed calls with
``check=False``, each started after a barrier; a call's time is the maximum over ranks, and its
CPU time (``cpu_seconds``) the sum over ranks: 16-32 ranks share 2 cores here, and this says
when the CPU rather than the links set the pace.
Rank 0 reads every link's interface counters and its shaper's drops (``ip -n``, ``tc -n``, from
inside its namespace) around the timed calls and writes one JSON row per measurement
(``link_bytes``: per link direction, bytes and packets per call, barriers included; ``drops``:
packets the shaper's queue dropped per call), and a progress line to stdout. Every rank reads its
own namespace's TCP counters around the timed calls (:func:`tcp_counters`); the row has their
sums per call (``tcp_retrans``, ``tcp_timeouts``): how much of the time went to recovering
losses rather than moving new bytes.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys

import torch

from bitcomm.collectives import registry
from bitcomm.comm.mpi import MPIComm
from bitcomm.netem.emulator import Sender, drops, tx_counters
from bitcomm.netem.results import Measurement
from bitcomm.netem.topology import direction_key


# Brute force over every rank's regenerated input: once per size, shared by the majorities.
@functools.lru_cache(maxsize=1)
def _majority(seed: int, size: int, n: int) -> torch.Tensor | None:
    return registry.get("ring-majority").reference(seed, size, n)


def _wrong(comm: MPIComm, spec: registry.Collective, out: torch.Tensor, seed: int, n: int) -> int:
    # Majorities against the brute-force count, the rest for byte-identity across ranks.
    reference = _majority(seed, comm.size, n) if spec.is_majority else None
    return registry.mismatches(comm, out, reference)


def tcp_counters() -> tuple[int, int]:
    """Return this network namespace's TCP (retransmitted segments, retransmission timeouts).

    From ``/proc/net/snmp`` (``Tcp: RetransSegs``) and ``/proc/net/netstat``
    (``TcpExt: TCPTimeouts``), which the kernel keeps per namespace: in an emulated network,
    per rank.
    """
    def field(path: str, table: str, name: str) -> int:
        with open(path) as fh:
            rows = [line.split() for line in fh if line.startswith(table + ":")]
        return int(rows[1][rows[0].index(name)])  # a header row, then a values row

    return (field("/proc/net/snmp", "Tcp", "RetransSegs"),
            field("/proc/net/netstat", "TcpExt", "TCPTimeouts"))


def main(argv: list[str] | None = None) -> None:
    """Measure what the spec file names (``python -m bitcomm.netem.worker SPEC.json``)."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("spec", help="the JSON spec of bitcomm.netem.experiment.worker_spec")
    with open(ap.parse_args(argv).spec) as fh:
        plan = json.load(fh)
    senders = [Sender(*s) for s in plan["senders"]]
    topology, repeat, seed = plan["topology"], plan["repeat"], plan["seed"]
    # Pairwise exchanges: the pattern the model predicts. Test-and-sleep waits: 16-32 ranks
    # share 2 cores, and MPICH's busy-polling waiters (its progress throttle did not help)
    # would take the CPU from the ranks that have packing to do.
    comm = MPIComm(native=False, poll_interval=2e-3)
    if comm.size != plan["ranks"]:
        raise SystemExit(f"expected {plan['ranks']} ranks for {topology}, got {comm.size}")
    rows = []
    for n in plan["sizes"]:
        x = registry.standard_input(seed, comm.rank, n)
        for algorithm in plan["algorithms"]:
            spec = registry.get(algorithm)
            comm.barrier()
            # one state for the warm-up and the timed calls: a primed collective's timed calls
            # reuse what the warm-up set up
            state = spec.new_state(n, comm.size)
            wrong = _wrong(comm, spec, spec(comm, x, state=state, check=True), seed, n)
            comm.barrier()
            before = tx_counters(senders) if comm.rank == 0 else None
            drops_before = drops(senders) if comm.rank == 0 else None
            tcp_before = tcp_counters()
            local = registry.time_calls(
                comm, lambda spec=spec, x=x, state=state: spec(comm, x, state=state,
                                                                check=False), repeat)
            comm.barrier()
            after = tx_counters(senders) if comm.rank == 0 else None
            drops_after = drops(senders) if comm.rank == 0 else None
            tcp = [a - b for a, b in zip(tcp_counters(), tcp_before, strict=True)]
            # gathered after the counters are read, so the gathers are not counted
            timing = registry.combine(comm, local)
            times, cpu_seconds = timing.seconds, timing.cpu_seconds
            every = comm.allgather_floats(tcp)
            retrans, timeouts = (sum(r[i] for r in every) / repeat for i in range(2))
            if comm.rank == 0:
                per_call = {direction_key(*k): [(after[k][0] - before[k][0]) / repeat,
                                                (after[k][1] - before[k][1]) / repeat]
                            for k in after}
                row = Measurement(
                    topology=topology, ranks=comm.size, n=n, algorithm=algorithm, times=times,
                    seconds=statistics.median(times), wrong=wrong,
                    cpu_seconds=statistics.median(cpu_seconds), link_bytes=per_call,
                    drops={direction_key(*k): (drops_after[k] - drops_before[k]) / repeat
                           for k in drops_after},
                    tcp_retrans=retrans, tcp_timeouts=timeouts)
                rows.append(row)
                print(f"  {topology} n={n} {algorithm}: {row.seconds:.3f} s, "
                      f"cpu {row.cpu_seconds:.2f} s over all ranks, "
                      f"{retrans:.0f} TCP segments resent per call (#wrong {wrong})",
                      flush=True)
    if comm.rank == 0:
        with open(plan["out"], "w") as fh:
            json.dump([r.as_dict() for r in rows], fh)
    comm.barrier()
    sys.stdout.flush()


if __name__ == "__main__":
    main()
