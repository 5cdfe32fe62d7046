"""The ``bitcomm`` command line: one click group, subcommands registered on it."""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

import click
import torch

from bitcomm import _sizes, netem
from bitcomm._sizes import human as _human
from bitcomm.collectives import registry
from bitcomm.comm.launch import TRANSPORTS

__all__ = ["main", "Size"]

class Size(click.ParamType):
    """A size such as ``4096``, ``128K``, ``16M`` or ``1G`` (:mod:`bitcomm._sizes`)."""

    name = "size"

    def convert(self, value, param, ctx):
        """Parse ``value`` into an int, failing with a message that shows the accepted forms."""
        try:
            return _sizes.parse(value)
        except ValueError as e:
            self.fail(str(e), param, ctx)


class SizeList(click.ParamType):
    """A comma-separated list of :class:`Size` values."""

    name = "sizes"

    def convert(self, value, param, ctx):
        """Parse ``value`` into a tuple of ints."""
        if isinstance(value, (list, tuple)):
            return tuple(value)
        return tuple(Size().convert(part, param, ctx) for part in str(value).split(",") if part)


class FloatList(click.ParamType):
    """A comma-separated list of positive numbers."""

    name = "numbers"

    def convert(self, value, param, ctx):
        """Parse ``value`` into a tuple of floats > 0."""
        if isinstance(value, (list, tuple)):
            return tuple(value)
        try:
            out = tuple(float(part) for part in str(value).split(",") if part)
        except ValueError:
            self.fail(f"expected comma-separated numbers such as 0.004,0.25,1, got {value!r}",
                      param, ctx)
        if not out or any(not v > 0 or math.isinf(v) for v in out):
            self.fail(f"expected positive numbers, got {value!r}", param, ctx)
        return out


@click.group()
@click.version_option(package_name="bitcomm")
def main() -> None:
    """bitcomm: bit-level gradient codecs and communication-efficient collectives."""


@main.command("collectives")
@click.option("--size", type=Size(), default="1M", show_default=True,
              help="float32 elements per rank, for the bytes column.")
@click.option("--ranks", type=click.IntRange(1), default=8, show_default=True)
def collectives_cmd(size: int, ranks: int) -> None:
    """List the collectives the benchmark, experiments and compare accept (by name).

    For each: the bytes rank 0 sends for SIZE elements over RANKS ranks (by the collective's
    documented formula, agreement included), whether the emulated experiments can run it, and
    what it does.
    """
    click.echo(f"{'name':<20} {'bytes/rank':>12} {'emulated':>8}  summary")
    for name, c in registry.COLLECTIVES.items():
        click.echo(f"{name:<20} {c.wire_bytes(size, ranks, 0, True):>12} "
                   f"{'yes' if c.emulated else 'no':>8}  {c.summary}")


@main.group()
def bench() -> None:
    """Measure codecs and collectives and save the numbers."""


@bench.command("codecs")
@click.option("--sizes", type=SizeList(), default="1M,16M,64M", show_default=True,
              help="Comma-separated float32 element counts.")
@click.option("--repeat", type=click.IntRange(1), default=3, show_default=True,
              help="Timed repetitions per measurement (median reported), after a warm-up.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True,
              help="Where the vector lives: cpu (numpy anchors) or cuda (HBM-read anchor, "
                   "CUDA-event timing).")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default="results",
              show_default=True,
              help="Directory for codecs[-cuda].json, .csv and .md (the docs' table).")
def bench_codecs(sizes: tuple[int, ...], repeat: int, seed: int, device: str,
                 out_dir: str) -> None:
    """Encode/decode throughput of every codec, as ratios to anchors in the same run."""
    from bitcomm.bench import codecs as bench_mod

    _check_device(device)
    load = os.getloadavg()[0]  # the minute before this run: other processes' load
    config = _machine(device) | {
        "sizes": list(sizes), "repeat": repeat, "seed": seed, "load1": round(load, 2),
    }
    _announce("bench codecs", config)
    click.echo("# GB/s of fp32 input (4 bytes/element, GB = 1e9); ratio = anchor time / time")
    gpu = device != "cpu"
    if gpu:  # on the CPU the host's time is the time
        click.echo("# time = the device's (CUDA events); host = until the call returned; "
                   "probe = the host's time for a fixed piece of work, around the calls")
    # Widths of the longest names (redsync-trimmed-1%, unpackbits): rows print as measured.
    header = (f"{'size':>6} {'codec':<18} {'op':<10} {'time(ms)':>10} "
              + (f"{'host(ms)':>9} {'probe(us)':>9} " if gpu else "")
              + f"{'GB/s':>8} {'wire_bytes':>12} {'#wrong':>6} {'ratio':>7} {'vs':<11} "
              f"{'target':>7}")
    click.echo(header)

    def show(row) -> None:
        ratio = "" if math.isnan(row.ratio) else f"{row.ratio:.3f}"
        target = "" if math.isnan(row.target) else f">={row.target:.3f}"
        flag = ""
        if not math.isnan(row.target):
            flag = " ok" if row.ratio >= row.target else " MISS"
        host = (f"{row.host_seconds * 1e3:>9.3f} {row.host_probe_seconds * 1e6:>9.0f} " if gpu
                else "")
        click.echo(f"{_human(row.n):>6} {row.codec:<18} {row.op:<10} {row.seconds * 1e3:>10.2f} "
                   f"{host}{row.gbps:>8.3f} {row.wire_bytes:>12} {row.wrong:>6} {ratio:>7} "
                   f"{row.anchor:<11} {target:>7}{flag}")

    rows = bench_mod.run(sizes, repeat=repeat, seed=seed, progress=show, device=device)
    command = (f"bitcomm bench codecs --sizes {','.join(_human(n) for n in sizes)} "
               f"--repeat {repeat} --seed {seed} --device {device}")
    _save(Path(out_dir), "codecs" if device == "cpu" else f"codecs-{device}", config,
          [r.as_dict() for r in rows], markdown=bench_mod.markdown(rows, config, command))
    misses = sum(1 for r in rows if not math.isnan(r.target) and r.ratio < r.target)
    cpus = os.cpu_count() or 1
    if misses and load > 0.5 * cpus:
        click.echo(f"# warning: {misses} MISS on a loaded machine (load average {load:.2f} over "
                   f"{cpus} CPUs in the minute before the run): a codec's calls alternate "
                   "with its anchor's, but other processes can still cost some of one and "
                   "not of the other; re-run when the machine is idle, or with more "
                   "--repeat", err=True)
    wrong = sum(r.wrong for r in rows)
    if wrong:
        click.echo(f"# {wrong} wrong results: a codec is broken", err=True)
        sys.exit(1)


@bench.command("tally")
@click.argument("runs", nargs=-1, required=True, type=click.Path(exists=True))
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default="results",
              show_default=True, help="Directory for tally.json, .csv and .md.")
