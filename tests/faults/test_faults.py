"""The fault suite: every failure mode on real ranks, with commlib's
default settings (only the watch dog's deadline is shortened, to
:data:`fault_jobs.DEADLINE` seconds), the misbehaving rank tried as the
first, a middle and the last of three (stalls: tests/faults/test_stalls.py).

For each fault: no hang (every job runs under a hard bound), every
surviving rank raises a CommlibError naming the culprit, and no array is
written after an error (a failed call leaves its arrays untouched). The
rank programs are in tests/faults/fault_programs.py; scenarios after which
the communicator stays usable try every rank in one job.
"""
import json
import os
import shutil
import sys

import numpy as np
import pytest

from fault_jobs import DEADLINE, assert_raised, find, others, run
from mpirun import ROOT, mpiexec, run_bounded

N = 3
RANKS = list(range(N))
LATE = 1          # the misbehaving rank of scenarios that try one rank only


# -- a rank that dies or leaves ------------------------------------------------------------

@pytest.mark.parametrize("late", RANKS)
@pytest.mark.parametrize("scenario, text", [("die_by_exception", "breaks down"),
                                            ("exception_in_with", "breaks inside with")])
def test_uncaught_exception_ends_the_job_and_peers_name_the_rank(scenario, text, late):
    records, proc = run(N, scenario, late, expect_fail=True)
    assert "RuntimeError: rank %d %s" % (late, text) in proc.stderr   # the traceback shows
    for r in others(N, late):
        assert_raised(find(records, r, "all_reduce"), "PeerError", [late], 3,
                      ["rank %d: rank %d left after an exception after collective #%d"
                       % (r, late, 0 if scenario == "die_by_exception" else 1),
                       "RuntimeError: rank %d %s" % (late, text)])
    assert late not in records, records          # it died before any record


@pytest.mark.parametrize("late", RANKS)
def test_sys_exit_on_one_rank(late):
    """An exit at another step is uneven steps: the rank with fewer is blamed."""
    records, proc = run(N, "sys_exit", late)
    for r in others(N, late):
        got = find(records, r, "all_reduce")
        assert_raised(got, "PeerError", [late], 3,
                      ["after collective #1", "uneven number of steps: rank %d entered 1 "
                       "collective, ranks %s entered 2 collectives; blaming rank %d"
                       % (late, ", ".join(map(str, others(N, late))), late)])
        # at exit, or dropped as its frame unwound: both say the rank is gone
        assert ("rank %d exited" % late in got["message"]
                or "rank %d dropped the communicator" % late in got["message"]), got
    assert "commlib: at exit: rank %d:" % late in proc.stderr


@pytest.mark.parametrize("late", RANKS)
def test_rank_that_vanishes_is_named_by_its_peers(late):
    """os._exit on one rank: no word on the status board; the others find
    its process gone and raise PeerError naming it at once. (A SIGKILL
    makes hydra end the whole job at once, so the peers may not get to
    report: test_launcher_names_a_rank_that_vanished covers it.)"""
    records, _ = run(N, "vanish", late, survivors=True)
    for r in others(N, late):
        got = find(records, r, "all_reduce")
        assert_raised(got, "PeerError", [late], 3,
                      ["rank %d: rank %d (pid " % (r, late),
                       ") died while this rank waits in all_reduce #2"])
        find(records, r, "done")
    assert late not in records, records


@pytest.mark.parametrize("how", ["close", "drop"])
def test_one_rank_leaving_early_each_rank_in_turn(how):
    """Uneven steps: a rank closes (or drops) its communicator after two
    steps while the others take a third; an error on every rank naming the
    rank that stopped early (the one whose count differs) and the
    collective the others were in."""
    records, _ = run(N, how + "_early")
    said = {"close": "closed the communicator",
            "drop": "dropped the communicator without close() (its script ended, or the "
                    "last reference went away)"}[how]
    for late in RANKS:
        steps = ("uneven number of steps: rank %d entered 2 collectives, ranks %s entered 3 "
                 "collectives; "
                 % (late, ", ".join(map(str, others(N, late)))))
        for r in others(N, late):
            assert_raised(find(records, r, "step 2", late=late), "PeerError", [late], 3,
                          ["rank %d: rank %d %s after collective #2" % (r, late, said),
                           "while this rank is in all_reduce #3", steps + "blaming rank %d"
                           % late])
        if how == "close":
            assert_raised(find(records, late, "close", late=late), "PeerError", [late], 3,
                          ["rank %d: this rank left after collective #2 but rank " % late,
                           "all_reduce #3", steps + "blaming this rank"])


