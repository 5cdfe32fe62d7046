"""``bitcomm bench kernels``: the Triton kernels compiled for an H100 without one.

The suite runs with ``TRITON_INTERPRET=1`` (kernels are interpreted there), so the compiler
runs in a child process without it.
"""

import csv
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton", reason="triton (the dev extra) is not installed")

from bitcomm.bench import kernels  # noqa: E402
from bitcomm.codecs import _kernels  # noqa: E402

_missing = [why for why in [kernels.available()] if why and "TRITON_INTERPRET" not in why]
pytestmark = pytest.mark.skipif(bool(_missing), reason=f"no offline compiler: {_missing}")


def _compiled_env() -> dict:
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    return env


def _bench(tmp_path, *args):
    return subprocess.run([sys.executable, "-m", "bitcomm.cli", "bench", "kernels", "--out",
                           str(tmp_path), *args], capture_output=True, text=True,
                          env=_compiled_env(), timeout=600)


ODD = (1 << 26) + 3


@pytest.fixture(scope="module")
def every_case(tmp_path_factory):
    """Every kernel configuration at 64M + 3 elements, compiled once: every decoder and ring
    step leaves a partial last tile there, so the last tile's kernels are compiled too."""
    out = tmp_path_factory.mktemp("kernels")
    result = _bench(out, "--n", str(ODD))
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads((out / "kernels-sm90.json").read_text())["rows"]
    return result, rows, out


def test_no_kernel_spills_registers_on_an_h100(every_case):
    # A stack is registers spilled to local memory: the radix decoder's old tile spilled
    # about 5 KB a thread and ran at 0.04 of the HBM read.
    _, rows, _ = every_case
    names = {r["case"] for r in rows}
    assert {"sign decode", "counts-radix-m2 decode", "counts-w16 decode (m=65535)",
            "qsgd-8 encode, bucket 512", "qsgd-2 decode, bucket 512",
            "qsgd-4 decode, bucket 1000", "qsgd-4 mean of 8 frames", "ring last step (decide)",
            "redsync-1% counts of 63 bounds", "top-k 1% fp32", "top-k 1% fp64",
            "top-k 1% bf16, magnitude", "top-k 10% fp32"} <= names
    # the top-k of 1% from the sampled bound, of 10% from two digits
    assert {r["kernel"] for r in rows if r["case"] == "top-k 1% fp32"} == {
        "sample_bound", "count_at_least", "gather", "key_digits", "chosen_counts",
        "chosen_write"}
    assert "gathered_counts" in {r["kernel"] for r in rows if r["case"] == "top-k 10% fp32"}
    edges = {r["kernel"] for r in rows if "EDGE=True" in r["config"]}
    assert edges == {"sign_unpack", "planes_unpack", "radix_unpack", "qsgd_decode",
                     "qsgd_values", "qsgd_mean", "count_step", "vote_count", "sign_error",
                     "weighted_votes", "scaled_signs"}
    assert [(r["case"], r["stack"]) for r in rows if r["stack"]] == []
    assert all(0 < r["registers"] <= 255 for r in rows)