def bench_tally(runs: tuple[str, ...], out_dir: str) -> None:
    """Tally runs of ``bench codecs`` against their targets.

    For each codec operation and size: how many runs met its target and its lowest, median
    and highest ratio; then every row that missed in some run, run by run (with its host probe
    and its thread's preemptions and CPU moves where the runs saved them), and which runs met
    every target. RUNS: the runs' codecs.json or codecs-cuda.json, or the folders holding
    them (such as tools/gpu-check.sh's codecs-run1, codecs-run2, ...).
    """
    from bitcomm.bench import codecs as bench_mod

    files = [_codecs_result(Path(p)) for p in runs]
    saved = []
    for f in files:
        try:
            data = json.loads(f.read_text())
            saved.append((data["config"], data["rows"]))
        except (ValueError, KeyError, TypeError) as e:
            raise click.UsageError(f"{f}: not a result of bench codecs ({e})") from None
    try:
        tallies = bench_mod.tally([rows for _, rows in saved])
    except (ValueError, KeyError, TypeError) as e:  # rows of other runs, or not rows
        raise click.UsageError(f"these runs cannot be tallied together: {e}") from None
    configs = [config for config, _ in saved]
    names = [str(f.parent if f.parent.name else f) for f in files]
    command = "bitcomm bench tally " + " ".join(runs)
    table = bench_mod.tally_markdown(tallies, configs, names, command)
    click.echo(table, nl=False)
    config = {"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "runs": [str(f) for f in files],
              "times": [c.get("time") for c in configs]}
    _save(Path(out_dir), "tally", config, [t.as_dict() for t in tallies], markdown=table)


def _codecs_result(path: Path) -> Path:
    # a run's saved codecs[-cuda].json: the file itself, or the one in its folder
    if path.is_file():
        return path
    found = sorted(path.glob("codecs*.json"))
    if len(found) != 1:
        raise click.UsageError(f"{path}: expected one codecs.json or codecs-cuda.json there, "
                               f"found {', '.join(f.name for f in found) or 'none'}")
    return found[0]


@bench.command("kernels")
@click.option("--n", "n", type=Size(), default="64M", show_default=True,
              help="Vector length the launches are specialised for.")
@click.option("--arch", type=click.IntRange(70), default=90, show_default=True,
              help="CUDA compute capability to compile for (90: H100).")
@click.option("--only", default=None, help="Only the cases whose name contains this text.")
@click.option("--jobs", type=click.IntRange(1), default=None,
              help="Processes that compile the cases  [default: the CPUs, at most 8]")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default="results",
              show_default=True, help="Directory for kernels-smARCH.json and .csv.")
def bench_kernels(n: int, arch: int, only: str | None, jobs: int | None, out_dir: str) -> None:
    """Report what each Triton kernel compiles to for a GPU, without one: registers, spills.

    Needs triton (the dev extra), whose bundled ptxas and cuobjdump do the work; no GPU and no
    CUDA driver. Instructions are counted in the program's machine code, not timed.
    """
    from bitcomm.bench import kernels as bench_mod

    why = bench_mod.available()
    if why:
        raise click.UsageError(f"bench kernels: {why}")
    import triton

    config = _machine() | {"triton": triton.__version__, "n": n, "arch": arch}
    _announce("bench kernels", config)
    click.echo("# per element and lane: SASS instructions, global loads, global stores "
               "(static counts); stack = bytes spilled per thread")
    click.echo(f"{'case':<30} {'kernel':<15} {'regs':>4} {'stack':>5} {'instr':>6} "
               f"{'loads':>5} {'stores':>6}  config")

    def show(row) -> None:
        click.echo(f"{row.case:<30} {row.kernel:<15} {row.registers:>4} {row.stack:>5} "
                   f"{row.per_element:>6.1f} {row.loads:>5.2f} {row.stores:>6.2f}  "
                   f"{row.config}")

    jobs = jobs or min(os.cpu_count() or 1, 8)
    rows = bench_mod.run(n, arch=arch, only=only, progress=show, jobs=jobs)
    if not rows:
        raise click.BadParameter(f"no case name contains {only!r}", param_hint="--only")
    _save(Path(out_dir), f"kernels-sm{arch}", config, [r.as_dict() for r in rows])
    spilled = [r.case for r in rows if r.stack]
    if spilled:
        click.echo(f"# {len(spilled)} kernels spill registers: {', '.join(spilled)}", err=True)


@bench.command("host")
@click.option("--sizes", type=SizeList(), default="1M", show_default=True,
              help="Comma-separated float32 element counts (a top-k takes its sampled path "
                   "from 256K; past a few MB a CPU tensor's allocation is an mmap, which CUDA's "
                   "caching allocator does not pay).")
@click.option("--calls", type=click.IntRange(1), default=200, show_default=True,
              help="Calls a round.")
@click.option("--rounds", type=click.IntRange(1), default=7, show_default=True,
              help="Rounds (each side's fastest is kept).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default="results",
              show_default=True, help="Directory for host.json, .csv and .md.")
def bench_host(sizes: tuple[int, ...], calls: int, rounds: int, seed: int,
               out_dir: str) -> None:
    """Time the host's work a codec call on the Triton path, without a GPU (stand-in driver).

    Each call with the launch and call replays against the same call without them. Needs
    triton (the gpu or dev extra); no GPU. This process's Triton launches stand-in kernels
    from then on: run it on its own.
    """
    try:
        import triton
    except ImportError:
        raise click.UsageError("bench host: triton is not installed (pip install "
                               "'bitcomm[gpu]')") from None

    from bitcomm.bench import heading
    from bitcomm.bench import host as bench_mod

    config = _machine() | {"triton": triton.__version__, "sizes": list(sizes), "calls": calls,
                           "rounds": rounds, "seed": seed}
    command = (f"bitcomm bench host --sizes {','.join(_human(s) for s in sizes)} --calls "
               f"{calls} --rounds {rounds} --seed {seed}")
    _announce("bench host", config)
    click.echo(f"{'codec':<12} {'op':<7} {'n':>6} {'replayed':>10} {'anchor':>10} {'ratio':>6}"
               "   (us of host a call; anchor: without the replays)")

    def show(row) -> None:
        click.echo(f"{row.codec:<12} {row.op:<7} {_human(row.n):>6} {row.host_us:>10.1f} "
                   f"{row.anchor_us:>10.1f} {row.ratio:>6.2f}")

    try:
        rows = bench_mod.run(sizes, calls=calls, rounds=rounds, seed=seed, progress=show)
    except RuntimeError as e:
        raise click.UsageError(str(e)) from e
    table = heading(config, command)[:-1] + [
        f"- Triton: {config['triton']}, its launches to a stand-in driver", "",
        "| codec | op | n | host us a call | without the replays | ratio |",
        "| --- | --- | --- | --- | --- | --- |"] + [
        f"| {r.codec} | {r.op} | {_human(r.n)} | {r.host_us:.1f} | {r.anchor_us:.1f} | "
        f"{r.ratio:.2f} |" for r in rows]
    _save(Path(out_dir), "host", config, [r.as_dict() for r in rows],
          markdown="\n".join(table) + "\n")


@bench.command("profile")
@click.option("--sizes", type=SizeList(), default="64M", show_default=True,
              help="Comma-separated float32 element counts.")
@click.option("--codecs", "names", default=None,
              help="Comma-separated codecs of bench codecs (e.g. sign,qsgd-4,topk-1%); "
                   "all by default.")
@click.option("--calls", type=click.IntRange(1), default=5, show_default=True,
              help="Calls per measurement, after a warm-up.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True,
              help="Where the vector lives (cuda: the kernels' times from torch.profiler).")
