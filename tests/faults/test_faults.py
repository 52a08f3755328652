"""The fault suite: every failure mode at 2 and 3 real ranks, with commlib's
default settings (only the watch dog's deadline is shortened, to
:data:`DEADLINE` seconds).

For each fault: no hang (every job runs under a hard bound), every
surviving rank raises a CommlibError naming the culprit within the deadline
plus 5 s, and no array is written after an error (a failed call leaves its
arrays untouched, and they stay so after the late peer has come and gone).
The rank programs are in tests/faults/fault_programs.py; rank 1 misbehaves.
"""
import json
import os
import sys

import numpy as np
import pytest

from mpirun import ROOT, mpiexec, run_bounded, run_mpi

DEADLINE = 2.0
LATE = 1
SIZES = [2, 3]
CODE = "import sys, fault_programs\nfault_programs.main(*sys.argv[1:])\n"


def run(n, scenario, *args, expect_fail=False, env=None):
    """Run ``scenario`` on ``n`` ranks; returns (records by rank, process)."""
    proc = run_mpi(n, CODE, timeout=DEADLINE * 4 + 40, args=(scenario, *args),
                   expect_fail=expect_fail,
                   env=dict({"COMMLIB_WATCHDOG_TIMEOUT": str(DEADLINE)}, **(env or {})))
    records = {}
    for line in proc.stdout.splitlines():
        if line.startswith("FAULT "):
            record = json.loads(line[len("FAULT "):])
            records.setdefault(record["rank"], []).append(record)
    return records, proc


def find(records, rank, what):
    found = [r for r in records.get(rank, []) if r["what"] == what]
    assert found, "rank %d reported no %r: %s" % (rank, what, records.get(rank))
    return found[0]


def uneven_blame(n):
    """Whom uneven steps blame when rank LATE alone stopped early: LATE, the
    rank whose count differs from the majority's; both ranks of two."""
    return [LATE] if n > 2 else [0, 1]


def others(n):
    return [r for r in range(n) if r != LATE]


def assert_raised(record, error, culprits=None, within=DEADLINE + 5, text=()):
    assert record["error"] == error, record
    if culprits is not None:
        assert record["culprits"] == list(culprits), record
    assert record["seconds"] <= within, record
    assert record["untouched"], record
    for fragment in text:
        assert fragment in record["message"], (fragment, record)


# -- a rank that hangs, dies or leaves ------------------------------------------------------

@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("scenario", ["stall", "stall_large"])
def test_stalled_rank_is_named_and_no_array_is_written_later(n, scenario):
    """The others raise at the deadline naming the late rank; the late rank,
    when it comes, raises naming one that gave up; nobody's arrays change."""
    records, proc = run(n, scenario, env={"COMMLIB_STALL_WARNING": "1"})
    for r in others(n):      # a warning at 1 s, the error at the deadline
        assert "commlib: rank %d has waited 1 s in all_reduce #2; rank %d last entered " \
               "all_reduce #1" % (r, LATE) in proc.stderr, proc.stderr
        got = find(records, r, "all_reduce")
        assert_raised(got, "CollectiveTimeoutError", [LATE], text=["rank %d " % LATE])
        assert got["seconds"] >= DEADLINE - 0.1, got
        assert not find(records, r, "after")["written_after"]
        assert find(records, r, "next")["error"] == "ClosedError"
    # the late rank learns that its peers gave up waiting for it
    assert_raised(find(records, LATE, "all_reduce"), "PeerError", [LATE], within=2.0,
                  text=["gave up", "waiting for rank %d" % LATE])
    assert not find(records, LATE, "after")["written_after"]


@pytest.mark.parametrize("n", SIZES)
def test_abandoned_mpi_collective_never_writes_into_the_arrays(n):
    """Consistency check off: the late rank joins the collective its peers
    gave up on inside MPI; it completes, but the peers' arrays, staged out
    of MPI's reach, stay as they were when their error was raised."""
    records, _ = run(n, "stall_unchecked")
    for r in others(n):
        got = find(records, r, "all_reduce")
        # the first to time out names the late rank; a peer that sees it give
        # up first passes the blame on
        assert got["error"] in ("CollectiveTimeoutError", "PeerError"), got
        assert_raised(got, got["error"], [LATE], text=["rank %d" % LATE])
        assert not find(records, r, "after")["written_after"]
    late = find(records, LATE, "all_reduce")
    if late["error"] is None:       # completed with the staged data its peers left
        assert find(records, LATE, "next")["error"] == "PeerError"
    else:                           # or noticed that they gave up
        assert_raised(late, "PeerError", within=3, text=["gave up"])
    assert not find(records, LATE, "after")["written_after"]


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("scenario, text", [("die_by_exception", "breaks down"),
                                            ("exception_in_with", "breaks inside with")])
