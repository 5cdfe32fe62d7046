"""Topology files, routes, addresses and the traced model (no root needed)."""

from pathlib import Path

import pytest

from bitcomm.collectives import (
    alltoall_majority_bytes,
    onebit_allreduce_bytes,
    ring_majority_bytes,
)
from bitcomm.netem import model
from bitcomm.netem.topology import TopologyError, from_dict, load, parse_delay, parse_rate

CONFIGS = Path(__file__).parent.parent / "bitcomm" / "configs" / "topologies"
DATA = Path(__file__).parent / "data"


def test_rates_and_delays():
    assert parse_rate("500MB/s") == 500e6
    assert parse_rate("100Mbit/s") == 12.5e6
    # tc's spellings, documented in the schema: mbps is bytes (as tc reads it), mbit bits
    assert parse_rate("100mbps") == 100e6 and parse_rate("100mbit") == 12.5e6
    assert parse_rate("1GB/s") == 1e9
    assert parse_delay("1ms") == 1e-3 and parse_delay("250us") == 250e-6
    with pytest.raises(TopologyError, match="expected a rate like 500MB/s"):
        parse_rate("fast")
    with pytest.raises(TopologyError, match="positive rate"):
        parse_rate(0)
    with pytest.raises(TopologyError, match="expected a delay like 1ms"):
        parse_delay("soon")


def base(**kw):
    doc = {"name": "t", "nodes": 3, "links": [{"a": 0, "b": 1, "rate": "1MB/s"},
                                              {"a": 1, "b": 2, "rate": "2MB/s"}]}
    doc.update(kw)
    return doc


@pytest.mark.parametrize("change, message", [
    ({"nodes": 0}, r"nodes to be an int in 2\.\.254"),
    ({"name": "Bad Name"}, r"name to match \[a-z0-9-\]\+"),
    ({"links": [{"a": 0, "b": 5, "rate": "1MB/s"}]}, r"links\[0\]: expected b to be a rank in "
                                                     r"0..2"),
    ({"links": [{"a": 0, "b": 0, "rate": "1MB/s"}]}, "two different ends"),
    ({"links": [{"a": 0, "b": 1, "rate": "1MB/s"}, {"a": 1, "b": 0, "rate": "1MB/s"}]},
     "a second link between 1 and 0"),
    ({"links": [{"a": 0, "b": 1, "rate": "1MB/s"}]}, r"not reachable from rank 0: \[2\]"),
    ({"links": [{"a": 0, "b": 1}]}, "expected keys a, b, rate"),
    ({"scale": -1}, "scale to be a finite number > 0"),
    ({"colour": "red"}, r"unknown keys \['colour'\]"),
    ({"switches": ["S 1"]}, "switch names are 1-16 characters"),
    ({"switches": "s0"}, "switches to be a list of names"),
    # ranges: what tc, the address plan and one machine's memory can hold
    ({"nodes": 1, "links": []}, r"nodes to be an int in 2\.\.254"),
    ({"nodes": 10_000}, r"nodes to be an int in 2\.\.254"),
    ({"links": [{"a": 0, "b": 1, "rate": float("inf")}]}, r"links\[0\]\.rate: expected a finite"),
    ({"links": [{"a": 0, "b": 1, "rate": 1e30}]}, r"links\[0\]: expected a rate .* at most"),
    ({"links": [{"a": 0, "b": 1, "rate": 1e-9}]}, r"links\[0\]: expected a rate .* at least"),
    ({"links": [{"a": 0, "b": 1, "rate": "1MB/s", "delay": float("nan")}]},
     r"links\[0\]\.delay: expected a finite"),
    ({"links": [{"a": 0, "b": 1, "rate": "1MB/s", "delay": 1e6}]}, r"delay .* at most 10 s"),
    ({"scale": float("inf")}, r"scale to be a finite number"),
    ({"switches": ["r0"]}, r"switch names .* r<digits> .* rank namespaces"),
    ({"switches": ["s" * 17]}, r"switch names are 1-16 characters"),
])
def test_schema_errors_say_where(change, message):
    with pytest.raises(TopologyError, match=message):
        from_dict(base(**change), "t.yaml")