@click.option("--top", type=click.IntRange(0), default=4, show_default=True,
              help="Kernels printed under each call, the slowest first (all are saved).")
@click.option("--host-functions", type=click.IntRange(0), default=0, show_default=True,
              help="Host functions (cProfile) printed and saved under each call, those with "
                   "the most own time first.")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default="results",
              show_default=True, help="Directory for profile[-cuda].json and .csv.")
@click.option("--set", "sets", multiple=True, metavar="NAME=INT",
              help="Set a selection constant for the run (CANDIDATE_TILES, SMALL_TOP, SLACK, "
                   "COUNT_PROGRAMS, LOCAL_ROOM, COUNT_STAGES); repeatable.")
def bench_profile(sizes: tuple[int, ...], names: str | None, calls: int, seed: int,
                  device: str, top: int, host_functions: int, out_dir: str,
                  sets: tuple[str, ...]) -> None:
    """Where each codec call's time goes: kernels, launches, host time, the device's idle gap."""
    from bitcomm.bench import profile as bench_mod

    _check_device(device)
    codecs = None if names is None else names.split(",")
    settings = {}
    for item in sets:
        name, _, value = item.partition("=")
        try:
            settings[name] = int(value)
        except ValueError:
            raise click.BadParameter(f"expected NAME=INT, got {item!r}",
                                     param_hint="--set") from None
    try:
        bench_mod.check_settings(settings)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--set") from e
    config = _machine(device) | {"sizes": list(sizes), "codecs": codecs, "calls": calls,
                                 "seed": seed, "settings": settings,
                                 "host_functions": host_functions}
    _announce("bench profile", config)
    click.echo("# per call: launches, device = kernels' time, host = until it returns, wall = "
               "until its work is done, idle = wall - device (us)")
    if host_functions:
        click.echo("# host: a function's calls a codec call x its own time a call (us, "
                   "cProfile: Python functions' high by ~1 us a call)")
    shown = {"kernels": 0}

    def show(row) -> None:
        if row.name == bench_mod.CALL:
            shown["kernels"] = 0
            idle = row.wall_us - row.device_us
            click.echo(f"{_human(row.n):>6} {row.codec:<16} {row.op:<7} launches "
                       f"{row.launches:>5.1f} device {row.device_us:>9.1f} host "
                       f"{row.host_us:>9.1f} wall {row.wall_us:>9.1f} idle {idle:>9.1f}")
        elif row.name.startswith(bench_mod.HOST):
            click.echo(f"{'':>32}{row.launches:>5.1f} x {row.host_us:>9.1f}  {row.name[:90]}")
        elif shown["kernels"] < top:
            shown["kernels"] += 1
            click.echo(f"{'':>32}{row.launches:>5.1f} x {row.device_us:>9.1f}  {row.name[:70]}")

    try:
        rows = bench_mod.run(sizes, device=device, codecs=codecs, calls=calls, seed=seed,
                             progress=show, settings=settings, host_functions=host_functions)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--codecs") from e
    _save(Path(out_dir), "profile" if device == "cpu" else f"profile-{device}", config,
          [r.as_dict() for r in rows])


@bench.command("tune")
@click.option("--n", "n", type=Size(), default="64M", show_default=True,
              help="Elements of the benchmark vector.")
@click.option("--repeat", type=click.IntRange(1), default=10, show_default=True,
              help="Timed calls per configuration (median), after a warm-up.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--only", default=None,
              help="Comma-separated settings (TUNING names, or SMALL_TOP); all by default.")
@click.option("--small-top-sizes", type=SizeList(), default="4K,8K,16K,32K,64K,128K",
              show_default=True, help="Lengths at which the one-program top-k is timed.")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default="results",
              show_default=True, help="Directory for tune-cuda.json, .csv and .md.")
def bench_tune(n: int, repeat: int, seed: int, only: str | None,
               small_top_sizes: tuple[int, ...], out_dir: str) -> None:
    """Each Triton kernel's tile and warps against its neighbours, on a GPU.

    Every configuration's calls alternate with the code's configuration; the files are
    rewritten after each row, so a run cut off by a deadline keeps what it measured.
    """
    from bitcomm.bench import tune as bench_mod

    _check_device("cuda")
    try:
        wanted = bench_mod.settings(None if only is None else only.split(","))
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--only") from e
    config = _machine("cuda") | {"n": n, "repeat": repeat, "seed": seed, "only": wanted,
                                 "small_top_sizes": list(small_top_sizes)}
    command = (f"bitcomm bench tune --n {_human(n)} --repeat {repeat} --seed {seed}"
               + (f" --only {only}" if only else "")
               + f" --small-top-sizes {','.join(_human(s) for s in small_top_sizes)}")
    _announce("bench tune", config)
    click.echo(f"{'setting':<20} {'operation':<22} {'n':>6} {'tried':>10} {'against':>12} "
               f"{'speedup':>7}  same")
    rows: list = []

    def show(row) -> None:
        rows.append(row)
        click.echo(f"{row.setting:<20} {row.case:<22} {_human(row.n):>6} {row.tried:>10} "
                   f"{row.against:>12} {row.speedup:>7.2f}  {'yes' if row.same else 'NO'}")
        _save(Path(out_dir), "tune-cuda", config, [r.as_dict() for r in rows],
              markdown=bench_mod.markdown(rows, config, command), announce=False)

    bench_mod.run(n, "cuda", repeat=repeat, seed=seed, only=wanted,
                  small_top_sizes=small_top_sizes, progress=show)
    if rows:
        _save(Path(out_dir), "tune-cuda", config, [r.as_dict() for r in rows],
              markdown=bench_mod.markdown(rows, config, command))
    differ = [f"{r.setting} {r.tried}" for r in rows if not r.same]
    if differ:
        click.echo(f"# {len(differ)} configurations gave other output than the code's: "
                   f"{', '.join(differ)}", err=True)
        sys.exit(1)


@bench.command("select")
@click.option("--sizes", type=SizeList(), default="256K,2560K", show_default=True,
              help="Comma-separated vector lengths (SIDCo's figures use 0.26M-26M).")
@click.option("--deltas", type=FloatList(), default="0.1,0.01,0.001", show_default=True,
              help="Comma-separated target ratios k / n.")
@click.option("--dists", default=",".join(("laplace", "gauss", "t3", "digits")),
              show_default=True, help="Comma-separated distributions: laplace, gauss, t3, "
                                      "digits (train-digits gradients; experiments extra).")
@click.option("--repeat", type=click.IntRange(1), default=3, show_default=True,
              help="Timed repetitions per selection (median reported), after a warm-up.")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True,
              help="Where the scores live (cuda: CUDA-event timing).")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default="results",
              show_default=True,
              help="Directory for select[-cuda].json, .csv and .md (the docs' tables).")
