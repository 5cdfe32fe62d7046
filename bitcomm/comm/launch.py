"""Start a job of N ranks on this machine, and the Comm each rank of it builds.

Two transports, one convention: ``"mpi"`` runs the command under the ``mpiexec`` next to this
Python (``python -m mpi4py``, so an exception on one rank aborts all of them instead of leaving
the others blocked); ``"gloo"`` starts N processes with ``RANK``, ``WORLD_SIZE`` and
``BITCOMM_STORE`` (a file-store path for ``torch.distributed``) in their environment. A rank
then calls :func:`world` with the same transport name.

Example::

    with tempfile.TemporaryDirectory() as tmp:
        procs = [subprocess.Popen(cmd, env=env)
                 for cmd, env in commands(4, "gloo", [sys.executable, "-m", "my.worker"], tmp)]
    # in my.worker:  comm = world("gloo")
"""

from __future__ import annotations

import datetime
import os
import sys
from pathlib import Path

from bitcomm.comm.base import Comm

__all__ = ["TRANSPORTS", "commands", "world"]

TRANSPORTS = ("mpi", "gloo")
"""Transport names :func:`commands` and :func:`world` accept."""


def commands(ranks: int, transport: str, argv: list[str], store_dir: str | os.PathLike
             ) -> list[tuple[list[str], dict[str, str]]]:
    """Return ``(command, environment)`` pairs that start ``argv`` as a job of ``ranks`` ranks.

    ``argv`` starts with the Python interpreter; ``store_dir`` is a directory that outlives the
    job (the gloo file store goes there). MPI gives one ``mpiexec`` command, gloo one per rank.

    Raises:
        ValueError: an unknown transport or ``ranks < 1``.
        RuntimeError: MPI was asked for and there is no ``mpiexec`` next to ``sys.executable``.

    """
    if transport not in TRANSPORTS:
        raise ValueError(f"expected transport in {TRANSPORTS}, got {transport!r}")
    if ranks < 1:
        raise ValueError(f"expected ranks >= 1, got {ranks}")
    env = dict(os.environ)
    if transport == "mpi":
        mpiexec = Path(sys.executable).with_name("mpiexec")
        if not mpiexec.exists():
            raise RuntimeError(f"expected mpiexec next to {sys.executable}; install the mpi "
                               "extra (pip install 'bitcomm[mpi]')")
        return [([str(mpiexec), "-n", str(ranks), argv[0], "-m", "mpi4py", *argv[1:]], env)]
    env.update(WORLD_SIZE=str(ranks), BITCOMM_STORE=str(Path(store_dir) / "store"))
    return [(list(argv), dict(env, RANK=str(r))) for r in range(ranks)]


def world(transport: str, *, timeout: float = 300.0) -> Comm:
    """Return this rank's Comm in a job started as :func:`commands` describes.

    ``timeout`` bounds every gloo wait (the process group's timeout); MPI has none of its own.
    """
    if transport == "mpi":
        from bitcomm.comm.mpi import MPIComm

        return MPIComm()
    if transport != "gloo":
        raise ValueError(f"expected transport in {TRANSPORTS}, got {transport!r}")
    import torch.distributed as dist

    from bitcomm.comm.torchdist import TorchComm

    dist.init_process_group("gloo", init_method=f"file://{os.environ['BITCOMM_STORE']}",
                            rank=int(os.environ["RANK"]),
                            world_size=int(os.environ["WORLD_SIZE"]),
                            timeout=datetime.timedelta(seconds=timeout))
    return TorchComm()