def test_a_file_that_is_not_text_is_a_topology_error(tmp_path):
    f = tmp_path / "noise.yaml"
    f.write_bytes(bytes(range(256)) * 4)
    with pytest.raises(TopologyError, match="noise.yaml: not a UTF-8 text file"):
        load(f)


def test_more_links_than_the_address_plan_holds_are_refused():
    # link i gets 10.77.(i >> 6).((i & 63) << 2)/30: 16384 links fill 10.77.0.0/16
    ends = [(a, b) for a in range(200) for b in range(a + 1, 200)][:16385]
    links = [{"a": a, "b": b, "rate": "1MB/s"} for a, b in ends]
    with pytest.raises(TopologyError, match="at most 16384 links"):
        from_dict({"name": "mesh", "nodes": 200, "links": links})


def test_scale_divides_rates_and_paths_are_shortest():
    t = from_dict(base(scale=4))
    assert [link.rate for link in t.links] == [0.25e6, 0.5e6]
    assert t.path(0, 2) == [0, 1, 2]
    assert [(link.index, fwd) for link, fwd in t.route_links(2, 0)] == [(1, False), (0, False)]


def test_every_config_loads_with_the_papers_rates():
    names = sorted(p.stem for p in CONFIGS.glob("*.yaml"))
    assert names == ["chain-16", "chain-32", "cluster-16", "cluster-32", "hetero-16",
                     "hetero-32", "pair", "star-16"]
    for name in names:
        t = load(CONFIGS / f"{name}.yaml")
        if name == "pair":  # not a paper's: bench hooks' 100 Mbit/s link between 2 workers
            assert t.nodes == 2 and [link.rate for link in t.links] == [12.5e6]
            continue
        unscaled = sorted({round(link.rate * t.scale / 1e6) for link in t.links})
        if name.startswith("chain"):
            assert unscaled == [100, 500] and t.slowest_link().index == t.nodes // 2 - 1
        elif name.startswith("cluster"):
            assert unscaled == [100, 1000] and t.slowest_link().ends() == ("s0", "s1")
        elif name == "hetero-16":
            assert 100 <= unscaled[0] and unscaled[-1] <= 250
        elif name == "hetero-32":
            assert 20 <= unscaled[0] and unscaled[-1] <= 150
        else:
            assert unscaled == [100] and len(t.switches) == 1


def test_cluster_routes_cross_the_trunk():
    t = load(CONFIGS / "cluster-16.yaml")
    assert t.path(3, 12) == [3, "s0", "s1", 12]
    assert t.path(3, 5) == [3, "s0", 5]
    assert str(t.address(3, t.links[3])) == "10.78.0.4/24"


def test_addresses_are_unique_and_on_their_link():
    t = load(CONFIGS / "chain-32.yaml")
    seen = set()
    for link in t.links:
        a, b = t.address(link.a, link), t.address(link.b, link)
        assert a.network == b.network and a.ip != b.ip
        seen |= {a.ip, b.ip}
    assert len(seen) == 2 * len(t.links)


@pytest.mark.parametrize("algorithm, formula", [
    ("ring-majority", lambda n, s, r: ring_majority_bytes(n, s, r, check=False)),
    ("alltoall-majority", lambda n, s, r: alltoall_majority_bytes(n, s, r, check=False)),
    ("onebit-allreduce", lambda n, s, r: onebit_allreduce_bytes(n, s, check=False)),
])
def test_traced_schedule_matches_the_byte_formulas(algorithm, formula):
    for size, n in ((4, 1000), (5, 4099)):
        phases = model.trace(algorithm, n, size)
        for r in range(size):
            # traced without the input agreement (check=False), as the experiments time them
            assert sum(b for p in phases for s, _, b, _ in p if s == r) == formula(n, size, r)
        # the ring sends ahead (isend); the all-to-all rounds wait for their sends
        assert all(m[3] == (algorithm != "ring-majority") for p in phases for m in p)