def bench_select(sizes: tuple[int, ...], deltas: tuple[float, ...], dists: str, repeat: int,
                 device: str, out_dir: str) -> None:
    """How many entries each top-k selector picks against k, and its time against topk."""
    from bitcomm.bench import select as bench_mod

    _check_device(device)
    ratios = list(deltas)
    if not all(d < 1 for d in ratios):
        raise click.BadParameter(f"expected ratios below 1, got {deltas!r}",
                                 param_hint="--deltas")
    names = dists.split(",")
    bad = [d for d in names if d not in bench_mod.DISTRIBUTIONS]
    if bad:
        raise click.BadParameter(f"unknown {bad}; expected some of {bench_mod.DISTRIBUTIONS}",
                                 param_hint="--dists")
    config = _machine(device) | {"sizes": list(sizes), "deltas": ratios, "dists": names,
                                 "repeat": repeat}
    _announce("bench select", config)
    click.echo("# ratio = selected / k; vs_topk = bitcomm's exact topk time / this selector's "
               "time")
    click.echo(f"{'dist':<7} {'n':>6} {'delta':>6} {'selector':<13} {'mode':<9} {'M':>2} "
               f"{'bestM':>5} {'k':>7} {'selected':>8} {'ratio':>7} {'ms':>8} {'vs_topk':>7}")

    def show(row) -> None:
        click.echo(f"{row.dist:<7} {_human(row.n):>6} {row.delta:>6g} {row.selector:<13} "
                   f"{row.mode:<9} {row.stages:>2} {row.best_stages:>5} {row.k:>7} "
                   f"{row.selected:>8} {row.ratio:>7.3f} {row.seconds * 1e3:>8.2f} "
                   f"{row.vs_topk:>7.2f}")

    rows = bench_mod.run(sizes, ratios, names, repeat=repeat, progress=show, device=device)
    command = (f"bitcomm bench select --sizes {','.join(_human(n) for n in sizes)} --deltas "
               f"{','.join(f'{d:g}' for d in ratios)} --dists {dists} --repeat {repeat} "
               f"--device {device}")
    _save(Path(out_dir), "select" if device == "cpu" else f"select-{device}", config,
          [r.as_dict() for r in rows], markdown=bench_mod.markdown(rows, config, command))


@bench.command("volume")
@click.option("--ranks", "ranks", type=SizeList(), default="4,8,16,32", show_default=True,
              help="Comma-separated rank counts (threads of this process).")
@click.option("--n", "n", type=SizeList(), default="256K", show_default=True,
              help="Vector length.")
@click.option("--density", type=click.FloatRange(0, 1, min_open=True), default=0.01,
              show_default=True, help="k / n per rank.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--inputs", type=click.Choice(["standard", "digits"]), default="standard",
              show_default=True, help="standard: randn per rank (uniform top-k indices); "
                                      "digits: real train-digits gradients (skewed; --n is "
                                      "then the model's 76,810; experiments extra).")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default="results",
              show_default=True, help="Directory for volume[-digits].json, .csv and .png.")
def bench_volume(ranks: tuple[int, ...], n: tuple[int, ...], density: float, seed: int,
                 inputs: str, out_dir: str) -> None:
    """Bytes per rank of Ok-Topk, RedSync's allgather and SparCML's split-allgather vs P."""
    from bitcomm.bench import volume as bench_mod

    if not ranks or not all(2 <= r <= 64 for r in ranks):
        raise click.BadParameter(f"expected rank counts in 2..64, got {ranks!r}",
                                 param_hint="--ranks")
    if len(n) != 1:
        raise click.BadParameter("expected one length", param_hint="--n")
    config = _machine() | {"ranks": list(ranks), "n": n[0], "density": density, "seed": seed,
                           "inputs": inputs}
    _announce("bench volume", config)
    click.echo("# bytes the busiest rank sends in one call; words = bytes / 4")
    click.echo(f"{'P':>3} {'algorithm':<17} {'max bytes':>10} {'words':>10} "
               f"{'6k(P-1)/P':>10} {'2k(P-1)':>10} {'selected':>8} {'recv max':>8} "
               f"{'block max':>9}")

    def show(row) -> None:
        click.echo(f"{row.ranks:>3} {row.algorithm:<17} {row.max_bytes:>10} {row.words:>10.0f} "
                   f"{row.bound_words:>10.0f} {row.allgather_words:>10.0f} {row.selected:>8} "
                   f"{row.received_max:>8} {row.block_max:>9}")

    rows = bench_mod.run(ranks, n[0], density, seed=seed, inputs=inputs, progress=show)
    out = Path(out_dir)
    name = "volume" if inputs == "standard" else f"volume-{inputs}"
    _save(out, name, config, [r.as_dict() for r in rows])
    try:
        import matplotlib
    except ImportError:
        click.echo("# no plot: matplotlib is missing (pip install 'bitcomm[plots]')", err=True)
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = bench_mod.plot(rows)
    fig.savefig(out / f"{name}.png", dpi=100, bbox_inches="tight")
    plt.close(fig)
    click.echo(f"# wrote {out / (name + '.png')}")


def _machine(device: str = "cpu") -> dict:
    info = {"torch": torch.__version__, "threads": torch.get_num_threads(),
            "cpus": os.cpu_count(), "machine": platform.machine(),
            "python": platform.python_version(), "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    allowed = _affinity()
    if allowed is not None:
        info["affinity"] = allowed
    if device == "cuda":
        from bitcomm.codecs import backend

        info["gpu"] = torch.cuda.get_device_name().replace(" ", "_")
        info["path"] = backend(torch.empty(0, device="cuda"))
        if info["path"] == "triton":
            import triton

            info["triton"] = triton.__version__
    return info


def _affinity() -> str | None:
    # The CPUs this process may run on where they are fewer than the machine's (taskset, a
    # cgroup's cpuset), as Linux writes CPU lists ("2", "0-3,8"): a run pinned to a CPU is
    # timed differently from one the scheduler moves, and its results should say so.
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no such call here (macOS, Windows)
        return None
    if len(cpus) >= (os.cpu_count() or 0):
        return None
    spans: list[list[int]] = []
    for cpu in cpus:
        if spans and spans[-1][1] == cpu - 1:
            spans[-1][1] = cpu
        else:
            spans.append([cpu, cpu])
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in spans)


def _announce(command: str, config: dict) -> None:
    """Print a benchmark's first line: the command and its configuration (as saved)."""
    click.echo(f"# bitcomm {command}: " + " ".join(f"{k}={v}" for k, v in config.items()))


def _check_device(device: str) -> None:
    if device == "cuda" and not torch.cuda.is_available():
        raise click.UsageError("--device cuda: expected a CUDA device, but "
                               "torch.cuda.is_available() is False on this machine")