def test_rows_are_printed_and_saved(every_case):
    result, rows, out = every_case
    with open(out / "kernels-sm90.csv") as fh:
        saved = list(csv.DictReader(fh))
    assert [r["case"] for r in saved] == [r["case"] for r in rows]
    for r in rows:
        assert r["case"] in result.stdout
        if r["programs"] == 1:  # a last tile, the one that checks the end, the top-k's
            # sampled bound or the score statistics' totals: no figure per element
            assert "EDGE=True" in r["config"] or r["kernel"] in (
                "sample_bound", "score_totals", "sparse_mean", "small_top"), r
            continue
        if r["kernel"] == "gathered_counts":  # one row of 257 counts a program, not the vector
            assert r["per_element"] < 1 and r["loads"] > 0, r
            continue
        if r["kernel"] == "qsgd_steps" and "8 frames" not in r["case"]:  # one step a bucket
            assert 0 < r["per_element"] < 1 and r["loads"] > 0, r
            continue
        # Every kernel does some work per element and touches memory.
        assert r["per_element"] > 1 and r["loads"] + r["stores"] > 0, r
    # The sign encoder reads 8 float32 elements a byte: far fewer instructions an element than
    # the qsgd encoder's hash and rounding.
    by = {r["case"]: r for r in rows}
    assert by["sign encode fp32"]["per_element"] < by["qsgd-4 encode, bucket 512"]["per_element"]
    # A program of the threshold counts loops over 17 tiles: the code around its tile loop
    # (the atomic additions of its counts) is spread over them, so an element costs less than
    # the program's whole code over one tile of 1024 elements, and more than a tenth of it.
    counts = by["redsync-1% counts of 63 bounds"]
    one_tile = counts["instructions"] * 32 * counts["warps"] / 1024
    assert one_tile / 10 < counts["per_element"] < one_tile


def test_only_filters_cases_and_unknown_names_fail(tmp_path):
    result = _bench(tmp_path, "--only", "sign decode", "--n", "1M")
    assert result.returncode == 0, result.stderr[-2000:]
    rows = json.loads((tmp_path / "kernels-sm90.json").read_text())["rows"]
    assert [r["case"] for r in rows] == ["sign decode"]
    assert rows[0]["programs"] == (1 << 20) // 8 // _kernels.TUNING["sign_unpack"][0]
    result = _bench(tmp_path, "--only", "no such kernel")
    assert result.returncode == 2 and "no case name contains" in result.stderr


def test_processes_give_the_rows_of_one_in_the_cases_order(tmp_path):
    """--jobs 2 compiles the cases in two spawned processes: the same rows, in the same
    order, as one process."""
    got = []
    for jobs in ("1", "2"):
        out = tmp_path / jobs
        result = _bench(out, "--only", "sign", "--n", "1M", "--jobs", jobs)
        assert result.returncode == 0, result.stderr[-2000:]
        got.append(json.loads((out / "kernels-sm90.json").read_text())["rows"])
    assert len(got[0]) > 3 and got[0] == got[1]