def test_model_reproduces_the_papers_analysis():
    """Chain: the all-to-all pushes ~2x (N=16) and ~3.2x (N=32) the ring's bytes over the slow
    link (Table 1's speedups); star: no slow link, the all-to-all is faster."""
    n = 1 << 18
    for name, lo, hi in (("chain-16", 1.95, 2.05), ("chain-32", 3.1, 3.3)):
        t = load(CONFIGS / f"{name}.yaml")
        slow = t.slowest_link().index
        ring = model.predict(t, "ring-majority", n)
        a2a = model.predict(t, "alltoall-majority", n)
        # all-to-all: (N/2)^2 chunks of K/(8N) bytes cross per direction, in each of two phases
        assert a2a.link_payload(slow, True) == pytest.approx(n / 8 * t.nodes / 2, rel=0.02)
        assert lo < a2a.link_payload(slow, True) / ring.link_payload(slow, True) < hi
        assert a2a.seconds > ring.seconds
    t = load(CONFIGS / "star-16.yaml")
    assert (model.predict(t, "alltoall-majority", n).seconds
            < model.predict(t, "ring-majority", n).seconds)


def test_test_topology_loads():
    t = load(DATA / "chain-4.yaml")
    assert t.slowest_link().rate == 0.5e6 and t.links[1].index == 1


def test_link_check_pairs_make_each_link_the_bottleneck():
    from bitcomm.netem.linkcheck import pair_for

    chain = load(CONFIGS / "chain-16.yaml")
    assert [pair_for(chain, link) for link in chain.links[:3]] == [(0, 1), (1, 2), (2, 3)]
    cluster = load(CONFIGS / "cluster-16.yaml")
    trunk = cluster.slowest_link()
    u, v = pair_for(cluster, trunk)
    assert u < 8 <= v  # one rank in each cluster
    for link in cluster.links:
        u, v = pair_for(cluster, link)
        hops = cluster.route_links(u, v)
        assert link.index in [h.index for h, _ in hops]
        assert min(h.rate for h, _ in hops) == link.rate


def test_emulator_tcp_settings_follow_the_slowest_link():
    from bitcomm.netem.emulator import Emulator

    chain = load(CONFIGS / "chain-32.yaml")  # slowest 100 MB/s / 250
    assert Emulator(chain, window=0.32).receive_buffer() == int(0.4e6 * 0.32)
    assert Emulator(chain, window=0.01).receive_buffer() == 64 << 10  # the floor
    assert Emulator(chain, window=None).receive_buffer() is None
    # shaper queues: 0.5 s of the rate, but never under a few of the ring's messages
    slow, fast = chain.slowest_link(), chain.links[0]
    assert (slow.rate, fast.rate) == (0.4e6, 2e6)
    assert Emulator(chain).queue_bytes(slow) == 400_000  # the floor, not 0.5 s (200 KB)
    assert Emulator(chain).queue_bytes(fast) == 1_000_000
    assert Emulator(chain, queue=2.0).queue_bytes(slow) == 800_000
    with pytest.raises(ValueError, match="expected window > 0 seconds or None, got 0"):
        Emulator(chain, window=0)
    with pytest.raises(ValueError, match="expected queue > 0 seconds, got -1"):
        Emulator(chain, queue=-1)