def _save(out: Path, name: str, config: dict, dicts: list[dict], *,
          markdown: str | None = None, announce: bool = True) -> None:
    """Write ``name``.json (strict: NaN becomes null) and ``name``.csv under ``out``.

    ``markdown``: a table as the docs quote it, written to ``name``.md as well. ``announce``:
    print the files written.
    """
    out.mkdir(parents=True, exist_ok=True)
    strict = [{k: None if isinstance(v, float) and math.isnan(v) else v for k, v in d.items()}
              for d in dicts]
    (out / f"{name}.json").write_text(
        json.dumps({"config": config, "rows": strict}, indent=1, allow_nan=False))
    with open(out / f"{name}.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(dicts[0]) if dicts else [])
        writer.writeheader()
        writer.writerows(dicts)
    written = [out / f"{name}.json", out / f"{name}.csv"]
    if markdown is not None:
        written.append(out / f"{name}.md")
        written[-1].write_text(markdown)
    if announce:
        click.echo(f"# wrote {', '.join(map(str, written[:-1]))} and {written[-1]}")


@bench.command("collectives")
@click.option("--ranks", type=click.IntRange(1), default=4, show_default=True,
              help="Processes to launch (ignored when torchrun, mpiexec, mpirun or srun "
                   "started this one).")
@click.option("--transport", type=click.Choice(TRANSPORTS), default="mpi", show_default=True,
              help="mpi (mpi4py), gloo, or nccl (CUDA tensors, one GPU per rank).")
@click.option("--launcher", default=None,
              help="MPI launcher command for --transport mpi, e.g. mpirun, 'srun --mpi=pmix' or "
                   "a path [default: $BITCOMM_LAUNCHER, the mpi extra's mpiexec, then mpiexec "
                   "or mpirun on PATH].")
@click.option("--hostfile", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Hostfile passed to the MPI launcher (--hostfile; srun: SLURM_HOSTFILE).")
@click.option("--sizes", type=SizeList(), default="1M,8M", show_default=True,
              help="Comma-separated float32 element counts per rank.")
@click.option("--repeat", type=click.IntRange(1), default=3, show_default=True,
              help="Timed calls after a warm-up (each call's slowest rank; median, min, max).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default="results",
              show_default=True,
              help="Directory for collectives-TRANSPORT-RANKS.json, .csv and .md (the docs' "
                   "table).")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True,
              help="cuda: time one rank's ring-majority kernels on this GPU (no launch), each "
                   "next to its bytes at HBM speed and the rank's wire bytes at --link-gbps.")
@click.option("--link-gbps", type=click.FloatRange(min=0, min_open=True), default=100.0,
              show_default=True, help="Link rate (Gb/s) for the wire time (--device cuda).")
@click.option("--worker", is_flag=True, hidden=True, help="Run as one rank of a launched job.")
def bench_collectives(ranks: int, transport: str, launcher: str | None, hostfile: str | None,
                      sizes: tuple[int, ...], repeat: int, seed: int, out_dir: str, device: str,
                      link_gbps: float, worker: bool) -> None:
    """Time ring vs all-to-all majority, 1-bit allreduce, sparse and dense allreduce."""
    if device == "cuda":
        _check_device(device)
        _bench_ring_steps(ranks, sizes, max(repeat, 10), seed, link_gbps, Path(out_dir))
        return
    args = ["--transport", transport, "--sizes", ",".join(map(str, sizes)), "--repeat",
            str(repeat), "--seed", str(seed), "--out", out_dir]
    if transport != "mpi" and (launcher or hostfile):
        raise click.UsageError(f"--launcher and --hostfile start MPI jobs; --transport "
                               f"{transport} starts its ranks here (torchrun across machines)")
    if transport == "nccl":
        _check_device("cuda")
    if not worker and _launched() is None:
        sys.exit(_launch(ranks, transport, ["collectives", *args], launcher, hostfile))
    from bitcomm.bench import collectives as bench_mod
    from bitcomm.collectives.registry import COLLECTIVES
    from bitcomm.comm.launch import world

    comm = world(transport)
    config = _machine() | {"ranks": comm.size, "transport": transport, "sizes": list(sizes),
                           "repeat": repeat, "seed": seed}
    wide = max(map(len, COLLECTIVES))  # every row's name fits: rows print as measured
    if comm.rank == 0:
        _announce("bench collectives", config)
        click.echo("# algbw = 4n bytes / time (GB = 1e9), busbw = algbw * 2(N-1)/N; time = "
                   "median over calls of each call's slowest rank (min, max in the JSON)")
        click.echo(f"{'size(B)':>7} {'count':>10} {'collective':<{wide}} {'time(ms)':>10} "
                   f"{'algbw':>8} {'busbw':>8} {'wire_bytes':>12} {'formula':>12} "
                   f"{'#wrong':>6} {'vs a2a':>7}")

    def show(row) -> None:
        speed = "" if row.speedup_vs_alltoall is None else f"{row.speedup_vs_alltoall:.2f}"
        click.echo(f"{_human(4 * row.n):>7} {row.n:>10} {row.collective:<{wide}} "
                   f"{row.seconds * 1e3:>10.2f} {row.algbw:>8.3f} {row.busbw:>8.3f} "
                   f"{row.wire_bytes:>12} {row.expected_bytes:>12} {row.wrong:>6} {speed:>7}",
                   nl=True)

    on = torch.device("cuda", torch.cuda.current_device()) if transport == "nccl" else "cpu"
    rows = bench_mod.run(comm, sizes, repeat=repeat, seed=seed, progress=show, device=on)
    comm.barrier()
    code = 0
    if comm.rank == 0:
        command = (f"bitcomm bench collectives --ranks {comm.size} --transport {transport} "
                   f"--sizes {','.join(_human(n) for n in sizes)} --repeat {repeat} "
                   f"--seed {seed}")
        _save(Path(out_dir), f"collectives-{transport}-{comm.size}", config,
              [r.as_dict() for r in rows], markdown=bench_mod.markdown(rows, config, command))
        wrong = sum(r.wrong for r in rows)
        if wrong:
            click.echo(f"# {wrong} wrong results or byte counts: a collective is broken",
                       err=True)
            code = 1
    _finish(code)


def _bench_ring_steps(ranks: int, sizes: tuple[int, ...], repeat: int, seed: int,
                      link_gbps: float, out: Path) -> None:
    from bitcomm.bench import collectives as bench_mod

    config = _machine("cuda") | {"ranks": ranks, "sizes": list(sizes), "repeat": repeat,
                                 "seed": seed, "link_gbps": link_gbps}
    _announce("bench collectives --device cuda", config)
    click.echo("# one rank's ring_majority kernels (CUDA events, median); hbm(ms) = bytes "
               "moved at the torch.sum read speed; wire(ms) = the rank's wire bytes at "
               f"{link_gbps:g} Gb/s; call = every rank a thread on this GPU")
    click.echo(f"{'size':>6} {'kernel':<11} {'count':>10} {'time(ms)':>9} {'moved':>12} "
               f"{'hbm(ms)':>8} {'vs_hbm':>6} {'wire_bytes':>11} {'wire(ms)':>8}")
    rows = []
    for n in sizes:
        for row in bench_mod.ring_steps(n, ranks, device="cuda", repeat=repeat,
                                        link_gbps=link_gbps, seed=seed):
            rows.append(row)
            wire = "" if math.isnan(row.wire_seconds) else f"{row.wire_seconds * 1e3:.3f}"
            click.echo(f"{_human(n):>6} {row.what:<11} {row.count:>10} {row.seconds * 1e3:>9.3f} "
                       f"{row.moved:>12} {row.hbm_seconds * 1e3:>8.3f} {row.vs_hbm:>6.2f} "
                       f"{row.wire_bytes or '':>11} {wire:>8}")
    command = (f"bitcomm bench collectives --device cuda --ranks {ranks} --sizes "
               f"{','.join(_human(n) for n in sizes)} --repeat {repeat} --seed {seed} "
               f"--link-gbps {link_gbps:g}")
    _save(out, f"collectives-cuda-{ranks}", config, [r.as_dict() for r in rows],
          markdown=bench_mod.steps_markdown(rows, config, command))
    n = min(sizes)
    click.echo(f"# host synchronisations per call and rank: {ranks} ranks as threads on this "
               f"GPU, {_human(4 * n)} of float32 each, check=False, after a warm-up call")
    counted = bench_mod.syncs(n, ranks, device="cuda", seed=seed)
    for row in counted:
        click.echo(f"{row.collective:<24} {row.syncs:>6.1f}")
    _save(out, f"syncs-cuda-{ranks}", config | {"n": n}, [r.as_dict() for r in counted])


@bench.command("hooks")
@click.option("--ranks", type=click.IntRange(1), default=2, show_default=True,
              help="Processes to launch (ignored when torchrun started this one); one per GPU "
                   "with nccl.")
@click.option("--bucket-mb", "bucket_mbs", type=FloatList(), default="0.004,0.25,1",
              show_default=True, help="Comma-separated DDP bucket_cap_mb values.")
@click.option("--width", type=click.IntRange(1), default=128, show_default=True,
              help="Hidden width of the MLP.")
@click.option("--depth", type=click.IntRange(1), default=8, show_default=True,
              help="Hidden layers of the MLP.")
@click.option("--batch", type=click.IntRange(1), default=64, show_default=True,
              help="Samples per step and rank (a larger batch lengthens backward, which an "
                   "overlapped hook can hide its exchange behind).")
@click.option("--steps", type=click.IntRange(1), default=10, show_default=True,
              help="Timed training steps per hook, bucket size and repeat.")
@click.option("--repeats", type=click.IntRange(1), default=3, show_default=True,
              help="Measurements of each hook per bucket size, in an order shuffled per repeat.")
@click.option("--hooks", "names", default=",".join(["allreduce", "allreduce/blocking",
                                                     "fp16_compress", "powerSGD",
                                                     "sign", "sign/blocking", "sign/ring",
                                                     "onebit", "onebit/blocking",
                                                     "onebit/alltoall", "qsgd", "qsgd/blocking",
                                                     "topk", "topk/blocking"]),
              show_default=True, help="Comma-separated hooks (allreduce, the anchor, always).")
@click.option("--topology", default=None,
              help="Run the ranks in an emulated network (a shipped name such as pair, or a "
                   ".yaml path; as root), one per node, instead of over loopback.")
@click.option("--transport", type=click.Choice(["gloo", "nccl"]), default="gloo",
              show_default=True,
              help="gloo (CPU model), or nccl (the model on each rank's GPU; the hooks' CUDA "
                   "stream path).")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default="results",
              show_default=True, help="Directory for hooks-TRANSPORT-RANKS.json and .csv.")