def test_interpreted_kernels_cannot_be_compiled(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert "TRITON_INTERPRET" in kernels.available()
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        kernels.run(1 << 10)


_SWEEP = r"""
import json, sys, torch, triton
from bitcomm.bench import kernels
from bitcomm.codecs import _kernels

mode = sys.argv[1]
if mode == "bf16":  # every case's float32 vectors as bfloat16 (an AMP gradient's)
    empty = torch.empty

    def bf16_empty(*a, dtype=None, device=None, **kw):
        if str(device) == "meta" and dtype == torch.float32:
            dtype = torch.bfloat16
        return empty(*a, dtype=dtype, device=device, **kw)

    torch.empty = bf16_empty
launches, refused = [], []
for name, _, launch in kernels.cases(1 << 20):
    try:
        with kernels._recorded() as calls:
            launch()
    except (TypeError, ValueError) as e:  # a wrapper that takes float32 or float64 only
        refused.append([name, type(e).__name__])
        continue
    launches += calls
if mode == "ones":
    with kernels._recorded() as calls:  # an empty vector's frame header: a kernel of its own
        meta = torch.empty(0, device="meta")
        _kernels.qsgd_codes(meta, 4, 512, 7, meta, None,
                            header=(torch.empty(16, dtype=torch.uint8, device="meta"),
                                    bytes(16)))
    launches += calls
done, failed = set(), []
for kernel, _, args, options in launches:
    args, options = list(args), dict(options)
    if mode == "ones":
        for i, (param, value) in enumerate(zip(kernel.params, args)):
            if not param.is_constexpr and type(value) is int:
                args[i] = 1
        for param in kernel.params[len(args):]:
            if not param.is_constexpr and type(options.get(param.name)) is int:
                options[param.name] = 1
    key = (kernel.fn.__name__, repr(sorted(options.items())),
           repr([getattr(a, "dtype", None) for a in args]))
    if key in done:
        continue
    done.add(key)
    try:
        kernels._compile(kernel, tuple(args), options, 90)
    except Exception as e:
        failed.append([kernel.fn.__name__, str(e).splitlines()[:12]])
print(json.dumps({"kernels": sorted({k for k, _, _ in done}), "compiled": len(done),
                  "failed": failed, "refused": refused, "triton": triton.__version__}))
"""

_GPU_TRITON = os.path.join(sys.prefix, "triton-gpu")
"""Triton as the GPU image's torch ships it (`make test` installs it there): it rejects code
that the dev extra's Triton and the interpreter accept."""

TRITONS = [pytest.param(None, id="dev-triton"), pytest.param(_GPU_TRITON, id="gpu-triton")]


def _sweep(mode: str, triton_dir: str | None) -> dict:
    if triton_dir is not None and not os.path.isdir(triton_dir):
        pytest.skip(f"{triton_dir} is missing: `make test` installs the GPU image's triton")
    env = _compiled_env()
    if triton_dir is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [triton_dir, env.get("PYTHONPATH")]))
    result = subprocess.run([sys.executable, "-c", _SWEEP, mode], capture_output=True,
                            text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.splitlines()[-1])
    assert report["failed"] == []
    import triton

    if triton_dir is None:
        assert report["triton"] == triton.__version__
    else:  # the installed one, not the venv's
        installed = {d.name.removesuffix(".dist-info").split("-")[1]
                     for d in os.scandir(triton_dir)
                     if d.name.startswith("triton-") and d.name.endswith(".dist-info")}
        assert installed == {report["triton"]} and report["triton"] != triton.__version__
    return report


@pytest.mark.parametrize("triton_dir", TRITONS)
def test_every_kernel_compiles_with_its_int_arguments_equal_to_one(triton_dir):
    """A launch makes an int argument equal to 1 a compile-time constant, a Python int in the
    kernel: a data word (a header's, k) used as a tensor there fails to compile on a GPU,
    for the rare call whose value is 1, while the interpreter runs it. Every configuration of
    `bench kernels` and the empty frame's header kernel compile with all their ints at 1,
    under the dev extra's Triton and the GPU image's."""
    report = _sweep("ones", triton_dir)
    # every kernel the codecs and collectives launch, but one whose arguments are all
    # pointers and constants (the k-th value's, read from the selection's state)
    from bitcomm.collectives import _kernels as steps

    defined = {name for module in (_kernels, steps) for name in vars(module)
               if name.endswith("_kernel") and name.startswith("_")}
    assert set(report["kernels"]) == defined - {"_kth_value_kernel"}
    assert report["compiled"] > len(defined)


@pytest.mark.parametrize("triton_dir", TRITONS)
def test_every_kernel_compiles_for_bfloat16_inputs(triton_dir):
    """Every case of `bench kernels` with its float32 vectors as bfloat16 compiles, or its
    wrapper refuses them with a TypeError or ValueError: the GPU image's Triton failed on
    16-bit floats where the dev extra's and the interpreter did not (rows of a tile, a
    helper whose branches return different dtypes)."""
    report = _sweep("bf16", triton_dir)
    assert report["compiled"] > 100
    # the wrappers documented as float32 / float64 only
    assert {name for name, _ in report["refused"]} == {
        "momentum fp32", "momentum of bf16", "qsgd-4 mean of 8 frames, residual",
        "top-k 1% fp32, top side, census", "top-k 1% fp32, top side, census, COUNT_STAGES=3",
        "top-k 1% fp32, magnitude, frame, census",
        "top-k 1% fp32, top side, census, mean frame",
        "redsync-1% counts of 63 bounds",
        "redsync-1% statistics, then counts of 6 bounds"}
