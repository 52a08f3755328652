"""Every collective across real nodes: ranks in network namespaces of their
own, joined by a bridge, talking TCP (tests/nodes.py), at 2x1 and 3x1
(nodes x ranks per node) under bare mpiexec and at 2x2 under the launcher
with ``--hosts`` (its supervisors and records across nodes, at no extra
job's cost).

One job per layout runs every check; each rank regenerates every rank's
inputs from their seeds and compares its results with numpy on them. Each
rank prints a digest of its results that are the same on every rank: the test asserts that every rank
printed the same one, that each node's link carried the large arrays, and
that commlib saw the nodes (``local_size``, ``local_rank``, the
fingerprint exchange rather than the shared status board)."""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from mpirun import assert_each_rank, python_path
from nodes import _mode, _pid_alive, launcher, namespaces, remove_stale, run_nodes

CHECKS = ["placement", "all_reduce", "all_reduce avg", "fp16", "bf16", "broadcast", "reduce",
          "all_gather", "all_gatherv", "reduce_scatter", "barrier", "async",
          "mismatch", "check=False", "uneven steps"]
HIERARCHICAL_CHECKS = ["hierarchical", "hierarchical timeout"]

CODE = r"""
import hashlib, os, sys, time
import numpy as np
import ml_dtypes
import commlib
from commlib import errors
from commlib.faults.board_exchange import ExchangeBoard
from commlib.transport.hierarchical import HierarchicalTransport
from commlib.transport.mpi import MpiTransport

NODES, PER_NODE = int(sys.argv[1]), int(sys.argv[2])
comm = commlib.init()
n, rank = comm.size, comm.rank
digest = hashlib.sha256()
LENGTHS = (0, 1, 7, 4097, 300_001)


def ok(check):
    print("ok %s rank %d" % (check, rank), flush=True)


def everyone(seed, make):
    # every rank's input, made anew from its seed (no communication)
    return [make(np.random.default_rng([seed, r])) for r in range(n)]


def same(got, want, what, alike=True):
    # alike: every rank's result is the same (added to the digest)
    assert got.dtype == want.dtype and got.shape == want.shape, (what, got.dtype, got.shape,
                                                                 want.dtype, want.shape)
    assert np.array_equal(got, want), "%s: rank %d got %s, want %s" % (what, rank, got[:6],
                                                                       want[:6])
    if alike:
        digest.update(got.tobytes())


def exact(rng, dtype, m):
    # integers (quarters for floats): any order of summation is exact at 4 ranks
    if np.dtype(dtype).kind == "f":
        return (rng.integers(-64, 65, m) / 4).astype(dtype)
    if dtype == "uint8":
        return rng.integers(0, 60, m).astype(dtype)
    return rng.integers(-1000, 1000, m).astype(dtype)


REDUCE = {"sum": np.add, "max": np.maximum, "min": np.minimum, "prod": np.multiply}


def reduced(inputs, op):
    acc = inputs[0].copy()
    for x in inputs[1:]:
        acc = REDUCE[op](acc, x).astype(acc.dtype)
    return acc


# -- placement: one rank per node's share of the machine, over MPI only
assert comm.backend == "mpi", comm.backend
assert (comm.local_rank, comm.local_size) == (rank % PER_NODE, PER_NODE), \
    (comm.local_rank, comm.local_size)
assert isinstance(comm._session.board, ExchangeBoard), type(comm._session.board)
HIERARCHICAL = PER_NODE > 1                  # several nodes of several ranks each
assert [type(t) for t in comm._session.transports] == \
    [HierarchicalTransport] * HIERARCHICAL + [MpiTransport], comm._session.transports
print("local %d of %d rank %d" % (comm.local_rank, comm.local_size, rank), flush=True)
ok("placement")

# -- all_reduce: dtypes, lengths (one list per dtype and op; the large array
# with sum only), every op
seed = 0
for dtype in ("float16", "float32", "float64", "int32", "int64", "uint8"):
    for op in ("sum", "max", "min", "prod"):
        seed += 1
        lengths = LENGTHS if op == "sum" else LENGTHS[:-1]
        if op == "prod":
            ins = everyone(seed, lambda g: [g.integers(1, 3, m).astype(dtype) for m in lengths])
        else:
            ins = everyone(seed, lambda g: [exact(g, dtype, m) for m in lengths])
        mine = [a.copy() for a in ins[rank]]
        assert comm.all_reduce(mine, op=op) is mine
        for k, a in enumerate(mine):
            same(a, reduced([x[k] for x in ins], op), "all_reduce %s %s n=%d"
                 % (dtype, op, lengths[k]))
ok("all_reduce")

# -- avg of random floats, and division=True; a bucket of 4 KiB (many buckets)
small = commlib.Communicator.from_mpi(bucket_bytes=4096)
for c, kwargs in ((comm, dict(op="avg")), (small, dict(division=True))):
    ins = everyone(100, lambda g: [g.standard_normal(m).astype(np.float32) for m in LENGTHS])
    mine = [a.copy() for a in ins[rank]]
    c.all_reduce(mine, **kwargs)
    for k, a in enumerate(mine):
        want = np.add.reduce(np.stack([x[k] for x in ins]).astype(np.float64), axis=0) / n
        np.testing.assert_allclose(a, want, rtol=1e-5, atol=1e-6)
        digest.update(a.tobytes())
small.close()
ok("all_reduce avg")


# -- fp16/bf16: float32 arrays travel in half precision; float64 as they are
def halves(x, fmt):
    return x.astype(np.float16 if fmt == "fp16" else ml_dtypes.bfloat16).astype(np.float32)


for fmt in ("fp16", "bf16"):
    for op in ("sum", "avg"):
        ins = everyone(200, lambda g: [(g.standard_normal(m) * 3).astype(np.float32)
                                       for m in LENGTHS] + [g.standard_normal(5)])
        mine = [a.copy() for a in ins[rank]]
        comm.all_reduce(mine, op=op, compression=fmt)
        for k, a in enumerate(mine):
            xs = [x[k] for x in ins]
            if a.dtype == np.float64:
                want = np.add.reduce(np.stack(xs), axis=0) / (n if op == "avg" else 1)
                np.testing.assert_allclose(a, want, rtol=1e-12, atol=0)
                continue
            # divided by n first when averaging, then cast; each step rounds
            terms = [halves(x / np.float32(n) if op == "avg" else x, fmt).astype(np.float64)
                     for x in xs]
            want = np.add.reduce(np.stack(terms), axis=0)
            eps = 2.0 ** -10 if fmt == "fp16" else 2.0 ** -7
            bound = np.add.reduce(np.abs(np.stack(terms)), axis=0) * (n * eps) + 2.0 ** -24
            assert (halves(a, fmt) == a).all(), "%s: not through %s" % (k, fmt)
            assert (np.abs(a - want) <= bound).all(), (fmt, op, k, np.abs(a - want).max())
            digest.update(a.tobytes())
    ok(fmt)

# -- hierarchical: within the node over shared memory, across nodes only each
# rank's share; sizes from empty to several windows (the largest case is one
# window and 3 elements, a block of quarters repeated: exact in any order,
# and quicker to make than as many random numbers)
if HIERARCHICAL:
    hier = comm._session.transports[0]
    window = hier.reducer.capacity_bytes
    shares, flat = [], []
    across_reduce, flat_reduce = hier.across.all_reduce, hier.fallback.all_reduce
    hier.across.all_reduce = lambda b, *a, **k: (shares.append(b.size), across_reduce(b, *a, **k))
    hier.fallback.all_reduce = lambda b, *a, **k: (flat.append(b.size), flat_reduce(b, *a, **k))
    big = window // 4 + 3
    cases = [("float64", "sum", m) for m in (0, 7, 8193, 100_003)] + [
        ("float32", "sum", big), ("float32", "avg", 300_001), ("float16", "sum", 70_001),
        ("int64", "max", 300_001), ("int32", "prod", 40_001), ("uint8", "sum", 300_001)]
    for k, (dtype, op, m) in enumerate(cases):
        ins = everyone(1000 + k, lambda g: (
            np.resize(exact(g, dtype, 4099), m) if m == big else g.integers(1, 3, m)
            if op == "prod" else g.integers(0, 60, m) if dtype == "uint8"
            else g.standard_normal(m) * 1000).astype(dtype))
        mine = ins[rank].copy()
        shares.clear(), flat.clear()
        comm.all_reduce(mine, op=op)
        what = "hierarchical %s %s n=%d" % (dtype, op, m)
        if dtype[0] == "f" and m != big:   # random floats: the order of the sums is not numpy's
            wide = np.stack(ins).astype(np.float64)
            by = n if op == "avg" else 1
            # n roundings at most (n - 1 sums, the scale), each within eps of the magnitudes
            bound = np.abs(wide).sum(0) / by * n * np.finfo(dtype).eps
            error = np.abs(mine.astype(np.float64) - wide.sum(0) / by)
            assert mine.dtype == np.dtype(dtype) and (error <= bound).all(), (what, error.max())
            digest.update(mine.tobytes())          # every rank's bits the same
        else:
            same(mine, reduced(ins, op), what)
        # the large ones crossed the nodes share by share, window by window
        if m * np.dtype(dtype).itemsize >= 64 << 10:
            step = window // np.dtype(dtype).itemsize
            r, L = comm.local_rank, PER_NODE
            want_shares = [w * (r + 1) // L - w * r // L
                           for w in (min(step, m - a) for a in range(0, m, step))]
            assert shares == want_shares and not flat, (what, shares, want_shares, flat)
        else:
            assert not shares and flat == ([m] if m else flat), (what, shares, flat)
    hier.across.all_reduce, hier.fallback.all_reduce = across_reduce, flat_reduce
    ok("hierarchical")

    # a rank late past the deadline (rank 0, then the last): every rank raises
    # CollectiveTimeoutError, or PeerError when a peer gave up first (its blame
    # passed on), and no rank's array is written; the late rank's
    # node peer names it by its world rank (check=False: the transport's own
    # wait, not the fingerprint exchange's). The late rank comes once every
    # other rank left (their notices).
    for bad in (0, n - 1):
        timed = commlib.Communicator.from_mpi(timeout=0.2, check=False)
        assert type(timed._session.transports[0]) is HierarchicalTransport
        x = np.full(100_003, rank + 1.0)
        notice = os.path.join(os.environ["COMMLIB_TEST_NODES_FOLDER"], "gave-up-%d-%%d" % bad)
        if rank == bad:
            limit = time.monotonic() + 60
            while not all(os.path.exists(notice % r) for r in range(n) if r != bad):
                assert time.monotonic() < limit, "rank %d: the others never gave up" % rank
                time.sleep(0.01)
        try:
            timed.all_reduce(x)
        except (errors.CollectiveTimeoutError, errors.PeerError) as exc:
            if type(exc) is errors.CollectiveTimeoutError:
                assert str(exc).startswith("rank %d: all_reduce #1 did not complete before "
                                           "its deadline" % rank), exc
                if rank != bad and rank // PER_NODE == bad // PER_NODE:   # bad's node
                    assert exc.culprits == (bad,), (bad, exc.culprits)
            else:       # a peer gave up first and said whom it waited for (the peer watch)
                assert type(exc) is errors.PeerError and "gave up in collective #1" in str(exc), exc
                assert exc.culprits == (bad,), (bad, exc.culprits, str(exc))
        else:
            raise AssertionError("rank %d: no timeout with rank %d late" % (rank, bad))
        assert (x == rank + 1.0).all(), "rank %d: written after a timeout" % rank
        open(notice % rank, "x").close()
        timed.close()
        comm.barrier()
    ok("hierarchical timeout")

# -- broadcast from every root
for root in range(n):
    ins = everyone(300 + root, lambda g: [exact(g, dt, m) for dt in ("float32", "int64", "uint8")
                                          for m in LENGTHS])
    mine = [a.copy() for a in ins[rank]]
    assert comm.broadcast(mine, root=root) is mine
    for a, w in zip(mine, ins[root]):
        same(a, w, "broadcast root=%d" % root)
ok("broadcast")

# -- reduce to every root: the root gets the sum, the others keep theirs
for root in range(n):
    ins = everyone(400 + root, lambda g: [exact(g, "float64", m) for m in LENGTHS])
    mine = [a.copy() for a in ins[rank]]
    comm.reduce(mine, root=root, op="sum")
    for k, a in enumerate(mine):
        same(a, reduced([x[k] for x in ins], "sum") if rank == root else ins[rank][k],
             "reduce root=%d n=%d" % (root, LENGTHS[k]), alike=False)
ok("reduce")

# -- all_gather
for dtype in ("float32", "int32", "uint8"):
    for shape in ((0,), (1,), (3, 5), (100_003,)):
        ins = everyone(500, lambda g: exact(g, dtype, shape))
        same(comm.all_gather(ins[rank].copy()), np.stack(ins), "all_gather %s %s"
             % (dtype, shape))
ok("all_gather")

# -- all_gatherv: lengths differ, rank 1's is empty
ins = everyone(600, lambda g: exact(g, "float32", int(g.integers(0, 70_000))))
ins[1] = ins[1][:0]
mine = ins[rank].copy() if rank != 1 else np.zeros(0, np.float32)
values, counts = comm.all_gatherv(mine)
assert list(counts) == [x.size for x in ins], counts
same(values, np.concatenate(ins), "all_gatherv")
ok("all_gatherv")

# -- reduce_scatter: block r of the sum goes to rank r
for m in (0, 1, 7, 40_001):
    for op in ("sum", "max"):
        ins = everyone(700 + m, lambda g: exact(g, "float32", n * m))
        got = comm.reduce_scatter(ins[rank].copy(), op=op)
        same(got, reduced(ins, op)[rank * m:(rank + 1) * m], "reduce_scatter %s m=%d" % (op, m),
             alike=False)
ok("reduce_scatter")

# -- barrier: nobody leaves before everyone's notice is written (the last
# rank comes late, so that a barrier that does not wait is seen)
folder = os.environ["COMMLIB_TEST_NODES_FOLDER"]
for step in range(2):
    if rank == n - 1:
        time.sleep(0.2)
    open(os.path.join(folder, "barrier-%d-%d" % (step, rank)), "x").close()
    comm.barrier()
    missing = [r for r in range(n) if not os.path.exists(
        os.path.join(folder, "barrier-%d-%d" % (step, r)))]
    assert not missing, "rank %d left barrier %d before ranks %s came" % (rank, step, missing)
ok("barrier")

# -- async: two all_reduces in flight, then a broadcast, then the waits
ins = everyone(800, lambda g: [exact(g, "float32", m) for m in LENGTHS])
first = [a.copy() for a in ins[rank]]
second = [a.copy() for a in ins[rank]]
w1 = comm.all_reduce(first, op="sum", async_op=True)
w2 = comm.all_reduce(second, op="max", async_op=True)
b = np.full(9, float(rank))
comm.broadcast(b, root=n - 1)
assert w1.wait() is first and w2.wait() is second
for k in range(len(LENGTHS)):
    same(first[k], reduced([x[k] for x in ins], "sum"), "async sum")
    same(second[k], reduced([x[k] for x in ins], "max"), "async max")
same(b, np.full(9, float(n - 1)), "broadcast between async calls")
ok("async")

# -- consistency check across nodes: a rank whose shape differs is named on
# every rank, nothing is written, and the communicator goes on
culprits_seen = []
for bad in sorted({0, n - 1}):
    z = np.full(5 if rank != bad else 6, float(rank), np.float32)
    keep = z.copy()
    try:
        comm.all_reduce(z)
    except errors.ConsistencyError as exc:
        assert type(exc) is errors.ConsistencyError and "disagree" in str(exc), exc
        assert "float32(5,)" in str(exc) and "float32(6,)" in str(exc), exc
        if n > 2:
            assert exc.culprits == (bad,), (bad, exc.culprits)
            assert "[%d]" % bad in str(exc), exc
        culprits_seen.append(exc.culprits)
    else:
        raise AssertionError("rank %d: shapes differing on rank %d passed" % (rank, bad))
    assert np.array_equal(z, keep), "written after a disagreement"
try:                                         # every rank but rank 0 differs
    comm.all_reduce(np.zeros(3 + rank, np.float32))
except errors.ConsistencyError as exc:
    assert type(exc) is errors.ConsistencyError and "disagree" in str(exc), exc
    assert exc.culprits == tuple(range(1, n)), exc.culprits
    culprits_seen.append(exc.culprits)
else:
    raise AssertionError("shapes 3 + rank passed")
x = np.full(3, rank + 1.0)
comm.all_reduce(x)
same(x, np.full(3, n * (n + 1) / 2), "all_reduce after the mismatches")
print("culprits %s rank %d" % (culprits_seen, rank), flush=True)
ok("mismatch")

# -- the same without the check: the fingerprint exchange still carries the board
off = commlib.Communicator.from_mpi(check=False)
assert isinstance(off._session.board, ExchangeBoard) and not off.check
ins = everyone(900, lambda g: [g.standard_normal(m).astype(np.float32) for m in LENGTHS])
mine = [a.copy() for a in ins[rank]]
off.all_reduce(mine, op="avg")
for k, a in enumerate(mine):
    want = np.add.reduce(np.stack([x[k] for x in ins]).astype(np.float64), axis=0) / n
    np.testing.assert_allclose(a, want, rtol=1e-5, atol=1e-6)
w = off.all_reduce(np.arange(7.0) * (rank + 1), op="sum", async_op=True)
same(w.wait(), np.arange(7.0) * sum(range(1, n + 1)), "async, check=False")
off.close()
ok("check=False")
comm.close()

# -- uneven steps: rank 1 takes one step more; every rank blames the
# minority (both ranks of two)
uneven = commlib.Communicator.from_mpi()
try:
    for _ in range(3 if rank == 1 else 2):
        uneven.all_reduce(np.ones(4))
    uneven.close()
except errors.PeerError as exc:
    print("blame %s rank %d" % (list(exc.culprits), rank), flush=True)
    assert list(exc.culprits) == ([1] if n > 2 else [0, 1]), exc.culprits
else:
    raise AssertionError("rank %d: uneven steps went unnoticed" % rank)
ok("uneven steps")
print("digest %s rank %d" % (digest.hexdigest(), rank), flush=True)
"""