@click.option("--worker", is_flag=True, hidden=True, help="Run as one rank of a launched job.")
def bench_hooks(ranks: int, bucket_mbs: tuple[float, ...], width: int, depth: int, batch: int,
                steps: int, repeats: int, names: str, topology: str | None, transport: str,
                out_dir: str, worker: bool) -> None:
    """Time a DDP training step with each communication hook, as ratios to allreduce_hook.

    Also times the step with no exchange (local, under no_sync) and reports how much of each
    hook's exchange its overlapped form hid (hooks-TRANSPORT-RANKS-overlap.json/csv).
    """
    from bitcomm.bench import hooks as bench_mod

    chosen = tuple(n for n in names.split(",") if n)
    unknown = [n for n in chosen if n not in bench_mod.HOOKS]
    if unknown:
        raise click.BadParameter(f"unknown hooks {unknown}; choose from "
                                 f"{', '.join(bench_mod.HOOKS)}", param_hint="--hooks")
    args = ["--bucket-mb", ",".join(map(str, bucket_mbs)), "--width", str(width), "--depth",
            str(depth), "--batch", str(batch), "--steps", str(steps), "--repeats", str(repeats),
            "--hooks",
            ",".join(chosen), "--out", out_dir]
    if topology is not None:
        if transport != "gloo":
            raise click.UsageError("--topology runs gloo ranks in network namespaces; "
                                   f"--transport {transport} is for GPUs")
        args += ["--topology", topology]
    if transport == "nccl":
        _check_device("cuda")
        args += ["--transport", "nccl"]
    if not worker and _launched() is None:
        if topology is not None:
            sys.exit(_launch_emulated(topology, ["hooks", *args]))
        sys.exit(_launch(ranks, transport, ["hooks", *args]))
    from bitcomm.comm.launch import world

    comm = world(transport, timeout=120)
    hook_comm, device = comm, torch.device("cpu")
    if transport == "nccl":
        import torch.distributed as dist

        from bitcomm.comm.torchdist import TorchComm

        # The hooks' exchange thread gets a communicator of its own (bitcomm.train.hooks).
        hook_comm = TorchComm(dist.new_group())
        device = torch.device("cuda", torch.cuda.current_device())
    config = _machine() | {"ranks": comm.size, "transport": transport,
                           "bucket_mb": list(bucket_mbs),
                           "width": width, "depth": depth, "batch": batch, "steps": steps,
                           "repeats": repeats,
                           "network": topology or "loopback"}
    if comm.rank == 0:
        _announce("bench hooks", config)
        click.echo("# a DDP training step (zero_grad, forward, backward, SGD step): median over "
                   "steps of the slowest rank; vs_allreduce = its ratio to allreduce_hook's "
                   "median at the same bucket size in this run; local = the step under no_sync "
                   "(no exchange)")
        click.echo(f"{'bucket_mb':>9} {'buckets':>7} {'hook':<18} {'step(ms)':>9} {'min':>8} "
                   f"{'max':>8} {'vs_allreduce':>12}")

    def show(row) -> None:
        click.echo(f"{row.bucket_mb:>9g} {row.buckets:>7} {row.hook:<18} {row.step_ms:>9.2f} "
                   f"{row.step_ms_min:>8.2f} {row.step_ms_max:>8.2f} {row.vs_allreduce:>12.2f}")

    def skip(name: str, mb: float, why: str) -> None:
        click.echo(f"# {name} skipped at bucket_mb={mb:g}: {why}")

    rows = bench_mod.run(comm, bucket_mbs, width=width, depth=depth, batch=batch, steps=steps,
                         repeats=repeats, names=chosen, progress=show, skipped=skip,
                         hook_comm=hook_comm, device=device)
    comm.barrier()
    if comm.rank == 0:
        config |= {"params": rows[0].params}
        _save(Path(out_dir), f"hooks-{transport}-{comm.size}", config,
              [r.as_dict() for r in rows])
        hid = bench_mod.overlap(rows)
        if hid:
            click.echo("# overlap: exchange = blocking - local step; hidden = blocking - "
                       "overlapped step; bound = min(local, exchange) / exchange")
            click.echo(f"{'bucket_mb':>9} {'hook':<9} {'local(ms)':>9} {'exchange':>9} "
                       f"{'hidden':>8} {'hidden/exch':>11} {'bound':>6}")
            for o in hid:
                click.echo(f"{o.bucket_mb:>9g} {o.hook:<9} {o.local_ms:>9.2f} "
                           f"{o.exchange_ms:>9.2f} {o.hidden_ms:>8.2f} {o.hidden_share:>11.2f} "
                           f"{o.bound_share:>6.2f}")
            _save(Path(out_dir), f"hooks-{transport}-{comm.size}-overlap", config,
                  [o.as_dict() for o in hid])
    _finish(0)


def _finish(code: int) -> None:
    """End this rank of a launched benchmark (:func:`bitcomm.comm.launch.finish`)."""
    from bitcomm.comm import launch

    launch.finish(code)


