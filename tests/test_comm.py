"""Transport-level behaviour of the in-process Comm: isend, requests, counting, errors."""

import os

import pytest
import torch

from bitcomm.comm import Request, run_local


def _bytes(*values):
    return torch.tensor(values, dtype=torch.uint8)


def test_isend_runs_ahead_of_the_receiver_and_keeps_order():
    # Every rank posts three sends before receiving anything: with blocking sends on a ring
    # this would deadlock; the messages then arrive in the order they were sent.
    def fn(c):
        nxt, prv = (c.rank + 1) % c.size, (c.rank - 1) % c.size
        reqs = [c.isend(_bytes(c.rank, k, k * 7), nxt) for k in range(3)]
        got = [c.recv(torch.empty(3, dtype=torch.uint8), prv).tolist() for _ in range(3)]
        Request.wait_all(reqs)
        return got, c.counters.sent[nxt], c.counters.total_sent

    for r, (got, to_next, total) in enumerate(run_local(fn, 4, timeout=30)):
        prv = (r - 1) % 4
        assert got == [[prv, 0, 0], [prv, 1, 7], [prv, 2, 14]]
        assert to_next == total == 9


def test_isend_copies_at_post_time_for_the_local_transport():
    # The in-process transport takes the bytes when the send is posted, so changing the buffer
    # afterwards (which the API forbids until wait) cannot corrupt what was sent.
    def fn(c):
        if c.rank == 0:
            buf = _bytes(1, 2, 3)
            req = c.isend(buf, 1)
            buf.fill_(0)
            req.wait()
            return None
        return c.recv(torch.empty(3, dtype=torch.uint8), 0).tolist()

    assert run_local(fn, 2, timeout=30)[1] == [1, 2, 3]


def test_request_wait_is_idempotent_and_releases_buffers():
    calls = []
    keep = torch.zeros(4)
    req = Request(lambda: calls.append(1), keep)
    req.wait()
    req.wait()
    assert calls == [1]
    assert req._keep is None
    Request.wait_all([Request(), Request(lambda: calls.append(2))])
    assert calls == [1, 2]


def test_isend_checks_its_arguments():
    def fn(c):
        with pytest.raises(ValueError, match="another rank"):
            c.isend(_bytes(1), c.rank)
        with pytest.raises(ValueError, match="another rank"):
            c.isend(_bytes(1), c.size)
        with pytest.raises(TypeError):
            c.isend(torch.ones(3), 1 - c.rank)
        return c.counters.total_sent

    assert run_local(fn, 2, timeout=30) == [0, 0]


def test_every_primitive_checks_its_arguments_before_sending():
    """A wrong buffer or size list is refused on the rank that passed it, before a byte moves:
    TypeError for what is not a 1-D uint8 tensor, ValueError for sizes that do not fit."""
    def fn(c):
        other = 1 - c.rank
        with pytest.raises(TypeError, match="buf to be a torch.Tensor, got bytes"):
            c.send(b"\x01", other)
        with pytest.raises(TypeError, match="1-D uint8 tensor, got torch.uint8 with shape"):
            c.send(torch.zeros(2, 2, dtype=torch.uint8), other)
        with pytest.raises(ValueError, match="expected 2 buffers and sizes, got 1 and 2"):
            c.alltoallv([_bytes(1)], [1, 1])
        with pytest.raises(ValueError, match=f"sizes\\[{c.rank}\\] = 3, got \\[1, 1\\]"):
            c.allgatherv(_bytes(7, 7, 7), [1, 1])
        with pytest.raises(TypeError, match="x to be a torch.Tensor, got list"):
            c.allreduce([1.0])
        return c.counters.total_sent

    assert run_local(fn, 2, timeout=30) == [0, 0]
    from bitcomm.comm.local import LocalGroup

    with pytest.raises(ValueError, match="rank=2, size=2"):
        LocalGroup(2).comm(2)
    with pytest.raises(ValueError, match="size >= 1, got 0"):
        LocalGroup(0)


