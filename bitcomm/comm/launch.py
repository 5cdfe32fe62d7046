"""Start a job of N ranks, find out which rank this process is, and build its Comm.

Three transports, one convention. ``"mpi"`` runs the command under an MPI launcher
(``python -m mpi4py``, so an exception on one rank aborts all of them instead of leaving the
others blocked): the one given (``launcher="mpirun"``, ``"srun --mpi=pmix"``, a path), else
``$BITCOMM_LAUNCHER``, else the ``mpiexec`` next to this Python (the ``[mpi]`` extra's MPICH),
else ``mpiexec`` or ``mpirun`` from ``PATH``; a hostfile is passed through (``--hostfile`` to
mpiexec/mpirun, ``SLURM_HOSTFILE`` to srun). ``"gloo"`` and ``"nccl"`` start N processes on
this machine with ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE`` and ``BITCOMM_STORE`` (a file-store
path for ``torch.distributed``), and ``OMP_NUM_THREADS=1`` unless it is set (torchrun's
default); across machines, start them with ``torchrun`` instead. A rank
then calls :func:`world` with the same transport name.

:func:`launched` reads which rank this process is from whatever started it: torchrun (and this
module), MPICH/Intel MPI (``PMI_RANK``), Open MPI (``OMPI_COMM_WORLD_RANK``), MVAPICH
(``MV2_COMM_WORLD_RANK``), PMIx (``PMIX_RANK``) or a Slurm step (``SLURM_PROCID``). A gloo or
NCCL world rendezvouses at ``BITCOMM_STORE`` when set, else at torchrun's ``MASTER_ADDR`` and
``MASTER_PORT`` (``env://``), which mpirun or srun users export themselves.

Example::

    with job_dir("mine") as tmp:
        run_job(commands(4, "gloo", [sys.executable, "-m", "my.worker"], tmp), timeout=600,
                what="my job")
    # in my.worker:  comm = world("gloo")
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import dataclasses
import datetime
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

from bitcomm.comm.base import Comm

__all__ = ["TRANSPORTS", "CPU_TRANSPORTS", "Launched", "commands", "finish", "job_dir",
           "launched", "find_launcher", "leaked_job_dirs", "mpiexec", "remove_leaked_job_dirs",
           "run_job", "spawn", "world"]

TRANSPORTS = ("mpi", "gloo", "nccl")
"""Transport names :func:`commands` and :func:`world` accept."""

CPU_TRANSPORTS = ("mpi", "gloo")
"""The transports that carry CPU tensors (NCCL carries CUDA tensors only)."""


def commands(ranks: int, transport: str, argv: list[str], store_dir: str | os.PathLike, *,
             launcher: str | None = None, hostfile: str | os.PathLike | None = None
             ) -> list[tuple[list[str], dict[str, str]]]:
    """Return ``(command, environment)`` pairs that start ``argv`` as a job of ``ranks`` ranks.

    ``argv`` starts with the Python interpreter; ``store_dir`` is a directory that outlives the
    job (the gloo file store goes there). MPI gives one launcher command, gloo and NCCL one
    process per rank on this machine.

    Args:
        ranks: processes in the job.
        transport: one of :data:`TRANSPORTS`.
        argv: the command every rank runs.
        store_dir: where the gloo/NCCL file store goes.
        launcher: MPI only: the launcher command (see :func:`find_launcher`).
        hostfile: MPI only: a hostfile for the launcher.

    Raises:
        ValueError: an unknown transport, ``ranks < 1``, a launcher or hostfile with gloo or
            NCCL, or a hostfile that does not exist.
        RuntimeError: MPI was asked for and no launcher was found.

    """
    if transport not in TRANSPORTS:
        raise ValueError(f"expected transport in {TRANSPORTS}, got {transport!r}")
    if ranks < 1:
        raise ValueError(f"expected ranks >= 1, got {ranks}")
    env = dict(os.environ)
    if transport == "mpi":
        words = find_launcher(launcher)
        count = ["--ntasks", str(ranks)] if _is_srun(words) else ["-n", str(ranks)]
        if hostfile is not None:
            if not Path(hostfile).is_file():
                raise ValueError(f"expected hostfile to be a file, got {str(hostfile)!r}")
            if _is_srun(words):  # Slurm places the tasks on the file's hosts, in order
                env["SLURM_HOSTFILE"] = str(hostfile)
                count.append("--distribution=arbitrary")
            else:
                count = ["--hostfile", str(hostfile), *count]
        return [([*words, *count, argv[0], "-m", "mpi4py", *argv[1:]], env)]
    if launcher is not None or hostfile is not None:
        raise ValueError(f"launcher and hostfile are for the mpi transport; {transport} starts "
                         "its ranks on this machine (use torchrun across machines)")
    env.update(WORLD_SIZE=str(ranks), BITCOMM_STORE=str(Path(store_dir) / "store"))
    # As torchrun does: several ranks on one machine, each with a thread per core, oversubscribe
    # it (measured: a blocking DDP hook's step took 2.4x its time with one thread per rank).
    env.setdefault("OMP_NUM_THREADS", "1")
    return [(list(argv), dict(env, RANK=str(r), LOCAL_RANK=str(r))) for r in range(ranks)]


def _is_srun(words: list[str]) -> bool:
    return Path(words[0]).name == "srun"


def find_launcher(spec: str | None = None) -> list[str]:
    """Return the MPI launcher command as a list of words.

    ``spec`` (or, without it, ``$BITCOMM_LAUNCHER``) is a command line such as ``"mpirun"``,
    ``"srun --mpi=pmix"`` or a path; its first word is looked up on ``PATH`` unless it is a
    path. Without either: the ``mpiexec`` next to this Python (the ``[mpi]`` extra's MPICH, which
    mpi4py also loads first), else ``mpiexec`` or ``mpirun`` on ``PATH``.

    Raises:
        ValueError: the launcher named is not an executable file.
        RuntimeError: none was named and none was found.

    """
    spec = spec if spec is not None else os.environ.get("BITCOMM_LAUNCHER") or None
    if spec is not None:
        words = shlex.split(spec)
        found = shutil.which(words[0]) if words else None
        if found is None:
            raise ValueError(f"expected the launcher {spec!r} to name an executable (on PATH "
                             "or a path)")
        return [found, *words[1:]]
    bundled = Path(sys.executable).with_name("mpiexec")
    if bundled.exists():
        return [str(bundled)]
    for name in ("mpiexec", "mpirun"):
        found = shutil.which(name)
        if found is not None:
            return [found]
    raise RuntimeError(f"expected an MPI launcher: none next to {sys.executable} and no "
                       "mpiexec or mpirun on PATH; install the mpi extra (pip install "
                       "'bitcomm[mpi]'), load your cluster's MPI, or name one (--launcher)")


def mpiexec() -> str:
    """Return the ``mpiexec`` next to this Python (the mpi extra's MPICH).

    The emulator needs this one: its ranks find their network namespace from MPICH's
    ``PMI_RANK`` and its settings are MPICH's.

    Raises:
        RuntimeError: there is none.

    """
    path = Path(sys.executable).with_name("mpiexec")
    if not path.exists():
        raise RuntimeError(f"expected mpiexec next to {sys.executable}; install the mpi "
                           "extra (pip install 'bitcomm[mpi]')")
    return str(path)


@dataclasses.dataclass(frozen=True)
class Launched:
    """Which rank of which job this process is, as its launcher said.

    Attributes:
        rank: this process's rank.
        size: the number of ranks.
        local_rank: its rank among the ranks on this machine (its GPU, for NCCL).
        launcher: what set the variables (``"torchrun"``, ``"mpich"``, ``"openmpi"``,
            ``"mvapich"``, ``"pmix"``, ``"slurm"``).

    """

    rank: int
    size: int
    local_rank: int
    launcher: str


# (launcher, rank, size, local rank): the first whose rank variable is set wins. RANK comes
# first because torchrun sets it and this module's gloo jobs do; a Slurm step sets SLURM_*
# for an mpirun inside it too, so Slurm comes last.
_RANK_VARIABLES = (
    ("torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK"),
    ("openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
    ("mpich", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),
    ("mvapich", "MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_LOCAL_RANK"),
    ("pmix", "PMIX_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
    ("slurm", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_LOCALID"),
)


def launched(environ: Mapping[str, str] | None = None) -> Launched | None:
    """Return this process's place in a launched job, or None if no launcher started it.

    ``environ`` defaults to ``os.environ``. A Slurm batch script's own shell (no step of
    several tasks) is not a launched rank, so a command run there starts its job itself.

    Raises:
        ValueError: a rank variable is set but no launcher says the job's size, a value is not
            an integer, or the rank is not below the size.

    """
    env = os.environ if environ is None else environ
    sizeless = []
    for name, rank_var, size_var, local_var in _RANK_VARIABLES:
        if rank_var not in env:
            continue
        if name == "slurm" and env.get(size_var, "1").strip() in ("0", "1"):
            return None  # a batch script's shell, or a step of one task: not a launched rank
        if size_var not in env:  # PMIx under srun, say: the next launcher's variables tell
            sizeless.append(f"{rank_var} without {size_var}")
            continue
        try:
            rank, size = int(env[rank_var]), int(env[size_var])
            local = int(env.get(local_var, rank))
        except ValueError:
            raise ValueError(f"expected integers in {rank_var}, {size_var} and {local_var} "
                             f"({name}), got {env.get(rank_var)!r}, {env.get(size_var)!r} and "
                             f"{env.get(local_var)!r}") from None
        if not 0 <= rank < size or local < 0:
            raise ValueError(f"expected 0 <= {rank_var} < {size_var} ({name}), got {rank} "
                             f"and {size}")
        return Launched(rank, size, local, name)
    if sizeless:
        raise ValueError(f"expected a launcher's rank and size, found only {sizeless}")
    return None


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
    """Return this rank's Comm in a launched job (:func:`commands`, torchrun, mpirun, srun).

    ``"mpi"``: MPI's world. ``"gloo"`` and ``"nccl"``: ``torch.distributed``'s default group,
    with the rank and size from :func:`launched`, meeting at ``BITCOMM_STORE`` (a file store)
    or, without it, at ``MASTER_ADDR:MASTER_PORT`` (``env://``, as torchrun sets them); NCCL
    ranks use the GPU ``local_rank`` (modulo the GPUs present). ``timeout`` bounds every gloo
    or NCCL wait (the process group's timeout); MPI has none of its own.

    Raises:
        ValueError: an unknown transport, or no launcher's variables / no rendezvous for gloo
            and NCCL.
        RuntimeError: NCCL without a CUDA device.

    """
    if transport == "mpi":
        from bitcomm.comm.mpi import MPIComm

        return MPIComm()
    if transport not in TRANSPORTS:
        raise ValueError(f"expected transport in {TRANSPORTS}, got {transport!r}")
    me = launched()
    if me is None:
        raise ValueError(f"a {transport} world needs its rank: expected RANK and WORLD_SIZE "
                         "(torchrun, bitcomm's launcher) or an MPI launcher's or Slurm's rank "
                         "variables")
    if "BITCOMM_STORE" in os.environ:
        init = f"file://{os.environ['BITCOMM_STORE']}"
    elif "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ:
        init = "env://"
    else:
        raise ValueError(f"a {transport} world needs a rendezvous: expected BITCOMM_STORE (a "
                         "shared file path) or MASTER_ADDR and MASTER_PORT (torchrun sets them; "
                         f"export them under {me.launcher})")
    import torch
    import torch.distributed as dist

    from bitcomm.comm.torchdist import TorchComm

    if transport == "nccl":
        if not torch.cuda.is_available():
            raise RuntimeError("the nccl transport needs CUDA: torch.cuda.is_available() is "
                               "False here (use gloo)")
        torch.cuda.set_device(me.local_rank % torch.cuda.device_count())
    dist.init_process_group(transport, init_method=init, rank=me.rank, world_size=me.size,
                            timeout=datetime.timedelta(seconds=timeout))
    atexit.register(_leave)
    return TorchComm()


def finish(code: int = 0) -> None:
    """End a rank program whose work is done, with exit status ``code``.

    With a torch.distributed group (gloo, NCCL) the rank leaves it, flushes its output and
    exits at once, skipping the interpreter's teardown: a gloo process can abort there
    ("terminate called without an active exception", SIGABRT: a C++ thread destroyed while
    joinable) after all its work, and its launcher then reports a failed rank. Seen at exit
    in about one run in a dozen to one in three, in the benchmarks', the training
    experiment's and the tests' gloo ranks, even after ``destroy_process_group``: most likely
    objects that still hold the group (a DDP model, optimizers with a communicator) keep its
    threads alive into the teardown. The README's trainer example (``torchrun --standalone
    --nproc-per-node 2``, with three ``yes > /dev/null`` loops on a 2-core machine) aborted in
    2 of 20 runs; in 0 of 30 with this function, and in 0 of 30 with those objects deleted
    before ``destroy_process_group``. Otherwise (MPI, which must finalise; no group) a normal
    ``sys.exit``.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        sys.exit(code)
    _leave()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def _leave() -> None:
    # A process that exits with gloo's threads still running can abort in teardown
    # ("terminate called without an active exception", in about 1 of 12 torchrun runs of the
    # collectives benchmark here), and its launcher then reports a failed rank: leave the group
    # first. Local to this rank; a peer still waiting on it would fail as it would anyway.
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
