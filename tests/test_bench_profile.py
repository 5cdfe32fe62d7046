"""bitcomm.bench.profile: a codec call split into its kernels (here: torch's CPU operators)."""

import json
import math

import pytest
import torch
from click.testing import CliRunner

from bitcomm.bench import profile
from bitcomm.cli import main

from conftest import forced, needs_interpreter


def test_each_call_is_its_kernels_rows_summed():
    with forced("torch"):
        rows = profile.run([4097], codecs=["qsgd-4", "sign"], calls=2)
    calls = [r for r in rows if r.name == profile.CALL]
    assert [(r.codec, r.op) for r in calls] == [("sign", "encode"), ("sign", "decode"),
                                                ("qsgd-4", "encode"), ("qsgd-4", "decode")]
    starts = [i for i, r in enumerate(rows) if r.name == profile.CALL] + [len(rows)]
    for lo, hi in zip(starts, starts[1:], strict=False):
        call, kernels = rows[lo], rows[lo + 1:hi]
        assert kernels
        assert all((r.codec, r.op, r.n) == (call.codec, call.op, 4097) for r in kernels)
        assert math.isclose(call.launches, sum(r.launches for r in kernels))
        assert math.isclose(call.device_us, sum(r.device_us for r in kernels), rel_tol=1e-9)
        # the slowest kernel first; host and wall only on the call's row
        assert [r.device_us for r in kernels] == sorted((r.device_us for r in kernels),
                                                        reverse=True)
        assert 0 < call.host_us <= call.wall_us
        assert all(math.isnan(r.host_us) and math.isnan(r.wall_us) for r in kernels)


def test_host_functions_follow_the_kernels_with_their_calls_a_codec_call():
    from bitcomm.codecs import sign

    rows = profile.run([4097], codecs=["sign"], calls=3, host_functions=40)
    enc = [r for r in rows if r.op == "encode"]
    assert enc[0].name == profile.CALL
    host = [r for r in enc if r.name.startswith(profile.HOST)]
    kernels = [r for r in enc[1:] if not r.name.startswith(profile.HOST)]
    assert kernels and 0 < len(host) <= 40
    assert enc[1:] == kernels + host  # after the kernels, the most own time first
    assert [r.host_us for r in host] == sorted((r.host_us for r in host), reverse=True)
    assert all(math.isnan(r.device_us) and r.host_us >= 0 for r in host)
    # named by function, file and line; counted a codec call (three calls, one pack each)
    line = sign.pack.__code__.co_firstlineno
    [pack] = [r for r in host if r.name == f"{profile.HOST}pack (codecs/sign.py:{line})"]
    assert pack.launches == 1.0
    assert not [r for r in host if "_lsprof" in r.name]  # the profiler's own switch
    # the call's launches and device time stay its kernels' sums; by default no host rows
    assert math.isclose(enc[0].launches, sum(r.launches for r in kernels))
    plain = profile.run([4097], codecs=["sign"], calls=1)
    assert not [r for r in plain if r.name.startswith(profile.HOST)]
    with pytest.raises(ValueError, match="host_functions to be an int >= 0"):
        profile.run([4097], codecs=["sign"], host_functions=-1)


def test_host_functions_that_share_a_name_are_counted_together():
    """Each Triton kernel's launcher is a C function named `__triton_launcher.launch`: two
    functions of one name (here two compiled from one source) count as one row, every call."""
    source = "def f(n):\n    return sum(range(n))\n"
    made = [{}, {}]
    for names in made:
        exec(compile(source, "same.py", "exec"), names)
    first, second = (names["f"] for names in made)
    assert first.__code__ is not second.__code__

    def call():
        first(100)
        second(100)

    spent = profile._host_times(call, 3, torch.device("cpu"))
    assert spent["f (same.py:1)"][0] == 6


def test_an_unknown_codec_or_call_count_is_refused_before_any_work(monkeypatch):
    def no_data(*args, **kwargs):
        raise AssertionError("made a vector")

    monkeypatch.setattr(torch, "randn", no_data)
    with pytest.raises(ValueError, match=r"unknown codec\(s\) \['sgn'\]; expected some of"):
        profile.run([1 << 26], codecs=["sign", "sgn"])
    with pytest.raises(ValueError, match="calls to be an int >= 1"):
        profile.run([1 << 26], calls=0)