def test_uncaught_exception_ends_the_job_and_peers_name_the_rank(n, scenario, text):
    records, proc = run(n, scenario, expect_fail=True)
    assert "RuntimeError: rank %d %s" % (LATE, text) in proc.stderr   # the traceback shows
    for r in others(n):
        assert_raised(find(records, r, "all_reduce"), "PeerError", [LATE], within=3,
                      text=["rank %d left after an exception" % LATE, text])


@pytest.mark.parametrize("n", SIZES)
def test_sys_exit_on_one_rank(n):
    records, proc = run(n, "sys_exit")
    for r in others(n):
        got = find(records, r, "all_reduce")
        # an exit at another step is uneven steps: the minority is blamed
        assert_raised(got, "PeerError", uneven_blame(n), within=3,
                      text=["after collective #1"])
        # at exit, or dropped as its frame unwound: both say the rank is gone
        assert ("rank %d exited" % LATE in got["message"]
                or "rank %d dropped the communicator" % LATE in got["message"]), got
    assert "commlib: at exit: rank %d:" % LATE in proc.stderr


@pytest.mark.parametrize("n", SIZES)
def test_close_on_one_rank_while_others_reduce(n):
    """Uneven steps: an error on every rank naming the rank that stopped
    early and the collective the others were in."""
    records, _ = run(n, "close_early")
    blamed = uneven_blame(n)
    for r in others(n):
        assert_raised(find(records, r, "all_reduce"), "PeerError", blamed, within=3,
                      text=["rank %d closed the communicator after collective #2" % LATE,
                            "all_reduce #3", "uneven number of steps"])
    assert_raised(find(records, LATE, "close"), "PeerError", blamed, within=3,
                  text=["this rank left after collective #2", "all_reduce #3", "uneven"])


@pytest.mark.parametrize("n", SIZES)
def test_uneven_steps_without_close(n):
    records, proc = run(n, "uneven_steps")
    for r in others(n):
        assert find(records, r, "step 1")["error"] is None
        got = find(records, r, "step 2")
        assert_raised(got, "PeerError", uneven_blame(n), within=3,
                      text=["after collective #2", "all_reduce #3", "uneven number of steps"])
    assert "this rank left after collective #2" in proc.stderr


@pytest.mark.parametrize("n", SIZES)
def test_ctrl_c_ends_a_waiting_rank_and_its_peers_learn_it(n):
    records, _ = run(n, "interrupt")
    got = find(records, 0, "all_reduce")
    assert got["error"] == "KeyboardInterrupt" and got["seconds"] < 1.5 and got["untouched"]
    for r in range(1, n):
        assert_raised(find(records, r, "all_reduce"), "PeerError", [0], within=3,
                      text=["rank 0 gave up", "KeyboardInterrupt"])


# -- calls that disagree -------------------------------------------------------------------

MISMATCHES = ["op", "shape", "dtype", "count", "order", "division", "compression",
              "compression settings", "root", "collective", "barrier timeout"]


@pytest.mark.parametrize("n", SIZES)
def test_every_mismatch_raises_on_every_rank_before_data_moves(n):
    records, _ = run(n, "mismatches")
    for r in range(n):
        for what in MISMATCHES:
            assert_raised(find(records, r, what), "ConsistencyError", within=2,
                          text=["ranks disagree on"])
        assert find(records, r, "afterwards")["error"] is None
        assert find(records, r, "result")["value"] == n * (n + 1) / 2


BAD_INPUT = {"None": "ArrayTypeError", "scalar": "ArrayTypeError",
             "list with None": "ArrayTypeError", "complex": "ArrayTypeError",
             "strided": "ArrayTypeError", "read-only": "ArrayTypeError",
             "integer avg": "ArrayTypeError", "bad op": "ArgumentError",
             "root": "ArgumentError", "all_gatherv None": "ArrayTypeError",
             "all_gather list": "ArgumentError", "barrier timeout": "ArgumentError",
             "compression": "ArgumentError"}


