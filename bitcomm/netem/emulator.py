"""Build a :class:`~bitcomm.netem.topology.Topology` out of Linux network namespaces.

One namespace per rank (``<prefix>-r<rank>``) and per switch (``<prefix>-<switch>``, holding a
bridge ``br0``); one veth pair per link, created directly inside the two namespaces and named
``l<index>`` at both ends; ``tc`` shapes the egress of every veth end to the link's rate (``tbf``;
a ``netem`` parent adds the delay), so each direction of a cable is shaped on its own. Ranks get
the addresses of :meth:`Topology.address`, forwarding on, and static host routes to every other
rank's addresses along :meth:`Topology.path`.

Every command runs as an argument list (``subprocess`` without a shell). Teardown deletes the
namespaces (which deletes their veths and bridges); it runs on leaving the context manager, on
SIGTERM/SIGINT, and :func:`sweep` removes leftovers of any earlier run (``bitcomm topo down``).

tbf details: ``burst`` is the larger of two MTU-sized frames and 1 ms of the rate, so short
transfers cannot run much faster than the rate; the queue holds 500 ms of the rate, and at least
:data:`QUEUE_BYTES`, so many concurrent flows queue instead of being dropped.

Why a floor in bytes: what arrives at a slow link in one burst is a message, and messages have
the same bytes whatever the scale, so a queue sized in seconds alone shrinks under them when the
rates are scaled down. Measured on hetero-32 with 4M elements at 0.4 MB/s slow links (scale 50):
with 0.5 s (200 KB) queues the ring dropped 28 packets per call, hit 1.7
retransmission timeouts per call, and took 1.41x its bandwidth bound; with 400 KB (``queue: 1.0``
there), 0 drops and 1.09x, as at 0.8 MB/s.

Why 500 ms: a ring sends one bulk flow each way over every link it uses, and each flow's ACKs
queue behind the other flow's data. With 200 ms the flows overflowed the slow link's queue; a
drop halves reno's window, which grows back by one segment per round trip, and round trips are
hundreds of milliseconds behind a full queue, so a direction could run at 0.5-0.75 of its rate
for whole calls (``ss -ti`` on chain-32's wrap-around flow: cwnd 120 -> 60 segments after one
drop, then +1 per 220 ms). With 500 ms, ``bitcomm compare --topology chain-32 --size 4M
--scale 125 ring-majority`` (0.8 MB/s slow links) took 1.08x the ring's bandwidth bound and
hetero-32 (``--scale 25``) 1.08x; with the receive buffer limit below set to 0.32 s as well,
1.17x and 1.46x.

TCP inside the ranks: reno, no slow start after idle, and optionally (``window``) a receive
buffer limit (``net.ipv4.tcp_rmem`` maximum) in seconds of the slowest link's rate, which caps
what one connection keeps in flight (Linux advertises about 0.63 of the buffer on these veths).
Off by default: it keeps one flow from overflowing a queue, but on chains of uneven links it
starves the wrap-around flow, whose ACKs wait in many queues.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import secrets
import shutil
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

from bitcomm.comm import launch
from bitcomm.netem.topology import Link, Topology

__all__ = ["Emulator", "Sender", "Swept", "tx_counters", "drops", "sweep", "requirements", "PREFIX",
           "QUEUE", "WINDOW", "CONGESTION", "EmulatorError"]

PREFIX = "bitcomm-"
"""Every namespace bitcomm creates starts with this."""

QUEUE = 0.5
"""Default shaper queue, seconds of the link's rate."""
QUEUE_BYTES = 400_000
"""Smallest shaper queue in bytes (0.5 s of the 0.8 MB/s slow links the experiments validated)."""

WINDOW: float | None = None
"""Default TCP receive buffer limit, seconds of the slowest link's rate; None: the kernel's."""
CONGESTION = "reno"
"""Default TCP congestion control inside the ranks (see :meth:`Emulator.up`)."""