def test_the_cli_prints_each_call_and_saves_every_row(tmp_path):
    r = CliRunner().invoke(main, ["bench", "profile", "--sizes", "4K", "--codecs", "sign",
                                  "--calls", "2", "--top", "1", "--out", str(tmp_path)])
    assert r.exit_code == 0, r.output
    lines = [ln for ln in r.output.splitlines() if ln.startswith("    4K")]
    assert [ln.split()[1:3] for ln in lines] == [["sign", "encode"], ["sign", "decode"]]
    saved = json.loads((tmp_path / "profile.json").read_text())
    assert saved["config"]["codecs"] == ["sign"] and saved["config"]["calls"] == 2
    assert [row["name"] for row in saved["rows"]].count(profile.CALL) == 2
    assert not any(row["name"].startswith(profile.HOST) for row in saved["rows"])
    r = CliRunner().invoke(main, ["bench", "profile", "--sizes", "4K", "--codecs", "sign",
                                  "--calls", "2", "--host-functions", "3", "--out",
                                  str(tmp_path)])
    assert r.exit_code == 0, r.output
    saved = json.loads((tmp_path / "profile.json").read_text())
    host = [row for row in saved["rows"] if row["name"].startswith(profile.HOST)]
    assert len(host) == 6 and saved["config"]["host_functions"] == 3  # 3 an operation
    shown = [ln for ln in r.output.splitlines() if profile.HOST in ln and ln[0] != "#"]
    assert [ln.split(profile.HOST, 1)[1] for ln in shown] == [
        row["name"][len(profile.HOST):90] for row in host]
    bad = CliRunner().invoke(main, ["bench", "profile", "--codecs", "nope", "--out",
                                    str(tmp_path)])
    assert bad.exit_code == 2 and "unknown codec(s) ['nope']" in bad.output


@needs_interpreter
def test_a_setting_holds_for_the_run_only(monkeypatch, small_sample):
    """--set changes a selection constant for the run: the top-k's digit passes then take a
    program per CANDIDATE_TILES tiles of the candidates' room (here 1300 keys, tiles of 256),
    and the module's value is back after it. Bad names and values are refused before any
    work, by run and by the CLI."""
    from bitcomm.codecs import _kernels

    monkeypatch.setitem(_kernels.TUNING, "key_digits", (256, 4))
    grids = []
    launch = _kernels.launch

    def spy(kernel, grid, *args, **kwargs):
        if kernel is _kernels._key_digits_kernel:
            grids.append(grid)
        return launch(kernel, grid, *args, **kwargs)

    monkeypatch.setattr(_kernels, "launch", spy)
    with forced("triton"):
        for tiles, programs in ((1, 6), (2, 3), (None, 1)):  # ceil(1300 / (tiles * 256))
            grids.clear()
            profile.run([5000], codecs=["topk-1%"], calls=1,
                        settings=None if tiles is None else {"CANDIDATE_TILES": tiles})
            assert grids and set(grids) == {(programs,)}, (tiles, grids)
    assert _kernels.CANDIDATE_TILES == 8
    for bad, message in (({"TILES": 2}, "unknown setting 'TILES'"),
                         ({"CANDIDATE_TILES": 0}, "CANDIDATE_TILES to be an int >= 1"),
                         ({"SMALL_TOP": True}, "SMALL_TOP to be an int >= 0"),
                         ({"LOCAL_ROOM": -1}, "LOCAL_ROOM to be an int >= 0")):
        with pytest.raises(ValueError, match=message):
            profile.run([1 << 26], settings=bad)
    r = CliRunner().invoke(main, ["bench", "profile", "--set", "CANDIDATE_TILES=x"])
    assert r.exit_code == 2 and "expected NAME=INT" in r.output
    r = CliRunner().invoke(main, ["bench", "profile", "--set", "SLACK=0"])
    assert r.exit_code == 2 and "SLACK to be an int >= 1" in r.output
