"""Network topologies for the emulator: a documented YAML schema, validation, routes, addresses.

Schema (``bitcomm/configs/topologies/*.yaml``, or a file of one's own)::

    name: chain-16               # required, [a-z0-9-]
    description: free text       # optional
    nodes: 16                    # required, 2..254: ranks 0..nodes-1, one network namespace each
    switches: [s0, s1]           # optional names ([a-z][a-z0-9]*, 1-16 characters, not r<digits>,
                                 # which name the ranks' namespaces), a Linux bridge each
    scale: 100                   # optional (default 1, finite): every rate is divided by it
    links:                       # required: one entry per cable
      - {a: 0, b: 1, rate: 500MB/s}              # endpoint: a rank or a switch name
      - {a: 7, b: 8, rate: 100MB/s, delay: 1ms}  # delay (netem) is optional

Rates take the units ``B/s``, ``KB/s``, ``MB/s``, ``GB/s`` (decimal bytes, as the paper's
MBps) and ``Kbit/s``, ``Mbit/s``, ``Gbit/s``, and tc's spellings: ``bps``, ``kbps``, ``mbps``,
``gbps`` are bytes per second as in tc (``100mbps`` is 100 MB/s, not 100 Mbit/s), ``kbit``,
``mbit``, ``gbit`` bits; delays ``us``, ``ms``, ``s``. Every link is full
duplex: each direction is shaped to ``rate / scale`` on its own. A link may appear once per pair
of endpoints. The graph must be connected, and every rank needs at least one link.

Ranges, each refused with a :class:`TopologyError` that says where: a scaled rate in 1 KB/s..100
GB/s (slower links make tc's token bucket and the model meaningless; faster ones exceed any veth
pair), a delay in 0..10 s, at most 254 ranks and 254 switches (a switch segment's ranks take host
parts ``rank + 1`` of one /24) and at most 16384 links (the /30 subnets of ``10.77.0.0/16``).

Routing: packets follow a shortest path in hops (switches count as hops), ties broken towards
the lower-numbered neighbour, the same for every flow, so the model and the emulator agree on
which links each flow crosses (:meth:`Topology.path`).

Addresses: link ``i`` between two ranks is the subnet ``10.77.(i >> 6).((i & 63) << 2)/30``
(``.1`` for ``a``, ``.2`` for ``b``); the ranks attached to switch segment ``j`` (a connected
group of switches) share ``10.78.j.0/24`` with host part ``rank + 1``.
"""

from __future__ import annotations

import dataclasses
import heapq
import ipaddress
import math
import re
from pathlib import Path

from bitcomm import configs

__all__ = ["Link", "Topology", "load", "parse_rate", "parse_delay", "TopologyError",
           "direction_key"]


def direction_key(index: int, a_to_b: bool) -> str:
    """Return the key of one link direction in result files: ``"3:ab"`` (a to b) or ``"3:ba"``."""
    return f"{index}:{'ab' if a_to_b else 'ba'}"


class TopologyError(ValueError):
    """A topology file or dict that does not follow the schema; the message says where."""


_RATE_UNITS = {"b/s": 1, "kb/s": 1e3, "mb/s": 1e6, "gb/s": 1e9,
               "kbit/s": 1e3 / 8, "mbit/s": 1e6 / 8, "gbit/s": 1e9 / 8,
               "bps": 1, "kbps": 1e3, "mbps": 1e6, "gbps": 1e9,
               "kbit": 1e3 / 8, "mbit": 1e6 / 8, "gbit": 1e9 / 8}
_DELAY_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0}
_NAME = re.compile(r"[a-z0-9][a-z0-9-]*")
_SWITCH = re.compile(r"[a-z][a-z0-9]{0,15}")
_RANK_NS = re.compile(r"r[0-9]+")  # the ranks' namespaces end in -r<rank>
MAX_NODES = 254
"""Ranks (and switches) a topology may have: host parts 1..254 of a switch segment's /24."""
MAX_LINKS = 1 << 14
"""Links a topology may have: the /30 subnets of ``10.77.0.0/16``."""
MIN_RATE, MAX_RATE = 1e3, 1e11
"""The range of a link's scaled rate, in bytes per second."""
MAX_DELAY = 10.0
"""The largest link delay, in seconds."""