def _row(algorithm, seconds, cpu_seconds, n=1 << 12):
    # a measured row as bitcomm.netem.worker writes it, for a 3-node chain (links 0 and 1)
    from bitcomm.netem.results import Measurement

    return Measurement(topology="t", ranks=3, algorithm=algorithm, n=n, seconds=seconds,
                       times=[seconds], wrong=0, cpu_seconds=cpu_seconds,
                       link_bytes={"0:ab": [2000, 10], "0:ba": [1000, 5],
                                   "1:ab": [2000, 10], "1:ba": [1000, 5]},
                       drops={"0:ab": 3, "0:ba": 1, "1:ab": 0, "1:ba": 2},
                       tcp_retrans=7.5, tcp_timeouts=1)


def test_analyse_reports_how_busy_the_cores_were_and_the_table_shows_it():
    from bitcomm.netem import report
    from bitcomm.netem.experiment import CPU_BOUND, analyse

    topo = from_dict(base())
    cells = analyse(topo, [_row("ring-majority", 2.0, 3.2), _row("alltoall-majority", 4.0, 1.0)],
                    ncores=2)
    ring, a2a = cells
    assert ring.cpu_share == pytest.approx(3.2 / (2 * 2.0)) and ring.cpu_share > CPU_BOUND
    assert a2a.cpu_share == pytest.approx(1.0 / (2 * 4.0)) and a2a.cpu_share < CPU_BOUND
    assert ring.speedup == pytest.approx(2.0) and a2a.speedup == pytest.approx(1.0)
    # payload from the counters: bytes - 66 per frame, on the slowest link (0, 1 MB/s)
    assert ring.slow_link == "0-1"
    assert ring.slow_link_payload in (2000 - 66 * 10, 1000 - 66 * 5)
    text = report.table(cells)
    assert "cpu%" in text.splitlines()[0]
    assert [line.split()[-3:-1] for line in text.splitlines()[1:]] == [["80", "8"], ["12", "8"]]
    # losses: all links' drops, the slowest link's both directions, TCP's resends as measured
    assert (ring.drops, ring.slow_link_drops, ring.tcp_retrans) == (6, 4, 7.5)
    assert report.markdown(cells).splitlines()[-1].endswith("| 80% |")  # the busier of the two


def test_finished_experiment_warns_about_cpu_bound_cells(tmp_path, capsys):
    from bitcomm.cli import _finish_experiment
    from bitcomm.netem.experiment import analyse

    topo = from_dict(base())

    def finish(ring_cpu):
        cells = analyse(topo, [_row("ring-majority", 2.0, ring_cpu),
                               _row("alltoall-majority", 4.0, 1.0)], ncores=2)
        _finish_experiment(cells, {}, tmp_path)
        return capsys.readouterr().err

    assert "1 cells kept the CPU over 75% busy (t)" in finish(3.2)
    assert "busy" not in finish(1.0)
    assert (tmp_path / "results.json").exists() and (tmp_path / "table.md").exists()
    # results.json's rows carry the Cell's fields under their own names
    import dataclasses
    import json

    from bitcomm.netem.results import Cell

    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert [set(r) for r in rows] == [{f.name for f in dataclasses.fields(Cell)}] * 2
    assert rows[0]["speedup"] == pytest.approx(2.0)


def test_direction_keys_name_the_link_and_its_direction():
    from bitcomm.netem.topology import direction_key

    assert (direction_key(3, True), direction_key(3, False), direction_key(12, True)) == (
        "3:ab", "3:ba", "12:ab")


