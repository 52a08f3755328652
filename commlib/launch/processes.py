"""The launcher's processes: the name and flags it starts its own parts
with (``python -m commlib.launch --_worker|--_rank``), child processes that
die with it, their output passed on in whole lines with a ``[rank] ``
prefix, and the launcher's own messages (one line on stderr, prefixed with
its name)."""
import ctypes
import json
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time

from .. import settings


PROG = "commlib.launch"  # also the module name workers run with -m
WORKER_FLAG = "--_worker"  # the supervisor of one rank under mpiexec
RANK_FLAG = "--_rank"  # the rank process itself: runs the script
#: "1": supervisors prefix output lines with "[rank] " (mpiexec without -prepend-rank)
ENV_PREFIX = settings.LAUNCH_PREFIX
POLL_S = 0.05
PIPE_DRAIN_S = 1.0  # after a process ended, wait for its pipes (held by its children?)
PARTIAL_LINE_S = 0.5  # an unfinished output line is passed on after this long
PARTIAL_LINE_MAX = 1 << 16  # or when it has this many bytes

_prctl = None


def say(message):
    """Write ``message`` to stderr as one line headed by the launcher's name."""
    sys.stderr.write("%s: %s\n" % (PROG, message))  # one write: other output is per line
    sys.stderr.flush()


def _child_setup(parent, new_group):
    """preexec_fn (Linux): SIGKILL the child when ``parent`` (the pid that
    starts it) dies; with ``new_group``, a process group of its own."""
    def setup():
        if new_group:
            os.setpgid(0, 0)
        if _prctl is not None:
            _prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
            if os.getppid() != parent:  # the parent died before prctl
                os._exit(128 + signal.SIGKILL)
    return setup


def popen(cmd, env, new_group=False, **kwargs):
    """Popen whose child dies with this process (Linux)."""
    global _prctl
    preexec = None
    if sys.platform.startswith("linux"):
        try:
            _prctl = _prctl or ctypes.CDLL(None, use_errno=True).prctl  # resolved before fork
            preexec = _child_setup(os.getpid(), new_group)
        except (OSError, AttributeError):
            pass
    return subprocess.Popen(cmd, env=env, preexec_fn=preexec, **kwargs)


_WRITE = threading.Lock()  # one line at a time on this process's outputs


def write_all(fd, data):
    with _WRITE:
        while data:
            data = data[os.write(fd, data):]


#: the head of a line that carries a rank's record (see :func:`record_line`)
RECORD_MARK = b"\x1ecommlib-record "
_RECORD_LINE = re.compile(rb"^(?:\[\d+\] )?" + re.escape(RECORD_MARK) + rb"(\{.*\})\r?\n?$")


def record_line(record):
    """``record`` (a :class:`~commlib.startup.records.Record`) as one
    output line, for a launcher that shares no directory with the rank."""
    return RECORD_MARK + json.dumps(record._asdict()).encode() + b"\n"


def parse_record_line(line):
    """The record dict a :func:`record_line` line carries (with or
    without mpiexec's ``[rank] `` prefix), or None for any other line."""
    found = _RECORD_LINE.match(line)
    if found is None:
        return None
    try:
        return json.loads(found.group(1))
    except ValueError:
        return None


_LINE_END = re.compile(rb"\r\n|\n|\r(?=[^\n])")  # "\r" too: progress bars redraw a line


def relay(src, dst, prefix=b"", consume=None):
    """Copy output from file descriptor ``src`` to ``dst`` in whole lines, one
    write per line, each starting with ``prefix``; a line left unfinished for
    PARTIAL_LINE_S (or longer than PARTIAL_LINE_MAX) is passed on as it is.
    ``consume(line)``: called with each whole line; a line for which it
    returns True is not passed on. Closes ``src`` at its end."""
    pending, at_line_start, broken = b"", True, False
    readable = select.poll()
    readable.register(src, select.POLLIN)

    def emit(data):
        nonlocal broken
        if not broken:
            try:
                write_all(dst, data)
            except OSError:  # the reader is gone: keep reading so the writer never blocks
                broken = True
    try:
        while True:
            if pending and not readable.poll(PARTIAL_LINE_S * 1000):
                emit((prefix if at_line_start else b"") + pending)
                pending, at_line_start = b"", False
                continue
            try:
                chunk = os.read(src, 65536)
            except OSError:
                chunk = b""
            if not chunk:
                break
            data, start = pending + chunk, 0
            for end in _LINE_END.finditer(data):
                line = data[start:end.end()]
                if not (at_line_start and consume is not None and consume(line)):
                    emit((prefix if at_line_start else b"") + line)
                start, at_line_start = end.end(), True
            pending = data[start:]
            if len(pending) >= PARTIAL_LINE_MAX:
                emit((prefix if at_line_start else b"") + pending)
                pending, at_line_start = b"", False
        if pending:
            emit((prefix if at_line_start else b"") + pending + b"\n")
    finally:
        os.close(src)


def start_relays(proc, prefix=b""):
    """Threads passing ``proc``'s stdout and stderr pipes on to ours."""
    threads = []
    for pipe, dst in ((proc.stdout, 1), (proc.stderr, 2)):
        fd = os.dup(pipe.fileno())
        pipe.close()
        t = threading.Thread(target=relay, args=(fd, dst, prefix), daemon=True)
        t.start()
        threads.append(t)
    return threads


def join(threads, timeout):
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))


def end_processes(procs, grace):
    """SIGTERM the live ``procs``, SIGKILL those still alive after ``grace`` s."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
    for p in procs:
        p.wait()
