"""The collectives across real processes: MPI (mpiexec + mpi4py) and torch.distributed gloo.

Each run executes tests/mp_worker.py on every rank under a wall-clock limit, so a hang fails
the test instead of stalling the suite.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bitcomm.comm.launch import commands

WORKER = Path(__file__).with_name("mp_worker.py")
MPIEXEC = Path(sys.executable).with_name("mpiexec")
LIMIT = 150  # seconds for one launch, all ranks


def env(base=None):
    e = dict(os.environ if base is None else base)
    e["PYTHONPATH"] = os.pathsep.join([str(WORKER.parent), str(WORKER.parent.parent),
                                       e.get("PYTHONPATH", "")])
    e["OMP_NUM_THREADS"] = "1"  # 8 ranks on 2 cores: no thread oversubscription
    return e


def run_mpi(size, mode):
    if not MPIEXEC.exists():
        pytest.skip(f"mpiexec not installed next to {sys.executable} (pip install 'bitcomm[mpi]')")
    [(cmd, _)] = commands(size, "mpi", [sys.executable, str(WORKER), "mpi", mode], ".")
    return subprocess.run(cmd, capture_output=True, text=True, timeout=LIMIT, env=env())


def run_gloo(size, mode, tmp_path, script=WORKER, kind="torch"):
    """Start ``size`` gloo ranks of ``script`` (mp_worker.py in ``mode``); return codes, output.

    ``kind="nccl"`` makes mp_worker.py's ranks use NCCL instead (same launch, file store).
    """
    args = [str(script)] if script != WORKER else [str(WORKER), kind, mode]
    procs = [subprocess.Popen(cmd, env=env(job_env), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
             for cmd, job_env in commands(size, "gloo", [sys.executable, *args], tmp_path)]
    outs, codes = [], []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=LIMIT)
            outs.append(out)
            codes.append(p.returncode)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return codes, "\n".join(outs)


@pytest.mark.timeout(LIMIT + 30)
@pytest.mark.parametrize("size", [2, 3, 4, 5, 8])
def test_collectives_under_mpiexec(size):
    r = run_mpi(size, "check")
    assert r.returncode == 0, r.stdout + r.stderr
    # ranks share stdout, so lines may run together: find the marks anywhere
    assert sorted(map(int, re.findall(r"OK rank (\d+)", r.stdout))) == list(range(size))


@pytest.mark.timeout(LIMIT + 30)
@pytest.mark.parametrize("size", [2, 3, 4])
def test_collectives_under_gloo(size, tmp_path):
    codes, out = run_gloo(size, "check", tmp_path)
    assert codes == [0] * size, out
    assert all(f"OK rank {i}" in out for i in range(size))


@pytest.mark.timeout(LIMIT + 30)
def test_inconsistent_calls_raise_on_every_mpi_rank():
    r = run_mpi(3, "inconsistent")
    assert r.returncode == 0, r.stdout + r.stderr
    assert sorted(map(int, re.findall(r"OK rank (\d+)", r.stdout))) == [0, 1, 2]


@pytest.mark.timeout(LIMIT + 30)
def test_inconsistent_calls_raise_on_every_gloo_rank(tmp_path):
    codes, out = run_gloo(3, "inconsistent", tmp_path)
    assert codes == [0] * 3, out
    assert all(f"OK rank {i}" in out for i in range(3))


@pytest.mark.timeout(LIMIT + 30)
def test_an_mpi_message_of_the_wrong_length_is_refused_by_its_receiver():
    r = run_mpi(2, "sizes")
    assert r.returncode == 0, r.stdout + r.stderr
    assert sorted(map(int, re.findall(r"OK rank (\d+)", r.stdout))) == [0, 1]


@pytest.mark.timeout(LIMIT + 30)
def test_a_failing_mpi_rank_aborts_the_job():
    r = run_mpi(3, "fault")
    assert r.returncode != 0
    assert "rank 1 fails on purpose at ring step 2" in r.stdout + r.stderr
    assert "OK rank" not in r.stdout


@pytest.mark.timeout(LIMIT + 30)
def test_a_failing_gloo_rank_fails_the_others(tmp_path):
    codes, out = run_gloo(3, "fault", tmp_path)
    assert all(c != 0 for c in codes), out
    assert "rank 1 fails on purpose at ring step 2" in out
    assert "OK rank" not in out


@pytest.mark.timeout(LIMIT + 30)
@pytest.mark.parametrize("transport", ["mpi", "gloo"])
def test_bench_collectives_cli(transport, tmp_path):
    import json

    from bitcomm.collectives import alltoall_majority_bytes, ring_majority_bytes

    if transport == "mpi" and not MPIEXEC.exists():
        pytest.skip("mpiexec not installed (pip install 'bitcomm[mpi]')")
    cmd = [sys.executable, "-m", "bitcomm.cli", "bench", "collectives", "--ranks", "3",
           "--transport", transport, "--sizes", "1000,4K", "--repeat", "1", "--seed", "3",
           "--out", str(tmp_path)]
    e = env()
    for var in ("RANK", "PMI_RANK"):
        e.pop(var, None)
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=LIMIT, env=e)
    assert r.returncode == 0, r.stdout + r.stderr
    data = json.loads((tmp_path / f"collectives-{transport}-3.json").read_text())
    rows = {(row["collective"], row["n"]): row for row in data["rows"]}
    # every registered collective; a byte count off its formula counts as wrong, and the
    # sparse ones' formulas depend on the inputs of --seed
    from bitcomm.collectives import registry

    assert len(rows) == 2 * len(registry.COLLECTIVES)
    assert all(row["wrong"] == 0 for row in rows.values()), rows
    for n in (1000, 4096):
        assert rows[("ring-majority", n)]["wire_bytes"] == max(
            ring_majority_bytes(n, 3, rank) for rank in range(3))
        assert rows[("alltoall-majority", n)]["wire_bytes"] == max(
            alltoall_majority_bytes(n, 3, rank) for rank in range(3))
        assert rows[("alltoall-majority", n)]["speedup_vs_alltoall"] == 1.0
    assert "ring-majority" in r.stdout and "#wrong" in r.stdout
    # nccl-tests' columns: the size in bytes says so, the count is in elements
    header = next(line for line in r.stdout.splitlines() if "collective" in line and "#" not in
                  line.split()[0])
    assert header.split()[:2] == ["size(B)", "count"], header
    row = next(line for line in r.stdout.splitlines() if line.split()[1:3] == ["4096",
                                                                                 "ring-majority"])
    assert row.split()[0] == "16K", row
    # the docs' table: date, machine, the command that re-runs it, a line a row
    md = (tmp_path / f"collectives-{transport}-3.md").read_text().splitlines()
    assert md[2] == (f"- Command: `bitcomm bench collectives --ranks 3 --transport {transport} "
                     "--sizes 1000,4K --repeat 1 --seed 3`")
    lines = {tuple(c.strip() for c in line.split("|")[2:4]): line.split("|")[1:-1]
             for line in md[6:]}
    assert len(lines) == len(rows)
    ring = [c.strip() for c in lines[("4K", "ring-majority")]]
    want = rows[("ring-majority", 4096)]
    assert ring[0] == "3" and ring[5] == str(want["wire_bytes"]) and ring[6] == "0"
    assert ring[3] == (f"{want['seconds'] * 1e3:.1f} [{want['seconds_min'] * 1e3:.1f}, "
                       f"{want['seconds_max'] * 1e3:.1f}]")
    assert lines[("4K", "alltoall-majority")][7].strip() == "1.00"


@pytest.mark.timeout(LIMIT + 30)
@pytest.mark.parametrize("size", [2, 4])
def test_onebit_allreduce_equals_deepspeed(size, tmp_path):
    """Outputs and both error buffers equal DeepSpeed 0.17's compressed_allreduce (4 calls), and
    the one-round allgather form gives the same bits (its server error chunk by chunk)."""
    import importlib.util

    assert importlib.util.find_spec("deepspeed") is not None, (
        "DeepSpeed 0.17.6 is the reference for onebit_allreduce; `make test` installs it "
        "(DS_BUILD_OPS=0 pip install --no-build-isolation deepspeed==0.17.6)")
    codes, out = run_gloo(size, None, tmp_path, script=WORKER.with_name("ds_worker.py"))
    assert codes == [0] * size, out
    assert all(f"OK rank {i}" in out for i in range(size))


@pytest.mark.timeout(LIMIT + 30)
def test_ddp_hooks_train_on_two_gloo_processes(tmp_path):
    codes, out = run_gloo(2, None, tmp_path, script=WORKER.with_name("ddp_worker.py"))
    assert codes == [0, 0], out
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    by = {(r["hook"], r["rank"]): r for r in rows if "hook" in r}
    assert len(by) == 12, out
    for r in by.values():
        assert r["same_on_ranks"], r
        # every hook trains: the loss of the last steps is well below the first step's
        assert r["last"] < 0.5 * r["first"], r
        # after DDP's bucket rebuild the buffers hold each parameter once, in as many buckets
        # as DDP has (not the first iteration's layout as well)
        assert all(h in (0, r["params"]) for h in r["held"]), r
        assert all(b == 2 for b, h in zip(r["buckets"], r["held"], strict=True) if h), r
    views = {(r["bucket_view"], r["rank"]): r["same"] for r in rows if "bucket_view" in r}
    assert len(views) == 8 and all(views.values()), views
    # GradScaler under DDP: rank 1 overflows in one parameter at step 1, and on both ranks every
    # bucket comes back NaN, the step is skipped and the scale halves; the other steps move
    flows = {(r["overflow"], r["rank"]): r for r in rows if "overflow" in r}
    assert len(flows) == 8, out
    for (name, rank), r in flows.items():
        assert [s["all_nan"] for s in r["steps"]] == [False, True, False], r
        assert [s["moved"] for s in r["steps"]] == [True, False, True], r
        assert [s["scale"] for s in r["steps"]] == [256.0, 128.0, 128.0], r
        assert r["digest"] == flows[(name, 1 - rank)]["digest"], r
    # the exchange on the state's thread computes what the blocking hook computes
    same = [r for r in rows if "qsgd_overlap_equals_blocking" in r]
    assert [r["qsgd_overlap_equals_blocking"] for r in same] == [True, True], out
    # rank 1 starts backward 0.5 s late: rank 0's hook returns at once with a pending future
    # (a blocking hook would take the 0.5 s and return a done one), and backward still waits
    timing = {r["rank"]: r for r in rows if "hook_return_s" in r}
    assert timing[0]["hook_return_s"] < 0.2 and not timing[0]["done_at_return"], timing
    assert timing[0]["backward_s"] > 0.3, timing
    # 8-bit qsgd with error feedback is near-lossless: parameters within 0.02 of the fp32 run
    # (stated tolerance in bitcomm.train.hooks) and its final loss within 10%
    for rank in (0, 1):
        q = by[("qsgd8", rank)]
        assert q["max_param_diff"] < 0.02, q
        assert abs(q["last"] - q["base_last"]) < 0.1 * q["base_last"] + 1e-3, q
        # ring and all-to-all give the same majority, hence the same training
        assert by[("sign", rank)]["last"] == by[("sign-alltoall", rank)]["last"]


@pytest.mark.timeout(LIMIT + 30)
def test_bench_hooks_cli(tmp_path):
    import json

    cmd = [sys.executable, "-m", "bitcomm.cli", "bench", "hooks", "--width", "16", "--depth",
           "3", "--steps", "2", "--repeats", "2", "--bucket-mb", "0.0005,25", "--hooks",
           "powerSGD,sign,sign/blocking,topk", "--out", str(tmp_path)]
    e = env()
    for var in ("RANK", "PMI_RANK"):
        e.pop(var, None)
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=LIMIT, env=e)
    assert r.returncode == 0, r.stdout + r.stderr
    data = json.loads((tmp_path / "hooks-gloo-2.json").read_text())
    rows = {(row["hook"], row["bucket_mb"]): row for row in data["rows"]}
    # the anchor and the step without exchange are measured at each size even when not asked
    # for; powerSGD only where the model is one bucket, and its skip is said
    assert sorted(rows) == sorted([(h, mb) for mb in (0.0005, 25.0) for h in (
        "allreduce", "local", "sign", "sign/blocking", "topk")] + [("powerSGD", 25.0)])
    assert data["config"]["repeats"] == 2 and data["config"]["steps"] == 2
    assert "powerSGD skipped at bucket_mb=0.0005" in r.stdout
    # 32*16+16 + 2*(16*16+16) + 17 parameters; 0.0005 MB holds 131 floats, so several
    # buckets; 25 MB holds the model
    assert {row["params"] for row in rows.values()} == {1089}
    assert rows[("allreduce", 25.0)]["buckets"] == 1
    assert rows[("allreduce", 0.0005)]["buckets"] > 1
    assert rows[("local", 0.0005)]["buckets"] == 0  # no_sync: DDP calls no hook
    for (_, mb), row in rows.items():
        assert row["ranks"] == 2 and row["step_ms_min"] <= row["step_ms"] <= row["step_ms_max"]
        assert row["steps"] == 2 * 2  # a row pools the steps of its repeats
        anchor = rows[("allreduce", mb)]["step_ms"]
        assert row["vs_allreduce"] == pytest.approx(row["step_ms"] / anchor)
    assert "vs_allreduce" in r.stdout
    # sign has both forms: the overlap it hid is read off its rows and the local step's
    hid = json.loads((tmp_path / "hooks-gloo-2-overlap.json").read_text())["rows"]
    for o in hid:
        assert o["hook"] == "sign"
        local, blocking, mine = (rows[(h, o["bucket_mb"])]["step_ms"]
                                 for h in ("local", "sign/blocking", "sign"))
        assert o["exchange_ms"] == pytest.approx(blocking - local)
        assert o["hidden_ms"] == pytest.approx(blocking - mine)
    assert len(hid) == sum(rows[("sign/blocking", mb)]["step_ms"] > rows[("local", mb)]["step_ms"]
                           for mb in (0.0005, 25.0))


def _no_launcher_env():
    e = env()
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "BITCOMM_STORE", "PMI_RANK", "MASTER_ADDR",
                "MASTER_PORT", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID",
                "BITCOMM_LAUNCHER"):
        e.pop(var, None)
    return e


def _torchrun(args, nproc=2):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           str(nproc), "-m", "bitcomm.cli", "bench", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=LIMIT,
                          env=_no_launcher_env())


@pytest.mark.timeout(2 * LIMIT + 30)
def test_the_benchmarks_run_under_torchrun(tmp_path):
    """torchrun starts the ranks (RANK, MASTER_ADDR/PORT): the CLI joins its env:// world."""
    r = _torchrun(["collectives", "--transport", "gloo", "--sizes", "1000", "--repeat", "1",
                   "--out", str(tmp_path)])
    assert r.returncode == 0, r.stdout + r.stderr
    data = json.loads((tmp_path / "collectives-gloo-2.json").read_text())
    assert data["config"]["ranks"] == 2
    assert all(row["wrong"] == 0 for row in data["rows"])
    r = _torchrun(["hooks", "--width", "8", "--depth", "1", "--steps", "1", "--bucket-mb", "25",
                   "--hooks", "sign", "--out", str(tmp_path)])
    assert r.returncode == 0, r.stdout + r.stderr
    rows = json.loads((tmp_path / "hooks-gloo-2.json").read_text())["rows"]
    # the no_sync ``local`` row is the floor every benchmark run measures beside the hooks
    assert [row["hook"] for row in rows] == ["allreduce", "local", "sign"]


