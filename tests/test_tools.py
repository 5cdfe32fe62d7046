"""tools/gpu-check.sh, the GPU checks' one command, as far as a machine without a GPU runs it."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "tools" / "gpu-check.sh"


def _run(*args, env=None):
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=120, env={**os.environ, **(env or {})})


def test_gpu_check_refuses_unknown_steps_before_it_starts(tmp_path):
    assert _run().returncode == 2
    r = _run(str(tmp_path / "out"), "tests", "benchmarks")
    assert r.returncode == 2 and "unknown step: benchmarks" in r.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_gpu_check_without_a_gpu_says_so_and_runs_no_step(tmp_path):
    r = _run(str(tmp_path), "tests", env={"GPU_CHECK_PYTHON": sys.executable,
                                          "GPU_CHECK_WHEELS": str(tmp_path)})
    assert r.returncode == 1, r.stdout + r.stderr
    log = (tmp_path / "gpu-check.log").read_text()
    assert "no CUDA device: these are the GPU checks" in log
    assert "## setup: failed" in log and "## tests" not in log
    assert not (tmp_path / "gpu-check.tar.gz").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_gpu_check_restores_a_carried_triton_cache_first(tmp_path):
    """A triton-cache.tgz among the carried wheels is unpacked into Triton's cache before the
    CUDA check, so a fresh machine finds the kernels an earlier run compiled."""
    import tarfile

    wheels, cache = tmp_path / "whl", tmp_path / "cache"
    (wheels / "src").mkdir(parents=True)
    (wheels / "src" / "kernel.cubin").write_bytes(b"compiled")
    with tarfile.open(wheels / "triton-cache.tgz", "w:gz") as tar:
        tar.add(wheels / "src" / "kernel.cubin", arcname="ab12/kernel.cubin")
    r = _run(str(tmp_path / "out"), "tests", env={
        "GPU_CHECK_PYTHON": sys.executable, "GPU_CHECK_WHEELS": str(wheels),
        "TRITON_CACHE_DIR": str(cache)})
    assert r.returncode == 1, r.stdout + r.stderr
    assert (cache / "ab12" / "kernel.cubin").read_bytes() == b"compiled"
    assert "triton cache restored" in (tmp_path / "out" / "gpu-check.log").read_text()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_gpu_check_restores_a_cache_carried_in_parts(tmp_path):
    """The cache a run leaves in OUT comes in parts of 15 MiB (a lent machine hands back files
    of at most 16 MiB): the parts, joined in name order, are restored as one archive."""
    import io
    import tarfile

    wheels, cache = tmp_path / "whl", tmp_path / "cache"
    wheels.mkdir()
    payload = os.urandom(3000)  # incompressible: the archive is larger than its first part
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        info = tarfile.TarInfo("cd34/kernel.cubin")
        info.size = len(payload)
        tar.addfile(info, io.BytesIO(payload))
    archive = buf.getvalue()
    (wheels / "triton-cache.tgz.part-aa").write_bytes(archive[:1000])
    (wheels / "triton-cache.tgz.part-ab").write_bytes(archive[1000:])
    r = _run(str(tmp_path / "out"), "tests", env={
        "GPU_CHECK_PYTHON": sys.executable, "GPU_CHECK_WHEELS": str(wheels),
        "TRITON_CACHE_DIR": str(cache)})
    assert r.returncode == 1, r.stdout + r.stderr
    assert (cache / "cd34" / "kernel.cubin").read_bytes() == payload


def test_gpu_check_leaves_its_cache_in_parts_a_lent_machine_hands_back(tmp_path):
    """The cache goes back in parts of at most 16 MiB, which the next run restores whole. A
    stand-in Python that succeeds at everything plays the GPU machine's."""
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\nexit 0\n")
    fake.chmod(0o755)
    cache, out = tmp_path / "cache", tmp_path / "out"
    (cache / "ef56").mkdir(parents=True)
    payload = os.urandom(17 << 20)  # incompressible: two parts
    (cache / "ef56" / "kernel.cubin").write_bytes(payload)
    r = _run(str(out), "profile", env={"GPU_CHECK_PYTHON": str(fake),
                                        "GPU_CHECK_WHEELS": str(tmp_path / "none"),
                                        "TRITON_CACHE_DIR": str(cache)})
    assert r.returncode == 0, r.stdout + r.stderr
    parts = sorted(out.glob("triton-cache.tgz.part-*"))
    assert [p.name[-2:] for p in parts] == ["aa", "ab"]
    assert all(p.stat().st_size <= 16 << 20 for p in parts)
    again = tmp_path / "cache2"
    r = _run(str(tmp_path / "out2"), "profile", env={"GPU_CHECK_PYTHON": str(fake),
                                                      "GPU_CHECK_WHEELS": str(out),
                                                      "TRITON_CACHE_DIR": str(again)})
    assert r.returncode == 0, r.stdout + r.stderr
    assert (again / "ef56" / "kernel.cubin").read_bytes() == payload


