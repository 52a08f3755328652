"""The NCCL transport's watch (commlib.transport.nccl.NcclWatch) tells a
failure as it is: NCCL's asynchronous error is a TransportError naming the
rank, the collective and NCCL's text; a missed deadline stays a
CollectiveTimeoutError; either way the NCCL communicator is aborted and the
transport left unusable. The watch needs no GPU: it is given a stand-in
of the transport and of the collective's event."""
import threading
import time

import pytest

from commlib.errors import CollectiveTimeoutError, TransportError
from commlib.core.waiting import Wait
from commlib.transport.nccl import NcclWatch


class Comm:
    """cupy's NcclCommunicator as the watch uses it."""

    def __init__(self, error=None):
        self.error, self.aborted = error, threading.Event()

    def check_async_error(self):
        if self.error is not None:
            raise self.error

    def abort(self):
        self.aborted.set()


class Transport:
    def __init__(self, comm):
        self.comm, self.broken = comm, None

    def fail(self, reason):
        self.broken = reason


class Event:
    done = False           # the collective never completes


def watched(error, deadline):
    transport = Transport(Comm(error))
    watch = NcclWatch(transport, every=0.001)
    watch.add(Event(), Wait(deadline, seq=3, what=0, board=None, rank=1))
    assert transport.comm.aborted.wait(30), "the watch did not abort the communicator"
    return watch, transport


def test_an_asynchronous_nccl_error_is_a_transport_error_naming_rank_and_text():
    watch, transport = watched(RuntimeError("NCCL_ERROR_SYSTEM_ERROR: unhandled system error"),
                               time.monotonic() + 3600)
    assert isinstance(watch.failure, TransportError)
    text = str(watch.failure)
    assert text.startswith("rank 1: NCCL reported an error in all_reduce #3: ")
    assert "unhandled system error" in text
    assert transport.broken == text
    with pytest.raises(TransportError, match="unhandled system error"):
        watch.check()


def test_a_missed_deadline_stays_a_timeout():
    watch, transport = watched(None, time.monotonic() - 1)
    assert type(watch.failure) is CollectiveTimeoutError
    assert "all_reduce #3 did not complete before its deadline" in str(watch.failure)
    with pytest.raises(CollectiveTimeoutError):
        watch.check()
