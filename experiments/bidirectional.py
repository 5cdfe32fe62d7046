"""Two bulk TCP flows in opposite directions over one tbf-shaped link (needs root).

    .venv/bin/python experiments/bidirectional.py [CONGESTION_CONTROL] [--window=SECONDS]

Prints each flow's goodput as a fraction of the link's 0.8 MB/s, first for one flow alone, then
for one flow each way. Every link of a ring carries traffic both ways (neighbour steps one way,
the wrap-around flow the other), and in a FIFO queue each flow's ACKs wait behind the other
flow's data; this measures what that costs on this kernel. The namespaces use the emulator's
congestion control (reno) unless one is named, e.g. ``bbr``, and its queues; ``--window=S`` caps
the TCP receive buffer at S seconds of the link's rate (the emulator's ``window``, off by
default; see bitcomm.netem.emulator).
"""

import subprocess
import sys

from bitcomm.netem.emulator import WINDOW, Emulator
from bitcomm.netem.topology import from_dict

SERVER = """
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", int(sys.argv[1]))); s.listen(1); print("ready", flush=True)
c, _ = s.accept(); n = 0; t0 = None
while True:
    d = c.recv(1 << 16)
    if not d: break
    t0 = t0 or time.perf_counter()
    n += len(d)
print(n / (time.perf_counter() - t0), flush=True)
"""
CLIENT = """
import socket, sys
s = socket.create_connection((sys.argv[1], int(sys.argv[2]))); s.sendall(b"x" * int(sys.argv[3]))
s.close()
"""
RATE = 0.8e6
NBYTES = 4_000_000


def flow(net, src, dst, port):
    """Start a server at ``dst`` and a client at ``src``; return (server, client)."""
    server = net.popen(dst, [sys.executable, "-c", SERVER, str(port)], stdout=subprocess.PIPE,
                       text=True)
    server.stdout.readline()
    address = str(net.topo.addresses(dst)[0].ip)
    return server, net.popen(src, [sys.executable, "-c", CLIENT, address, str(port),
                                   str(NBYTES)])


def main():
    """Measure one flow, then one flow each way, and print their shares of the rate."""
    topo = from_dict({"name": "bidir", "nodes": 2,
                      "links": [{"a": 0, "b": 1, "rate": f"{RATE}B/s"}]})
    args = sys.argv[1:]
    windows = [float(a.split("=", 1)[1]) for a in args if a.startswith("--window=")]
    window = windows[-1] if windows else WINDOW
    congestion = [a for a in args if not a.startswith("--window=")]
    with Emulator(topo, window=window) as net:
        if congestion:
            for rank in (0, 1):
                subprocess.run(["ip", "netns", "exec", net.ns(rank), "sysctl", "-qw",
                                f"net.ipv4.tcp_congestion_control={congestion[0]}"], check=True)
        for label, pairs in (("one flow", [(0, 1)]), ("one flow each way", [(0, 1), (1, 0)])):
            flows = [flow(net, s, d, 6001 + i) for i, (s, d) in enumerate(pairs)]
            for _, client in flows:
                client.wait(timeout=120)
            shares = [float(server.communicate(timeout=60)[0]) / RATE for server, _ in flows]
            print(f"{label}: goodput / rate = {', '.join(f'{x:.3f}' for x in shares)}")


if __name__ == "__main__":
    main()
