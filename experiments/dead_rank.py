"""How long the other ranks take to stop after one rank dies by SIGKILL, per transport.

    .venv/bin/python experiments/dead_rank.py [--ranks 3] [--repeat 5] [--out results]

Each run starts a job of N ranks (MPI through the mpiexec next to this Python, then gloo), lets
every rank finish one ``ring_majority`` of 64K elements, and then rank 1 kills itself with
SIGKILL while the others keep calling ``ring_majority``: no handler of the dead rank runs, as
when a machine or a process dies for real. The figure is the time from rank 1's kill (it writes
the time first) to the exit of the last other rank, measured by this script, which waits for
them. Under MPI the survivors are ended by mpiexec, which sees a rank die; under gloo each
survivor's next receive fails when its peer's socket closes, and it exits with that exception
(``noticed`` counts them). Prints one line per run and a summary, and saves
``OUT/dead-rank.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

LIMIT = 120.0  # seconds one job may take; a job still running then is a hang, and is killed


def rank_main(transport: str, job: Path) -> None:
    """One rank: agree, run one collective, then rank 1 dies and the others keep going."""
    import torch

    from bitcomm.collectives import ring_majority
    from bitcomm.comm.launch import world

    comm = world(transport, timeout=LIMIT)
    x = torch.randn(1 << 16)
    ring_majority(comm, x)
    comm.barrier()
    if comm.rank == 1:
        (job / "killed").write_text(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        while True:
            ring_majority(comm, x)
    except Exception as e:  # noqa: BLE001 - recorded, then the rank fails as it would
        (job / f"noticed-{comm.rank}").write_text(f"{time.time()!r} {type(e).__name__}")
        raise


def one_run(transport: str, ranks: int) -> dict:
    """Run one job; return the seconds from the kill to the last survivor's exit."""
    from bitcomm.comm import launch

    with launch.job_dir("dead-rank") as job:
        argv = [sys.executable, str(Path(__file__).resolve()), "--rank", transport, str(job)]
        procs = [launch.spawn(cmd, dict(env, OMP_NUM_THREADS="1"), stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
                 for cmd, env in launch.commands(ranks, transport, argv, job)]
        deadline = time.monotonic() + LIMIT
        hung = False
        for p in procs:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                hung = True
        end = time.time()
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        killed = float((job / "killed").read_text()) if (job / "killed").exists() else None
        noticed = len(list(job.glob("noticed-*")))
    if killed is None:
        raise RuntimeError(f"{transport}: rank 1 never reached its kill")
    return {"transport": transport, "ranks": ranks, "seconds": end - killed, "hung": hung,
            "noticed": noticed}


def main() -> None:
    """Measure each transport ``--repeat`` times; print and save the figures."""
    if len(sys.argv) > 1 and sys.argv[1] == "--rank":
        rank_main(sys.argv[2], Path(sys.argv[3]))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--out", default="results")
    args = parser.parse_args()
    if args.ranks < 2:
        parser.error("--ranks must be at least 2: rank 1 is the one that dies")
    from bitcomm.comm import launch

    transports = ["mpi", "gloo"]
    try:
        launch.mpiexec()
    except RuntimeError as e:
        print(f"# skipping mpi: {e}")
        transports.remove("mpi")
    rows = []
    for transport in transports:
        for i in range(args.repeat):
            row = one_run(transport, args.ranks)
            rows.append(row)
            print(f"  {transport} run {i + 1}: the others stopped {row['seconds']:.2f} s after "
                  f"the kill ({row['noticed']} raised an exception first"
                  f"{'; HUNG, killed' if row['hung'] else ''})", flush=True)
    summary = {}
    for transport in transports:
        secs = [r["seconds"] for r in rows if r["transport"] == transport]
        summary[transport] = {"min": min(secs), "median": statistics.median(secs),
                              "max": max(secs), "hung": sum(r["hung"] for r in rows
                                                            if r["transport"] == transport)}
        s = summary[transport]
        print(f"{transport}: {s['min']:.2f} / {s['median']:.2f} / {s['max']:.2f} s "
              f"(min / median / max of {len(secs)}), {s['hung']} hung")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "dead-rank.json"
    path.write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M"), "ranks": args.ranks,
                                "limit_s": LIMIT, "runs": rows, "summary": summary}, indent=1))
    print(f"# wrote {path}")


if __name__ == "__main__":
    main()
