"""Whether a process of this machine still runs: the status board's test of
a rank's death (:meth:`StatusBoard.died
<commlib.faults.board.StatusBoard.died>`), and the tests' of their own
stand-ins and jobs."""


def alive(pid, zombie=False):
    """Whether process ``pid`` of this machine still runs. A zombie (ended,
    not yet reaped by its parent) counts as ended, or as alive with
    ``zombie=True`` (until reaped). A process whose state cannot be read
    (but whose entry exists) counts as alive."""
    try:
        with open("/proc/%d/stat" % pid, "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    except OSError:
        return True
    return zombie or state not in (b"Z", b"X")
