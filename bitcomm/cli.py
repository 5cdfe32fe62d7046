"""The ``bitcomm`` command line: one click group, subcommands registered on it."""

from __future__ import annotations

import csv
import json
import math
import os
import platform
import re
import sys
import time
from pathlib import Path

import click
import torch

__all__ = ["main", "Size"]

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


class Size(click.ParamType):
    """A size such as ``4096``, ``128K``, ``16M`` or ``1G`` (binary multiples)."""

    name = "size"

    def convert(self, value, param, ctx):
        """Parse ``value`` into an int, failing with a message that shows the accepted forms."""
        if isinstance(value, int):
            return value
        match = re.fullmatch(r"\s*(\d+)\s*([KMG]?)i?B?\s*", str(value), re.IGNORECASE)
        if not match:
            self.fail(f"expected a size like 4096, 128K, 16M or 1G, got {value!r}", param, ctx)
        return int(match.group(1)) * _UNITS[match.group(2).upper()]


class SizeList(click.ParamType):
    """A comma-separated list of :class:`Size` values."""

    name = "sizes"

    def convert(self, value, param, ctx):
        """Parse ``value`` into a tuple of ints."""
        if isinstance(value, (list, tuple)):
            return tuple(value)
        return tuple(Size().convert(part, param, ctx) for part in str(value).split(",") if part)


def _human(n: int) -> str:
    for unit, mult in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= mult and n % mult == 0:
            return f"{n // mult}{unit}"
    return str(n)


@click.group()
@click.version_option(package_name="bitcomm")
def main() -> None:
    """bitcomm: bit-level gradient codecs and communication-efficient collectives."""


@main.group()
def bench() -> None:
    """Measure codecs (and, later, collectives) and save the numbers."""


@bench.command("codecs")
@click.option("--sizes", type=SizeList(), default="1M,16M,64M", show_default=True,
              help="Comma-separated float32 element counts.")
@click.option("--repeat", type=click.IntRange(1), default=3, show_default=True,
              help="Timed repetitions per measurement (median reported), after a warm-up.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default="results",
              show_default=True, help="Directory for codecs.json and codecs.csv.")
def bench_codecs(sizes: tuple[int, ...], repeat: int, seed: int, out_dir: str) -> None:
    """Encode/decode throughput of every codec, as ratios to numpy anchors in the same run."""
    from bitcomm.bench import codecs as bench_mod

    config = {
        "sizes": list(sizes), "repeat": repeat, "seed": seed,
        "torch": torch.__version__, "threads": torch.get_num_threads(),
        "cpus": os.cpu_count(), "machine": platform.machine(),
        "python": platform.python_version(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    click.echo("# bitcomm bench codecs: " + " ".join(f"{k}={v}" for k, v in config.items()))
    click.echo("# GB/s of fp32 input (4 bytes/element, GB = 1e9); ratio = anchor time / time")
    header = (f"{'size':>6} {'codec':<16} {'op':<7} {'time(ms)':>10} {'GB/s':>8} "
              f"{'wire_bytes':>12} {'#wrong':>6} {'ratio':>7} {'vs':<11} {'target':>7}")
    click.echo(header)

    def show(row) -> None:
        ratio = "" if math.isnan(row.ratio) else f"{row.ratio:.3f}"
        target = "" if math.isnan(row.target) else f">={row.target:.3f}"
        flag = ""
        if not math.isnan(row.target):
            flag = " ok" if row.ratio >= row.target else " MISS"
        click.echo(f"{_human(row.n):>6} {row.codec:<16} {row.op:<7} {row.seconds * 1e3:>10.2f} "
                   f"{row.gbps:>8.3f} {row.wire_bytes:>12} {row.wrong:>6} {ratio:>7} "
                   f"{row.anchor:<11} {target:>7}{flag}")

    rows = bench_mod.run(sizes, repeat=repeat, seed=seed, progress=show)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    dicts = [r.as_dict() for r in rows]
    # Strict JSON: a row without a ratio or target says null, not NaN.
    strict = [{k: None if isinstance(v, float) and math.isnan(v) else v for k, v in d.items()}
              for d in dicts]
    (out / "codecs.json").write_text(
        json.dumps({"config": config, "rows": strict}, indent=1, allow_nan=False))
    with open(out / "codecs.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(dicts[0]))
        writer.writeheader()
        writer.writerows(dicts)
    click.echo(f"# wrote {out / 'codecs.json'} and {out / 'codecs.csv'}")
    wrong = sum(r.wrong for r in rows)
    if wrong:
        click.echo(f"# {wrong} wrong results: a codec is broken", err=True)
        sys.exit(1)


if __name__ == "__main__":  # pragma: no cover
    main()
