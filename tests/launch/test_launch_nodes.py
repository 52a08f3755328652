"""The launcher across nodes (tests/nodes.py: network namespaces joined by a
bridge, hydra reaching them through a fake ssh): ``python -m commlib.launch
--hosts a:2,b:2 --launcher-exec <fake ssh>`` at 2x2, where the launcher's
status directory exists on node 0 only and the ranks of node 1 send their
records over their output.

Every fault runs in one network, one launcher job after the other: a rank
killed with SIGKILL, one that calls ``os._exit(0)``, one that raises, one
that stalls, one that takes a step fewer; the culprit is rank 0 (whose
records the launcher's node holds) or a rank of node 1 (whose records
travel over its output), by turns. Every rank raises or is ended within seconds of the fault, the
launcher's last line names the culprit, and nothing is left running.
Two faults run under bare mpiexec in the same network, for comparison.
(The job with correct results, and ``commlib.info --run`` with
``--hosts``, is tests/transport/test_nodes.py's 2x2.)"""
import re
import signal

from nodes import launcher, run_nodes

FAULTS = r"""
import os, signal, sys, threading, time
import numpy as np
import commlib
from commlib import errors

KIND, BAD = sys.argv[1], int(sys.argv[2])
from mpi4py import MPI
MPI.COMM_WORLD.Barrier()                    # every rank here, however slow its start
comm = commlib.Communicator.from_mpi(timeout=2)
rank = comm.rank
n = comm.size
folder = os.environ["COMMLIB_TEST_NODES_FOLDER"]


def fault():
    with open(os.path.join(folder, "fault"), "x") as f:
        f.write(repr(time.time()))


STEPS = 3
try:
    for step in range(STEPS):
        if rank == BAD and step == STEPS - 1:
            fault()
            if KIND == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            elif KIND == "exit":
                os._exit(0)
            elif KIND == "raise":
                raise RuntimeError("rank %d: the script failed" % rank)
            elif KIND == "stall":
                threading.Event().wait()
            elif KIND == "uneven":
                break
        x = np.full(10_001, rank + 1.0)
        comm.all_reduce(x)
        assert (x == n * (n + 1) / 2).all(), x[:3]
    comm.close()
except errors.CommlibError as exc:
    print("raised %s %s rank %d" % (type(exc).__name__, list(getattr(exc, "culprits", ())),
                                     rank), flush=True)
    raise
print("finished rank %d" % rank, flush=True)
"""

#: (fault, culprit, launcher's exit status, its last line's start)
CASES = [
    ("kill", 3, 128 + signal.SIGKILL, "rank 3 was killed by SIGKILL; all workers ended"),
    ("exit", 0, 1, "rank 0 exited with status 0 without finishing its script"),
    ("raise", 2, 1, "rank 2 failed with exit code 1 (RuntimeError: rank 2: the script failed)"),
    ("stall", 0, 1, "rank 0 is at fault: rank"),
    ("uneven", 3, 1, "rank 3 failed with exit code 1 (PeerError blaming rank 3: "),
]
#: seconds from the fault until the launcher has exited and every rank ended
#: (a stall: the peers' watch dog, 2 s, then ending the job)
ENDED_WITHIN_S = 5


def said(text):
    return re.findall(r"^commlib\.launch: (.*)$", text, re.MULTILINE)


#: (fault, culprit) under bare mpiexec, for comparison (docs/launching.md's table)
BARE = [("kill", 3), ("raise", 0)]


def test_faults_under_the_launcher_across_nodes():
    runs = run_nodes((2, 2), FAULTS, timeout=60, expect_fail=True,
                     jobs=[launcher(args=(kind, bad)) for kind, bad, _, _ in CASES] +
                     [launcher(args=case, tool="mpiexec") for case in BARE])
    for (kind, bad), run in zip(BARE, runs[len(CASES):]):
        # bare mpiexec ends every rank too, but names no rank: a killed rank is a pid
        # and a host in hydra's banner, an exception a traceback among the others; a
        # peer that raises blames the first death it saw, the culprit's or that of a
        # rank hydra ended with it (rank 2 blamed for rank 3's SIGKILL, seen)
        what = "bare mpiexec, %s on rank %d: %s" % (kind, bad, run.describe())
        after = run.ended + run.gone_s - float(run.files["fault"])
        print("bare mpiexec, %s on rank %d: exit status %d, every rank ended %.2f s after the "
              "fault" % (kind, bad, run.returncode, after))
        assert run.left == [] and after < ENDED_WITHIN_S, what
        raised = {int(r): culprits for culprits, r in re.findall(
            r"raised PeerError (\[[\d, ]*\]) rank (\d+)", run.text)}
        assert bad not in raised and all(re.fullmatch(r"\[\d\]", c) for c in raised.values()), \
            what
        if kind == "kill":
            pid = [r["pid"] for r in run.reports if r["rank"] == bad][0]
            assert "PID %d RUNNING AT 10.250.0.2" % pid in run.launcher, what
        else:
            assert "RuntimeError: rank 0: the script failed" in run.errors[0], what
        assert not said(run.launcher), what
    for (kind, bad, status, line), run in zip(CASES, runs):
        what = "%s on rank %d: %s" % (kind, bad, run.describe())
        assert run.returncode == status, what
        assert said(run.launcher)[-1].startswith(line), what
        assert said(run.launcher)[-1].endswith("all workers ended"), what
        assert run.left == [], what
        after = run.ended + run.gone_s - float(run.files["fault"])
        print("%s on rank %d: the launcher ran %.2f s, exited %.2f s after the fault, every "
              "rank ended %.2f s after" % (kind, bad, run.seconds,
                                           run.ended - float(run.files["fault"]), after))
        assert after < ENDED_WITHIN_S, (after, what)
        raised = {int(r): (error, culprits) for error, culprits, r in re.findall(
            r"raised (\w+) (\[[\d, ]*\]) rank (\d+)", run.text)}
        assert not any("finished" in out for out in run.outputs), what
        if kind in ("stall", "uneven"):
            # the others (and, a step short, the culprit too) give up naming it
            # alone: every rank's count has reached every other
            peers = [r for r in range(4) if r != bad]
            assert set(peers) <= set(raised), (raised, what)
            assert all(culprits == "[%d]" % bad for _, culprits in raised.values()), \
                (raised, what)
        else:
            # the others raise blaming a rank that died (the culprit, or one ended
            # with it whose end they saw first), or were ended first; the launcher's
            # line is what names the culprit
            assert bad not in raised, what
            assert all(re.fullmatch(r"\[\d\]", culprits) for _, culprits in raised.values()), \
                what
