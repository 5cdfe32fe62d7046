"""bitcomm.bench.tune: each TUNING entry's neighbours, timed against the code's configuration.

Here the kernels run in Triton's interpreter on CPU tensors (the path forced), so the times mean
nothing; what is tested is which configurations are tried, that each one's output is compared
with the code's, and that the settings are as they were afterwards.
"""

import json

import pytest
import torch
from click.testing import CliRunner

pytest.importorskip("triton", reason="triton (the dev extra) is not installed")

from bitcomm import cli  # noqa: E402
from bitcomm.bench import codecs as bench_codecs  # noqa: E402
from bitcomm.bench import tune  # noqa: E402
from bitcomm.codecs import _kernels  # noqa: E402
from bitcomm.collectives import _kernels as step_kernels  # noqa: E402

from conftest import forced, needs_interpreter  # noqa: E402


@pytest.fixture
def quick(monkeypatch):
    # one timed call a configuration: the interpreter's times say nothing anyway
    monkeypatch.setattr(bench_codecs, "_MIN_SECONDS", 0)


def test_neighbours_are_half_and_twice_the_tile_and_the_warps():
    assert tune.neighbours(1024, 4) == [(512, 4), (2048, 4), (1024, 2), (1024, 8)]
    assert tune.neighbours(8, 1) == [(16, 1), (8, 2)]  # no tile under 8, no warps under 1
    assert tune.neighbours(4096, 16) == [(2048, 16), (8192, 16), (4096, 8)]  # nor over 16


@needs_interpreter
@pytest.mark.triton
def test_each_neighbour_is_timed_against_the_code_and_the_settings_stay(quick, monkeypatch,
                                                                        launched):
    codec_before, step_before = dict(_kernels.TUNING), dict(step_kernels.TUNING)
    # below both sizes: the one program runs only where the benchmark raises it
    monkeypatch.setattr(_kernels, "SMALL_TOP", 16)
    with forced("triton"):
        rows = tune.run(3000, "cpu", repeat=1, only=["qsgd_decode", "count_step", "SMALL_TOP"],
                        small_top_sizes=(64, 300))
    assert _kernels.TUNING == codec_before and step_kernels.TUNING == step_before
    assert _kernels.SMALL_TOP == 16
    assert "_small_top_kernel" in launched and "_key_digits_kernel" in launched  # both paths
    b, w = codec_before["qsgd_decode"]
    s, v = step_before["count_step"]
    assert [(r.setting, r.case, r.tried, r.against) for r in rows] == [
        ("qsgd_decode", "qsgd-4 decode", f"{b // 2}x{w}", f"{b}x{w}"),
        ("qsgd_decode", "qsgd-4 decode", f"{2 * b}x{w}", f"{b}x{w}"),
        ("qsgd_decode", "qsgd-4 decode", f"{b}x{w // 2}", f"{b}x{w}"),
        ("qsgd_decode", "qsgd-4 decode", f"{b}x{2 * w}", f"{b}x{w}"),
        ("count_step", "ring step 6 of 8", f"{s // 2}x{v}", f"{s}x{v}"),
        ("count_step", "ring step 6 of 8", f"{2 * s}x{v}", f"{s}x{v}"),
        ("count_step", "ring step 6 of 8", f"{s}x{v // 2}", f"{s}x{v}"),
        ("count_step", "ring step 6 of 8", f"{s}x{2 * v}", f"{s}x{v}"),
        ("SMALL_TOP", "top-k 1%", "one program", "radix passes"),
        ("SMALL_TOP", "top-k 1%", "one program", "radix passes"),
    ]
    assert [r.n for r in rows] == [3000] * 8 + [64, 300]
    # every tile and warp count gives the code's bytes, and each top-k path the same indices
    assert all(r.same for r in rows)
    assert all(r.seconds > 0 and r.speedup == r.against_seconds / r.seconds for r in rows)


def test_every_tuning_entry_is_swept_or_says_why_not():
    swept, left = set(tune.SETTINGS), set(tune.UNSWEPT)
    assert not swept & left
    assert swept | left == set(_kernels.TUNING) | set(step_kernels.TUNING)


@needs_interpreter
@pytest.mark.triton
def test_every_settings_operation_runs_and_repeats_its_output(monkeypatch):
    """Each operation the sweep times, built at a small size, gives the same output twice
    (the sweep compares configurations by it) and launches Triton kernels (so TUNING
    reaches it)."""
    x = bench_codecs.vector(3001, 0, "cpu")
    names = []
    original = _kernels.launch
    monkeypatch.setattr(_kernels, "launch", lambda kernel, *a, **k: names.append(
        kernel.fn.__name__) or original(kernel, *a, **k))
    with forced("triton"):
        ops = tune._operations(x, x.numel(), 0, set(tune.SETTINGS.values()))
        assert set(ops) == set(tune.SETTINGS.values())
        for case, op in ops.items():
            names.clear()
            first, again = op(), op()
            assert names, case
            assert tune._same(first, again), case