@pytest.mark.timeout(LIMIT + 30)
def test_bench_collectives_over_nccl(tmp_path):
    """--transport nccl: CUDA inputs, one GPU per rank (one rank: NCCL cannot put two on one)."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: the nccl transport carries CUDA tensors only")
    cmd = [sys.executable, "-m", "bitcomm.cli", "bench", "collectives", "--transport", "nccl",
           "--ranks", "1", "--sizes", "1000", "--repeat", "1", "--out", str(tmp_path)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=LIMIT, env=_no_launcher_env())
    assert r.returncode == 0, r.stdout + r.stderr
    rows = json.loads((tmp_path / "collectives-nccl-1.json").read_text())["rows"]
    assert rows and all(row["wrong"] == 0 for row in rows)


@pytest.mark.timeout(LIMIT + 30)
def test_bench_collectives_through_a_named_launcher_with_a_hostfile(tmp_path):
    """--launcher names the MPI launcher (here a wrapper that logs its arguments, then runs
    MPICH's mpiexec) and --hostfile reaches it."""
    if not MPIEXEC.exists():
        pytest.skip("mpiexec not installed (pip install 'bitcomm[mpi]')")
    log, wrapper = tmp_path / "args", tmp_path / "mympirun"
    wrapper.write_text(f'#!/bin/sh\necho "$@" > {log}\nexec {MPIEXEC} "$@"\n')
    wrapper.chmod(0o755)
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost:2\n")
    cmd = [sys.executable, "-m", "bitcomm.cli", "bench", "collectives", "--ranks", "2",
           "--launcher", str(wrapper), "--hostfile", str(hosts), "--sizes", "1000", "--repeat",
           "1", "--out", str(tmp_path)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=LIMIT, env=_no_launcher_env())
    assert r.returncode == 0, r.stdout + r.stderr
    assert log.read_text().split()[:4] == ["--hostfile", str(hosts), "-n", "2"]
    data = json.loads((tmp_path / "collectives-mpi-2.json").read_text())
    assert all(row["wrong"] == 0 for row in data["rows"])
