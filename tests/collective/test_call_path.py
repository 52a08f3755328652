"""A steady all-reduce reaches the wire in a few frames: counted from the
public method to the first call a transport makes into mpi4py or the
compiled host loops (see call_path_program.py), at 2 ranks on one node,
numpy arrays, over MPI (small buckets) and shared memory (large ones);
cupy arrays of the host build run the same program from
tests/ops/test_kernel_sources.py (``check_call_path``)."""
import json
import re

from mpirun import assert_each_rank, run_mpi

CODE = "import call_path_program\ncall_path_program.main()\n"
#: the most frames and files a call may pass through, by strategy
LIMITS = {"dense": (7, 5), "fp16": (9, 6), "bf16": (9, 6)}


def files_of(stack):
    return {entry.split(":")[0] for entry in stack}


def over_limits(results):
    """``[(case, frames, files, stack)]`` of the cases over their limits."""
    over = []
    for case, stack in results.items():
        frames, files = LIMITS[case.split()[0]]
        if len(stack) > frames or len(files_of(stack)) > files:
            over.append((case, len(stack), len(files_of(stack)), stack))
    return over


def test_the_limits_catch_a_deeper_stack():
    deep = ["commlib/communicator.py:all_reduce"] + ["commlib/m.py:f%d" % i for i in range(7)]
    assert over_limits({"dense mpi": deep[:7]}) == []
    assert [case for case, *_ in over_limits({"dense mpi": deep, "fp16 shm": deep})] == \
        ["dense mpi"]
    wide = ["commlib/communicator.py:all_reduce"] + ["commlib/m%d.py:f" % i for i in range(5)]
    assert [case for case, *_ in over_limits({"dense mpi": wide, "fp16 shm": wide})] == \
        ["dense mpi"]


def test_a_steady_all_reduce_reaches_the_wire_in_a_few_frames():
    check_call_path(run_mpi(2, CODE, timeout=90).stdout, ("mpi", "shm"))


def check_call_path(stdout, paths):
    """Every rank printed its stacks (one per strategy and path), each
    within :data:`LIMITS`, each ending in the transport it should."""
    assert_each_rank(stdout, r"call path rank (?P<rank>\d+): ", 2)
    for line in re.findall(r"call path rank \d+: (.*)", stdout):
        results = json.loads(line)
        assert sorted(results) == sorted("%s %s" % (s, p) for s in LIMITS for p in paths)
        for case, stack in sorted(results.items()):
            print("%-10s %d frames in %d files: %s" % (case, len(stack), len(files_of(stack)),
                                                       " -> ".join(stack)))
        over = over_limits(results)
        assert not over, "\n".join("%s: %d frames in %d files:\n  %s" % (
            case, frames, files, "\n  ".join(stack)) for case, frames, files, stack in over)
        # the data moves where it should: MPI below shared memory's threshold;
        # shared memory reduces a dense bucket where its arrays lie, and casts
        # a compressed one into and out of its slots itself
        for case in results:
            if case.endswith("shm"):
                call = "all_reduce_parts" if case.startswith("dense") else "all_reduce_cast"
                assert "commlib/transport/shm.py:" + call in results[case], case
        assert all(results[case][-1] == "commlib/transport/mpi.py:_call"
                   for case in results if case.endswith("mpi"))