def test_worker_spec_holds_what_a_rank_needs_as_plain_data():
    import json

    from bitcomm.netem.emulator import Emulator
    from bitcomm.netem.experiment import Experiment, worker_spec

    topo = load(CONFIGS / "chain-16.yaml")
    net = Emulator(topo, "bitcomm-spec-")  # names only: nothing is built
    exp = Experiment("x", ["chain-16"], [1024, 4096], ["ring-majority"], repeat=2, seed=7)
    spec = worker_spec(topo, net, exp, Path("/tmp/rows.json"))
    assert json.loads(json.dumps(spec)) == spec
    assert (spec["ranks"], spec["sizes"], spec["algorithms"], spec["repeat"], spec["seed"]) == (
        16, [1024, 4096], ["ring-majority"], 2, 7)
    assert len(set(spec["namespaces"])) == 16
    assert all(ns.startswith("bitcomm-spec-") for ns in spec["namespaces"])
    # every link direction once, read at its sending end: link.a's namespace sends a -> b
    assert sorted((s[0], s[1]) for s in spec["senders"]) == sorted(
        (link.index, d) for link in topo.links for d in (True, False))
    for index, a_to_b, ns, _ in spec["senders"]:
        link = topo.links[index]
        assert ns == net.ns(link.a if a_to_b else link.b)


def test_link_check_rows_compare_iperf3_goodput_with_each_links_rate(monkeypatch):
    # iperf3 and namespaces replaced by fakes: what is checked is the row each link gets
    import json
    import types

    from bitcomm.netem import linkcheck

    topo = load(DATA / "chain-4.yaml")
    runs = []

    class Done:
        returncode, stderr = 0, ""
        stdout = json.dumps({"end": {"sum_received": {"bits_per_second": 8e5}}})

        def poll(self):
            return 0

    def run(rank, args, **kwargs):
        runs.append((rank, args[args.index("-c") + 1]))
        return Done()
    net = types.SimpleNamespace(topo=topo, popen=lambda *a, **k: Done(), run=run)
    monkeypatch.setattr(linkcheck.shutil, "which", lambda name: "/usr/bin/iperf3")
    monkeypatch.setattr(linkcheck.time, "sleep", lambda s: None)
    rows = linkcheck.check_links(net, 0.1, progress=lambda line: None)
    assert [(r.link, r.pair, r.rate) for r in rows] == [
        (link.index, list(linkcheck.pair_for(topo, link)), link.rate) for link in topo.links]
    assert all(r.goodput == 1e5 and r.ratio == 1e5 / r.rate for r in rows)
    # each client sent to its receiver's first address
    assert runs == [(r.pair[0], str(topo.addresses(r.pair[1])[0].ip)) for r in rows]


def test_alpha_beta_of_a_topology_feeds_the_sparse_choice():
    from bitcomm.collectives import sparcml

    t = load(DATA / "chain-4.yaml")
    alpha, beta = model.alpha_beta(t)
    # the longest path, 0 -> 3, crosses 3 links without delay: one 1514-byte frame each
    assert alpha == pytest.approx(1514 / 2e6 + 1514 / 0.5e6 + 1514 / 2e6)
    assert beta == pytest.approx(1 / 0.5e6)  # the centre link
    # 4 ranks at 1% of 1M: recursive doubling; on its slow links a filled-in sum goes dense
    assert sparcml.choose(1 << 20, 10_000, 4, alpha=alpha, beta=beta).algorithm == \
        "ssar_recursive_double"
    assert sparcml.choose(1 << 20, 200_000, 4, alpha=alpha, beta=beta).algorithm == \
        "dsar_split_allgather"


@pytest.mark.parametrize("density", ["1%", "25%"])
def test_the_sparse_choice_prices_as_the_traced_model_does(density):
    """sparcml.choose's closed form (uniform indices, E[K]) against the model's trace of the
    collectives on a star's alpha and beta: within 5% for every algorithm."""
    from bitcomm.collectives import sparcml

    t = load(CONFIGS / "star-16.yaml")
    alpha, beta = model.alpha_beta(t)
    n = 1 << 15
    k = round(float(density[:-1]) / 100 * n)
    priced = sparcml.choose(n, k, 16, alpha=alpha, beta=beta).seconds
    for name in ("ssar-recursive-double", "ssar-split-allgather", "dsar-split-allgather",
                 "stream-allgather"):
        traced = model.predict(t, f"{name}@{density}", n).seconds
        assert priced[name.replace("-", "_")] == pytest.approx(traced, rel=0.05), name
