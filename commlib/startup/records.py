"""How the ranks of a job started by :mod:`commlib.launch` started and
ended: one JSON record per file in the job's status directory
(``COMMLIB_LAUNCH_STATUS_DIR``), written to a temporary name and renamed,
and the reading of them (whom to blame, which tracebacks to print).

Kinds: ``started.R`` (rank R's MPI world was set up: its ``size`` and MPI
``library``, written by :meth:`commlib.Communicator.from_mpi`), ``done.R``,
``failed.R`` and ``died.R`` (see :mod:`commlib.launch`).
"""
import collections
import json
import os
import re
import signal
import time

from .. import settings
from ..settings import launcher_rank
from ..errors import ranks_text
from ..files import write_atomically

#: directory where ranks and their supervisors record how they started and ended
ENV_STATUS_DIR = settings.LAUNCH_STATUS_DIR
#: (rank variable) of the launchers commlib knows, most specific first
def _shorten(text, limit=300):
    return text if len(text) <= limit else text[:limit - 3] + "..."


def signal_name(signum):
    try:
        return signal.Signals(signum).name
    except ValueError:
        return "signal %d" % signum


_RECORD_FIELDS = ("rank", "kind", "time", "code", "signal", "exception", "message",
                  "culprits", "traceback", "finished", "requested", "size", "library")


class Record(collections.namedtuple("Record", _RECORD_FIELDS)):
    """How one rank started or ended (see the module docstring): ``kind`` is
    ``"started"``, ``"done"``, ``"failed"`` or ``"died"``; ``code`` an exit
    status, ``signal`` the signal that killed it; ``size`` and ``library``
    (started records) the size of the rank's MPI world and its MPI library."""

    def __new__(cls, rank, kind, time=0.0, code=None, signal=None, exception=None,
                message=None, culprits=(), traceback=None, finished=False, requested=None,
                size=None, library=None):
        return super().__new__(cls, rank, kind, time, code, signal, exception, message,
                               tuple(culprits), traceback, finished, requested, size, library)

    @classmethod
    def from_dict(cls, data):
        data = {k: v for k, v in data.items() if k in _RECORD_FIELDS}
        return cls(**data)

    @property
    def bad(self):
        """Whether this record blames its rank: it failed or died, unasked."""
        return self.kind in ("failed", "died") and self.requested is None

    def describe(self):
        rank = self.rank
        if self.kind == "failed":
            text = "rank %s failed with exit code %d" % (rank, self.code)
            if self.exception:
                blaming = " blaming %s" % ranks_text(self.culprits) if self.culprits else ""
                message = (self.message or "").strip().splitlines()
                message = ": " + _shorten(message[0]) if message else ""
                text += " (%s%s%s)" % (self.exception, blaming, message)
            return text
        if self.kind == "done":
            return "rank %s finished" % rank
        if self.kind == "started":
            return "rank %s started in an MPI world of size %s (%s)" % (rank, self.size,
                                                                      self.library)
        if self.signal is not None:
            how = ("ended by %s" if self.requested else "killed by %s") \
                % signal_name(self.signal)
            text = "rank %s was %s" % (rank, how)
            return text + " after its script finished" if self.finished else text
        if self.finished:
            return "rank %s exited with status %d after its script finished" % (rank, self.code)
        return ("rank %s exited with status %d without finishing its script (os._exit, or "
                "an exit in native code)" % (rank, self.code))

    def exit_status(self):
        if self.signal is not None:
            return 128 + self.signal
        return self.code or 1


def write_record(status_dir, record):
    """Write ``record`` as ``<kind>.<rank>`` in ``status_dir`` (atomically);
    False when it could not be written."""
    path = os.path.join(status_dir, "%s.%s" % (record.kind, record.rank))
    try:
        write_atomically(path, lambda f: json.dump(record._asdict(), f))
        return True
    except (OSError, TypeError, ValueError):
        return False


_RECORD_NAME = re.compile(r"(started|done|failed|died)\.(\d+)$")


def read_records(status_dir):
    """The records in ``status_dir``, earliest first (unreadable ones left out)."""
    found = []
    try:
        names = os.listdir(status_dir)
    except OSError:
        return found
    for name in names:
        if _RECORD_NAME.match(name):
            try:
                with open(os.path.join(status_dir, name)) as f:
                    found.append(Record.from_dict(json.load(f)))
            except (OSError, ValueError, TypeError):
                continue
    return sorted(found, key=lambda r: r.time)


def blame(records):
    """The record to name for a job's failure, or None when no rank failed
    or died unasked. A rank other ranks blame (``culprits``) comes first,
    then one that failed or died without blaming others, the earliest first."""
    bad = [r for r in records if r.bad]

    def key(r):
        named = any(r.rank in o.culprits for o in bad if o.rank != r.rank)
        return (not named, bool(r.culprits), r.time)
    return min(bad, key=key) if bad else None


def verdict(records):
    """(the launcher's last line, less "; all workers ended", and the exit
    status) for a job's failure, or None when no rank failed or died unasked.

    The rank :func:`blame` picks, described; but a rank that failed only
    because it gave up on others (a CollectiveTimeoutError or PeerError
    whose ``culprits`` name ranks that left no failure of their own: a rank
    that stalled, say) is never the one blamed: the line names the ranks
    the failed ranks' errors blame, and which ranks blamed them. The exit
    status is the blamed record's."""
    chosen = blame(records)
    if chosen is None:
        return None
    if not chosen.culprits or chosen.rank in chosen.culprits:
        return chosen.describe(), chosen.exit_status()
    bad = [r for r in records if r.bad and r.culprits and r.rank not in r.culprits]
    culprits = sorted({c for r in bad for c in r.culprits})
    blamers = sorted({r.rank for r in bad})
    message = (chosen.message or "").strip().splitlines()
    return ("%s %s at fault: %s failed blaming %s (%s%s)" % (
        ranks_text(culprits), "is" if len(culprits) == 1 else "are", ranks_text(blamers),
        "it" if len(culprits) == 1 else "them", chosen.exception or "an error",
        ": " + _shorten(message[0]) if message else ""), chosen.exit_status())


def _same_traceback_key(record):
    """The traceback with the rank's own number in ``rank R`` replaced."""
    return re.sub(r"\b(ranks?\s+)%d\b" % int(record.rank), r"\1<R>", record.traceback,
                  flags=re.IGNORECASE)


def distinct_tracebacks(records):
    """[(ranks, traceback text)] for the failed records with a traceback,
    one entry per distinct traceback (the text of its lowest rank), in the
    order they were first recorded."""
    groups = collections.OrderedDict()
    for r in sorted(records, key=lambda r: r.time):
        if r.kind == "failed" and r.traceback:
            groups.setdefault(_same_traceback_key(r), []).append(r)
    found = []
    for group in groups.values():
        group.sort(key=lambda r: r.rank)
        found.append(([r.rank for r in group], group[0].traceback))
    return found


def record_started(size, library, env=None):
    """Write ``started.R`` (R: the launcher's rank) when this process runs
    under :mod:`commlib.launch` (its status directory is set); the launcher
    ends a job whose ranks report another size than it started. Returns
    whether a record was written."""
    env = os.environ if env is None else env
    status_dir, rank = env.get(ENV_STATUS_DIR), launcher_rank(env)
    if not status_dir or rank is None:
        return False
    return write_record(status_dir, Record(int(rank), "started", time.time(), size=int(size),
                                           library=library))
