import io
import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from click.testing import CliRunner

from bitcomm.cli import Size, SizeList, main


def test_size_parsing():
    assert Size().convert("128K", None, None) == 128 * 1024
    assert Size().convert("16M", None, None) == 16 << 20
    assert Size().convert("1G", None, None) == 1 << 30
    assert Size().convert("4096", None, None) == 4096
    assert SizeList().convert("1K,2M", None, None) == (1024, 2 << 20)
    assert Size().convert("16MiB", None, None) == 16 << 20


@pytest.mark.parametrize("bad", [0, "0", "0K", True, -5, "1.5M", "12Q", ""])
def test_sizes_are_positive_counts_in_one_grammar(bad):
    from bitcomm import _sizes

    with pytest.raises(ValueError, match="expected a size like 4096, 128K, 16M or 1G"):
        _sizes.parse(bad)
    assert [_sizes.human(v) for v in (1 << 30, 3 << 20, 5 << 10, 1000)] == ["1G", "3M", "5K",
                                                                             "1000"]


def test_bad_size_is_a_usage_error(tmp_path):
    result = CliRunner().invoke(main, ["bench", "codecs", "--sizes", "12Q", "--out",
                                       str(tmp_path)])
    assert result.exit_code == 2
    assert "expected a size like 4096, 128K, 16M or 1G, got '12Q'" in result.output


def by_key(rows, codec, op):
    return next(r for r in rows if (r["codec"], r["op"]) == (codec, op))