def _recording_python(tmp_path, xdist: bool) -> tuple[Path, Path]:
    # A stand-in Python that succeeds at everything and writes each command line to a file;
    # `-c "import xdist"` fails unless `xdist`.
    fake, calls = tmp_path / "python", tmp_path / "calls"
    refuse = "" if xdist else '[ "$1" = "-c" ] && [ "$2" = "import xdist" ] && exit 1\n'
    fake.write_text(f'#!/bin/sh\necho "$*" >> "{calls}"\n{refuse}exit 0\n')
    fake.chmod(0o755)
    return fake, calls


@pytest.mark.parametrize(("xdist", "workers", "expected"), [
    (True, None, "-m pytest -n 8 -v"), (True, "3", "-m pytest -n 3 -v"),
    (True, "1", "-m pytest -v"), (False, None, "-m pytest -v")])
def test_gpu_check_runs_the_cuda_tests_in_processes_where_xdist_is_there(
        tmp_path, xdist, workers, expected):
    """The tests step compiles its kernels in GPU_CHECK_WORKERS processes (8 unless told) when
    pytest-xdist imports, and in one process otherwise, saying which."""
    fake, calls = _recording_python(tmp_path, xdist)
    env = {"GPU_CHECK_PYTHON": str(fake), "GPU_CHECK_WHEELS": str(tmp_path / "none"),
           "TRITON_CACHE_DIR": str(tmp_path / "cache")}
    if workers is not None:
        env["GPU_CHECK_WORKERS"] = workers
    r = _run(str(tmp_path / "out"), "tests", env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    runs = [line for line in calls.read_text().splitlines() if "-m pytest" in line]
    assert len(runs) == 1 and runs[0].startswith(expected), runs
    assert runs[0].endswith("tests/test_cuda.py")
    log = (tmp_path / "out" / "gpu-check.log").read_text()
    if workers == "1":
        assert "processes" not in log and "one process" not in log
    else:
        assert (f"tests run in {workers or 8} processes (pytest-xdist)" in log) == xdist
        assert ("pytest-xdist is not installed" in log) == (not xdist)


def test_gpu_check_asks_about_xdist_only_for_the_tests_step(tmp_path):
    fake, calls = _recording_python(tmp_path, True)
    r = _run(str(tmp_path / "out"), "profile", env={
        "GPU_CHECK_PYTHON": str(fake), "GPU_CHECK_WHEELS": str(tmp_path / "none"),
        "TRITON_CACHE_DIR": str(tmp_path / "cache")})
    assert r.returncode == 0, r.stdout + r.stderr
    assert "import xdist" not in calls.read_text()
    assert "-n 8" not in calls.read_text()


def test_gpu_check_refuses_a_worker_count_that_is_not_a_number(tmp_path):
    r = _run(str(tmp_path / "out"), "tests", env={"GPU_CHECK_WORKERS": "eight"})
    assert r.returncode == 2 and "GPU_CHECK_WORKERS" in r.stderr
    assert not (tmp_path / "out").exists()


def test_gpu_check_runs_the_codecs_benchmark_as_often_as_told_each_into_its_folder(tmp_path):
    fake, calls = _recording_python(tmp_path, True)
    env = {"GPU_CHECK_PYTHON": str(fake), "GPU_CHECK_WHEELS": str(tmp_path / "none"),
           "TRITON_CACHE_DIR": str(tmp_path / "cache")}
    r = _run(str(tmp_path / "out"), "codecs", env={**env, "GPU_CHECK_CODECS_RUNS": "3"})
    assert r.returncode == 0, r.stdout + r.stderr
    runs = [line for line in calls.read_text().splitlines() if "bench codecs" in line]
    assert [line.split("--out ")[1].rsplit("/", 1)[1] for line in runs] == [
        "codecs-run1", "codecs-run2", "codecs-run3"]
    log = (tmp_path / "out" / "gpu-check.log").read_text()
    assert all(f"## codecs {i}: ok" in log for i in (1, 2, 3))
    assert "bench tally" not in calls.read_text()  # no run left a result to tally
    calls.unlink()
    r = _run(str(tmp_path / "out2"), "codecs", env=env)  # twice unless told
    assert r.returncode == 0, r.stdout + r.stderr
    assert calls.read_text().count("bench codecs") == 2
    for bad in ("0", "two", "-1"):
        r = _run(str(tmp_path / "out3"), "codecs", env={**env, "GPU_CHECK_CODECS_RUNS": bad})
        assert r.returncode == 2 and "GPU_CHECK_CODECS_RUNS" in r.stderr, bad


def test_gpu_check_pins_every_second_codecs_run_to_the_cpu_it_is_told(tmp_path):
    """GPU_CHECK_CODECS_PIN=N: runs 2 and 4 run on CPU N alone (or a list of CPUs, as taskset
    takes it), runs 1 and 3 on every CPU the script may use, so that one call compares the
    two; a value that is not a CPU list is refused before anything runs."""
    allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if len(allowed) < 2:
        pytest.skip("needs two CPUs to tell a pinned run from a free one")
    fake, calls = tmp_path / "python", tmp_path / "calls"
    # a stand-in that records its command and the CPUs it may run on
    fake.write_text(f'#!/bin/sh\nc=$(grep Cpus_allowed_list /proc/$$/status)\n'
                    f'echo "$* | ${{c##*:}}" >> "{calls}"\nexit 0\n')
    fake.chmod(0o755)
    env = {"GPU_CHECK_PYTHON": str(fake), "GPU_CHECK_WHEELS": str(tmp_path / "none"),
           "TRITON_CACHE_DIR": str(tmp_path / "cache"), "GPU_CHECK_CODECS_RUNS": "4",
           "GPU_CHECK_CODECS_PIN": str(allowed[-1])}
    r = _run(str(tmp_path / "out"), "codecs", env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    cpus = [line.split("|")[1].strip() for line in calls.read_text().splitlines()
            if "bench codecs" in line]
    assert len(cpus) == 4
    assert cpus[1] == cpus[3] == str(allowed[-1]) and cpus[0] == cpus[2] != cpus[1], cpus
    log = (tmp_path / "out" / "gpu-check.log").read_text()
    assert f"## codecs 2 (at most 90s): taskset -c {allowed[-1]} " in log
    calls.unlink()  # a list of CPUs, as taskset takes it
    r = _run(str(tmp_path / "out2"), "codecs", env={
        **env, "GPU_CHECK_CODECS_RUNS": "2", "GPU_CHECK_CODECS_PIN": f"{allowed[0]},{allowed[-1]}"})
    assert r.returncode == 0, r.stdout + r.stderr
    cpus = [line.split("|")[1].strip() for line in calls.read_text().splitlines()
            if "bench codecs" in line]
    assert cpus[1] in (f"{allowed[0]},{allowed[-1]}", f"{allowed[0]}-{allowed[-1]}"), cpus
    for bad in ("one", "-1", "2,", "1;2"):
        r = _run(str(tmp_path / "bad"), "codecs", env={**env, "GPU_CHECK_CODECS_PIN": bad})
        assert r.returncode == 2 and "GPU_CHECK_CODECS_PIN" in r.stderr, bad
    assert not (tmp_path / "bad").exists()


def test_gpu_check_tallies_the_codecs_runs_that_left_a_result(tmp_path):
    """After the codecs runs, `bench tally` over the runs whose folder holds a result (a run
    cut off or failed leaves none), into the results."""
    fake, calls = tmp_path / "python", tmp_path / "calls"
    # a stand-in that records its command and, for the second run alone, leaves a result
    fake.write_text(f'#!/bin/sh\necho "$*" >> "{calls}"\n'
                    'case "$*" in *"bench codecs"*codecs-run2) out="${*##* }"; '
                    'mkdir -p "$out"; echo {} > "$out/codecs-cuda.json";; esac\nexit 0\n')
    fake.chmod(0o755)
    r = _run(str(tmp_path / "out"), "codecs", env={
        "GPU_CHECK_PYTHON": str(fake), "GPU_CHECK_WHEELS": str(tmp_path / "none"),
        "TRITON_CACHE_DIR": str(tmp_path / "cache"), "GPU_CHECK_CODECS_RUNS": "3"})
    assert r.returncode == 0, r.stdout + r.stderr
    [tally] = [line for line in calls.read_text().splitlines() if "bench tally" in line]
    folders = tally.split("bench tally ")[1].split(" --out ")
    assert [Path(f).name for f in folders[0].split()] == ["codecs-run2"], tally
    assert "## codecs tally: ok" in (tmp_path / "out" / "gpu-check.log").read_text()


def test_gpu_check_logs_the_gpus_clocks_beside_the_results_and_stops_the_logger(tmp_path):
    """A stand-in nvidia-smi that writes a line every 0.1 s: its lines end up in the results'
    archive, and it is not left running."""
    import re
    import tarfile

    fake, _ = _recording_python(tmp_path, True)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text('#!/bin/sh\n[ "$1" = "-L" ] && { echo "GPU 0: stand-in"; exit 0; }\n'
                   'echo "timestamp, clocks.current.sm [MHz]"\n'
                   'for i in $(seq 600); do echo "t$i, 1980 MHz"; sleep 0.1; done\n')
    smi.chmod(0o755)
    out = tmp_path / "out"
    r = _run(str(out), "profile", env={
        "GPU_CHECK_PYTHON": str(fake), "GPU_CHECK_WHEELS": str(tmp_path / "none"),
        "TRITON_CACHE_DIR": str(tmp_path / "cache"),
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"})
    assert r.returncode == 0, r.stdout + r.stderr
    log = (out / "gpu-check.log").read_text()
    [pid] = re.findall(r"GPU clocks every 0.5 s into gpu-clocks.csv \(pid (\d+)\)", log)
    with pytest.raises(ProcessLookupError):
        os.kill(int(pid), 0)
    with tarfile.open(out / "gpu-check.tar.gz") as tar:
        clocks = tar.extractfile("./gpu-clocks.csv").read().decode()
    assert clocks.startswith("timestamp, clocks.current.sm [MHz]\n")


def test_gpu_check_profiles_the_top_k_again_without_the_replays(tmp_path):
    """The profile step runs the profile, then the top-k's and RedSync's calls again with
    BITCOMM_PLANS=0 into no-replays/ (the replays' saving of the host's time, measured on
    the lent machine itself) and with COUNT_STAGES=3 into count-stages3/ (their count pass
    with three tiles' loads in flight, against the first run's)."""
    fake, calls = tmp_path / "python", tmp_path / "calls"
    fake.write_text(f'#!/bin/sh\necho "plans=${{BITCOMM_PLANS-}} $*" >> "{calls}"\nexit 0\n')
    fake.chmod(0o755)
    r = _run(str(tmp_path / "out"), "profile", env={
        "GPU_CHECK_PYTHON": str(fake), "GPU_CHECK_WHEELS": str(tmp_path / "none"),
        "TRITON_CACHE_DIR": str(tmp_path / "cache")})
    assert r.returncode == 0, r.stdout + r.stderr
    runs = [line for line in calls.read_text().splitlines() if "bench profile" in line]
    assert len(runs) == 3, runs
    assert runs[0].startswith("plans= ") and "--codecs" not in runs[0]
    assert runs[1].startswith("plans=0 ") and "--codecs topk-1%,redsync-1%" in runs[1]
    assert runs[1].endswith("/no-replays")
    assert runs[2].startswith("plans= ") and "--codecs topk-1%,redsync-1%" in runs[2]
    assert "--set COUNT_STAGES=3" in runs[2] and runs[2].endswith("/count-stages3")
    log = (tmp_path / "out" / "gpu-check.log").read_text()
    assert "## profile: ok" in log and "## profile without replays: ok" in log
    assert "## profile, count pass pipelined: ok" in log