def test_a_local_message_of_the_wrong_length_is_refused_by_its_receiver():
    def fn(c):
        if c.rank == 0:
            c.send(_bytes(1, 2, 3, 4, 5), 1)
            c.send(_bytes(1, 2), 1)
            return None
        errors = []
        for _ in range(2):
            with pytest.raises(ValueError) as e:
                c.recv(torch.empty(3, dtype=torch.uint8), 0)
            errors.append(str(e.value))
        return errors

    assert run_local(fn, 2, timeout=30)[1] == ["rank 1 expected 3 bytes from rank 0, got 5",
                                              "rank 1 expected 3 bytes from rank 0, got 2"]


def test_launch_commands_for_each_transport(tmp_path, monkeypatch):
    import sys

    from bitcomm.comm.launch import commands, world

    argv = [sys.executable, "-m", "some.worker", "--flag"]
    jobs = commands(3, "gloo", argv, tmp_path)
    assert [cmd for cmd, _ in jobs] == [argv] * 3
    assert [e["RANK"] for _, e in jobs] == ["0", "1", "2"]
    assert {e["WORLD_SIZE"] for _, e in jobs} == {"3"}
    assert {e["BITCOMM_STORE"] for _, e in jobs} == {str(tmp_path / "store")}
    # one thread per rank unless the caller chose (torchrun's default)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert {e["OMP_NUM_THREADS"] for _, e in commands(2, "gloo", argv, tmp_path)} == {"1"}
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert {e["OMP_NUM_THREADS"] for _, e in commands(2, "gloo", argv, tmp_path)} == {"3"}
    [(cmd, _)] = commands(2, "mpi", argv, tmp_path)
    assert cmd[1:] == ["-n", "2", sys.executable, "-m", "mpi4py", "-m", "some.worker", "--flag"]
    assert cmd[0].endswith("mpiexec")
    with pytest.raises(ValueError, match="transport"):
        commands(2, "tcp", argv, tmp_path)
    with pytest.raises(ValueError, match="mpi transport"):
        commands(2, "gloo", argv, tmp_path, launcher="mpirun")
    with pytest.raises(ValueError, match="ranks"):
        commands(0, "gloo", argv, tmp_path)
    with pytest.raises(ValueError, match="transport"):
        world("tcp")


def _fake(directory, name):
    """An executable ``name`` in ``directory`` (a launcher that is never run)."""
    path = directory / name
    path.write_text("#!/bin/sh\nexit 0\n")
    path.chmod(0o755)
    return str(path)


def test_the_mpi_launcher_is_named_or_found(tmp_path, monkeypatch):
    import sys

    from bitcomm.comm.launch import commands, find_launcher

    bare, bindir = tmp_path / "venv", tmp_path / "bin"
    bare.mkdir()
    bindir.mkdir()
    monkeypatch.delenv("BITCOMM_LAUNCHER", raising=False)
    # no mpiexec next to this Python, none on PATH: a clear error naming the ways out
    monkeypatch.setattr(sys, "executable", str(bare / "python"))
    monkeypatch.setenv("PATH", str(bindir))
    with pytest.raises(RuntimeError, match="--launcher"):
        find_launcher()
    # a cluster's mpirun on PATH (module load openmpi)
    mpirun = _fake(bindir, "mpirun")
    assert find_launcher() == [mpirun]
    # mpiexec is preferred to mpirun, and the one next to this Python to either
    mpiexec = _fake(bindir, "mpiexec")
    assert find_launcher() == [mpiexec]
    bundled = _fake(bare, "mpiexec")
    assert find_launcher() == [bundled]
    # named: an option, or BITCOMM_LAUNCHER; words after the first are kept
    srun = _fake(bindir, "srun")
    assert find_launcher("srun --mpi=pmix") == [srun, "--mpi=pmix"]
    monkeypatch.setenv("BITCOMM_LAUNCHER", "mpirun --bind-to none")
    assert find_launcher() == [mpirun, "--bind-to", "none"]
    with pytest.raises(ValueError, match="'mpprun'"):
        find_launcher("mpprun")
    # the count and the hostfile in each launcher's own words
    hosts = tmp_path / "hosts"
    hosts.write_text("node1 slots=2\nnode2 slots=2\n")
    argv = [sys.executable, "-m", "w"]
    [(cmd, _)] = commands(4, "mpi", argv, tmp_path, launcher="mpirun", hostfile=hosts)
    assert cmd == [mpirun, "--hostfile", str(hosts), "-n", "4", sys.executable, "-m", "mpi4py",
                   "-m", "w"]
    [(cmd, env)] = commands(4, "mpi", argv, tmp_path, launcher="srun --mpi=pmix",
                            hostfile=hosts)
    assert cmd[:4] == [srun, "--mpi=pmix", "--ntasks", "4"]
    assert "--distribution=arbitrary" in cmd and env["SLURM_HOSTFILE"] == str(hosts)
    with pytest.raises(ValueError, match="hostfile"):
        commands(4, "mpi", argv, tmp_path, hostfile=tmp_path / "nope")