class EmulatorError(RuntimeError):
    """The emulator cannot run here, or a command failed; the message says which and why."""


def requirements() -> list[str]:
    """Return what is missing to build namespaces here (empty when all is there)."""
    missing = []
    if os.geteuid() != 0:
        missing.append("root (network namespaces and tc need CAP_NET_ADMIN; run as root)")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            missing.append(f"the {tool!r} command (Debian/Ubuntu: apt-get install iproute2)")
    return missing


def _run(args: list[str], *, input: str | None = None) -> str:
    try:
        done = subprocess.run(args, capture_output=True, text=True, input=input, timeout=60)
    except FileNotFoundError as e:
        raise EmulatorError(f"cannot run {args[0]!r}: {e}") from None
    if done.returncode:
        raise EmulatorError(f"command failed ({done.returncode}): {' '.join(args)}\n"
                            f"{done.stderr.strip()}")
    return done.stdout


def namespaces() -> list[str]:
    """Return the names of all network namespaces."""
    out = _run(["ip", "-j", "netns", "list"]) or "[]"
    return sorted(entry["name"] for entry in json.loads(out))


def _end_processes(ns: str) -> list[int]:
    # Processes inside a namespace (ranks of a run whose controller was killed) would keep
    # running after it is deleted: SIGKILL them first.
    out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=60)
    pids = [int(p) for p in out.stdout.split() if p.isdigit()]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return pids


def _delete(ns: str) -> list[int]:
    pids = _end_processes(ns)
    subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=60)
    return pids


@dataclasses.dataclass
class Swept:
    """What :func:`sweep` removed."""

    namespaces: list[str]
    processes: list[int]
    job_dirs: list[Path]


def sweep(prefix: str = PREFIX) -> Swept:
    """Remove what runs left behind: namespaces starting with ``prefix`` and what ran in them.

    Every process still inside such a namespace is killed before the namespace is deleted, and
    the temporary directories of jobs whose controller is gone
    (:func:`bitcomm.comm.launch.leaked_job_dirs`) are removed.
    """
    gone, pids = [], []
    for ns in namespaces():
        if ns.startswith(prefix):
            pids += _delete(ns)
            gone.append(ns)
    return Swept(gone, pids, launch.remove_leaked_job_dirs())