@pytest.mark.parametrize("n", SIZES)
def test_bad_input_on_one_rank_reaches_every_rank(n):
    records, _ = run(n, "bad_input")
    for what, error in BAD_INPUT.items():
        assert_raised(find(records, LATE, what), error, within=2, text=["rank %d" % LATE])
        for r in others(n):
            assert_raised(find(records, r, what), "ConsistencyError", [LATE], within=2,
                          text=["rank %d rejected its arguments" % LATE])
    for r in range(n):
        assert find(records, r, "afterwards")["error"] is None
        assert find(records, r, "result")["value"] == n * (n + 1) / 2


@pytest.mark.parametrize("n", SIZES)
def test_nonfinite_values_with_every_compression(n):
    records, _ = run(n, "nonfinite")
    cases = [r["what"] for r in records[0] if r["what"] not in ("afterwards", "done")]
    assert len(cases) == 8, cases
    for r in range(n):
        for what in cases:
            assert_raised(find(records, r, what), "NonFiniteError", [LATE], within=2)
        assert find(records, r, "afterwards")["error"] is None


@pytest.mark.parametrize("n", SIZES)
def test_tampered_sparse_payload(n):
    records, _ = run(n, "tampered")
    for r in range(n):
        assert_raised(find(records, r, "out of range"), "PayloadError", [LATE], within=2,
                      text=["rank %d sent index 10000000" % LATE])
        assert find(records, r, "afterwards")["error"] is None


@pytest.mark.parametrize("n", SIZES)
def test_new_partial_object_per_call_on_one_rank_keeps_windows_in_step(n):
    from commlib.compression import Partial
    records, _ = run(n, "partial_objects")
    for r in range(n):
        values = find(records, r, "partial")["values"]
        for call, got in enumerate(values):
            start, stop = Partial(0.25).window(len(got), call)
            want = np.arange(len(got)) + r + 1.0 + call
            want[start:stop] = np.arange(start, stop) + call + (n + 1) / 2
            assert np.array_equal(np.float32(got), np.float32(want)), (r, call)


# -- settings --------------------------------------------------------------------------------

@pytest.mark.parametrize("variable, setting", [("COMMLIB_WATCHDOG_ENABLE", "timeout"),
                                               ("COMMLIB_CHECK", "check")])
def test_watch_dog_or_check_on_one_rank_only(variable, setting):
    records, _ = run(2, "settings_differ", variable)
    for r in range(2):
        assert_raised(find(records, r, variable), "ConsistencyError", within=5,
                      text=["different settings", setting])


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "ten"])
def test_bad_watchdog_timeout_in_the_environment(value):
    records, _ = run(2, "bad_environment", value)
    for r in range(2):
        assert_raised(find(records, r, value), "ArgumentError", within=5,
                      text=["COMMLIB_WATCHDOG_TIMEOUT"])


@pytest.mark.parametrize("n", SIZES)
def test_error_inside_init_on_one_rank(n):
    records, _ = run(n, "init_error")
    assert_raised(find(records, LATE, "init"), "ArgumentError", within=5, text=["backend"])
    for r in others(n):
        assert_raised(find(records, r, "init"), "ConsistencyError", [LATE], within=5,
                      text=["rank %d failed" % LATE, "backend"])


@pytest.mark.parametrize("n", SIZES)
def test_mpi_error_becomes_a_transport_error(n):
    records, _ = run(n, "mpi_error", env={"COMMLIB_SHM": "0"})
    for r in range(1, n):      # the ranks that received too little
        assert_raised(find(records, r, "broadcast"), "TransportError", within=3,
                      text=["rank %d: MPI reported an error in broadcast" % r,
                            "different sizes or dtypes"])


def test_dropped_communicators_do_not_exhaust_mpi():
    records, _ = run(2, "dropped")
    assert [find(records, r, "dropped")["left"] for r in range(2)] == [0, 0]


# -- launchers -------------------------------------------------------------------------------

