"""How deep one call goes: the commlib frames between a public collective
method and the wire (run by tests/collective/test_call_path.py).

The wire is the first call into C that a transport makes: into mpi4py (its
communicator's methods) or into the compiled host loops. Both are watched
through stand-ins that record the Python stack of their caller and call the
real thing: the MPI transport's communicator is wrapped, and so is the
host loops' module. The stack counted runs from the public method (its
frame included) to the caller of the C function.
"""
import json
import os
import sys

import numpy as np

import commlib
from commlib.ops import native

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_seen = []          # (stack) of each call into C while recording


def _stack(frame):
    """``file:function`` of ``frame`` and its callers up to the public
    Communicator method, outermost first; None outside a collective."""
    names = []
    while frame is not None:
        path = os.path.relpath(frame.f_code.co_filename, ROOT)
        names.append("%s:%s" % (path, frame.f_code.co_name))
        if path == os.path.join("commlib", "communicator.py") and frame.f_code.co_name in (
                "all_reduce", "broadcast", "reduce"):
            return names[::-1]
        frame = frame.f_back
    return None


class Recorder:
    """Wraps an object (mpi4py's communicator, the host loops' module): each
    call of one of its functions records its caller's stack when it is made
    from a transport (the wire), then calls the function."""

    def __init__(self, wrapped):
        self._wrapped = wrapped

    def __getattr__(self, name):
        target = getattr(self._wrapped, name)
        if not callable(target):
            return target

        def call(*args, **kwargs):
            stack = _stack(sys._getframe(1))
            if stack is not None and any("/transport/" in s or s.startswith("commlib/transport")
                                         for s in stack):
                _seen.append(stack)
            return target(*args, **kwargs)
        return call


def depth(comm, call):
    """The stack of the first wire call of ``call()`` (a steady call: made
    after the same call ran three times)."""
    for _ in range(3):
        call()
    _seen.clear()
    call()
    assert _seen, "no call into mpi4py or the host loops was seen"
    return _seen[0]


def main(kind="numpy"):
    """Print the stacks of dense, fp16 and bf16 all-reduces of ``kind``
    arrays: numpy over MPI (small buckets) and shared memory (large ones),
    or cupy (the host build's stand-in) over the MPI transport."""
    comm = commlib.Communicator.from_mpi(backend="mpi")
    xp = np
    if kind == "cupy":
        import cupy as xp
        assert comm.transport_for("cupy") == "mpi", comm.transport_for("cupy")
        paths = ((1000, "mpi"),)
    else:
        assert comm.transport_for("numpy") == "shm", comm.transport_for("numpy")
        paths = ((1000, "mpi"), (100000, "shm"))
    session = comm._session
    mpi = next(t for t in session.transports if t.name == "mpi")
    mpi.comm = Recorder(mpi.comm)
    native._lib = Recorder(native.module())
    results = {}
    for compression in (None, "fp16", "bf16"):
        for size, path in paths:
            grads = [xp.full(size, comm.rank + 1.0, np.float32) for _ in range(4)]
            stack = depth(comm, lambda: comm.all_reduce(grads, op="avg",
                                                        compression=compression))
            expected = (1.0 + comm.size) / 2
            got = grads[0] if xp is np else grads[0].get()
            assert np.allclose(got, expected, rtol=1e-2), (got[:4], expected)
            results["%s %s" % (compression or "dense", path)] = stack
    # one write of one line (below the size a pipe writes whole)
    sys.stdout.write("call path rank %d: %s\n" % (comm.rank, json.dumps(results)))
    sys.stdout.flush()
    comm.close()


if __name__ == "__main__":
    main(*sys.argv[1:])