def parse_rate(value: object, where: str = "rate") -> float:
    """Return a rate in bytes per second from ``"500MB/s"``, ``"100Mbit/s"`` or a number."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        rate = float(value)
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z/]+)\s*", str(value))
        unit = m.group(2).lower() if m else ""
        if not m or unit not in _RATE_UNITS:
            raise TopologyError(f"{where}: expected a rate like 500MB/s or 100Mbit/s, got "
                                f"{value!r}")
        rate = float(m.group(1)) * _RATE_UNITS[unit]
    if not math.isfinite(rate):
        raise TopologyError(f"{where}: expected a finite rate, got {value!r}")
    if not rate > 0:
        raise TopologyError(f"{where}: expected a positive rate, got {value!r}")
    return rate


def parse_delay(value: object, where: str = "delay") -> float:
    """Return a delay in seconds from ``"1ms"``, ``"250us"`` or a number of seconds."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        delay = float(value)
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(us|ms|s)\s*", str(value))
        if not m:
            raise TopologyError(f"{where}: expected a delay like 1ms or 250us, got {value!r}")
        delay = float(m.group(1)) * _DELAY_UNITS[m.group(2)]
    if not math.isfinite(delay):
        raise TopologyError(f"{where}: expected a finite delay, got {value!r}")
    if delay < 0:
        raise TopologyError(f"{where}: expected a delay >= 0, got {value!r}")
    if delay > MAX_DELAY:
        raise TopologyError(f"{where}: expected a delay of at most {MAX_DELAY:g} s, got "
                            f"{value!r}")
    return delay


@dataclasses.dataclass(frozen=True)
class Link:
    """One full-duplex cable: endpoints (rank int or switch name), rate (B/s, scaled), delay."""

    index: int
    a: int | str
    b: int | str
    rate: float
    delay: float = 0.0

    def ends(self) -> tuple[int | str, int | str]:
        """Return the two endpoints."""
        return self.a, self.b


Vertex = int | str