def _launched():  # noqa: ANN202 - a Launched or None
    """Return this process's place in a job a launcher started (None: start one here)."""
    from bitcomm.comm import launch

    try:
        return launch.launched()
    except ValueError as e:
        raise click.ClickException(str(e)) from None


def _launch(ranks: int, transport: str, args: list[str], launcher: str | None = None,
            hostfile: str | None = None) -> int:
    """Start ``ranks`` workers of ``bitcomm bench ARGS``; return the job's exit status."""
    from bitcomm.comm import launch

    argv = [sys.executable, "-m", "bitcomm.cli", "bench", args[0], "--worker", *args[1:]]
    with launch.job_dir(f"bench-{args[0]}") as tmp:
        try:
            jobs = launch.commands(ranks, transport, argv, tmp, launcher=launcher,
                                   hostfile=hostfile)
        except (RuntimeError, ValueError) as e:
            raise click.ClickException(str(e)) from None
        procs = [launch.spawn(cmd, env) for cmd, env in jobs]
        return max(abs(p.wait()) for p in procs)


def _launch_emulated(name: str, args: list[str]) -> int:
    """Start ``bitcomm bench ARGS`` on each node of topology ``name``; return the exit status.

    One gloo worker per node, inside the node's namespace, so the ranks talk over the
    topology's shaped links instead of loopback.
    """
    from bitcomm.comm import launch

    _, topology = _topology(name, None)
    argv = [sys.executable, "-m", "bitcomm.cli", "bench", args[0], "--worker", *args[1:]]
    try:
        with launch.job_dir(f"bench-{args[0]}") as tmp, netem.Emulator(topology) as net:
            procs = []
            for cmd, env in launch.commands(topology.nodes, "gloo", argv, tmp):
                rank = int(env["RANK"])
                # gloo binds to, and tells the others, the address of this interface: the
                # node's first link (host routes reach a node's addresses from any of its links)
                env["GLOO_SOCKET_IFNAME"] = net.dev(topology.neighbours(rank)[0][1])
                procs.append(net.popen(rank, cmd, env=env))
            try:
                return max(abs(p.wait()) for p in procs)
            finally:
                for p in procs:
                    if p.poll() is None:
                        p.kill()
                        p.wait()
    except netem.EmulatorError as e:
        raise click.ClickException(str(e)) from None


@main.group()
def topo() -> None:
    """Build, remove or print emulated network topologies (a shipped name or a .yaml path)."""


def _topology(name: str, scale: float | None):  # noqa: ANN202 - a Topology

    try:
        return netem.find(name), netem.load(netem.find(name), scale=scale)
    except netem.TopologyError as e:
        raise click.ClickException(str(e)) from None


@topo.command("show")
@click.argument("name")
@click.option("--scale", type=float, default=None, help="Override the file's scale.")
@click.option("--size", type=Size(), default="1M", show_default=True,
              help="float32 elements for the model's per-algorithm summary.")
def topo_show(name: str, scale: float | None, size: int) -> None:
    """Print a topology's links and the model's time and slow-link bytes per algorithm."""
    _, t = _topology(name, scale)
    click.echo(t.describe())
    slow = t.slowest_link()
    click.echo(f"model at {_human(size)} elements (slowest link {slow.a}-{slow.b}):")
    for alg in registry.EMULATED:
        p = netem.model.predict(t, alg, size)
        worst = max(p.link_payload(slow.index, d) for d in (True, False))
        click.echo(f"  {alg:<20} {p.seconds:8.3f} s  {p.phases:4} phases  "
                   f"{worst / 1e6:8.3f} MB on the slowest link")


@topo.command("up")
@click.argument("name")
@click.option("--scale", type=float, default=None, help="Override the file's scale.")
def topo_up(name: str, scale: float | None) -> None:
    """Build a topology and leave it up (remove it with `bitcomm topo down`)."""
    _, t = _topology(name, scale)
    net = netem.Emulator(t)
    try:
        net.build()  # removes what it built if it fails or is interrupted
    except netem.EmulatorError as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"{t.name} is up with prefix {net.prefix}:")
    for r in range(t.nodes):
        addrs = ", ".join(str(a) for a in t.addresses(r))
        click.echo(f"  rank {r}: ip netns exec {net.ns(r)} ...   ({addrs})")


@topo.command("check")
@click.argument("name")
@click.option("--scale", type=float, default=None, help="Override the file's scale.")
@click.option("--seconds", type=float, default=3.0, show_default=True,
              help="iperf3 duration per link.")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default="results",
              show_default=True, help="Directory for links-NAME.json/csv.")
def topo_check(name: str, scale: float | None, seconds: float, out_dir: str) -> None:
    """Build a topology and measure every link with iperf3 against its configured rate."""
    _, t = _topology(name, scale)
    try:
        with netem.Emulator(t) as net:
            rows = netem.check_links(net, seconds, progress=click.echo)
    except netem.EmulatorError as e:
        raise click.ClickException(str(e)) from None
    worst = min(r.ratio for r in rows)
    click.echo(f"# lowest goodput / rate: {worst:.3f} (TCP payload is at most 0.956 of the line "
               "rate)")
    _save(Path(out_dir), f"links-{t.name}", _machine() | {"topology": t.name,
                                                          "seconds": seconds},
          [r.as_dict() for r in rows])


@topo.command("down")
@click.argument("prefix", default="bitcomm-")
def topo_down(prefix: str) -> None:
    """Remove every namespace starting with PREFIX (default: all of bitcomm's).

    Processes still running inside them are killed first, and the temporary directories of
    jobs whose controller was killed are removed too.
    """
    if not prefix.startswith(netem.PREFIX):
        raise click.ClickException(f"expected a prefix starting with {netem.PREFIX!r}, "
                                   f"got {prefix!r}")
    missing = netem.requirements()
    if missing:
        raise click.ClickException("removing namespaces needs " + "; ".join(missing))
    try:
        swept = netem.sweep(prefix)
    except netem.EmulatorError as e:
        raise click.ClickException(str(e)) from None
    gone = swept.namespaces
    click.echo(f"removed {len(gone)} namespaces" + (": " + " ".join(gone) if gone else ""))
    if swept.processes:
        n = len(swept.processes)
        click.echo(f"ended {n} process{'es' if n > 1 else ''} still running in them: "
                   f"{' '.join(map(str, swept.processes))}")
    if swept.job_dirs:
        click.echo(f"removed {len(swept.job_dirs)} temporary directories of killed jobs: "
                   f"{' '.join(map(str, swept.job_dirs))}")


@main.group("run")
def run_group() -> None:
    """Run experiments on emulated networks."""


def _finish_experiment(cells: list[netem.Cell], config: dict, out: Path) -> None:

    click.echo(netem.report.table(cells))
    busy = [c for c in cells if c.cpu_share > netem.CPU_BOUND]
    if busy:
        click.echo(f"# {len(busy)} cells kept the CPU over {netem.CPU_BOUND:.0%} busy "
                   f"({', '.join(sorted({c.topology for c in busy}))}): they measured this "
                   "machine's cores as much as the network; a larger --scale (slower links) "
                   "makes them network-bound", err=True)
    _save(out, "results", config, [c.as_dict() for c in cells])
    (out / "table.md").write_text(netem.report.markdown(cells) + "\n")
    try:
        for png in netem.report.plots(cells, out):
            click.echo(f"# wrote {png}")
    except ImportError as e:  # the results are saved; only the pictures need the extra
        click.echo(f"# no plots: {e}", err=True)
    wrong = sum(c.wrong for c in cells)
    if wrong:
        click.echo(f"# {wrong} wrong results: a collective is broken", err=True)
        sys.exit(1)


