"""The namespace emulator on a 4-rank chain (needs root and iproute2, as CI has)."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bitcomm.netem.emulator import Emulator, namespaces, requirements, sweep
from bitcomm.netem.experiment import Experiment, analyse, measure
from bitcomm.netem.model import payload_from_counters
from bitcomm.netem.topology import load

pytestmark = pytest.mark.skipif(bool(requirements()),
                                reason="needs " + "; ".join(requirements()))

CHAIN = Path(__file__).parent / "data" / "chain-4.yaml"
MPIEXEC = Path(sys.executable).with_name("mpiexec")

SERVER = """
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", 5999)); s.listen(1); print("ready", flush=True)
c, _ = s.accept(); n = 0
while True:
    d = c.recv(1 << 16)
    if not d: break
    n += len(d)
print(n, flush=True)
"""
CLIENT = """
import socket, sys, time
s = socket.create_connection((sys.argv[1], 5999)); t0 = time.perf_counter()
s.sendall(b"x" * int(sys.argv[2])); s.shutdown(socket.SHUT_WR); s.recv(1)
print(time.perf_counter() - t0, flush=True)
"""


def ours(prefix):
    return [ns for ns in namespaces() if ns.startswith(prefix)]


@pytest.mark.timeout(120)
def test_shaping_routes_and_teardown():
    topo = load(CHAIN)
    with Emulator(topo, window=0.32) as net:
        prefix = net.prefix
        assert len(ours(prefix)) == 4
        # every rank's TCP receive buffer is capped at 0.32 s of the slow link (0.5 MB/s)
        for rank in range(4):
            rmem = net.run(rank, ["sysctl", "-n", "net.ipv4.tcp_rmem"], capture_output=True,
                           text=True, check=True).stdout.split()
            assert rmem == ["4096", "131072", "160000"], rmem
        dst = str(topo.addresses(3)[0].ip)
        server = net.popen(3, [sys.executable, "-c", SERVER], stdout=subprocess.PIPE, text=True)
        assert server.stdout.readline().strip() == "ready"
        before = net.tx_counters()
        nbytes = 1_000_000
        out = net.run(0, [sys.executable, "-c", CLIENT, dst, str(nbytes)], capture_output=True,
                      text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert int(server.communicate(timeout=30)[0].strip()) == nbytes
        seconds = float(out.stdout)
        after = net.tx_counters()
        # the slow centre link (0.5 MB/s) sets the time: at least bytes / rate
        assert seconds >= nbytes / 0.5e6
        assert seconds < 1.3 * nbytes / 0.5e6 + 1  # and the shaper does not starve it
        for link in topo.links:  # every hop of the path carried it
            sent, packets = (after[(link.index, True)][i] - before[(link.index, True)][i]
                             for i in (0, 1))
            payload = payload_from_counters(sent, packets)
            # Device counters count what left after the shaper: from the slow link on, the
            # payload once (spurious retransmissions aside); the fast link before it also
            # carries the retransmissions of what the slow link's full queue dropped.
            upper = 1.05 if link.index >= 1 else 1.6
            assert nbytes <= payload < upper * nbytes, (link.index, payload)
    assert ours(prefix) == []


BLAST = """
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
for _ in range(600):
    s.sendto(b"u" * 1400, (sys.argv[1], 6000))