@pytest.mark.parametrize(("environ", "expect"), [
    ({}, None),
    ({"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1"}, (1, 4, 1, "torchrun")),
    ({"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
      "PMIX_RANK": "5"}, (5, 8, 1, "openmpi")),
    ({"PMI_RANK": "2", "PMI_SIZE": "3", "MPI_LOCALRANKID": "0"}, (2, 3, 0, "mpich")),
    ({"MV2_COMM_WORLD_RANK": "0", "MV2_COMM_WORLD_SIZE": "2"}, (0, 2, 0, "mvapich")),
    # srun --mpi=pmix: PMIx says the rank, Slurm the size
    ({"PMIX_RANK": "3", "SLURM_PROCID": "3", "SLURM_STEP_NUM_TASKS": "4", "SLURM_LOCALID": "1"},
     (3, 4, 1, "slurm")),
    # a batch script's shell: SLURM_PROCID=0 but no step of several tasks
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "8"}, None),
])
def test_launched_reads_every_common_launcher(environ, expect):
    from bitcomm.comm.launch import launched

    got = launched(environ)
    assert (None if got is None else (got.rank, got.size, got.local_rank, got.launcher)) == expect


def test_launched_refuses_what_it_cannot_use():
    from bitcomm.comm.launch import launched

    with pytest.raises(ValueError, match="PMIX_RANK without"):
        launched({"PMIX_RANK": "0"})
    with pytest.raises(ValueError, match="integers"):
        launched({"RANK": "one", "WORLD_SIZE": "2"})
    with pytest.raises(ValueError, match="0 <= RANK < WORLD_SIZE"):
        launched({"RANK": "2", "WORLD_SIZE": "2"})


def test_a_gloo_world_says_what_it_is_missing(monkeypatch):
    from bitcomm.comm.launch import world

    for var in ("RANK", "WORLD_SIZE", "BITCOMM_STORE", "MASTER_ADDR", "MASTER_PORT",
                "PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID",
                "MV2_COMM_WORLD_RANK"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ValueError, match="needs its rank"):
        world("gloo")
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "0")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="MASTER_ADDR and MASTER_PORT.*openmpi"):
        world("gloo")


def test_run_job_streams_progress_and_reports_failures():
    import sys
    import time

    from bitcomm.comm.launch import run_job

    def job(code):
        return ([sys.executable, "-c", code], dict(os.environ))

    seen = []
    run_job([job("print('  step 1'); print('quiet')"), job("print('  other rank')")],
            timeout=60, what="ok job", progress=seen.append)
    assert seen == ["  step 1"]  # progress lines of the first process only
    with pytest.raises(RuntimeError, match=r"(?s)bad job failed \(exit status \[0, 3\]\).*boom"):
        run_job([job("pass"), job("print('boom'); raise SystemExit(3)")], timeout=60,
                what="bad job")
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"(?s)slow job did not finish in 1 s.*started"):
        run_job([job("print('started', flush=True); import time; time.sleep(60)")], timeout=1,
                what="slow job")
    assert time.monotonic() - t0 < 30  # killed, not waited for