class Emulator:
    """A topology brought up in namespaces; use as a context manager.

    Args:
        topo: the topology.
        prefix: namespace prefix; a fresh ``bitcomm-<6 hex>`` by default.
        queue: each shaper's queue, in seconds of its rate (at least :data:`QUEUE_BYTES`).
        window: each rank's TCP receive buffer limit, in seconds of the slowest link's rate (at
            least 64 KiB); ``None`` keeps the kernel's default. See the module docstring.
        congestion: the ranks' TCP congestion control (``net.ipv4.tcp_congestion_control``),
            one the host lets namespaces use (``net.ipv4.tcp_allowed_congestion_control``).

    Example::

        with Emulator(load(find("chain-16"))) as net:
            net.run(3, ["ping", "-c1", str(net.topo.addresses(9)[0].ip)])

    """

    def __init__(self, topo: Topology, prefix: str | None = None, *, queue: float = QUEUE,
                 window: float | None = WINDOW, congestion: str = CONGESTION):
        if not queue > 0:
            raise ValueError(f"expected queue > 0 seconds, got {queue}")
        if window is not None and not window > 0:
            raise ValueError(f"expected window > 0 seconds or None, got {window}")
        if not isinstance(congestion, str) or not congestion.isidentifier():
            raise ValueError(f"expected a congestion control name like 'reno', got {congestion!r}")
        self.queue = queue
        self.window = window
        self.congestion = congestion
        self.topo = topo
        self.prefix = prefix or f"{PREFIX}{secrets.token_hex(3)}"
        if not self.prefix.startswith(PREFIX):
            raise ValueError(f"expected a prefix starting with {PREFIX!r}, got {self.prefix!r}")
        self.created: list[str] = []
        self._old_handlers: dict[int, object] = {}
        self._stopped_by: int | None = None

    # -- names -------------------------------------------------------------------------------

    def ns(self, vertex: int | str) -> str:
        """Return the namespace of a rank or switch."""
        return f"{self.prefix}-r{vertex}" if isinstance(vertex, int) else f"{self.prefix}-{vertex}"

    @staticmethod
    def dev(link: Link) -> str:
        """Return the interface name of ``link`` (the same at both ends)."""
        return f"l{link.index}"

    # -- lifecycle ---------------------------------------------------------------------------

    def __enter__(self) -> Emulator:
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._old_handlers[sig] = signal.signal(sig, self._on_signal)
        try:
            self.up()
            self._stop_if_signalled()
        except BaseException:
            self.down()
            raise
        return self

    def build(self) -> None:
        """Bring the network up and leave it up, until :meth:`down` or ``bitcomm topo down``.

        The build itself is guarded as the context manager guards a whole run: a failure of any
        kind, SIGINT or SIGTERM removes what was built before the exception propagates.
        """
        self.__enter__()
        self._restore_handlers()

    def __exit__(self, *exc: object) -> None:
        self.down()

    def _on_signal(self, signum: int, frame: object) -> None:
        # Only raise: the teardown runs where the exception lands (__exit__, or build's and
        # __enter__'s except), after the command it interrupted has been reaped. Tearing down
        # here raced a namespace that `ip netns add` was still creating. The signal is noted
        # too: an exception that lands in a finalizer (Popen.__del__) is printed and dropped,
        # so the build also asks between its commands (_stop_if_signalled).
        self._stopped_by = signum
        raise KeyboardInterrupt(f"stopped by signal {signum}; removing the namespaces")

    def _stop_if_signalled(self) -> None:
        if self._stopped_by is not None:
            raise KeyboardInterrupt(f"stopped by signal {self._stopped_by}; removing the "
                                    "namespaces")

    def _run(self, cmd: list[str], **kwargs: object) -> str:
        # A build step: the command, then a look for a signal whose exception was dropped.
        out = _run(cmd, **kwargs)
        self._stop_if_signalled()
        return out

    def up(self) -> None:
        """Create namespaces, bridges, links, shaping, addresses and routes."""
        missing = requirements()
        if missing:
            raise EmulatorError("the network emulator needs " + "; ".join(missing))
        topo = self.topo
        for v in topo.vertices():
            name = self.ns(v)
            self.created.append(name)  # first: an interrupted add may still leave it behind
            self._run(["ip", "netns", "add", name])
            self._run(["ip", "-n", name, "link", "set", "lo", "up"])
            if isinstance(v, int):
                # No slow start after idle: a ring step waits for its neighbour between
                # messages, and restarting from a small window on every step would measure TCP's
                # congestion control instead of the link (datacentre stacks turn it off too).
                # Reno, always built in, so every run uses the same congestion control whatever
                # the host's default (bbr on the machine this was measured on): with one bulk
                # flow each way over a shaped link (experiments/bidirectional.py) reno got
                # 0.93 / 0.88 of the rate and bbr 0.93 / 0.82.
                for key, value in (("net.ipv4.ip_forward", "1"),
                                   ("net.ipv4.conf.all.rp_filter", "0"),
                                   ("net.ipv4.conf.default.rp_filter", "0"),
                                   ("net.ipv4.tcp_slow_start_after_idle", "0"),
                                   ("net.ipv4.tcp_congestion_control", self.congestion),
                                   *self._rmem()):
                    try:
                        self._run(["ip", "netns", "exec", name, "sysctl", "-qw",
                                   f"{key}={value}"])
                    except EmulatorError as e:
                        if key != "net.ipv4.tcp_congestion_control":
                            raise
                        # a namespace may only pick what the host allows
                        # (tcp_allowed_congestion_control), not all the kernel has
                        allowed = Path("/proc/sys/net/ipv4/tcp_allowed_congestion_control")
                        raise EmulatorError(
                            f"TCP congestion control {value!r} is not available to namespaces "
                            f"here; the host allows: {allowed.read_text().strip()} (the host's "
                            "sysctl net.ipv4.tcp_allowed_congestion_control can add one of "
                            "net.ipv4.tcp_available_congestion_control)") from e
            else:
                self._run(["ip", "-n", name, "link", "add", "br0", "type", "bridge"])
                self._run(["ip", "-n", name, "link", "set", "br0", "up"])
        for link in topo.links:
            dev = self.dev(link)
            self._run(["ip", "link", "add", "name", dev, "netns", self.ns(link.a), "type",
                       "veth", "peer", "name", dev, "netns", self.ns(link.b)])
            for end in link.ends():
                ns = self.ns(end)
                if isinstance(end, int):
                    self._run(["ip", "-n", ns, "addr", "add", str(topo.address(end, link)),
                               "dev", dev])
                else:
                    self._run(["ip", "-n", ns, "link", "set", dev, "master", "br0"])
                self._shape(ns, dev, link)
                self._run(["ip", "-n", ns, "link", "set", dev, "up"])
        for rank in range(topo.nodes):
            batch = self._routes(rank)
            if batch:
                self._run(["ip", "-n", self.ns(rank), "-batch", "-"], input=batch)

    def receive_buffer(self) -> int | None:
        """Return the ``tcp_rmem`` maximum in bytes set in every rank (``None``: kernel default)."""
        if self.window is None:
            return None
        return max(64 << 10, int(self.topo.slowest_link().rate * self.window))

    def _rmem(self) -> tuple[tuple[str, str], ...]:
        limit = self.receive_buffer()
        if limit is None:
            return ()
        return (("net.ipv4.tcp_rmem", f"4096 {min(131072, limit)} {limit}"),)

    def queue_bytes(self, link: Link) -> int:
        """Return the shaper queue of ``link``, bytes: ``queue`` s of its rate, >= QUEUE_BYTES."""
        return max(QUEUE_BYTES, int(link.rate * self.queue))

    def _shape(self, ns: str, dev: str, link: Link) -> None:
        rate_bits = max(8, round(link.rate * 8))
        burst = max(2 * 1514, int(link.rate / 1000))
        limit = self.queue_bytes(link)
        tbf = ["tbf", "rate", f"{rate_bits}bit", "burst", str(burst), "limit", str(limit)]
        if link.delay:
            try:
                self._run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:",
                           "netem", "delay", f"{link.delay * 1e6:.0f}us"])
            except EmulatorError as e:
                if "unknown" not in str(e):
                    raise
                raise EmulatorError(f"link {link.index} ({link.a}-{link.b}) has a delay, which "
                                    "needs tc's netem qdisc (kernel module sch_netem); this "
                                    "kernel does not have it: remove the delay") from None
            self._run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "parent", "1:1", "handle",
                       "10:", *tbf])
        else:
            self._run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", *tbf])

    def _routes(self, rank: int) -> str:
        topo = self.topo
        lines = []
        connected = {a.network for a in topo.addresses(rank)}
        for dst in range(topo.nodes):
            if dst == rank:
                continue
            path = topo.path(rank, dst)
            first = topo.link_between(path[0], path[1])
            at = next(i for i, v in enumerate(path) if i and isinstance(v, int))
            hop = path[at]  # the first rank on the path: the gateway
            # its address on the cable or switch segment it shares with this rank
            via = topo.address(hop, topo.link_between(path[at - 1], hop))
            for addr in topo.addresses(dst):
                if addr.network in connected and hop == dst:
                    continue  # on a shared subnet: the kernel's connected route reaches it
                lines.append(f"route replace {addr.ip}/32 via {via.ip} dev {self.dev(first)}")
        return "\n".join(lines) + ("\n" if lines else "")

    def down(self) -> None:
        """Delete every namespace this emulator created (idempotent).

        SIGINT and SIGTERM are ignored until it is done, so a second Ctrl-C cannot cut the
        teardown short; then the handlers from before the emulator are back.
        """
        for sig in self._old_handlers:
            signal.signal(sig, signal.SIG_IGN)
        try:
            for name in reversed(self.created):
                _delete(name)
            self.created.clear()
        finally:
            self._restore_handlers()

    def _restore_handlers(self) -> None:
        for sig, handler in self._old_handlers.items():
            signal.signal(sig, handler)
        self._old_handlers.clear()

    # -- use ---------------------------------------------------------------------------------

    def run(self, rank: int, args: list[str], **kwargs: object) -> subprocess.CompletedProcess:
        """Run ``args`` inside rank ``rank``'s namespace (no shell) and return the result."""
        return subprocess.run(["ip", "netns", "exec", self.ns(rank), *args], **kwargs)

    def popen(self, rank: int, args: list[str], **kwargs: object) -> subprocess.Popen:
        """Start ``args`` inside rank ``rank``'s namespace."""
        return subprocess.Popen(["ip", "netns", "exec", self.ns(rank), *args], **kwargs)

    def senders(self) -> list[Sender]:
        """Return every link direction's sending end, where its counters are read.

        The device in ``link.a``'s namespace sends a -> b, the one in ``link.b``'s b -> a.
        Plain data, so a process that did not build the network can read the counters.
        """
        return [Sender(link.index, forward, self.ns(end), self.dev(link))
                for link in self.topo.links
                for forward, end in ((True, link.a), (False, link.b))]

    def tx_counters(self) -> dict[tuple[int, bool], tuple[int, int]]:
        """Return ``{(link index, a_to_b): (bytes, packets)}`` sent so far on every direction."""
        return tx_counters(self.senders())

    def drops(self) -> dict[tuple[int, bool], int]:
        """Return ``{(link index, a_to_b): packets}`` the shapers dropped so far (queue full)."""
        return drops(self.senders())


