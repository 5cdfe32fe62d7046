"""Measure every emulated link with iperf3 and compare it with its configured rate.

For each link the check picks the pair of ranks with the shortest route that crosses it and
has it as its slowest link (for a link between two ranks, those two; for a switch port, a
neighbour on the same switch; for a trunk, one rank on each side), runs an iperf3 TCP stream
between them for a few seconds, and reports the receiver's goodput against the link's rate.
TCP goodput is at most ``1448 / 1514`` (95.6 %) of the line rate: payload per full frame.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time

from bitcomm.netem.emulator import Emulator, EmulatorError
from bitcomm.netem.results import LinkCheck
from bitcomm.netem.topology import Link, Topology

__all__ = ["pair_for", "check_links"]


def pair_for(topo: Topology, link: Link) -> tuple[int, int]:
    """Return ranks ``(u, v)`` whose route ``u -> v`` crosses ``link`` as its slowest link."""
    best = None
    for u in range(topo.nodes):
        for v in range(topo.nodes):
            if u == v:
                continue
            hops = topo.route_links(u, v)
            if not any(h.index == link.index for h, _ in hops):
                continue
            if min(h.rate for h, _ in hops) < link.rate:
                continue
            key = (len(hops), u, v)
            if best is None or key < best:
                best = key
    if best is None:
        raise EmulatorError(f"no pair of ranks has link {link.index} as its bottleneck")
    return best[1], best[2]


def check_links(net: Emulator, seconds: float = 3.0,
                progress=print) -> list[LinkCheck]:  # noqa: ANN001
    """Run iperf3 across every link of the running emulator ``net``; return one row per link."""
    if shutil.which("iperf3") is None:
        raise EmulatorError("the link check needs iperf3 (Debian/Ubuntu: apt-get install -y "
                            "iperf3)")
    rows = []
    for link in net.topo.links:
        u, v = pair_for(net.topo, link)
        server = net.popen(v, ["iperf3", "-s", "-1", "-p", "5201"], stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
        try:
            time.sleep(0.3)
            dst = str(net.topo.addresses(v)[0].ip)
            out = net.run(u, ["iperf3", "-c", dst, "-p", "5201", "-t", str(seconds), "-J"],
                          capture_output=True, text=True, timeout=seconds + 60)
        finally:
            server.wait(timeout=30) if server.poll() is None else None
        if out.returncode:
            raise EmulatorError(f"iperf3 {u} -> {v} failed: {out.stderr.strip() or out.stdout}")
        goodput = json.loads(out.stdout)["end"]["sum_received"]["bits_per_second"] / 8
        row = LinkCheck(link=link.index, a=link.a, b=link.b, pair=[u, v], rate=link.rate,
                        goodput=goodput, ratio=goodput / link.rate)
        rows.append(row)
        progress(f"  link {link.index:>3} {link.a!s:>4}-{link.b!s:<4} via {u}->{v}: "
                 f"{goodput / 1e6:8.3f} of {link.rate / 1e6:8.3f} MB/s ({row.ratio:.3f})")
    return rows