def _results_dir(out_dir: str | None, name: str, overwrite: bool) -> Path:
    """Return the results directory, refusing one that holds an earlier run's files."""
    out = Path(out_dir or Path("results") / name)
    if not overwrite and out.is_dir() and any(out.iterdir()):
        raise click.ClickException(f"{out} holds the results of an earlier run; pass "
                                   "--overwrite to replace them, or --out for another directory")
    return out


def _run_training(data: dict, path: Path, out_dir: str | None, overwrite: bool) -> None:
    """Run a ``kind: train`` experiment (bitcomm.experiments.digits) over its transports."""
    from bitcomm.experiments import digits

    try:
        cfg = digits.config_from(data, path)
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    missing = digits.requirements()
    if missing:
        raise click.ClickException(f"{cfg.name} needs {', '.join(missing)}: pip install "
                                   "'bitcomm[experiments]'")
    out = _results_dir(out_dir, cfg.name, overwrite)
    click.echo(f"# bitcomm run experiment {cfg.name}: " + cfg.description.strip())
    rows = []
    for transport in cfg.transports:
        click.echo(f"# {transport}: {cfg.workers} workers, {cfg.steps} steps, "
                   f"{len(cfg.methods)} methods")
        try:
            rows += digits.launch(cfg, transport, progress=click.echo)
        except RuntimeError as e:
            raise click.ClickException(str(e)) from None
    rows = digits.summarise(rows)
    config = _machine() | dataclasses.asdict(cfg)
    paths = digits.write_report(rows, config, out)
    click.echo((out / "table.md").read_text(), nl=False)
    for p in paths:
        click.echo(f"# wrote {p}")
    broken = [r.method for r in rows if not r.identical_on_ranks]
    if broken:
        click.echo(f"# parameters differ across ranks for {broken}", err=True)
        sys.exit(1)


@run_group.command("experiment")
@click.argument("name", default="default")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default=None,
              help="Results directory [default: results/NAME].")
@click.option("--repeat", type=click.IntRange(1), default=None, help="Override the file's.")
@click.option("--sizes", type=SizeList(), default=None, help="Override the file's sizes.")
@click.option("--scale", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Override every topology's scale (rates are divided by it).")
@click.option("--overwrite", is_flag=True,
              help="Replace the results of an earlier run in the results directory.")
def run_experiment_cmd(name: str, out_dir: str | None, repeat: int | None,
                       sizes: tuple[int, ...] | None, scale: float | None,
                       overwrite: bool) -> None:
    """Run experiment NAME: a shipped one or a .yaml path (default: the chain-16 comparison).

    The shipped experiments (bitcomm/configs/experiments/) are found from any directory.
    """
    try:
        path = netem.find_experiment(name)
        data = netem.read_file(path)  # read once; its kind says which harness runs it
        if isinstance(data, dict) and data.get("kind") == "train":
            _run_training(data, path, out_dir, overwrite)
            return
        exp = netem.experiment_from(data, path)
    except netem.TopologyError as e:
        raise click.ClickException(str(e)) from None
    if repeat:
        exp.repeat = repeat
    if sizes:
        exp.sizes = list(sizes)
    if scale is not None:
        exp.scale = scale
    missing = netem.requirements()
    if missing:
        raise click.ClickException("the network emulator needs " + "; ".join(missing))
    out = _results_dir(out_dir, exp.name, overwrite)
    config = _machine() | {"experiment": exp.name, "topologies": exp.topologies,
                           "sizes": exp.sizes, "algorithms": exp.algorithms,
                           "repeat": exp.repeat, "scale": exp.scale, "alpha": exp.alpha,
                           "queue": exp.queue, "window": exp.window,
                           "congestion": exp.congestion}
    click.echo(f"# bitcomm run experiment {exp.name}: " + exp.description.strip())
    try:
        cells = netem.run_experiment(exp, progress=click.echo)
    except (netem.EmulatorError, netem.TopologyError, RuntimeError) as e:
        raise click.ClickException(str(e)) from None
    _finish_experiment(cells, config, out)


@main.command("compare")
@click.option("--topology", "topology", required=True,
              help="A shipped topology's name (bitcomm topo show NAME) or a .yaml path.")
@click.option("--size", type=Size(), default="1M", show_default=True,
              help="float32 elements per rank.")
@click.option("--repeat", type=click.IntRange(1), default=3, show_default=True)
@click.option("--scale", type=float, default=None, help="Override the topology's scale.")
@click.option("--queue", type=click.FloatRange(0, min_open=True), default=None,
              help="Shaper queue, seconds of each link's rate [default: the emulator's, 0.5].")
@click.option("--window", type=click.FloatRange(0, min_open=True), default=None,
              help="TCP receive buffer limit, seconds of the slowest link's rate [default: "
                   "none, the kernel's].")
@click.option("--congestion", default=None,
              help="The ranks' TCP congestion control [default: the emulator's, reno].")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default=None,
              help="Results directory [default: results/compare-NAME, NAME the topology's "
                   "name].")
@click.option("--overwrite", is_flag=True,
              help="Replace the results of an earlier run in the results directory.")
@click.argument("algorithms", nargs=-1, required=True)
def compare(topology: str, size: int, repeat: int, scale: float | None, queue: float | None,
            window: float | None, congestion: str | None, out_dir: str | None,
            overwrite: bool, algorithms: tuple[str, ...]) -> None:
    """Compare ALGORITHMS (e.g. ring-majority alltoall-majority) on one topology."""
    bad = [a for a in algorithms if not registry.is_emulated(a)]
    if bad:
        raise click.ClickException(f"unknown algorithms {bad}; expected some of "
                                   f"{list(registry.EMULATED)} (SparCML's with @DENSITY)")
    _, t = _topology(topology, scale)
    algs = list(algorithms)
    if "alltoall-majority" not in algs:
        algs.append("alltoall-majority")  # the baseline speedups are measured against
    missing = netem.requirements()
    if missing:
        raise click.ClickException("the network emulator needs " + "; ".join(missing))
    # named after the topology's own name (a checked [a-z0-9-] word), not the path given
    exp = netem.Experiment(name=f"compare-{t.name}", topologies=[topology], sizes=[size],
                           algorithms=algs, repeat=repeat, scale=scale,
                           queue=netem.QUEUE if queue is None else queue,
                           window=netem.WINDOW if window is None else window,
                           congestion=netem.CONGESTION if congestion is None else congestion)
    out = _results_dir(out_dir, exp.name, overwrite)
    config = _machine() | dataclasses.asdict(exp)
    try:
        cells = netem.run_experiment(exp, progress=click.echo)
    except (netem.EmulatorError, netem.TopologyError, RuntimeError) as e:
        raise click.ClickException(str(e)) from None
    _finish_experiment(cells, config, out)


if __name__ == "__main__":  # pragma: no cover
    main()