def _script(tmp_path, body):
    path = tmp_path / "job.py"
    path.write_text("import os, signal, sys, time\nimport numpy as np\nimport commlib\n"
                    "comm = commlib.init()\nx = np.ones(1000)\ncomm.all_reduce(x)\n" + body)
    return path


def _env():
    return dict(os.environ, COMMLIB_WATCHDOG_TIMEOUT=str(DEADLINE),
                PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))


@pytest.mark.parametrize("how", ["os._exit(0)", "os.kill(os.getpid(), signal.SIGKILL)"])
def test_launcher_names_a_rank_that_vanished(tmp_path, how):
    script = _script(tmp_path, "if comm.rank == 1:\n    %s\ncomm.all_reduce(x)\n" % how)
    proc = run_bounded([sys.executable, "-m", "commlib.launch", "-n", "3", "--backend", "mpi",
                        script], 60, env=_env())
    last = [l for l in proc.stderr.splitlines() if l.startswith("commlib.launch:")][-1]
    assert proc.returncode != 0 and "rank 1 " in last, proc.stderr
    assert "rank 0 " not in last and "rank 2 " not in last, proc.stderr


@pytest.mark.parametrize("runner", ["launcher", "mpi4py"])
def test_exception_inside_with_ends_the_job_with_its_traceback(tmp_path, runner):
    script = _script(tmp_path, "comm.close()\nwith commlib.init() as comm:\n"
                               "    if comm.rank == 1:\n        raise ValueError('inside with')\n"
                               "    comm.all_reduce(x)\n")
    cmd = ([sys.executable, "-m", "commlib.launch", "-n", "2", "--backend", "mpi"]
           if runner == "launcher" else [*mpiexec(), "-n", "2", sys.executable, "-m", "mpi4py"])
    proc = run_bounded(cmd + [script], 60, env=_env())
    assert proc.returncode != 0, proc.stderr
    assert proc.stderr.count("ValueError: inside with") >= 1, proc.stderr


@pytest.mark.parametrize("n", [2, 3, 4])
def test_the_rank_with_an_extra_optimizer_step_is_blamed(tmp_path, n):
    """DistributedOptimizer, rank 1 takes one step more than the others: the
    others' close() and rank 1's step name rank 1 (the rank whose number of
    collectives differs from the majority's), and so does the launcher; with
    two ranks neither count is the majority's and both are named."""
    path = tmp_path / "job.py"
    path.write_text(
        "import json, sys\nimport numpy as np\nimport commlib\nfrom commlib.optim import SGD\n"
        "comm = commlib.init()\n"
        "params = [np.zeros(10, np.float32), np.zeros(3, np.float32)]\n"
        "opt = commlib.DistributedOptimizer(comm, params, SGD(0.1))\n"
        "steps = 4 if comm.rank == 1 else 3\n"
        "try:\n"
        "    for _ in range(steps):\n"
        "        opt.step([np.ones(10, np.float32), np.ones(3, np.float32)])\n"
        "    comm.close()\n"
        "except commlib.PeerError as exc:\n"
        "    print('BLAME ' + json.dumps({'rank': comm.rank, 'culprits': list(exc.culprits),\n"
        "                                 'message': str(exc)}), flush=True)\n"
        "    raise\n")
    proc = run_bounded([sys.executable, "-m", "commlib.launch", "-n", str(n), "--backend",
                        "mpi", path], 90, env=_env())
    assert proc.returncode != 0, proc.stderr
    said = {}
    for line in proc.stdout.splitlines():
        if "BLAME " in line:
            record = json.loads(line.split("BLAME ", 1)[1])
            said[record["rank"]] = record
    assert sorted(said) == list(range(n)), proc.stdout
    want = [1] if n > 2 else [0, 1]
    for rank, record in said.items():
        assert record["culprits"] == want, record
        assert "uneven number of steps" in record["message"], record
        assert ("blaming rank 1" if n > 2 else "blaming ranks 0, 1") in record["message"] \
            or (rank == 1 and n > 2 and "blaming this rank" in record["message"]), record
    last = [l for l in proc.stderr.splitlines() if l.startswith("commlib.launch:")][-1]
    if n > 2:
        assert last.startswith("commlib.launch: rank 1 failed"), proc.stderr
        assert "blaming rank 1" in last, proc.stderr
