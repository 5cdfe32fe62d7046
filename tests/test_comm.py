"""Transport-level behaviour of the in-process Comm: isend, requests, counting, errors."""

import os

import pytest
import torch

from bitcomm.comm import Request, run_local


def _bytes(*values):
    return torch.tensor(values, dtype=torch.uint8)


def test_isend_runs_ahead_of_the_receiver_and_keeps_order():
    # Every rank posts three sends before receiving anything: with blocking sends on a ring
    # this would deadlock; the messages then arrive in the order they were sent.
    def fn(c):
        nxt, prv = (c.rank + 1) % c.size, (c.rank - 1) % c.size
        reqs = [c.isend(_bytes(c.rank, k, k * 7), nxt) for k in range(3)]
        got = [c.recv(torch.empty(3, dtype=torch.uint8), prv).tolist() for _ in range(3)]
        Request.wait_all(reqs)
        return got, c.counters.sent[nxt], c.counters.total_sent

    for r, (got, to_next, total) in enumerate(run_local(fn, 4, timeout=30)):
        prv = (r - 1) % 4
        assert got == [[prv, 0, 0], [prv, 1, 7], [prv, 2, 14]]
        assert to_next == total == 9


def test_isend_copies_at_post_time_for_the_local_transport():
    # The in-process transport takes the bytes when the send is posted, so changing the buffer
    # afterwards (which the API forbids until wait) cannot corrupt what was sent.
    def fn(c):
        if c.rank == 0:
            buf = _bytes(1, 2, 3)
            req = c.isend(buf, 1)
            buf.fill_(0)
            req.wait()
            return None
        return c.recv(torch.empty(3, dtype=torch.uint8), 0).tolist()

    assert run_local(fn, 2, timeout=30)[1] == [1, 2, 3]


def test_request_wait_is_idempotent_and_releases_buffers():
    calls = []
    keep = torch.zeros(4)
    req = Request(lambda: calls.append(1), keep)
    req.wait()
    req.wait()
    assert calls == [1]
    assert req._keep is None
    Request.wait_all([Request(), Request(lambda: calls.append(2))])
    assert calls == [1, 2]


def test_isend_checks_its_arguments():
    def fn(c):
        with pytest.raises(ValueError, match="another rank"):
            c.isend(_bytes(1), c.rank)
        with pytest.raises(ValueError, match="another rank"):
            c.isend(_bytes(1), c.size)
        with pytest.raises(TypeError):
            c.isend(torch.ones(3), 1 - c.rank)
        return c.counters.total_sent

    assert run_local(fn, 2, timeout=30) == [0, 0]


def test_launch_commands_for_each_transport(tmp_path):
    import sys

    from bitcomm.comm.launch import commands, world

    argv = [sys.executable, "-m", "some.worker", "--flag"]
    jobs = commands(3, "gloo", argv, tmp_path)
    assert [cmd for cmd, _ in jobs] == [argv] * 3
    assert [e["RANK"] for _, e in jobs] == ["0", "1", "2"]
    assert {e["WORLD_SIZE"] for _, e in jobs} == {"3"}
    assert {e["BITCOMM_STORE"] for _, e in jobs} == {str(tmp_path / "store")}
    [(cmd, _)] = commands(2, "mpi", argv, tmp_path)
    assert cmd[1:] == ["-n", "2", sys.executable, "-m", "mpi4py", "-m", "some.worker", "--flag"]
    assert cmd[0].endswith("mpiexec")
    with pytest.raises(ValueError, match="transport"):
        commands(2, "nccl", argv, tmp_path)
    with pytest.raises(ValueError, match="ranks"):
        commands(0, "gloo", argv, tmp_path)
    with pytest.raises(ValueError, match="transport"):
        world("tcp")


def test_run_job_streams_progress_and_reports_failures():
    import sys
    import time

    from bitcomm.comm.launch import run_job

    def job(code):
        return ([sys.executable, "-c", code], dict(os.environ))

    seen = []
    run_job([job("print('  step 1'); print('quiet')"), job("print('  other rank')")],
            timeout=60, what="ok job", progress=seen.append)
    assert seen == ["  step 1"]  # progress lines of the first process only
    with pytest.raises(RuntimeError, match=r"(?s)bad job failed \(exit status \[0, 3\]\).*boom"):
        run_job([job("pass"), job("print('boom'); raise SystemExit(3)")], timeout=60,
                what="bad job")
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"(?s)slow job did not finish in 1 s.*started"):
        run_job([job("print('started', flush=True); import time; time.sleep(60)")], timeout=1,
                what="slow job")
    assert time.monotonic() - t0 < 30  # killed, not waited for


def test_a_failed_rank_does_not_stop_waits_on_ranks_that_are_still_sending():
    # Rank 0 finishes the exchange and fails; rank 1 still waits for rank 2's message, which rank
    # 2 (alive, only slow) sends late. Rank 1 must get it and fail on its own terms, as rank 0
    # did, instead of giving up because some rank failed.
    import time

    def fn(comm):
        if comm.rank == 2:
            put = comm._put

            def slow_to_rank_1(dest, item, blocking=True):
                if dest == 1:
                    time.sleep(0.5)
                put(dest, item, blocking)
            comm._put = slow_to_rank_1
        got = comm.allgatherv(torch.full((4,), comm.rank, dtype=torch.uint8), [4] * 3)
        raise ValueError(f"every rank saw {[int(g[0]) for g in got]}")

    out = run_local(fn, 3, return_exceptions=True, timeout=10)
    assert [str(e) for e in out] == ["every rank saw [0, 1, 2]"] * 3, out
