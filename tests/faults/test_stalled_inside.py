"""A rank that stalls inside a collective, after it entered it with the
consistency check off (it published only that it entered), is named by
every rank that waits for it (the status board's heartbeat: a waiting rank
looks at the board every few milliseconds, a stalled one does not); a rank
that only gave up first is never blamed. tests/faults/test_stalls.py covers
the check on, every rank in turn, and both data paths."""
import json
import re

import pytest

from mpirun import run_mpi

CODE = "import sys, stalled_inside_program\nstalled_inside_program.main(*sys.argv[1:])\n"
N = 3


@pytest.mark.parametrize("stalled, check, size", [(2, "0", 1000)])
def test_a_rank_stalled_inside_a_collective_is_named(stalled, check, size):
    proc = run_mpi(N, CODE, timeout=90, args=[str(stalled), check, str(size)],
                   survivors=True)
    lines = [json.loads(m) for m in re.findall(r"STALL (\{.*\})", proc.stdout)]
    assert sorted(line["rank"] for line in lines) == list(range(N)), proc.stdout
    for line in lines:
        if line["rank"] == stalled:
            continue
        assert line["error"] in ("CollectiveTimeoutError", "PeerError"), line
        assert line["culprits"] == [stalled], line
        assert line["untouched"], line
        if line["error"] == "CollectiveTimeoutError":
            assert "rank %d" % stalled in line["message"], line