def test_a_failed_rank_does_not_stop_waits_on_ranks_that_are_still_sending():
    # Rank 0 finishes the exchange and fails; rank 1 still waits for rank 2's message, which rank
    # 2 (alive, only slow) sends late. Rank 1 must get it and fail on its own terms, as rank 0
    # did, instead of giving up because some rank failed.
    import time

    def fn(comm):
        if comm.rank == 2:
            put = comm._put

            def slow_to_rank_1(dest, item, blocking=True):
                if dest == 1:
                    time.sleep(0.5)
                put(dest, item, blocking)
            comm._put = slow_to_rank_1
        got = comm.allgatherv(torch.full((4,), comm.rank, dtype=torch.uint8), [4] * 3)
        raise ValueError(f"every rank saw {[int(g[0]) for g in got]}")

    out = run_local(fn, 3, return_exceptions=True, timeout=10)
    assert [str(e) for e in out] == ["every rank saw [0, 1, 2]"] * 3, out


def test_a_gloo_world_is_left_before_the_process_exits(tmp_path):
    """world() leaves its process group at exit: a rank that exits with gloo's threads still
    running can abort in teardown ("terminate called without an active exception"), and its
    launcher then reports a failed rank although the work was done."""
    import subprocess
    import sys

    code = (
        "import atexit\n"
        "import torch.distributed as dist\n"
        "from bitcomm.comm.launch import world\n"
        # registered first, so it runs after any handler world() registers (LIFO)
        "atexit.register(lambda: print('initialised at exit:', dist.is_initialized()))\n"
        "comm = world('gloo', timeout=20)\n"
        "print('size', comm.size)\n")
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    env |= {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
            "BITCOMM_STORE": str(tmp_path / "store")}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert "size 1" in r.stdout and "initialised at exit: False" in r.stdout, r.stdout


def test_finish_ends_a_gloo_rank_without_the_interpreters_teardown(tmp_path):
    """A rank program's end: its output is flushed, its status is the one given, and no
    teardown runs (an atexit handler stands for it), where gloo's threads can abort."""
    import subprocess
    import sys

    def run(body):
        code = ("import atexit\n"
                "from bitcomm.comm.launch import finish, world\n"
                "atexit.register(lambda: print(' teardown ran'))\n" + body)
        env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
        env |= {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
                "BITCOMM_STORE": str(tmp_path / "store")}
        return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                              text=True, timeout=60)

    r = run("comm = world('gloo', timeout=20)\n"
            "print('size', comm.size, end='')\n"  # unflushed: finish must flush it
            "finish(3)\n")
    assert r.returncode == 3, r.stderr
    assert r.stdout == "size 1", r.stdout
    # without a torch.distributed group (MPI must finalise): an ordinary exit
    r = run("print('no group', end='')\nfinish(2)\n")
    assert r.returncode == 2, r.stderr
    assert r.stdout == "no group teardown ran\n", r.stdout


def test_transports_bring_received_parts_back_in_one_copy():
    """A buffer received on the exchange's device comes back as its ranks' parts in one copy
    (to the host from a GPU: one wait, not one a rank); a tensor already on the device is not
    copied at all. The meta device stands in for the other device here."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from bitcomm.comm.base import _moved, _parts

    class Copies(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.__name__.split(".")[0] in ("_to_copy", "copy_"):
                self.ops.append(func.__name__)
            return func(*args, **(kwargs or {}))

    recv = torch.arange(40, dtype=torch.uint8)
    sizes = [8, 0, 20, 12]
    with Copies() as seen:
        parts = _parts(recv, sizes, torch.device("meta"))
    assert len(seen.ops) == 1, seen.ops
    assert [p.numel() for p in parts] == sizes and all(p.device.type == "meta" for p in parts)
    with Copies() as seen:
        here = _parts(recv, sizes, recv.device)
        same = _moved(recv, recv.device)
    assert seen.ops == [] and same is recv
    assert [p.tolist() for p in here] == [recv[:8].tolist(), [], recv[8:28].tolist(),
                                          recv[28:].tolist()]