def test_a_configuration_whose_output_differs_is_reported(quick, monkeypatch):
    table = _kernels.TUNING

    def operations(x, n, seed, wanted):  # an output that shows the tile it ran with
        return {case: (lambda: torch.tensor(table["sign_pack"])) for case in wanted}

    monkeypatch.setattr(tune, "_operations", operations)
    before = table["sign_pack"]
    with forced("triton"):
        rows = tune.run(64, "cpu", repeat=1, only=["sign_pack"])
    assert [r.same for r in rows] == [False] * len(tune.neighbours(*before))
    assert table["sign_pack"] == before

    def failing(x, n, seed, wanted):
        def call():
            if table["sign_pack"] != before:
                raise RuntimeError("no such tile")
            return torch.zeros(1)
        return {case: call for case in wanted}

    monkeypatch.setattr(tune, "_operations", failing)
    with forced("triton"), pytest.raises(RuntimeError, match="no such tile"):
        tune.run(64, "cpu", repeat=1, only=["sign_pack"])
    assert table["sign_pack"] == before  # set back after a call that raised


def test_unknown_settings_and_the_torch_path_are_refused_before_any_timing(monkeypatch):
    def no_data(*args, **kwargs):
        raise AssertionError("made a vector")

    with monkeypatch.context() as m:
        m.setattr(torch, "randn", no_data)
        with pytest.raises(ValueError, match=r"unknown setting\(s\) \['sign_pak'\]"):
            tune.run(1 << 26, "cpu", only=["sign_pack", "sign_pak"])
        with pytest.raises(ValueError, match="small_top_sizes >= 1"):
            tune.run(1 << 26, "cpu", only=["SMALL_TOP"], small_top_sizes=(0,))
    with forced("torch"), pytest.raises(RuntimeError, match="Triton's launches"):
        tune.run(64, "cpu", only=["sign_pack"])


def test_markdown_marks_each_settings_best_configuration_that_keeps_the_output():
    def row(setting, tried, speedup, same=True):
        return tune.Row(setting, "sign encode", 1 << 26, tried, "1024x4", 1e-4, speedup * 1e-4,
                        speedup, same)

    rows = [row("sign_pack", "512x4", 1.2), row("sign_pack", "2048x4", 1.5),
            row("sign_pack", "1024x2", 3.0, same=False), row("sign_unpack", "256x4", 0.9)]
    lines = tune.markdown(rows, {"time": "2026-11-26T20:00:00+0000"}, "bitcomm bench tune")
    lines = lines.splitlines()
    assert lines[0] == "- Date: 2026-11-26" and lines[2] == "- Command: `bitcomm bench tune`"
    body = [ln for ln in lines if ln.startswith("| sign")]
    assert body == [
        "| sign_pack | sign encode | 64M | 512x4 | 1024x4 | 100.0 | 120.0 | 1.20 | yes |",
        "| sign_pack | sign encode | 64M | 2048x4 | 1024x4 | 100.0 | 150.0 | **1.50** | yes |",
        "| sign_pack | sign encode | 64M | 1024x2 | 1024x4 | 100.0 | 300.0 | 3.00 | NO |",
        "| sign_unpack | sign encode | 64M | 256x4 | 1024x4 | 100.0 | 90.0 | 0.90 | yes |",
    ]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_the_cli_needs_a_gpu(tmp_path):
    r = CliRunner().invoke(cli.main, ["bench", "tune", "--out", str(tmp_path)])
    assert r.exit_code == 2 and "expected a CUDA device" in r.output


def test_the_cli_saves_after_every_row(tmp_path, monkeypatch):
    monkeypatch.setattr(cli, "_check_device", lambda device: None)
    monkeypatch.setattr(cli, "_machine", lambda device="cpu": {"time": "2026-11-26T20:00"})
    saved = []

    def run(n, device, *, repeat, seed, only, small_top_sizes, progress):
        assert (n, device, repeat, only, small_top_sizes) == (1 << 20, "cuda", 2, ["sign_pack"],
                                                              (4096,))
        for tried, same in (("512x4", True), ("2048x4", False)):
            progress(tune.Row("sign_pack", "sign encode", n, tried, "1024x4", 1.0, 1.0, 1.0,
                              same))
            saved.append(json.loads((tmp_path / "tune-cuda.json").read_text())["rows"])

    monkeypatch.setattr(tune, "run", run)
    bad = CliRunner().invoke(cli.main, ["bench", "tune", "--only", "sign_pack,sign_pak",
                                        "--out", str(tmp_path)])
    assert bad.exit_code == 2 and "unknown setting(s) ['sign_pak']" in bad.output
    assert not (tmp_path / "tune-cuda.json").exists()
    r = CliRunner().invoke(cli.main, ["bench", "tune", "--n", "1M", "--repeat", "2", "--only",
                                      "sign_pack", "--small-top-sizes", "4K", "--out",
                                      str(tmp_path)])
    # a run cut off after its first row would have kept that row
    assert [[row["tried"] for row in rows] for rows in saved] == [["512x4"],
                                                                  ["512x4", "2048x4"]]
    assert r.exit_code == 1 and "other output than the code's: sign_pack 2048x4" in r.output
    md = (tmp_path / "tune-cuda.md").read_text()
    assert "`bitcomm bench tune --n 1M --repeat 2 --seed 0 --only sign_pack " \
           "--small-top-sizes 4K`" in md
