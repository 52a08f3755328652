"""A rank that stalls inside a collective's data phase, after every rank
entered it (run by tests/faults/test_stalled_inside.py): the waiting ranks
must name it, not a rank that merely gave up first.

``python stalled_inside_program.py STALLED CHECK SIZE``: rank STALLED stops
for twice the deadline just before its part of the exchange (its
transport's all_reduce), the consistency check on or off (CHECK: 1 or 0),
arrays of SIZE floats (small ones go over MPI, large ones through shared
memory). Every rank prints one ``STALL {json}`` line: what it raised and
whom it named.
"""
import json
import os
import sys
import time

import numpy as np

import commlib
from commlib.errors import CommlibError

DEADLINE = 1.0


def main(stalled, check, size):
    stalled, check, size = int(stalled), check == "1", int(size)
    comm = commlib.Communicator.from_mpi(check=check, timeout=DEADLINE)
    rank = comm.rank
    arrays = [np.full(size, rank + 1.0, np.float32) for _ in range(2)]
    comm.all_reduce(arrays)                           # a good step first
    assert all((a == comm.size * (comm.size + 1) / 2).all() for a in arrays)
    if rank == stalled:
        transport = comm._session.routes["numpy"]
        inner = transport.all_reduce

        def late_all_reduce(*args, **kwargs):
            time.sleep(2 * DEADLINE)
            return inner(*args, **kwargs)
        transport.all_reduce = late_all_reduce
        if hasattr(transport, "all_reduce_parts"):
            inner_parts = transport.all_reduce_parts

            def late_parts(*args, **kwargs):
                time.sleep(2 * DEADLINE)
                return inner_parts(*args, **kwargs)
            transport.all_reduce_parts = late_parts
    before = [a.copy() for a in arrays]
    error = None
    try:
        comm.all_reduce(arrays)
    except CommlibError as exc:
        error = exc
    line = {"rank": rank, "error": type(error).__name__ if error else None,
            "culprits": list(getattr(error, "culprits", ())), "message": str(error)[:1500],
            "untouched": all(np.array_equal(a, b) for a, b in zip(arrays, before))}
    sys.stdout.flush()
    os.write(1, ("STALL " + json.dumps(line) + "\n").encode())
    os._exit(0)          # the communicator is broken; MPI's finalisation would wait for it


if __name__ == "__main__":
    main(*sys.argv[1:])
