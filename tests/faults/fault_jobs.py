"""Running a scenario of tests/faults/fault_programs.py as an MPI job and
reading back what each rank reported (shared by the fault tests)."""
import json
import shutil
import tempfile

from mpirun import run_mpi

#: the watch dog's deadline of the fault jobs (seconds); the stall episodes
#: set their own (fault_programs.STALL_DEADLINE)
DEADLINE = 2.0
CODE = "import sys, fault_programs\nfault_programs.main(*sys.argv[1:])\n"


def run(n, scenario, *args, expect_fail=False, env=None, survivors=False, timeout=None):
    """Run ``scenario`` on ``n`` ranks, with a notice folder of its own;
    returns (records by rank, process). ``args`` are the scenario's (the
    misbehaving rank first, where it takes one)."""
    notices = tempfile.mkdtemp(prefix="commlib-notices-")
    try:
        proc = run_mpi(n, CODE, timeout=timeout or DEADLINE * 4 + 40,
                       args=(scenario, *map(str, args)), expect_fail=expect_fail,
                       survivors=survivors,
                       env=dict({"COMMLIB_WATCHDOG_TIMEOUT": str(DEADLINE),
                                 "FAULT_NOTICES": notices}, **(env or {})))
    finally:
        shutil.rmtree(notices, ignore_errors=True)
    records = {}
    for line in proc.stdout.splitlines():
        if "FAULT {" in line:
            record = json.loads(line[line.index("FAULT {") + len("FAULT "):])
            records.setdefault(record["rank"], []).append(record)
    return records, proc


def find(records, rank, what, **where):
    """Rank ``rank``'s one record ``what`` (whose fields match ``where``)."""
    found = [r for r in records.get(rank, []) if r["what"] == what
             and all(r.get(k) == v for k, v in where.items())]
    assert len(found) == 1, "rank %d reported %d %r records %s: %s" % (
        rank, len(found), what, where, records.get(rank))
    return found[0]


def others(n, late):
    return [r for r in range(n) if r != late]


def assert_raised(record, error, culprits, within, text=(), untouched=True):
    """``record`` (of :func:`fault_programs.attempt`) raised exactly
    ``error`` (a class name) naming exactly ``culprits`` within ``within``
    seconds, its message holding each of ``text``; its arrays untouched
    unless ``untouched`` is None."""
    assert record["error"] == error, record
    assert record["culprits"] == list(culprits), record
    assert record["seconds"] <= within, record
    if untouched is not None:
        assert record["untouched"] == untouched, record
    for fragment in text:
        assert fragment in record["message"], (fragment, record)