def test_uneven_steps_without_close():
    """A script that ends after fewer steps: its communicator is closed at
    exit, and the ranks still stepping learn it."""
    records, proc = run(2, "uneven_steps")
    got = find(records, 0, "step 2")
    assert_raised(got, "PeerError", [0, 1], 3,
                  ["rank 0: rank 1 exited after collective #2 while this rank is in "
                   "all_reduce #3", "uneven number of steps"])
    assert find(records, 0, "step 1")["error"] is None
    assert "rank 1: this rank left after collective #2" in proc.stderr


def test_ctrl_c_ends_a_waiting_rank_and_its_peers_learn_it():
    records, _ = run(N, "interrupt")
    got = find(records, 0, "all_reduce")
    assert got["error"] == "KeyboardInterrupt" and got["seconds"] < 1.5 and got["untouched"]
    for r in range(1, N):
        assert_raised(find(records, r, "all_reduce"), "PeerError", [0], 3,
                      ["rank %d: rank 0 gave up in collective #1" % r, "KeyboardInterrupt"])


# -- calls that disagree -------------------------------------------------------------------

#: what each rank's line of the error says of the misbehaving rank's call
MISMATCHES = {
    "op": lambda late: "all_reduce(op=max, average=False) 3 arrays",
    "shape": lambda late: "3 arrays: float32(1000,) float32(1000,) float32(10, 100)",
    "dtype": lambda late: "3 arrays: float64(1000,) float64(1000,) float64(1000,)",
    "count": lambda late: "2 arrays: float32(1000,) float32(1000,)",
    "order": lambda late: "3 arrays: float32(1000,) float32(1000,) float32(2000,)",
    "division": lambda late: "all_reduce(op=sum, average=True)",
    "compression": lambda late: "all_reduce(op=sum, average=False, compression=fp16)",
    "compression settings": lambda late: "compression=topk(ratio=0.1,",
    "root": lambda late: "broadcast(root=%d)" % ((late + 1) % N),
    "collective": lambda late: "barrier() 0 arrays",
    "barrier timeout": lambda late: "barrier(timeout=30) 0 arrays"}


def test_every_mismatch_raises_on_every_rank_before_data_moves():
    records, _ = run(N, "mismatches")
    for late in RANKS:
        for r in RANKS:
            for what, shown in MISMATCHES.items():
                got = find(records, r, what, late=late)
                assert_raised(got, "ConsistencyError", [late], 2,
                              ["rank %d: ranks disagree on" % r,
                               "\n  ranks %s: " % others(N, late), "\n  ranks [%d]: " % late])
                line = got["message"].split("\n  ranks [%d]: " % late)[1].split("\n")[0]
                assert shown(late) in line, (what, got)
            assert find(records, r, "afterwards", late=late)["error"] is None
            assert find(records, r, "result", late=late)["value"] == N * (N + 1) / 2


BAD_INPUT = {"None": "ArrayTypeError", "scalar": "ArrayTypeError",
             "list with None": "ArrayTypeError", "complex": "ArrayTypeError",
             "strided": "ArrayTypeError", "read-only": "ArrayTypeError",
             "integer avg": "ArrayTypeError", "bad op": "ArgumentError",
             "root": "ArgumentError", "all_gatherv None": "ArrayTypeError",
             "all_gather list": "ArgumentError", "barrier timeout": "ArgumentError",
             "compression": "ArgumentError"}


def test_bad_input_on_one_rank_reaches_every_rank():
    records, _ = run(N, "bad_input")
    for late in RANKS:
        for what, error in BAD_INPUT.items():
            mine = find(records, late, what, late=late)
            assert_raised(mine, error, [], 2, ["rank %d" % late])
            for r in others(N, late):
                assert_raised(find(records, r, what, late=late), "ConsistencyError", [late], 2,
                              ["rank %d: " % r, "rank %d rejected its arguments: %s"
                               % (late, mine["message"][:60])])
        for r in RANKS:
            assert find(records, r, "afterwards", late=late)["error"] is None
            assert find(records, r, "result", late=late)["value"] == N * (N + 1) / 2


