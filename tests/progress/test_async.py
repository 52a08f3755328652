"""Asynchronous collectives (commlib.Work), comm.stats and the
BackwardReducer: the front-end logic with ranks as threads
(tests/inprocess.py), then real MPI ranks (rank programs in
tests/progress/async_programs.py) for results, order, errors and faults."""
import json
import os
import re
import sys
import threading

import numpy as np
import pytest

import commlib
from commlib.compression import TopK
from commlib.errors import ArgumentError, ClosedError, ConsistencyError
from commlib.overlap import backward_buckets
from inprocess import run_ranks
from mpirun import ROOT, mpiexec, python_path, run_bounded, run_mpi
from test_frontend import inputs, reference

SIZES = [1, 2, 3, 4]
OPS = ["sum", "max", "min", "prod", "avg"]
LENGTHS = [0, 1, 3, 7, 255, 1000, 70001]


def bits_equal(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


# -- in process: ranks as threads -------------------------------------------------------

@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("threaded", [True, False])
def test_async_equals_reference_and_sync(n, threaded):
    cases = [(d, op) for d in ("float32", "float64", "int32", "float16") for op in OPS
             if not (op == "avg" and d == "int32")]

    def body(comm):
        comm.async_threaded = threaded
        works, got_sync = [], []
        for seed, (dtype, op) in enumerate(cases):
            mine = inputs(comm.rank, dtype, LENGTHS, op, seed)
            works.append((comm.all_reduce(mine, op=op, async_op=True), mine))
        for seed, (dtype, op) in enumerate(cases):
            twin = inputs(comm.rank, dtype, LENGTHS, op, seed)
            got_sync.append(comm.all_reduce(twin, op=op))      # queued after the async ones
        assert all(w.done() for w, _ in works)
        return [w.wait() for w, _ in works], got_sync, [m for _, m in works]

    results = run_ranks(n, body, bucket_bytes=4096)
    for seed, (dtype, op) in enumerate(cases):
        want = reference([inputs(r, dtype, LENGTHS, op, seed) for r in range(n)], op, n)
        for r in range(n):
            waited, sync, given = (results[r][i][seed] for i in range(3))
            assert waited is given
            for a, s, w in zip(waited, sync, want):
                assert bits_equal(a, w) and bits_equal(a, s), (n, dtype, op, r)


def test_sync_call_runs_after_outstanding_async_ones():
    def body(comm):
        x = [np.full(1000, comm.rank + 1.0, np.float32)]
        work = comm.all_reduce(x, async_op=True)
        gathered = comm.all_gather(np.array([comm.rank], np.int64))
        return work.done(), gathered, x[0][0], work.wait() is x, work.wait() is x

    for done, gathered, value, again, twice in run_ranks(3, body):
        assert done and again and twice and value == 6.0
        assert gathered.reshape(-1).tolist() == [0, 1, 2]


def test_wait_timeout_raises_and_the_collective_goes_on():
    waited = threading.Event()      # rank 1 issues its part once rank 0's wait timed out

    def body(comm):
        x = [np.full(10, comm.rank + 1.0, np.float32)]
        if comm.rank == 1:
            assert waited.wait(30)
        work = comm.all_reduce(x, async_op=True)
        timed_out = False
        if comm.rank == 0:
            with pytest.raises(TimeoutError, match="^commlib: the collective did not complete "
                                                   "within 0.05 s; it goes on, wait again$") as info:
                work.wait(timeout=0.05)
            assert type(info.value) is TimeoutError     # the built-in, not the watch dog's
            timed_out = not work.done()
            waited.set()
        return timed_out, work.wait()[0][0]

    assert run_ranks(2, body) == [(True, 3.0), (False, 3.0)]


def test_deferred_work_runs_when_waited_for():
    def body(comm):
        comm.async_threaded = False
        x = [np.full(10, comm.rank + 1.0, np.float32)]
        y = [np.full(10, comm.rank + 1.0, np.float32)]
        wx = comm.all_reduce(x, async_op=True)
        wy = comm.all_reduce(y, op="max", async_op=True)
        before = (wx.done(), wy.done(), float(x[0][0]))
        wy.wait()                                     # runs wx first
        return before, wx.done(), x[0][0], y[0][0]

    for rank, (before, x_done, x, y) in enumerate(run_ranks(2, body)):
        assert before == (False, False, rank + 1.0)  # nothing ran before the wait
        assert x_done and x == 3.0 and y == 2.0


def test_close_waits_for_work_dropped_without_wait():
    def body(comm):
        x = [np.full(70001, comm.rank + 1.0, np.float32)]
        work = comm.all_reduce(x, async_op=True)
        comm.close()
        return work.done(), x[0][0]

    assert run_ranks(2, body) == [(True, 3.0), (True, 3.0)]


def test_mismatched_async_call_raises_from_wait_and_stays_usable():
    def body(comm):
        x = [np.ones(5 if comm.rank else 6, np.float32)]
        work = comm.all_reduce(x, async_op=True)
        said = ("rank %d: ranks disagree on all_reduce #1:\n  ranks [0]: all_reduce(op=sum, "
                "average=False) 1 arrays: float32(6,)\n  ranks [1]: all_reduce(op=sum, "
                "average=False) 1 arrays: float32(5,)" % comm.rank)
        with pytest.raises(ConsistencyError, match="^%s$" % re.escape(said)) as info:
            work.wait()
        with pytest.raises(ConsistencyError, match="^%s$" % re.escape(said)):  # every wait
            work.wait()
        assert x[0].tolist() == [1.0] * x[0].size
        y = comm.all_reduce([np.ones(4, np.float32)], async_op=True).wait()
        return info.value.culprits, y[0].tolist()

    # two ranks, two calls: neither is the majority's, the second rank's is blamed
    for culprits, y in run_ranks(2, body):
        assert culprits == (1,) and y == [2.0] * 4


def test_async_op_must_be_a_bool_and_closed_communicators_refuse():
    def body(comm):
        with pytest.raises(ArgumentError, match="rank %d.*async_op" % comm.rank):
            comm.all_reduce([np.ones(3, np.float32)], async_op="yes")
        comm.close()
        with pytest.raises(ClosedError, match="^rank %d: all_reduce called after close\\(\\)$"
                           % comm.rank):
            comm.all_reduce([np.ones(3, np.float32)], async_op=True)
        return True

    assert run_ranks(2, body) == [True, True]


def test_stats_count_bytes_collectives_and_blocked_time():
    def body(comm):
        stats = comm.stats
        stats.reset()
        comm.all_reduce([np.ones(1001, np.float32), np.ones(7, np.float64)], async_op=True).wait()
        dense = stats.bytes_sent
        comm.all_reduce([np.ones(1001, np.float32)], compression="fp16")
        half = stats.bytes_sent - dense
        comm.all_gather(np.ones(5, np.int32))
        comm.barrier()
        snap = stats.snapshot()
        stats.reset()
        return dense, half, snap, stats.snapshot()

    for dense, half, snap, zero in run_ranks(3, body):
        assert dense == 1001 * 4 + 7 * 8 and half == 1001 * 2
        assert snap["bytes_sent"] == dense + half + 20 and snap["collectives"] == 4
        assert snap["blocked_seconds"] > 0
        assert zero == {"bytes_sent": 0, "collectives": 0, "blocked_seconds": 0.0}


def test_backward_buckets_layout():
    arrays = [np.zeros(10, np.float32), np.zeros(10, np.float32), np.zeros(3, np.float64),
              np.zeros(100, np.float32), np.zeros(5, np.float32), np.zeros(5, np.float32),
              np.zeros(5, np.float32)]
    # reverse order, one dtype per bucket, at most bucket_bytes unless alone
    assert backward_buckets(arrays, 80) == [[4, 5, 6], [3], [2], [0, 1]]
    assert backward_buckets(arrays, 44) == [[5, 6], [4], [3], [2], [1], [0]]
    assert backward_buckets(arrays, 1 << 20) == [[3, 4, 5, 6], [2], [0, 1]]
    assert backward_buckets([], 100) == []
    # a first bucket of its own cap, as PyTorch DDP's
    assert backward_buckets(arrays, 80, first_bucket_bytes=20) == [[6], [4, 5], [3], [2], [0, 1]]
    assert backward_buckets(arrays, 80, first_bucket_bytes=44) == [[5, 6], [4], [3], [2], [0, 1]]
    assert backward_buckets(arrays, 80, first_bucket_bytes=1) == [[6], [4, 5], [3], [2], [0, 1]]


def test_reducer_default_buckets():
    """Without bucket_bytes: the first bucket up to 1 MiB, the rest up to
    the larger of 8 MiB and the transport's default; a communicator's own
    bucket_bytes rules every bucket."""
    shapes = [(1 << 18,)] * 40 + [(1000,)] * 3          # 1 MiB each, then 4 kB each

    def body(comm):
        grads = [np.zeros(s, np.float32) for s in shapes]
        red = commlib.BackwardReducer(comm, grads)
        return red.buckets, red.bucket_bytes

    (buckets, cap), = run_ranks(1, body)
    assert buckets[0] == [40, 41, 42]                   # 12 kB: the next 1 MiB would pass 1 MiB
    assert cap == max(8 << 20, commlib.collective.bucketing.DEFAULT_BUCKET_BYTES["threads"])
    assert all(len(b) == cap // (1 << 20) for b in buckets[1:])
    (buckets, cap), = run_ranks(1, body, bucket_bytes=2 << 20)
    assert cap == 2 << 20 and buckets[0] == [39, 40, 41, 42][-len(buckets[0]):]
    assert all(sum(4 * np.prod(shapes[j]) for j in b) <= 2 << 20 for b in buckets)


@pytest.mark.parametrize("n", [1, 2, 3])
def test_reducer_any_ready_order_equals_sync_per_bucket(n):
    shapes = [(3, 5), (1000,), (7,), (64, 64), (1,), (301,), (2, 2)]
    strategy = TopK(0.25)

    def body(comm):
        grads = commlib.flat_arrays(shapes, "float32")
        red = commlib.BackwardReducer(comm, grads, bucket_bytes=4200, compression=strategy)
        out, want = [], []
        given = []
        rng = np.random.default_rng(comm.rank)
        for step in range(3):
            for j, g in enumerate(grads):
                g[...] = np.random.default_rng([step, comm.rank, j]).standard_normal(g.shape)
            given.append([g.copy() for g in grads])
            for j in rng.permutation(len(grads)):
                red.ready(int(j))
            out.append([g.copy() for g in red.wait()])
        return red.buckets, out, given

    results = run_ranks(n, body)
    buckets = results[0][0]
    assert [j for b in buckets for j in reversed(b)] == list(range(len(shapes) - 1, -1, -1))

    def sync_body(comm):
        grads = commlib.flat_arrays(shapes, "float32")
        out = []
        for step in range(3):
            for g, v in zip(grads, results[comm.rank][2][step]):
                g[...] = v
            for b in buckets:
                comm.all_reduce([grads[j] for j in b], op="avg", compression=strategy)
            out.append([g.copy() for g in grads])
        return out

    sync = run_ranks(n, sync_body)
    for r in range(n):
        assert results[r][0] == buckets
        for step in range(3):
            for a, s, w in zip(results[r][1][step], sync[r][step], sync[0][step]):
                assert bits_equal(a, s) and bits_equal(a, w), (r, step)


def test_reducer_buckets_of_one_layout_keep_their_own_residuals():
    """Two buckets of the same shapes with top-K error feedback: each equals
    the same steps reduced alone, on communicators of its own."""
    shapes, steps, n = [(50,)] * 4, 3, 2

    def grads_of(rank, step):
        return [np.random.default_rng([step, rank, j]).standard_normal(s).astype(np.float32)
                for j, s in enumerate(shapes)]

    def body(comm):
        grads = commlib.flat_arrays(shapes, "float32")
        red = commlib.BackwardReducer(comm, grads, bucket_bytes=400, compression=TopK(0.1))
        out = []
        for step in range(steps):
            for g, v in zip(grads, grads_of(comm.rank, step)):
                g[...] = v
            for j in range(len(grads)):
                red.ready(j)
            out.append([g.copy() for g in red.wait()])
        return red.buckets, out

    results = run_ranks(n, body)
    buckets = results[0][0]
    assert buckets == [[2, 3], [0, 1]]
    for bucket in buckets:
        def alone(comm):
            arrays = [np.empty(shapes[j], np.float32) for j in bucket]
            out = []
            for step in range(steps):
                for a, j in zip(arrays, bucket):
                    a[...] = grads_of(comm.rank, step)[j]
                comm.all_reduce(arrays, op="avg", compression=TopK(0.1))
                out.append([a.copy() for a in arrays])
            return out

        want = run_ranks(n, alone)
        for r in range(n):
            for step in range(steps):
                for a, j in zip(want[r][step], bucket):
                    assert bits_equal(results[r][1][step][j], a), (bucket, r, step, j)


def test_reducer_buckets_reuse_their_plans(monkeypatch):
    """Bucket lists take turns every step; each keeps its fusion plan from
    its second step on (no checks and planning again per bucket)."""
    import commlib.collective.bucketing
    made = []
    plan_for = commlib.collective.bucketing.plan_for
    monkeypatch.setattr(commlib.collective.bucketing, "plan_for", lambda *a: made.append(1) or plan_for(*a))

    def body(comm):
        grads = commlib.flat_arrays([(100,)] * 12, "float32")
        red = commlib.BackwardReducer(comm, grads, bucket_bytes=800)
        counts = []
        for step in range(4):
            before = len(made)
            for j in reversed(range(len(grads))):
                red.ready(j)
            red.wait()
            counts.append(len(made) - before)
        return counts, len(red.buckets)

    counts, buckets = run_ranks(1, body)[0]
    assert buckets == 6 and counts == [6, 6, 0, 0]


def test_reducer_rejects_bad_calls():
    def body(comm):
        grads = [np.ones(4, np.float32), np.ones(4, np.float32)]
        red = commlib.BackwardReducer(comm, grads, bucket_bytes=16)
        red.ready(1)
        with pytest.raises(ArgumentError, match=r"rank %d.*ready\(1\) called twice"
                           % comm.rank):
            red.ready(1)
        for bad in (2, -1, 1.0, True):
            with pytest.raises(ArgumentError, match="rank %d" % comm.rank):
                red.ready(bad)
        got = red.wait()
        red.ready(1)                               # a new step
        red.wait()
        with pytest.raises(ArgumentError, match="bucket_bytes"):
            commlib.BackwardReducer(comm, grads, bucket_bytes=0)
        with pytest.raises(ArgumentError, match=r"grads\[1\]"):
            commlib.BackwardReducer(comm, [grads[0], 3])
        return [g[0] for g in got]

    assert run_ranks(2, body) == [[1.0, 1.0]] * 2


# -- real MPI ranks ------------------------------------------------------------------------

CODE = "import sys, async_programs\nasync_programs.main(*sys.argv[1:])\n"
DEADLINE = 2.0


def run(n, scenario, timeout=120, expect_fail=False, env=None):
    """Records by rank of ``scenario`` on ``n`` ranks: {rank: {what: record}}."""
    proc = run_mpi(n, CODE, timeout=timeout, args=(scenario,), expect_fail=expect_fail,
                   env=env)
    records = {}
    for line in proc.stdout.splitlines():
        if line.startswith("ASYNC "):
            record = json.loads(line[len("ASYNC "):])
            records.setdefault(record["rank"], {})[record["what"]] = record
    return records, proc


def all_ok(records, n):
    assert sorted(records) == list(range(n)), records
    for r in range(n):
        assert "ok" in records[r], records[r]


@pytest.mark.parametrize("n", SIZES)
def test_mpi_results_every_op_large_and_empty(n):
    records, _ = run(n, "results", timeout=180)
    all_ok(records, n)


@pytest.mark.parametrize("n", [2, 3])
def test_mpi_compression_async_equals_sync(n):
    all_ok(run(n, "compression")[0], n)


@pytest.mark.parametrize("n", [2, 4])
def test_mpi_reducer(n):
    records, _ = run(n, "reducer", timeout=180)
    all_ok(records, n)
    assert len({json.dumps(records[r]["buckets"]["buckets"]) for r in range(n)}) == 1


@pytest.mark.parametrize("n", [1, 3])
def test_mpi_order_of_mixed_calls(n):
    records, _ = run(n, "order")
    all_ok(records, n)


def test_mpi_done_progresses_without_wait():
    records, _ = run(2, "progress")
    all_ok(records, 2)
    waiter = records[0]["progress"]
    assert waiter["early"] is False            # the peer had not issued yet
    assert waiter["waited"] >= 0.8             # done() turned True only once it had
    assert waiter["longest"] < 0.01            # done() never blocks
    assert waiter["issued"] < 0.1


def test_mpi_mismatch_and_bad_argument_name_the_rank():
    records, _ = run(2, "mismatch")
    all_ok(records, 2)
    for r in range(2):
        rec = records[r]["mismatch"]
        assert rec["culprits"] == [1] and "float32(1002,)" in rec["message"], rec
    records, _ = run(2, "bad_argument")
    all_ok(records, 2)
    assert records[1]["bad_argument"]["error"] == "ArrayTypeError"
    rec = records[0]["bad_argument"]
    assert rec["error"] == "ConsistencyError" and rec["culprits"] == [1], rec
    assert "rank 1 rejected its arguments" in rec["message"]


def test_mpi_stats():
    records, _ = run(2, "stats")
    all_ok(records, 2)
    for r in range(2):
        rec = records[r]["stats"]
        for n, dense, half in rec["counts"]:
            assert dense == 4 * n and half == 2 * n, rec
        assert rec["snapshot"]["collectives"] == 2 and rec["snapshot"]["bytes_sent"] == 20
    assert records[0]["stats"]["snapshot"]["blocked_seconds"] >= 0.4     # waited for rank 1


def test_mpi_deferred_without_thread_multiple():
    # MPI is initialised before the program runs (tests/mpirun.py's
    # prologue), so the thread level comes from mpi4py's variable
    records, _ = run(2, "deferred", env={"MPI4PY_RC_THREAD_LEVEL": "serialized"})
    all_ok(records, 2)
    assert records[0]["deferred"]["early"] is False


def test_mpi_stalled_peer_raises_from_wait():
    records, _ = run(2, "stall", timeout=DEADLINE * 4 + 60,
                     env={"COMMLIB_WATCHDOG_TIMEOUT": str(DEADLINE)})
    all_ok(records, 2)
    rec = records[0]["failed"]
    assert rec["error"] == "CollectiveTimeoutError" and rec["culprits"] == [1], rec
    assert rec["seconds"] <= DEADLINE + 5 and rec["untouched"], rec
    assert records[1]["failed"]["error"] == "PeerError", records[1]
    for r in range(2):
        assert not records[r]["after"]["written_after"] and records[r]["later"]["error"] == \
            "ClosedError", records[r]


def test_mpi_crashed_peer_raises_from_wait():
    records, _ = run(2, "crash", timeout=DEADLINE * 4 + 60, expect_fail=True,
                     env={"COMMLIB_WATCHDOG_TIMEOUT": str(DEADLINE)})
    rec = records[0]["failed"]
    assert rec["error"] == "PeerError" and rec["culprits"] == [1], rec
    assert rec["seconds"] <= DEADLINE + 5 and rec["untouched"], rec
    assert "breaks down" in rec["message"]


def test_killed_peer_during_async_call_ends_the_job(tmp_path):
    """kill -9 of rank 1 while the others wait for an async all-reduce: the
    job ends within the bound and the launcher names rank 1. Hydra ends the
    job as soon as it learns of the kill, so whether a survivor reports
    first is a race: the records that made it out must name rank 1, and
    what every survivor raises is asserted by
    test_mpi_vanished_peer_raises_from_wait."""
    script = tmp_path / "job.py"
    script.write_text(CODE.replace("*sys.argv[1:]", "'killed'"))
    env = dict(os.environ, COMMLIB_WATCHDOG_TIMEOUT=str(DEADLINE),
               PYTHONPATH=python_path())
    proc = run_bounded([sys.executable, "-m", "commlib.launch", "-n", "3", "--backend", "mpi",
                        script], DEADLINE * 4 + 60, env=env)
    last = [line for line in proc.stderr.splitlines() if line.startswith("commlib.launch:")]
    assert proc.returncode != 0 and last and "rank 1 " in last[-1] and "SIGKILL" in last[-1], \
        proc.stderr
    reported = [json.loads(line.split("ASYNC ", 1)[1]) for line in proc.stdout.splitlines()
                if "ASYNC " in line and '"what": "failed"' in line]
    assert {r["rank"] for r in reported} <= {0, 2}, reported
    for record in reported:
        assert record["error"] == "PeerError" and record["culprits"] == [1], record


def test_mpi_vanished_peer_raises_from_wait():
    """Rank 1 of 3 ends without a word (os._exit) while the others wait for
    an async all-reduce: each one's wait() raises PeerError naming it at
    once, and their arrays are untouched."""
    proc = run_mpi(3, CODE, timeout=60, args=("vanished",), survivors=True)
    records = {}
    for line in proc.stdout.splitlines():
        if line.startswith("ASYNC "):
            record = json.loads(line[len("ASYNC "):])
            records[record["rank"]] = record
    assert sorted(records) == [0, 2], proc.stdout
    for r in (0, 2):
        rec = records[r]
        assert rec["error"] == "PeerError" and rec["culprits"] == [1], rec
        assert "rank %d: rank 1 (pid " % r in rec["message"] and " died while this rank " \
            "waits in all_reduce #2" in rec["message"], rec
        assert rec["seconds"] <= 3 and rec["untouched"], rec


def test_mpi_ctrl_c_while_waiting():
    records, _ = run(2, "interrupt", timeout=60)
    all_ok(records, 2)
    mine, peer = records[0]["interrupt"], records[1]["interrupt"]
    assert mine["error"] == "KeyboardInterrupt" and mine["seconds"] < 1.4, mine
    assert peer["error"] == "PeerError" and peer["culprits"] == [0], peer
    assert mine["untouched"] and peer["untouched"]
    assert mine["later"] == "ClosedError" and peer["later"] == "ClosedError"


# -- all-reduces in flight over MPI (shared memory off, as between nodes) ---------------

OVER_MPI = {"COMMLIB_SHM": "0"}


@pytest.mark.parametrize("n", SIZES)
def test_mpi_pipelined_all_reduces_equal_reference_and_sync(n):
    records, _ = run(n, "pipelined", timeout=240, env=OVER_MPI)
    all_ok(records, n)
    for r in range(n):
        rec = records[r]["pipelined"]
        if n > 1:       # several were in flight at once (a single process has no MPI transport)
            assert rec["deferred"] > 20 and rec["most"] >= 1, rec


def test_mpi_depth_one_keeps_one_in_flight():
    records, _ = run(2, "pipelined", timeout=240, env=dict(OVER_MPI, COMMLIB_ASYNC_DEPTH="1"))
    all_ok(records, 2)
    assert all(records[r]["pipelined"]["deferred"] == 0 for r in range(2))


@pytest.mark.parametrize("scenario", ["results", "reducer", "order", "compression"])
def test_mpi_scenarios_over_mpi_transport(scenario):
    all_ok(run(3, scenario, timeout=240, env=OVER_MPI)[0], 3)


def test_mpi_stall_inside_a_collective_in_flight():
    """Rank 1's third of five requests starts past the deadline: the others
    get two results, then errors, and no failed collective writes."""
    records, _ = run(3, "hang_in_flight", timeout=DEADLINE * 6 + 60,
                     env=dict(OVER_MPI, COMMLIB_WATCHDOG_TIMEOUT=str(DEADLINE)))
    all_ok(records, 3)
    for r in (0, 2):
        rec = records[r]["hang"]
        assert rec["outcome"][:2] == [None, None] and rec["right"][:2] == [True, True], rec
        failed = rec["outcome"][2:]
        assert all(f is not None for f in failed), rec
        # the third in flight times out, or the fourth does first (waiting
        # for rank 1 to enter it) and the third fails with it, or the other
        # waiting rank's deadline came first and this rank learns that it
        # gave up (a loaded machine)
        assert failed[0][0] in ("CollectiveTimeoutError", "ClosedError", "PeerError"), rec
        assert "did not complete before its deadline" in failed[0][2], rec
        assert all(f[0] in ("CollectiveTimeoutError", "ClosedError", "PeerError")
                   for f in failed[1:]), rec
        assert rec["untouched"][2:] == [True, True, True], rec
        assert rec["later"] == "ClosedError", rec
    assert records[1]["hang"]["later"] == "ClosedError"


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 2])
def test_gpu_async_stream_order_and_reducer(n):
    records, _ = run(n, "gpu", timeout=240)
    all_ok(records, n)


def test_overlap_benchmark_smoke(tmp_path):
    out = tmp_path / "overlap.json"
    proc = run_bounded([*mpiexec(), "-n", "2", sys.executable, ROOT / "benchmarks" / "overlap.py",
                        "--workload", "mnist_cnn", "--repeats", "3", "--budget-s", "5",
                        "--bucket-bytes", "4096", "--json", out], 120)
    assert proc.returncode == 0, proc.stderr
    r = json.loads(out.read_text())
    ms = r["ms"]
    assert r["ranks"] == 2 and r["buckets"] > 1 and r["repeats"] == 3
    assert r["ms_max"] == max(ms["compute"], ms["comm"])
    assert abs(r["overlap_to_max"] - ms["overlap"] / r["ms_max"]) < 1e-9
    assert 0 <= r["buckets_done_after_compute"] <= r["buckets"]
    assert "| step with overlap |" in proc.stdout
