"""The machines of a job across several hosts: ``--hosts a:2,b:2`` and
``--hostfile FILE`` (MPICH hydra's format: ``host`` or ``host:n`` per line,
``#`` comments and blank lines ignored), checked before anything starts,
and the arguments that pass them, with the program that reaches the other
hosts (``ssh`` by default), to an mpiexec of either family.

The number of ranks is checked against the slots: ``-n`` may be at most
their sum (as ``horovodrun`` and Open MPI's ``mpirun`` refuse more; hydra
would start the extra ranks on the hosts again, round robin, more ranks
on a machine than it was given). With fewer, ranks fill the hosts in
order: ``a:2,b:2`` with ``-n 3`` puts ranks 0 and 1 on ``a``, rank 2 on
``b``.
"""
import collections
import re
import shutil

from ..errors import ArgumentError
from .mpi_library import OPENMPI

#: one machine of the job and the ranks it takes
Host = collections.namedtuple("Host", "name slots")

_ENTRY = re.compile(r"^([A-Za-z0-9_][A-Za-z0-9._-]*)(?::(\d+))?$")
_EXPECTED = "HOST or HOST:SLOTS (a host name or IPv4 address; SLOTS an int >= 1)"


def _entry(text, where):
    found = _ENTRY.match(text)
    if found is None or (found.group(2) is not None and int(found.group(2)) < 1):
        raise ArgumentError("%s: %r: expected %s" % (where, text, _EXPECTED))
    return Host(found.group(1), int(found.group(2) or 1))


def parse_hosts(text, source="--hosts"):
    """The hosts of ``text`` (``a:2,b:2``; a host without ``:n`` has one slot).

    Raises:
        ArgumentError: an entry is not ``HOST`` or ``HOST:SLOTS`` (naming
            ``source`` and the entry).
    """
    if not text.strip():
        raise ArgumentError("%s %r: expected a comma-separated list of %s"
                            % (source, text, _EXPECTED))
    return [_entry(part.strip(), "%s entry" % source) for part in text.split(",")]


def read_hostfile(path, source="--hostfile"):
    """The hosts of a hydra hostfile: one ``host`` or ``host:n`` per line,
    ``#`` to the end of a line a comment, blank lines ignored.

    Raises:
        ArgumentError: the file cannot be read, holds no host, or a line is
            not ``HOST`` or ``HOST:SLOTS`` (naming the file and the line's
            number).
    """
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ArgumentError("%s %r: cannot be read (%s)" % (source, path,
                                                            exc.strerror or exc)) from None
    hosts = []
    for number, line in enumerate(lines, 1):
        text = line.split("#", 1)[0].strip()
        if text:
            hosts.append(_entry(text, "%s %s line %d" % (source, path, number)))
    if not hosts:
        raise ArgumentError("%s %r: no host in it (expected one %s per line)"
                            % (source, path, _EXPECTED))
    return hosts


def check_slots(hosts, n, source="--hosts", asked="-n"):
    """Raise unless ``n`` ranks (asked for with the option ``asked``) fit
    the slots of ``hosts``.

    Raises:
        ArgumentError: ``n`` is more than the slots' sum (naming both).
    """
    total = sum(h.slots for h in hosts)
    if n > total:
        raise ArgumentError(
            "%s %d is more than the %d slot%s of %s (%s): give each host as many slots as "
            "ranks it is to run (HOST:SLOTS), or %s %d or fewer"
            % (asked, n, total, "" if total == 1 else "s", source, text(hosts), asked, total))


def text(hosts):
    """``hosts`` as ``a:2,b:2``."""
    return ",".join("%s:%d" % h for h in hosts)


def check_launcher_exec(program, source="--launcher-exec"):
    """The path of ``program`` (an executable file, or a program on PATH).

    Raises:
        ArgumentError: it is neither (naming ``source``).
    """
    found = shutil.which(program)
    if found is None:
        raise ArgumentError("%s %r: expected the program that reaches the other hosts (an "
                            "executable file, or a program on PATH, called as ssh is: "
                            "PROGRAM HOST COMMAND)" % (source, program))
    return found


def mpiexec_args(family, hosts=None, launcher_exec=None):
    """The arguments that give an mpiexec of ``family`` its hosts and the
    program that reaches them: hydra (MPICH) ``-hosts a:2,b:2 -launcher ssh
    -launcher-exec P``; Open MPI ``--host a:2,b:2 --mca plm_rsh_agent P``."""
    args = []
    if hosts:
        args += ["--host" if family == OPENMPI else "-hosts", text(hosts)]
    if launcher_exec:
        args += (["--mca", "plm_rsh_agent", launcher_exec] if family == OPENMPI
                 else ["-launcher", "ssh", "-launcher-exec", launcher_exec])
    return args
