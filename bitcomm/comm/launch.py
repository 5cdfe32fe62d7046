"""Start a job of N ranks on this machine, and the Comm each rank of it builds.

Two transports, one convention: ``"mpi"`` runs the command under the ``mpiexec`` next to this
Python (``python -m mpi4py``, so an exception on one rank aborts all of them instead of leaving
the others blocked); ``"gloo"`` starts N processes with ``RANK``, ``WORLD_SIZE`` and
``BITCOMM_STORE`` (a file-store path for ``torch.distributed``) in their environment. A rank
then calls :func:`world` with the same transport name.

Example::

    with job_dir("mine") as tmp:
        run_job(commands(4, "gloo", [sys.executable, "-m", "my.worker"], tmp), timeout=600,
                what="my job")
    # in my.worker:  comm = world("gloo")
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from bitcomm.comm.base import Comm

__all__ = ["TRANSPORTS", "commands", "job_dir", "leaked_job_dirs", "mpiexec",
           "remove_leaked_job_dirs", "run_job", "spawn", "world"]

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
        return [([mpiexec(), "-n", str(ranks), argv[0], "-m", "mpi4py", *argv[1:]], env)]
    env.update(WORLD_SIZE=str(ranks), BITCOMM_STORE=str(Path(store_dir) / "store"))
    return [(list(argv), dict(env, RANK=str(r))) for r in range(ranks)]


def mpiexec() -> str:
    """Return the ``mpiexec`` next to this Python (the mpi extra's MPICH).

    Raises:
        RuntimeError: there is none.

    """
    path = Path(sys.executable).with_name("mpiexec")
    if not path.exists():
        raise RuntimeError(f"expected mpiexec next to {sys.executable}; install the mpi "
                           "extra (pip install 'bitcomm[mpi]')")
    return str(path)


_PR_SET_PDEATHSIG = 1
_OWNER = "owner.pid"  # in a job directory: the pid of the process that made it


def _death_signal() -> Callable[[], None] | None:
    # Linux's prctl(PR_SET_PDEATHSIG): the child is killed when its parent dies, even by SIGKILL,
    # when no handler of the parent can run. Resolved here, in the parent, so the child only
    # calls a ready function pointer between fork and exec.
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def arm() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # the parent died before the signal was armed
            os._exit(1)
    return arm


def spawn(cmd: list[str], env: dict[str, str] | None = None, **kwargs) -> subprocess.Popen:
    """Start ``cmd`` as :class:`subprocess.Popen` does, killed by SIGKILL if this process dies.

    On Linux the child gets a parent-death signal, so a job's ``mpiexec`` (whose proxies then end
    the ranks) or gloo ranks never outlive a controller that was killed, even by SIGKILL.
    Elsewhere it is a plain ``Popen``. Call it from the thread that lives as long as the child:
    Linux sends the signal when the thread that forked it exits.
    """
    return subprocess.Popen(cmd, env=env, preexec_fn=_death_signal(), **kwargs)


@contextlib.contextmanager
def job_dir(what: str) -> Iterator[Path]:
    """Yield a fresh temporary directory ``bitcomm-WHAT-*`` for one job; remove it afterwards.

    It records its owner's pid, so :func:`leaked_job_dirs` can tell a directory whose owner was
    killed before it could clean up from one in use.
    """
    with tempfile.TemporaryDirectory(prefix=f"bitcomm-{what}-") as tmp:
        (Path(tmp) / _OWNER).write_text(str(os.getpid()))
        yield Path(tmp)


def leaked_job_dirs() -> list[Path]:
    """Return the :func:`job_dir` directories whose owner is no longer running."""
    leaked = []
    for d in Path(tempfile.gettempdir()).glob("bitcomm-*"):
        try:
            pid = int((d / _OWNER).read_text())
        except (OSError, ValueError):
            continue  # not a job directory, or one being made right now
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            leaked.append(d)
        except PermissionError:
            pass  # alive, another user's
    return sorted(leaked)


def remove_leaked_job_dirs() -> list[Path]:
    """Delete :func:`leaked_job_dirs`; return them."""
    leaked = leaked_job_dirs()
    for d in leaked:
        shutil.rmtree(d, ignore_errors=True)
    return leaked


def run_job(jobs: list[tuple[list[str], dict[str, str]]], *, timeout: float, what: str,
            progress: Callable[[str], None] | None = None) -> None:
    """Run the processes of one job to the end, within ``timeout`` seconds in all.

    ``jobs`` are ``(command, environment)`` pairs (:func:`commands` makes them). Every process's
    output is read as it comes (so none blocks on a full pipe); lines of the first process that
    start with two spaces, the ranks' progress lines, go to ``progress``. The processes still
    running when one fails to finish in time are killed, and so are all of them if this
    function is interrupted, or if this process dies (:func:`spawn`).

    Raises:
        RuntimeError: a process exited with a non-zero status, or the job outlived
            ``timeout``; the message names ``what`` and ends with each process's last 40 lines.

    """
    deadline = time.monotonic() + timeout
    outputs: list[list[str]] = [[] for _ in jobs]
    procs: list[subprocess.Popen] = []
    threads = []

    def drain(i: int, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            outputs[i].append(line)
            if i == 0 and progress is not None and line.startswith("  "):
                progress(line.rstrip())

    late = False
    try:
        # Every process first, then the threads that read them: no thread runs while a child is
        # between fork and exec (see spawn).
        for cmd, env in jobs:
            procs.append(spawn(cmd, env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True))
        for i, proc in enumerate(procs):
            threads.append(threading.Thread(target=drain, args=(i, proc), daemon=True))
            threads[-1].start()
        for proc in procs:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        late = True
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for t in threads:
            t.join(timeout=10)
    tail = "".join(line for out in outputs for line in out[-40:])
    if late:
        raise RuntimeError(f"{what} did not finish in {timeout:g} s (killed):\n{tail}")
    codes = [p.returncode for p in procs]
    if any(codes):
        raise RuntimeError(f"{what} failed (exit status {codes}):\n{tail}")


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