def test_nonfinite_values_with_every_compression():
    records, _ = run(N, "nonfinite")
    cases = sorted({r["what"] for r in records[0] if r["what"] not in ("afterwards", "done")})
    assert len(cases) == 8, cases
    for late in RANKS:
        for r in RANKS:
            for what in cases:
                assert_raised(find(records, r, what, late=late), "NonFiniteError", [late], 2,
                              ["rank %d (1 value)" % late])
            assert find(records, r, "afterwards", late=late)["error"] is None


def test_tampered_sparse_payload():
    records, _ = run(N, "tampered")
    for late in RANKS:
        for r in RANKS:
            assert_raised(find(records, r, "out of range", late=late), "PayloadError", [late], 2,
                          ["rank %d sent index 10000000" % late])
            assert find(records, r, "afterwards", late=late)["error"] is None


def partial_windows(size, calls):
    """The window of each call of Partial(0.25) over ``size`` values, from
    the documented rule, apart from the code: windows of ceil(size / 4)
    values in turn."""
    width = -(-size // 4)
    starts = list(range(0, size, width))
    return [(starts[c % len(starts)], min(size, starts[c % len(starts)] + width))
            for c in range(calls)]


def test_partial_windows_rule_of_the_test():
    assert partial_windows(1000, 6) == [(0, 250), (250, 500), (500, 750), (750, 1000),
                                        (0, 250), (250, 500)]
    assert partial_windows(10, 4) == [(0, 3), (3, 6), (6, 9), (9, 10)]


def test_new_partial_object_per_call_on_one_rank_keeps_windows_in_step():
    records, _ = run(N, "partial_objects")
    for late in RANKS:
        for r in RANKS:
            values = find(records, r, "partial", late=late)["values"]
            assert len(values) == 6
            for call, ((start, stop), got) in enumerate(
                    zip(partial_windows(len(values[0]), 6), values)):
                want = np.arange(len(got)) + r + 1.0 + call
                want[start:stop] = np.arange(start, stop) + call + (N + 1) / 2
                assert np.array_equal(np.float32(got), np.float32(want)), (late, r, call)


# -- settings --------------------------------------------------------------------------------

@pytest.mark.parametrize("variable, setting, value", [
    ("COMMLIB_WATCHDOG_ENABLE", "timeout", "None"), ("COMMLIB_CHECK", "check", "False")])
def test_watch_dog_or_check_on_one_rank_only(variable, setting, value):
    """Each rank in turn turns one off: no rank makes the communicator."""
    records, _ = run(N, "settings_differ", variable)
    usual = {"timeout": repr(DEADLINE), "check": "True"}[setting]
    for late in RANKS:
        groups = sorted([([late], value), (others(N, late), usual)])
        for r in RANKS:
            assert_raised(find(records, r, variable, late=late), "ConsistencyError", [], 5,
                          ["rank %d: ranks made their communicators with different settings"
                           % r, "\n  %s: %s" % (setting, ", ".join(
                               "ranks %s: %s" % group for group in groups))])


#: what each bad COMMLIB_WATCHDOG_TIMEOUT is told
BAD_TIMEOUTS = {value: "invalid environment variable: COMMLIB_WATCHDOG_TIMEOUT=%r: expected a "
                       "positive, finite number of seconds" % value
                for value in ("0", "-1", "nan", "inf", "ten")}


def test_bad_watchdog_timeout_in_the_environment():
    records, _ = run(2, "bad_environment", *BAD_TIMEOUTS)
    for value, text in BAD_TIMEOUTS.items():
        for r in range(2):
            assert_raised(find(records, r, value), "ArgumentError", [], 5, [text])


def test_bad_watchdog_timeout_names_the_rank():
    records, _ = run(2, "bad_environment", "ten")
    for r in range(2):
        assert_raised(find(records, r, "ten"), "ArgumentError", [], 5, ["rank %d" % r])


def test_error_inside_init_on_one_rank():
    records, _ = run(N, "init_error")
    for late in RANKS:
        assert_raised(find(records, late, "init", late=late), "ArgumentError", [], 5,
                      ["rank %d" % late, "backend"])
        for r in others(N, late):
            assert_raised(find(records, r, "init", late=late), "ConsistencyError", [late], 5,
                          ["rank %d: " % r, "rank %d failed" % late, "backend"])


def test_mpi_error_becomes_a_transport_error():
    records, _ = run(N, "mpi_error", env={"COMMLIB_SHM": "0"})
    got = [find(records, r, "broadcast") for r in range(1, N)]  # received too little
    own = [g["rank"] for g in got if g["error"] == "TransportError"]
    assert own, got
    for g in got:
        if g["rank"] in own:
            assert_raised(g, "TransportError", [], 3,
                          ["rank %d: MPI reported an error in broadcast" % g["rank"],
                           "different sizes or dtypes"])
        else:   # a peer's error reached it before its own: the error passes on
            assert_raised(g, "PeerError", own, 3,
                          ["rank %d: " % g["rank"], "gave up in collective #1",
                           "MPI reported an error in broadcast", "different sizes or dtypes"])


def test_dropped_communicators_do_not_exhaust_mpi():
    records, _ = run(2, "dropped", timeout=120)
    got = [find(records, r, "dropped") for r in range(2)]
    assert [g["left"] for g in got] == [0, 0], got
    assert all(g["before"] > 100 and g["after"] == g["before"] for g in got), [
        (g["before"], g["after"]) for g in got]


# -- launchers -------------------------------------------------------------------------------

def _script(tmp_path, body):
    path = tmp_path / "job.py"
    path.write_text("import os, signal, sys, time\nimport numpy as np\nimport commlib\n"
                    "comm = commlib.init()\nx = np.ones(1000)\ncomm.all_reduce(x)\n" + body)
    return path


def _env():
    return dict(os.environ, COMMLIB_WATCHDOG_TIMEOUT=str(DEADLINE),
                PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))