class Sender(NamedTuple):
    """The sending end of one link direction: where its counters live."""

    link: int
    a_to_b: bool
    namespace: str
    device: str


def _per_direction(senders: list[Sender], read: Callable[[str], dict[str, object]]) -> dict:
    # read(namespace) -> {device: value}, once per namespace, mapped onto link directions
    per_ns = {ns: read(ns) for ns in dict.fromkeys(s.namespace for s in senders)}
    return {(s.link, s.a_to_b): per_ns[s.namespace][s.device] for s in senders}


def tx_counters(senders: list[Sender]) -> dict[tuple[int, bool], tuple[int, int]]:
    """Return ``{(link index, a_to_b): (bytes, packets)}`` sent so far by each sender."""
    def read(ns: str) -> dict[str, object]:
        stats = json.loads(_run(["ip", "-j", "-s", "-n", ns, "link", "show"]))
        return {s["ifname"]: (s["stats64"]["tx"]["bytes"], s["stats64"]["tx"]["packets"])
                for s in stats}

    return _per_direction(senders, read)


def drops(senders: list[Sender]) -> dict[tuple[int, bool], int]:
    """Return ``{(link index, a_to_b): packets}`` each sender's shapers dropped so far.

    A link direction's drops are those of every qdisc on the sending veth end (tbf, and netem
    when the link has a delay).
    """
    def read(ns: str) -> dict[str, object]:
        per_dev: dict[str, int] = {}
        for q in json.loads(_run(["tc", "-j", "-s", "-n", ns, "qdisc", "show"])):
            per_dev[q["dev"]] = per_dev.get(q["dev"], 0) + q.get("drops", 0)
        return per_dev

    return _per_direction(senders, read)