@dataclasses.dataclass
class Topology:
    """A validated topology; rates are already divided by ``scale``."""

    name: str
    nodes: int
    switches: tuple[str, ...]
    links: tuple[Link, ...]
    scale: float = 1.0
    description: str = ""

    def __post_init__(self) -> None:
        self._adj: dict[Vertex, list[tuple[Vertex, Link]]] = {v: [] for v in self.vertices()}
        for link in self.links:
            self._adj[link.a].append((link.b, link))
            self._adj[link.b].append((link.a, link))
        for v in self._adj:
            self._adj[v].sort(key=lambda e: _order(e[0]))
        self._segments = self._find_segments()
        self._paths: dict[tuple[int, int], list[Vertex]] = {}

    # -- structure ---------------------------------------------------------------------------

    def vertices(self) -> list[Vertex]:
        """Return ranks then switches."""
        return [*range(self.nodes), *self.switches]

    def neighbours(self, v: Vertex) -> list[tuple[Vertex, Link]]:
        """Return ``(neighbour, link)`` pairs of ``v``, lower-numbered neighbours first."""
        return self._adj[v]

    def link_between(self, u: Vertex, v: Vertex) -> Link:
        """Return the link joining ``u`` and ``v``."""
        for w, link in self._adj[u]:
            if w == v:
                return link
        raise KeyError(f"no link between {u!r} and {v!r}")

    def path(self, src: int, dst: int) -> list[Vertex]:
        """Return the vertices of the route from rank ``src`` to rank ``dst`` (both included)."""
        if src == dst:
            return [src]
        if (src, dst) in self._paths:
            return list(self._paths[(src, dst)])
        # Dijkstra on hop counts with (hops, tie-break key) so ties go to lower neighbours.
        best: dict[Vertex, tuple] = {src: (0, ())}
        prev: dict[Vertex, Vertex] = {}
        heap = [(0, (), _order(src), src)]
        while heap:
            hops, key, _, v = heapq.heappop(heap)
            if (hops, key) != best.get(v):
                continue
            if v == dst:
                break
            for w, _link in self._adj[v]:
                cand = (hops + 1, key + (_order(w),))
                if w not in best or cand < best[w]:
                    best[w] = cand
                    prev[w] = v
                    heapq.heappush(heap, (*cand, _order(w), w))
        out = [dst]
        while out[-1] != src:
            out.append(prev[out[-1]])
        self._paths[(src, dst)] = out[::-1]
        return out[::-1]

    def route_links(self, src: int, dst: int) -> list[tuple[Link, bool]]:
        """Return the links a packet from ``src`` to ``dst`` crosses, with its direction.

        The flag is True when the packet travels from the link's ``a`` end to its ``b`` end.
        """
        p = self.path(src, dst)
        out = []
        for u, v in zip(p, p[1:], strict=False):
            link = self.link_between(u, v)
            out.append((link, link.a == u))
        return out

    # -- switch segments and addresses -------------------------------------------------------

    def _find_segments(self) -> list[tuple[str, ...]]:
        seen: set[str] = set()
        segments = []
        for s in self.switches:
            if s in seen:
                continue
            group, todo = [], [s]
            seen.add(s)
            while todo:
                cur = todo.pop()
                group.append(cur)
                for w, _ in self._adj[cur]:
                    if isinstance(w, str) and w not in seen:
                        seen.add(w)
                        todo.append(w)
            segments.append(tuple(sorted(group)))
        return segments

    def segment_of(self, switch: str) -> int:
        """Return the index of the switch segment (connected switches) holding ``switch``."""
        for j, seg in enumerate(self._segments):
            if switch in seg:
                return j
        raise KeyError(switch)

    def segments(self) -> list[tuple[str, ...]]:
        """Return the switch segments, each a tuple of switch names."""
        return list(self._segments)

    def address(self, rank: int, link: Link) -> ipaddress.IPv4Interface:
        """Return the address (with prefix) of ``rank`` on ``link``."""
        other = link.b if link.a == rank else link.a
        if isinstance(other, str):
            j = self.segment_of(other)
            return ipaddress.IPv4Interface(f"10.78.{j}.{rank + 1}/24")
        i = link.index
        base = (10 << 24) | (77 << 16) | ((i >> 6) << 8) | ((i & 63) << 2)
        host = 1 if link.a == rank else 2
        return ipaddress.IPv4Interface((base + host, 30))

    def addresses(self, rank: int) -> list[ipaddress.IPv4Interface]:
        """Return every address of ``rank``, one per link, in link order."""
        return [self.address(rank, link) for _, link in self._adj[rank]]

    # -- summaries ---------------------------------------------------------------------------

    def slowest_link(self) -> Link:
        """Return the link with the lowest rate (the lowest index on ties)."""
        return min(self.links, key=lambda link: (link.rate, link.index))

    def describe(self) -> str:
        """Return a human-readable summary: nodes, switches and every link."""
        lines = [f"topology {self.name}: {self.nodes} ranks, {len(self.switches)} switches, "
                 f"{len(self.links)} links, scale 1/{self.scale:g}"]
        if self.description:
            lines.append(f"  {self.description.strip()}")
        for link in self.links:
            delay = f", delay {link.delay * 1e3:g} ms" if link.delay else ""
            lines.append(f"  link {link.index:>3}: {link.a!s:>4} <-> {link.b!s:<4} "
                         f"{link.rate / 1e6:10.3f} MB/s{delay}")
        return "\n".join(lines)


def _order(v: Vertex) -> tuple[int, int | str]:
    return (0, v) if isinstance(v, int) else (1, v)