@pytest.mark.parametrize("how, late", [("os._exit(0)", 1)] + [
    ("os.kill(os.getpid(), signal.SIGKILL)", late) for late in RANKS])
def test_launcher_names_a_rank_that_vanished(tmp_path, how, late):
    script = _script(tmp_path, "if comm.rank == %d:\n    %s\ncomm.all_reduce(x)\n"
                     % (late, how))
    proc = run_bounded([sys.executable, "-m", "commlib.launch", "-n", str(N), "--backend",
                        "mpi", script], 60, env=_env())
    last = [l for l in proc.stderr.splitlines() if l.startswith("commlib.launch:")][-1]
    assert proc.returncode != 0 and last.startswith("commlib.launch: rank %d " % late), \
        proc.stderr
    assert all("rank %d " % r not in last for r in others(N, late)), proc.stderr


def test_launcher_names_the_failed_rank_without_a_shared_status_directory(tmp_path):
    """As on nodes that share no directory with the launcher's: the ranks
    are told a status directory that does not exist where they run (an
    mpiexec that sets it to another path); their records come back over
    mpiexec's output instead, and the launcher names the rank that failed
    and prints its traceback, not rank 0's silence."""
    late = 2
    mpiexec = tmp_path / "mpiexec"
    real = shutil.which("mpiexec.hydra", path=os.path.dirname(sys.executable))
    mpiexec.write_text('#!/bin/sh\n[ "$1" = --version ] && exec %s --version\n'
                       'exec %s -genv COMMLIB_LAUNCH_STATUS_DIR %s "$@"\n'
                       % (real, real, tmp_path / "elsewhere"))
    mpiexec.chmod(0o700)
    script = _script(tmp_path, "if comm.rank == %d:\n    raise ValueError('rank %d breaks')\n"
                               "comm.all_reduce(x)\n" % (late, late))
    proc = run_bounded([sys.executable, "-m", "commlib.launch", "-n", str(N), "--backend",
                        "mpi", "--mpiexec", str(mpiexec), script], 60, env=_env())
    last = [l for l in proc.stderr.splitlines() if l.startswith("commlib.launch:")][-1]
    assert proc.returncode == 1 and last.startswith("commlib.launch: rank %d " % late), \
        proc.stderr
    assert "ValueError: rank %d breaks" % late in proc.stderr, proc.stderr
    assert "commlib-record" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    assert not (tmp_path / "elsewhere").exists()


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