def test_bench_codecs_prints_and_saves_rows(tmp_path, monkeypatch):
    from bitcomm.bench import codecs as bench_codecs

    # targets judged from 64K here (the CPU's are from 1M): the 64K rows have them, the 1000
    # rows their ratios only
    monkeypatch.setitem(bench_codecs.TARGET_SIZES, "cpu", 1 << 16)
    result = CliRunner().invoke(main, ["bench", "codecs", "--sizes", "64K,1000", "--repeat", "1",
                                       "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    # strict JSON: NaN is not JSON, rows without a ratio say null
    data = json.loads((tmp_path / "codecs.json").read_text(), parse_constant=pytest.fail)
    rows = data["rows"]
    assert by_key(rows, "anchor", "packbits")["ratio"] is None
    # each row with the host's state while it was measured: the probe's median, and (Linux)
    # the thread's preemptions and moves between CPUs meanwhile
    assert all(r["host_probe_seconds"] > 0 for r in rows)
    assert all(isinstance(r["preempted"], int) and r["preempted"] >= 0 for r in rows)
    assert all(isinstance(r["migrated"], int) and r["migrated"] >= 0 for r in rows)
    assert (tmp_path / "codecs.csv").read_text().count("\n") == len(rows) + 1
    codecs = {(r["codec"], r["op"]) for r in rows}
    for name in ("sign", "sign-scaled", "counts-w1", "counts-w4", "counts-radix-m2", "qsgd-2",
                 "qsgd-4", "qsgd-8", "redsync-1%", "topk-1%", "sparse-fp32-1%"):
        assert (name, "encode") in codecs and (name, "decode") in codecs
    for anchor in ("packbits", "unpackbits", "copy"):
        assert ("anchor", anchor) in codecs
    assert all(r["wrong"] == 0 for r in rows)
    by = {(r["codec"], r["op"], r["n"]): r for r in rows}
    for n in (65536, 1000):
        # each ratio from the anchor timed beside the row, which is the anchor its target names
        for (codec, _, size), row in by.items():
            # on the CPU a call's host time is its time
            assert row["host_seconds"] == row["seconds"] > 0, row
            if size == n and codec != "anchor":
                assert row["ratio"] == row["anchor_seconds"] / row["seconds"], row
                assert ("anchor", row["anchor"], n) in by or row["anchor"] == "sign.encode"
        row = by[("sign", "encode", n)]
        assert row["anchor"] == "packbits" and by[("sign", "decode", n)]["anchor"] == "unpackbits"
        assert by[("counts-w2", "encode", n)]["anchor"] == "sign.encode"
        assert by[("counts-w2", "encode", n)]["target"] == (0.5 if n == 65536 else None)
        assert by[("sign", "encode", n)]["target"] == (0.9 if n == 65536 else None)
        assert row["wire_bytes"] == (n + 7) // 8
        assert by[("qsgd-4", "encode", n)]["wire_bytes"] == 14 + 4 * -(-n // 512) + n // 2
    assert "sign" in result.output and "#wrong" in result.output
    # the docs' table: its date, machine and command, then one line a codec operation with the
    # JSON's figures, one column a size
    md = (tmp_path / "codecs.md").read_text().splitlines()
    assert md[0] == f"- Date: {data['config']['time'][:10]}"
    assert md[1].startswith(f"- Machine: {data['config']['machine']}, ")
    assert md[2] == ("- Command: `bitcomm bench codecs --sizes 64K,1000 --repeat 1 --seed 0 "
                     "--device cpu`")
    assert md[4] == "| codec | op | vs | 64K | 1000 | target |"
    table = {tuple(c.strip() for c in line.split("|")[1:3]): line.split("|")[3:-1]
             for line in md[6:]}
    assert set(table) == codecs and len(md) == 6 + len(codecs)
    for (codec, op), (vs, *cells, target) in table.items():
        for n, cell in zip((65536, 1000), cells, strict=True):
            row = by[(codec, op, n)]
            want = f"{row['gbps']:.2f}" if row["ratio"] is None else \
                f"{row['gbps']:.2f} ({row['ratio']:.2f})"
            assert cell.strip() == want, (codec, op, n)
        assert vs.strip() == ("" if codec == "anchor" else by[(codec, op, 1000)]["anchor"])
        assert by[(codec, op, 1000)]["target"] is None
        want = by[(codec, op, 65536)]["target"]
        assert target.strip() == ("" if want is None else f">= {want:.2f} from 64K")
    # a row without a target is neither ok nor a MISS
    printed = {tuple(line.split()[:3]): line for line in result.output.splitlines()}
    assert printed[("64K", "sign", "encode")].endswith((" ok", " MISS"))
    assert printed[("1000", "sign", "encode")].split()[-1] == "packbits"


def test_a_codec_and_its_anchor_are_timed_in_alternation(monkeypatch):
    """The machine slows down threefold after four calls: medians of calls taken one after the
    other would give the anchor the fast calls and the codec the slow ones (a ratio of 1/6);
    alternating, each pair sees the same speed and the ratio is the true 1/2."""
    from bitcomm.bench import codecs as bench_codecs

    clock, order = [0.0], []

    def costing(name, units):
        def fn():
            order.append(name)
            clock[0] += units * (1 if len(order) <= 4 else 3)
        return fn

    monkeypatch.setattr(bench_codecs, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    t, anchor = bench_codecs.time_against(costing("codec", 2.0), costing("anchor", 1.0), 5)
    assert order == ["codec", "anchor"] * 6  # the warm-ups, then five timed pairs
    assert anchor / t == 0.5
    order.clear()
    assert bench_codecs.time_call(costing("codec", 2.0), 3) == 2.0
    assert order == ["codec"] * 4


def test_the_host_probe_runs_just_before_and_after_a_rows_calls(monkeypatch):
    """A row's host probe runs three times before its calls (warm-ups included) and three
    times after, never among them: with a clock that a probe moves by 100, the calls' medians
    stay theirs, and the row's probe is the probes' median."""
    from bitcomm.bench import codecs as bench_codecs

    clock, order, probed = [0.0], [], []

    def costing(name, units):
        def fn():
            order.append(name)
            clock[0] += units
        return fn

    def probe():
        order.append("probe")
        clock[0] += 100.0
        probed.append(100.0 + len(probed))
        return probed[-1]

    monkeypatch.setattr(bench_codecs, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    monkeypatch.setattr(bench_codecs, "host_probe", probe)
    [(t, host), (anchor, _)], state = bench_codecs._measured(
        [costing("codec", 2.0), costing("anchor", 1.0)], 3, torch.device("cpu"))
    assert order == ["probe"] * 3 + ["codec", "anchor"] * 4 + ["probe"] * 3
    assert (t, host, anchor) == (2.0, 2.0, 1.0)
    assert state["host_probe_seconds"] == 102.5  # the median of 100 to 105


def test_a_run_confined_to_some_cpus_says_which(monkeypatch):
    """A benchmark run under taskset (or a cpuset) saves the CPUs it could run on, as Linux
    writes CPU lists, and its table's heading says so; a run free to use every CPU saves
    nothing of the kind."""
    from bitcomm import cli
    from bitcomm.bench import heading

    if not hasattr(os, "sched_getaffinity"):
        pytest.skip("needs os.sched_getaffinity (Linux)")
    allowed = os.sched_getaffinity(0)
    if len(allowed) == (os.cpu_count() or 0):
        assert "affinity" not in cli._machine()
    if len(allowed) > 1:
        cpu = max(allowed)
        try:
            os.sched_setaffinity(0, {cpu})
            config = cli._machine()
        finally:
            os.sched_setaffinity(0, allowed)
        assert config["affinity"] == str(cpu)
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {8, 0, 2, 1, 3, 10, 11})
    config = cli._machine()
    assert config["affinity"] == "0-3,8,10-11"
    assert heading(config, "c")[1].endswith(" threads), run on CPUs 0-3,8,10-11 alone")


def test_the_scheduler_counts_see_a_move_to_another_cpu(monkeypatch):
    """The rows' `migrated` and `preempted` come from Linux's counts for the benchmark's
    thread: a move of the thread to another CPU shows in the first; a system whose files lack
    the fields gives None, not a guess."""
    from bitcomm.bench import codecs as bench_codecs

    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if len(cpus) < 2 or bench_codecs._sched_counts() is None:
        pytest.skip("needs Linux's scheduler statistics and two CPUs to move between")
    allowed = set(cpus)
    try:
        before = bench_codecs._sched_counts()
        for cpu in cpus[:2] * 2:  # each a move: the thread leaves the CPU it is on
            os.sched_setaffinity(0, {cpu})
        after = bench_codecs._sched_counts()
    finally:
        os.sched_setaffinity(0, allowed)
    assert after[1] - before[1] >= 3 and after[0] >= before[0]

    def lacking(name, *args, **kwargs):
        return io.StringIO("voluntary_ctxt_switches: 3\n")

    monkeypatch.setattr(bench_codecs, "open", lacking, raising=False)
    assert bench_codecs._sched_counts() is None


def test_gpu_timing_records_each_end_event_as_the_call_returns(monkeypatch):
    """On a GPU each call's end event is recorded on the stream looked up once before the
    loop: nothing of the timer's (a stream lookup) lies between a call's return and its end
    event, which for a call that waits for the device would be timed as the call's. CUDA's
    calls are stand-ins here; the order of what the loop does is the test."""
    from bitcomm.bench import codecs as bench_codecs

    log, stream = [], object()

    class Event:
        def __init__(self, enable_timing):
            log.append(("new",))

        def record(self, on=None):
            log.append(("record", on is stream))

        def synchronize(self):
            pass

        def elapsed_time(self, end):
            return 1.0

    def lookup(device=None):
        log.append(("lookup",))
        return stream

    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: real_empty(1, dtype=torch.uint8))
    monkeypatch.setattr(bench_codecs, "_flush_bytes", lambda device: 1)
    monkeypatch.setattr(bench_codecs, "_GPU_WARM_SECONDS", 0.0)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lookup)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    bench_codecs._timings([lambda: log.append(("call",))], 3, "cuda")
    assert log.count(("lookup",)) == 1 and log.index(("lookup",)) < log.index(("new",))
    timed = [i for i, e in enumerate(log) if e == ("call",)][1:]  # after the warm-up
    assert len(timed) >= 3
    assert all(log[i + 1] == ("record", True) for i in timed), log  # the end event, at once
    assert all(e == ("record", True) for e in log if e[0] == "record")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
@pytest.mark.parametrize("what", ["codecs", "collectives", "select"])
def test_bench_device_cuda_without_a_gpu_is_a_usage_error(what, tmp_path):
    result = CliRunner().invoke(main, ["bench", what, "--device", "cuda", "--out",
                                       str(tmp_path)])
    assert result.exit_code == 2
    assert "--device cuda: expected a CUDA device" in result.output
    assert not list(tmp_path.iterdir())


def test_bench_select_times_each_selector_beside_topk_on_the_scores_device(monkeypatch):
    """Every selector's time comes from calls alternating with the exact top-k's, timed on
    the device the scores live on (CUDA events there: a host clock alone would time a GPU
    selection's launches, not its work)."""
    from bitcomm.bench import select as bench_select

    seen = []

    def timing(fn, anchor, repeat, device):  # no default device: each call must name it
        seen.append((torch.device(device), repeat))
        return 2.0, 1.0

    monkeypatch.setattr(bench_select, "time_against", timing)
    monkeypatch.setattr(bench_select, "time_call", lambda fn, repeat, device: 1.0)
    rows = bench_select.run([4096], [0.01], ["laplace"], repeat=2)
    assert seen and all(s == (torch.device("cpu"), 2) for s in seen)
    assert len(seen) == len(rows) - 1  # all but the top-k's own row
    for r in rows:
        assert (r.seconds, r.vs_topk) == ((1.0, 1.0) if r.selector == "topk" else (2.0, 0.5))


def test_bench_select_prints_and_saves_every_selector(tmp_path):
    result = CliRunner().invoke(main, ["bench", "select", "--sizes", "8K", "--deltas", "0.01",
                                       "--dists", "laplace,t3", "--repeat", "1", "--out",
                                       str(tmp_path)])
    assert result.exit_code == 0, result.output
    rows = json.loads((tmp_path / "select.json").read_text())["rows"]
    assert (tmp_path / "select.csv").read_text().count("\n") == len(rows) + 1
    by = {(r["dist"], r["selector"], r["mode"]): r for r in rows}
    k = 82  # ceil(0.01 * 8192)
    for dist in ("laplace", "t3"):
        assert by[(dist, "topk", "exact")]["selected"] == k
        assert by[(dist, "topk", "exact")]["vs_topk"] == 1.0
        assert by[(dist, "torch-topk", "exact")]["selected"] == k
        assert by[(dist, "trimmed", "exact")]["selected"] == k  # RedSync's: the same set
        assert k <= by[(dist, "threshold", "search")]["selected"] <= 2 * k
        for name in ("sidco-e", "sidco-p", "sidco-gp"):
            adapted = by[(dist, name, "adapted")]
            assert 1 <= adapted["stages"] <= 7 and 1 <= adapted["best_stages"] <= 7
    # |Laplace| is exponential: one exponential stage and a reused exact threshold hit k
    for key in (("laplace", "sidco-e", "one-stage"), ("laplace", "oktopk-reuse", "reused")):
        assert 0.7 <= by[key]["ratio"] <= 1.3, by[key]
    assert "oktopk-reuse" in result.output
    # the docs' tables: counts over k (SIDCo one stage, adapted [ended] (nearest k)), then
    # times as multiples of the exact top-k's
    md = (tmp_path / "select.md").read_text().splitlines()
    assert md[2] == ("- Command: `bitcomm bench select --sizes 8K --deltas 0.01 --dists "
                     "laplace,t3 --repeat 1 --device cpu`")
    tables = [line.split("|")[1:-1] for line in md if line.startswith("| laplace") or
              line.startswith("| t3")]
    counts, times = tables[:2], tables[2:]
    for dist, cells in zip(("laplace", "t3"), counts, strict=True):
        cells = [c.strip() for c in cells]
        gp_one, gp = by[(dist, "sidco-gp", "one-stage")], by[(dist, "sidco-gp", "adapted")]
        assert cells[:4] == [dist, "0.01", f"{by[(dist, 'threshold', 'search')]['ratio']:.2f}",
                             f"{by[(dist, 'sidco-e', 'one-stage')]['ratio']:.2f}"]
        assert cells[6] == (f"{gp_one['ratio']:.2f} / {gp['ratio']:.2f} [{gp['stages']}] "
                            f"({gp['best_stages']})")
        assert cells[7] == f"{by[(dist, 'oktopk-reuse', 'reused')]['ratio']:.2f}"
    for dist, cells in zip(("laplace", "t3"), times, strict=True):
        top = by[(dist, "topk", "exact")]["seconds"]
        assert cells[2].strip() == f"{top * 1e3:.2f}"
        assert cells[3].strip() == f"{by[(dist, 'torch-topk', 'exact')]['seconds'] / top:.2f}"
        assert cells[9].strip() == f"{by[(dist, 'oktopk-reuse', 'reused')]['seconds'] / top:.2f}"
    bad = CliRunner().invoke(main, ["bench", "select", "--dists", "cauchy", "--out",
                                    str(tmp_path)])
    assert bad.exit_code == 2 and "cauchy" in bad.output
    bad = CliRunner().invoke(main, ["bench", "select", "--deltas", "2", "--out", str(tmp_path)])
    assert bad.exit_code == 2 and "--deltas" in bad.output


def test_bench_volume_keeps_oktopk_within_its_bound_while_the_allgather_grows(tmp_path):
    result = CliRunner().invoke(main, ["bench", "volume", "--ranks", "2,4,8", "--n", "16K",
                                       "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    rows = json.loads((tmp_path / "volume.json").read_text())["rows"]
    by = {(r["ranks"], r["algorithm"]): r for r in rows}
    k = 164  # ceil(0.01 * 16384)
    for p in (2, 4, 8):
        steady = by[(p, "oktopk-steady")]
        assert steady["words"] <= 6 * k * (p - 1) / p, steady
        # RedSync's allgather: k (int32, fp32) pairs in a 17-byte frame to each of P - 1
        # ranks; every rank knows its length (exactly k entries), so no length is sent
        assert by[(p, "topkA")]["max_bytes"] == (p - 1) * (17 + 8 * k)
        recompute = by[(p, "oktopk-recompute")]["max_bytes"]
        amortized = by[(p, "oktopk-amortized")]["mean_bytes"]
        assert steady["mean_bytes"] < amortized < recompute
    assert by[(8, "topkA")]["words"] > 2 * by[(8, "oktopk-steady")]["words"]
    bad = CliRunner().invoke(main, ["bench", "volume", "--ranks", "1", "--out", str(tmp_path)])
    assert bad.exit_code == 2 and "--ranks" in bad.output
    assert (tmp_path / "volume.png").stat().st_size > 0
    # real gradients: skewed index sets, where the paper's balancing pays (its Figure 7)
    pytest.importorskip("sklearn", reason="the digits data need the experiments extra")
    result = CliRunner().invoke(main, ["bench", "volume", "--ranks", "4", "--inputs", "digits",
                                       "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    rows = json.loads((tmp_path / "volume-digits.json").read_text())["rows"]
    by = {r["algorithm"]: r for r in rows}
    assert by["oktopk-steady"]["n"] == 76810
    assert by["oktopk-even"]["received_max"] > 1.5 * by["oktopk-direct"]["received_max"]
    assert by["oktopk-direct"]["block_max"] > 1.5 * by["oktopk-always"]["block_max"]


@pytest.mark.parametrize("load", [0.0, 64.0])
def test_bench_codecs_warns_about_load_when_it_misses(load, tmp_path, monkeypatch):
    from bitcomm.bench import codecs as bench_codecs

    # an unreachable target, judged from 1000 elements: every sign encode row is a MISS
    monkeypatch.setitem(bench_codecs.TARGETS, ("sign", "encode"), ("packbits", 1e9, "never"))
    monkeypatch.setitem(bench_codecs.TARGET_SIZES, "cpu", 1000)
    monkeypatch.setattr(os, "getloadavg", lambda: (load, load, load))
    result = CliRunner().invoke(main, ["bench", "codecs", "--sizes", "1000", "--repeat", "1",
                                       "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert " MISS" in result.output
    warned = "MISS on a loaded machine (load average 64.00" in result.stderr
    assert warned == (load > 0)
    assert json.loads((tmp_path / "codecs.json").read_text())["config"]["load1"] == load


def test_hook_bench_shuffles_its_order_per_repeat_alike_on_every_rank():
    from bitcomm.bench.hooks import order

    names = ("allreduce", "local", "sign", "sign/blocking", "topk", "topk/blocking")
    assert order(names, 0) == list(names)  # the first repeat keeps the order given
    later = [order(names, r) for r in range(1, 6)]
    for o in later:
        assert sorted(o) == sorted(names)
    assert any(o != list(names) for o in later)
    assert len({tuple(o) for o in later}) > 1  # each repeat shuffles anew
    # a function of (names, repeat, seed) only, so every rank computes the same order
    assert [order(names, r) for r in range(1, 6)] == later
    assert [order(names, r, seed=1) for r in range(1, 6)] != later


def test_hook_bench_overlap_reads_the_exchange_off_the_local_and_blocking_steps():
    from bitcomm.bench.hooks import Row, overlap

    def row(hook, mb, ms):
        return Row(hook, mb, 2, 100, 2, ms, ms, ms, 1.0, 3)

    rows = [row("allreduce", 1.0, 15.0), row("local", 1.0, 10.0), row("sign", 1.0, 22.0),
            row("sign/blocking", 1.0, 30.0), row("topk", 1.0, 40.0),  # no blocking form
            row("qsgd", 1.0, 31.0), row("qsgd/blocking", 1.0, 28.0),  # the thread cost more
            row("local", 2.0, 10.0), row("sign", 2.0, 9.0), row("sign/blocking", 2.0, 9.5)]
    got = {(o.hook, o.bucket_mb): o for o in overlap(rows)}
    # at 2 MB the blocking step is not slower than the local one: nothing to hide, left out
    assert sorted(got) == [("qsgd", 1.0), ("sign", 1.0)]
    sign = got[("sign", 1.0)]
    # exchange 30 - 10 = 20 ms, of which 30 - 22 = 8 hidden; at most min(10, 20) = 10 could be
    assert (sign.local_ms, sign.exchange_ms, sign.hidden_ms) == (10.0, 20.0, 8.0)
    assert sign.hidden_share == pytest.approx(0.4) and sign.bound_share == pytest.approx(0.5)
    assert got[("qsgd", 1.0)].hidden_share == pytest.approx(-3 / 18)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_bench_over_nccl_without_a_gpu_is_a_usage_error(tmp_path):
    result = CliRunner().invoke(main, ["bench", "collectives", "--transport", "nccl", "--out",
                                       str(tmp_path)])
    assert result.exit_code == 2 and "expected a CUDA device" in result.output


def test_bench_hooks_over_nccl_needs_a_gpu_and_no_topology(tmp_path):
    result = CliRunner().invoke(main, ["bench", "hooks", "--transport", "nccl", "--out",
                                       str(tmp_path)])
    assert result.exit_code == 2 and "expected a CUDA device" in result.output
    result = CliRunner().invoke(main, ["bench", "hooks", "--transport", "nccl", "--topology",
                                       "pair", "--out", str(tmp_path)])
    assert result.exit_code == 2 and "--topology runs gloo ranks" in result.output


def test_launcher_options_are_for_mpi(tmp_path):
    result = CliRunner().invoke(main, ["bench", "collectives", "--transport", "gloo",
                                       "--launcher", "mpirun", "--out", str(tmp_path)])
    assert result.exit_code == 2 and "--launcher and --hostfile start MPI jobs" in result.output


def test_topo_show_prints_links_and_the_model():
    result = CliRunner().invoke(main, ["topo", "show", "chain-16", "--size", "64K"])
    assert result.exit_code == 0, result.output
    assert "topology chain-16: 16 ranks, 0 switches, 15 links, scale 1/125" in result.output
    assert "7 <-> 8" in result.output and "0.800 MB/s" in result.output
    for alg in ("ring-majority", "alltoall-majority", "onebit-allreduce"):
        assert alg in result.output


def test_unknown_topology_and_experiment_are_clear_errors():
    result = CliRunner().invoke(main, ["topo", "show", "ring-99"])
    assert result.exit_code == 1 and "no topology 'ring-99'" in result.output
    assert "chain-16" in result.output  # lists what exists
    result = CliRunner().invoke(main, ["run", "experiment", "nope"])
    assert result.exit_code == 1 and "no experiment 'nope'" in result.output
    assert "table1-chain" in result.output  # lists what exists
    result = CliRunner().invoke(main, ["compare", "--topology", "chain-16", "warp-drive"])
    assert result.exit_code == 1 and "unknown algorithms ['warp-drive']" in result.output


def test_broken_experiment_yaml_is_a_clear_error(tmp_path):
    bad = tmp_path / "broken.yaml"
    bad.write_text("name: [unclosed\n")
    result = CliRunner().invoke(main, ["run", "experiment", str(bad)])
    assert result.exit_code == 1 and f"{bad}: not valid YAML" in result.output
    assert "Traceback" not in result.output


def test_experiment_files_validate(tmp_path):
    from bitcomm.experiments import digits
    from bitcomm.netem.experiment import load_experiment
    from bitcomm.netem.topology import TopologyError

    shipped = Path(__file__).parent.parent / "bitcomm" / "configs" / "experiments"
    for path in sorted(shipped.glob("*.yaml")):
        if "kind: train" in path.read_text():
            assert digits.load_config(path).methods  # a training experiment
            continue
        exp = load_experiment(path)
        assert exp.sizes and exp.topologies
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\ntopologies: [chain-16]\nsizes: [12Q]\n")
    with pytest.raises(TopologyError, match=r"sizes\[0\]: expected a size like 4096, 128K"):
        load_experiment(bad)
    bad.write_text("name: x\ntopologies: [chain-16]\nsizes: [1M]\nqueue: 0\n")
    with pytest.raises(TopologyError, match="queue: expected a number of seconds > 0, got 0"):
        load_experiment(bad)
    bad.write_text("name: x\ntopologies: [chain-16]\nsizes: [1M]\nwindow: fast\n")
    with pytest.raises(TopologyError, match="window: expected a number of seconds > 0, got 'fast'"):
        load_experiment(bad)
    bad.write_text("name: x\ntopologies: [chain-16]\nsizes: [1M]\nwindow: null\nqueue: 0.3\n")
    exp = load_experiment(bad)
    assert (exp.window, exp.queue, exp.congestion) == (None, 0.3, "reno")
    bad.write_text("name: x\ntopologies: [chain-16]\nsizes: [1M]\ncongestion: cubic\n")
    assert load_experiment(bad).congestion == "cubic"
    bad.write_text("name: x\ntopologies: [chain-16]\nsizes: [1M]\ncongestion: [bbr]\n")
    with pytest.raises(TopologyError, match="expected congestion to be a name like reno"):
        load_experiment(bad)
    bad.write_text("name: x\ntopologies: [chain-16]\nsizes: [1M]\nalgorithms: [magic]\n")
    with pytest.raises(TopologyError, match=r"unknown algorithms \['magic'\]"):
        load_experiment(bad)
    bad.write_text("name: x\ntopologies: [chain-16]\nsizes: [1M]\n"
                   "algorithms: [ssar-split-allgather@5%, dsar-split-allgather@200%]\n")
    with pytest.raises(TopologyError, match=r"unknown algorithms \['dsar-split-allgather@200%'\]"):
        load_experiment(bad)


@pytest.mark.timeout(300)
def test_run_experiment_dispatches_training_files(tmp_path):
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text("kind: train\nname: tiny\nworkers: 2\nsteps: 4\neval_every: 2\n"
                   "transports: [gloo]\nmethods: [dense-sgd, signum-ring]\n")
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["run", "experiment", str(cfg), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "| gloo | signum-ring |" in result.output
    rows = json.loads((out / "results.json").read_text())["rows"]
    assert [r["method"] for r in rows] == ["dense-sgd", "signum-ring"]
    assert all(r["identical_on_ranks"] for r in rows)
    assert (out / "accuracy.png").stat().st_size > 0 and (out / "results.csv").exists()
    bad = tmp_path / "bad.yaml"
    bad.write_text("kind: train\nmethods: [nope]\n")
    result = CliRunner().invoke(main, ["run", "experiment", str(bad)])
    assert result.exit_code != 0 and "unknown methods" in result.output


@pytest.mark.parametrize("name", ["../../escape", "/tmp/abs", ".hidden", "a/b", "", "x" * 65])
def test_experiment_names_stay_inside_the_results_directory(tmp_path, name):
    from bitcomm.experiments import digits
    from bitcomm.netem.experiment import load_experiment
    from bitcomm.netem.topology import TopologyError

    exp = tmp_path / "exp.yaml"
    exp.write_text(f"name: {name!r}\ntopologies: [chain-16]\nsizes: [1M]\n")
    with pytest.raises(TopologyError, match="name: expected 1-64 letters"):
        load_experiment(exp)
    train = tmp_path / "train.yaml"
    train.write_text(f"kind: train\nname: {name!r}\n")
    with pytest.raises(ValueError, match="name: expected 1-64 letters"):
        digits.load_config(train)


def test_compare_names_its_results_after_the_topology_not_the_path_given(monkeypatch):
    from bitcomm import netem

    seen = []

    def stop(exp, progress=None):
        seen.append(exp)
        raise RuntimeError("stopped before any network is built")
    monkeypatch.setattr(netem, "run_experiment", stop)
    monkeypatch.setattr(netem, "requirements", lambda: [])
    chain = Path(__file__).parent / "data" / "chain-4.yaml"
    result = CliRunner().invoke(main, ["compare", "--topology", str(chain), "ring-majority"])
    assert "stopped before" in result.output and seen, result.output
    assert seen[0].name == "compare-chain-4"  # results/compare-chain-4, inside results/


def test_an_experiment_refuses_a_name_that_would_leave_its_results_directory():
    from bitcomm import netem

    for name in ("../../escape", "/abs", "a/b", ""):
        with pytest.raises(ValueError, match="name"):
            netem.Experiment(name=name, topologies=["chain-16"], sizes=[1024])


@pytest.mark.parametrize("command", [
    ["run", "experiment", "default"],
    ["run", "experiment", "train-digits"],
    ["compare", "--topology", "chain-16", "ring-majority"],
])
def test_earlier_results_are_not_replaced_without_overwrite(command, tmp_path, monkeypatch):
    from bitcomm import netem
    from bitcomm.experiments import digits

    def stop(*args, **kwargs):
        raise RuntimeError("stopped before any network is built")
    monkeypatch.setattr(netem, "run_experiment", stop)
    monkeypatch.setattr(digits, "launch", stop)
    monkeypatch.setattr(netem, "requirements", lambda: [])
    out = tmp_path / "earlier"
    out.mkdir()
    (out / "results.json").write_text("{}")
    result = CliRunner().invoke(main, [*command, "--out", str(out)])
    assert result.exit_code != 0 and "--overwrite" in result.output, result.output
    assert "stopped before" not in result.output  # refused before any work
    assert (out / "results.json").read_text() == "{}"
    result = CliRunner().invoke(main, [*command, "--out", str(out), "--overwrite"])
    assert "stopped before" in result.output, result.output
    # an empty directory holds nothing to lose
    result = CliRunner().invoke(main, [*command, "--out", str(tmp_path / "empty")])
    assert "stopped before" in result.output, result.output


def test_collectives_lists_the_registry_with_bytes_per_rank():
    from bitcomm.collectives import registry

    result = CliRunner().invoke(main, ["collectives", "--size", "1M", "--ranks", "8"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    for name, c in registry.COLLECTIVES.items():
        [line] = [x for x in lines if x.split()[:1] == [name]]
        assert str(c.wire_bytes(1 << 20, 8, 0, True)) in line
        assert ("yes" in line.split()) == c.emulated and c.summary in line


def test_topologies_and_experiments_are_found_by_name_from_any_directory(tmp_path):
    # what a user of an installed bitcomm runs: no checkout in the working directory
    import subprocess
    import sys

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "bitcomm.cli", *args], cwd=tmp_path,
                              capture_output=True, text=True, timeout=120)
    shown = cli("topo", "show", "chain-16")
    assert shown.returncode == 0 and "topology chain-16: 16 ranks" in shown.stdout, shown.stderr
    listed = cli("topo", "show", "nope")
    assert "chain-16" in listed.stderr and "star-16" in listed.stderr  # what exists, by name
    missing = cli("topo", "show", str(tmp_path / "nope.yaml"))
    assert f"{tmp_path / 'nope.yaml'}: no such topology file" in missing.stderr
    none = cli("run", "experiment", "nope")
    assert "no experiment 'nope'" in none.stderr and "table1-chain" in none.stderr
    assert "train-digits" in none.stderr


@pytest.mark.timeout(300)
def test_the_wheel_carries_the_topologies_and_experiments(tmp_path):
    import shutil
    import subprocess
    import sys
    import zipfile

    # built from a copy: a build writes build/ and *.egg-info next to the sources
    root = Path(__file__).parent.parent
    src = tmp_path / "src"
    shutil.copytree(root / "bitcomm", src / "bitcomm",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(root / name, src / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "-w", str(tmp_path), str(src)], check=True,
                   timeout=280, capture_output=True)
    [wheel] = tmp_path.glob("bitcomm-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for topo in ("chain-16", "chain-32", "cluster-16", "cluster-32", "hetero-16", "hetero-32",
                 "star-16"):
        assert f"bitcomm/configs/topologies/{topo}.yaml" in names
    for exp in ("default", "table1-chain", "table2-cluster", "table3-hetero", "star",
                "train-digits", "train-digits-wide", "sparcml", "sparcml-fast", "oktopk",
                "oktopk-balance"):
        assert f"bitcomm/configs/experiments/{exp}.yaml" in names


def _codecs_run(folder: Path, time: str, rows: list[tuple]) -> Path:
    # a saved run of bench codecs: rows as (codec, op, n, anchor, ratio, target, gbps), and
    # optionally host_probe_seconds, preempted and migrated
    folder.mkdir(parents=True)
    keys = ("codec", "op", "n", "anchor", "ratio", "target", "gbps", "host_probe_seconds",
            "preempted", "migrated")
    (folder / "codecs-cuda.json").write_text(json.dumps({
        "config": {"time": time, "machine": "x86_64", "cpus": 16, "torch": "2.11",
                   "threads": 16, "gpu": "NVIDIA_H200", "path": "triton"},
        "rows": [dict(zip(keys, r, strict=False)) for r in rows]}))
    return folder


def _tally_lines(runs: list, out: Path) -> list[str]:
    # bench tally of the runs into out; the lines of its tally.md
    result = CliRunner().invoke(main, ["bench", "tally", *map(str, runs), "--out", str(out)])
    assert result.exit_code == 0, result.output
    return (out / "tally.md").read_text().splitlines()


def test_bench_tally_counts_the_runs_that_met_each_target_and_names_the_misses(tmp_path):
    """Three runs: the tally gives each row's runs met and spread, the rows that missed in
    some run run by run (a ratio saved as null, NaN, is a miss), and which runs met every
    target; its files hold the same."""
    anchor = ("anchor", "sum", 64, "", None, None, 3000.0)
    runs = [
        _codecs_run(tmp_path / "codecs-run1", "t1", [
            anchor, ("qsgd-4", "encode", 64, "sum", 0.6, 0.5, 10.0),
            ("sign-scaled", "encode", 64, "sum", 0.3, None, 9.0),
            ("topk-1%", "encode", 64, "sum", 0.197, 0.2, 8.0)]),
        _codecs_run(tmp_path / "codecs-run2", "t2", [
            ("anchor", "sum", 64, "", None, None, 3100.0),
            ("qsgd-4", "encode", 64, "sum", 0.4, 0.5, 10.0),
            ("sign-scaled", "encode", 64, "sum", 0.1, None, 9.0)]),  # no top-k row
        _codecs_run(tmp_path / "codecs-run3", "t3", [
            ("anchor", "sum", 64, "", None, None, 3200.0),
            ("qsgd-4", "encode", 64, "sum", 0.7, 0.5, 10.0),
            ("sign-scaled", "encode", 64, "sum", 0.2, None, 9.0),
            ("topk-1%", "encode", 64, "sum", None, 0.2, 8.0)]),
    ]
    out = tmp_path / "tally"
    result = CliRunner().invoke(main, ["bench", "tally", *map(str, runs), "--out", str(out)])
    assert result.exit_code == 0, result.output
    md = (out / "tally.md").read_text()
    assert result.output.startswith(md) and "# wrote " in result.output
    lines = md.splitlines()
    assert lines[0] == "- Date: t1"
    assert lines[3:6] == [f"- Run {i}: {runs[i - 1]} (t{i})" for i in (1, 2, 3)]
    assert "| anchor | sum |  | 64 |  | 3000.0 / 3100.0 / 3200.0 GB/s |  |" in lines
    assert "| qsgd-4 | encode | sum | 64 | 2 of 3 | 0.40 / 0.60 / 0.70 | >= 0.50 |" in lines
    assert "| sign-scaled | encode | sum | 64 |  | 0.10 / 0.20 / 0.30 |  |" in lines
    # a miss that rounds to its target shows a third decimal
    assert "| topk-1% | encode | sum | 64 | 0 of 2 | 0.197 / 0.197 / 0.197 | >= 0.20 |" in lines
    misses = lines[lines.index("The rows that missed their target in a run (misses in "
                               "bold):") + 2:]
    assert misses[:4] == ["| codec | op | size | run 1 | run 2 | run 3 | target |",
                          "|---|---|---|---|---|---|---|",
                          "| qsgd-4 | encode | 64 | 0.60 | **0.40** | 0.70 | >= 0.50 |",
                          "| topk-1% | encode | 64 | **0.197** | - | **nan** | >= 0.20 |"]
    assert lines[-1] == "Runs that met every target: none (0 of 3)."
    saved = {(r["codec"], r["op"]): r for r in json.loads((out / "tally.json").read_text())
             ["rows"]}
    assert saved[("qsgd-4", "encode")]["values"] == [0.6, 0.4, 0.7]
    assert (saved[("topk-1%", "encode")]["values"], saved[("topk-1%", "encode")]["present"],
            saved[("topk-1%", "encode")]["met"]) == ([0.197, None, None], [True, False, True], 0)
    # a run that met every target, twice
    clean = _codecs_run(tmp_path / "clean", "t4", [anchor, ("qsgd-4", "encode", 64, "sum", 0.5,
                                                           0.5, 10.0)])
    result = CliRunner().invoke(main, ["bench", "tally", str(clean), str(clean),
                                       "--out", str(out)])
    assert "\nEvery target met in every run (2 of 2).\n# wrote " in result.output


def test_bench_tally_shows_the_host_probe_of_the_rows_that_missed(tmp_path):
    """Runs that saved each row's host probe: the tally adds, under the misses, each missed
    row's probe run by run (a miss's in bold) and each run's median over all its rows, so that
    a miss measured on a slow host shows as one; the JSON keeps every row's probes."""
    runs = [
        _codecs_run(tmp_path / "r1", "t1", [
            ("anchor", "sum", 64, "", None, None, 3000.0, 100e-6),
            ("qsgd-4", "encode", 64, "sum", 0.6, 0.5, 10.0, 120e-6),
            ("sign", "encode", 64, "sum", 1.0, 0.8, 10.0, 110e-6)]),
        _codecs_run(tmp_path / "r2", "t2", [
            ("anchor", "sum", 64, "", None, None, 3000.0, 240e-6),
            ("qsgd-4", "encode", 64, "sum", 0.4, 0.5, 10.0, 310e-6),
            ("sign", "encode", 64, "sum", 1.0, 0.8, 10.0, 260e-6)]),
    ]
    out = tmp_path / "tally"
    lines = _tally_lines(runs, out)
    at = lines.index("The host probe of those rows, us (`host_probe`: a fixed piece of host "
                     "work timed around the row's calls; a miss's in bold):")
    assert lines[at + 2:at + 7] == ["| codec | op | size | run 1 | run 2 |",
                                    "|---|---|---|---|---|",
                                    "| qsgd-4 | encode | 64 | 120 | **310** |",
                                    "| every row | median | | 110 | 260 |", ""]
    assert lines[-1] == "Runs that met every target: 1 (1 of 2)."
    saved = {(r["codec"], r["op"]): r for r in json.loads((out / "tally.json").read_text())
             ["rows"]}
    assert saved[("sign", "encode")]["probes"] == [110e-6, 260e-6]
    assert "preempted" not in "\n".join(lines)  # these runs saved no scheduler counts
    assert lines[3:5] == [f"- Run 1: {runs[0]} (t1)", f"- Run 2: {runs[1]} (t2)"]
    # runs saved without probes (as the docs' H200 runs were) tally as before: no such table
    bare = [_codecs_run(tmp_path / f"b{i}", "t", [("qsgd-4", "encode", 64, "sum", r, 0.5, 1.0)])
            for i, r in enumerate((0.4, 0.6))]
    result = CliRunner().invoke(main, ["bench", "tally", *map(str, bare), "--out", str(out)])
    assert result.exit_code == 0 and "host probe" not in result.output, result.output


def test_bench_tally_shows_the_scheduler_counts_of_the_rows_that_missed(tmp_path):
    """Runs that saved each row's preemptions and moves between CPUs: the tally adds, under
    the probes, each missed row's counts run by run (a miss's in bold) and each run's median,
    so that a miss measured while the benchmark's thread was preempted or moved shows as one;
    a row without counts (a system that gives none) shows a dash."""
    runs = [
        _codecs_run(tmp_path / "r1", "t1", [
            ("counts-w1", "encode", 16, "sign.encode", 0.55, 1.0, 10.0, 192e-6, 36, 3),
            ("sign", "encode", 16, "packbits", 1.0, 0.9, 10.0, 150e-6, 2, 0),
            ("sign", "decode", 16, "unpackbits", 1.0, 0.9, 10.0, 150e-6, 0, 0)]),
        _codecs_run(tmp_path / "r2", "t2", [
            ("counts-w1", "encode", 16, "sign.encode", 2.9, 1.0, 10.0, 170e-6, 1, 0),
            ("sign", "encode", 16, "packbits", 1.0, 0.9, 10.0, 150e-6, 0, 0),
            ("sign", "decode", 16, "unpackbits", 0.8, 0.9, 10.0, 150e-6, None, None)]),
    ]
    config = json.loads((runs[1] / "codecs-cuda.json").read_text())
    config["config"]["affinity"] = "3"  # a run pinned to CPU 3 (taskset -c 3) says so
    (runs[1] / "codecs-cuda.json").write_text(json.dumps(config))
    out = tmp_path / "tally"
    lines = _tally_lines(runs, out)
    assert lines[3:5] == [f"- Run 1: {runs[0]} (t1)", f"- Run 2: {runs[1]} (t2, on CPUs 3 alone)"]
    assert not any("machines differ" in line for line in lines)  # one machine, one run pinned
    at = lines.index("The benchmark thread's preemptions / moves between CPUs during those "
                     "rows' calls (`preempted` / `migrated`; a miss's in bold):")
    assert lines[at + 2:at + 8] == ["| codec | op | size | run 1 | run 2 |",
                                    "|---|---|---|---|---|",
                                    "| counts-w1 | encode | 16 | **36 / 3** | 1 / 0 |",
                                    "| sign | decode | 16 | 0 / 0 | **- / -** |",
                                    "| every row | median | | 2 / 0 | 0.5 / 0 |", ""]
    saved = {(r["codec"], r["op"]): r for r in json.loads((out / "tally.json").read_text())
             ["rows"]}
    assert saved[("counts-w1", "encode")]["preempted"] == [36, 1]
    assert saved[("sign", "decode")]["migrated"] == [0, None]


def test_bench_tally_refuses_what_it_cannot_tally(tmp_path):
    """A folder without one result, a file that is not one, and runs that give one row other
    anchors or targets are usage errors that name the problem."""
    good = _codecs_run(tmp_path / "a", "t1", [("qsgd-4", "encode", 64, "sum", 0.6, 0.5, 1.0)])
    other = _codecs_run(tmp_path / "b", "t2", [
        ("qsgd-4", "encode", 64, "packbits", 0.6, 0.1, 1.0)])
    (tmp_path / "empty").mkdir()
    (tmp_path / "junk.json").write_text("[1, 2]")
    (tmp_path / "odd.json").write_text('{"config": {}, "rows": {"codec": 1}}')
    cases = {
        (str(tmp_path / "odd.json"),): "these runs cannot be tallied together",
        (str(tmp_path / "empty"),): "expected one codecs.json or codecs-cuda.json there, "
                                    "found none",
        (str(tmp_path / "junk.json"),): "not a result of bench codecs",
        (str(good), str(other)): "runs 1 and 2 differ on qsgd-4 encode at 64: anchor 'sum' "
                                 "against 'packbits'",
    }
    for args, message in cases.items():
        result = CliRunner().invoke(main, ["bench", "tally", *args, "--out",
                                           str(tmp_path / "out")])
        assert result.exit_code == 2 and message in result.output, (args, result.output)
    assert not (tmp_path / "out").exists()


def _docs_runs(folder: str, count: int, out: Path) -> tuple[Path, list[str], list[str]]:
    # docs/results, the `count` runs kept in its `folder`, and the lines of their tally
    root = Path(__file__).resolve().parents[1] / "docs" / "results"
    runs = sorted(str(p) for p in (root / folder).glob("run*"))
    assert len(runs) == count
    return root, runs, _tally_lines(runs, out)


def test_the_h200_runs_kept_in_the_docs_tally_as_the_docs_say(tmp_path):
    """gpu-h200.md's codec verdict comes from the saved runs beside it: their tally names the
    runs that met every target and the misses the doc's table shows."""
    root, runs, lines = _docs_runs("h200-2026-11-28", 10, tmp_path)
    assert lines[-1] == "Runs that met every target: 2, 3, 4, 5, 8, 10 (6 of 10)."
    doc = (root / "gpu-h200.md").read_text()
    assert "runs 2-5, 8 and 10 met every target: 6 of 10" in " ".join(doc.split())
    assert ("| topk-1% | encode | 64M | 0.28 | 0.32 | 0.32 | 0.33 | 0.30 | **0.197** | 0.21 | "
            "0.33 | 0.33 | 0.33 | >= 0.20 |") in lines


def test_the_cpu_runs_kept_in_the_docs_tally_as_the_docs_say(tmp_path):
    """codecs-cpu.md's figures come from the three runs saved beside it: their tally meets
    every target, the doc's ranges are the tally's, and its table is the first run's."""
    root, runs, lines = _docs_runs("cpu-2026-11-28", 3, tmp_path)
    assert lines[-1] == "Every target met in every run (3 of 3)."
    doc = (root / "codecs-cpu.md").read_text()
    assert "| sign | decode | unpackbits | 64M | 3 of 3 | 2.64 / 3.14 / 3.59 | >= 0.90 |" in lines
    assert "64M 2.64-3.59" in doc
    first = {(r["codec"], r["op"], r["n"]): r for r in json.loads(
        (Path(runs[0]) / "codecs.json").read_text())["rows"]}
    row = first[("sign", "decode", 64 << 20)]
    assert f"{row['gbps']:.2f} ({row['ratio']:.2f}) | >= 0.90 |" in doc
