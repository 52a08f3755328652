"""The MPI transport when MPI reports an error in a request it already
started: the request and its buffers are kept alive (``ABANDONED``), the
transport becomes unusable, the error names the rank and the collective,
and the caller's array is not written. MPI's requests are stood in for by
objects whose ``Test`` raises ``MPI.Exception``, in one real MPI process."""
from mpirun import run_mpi

PROGRAM = r"""
import numpy as np
from mpi4py import MPI
from commlib.errors import ClosedError, TransportError
from commlib.transport import mpi as mpi_transport


class FailingRequest:
    def Test(self):
        raise MPI.Exception(MPI.ERR_OTHER)


class FailingComm:
    # the real communicator's rank and size; every started collective fails
    def __init__(self, real):
        self.real = real

    def __getattr__(self, name):
        if name.startswith("I"):
            return lambda *args, **kwargs: FailingRequest()
        return getattr(self.real, name)


def expect(kind, text, call):
    try:
        call()
    except kind as exc:
        assert text in str(exc), (text, str(exc))
        return
    raise AssertionError("expected %s %r" % (kind.__name__, text))


def fresh():
    t = mpi_transport.MpiTransport(MPI.COMM_WORLD.Dup())
    real, t.comm = t.comm, FailingComm(t.comm)
    return t, real


# a request tested inside the call
t, real = fresh()
before = len(mpi_transport.ABANDONED)
buf = np.arange(5, dtype=np.float32)
expect(TransportError, "rank 0: MPI reported an error in all_reduce: ",
       lambda: t.all_reduce(buf, "sum"))
assert np.array_equal(buf, np.arange(5, dtype=np.float32)), buf
assert len(mpi_transport.ABANDONED) == before + 1
expect(ClosedError, "rank 0: the mpi transport is unusable: all_reduce was given up on "
                    "(Exception)", lambda: t.barrier())
real.Free()

# a request started and handed over (deferred), tested later
t, real = fresh()
before = len(mpi_transport.ABANDONED)
started = mpi_transport._Started(t, "Iallreduce", FailingRequest(), ("buffers",))
expect(TransportError, "rank 0: MPI reported an error in all_reduce: ", started.test)
request, kept = mpi_transport.ABANDONED[-1]
assert len(mpi_transport.ABANDONED) == before + 1 and kept == ("buffers",)
expect(ClosedError, "rank 0: the mpi transport is unusable: all_reduce was given up on "
                    "(in flight)", lambda: t.barrier())
real.Free()
print("rank 0 done", flush=True)
"""


def test_an_error_in_a_started_request_keeps_it_and_ends_the_transport():
    out = run_mpi(1, PROGRAM, timeout=60).stdout
    assert out.count("rank 0 done") == 1, out