"""
TCP_COUNTERS = "from bitcomm.netem.worker import tcp_counters; print(*tcp_counters())"


@pytest.mark.timeout(120)
def test_shaper_drops_and_tcp_resends_are_counted_where_they_happen():
    topo = load(CHAIN)  # 2 MB/s, 0.5 MB/s, 2 MB/s; queues 1 MB, 400 KB (the floor), 1 MB

    def resent(rank):
        out = net.run(rank, [sys.executable, "-c", TCP_COUNTERS], capture_output=True,
                      text=True, check=True, timeout=60)
        return tuple(int(v) for v in out.stdout.split())

    with Emulator(topo) as net:
        assert net.drops() == {(i, d): 0 for i in range(3) for d in (True, False)}
        assert resent(0) == resent(3) == (0, 0)  # a fresh namespace's own TCP counters
        dst = str(topo.addresses(3)[0].ip)
        server = net.popen(3, [sys.executable, "-c", SERVER], stdout=subprocess.PIPE, text=True)
        assert server.stdout.readline().strip() == "ready"
        client = net.popen(0, [sys.executable, "-c", CLIENT, dst, str(1_000_000)],
                           stdout=subprocess.PIPE, text=True)
        time.sleep(0.5)  # the TCP flow is under way; 840 KB of UDP at 2 MB/s now overflows
        net.run(0, [sys.executable, "-c", BLAST, dst], check=True, timeout=60)  # the slow queue
        client.communicate(timeout=60)
        assert int(server.communicate(timeout=30)[0].strip()) == 1_000_000
        drops = net.drops()
        # only the slow link's forward queue overflowed: 2 MB/s in, 0.5 MB/s out
        assert drops[(1, True)] > 50, drops
        assert all(v == 0 for k, v in drops.items() if k != (1, True)), drops
        # and the sender, not the receiver, resent what was dropped of its flow
        assert resent(0)[0] > 0 and resent(3)[0] == 0


@pytest.mark.timeout(300)
@pytest.mark.skipif(not MPIEXEC.exists(), reason="mpiexec not installed (bitcomm[mpi])")
def test_ring_majority_over_the_chain_is_exact_and_crosses_the_links():
    topo = load(CHAIN)
    exp = Experiment("ci", [str(CHAIN)], [1 << 16], ["ring-majority", "alltoall-majority"],
                     repeat=2)
    before = set(namespaces())
    rows = measure(topo, exp, progress=lambda line: None)
    assert set(namespaces()) == before  # torn down
    cells = analyse(topo, rows)
    assert [c.wrong for c in cells] == [0, 0]  # brute-force majority on every rank
    for c in cells:
        # the MPI traffic really crossed the shaped centre link, as much as the model says
        assert c.payload_vs_model == pytest.approx(1.0, abs=0.05)
        assert c.seconds >= 0.9 * c.bandwidth_bound_seconds
    # losses were measured per call: every link direction's shaper drops, every rank's TCP
    every_direction = {f"{link.index}:{d}" for link in topo.links for d in ("ab", "ba")}
    for row in rows:
        assert set(row.drops) == every_direction
        assert all(v >= 0 for v in row.drops.values())
        assert row.tcp_retrans >= 0 and row.tcp_timeouts >= 0


@pytest.mark.timeout(300)
@pytest.mark.skipif(not MPIEXEC.exists(), reason="mpiexec not installed (bitcomm[mpi])")
def test_sparcml_over_the_chain_is_identical_everywhere_and_as_modelled():
    """The sparse collectives' messages depend on the inputs: the model traces the same
    standard inputs the ranks hold, so the centre link carries what it predicts."""
    topo = load(CHAIN)
    algorithms = ["ssar-recursive-double@5%", "ssar-split-allgather@5%",
                  "dsar-split-allgather@5%", "stream-allgather@5%"]
    exp = Experiment("ci", [str(CHAIN)], [1 << 16], algorithms, repeat=1, seed=3)
    rows = measure(topo, exp, progress=lambda line: None)
    cells = analyse(topo, rows, seed=3)
    assert [c.algorithm for c in cells] == algorithms
    for c in cells:
        assert c.wrong == 0, c.algorithm  # the same bytes on every rank
        assert c.payload_vs_model == pytest.approx(1.0, abs=0.05), c.algorithm


@pytest.mark.timeout(300)
@pytest.mark.skipif(not MPIEXEC.exists(), reason="mpiexec not installed (bitcomm[mpi])")
@pytest.mark.parametrize("victim", ["rank", "controller", "compare"])
def test_nothing_is_left_after_a_killed_run(tmp_path, victim):
    before = set(namespaces())
    exp = tmp_path / "exp.yaml"
    exp.write_text(f"name: kill\ntopologies: [{CHAIN}]\nsizes: [4M]\nrepeat: 50\n"
                   "algorithms: [ring-majority]\n")
    cmd = ["run", "experiment", str(exp)]
    if victim == "compare":  # interrupted by Ctrl-C
        cmd = ["compare", "--topology", str(CHAIN), "--size", "4M", "--repeat", "50",
               "ring-majority"]
    proc = subprocess.Popen([sys.executable, "-m", "bitcomm.cli", *cmd, "--out",
                             str(tmp_path / "out")],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    def rank_pids():
        mine = [ns for ns in set(namespaces()) - before if ns.endswith("-r1")]
        if not mine:
            return []
        out = subprocess.run(["ip", "netns", "pids", mine[0]], capture_output=True, text=True)
        return [int(p) for p in out.stdout.split()]

    deadline = time.monotonic() + 60
    pids = []
    while time.monotonic() < deadline and not pids:
        pids = rank_pids()
        time.sleep(0.5)
    assert pids, "the run never started a rank"
    time.sleep(3)  # let the job get going
    if victim == "rank":
        # listed again, until one is killed: the first look may have caught the set-up's
        # short-lived sysctl, and on a loaded machine the rank itself may start later
        killed = False
        deadline = time.monotonic() + 60
        while not killed and time.monotonic() < deadline and proc.poll() is None:
            for pid in rank_pids():
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed = True
                    break
                except ProcessLookupError:
                    continue
            time.sleep(0.2)
        assert killed, "no process of rank 1 was left to kill"
    else:
        proc.send_signal(signal.SIGINT if victim == "compare" else signal.SIGTERM)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode != 0, output
    assert set(namespaces()) == before, output


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sig, after", [(signal.SIGINT, 1), (signal.SIGINT, 3),
                                        (signal.SIGTERM, 2), (signal.SIGTERM, 5)])
def test_topo_up_interrupted_mid_build_leaves_nothing(sig, after):
    # at different moments, some of them while `ip netns add` is still running
    before = set(namespaces())
    topo = Path(__file__).parent.parent / "bitcomm" / "configs" / "topologies" / "chain-16.yaml"
    proc = subprocess.Popen([sys.executable, "-m", "bitcomm.cli", "topo", "up", str(topo)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while len(set(namespaces()) - before) < after and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(set(namespaces()) - before) >= after, "the build never started"
        proc.send_signal(sig)
        output, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
        left = set(namespaces()) - before
        for ns in left:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    assert proc.returncode != 0 and "is up" not in output, output
    assert not left, (left, output)


@pytest.mark.timeout(60)
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # the point
def test_a_signal_whose_exception_a_finalizer_swallowed_still_stops_the_build(monkeypatch):
    """Python prints and drops an exception raised in a finalizer (Popen.__del__, run by the
    garbage collector at any moment), the handler's KeyboardInterrupt included, and a build
    that relied on that exception alone would go on to 'is up'. It must still stop between its
    commands and remove what it made."""
    from bitcomm.netem import emulator

    before = set(namespaces())
    net = Emulator(load(CHAIN))
    real = emulator._run
    calls = []

    class Dropped:
        def __del__(self):
            net._on_signal(signal.SIGTERM, None)  # raised here, printed, lost

    def run(cmd, **kw):
        calls.append(cmd)
        out = real(cmd, **kw)
        if len(calls) == 3:  # the signal lands in a finalizer mid-build
            Dropped()
        return out

    monkeypatch.setattr(emulator, "_run", run)
    with pytest.raises(KeyboardInterrupt, match="signal 15"):
        net.build()
    assert len(calls) < 10, "the build went on after the signal"
    assert set(namespaces()) == before


@pytest.mark.timeout(60)
def test_topo_up_failing_mid_build_leaves_nothing(monkeypatch):
    from click.testing import CliRunner

    from bitcomm.cli import main

    calls = []
    real = Emulator._shape

    def shape_then_fail(self, *args):
        calls.append(1)
        if len(calls) == 2:
            raise OverflowError("an error nobody expected")
        return real(self, *args)
    monkeypatch.setattr(Emulator, "_shape", shape_then_fail)
    before = set(namespaces())
    result = CliRunner().invoke(main, ["topo", "up", str(CHAIN)])
    left = set(namespaces()) - before
    for ns in left:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    assert isinstance(result.exception, OverflowError) and len(calls) == 2, result.output
    assert not left


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (killed, not yet reaped by its parent) counts as gone
    with open(f"/proc/{pid}/stat") as fh:
        return fh.read().rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.timeout(300)
@pytest.mark.skipif(not MPIEXEC.exists(), reason="mpiexec not installed (bitcomm[mpi])")
def test_a_sigkilled_run_takes_its_job_along_and_topo_down_clears_the_rest(tmp_path):
    import tempfile

    before = set(namespaces())
    tmp_before = set(Path(tempfile.gettempdir()).glob("bitcomm-exp-*"))
    exp = tmp_path / "exp.yaml"
    exp.write_text(f"name: kill\ntopologies: [{CHAIN}]\nsizes: [4M]\nrepeat: 50\n"
                   "algorithms: [ring-majority]\n")
    proc = subprocess.Popen([sys.executable, "-m", "bitcomm.cli", "run", "experiment",
                             str(exp), "--out", str(tmp_path / "out")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    ranks = []
    while time.monotonic() < deadline and len(ranks) < 4:
        mine = sorted(set(namespaces()) - before)
        ranks = [int(p) for ns in mine for p in subprocess.run(
            ["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()]
        time.sleep(0.5)
    assert len(ranks) == 4, "the run never started its ranks"
    time.sleep(2)
    proc.kill()  # SIGKILL: no handler of the controller runs
    proc.wait()
    deadline = time.monotonic() + 30
    while any(map(_alive, ranks)) and time.monotonic() < deadline:
        time.sleep(0.2)
    left_running = [p for p in ranks if _alive(p)]
    down = subprocess.run([sys.executable, "-m", "bitcomm.cli", "topo", "down"],
                          capture_output=True, text=True, timeout=60)
    assert not left_running, "ranks outlived their controller"
    assert down.returncode == 0, down.stdout + down.stderr
    assert set(namespaces()) == before
    assert set(Path(tempfile.gettempdir()).glob("bitcomm-exp-*")) <= tmp_before, down.stdout


@pytest.mark.timeout(60)
def test_link_delay_is_applied_or_refused_clearly():
    from bitcomm.netem.emulator import EmulatorError
    from bitcomm.netem.topology import from_dict

    topo = from_dict({"name": "d", "nodes": 2,
                      "links": [{"a": 0, "b": 1, "rate": "1MB/s", "delay": "20ms"}]})
    before = set(namespaces())
    try:
        with Emulator(topo) as net:
            qdiscs = net.run(0, ["tc", "qdisc", "show", "dev", "l0"], capture_output=True,
                             text=True).stdout
            assert "netem" in qdiscs and "delay 20ms" in qdiscs and "tbf" in qdiscs
    except EmulatorError as e:  # kernels without sch_netem (this machine's) say so
        assert "needs tc's netem qdisc" in str(e)
    assert set(namespaces()) == before


@pytest.mark.timeout(60)
def test_topo_down_sweeps_leftovers():
    name = "bitcomm-cileft-r0"
    subprocess.run(["ip", "netns", "add", name], check=True)
    # a process still running inside it, as a rank of a killed run would be
    stray = subprocess.Popen(["ip", "netns", "exec", name, "sleep", "300"])
    try:
        out = subprocess.run([sys.executable, "-m", "bitcomm.cli", "topo", "down",
                              "bitcomm-cileft"], capture_output=True, text=True, timeout=30)
        assert out.returncode == 0 and name in out.stdout
        assert name not in namespaces()
        assert stray.wait(timeout=10) == -signal.SIGKILL
        assert "ended 1 process" in out.stdout
    finally:
        stray.kill()
        sweep("bitcomm-cileft")


@pytest.mark.timeout(60)
def test_congestion_control_is_set_in_every_rank_or_refused_clearly():
    from bitcomm.netem.emulator import EmulatorError

    topo = load(CHAIN)
    before = set(namespaces())
    proc = Path("/proc/sys/net/ipv4")
    # namespaces may use what the host allows; pick one that is not what they would inherit
    allowed = (proc / "tcp_allowed_congestion_control").read_text().split()
    host = (proc / "tcp_congestion_control").read_text().strip()
    wanted = next((cc for cc in allowed if cc != host), allowed[0])
    with Emulator(topo, congestion=wanted) as net:
        for rank in range(4):
            cc = net.run(rank, ["sysctl", "-n", "net.ipv4.tcp_congestion_control"],
                         capture_output=True, text=True, check=True).stdout.strip()
            assert cc == wanted
    with pytest.raises(EmulatorError, match="TCP congestion control 'warp' is not available"):
        with Emulator(topo, congestion="warp"):
            pass
    with pytest.raises(ValueError, match="expected a congestion control name"):
        Emulator(topo, congestion="re no")
    assert set(namespaces()) == before


@pytest.mark.timeout(300)
def test_bench_hooks_runs_its_ranks_over_an_emulated_link(tmp_path):
    """--topology pair: the 2 ranks talk over a 12.5 MB/s veth, not loopback. The model's
    gradients are 297,988 bytes; a 2-rank allreduce sends them once each way, which takes at
    least 24 ms at that rate (about 1 ms on loopback)."""
    import json

    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "BITCOMM_STORE", "PMI_RANK", "MASTER_ADDR")}
    cmd = [sys.executable, "-m", "bitcomm.cli", "bench", "hooks", "--topology", "pair",
           "--width", "256", "--depth", "2", "--steps", "3", "--bucket-mb", "25", "--hooks",
           "sign", "--out", str(tmp_path)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    data = json.loads((tmp_path / "hooks-gloo-2.json").read_text())
    assert data["config"]["network"] == "pair"
    rows = {row["hook"]: row for row in data["rows"]}
    assert rows["allreduce"]["params"] == 74497
    assert rows["allreduce"]["step_ms_min"] >= 4 * 74497 / 12.5e6 * 1e3
    assert not [ns for ns in namespaces() if ns.startswith("bitcomm-")]
