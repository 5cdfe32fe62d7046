"""What a plain ``pip install bitcomm`` gets, and what each extra adds (issue: users)."""

import sys
from importlib import metadata

import pytest
import torch
from click.testing import CliRunner


def _requirements():
    core, extras = set(), {}
    for req in metadata.requires("bitcomm"):
        name = req.split(";")[0].split(">")[0].split("=")[0].split("<")[0].strip().lower()
        if "extra ==" in req:
            extra = req.split("extra ==")[1].strip().strip("'\"")
            extras.setdefault(extra, set()).add(name)
        else:
            core.add(name)
    return core, extras


def test_the_core_install_is_what_the_codecs_comm_and_collectives_need():
    core, extras = _requirements()
    assert core == {"torch", "numpy", "click", "pyyaml"}
    assert extras["jit"] == {"numba"} and extras["plots"] == {"matplotlib"}
    assert extras["experiments"] == {"scikit-learn", "matplotlib"}
    assert {"mpi4py", "mpich"} <= extras["mpi"] and "bitarray" in extras["dev"]
    assert extras["mpi-system"] == {"mpi4py"}  # a cluster's own MPI, no MPICH wheel


def test_qsgd_on_the_cpu_without_numba_falls_back_and_names_the_extra(monkeypatch):
    from bitcomm.codecs import qsgd

    x = torch.randn(5000)
    fast = qsgd.encode(x, 4, seed=3)
    monkeypatch.setitem(sys.modules, "numba", None)  # `import numba` now fails
    with pytest.warns(RuntimeWarning, match=r"bitcomm\[jit\]"):
        slow = qsgd.encode(x, 4, seed=3)
    assert torch.equal(slow, fast)  # the torch path writes the same bytes


def test_training_experiments_without_scikit_learn_name_the_extra(monkeypatch, tmp_path):
    from bitcomm.cli import main

    monkeypatch.setitem(sys.modules, "sklearn", None)
    result = CliRunner().invoke(main, ["run", "experiment", "train-digits", "--out",
                                       str(tmp_path / "out")])
    assert result.exit_code != 0 and "pip install 'bitcomm[experiments]'" in result.output
    assert not (tmp_path / "out").exists()  # refused before any work


def test_reports_without_matplotlib_keep_the_results_and_name_the_extra(monkeypatch, tmp_path,
                                                                       capsys):
    from test_topology import _row, base

    from bitcomm.cli import _finish_experiment
    from bitcomm.netem.experiment import analyse
    from bitcomm.netem.topology import from_dict

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    cells = analyse(from_dict(base()), [_row("ring-majority", 2.0, 1.0),
                                        _row("alltoall-majority", 4.0, 1.0)], ncores=2)
    _finish_experiment(cells, {}, tmp_path)
    out = capsys.readouterr()
    assert (tmp_path / "results.json").exists() and (tmp_path / "table.md").exists()
    assert "pip install 'bitcomm[plots]'" in out.out + out.err
    assert not list(tmp_path.glob("*.png"))


def test_the_core_runs_without_any_extra(tmp_path):
    # numba, matplotlib, scikit-learn, mpi4py and bitarray made unimportable in a fresh process
    import subprocess

    code = (
        "import sys\n"
        "for m in ('numba', 'matplotlib', 'sklearn', 'mpi4py', 'bitarray', 'triton'):\n"
        "    sys.modules[m] = None\n"
        "import torch, bitcomm, bitcomm.cli, bitcomm.train, bitcomm.netem, bitcomm.collectives\n"
        "from bitcomm.comm import run_local\n"
        "from bitcomm.collectives import ring_majority\n"
        "x = torch.randn(1000)\n"
        "out = run_local(lambda c: ring_majority(c, x), 2)\n"
        "assert torch.equal(out[0], out[1])\n"
        "sys.argv = ['bitcomm', 'topo', 'show', 'chain-16']\n"
        "bitcomm.cli.main()\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and "topology chain-16: 16 ranks" in r.stdout, r.stderr


@pytest.mark.timeout(200)
def test_the_readme_trainer_example_runs_under_torchrun(tmp_path):
    import subprocess
    from pathlib import Path

    readme = (Path(__file__).parent.parent / "README.md").read_text()
    block = readme[readme.index("In a trainer"):]
    start = block.index("```python\n") + len("```python\n")
    (tmp_path / "example.py").write_text(block[start:block.index("```", start)])
    torchrun = Path(sys.executable).with_name("torchrun")
    r = subprocess.run([str(torchrun), "--standalone", "--nproc-per-node", "2", "example.py"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