def check_every_collective(run, layout):
    """Every rank of ``run`` (CODE at ``layout``) passed every check, on
    its node, with the same digest, and each node's link carried the large
    arrays."""
    nodes, per_node = layout
    n = nodes * per_node
    for check in CHECKS + HIERARCHICAL_CHECKS * (per_node > 1):
        assert_each_rank(run.text, r"ok %s rank (?P<rank>\d+)" % re.escape(check), n)
    assert run.node_of == [r // per_node for r in range(n)]
    local = {int(r): (int(i), int(s)) for i, s, r in
             re.findall(r"local (\d+) of (\d+) rank (\d+)", run.text)}
    assert local == {r: (r % per_node, per_node) for r in range(n)}, local
    digests = re.findall(r"digest (\w+) rank \d+", run.text)
    assert len(digests) == n and len(set(digests)) == 1, digests
    # the large arrays crossed the link: a 300 001-element float32 all-reduce
    # alone makes every node send at least (nodes - 1) / nodes of its 1.2 MB
    assert all(run.sent[i] > 1_000_000 for i in range(nodes)), run.sent


@pytest.mark.parametrize("layout", [(2, 1), (3, 1)], ids=["2x1", "3x1"])
def test_every_collective_across_nodes(layout):
    check_every_collective(run_nodes(layout, CODE, timeout=120, args=layout), layout)


def test_every_collective_under_the_launcher_with_hosts():
    """2x2 under ``python -m commlib.launch -n 4 --hosts <node 0>:2,<node 1>:2
    --launcher-exec <fake ssh>``: the ranks are placed two per node, every
    check passes on every rank, the launcher exits 0 having said nothing.
    Then ``python -m commlib.info --run 4`` with the same hosts names each
    rank's host, local rank and local size."""
    run, info = run_nodes((2, 2), CODE, timeout=120,
                          jobs=[launcher(args=(2, 2)), launcher(tool="commlib.info")])
    check_every_collective(run, (2, 2))
    assert not re.findall(r"^commlib\.launch: .*$", run.launcher, re.MULTILINE), run.launcher
    assert info.returncode == 0, info.launcher
    assert "4 ranks form one MPI world of 4: yes, on 2 hosts (node0, node1)" in info.launcher, \
        info.launcher
    ranks = re.findall(r"^rank (\d+): host (\S+), local rank (\d+) of (\d+)$", info.launcher,
                       re.MULTILINE)
    assert ranks == [(str(r), "node%d" % (r // 2), str(r % 2), "2") for r in range(4)], \
        info.launcher


def test_the_hierarchical_transport_is_for_nodes_alike_of_several_ranks():
    """Chosen from every rank's local_size: several nodes of the same number
    of ranks, more than one (uneven nodes and one node stay as they were)."""
    from commlib.transport.hierarchical import usable
    assert usable([2] * 4) and usable([3] * 6) and usable([2] * 6)
    for sizes in ([1], [1, 1], [2, 2], [4] * 4, [2, 2, 1], [1, 2, 2], [3, 3, 3, 2, 2]):
        assert not usable(sizes), sizes


# -- faults across nodes ------------------------------------------------------------------------

def fault_run(scenario, *args, expect_fail=False):
    """A scenario of tests/faults/fault_programs.py at 3x1, as tests/faults/
    fault_jobs.run runs it on one node; returns the records by rank and the
    run (whose exit status ``expect_fail`` says, as run_nodes')."""
    from fault_jobs import CODE as FAULT_CODE, DEADLINE
    notices = tempfile.mkdtemp(prefix="commlib-notices-")
    try:
        run = run_nodes((3, 1), FAULT_CODE, timeout=DEADLINE * 4 + 40,
                        args=(scenario, *args), survivors=True, expect_fail=expect_fail,
                        env={"COMMLIB_WATCHDOG_TIMEOUT": str(DEADLINE), "FAULT_NOTICES": notices})
    finally:
        shutil.rmtree(notices, ignore_errors=True)
    records = {}
    for line in run.text.splitlines():
        if "FAULT {" in line:
            record = json.loads(line[line.index("FAULT {") + len("FAULT "):])
            records.setdefault(record["rank"], []).append(record)
    return records, run


@pytest.mark.parametrize("late, leave", [(0, "sys.exit"), (2, "os._exit")])
def test_a_rank_that_exits_is_named_across_nodes(late, leave):
    """As tests/faults/test_faults.py's test_rank_that_vanishes_is_named_by_its_peers
    on one node: rank ``late`` ends with os._exit, its connections end
    without a goodbye, and the others raise PeerError naming it at once
    (or passing on the blame of a peer that saw it first). A survivor that
    then exits with ``sys.exit(1)`` does not hang in MPI's finalisation:
    the job ends at once, by MPI_Abort, with a failing status."""
    from fault_jobs import find, others
    records, run = fault_run("vanish", late, leave, expect_fail=leave == "sys.exit")
    for r in others(3, late):
        find(records, r, "done")
        got = find(records, r, "all_reduce")
        assert got["error"] == "PeerError" and got["culprits"] == [late], got
        assert got["seconds"] <= 1.5 and got["untouched"], got
        message = got["message"]
        assert message.startswith("rank %d: " % r), got
        assert "rank %d (pid " % late in message and \
            " on node%d) died while this rank waits in all_reduce #2" % late in message, got
        if leave == "sys.exit":
            assert "commlib: rank %d: rank %d of the communicator died; MPI cannot be " \
                   "finalised without it, so this process will end with MPI_Abort (status 1) " \
                   "at exit" % (r, late) in run.errors[r], run.errors[r]
    assert late not in records, records
    if leave == "sys.exit":
        assert run.seconds < 30, run.seconds     # the harness's bound is 48 s


def test_a_stalled_rank_is_named_across_nodes():
    """As tests/faults/test_stalls.py, each rank of three in turn late, in
    one job: with the check on, the peers name the rank that has not
    entered at the deadline; stalled inside the data phase, the rank that
    entered and went silent (no heartbeat); with the check off, the rank
    that has not arrived, from inside MPI's wait. The late rank learns
    that they gave up (blame passed on, never on a rank that gave up)."""
    from fault_programs import LARGE, SMALL
    from test_stalls import assert_late_learns, assert_peers_gave_up, entered, not_arrived
    records, _ = fault_run("stalls_nodes")
    for mode, said in (("board", not_arrived), ("inside", entered), ("off", not_arrived)):
        of_mode = {rank: [r for r in got if r.get("mode") == mode]
                   for rank, got in records.items()}
        for late in range(3):
            size = LARGE if late == 1 and mode == "board" else SMALL
            assert_peers_gave_up(of_mode, late, size, said(late), [late])
            assert_late_learns(of_mode, late, size, [late])
    # every rank came through to the end of the scenario
    assert [any(r["what"] == "done" for r in records.get(rank, ())) for rank in range(3)] \
        == [True] * 3, records


# -- the harness cleans up -------------------------------------------------------------------

BLOCKED = r"""
import os, sys, time
sys.path[:0] = [p for p in os.environ["PYTHONPATH"].split(os.pathsep) if p]
from nodes import run_nodes
run_nodes((2, 1), '''
import os, time
from mpi4py import MPI
open(os.path.join(FOLDER, "started-%d-%d" % (MPI.COMM_WORLD.Get_rank(), os.getpid())),
     "x").close()
time.sleep(300)
''', timeout=200)
"""


def blocked_job(tmp_path):
    """A process running a 2x1 job whose ranks block (each wrote a notice
    ``started-<rank>-<pid>``), with the pids of its ranks, once both started."""
    env = dict(os.environ, PYTHONPATH=python_path())
    code = BLOCKED.replace("FOLDER", repr(str(tmp_path)))
    proc = subprocess.Popen([sys.executable, "-c", code], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while len(list(tmp_path.glob("started-*"))) < 2:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            out, err = proc.communicate()
            pytest.fail("the blocked job did not start (exit %s)\n%s%s"
                        % (proc.returncode, out, err))
        time.sleep(0.05)
    ranks = [int(p.name.split("-")[2]) for p in tmp_path.glob("started-*")]
    return proc, ranks


def gone(pids, within=30):
    """Whether every process of ``pids`` has ended (and been reaped) within
    ``within`` seconds."""
    deadline = time.monotonic() + within
    while any(_pid_alive(p) for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def names_of(pid):
    return [n for n in namespaces() if n.startswith("commlib-%d-" % pid)]


@pytest.mark.parametrize("how", ["SIGINT", "SIGTERM"])
def test_ctrl_c_or_sigterm_removes_the_nodes(tmp_path, how):
    """Ctrl-C (SIGINT) or SIGTERM to the process in run_nodes: its ranks
    end and its namespaces are deleted before it exits."""
    proc, ranks = blocked_job(tmp_path)
    try:
        if _mode()[0] == "root":
            assert len(names_of(proc.pid)) == 3, names_of(proc.pid)    # two nodes, a switch
        proc.send_signal(getattr(signal, how))
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode != 0, out + err
    assert ("KeyboardInterrupt" if how == "SIGINT" else "Terminated") in err, err
    assert names_of(proc.pid) == []
    assert gone(ranks), ranks


def test_the_nodes_of_a_killed_run_are_removed_by_the_next():
    """A run killed with SIGKILL leaves its namespaces and ranks; the next
    run's sweep (remove_stale) kills the ranks and deletes the namespaces,
    and leaves those of live processes alone."""
    if _mode()[0] != "root":
        pytest.skip("namespaces outside a user namespace need root: the ones of a user "
                    "namespace go with its last process")
    folder = Path(tempfile.mkdtemp(prefix="commlib-blocked-"))
    proc, ranks = blocked_job(folder)
    live = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                            stdin=subprocess.PIPE)
    try:
        theirs = "commlib-%d-0" % live.pid          # a live process's: left alone
        subprocess.run(["ip", "netns", "add", theirs], check=True, timeout=30)
        mine = names_of(proc.pid)
        proc.kill()
        proc.communicate(timeout=60)
        assert names_of(proc.pid) == mine and len(mine) == 3
        removed = remove_stale()
        assert set(mine) <= set(removed) and theirs not in removed, (mine, removed)
        assert names_of(proc.pid) == [] and theirs in namespaces()
        assert gone(ranks), ranks
    finally:
        for p in (proc, live):
            if p.poll() is None:
                p.kill()
                p.wait()
        subprocess.run(["ip", "netns", "del", "commlib-%d-0" % live.pid], timeout=30)
        shutil.rmtree(folder, ignore_errors=True)