def from_dict(data: object, source: str = "topology") -> Topology:
    """Validate a parsed topology document and return the :class:`Topology`."""
    if not isinstance(data, dict):
        raise TopologyError(f"{source}: expected a mapping at the top level, got "
                            f"{type(data).__name__}")
    known = {"name", "description", "nodes", "switches", "scale", "links"}
    extra = sorted(set(data) - known)
    if extra:
        raise TopologyError(f"{source}: unknown keys {extra}; expected some of {sorted(known)}")
    for key in ("name", "nodes", "links"):
        if key not in data:
            raise TopologyError(f"{source}: missing required key {key!r}")
    name = data["name"]
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise TopologyError(f"{source}: expected name to match [a-z0-9-]+, got {name!r}")
    nodes = data["nodes"]
    if isinstance(nodes, bool) or not isinstance(nodes, int) or not 2 <= nodes <= MAX_NODES:
        raise TopologyError(f"{source}: expected nodes to be an int in 2..{MAX_NODES}, got "
                            f"{nodes!r}")
    switches = data.get("switches") or []
    if not isinstance(switches, list) or not all(isinstance(s, str) for s in switches):
        raise TopologyError(f"{source}: expected switches to be a list of names like s0, got "
                            f"{switches!r}")
    bad = [s for s in switches if not _SWITCH.fullmatch(s) or _RANK_NS.fullmatch(s)]
    if bad:
        raise TopologyError(f"{source}: switch names are 1-16 characters from a-z and 0-9 "
                            f"starting with a letter, and not r<digits> (the rank namespaces' "
                            f"names), got {bad}")
    if len(set(switches)) != len(switches):
        raise TopologyError(f"{source}: switch names must be unique, got {switches}")
    if len(switches) > MAX_NODES:
        raise TopologyError(f"{source}: expected at most {MAX_NODES} switches, got "
                            f"{len(switches)}")
    scale = data.get("scale", 1)
    if (isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0
            or not math.isfinite(scale)):
        raise TopologyError(f"{source}: expected scale to be a finite number > 0, got "
                            f"{scale!r}")
    raw = data["links"]
    if not isinstance(raw, list) or not raw:
        raise TopologyError(f"{source}: expected links to be a non-empty list")
    if len(raw) > MAX_LINKS:
        raise TopologyError(f"{source}: expected at most {MAX_LINKS} links (the /30 subnets of "
                            f"10.77.0.0/16), got {len(raw)}")
    links, pairs = [], set()
    for i, entry in enumerate(raw):
        where = f"{source}: links[{i}]"
        if not isinstance(entry, dict):
            raise TopologyError(f"{where}: expected a mapping with a, b, rate, got {entry!r}")
        extra = sorted(set(entry) - {"a", "b", "rate", "delay"})
        if extra or not {"a", "b", "rate"} <= set(entry):
            raise TopologyError(f"{where}: expected keys a, b, rate (and optional delay), got "
                                f"{sorted(entry)}")
        ends = []
        for key in ("a", "b"):
            v = entry[key]
            if isinstance(v, bool) or not (isinstance(v, int) and 0 <= v < nodes
                                           or isinstance(v, str) and v in switches):
                raise TopologyError(f"{where}: expected {key} to be a rank in 0..{nodes - 1} or "
                                    f"a switch in {switches}, got {v!r}")
            ends.append(v)
        if ends[0] == ends[1]:
            raise TopologyError(f"{where}: a link needs two different ends, got {ends[0]!r} "
                                "twice")
        pair = frozenset(ends)
        if pair in pairs:
            raise TopologyError(f"{where}: a second link between {ends[0]!r} and {ends[1]!r}")
        pairs.add(pair)
        rate = parse_rate(entry["rate"], f"{where}.rate") / scale
        if not MIN_RATE <= rate <= MAX_RATE:
            raise TopologyError(f"{where}: expected a rate (after scale 1/{scale:g}) of at least "
                                f"{MIN_RATE / 1e3:g} KB/s and at most {MAX_RATE / 1e9:g} GB/s, "
                                f"got {rate:g} B/s")
        delay = parse_delay(entry.get("delay", 0), f"{where}.delay")
        links.append(Link(i, ends[0], ends[1], rate, delay))
    topo = Topology(name, nodes, tuple(switches), tuple(links), float(scale),
                    str(data.get("description", "")))
    _check_connected(topo, source)
    return topo


def _check_connected(topo: Topology, source: str) -> None:
    seen, todo = {0}, [0]
    while todo:
        v = todo.pop()
        for w, _ in topo.neighbours(v):
            if w not in seen:
                seen.add(w)
                todo.append(w)
    missing = [v for v in topo.vertices() if v not in seen]
    if missing:
        raise TopologyError(f"{source}: expected a connected network; not reachable from rank "
                            f"0: {missing}")


def load(path: str | Path, *, scale: float | None = None) -> Topology:
    """Load and validate a topology YAML file; ``scale`` overrides the file's."""
    import yaml  # pyyaml: imported here so the codec/collective layers never need it

    path = Path(path)
    if not path.is_file():
        raise TopologyError(f"{path}: no such topology file")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise TopologyError(f"{path}: not a UTF-8 text file") from None
    except yaml.YAMLError as e:
        raise TopologyError(f"{path}: not valid YAML: {e}") from None
    if scale is not None and isinstance(data, dict):
        data = {**data, "scale": scale}
    return from_dict(data, str(path))


def find(name: str) -> Path:
    """Return the file of topology ``name``: a ``.yaml`` path, or a shipped topology's name.

    Shipped topologies (:mod:`bitcomm.configs`) are found from any directory; a name that looks
    like a path must be an existing file (``TopologyError`` otherwise, listing the names).
    """
    try:
        return configs.find("topologies", name)
    except ValueError as e:
        raise TopologyError(str(e)) from None
