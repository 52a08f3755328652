"""Which MPI library mpi4py loads, which MPI an ``mpiexec`` belongs to, and
whether the ranks of a job see the size they were launched with.

A job whose ranks are started by one MPI's ``mpiexec`` while mpi4py loads
another MPI's library does not fail by itself: every rank becomes an MPI
singleton of size 1, trains alone and exits 0. This module lets the
launcher pick an ``mpiexec`` of the library mpi4py loads (or refuse, naming
the fix) and lets every rank compare the size its launcher announced with
the size of its MPI world (:func:`check_world_size`).

Families: ``"mpich"`` (MPICH, Intel MPI, MVAPICH: hydra and the PMI wire
protocol) and ``"openmpi"`` (Open MPI's mpirun/prterun, PMIx). An
``mpiexec`` of one family starts ranks of a library of the same family.
"""
import collections
import json
import os
import re
import shutil
import subprocess
import sys

from ..errors import ArgumentError, BackendUnavailableError, LaunchError

MPICH, OPENMPI = "mpich", "openmpi"

#: (size variable, launcher that sets it), most specific first: the first one
#: set in a process's environment is the size it was launched with. Slurm's
#: per-step count is read only when no MPI launcher's variable is set (under
#: mpirun, srun starts one daemon per node, so the step's count is not the
#: job's), and never ``SLURM_NTASKS``, which a batch allocation sets around a
#: single process too.
SIZE_VARIABLES = (
    ("COMMLIB_SIZE", "commlib.launch"),
    ("PMI_SIZE", "a PMI launcher (MPICH's or Intel MPI's hydra mpiexec)"),
    ("OMPI_COMM_WORLD_SIZE", "Open MPI's mpirun"),
    ("MV2_COMM_WORLD_SIZE", "MVAPICH's mpirun_rsh"),
    ("PMIX_SIZE", "a PMIx launcher"),
    ("SLURM_STEP_NUM_TASKS", "Slurm's srun (a job step)"),
)

#: the library mpi4py loaded: first line of MPI_Get_library_version, the
#: family (None when not recognised) and the shared library's path (None
#: when not found)
Library = collections.namedtuple("Library", "version family path")
#: an mpiexec: its path, family (None when its --version is not recognised)
#: and the first line of its --version
Mpiexec = collections.namedtuple("Mpiexec", "path family version")

_LIBRARY_FIXES = {
    MPICH: "the mpiexec of that MPICH (with the PyPI wheels: the one beside "
           "sys.executable, from pip install mpich)",
    OPENMPI: "Open MPI's mpirun (Debian: mpiexec.openmpi from openmpi-bin; as root add "
             "--allow-run-as-root)",
}


def library_family(version):
    """The family of an MPI library from ``MPI.Get_library_version()``."""
    text = version or ""
    if "Open MPI" in text:
        return OPENMPI
    if re.search(r"MPICH|Intel\(R\) MPI|MVAPICH", text):
        return MPICH
    return None


def mpiexec_family(version_output):
    """The family of an mpiexec from what ``mpiexec --version`` printed."""
    text = version_output or ""
    if re.search(r"Open MPI|OpenRTE|PRRTE", text):
        return OPENMPI
    if re.search(r"HYDRA|Intel\(R\) MPI|MVAPICH", text):
        return MPICH
    return None


def _first_line(text):
    for line in (text or "").splitlines():
        if line.strip():
            return " ".join(line.split())
    return ""


def _library_path():
    """Path of the libmpi this process has mapped, or None."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1] if line.strip() else ""
                if re.search(r"/libmpi(\.so|[-_.]\w*\.so)[.\d]*$", path) and "libmpi_" not in path:
                    return path
    except OSError:
        pass
    return None


def this_library():
    """The :class:`Library` of this process's mpi4py (imports ``mpi4py.MPI``;
    MPI need not be initialised)."""
    from mpi4py import MPI
    version = MPI.Get_library_version().replace("\x00", "")
    return Library(_first_line(version), library_family(version), _library_path())


_PROBE = """
import json, mpi4py
mpi4py.rc.initialize = False
mpi4py.rc.finalize = False
from commlib.startup.mpi_library import this_library
print(json.dumps(this_library()._asdict()))
"""


def loaded_library(python=None, env=None, timeout=60):
    """The :class:`Library` that mpi4py loads in a new process of ``python``
    (default ``sys.executable``) with ``env`` (default ``os.environ``),
    without initialising MPI.

    Raises:
        BackendUnavailableError: mpi4py is not importable there, or the
            probe failed or took longer than ``timeout`` seconds.
    """
    python = python or sys.executable
    env = dict(os.environ if env is None else env)
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH", "")) if p)
    try:
        out = subprocess.run([python, "-c", _PROBE], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, timeout=timeout)
    except (OSError, subprocess.SubprocessError) as exc:
        raise BackendUnavailableError("could not ask %s which MPI library mpi4py loads: %s"
                                      % (python, exc)) from None
    if out.returncode != 0:
        if "No module named 'mpi4py'" in out.stderr:
            raise BackendUnavailableError(
                "mpi4py is not installed for %s: install mpi4py and an MPI, e.g. from the "
                "commlib source tree: pip install -e '.[mpi]' (or pip install mpi4py mpich)"
                % python)
        raise BackendUnavailableError("could not ask %s which MPI library mpi4py loads "
                                      "(exit %d):\n%s" % (python, out.returncode,
                                                          out.stderr.strip()[-2000:]))
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    return Library(**json.loads(lines[-1]))


def describe_mpiexec(path, timeout=30):
    """The :class:`Mpiexec` at ``path`` (runs ``path --version``)."""
    try:
        out = subprocess.run([path, "--version"], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, timeout=timeout).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        return Mpiexec(path, None, "(--version failed: %s)" % exc)
    first = _first_line(out)
    version = re.search(r"^\s*Version:\s*(\S+)", out, re.MULTILINE)
    if version and version.group(1) not in first:
        first += " version " + version.group(1)
    return Mpiexec(path, mpiexec_family(out), first)


def candidates(library, python=None, path=None):
    """mpiexec paths worth trying for ``library``, best first, without
    duplicates: the one beside ``python`` (the PyPI ``mpich`` wheel puts it
    there), the library's own (``PREFIX/bin`` of ``PREFIX/lib*/libmpi*``;
    Debian's ``mpiexec.openmpi``/``mpiexec.mpich``), then ``PATH``'s."""
    python = python or sys.executable
    found = []

    def add(exe):
        if exe and os.path.isfile(exe) and os.access(exe, os.X_OK):
            real = os.path.realpath(exe)
            if all(os.path.realpath(f) != real for f in found):
                found.append(exe)
    add(shutil.which("mpiexec", path=os.path.dirname(python)))
    if library is not None and library.path:
        libdir = os.path.dirname(library.path)
        for up in (1, 2, 3):
            prefix = os.path.normpath(os.path.join(libdir, *[".."] * up))
            add(os.path.join(prefix, "bin", "mpiexec"))
            if library.family:
                add(os.path.join(prefix, "bin", "mpiexec." + library.family))
    names = ["mpiexec", "mpirun", "mpiexec.hydra"]
    if library is not None and library.family:
        names = ["mpiexec." + library.family, "mpirun." + library.family] + names
    path = os.environ.get("PATH", "") if path is None else path
    for folder in [p for p in path.split(os.pathsep) if p]:
        for name in names:
            add(os.path.join(folder, name))
    return found


def extra_args(mpiexec):
    """Arguments an :class:`Mpiexec` needs to start N ranks of one node like
    hydra does: Open MPI's mpirun refuses more ranks than cores without
    ``--oversubscribe`` and refuses root without ``--allow-run-as-root``."""
    if mpiexec.family != OPENMPI:
        return []
    args = ["--oversubscribe"]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        args.append("--allow-run-as-root")
    return args


def choose_mpiexec(explicit=None, python=None, env=None, library=None,
                   source="the mpiexec named"):
    """The :class:`Mpiexec` to start ranks of ``python`` with.

    Args:
        explicit: an mpiexec the user named (``--mpiexec`` or
            ``COMMLIB_MPIEXEC``); used only if it belongs to the library's
            family (or either family is unknown).
        source: where ``explicit`` comes from, for messages (``"--mpiexec"``,
            ``"COMMLIB_MPIEXEC"``).
        python: the interpreter of the ranks (default ``sys.executable``).
        env: their environment (default ``os.environ``).
        library: the :class:`Library` their mpi4py loads (default: asked).

    Returns:
        The first candidate whose family matches the library's; without a
        known library family, the first candidate.

    Raises:
        ArgumentError: ``explicit`` is neither an executable file nor a
            program on ``PATH`` (naming ``source``).
        LaunchError: no candidate matches (the text names the library, each
            mpiexec found and its family, and the fix).
        BackendUnavailableError: mpi4py is missing, or no mpiexec was found.
    """
    env = os.environ if env is None else env
    if explicit:
        exe = shutil.which(explicit, path=env.get("PATH"))
        if exe is None:
            named = ("%s %r" if source.startswith("-") else "%s=%r") % (source, explicit)
            raise ArgumentError("%s: expected an mpiexec: an executable file, or a program "
                                "on PATH (%s)" % (named, "no such file"
                                                  if not os.path.exists(explicit)
                                                  else "not an executable file"))
    library = library or loaded_library(python, env)
    if explicit:
        chosen = describe_mpiexec(exe)
        if None in (chosen.family, library.family) or chosen.family == library.family:
            return chosen
        raise LaunchError(_mismatch_text(library, [chosen], named=True))
    paths = candidates(library, python, env.get("PATH"))
    if not paths:
        raise BackendUnavailableError(
            "mpiexec not found beside %s or on PATH: install an MPI, e.g. from the commlib "
            "source tree: pip install -e '.[mpi]' (MPICH from PyPI)" % (python or sys.executable))
    seen = [describe_mpiexec(p) for p in paths]
    if library.family is None:
        return seen[0]
    for m in seen:
        if m.family == library.family:
            return m
    raise LaunchError(_mismatch_text(library, seen))


def _mismatch_text(library, seen, named=False):
    lines = ["mpi4py loads %s (%s), but %s; %s would start every rank as a separate job of "
             "size 1:" % (library.version, library.path or "library path unknown",
                          "the mpiexec named belongs to another MPI" if named
                          else "no mpiexec of that MPI was found", "it" if named else "these")]
    for m in seen:
        lines.append("  %s: %s (%s)" % (m.path, m.version, m.family or "unknown MPI"))
    lines.append("Fix: start the job with %s, or point mpi4py at the MPI of your mpiexec "
                 "(MPI4PY_LIBMPI=/path/to/its/libmpi.so; for MPICH from PyPI: "
                 "pip install mpich, then MPI4PY_LIBMPI=<prefix>/lib/libmpi.so.12); "
                 "commlib.launch takes --mpiexec PATH (or COMMLIB_MPIEXEC)."
                 % _LIBRARY_FIXES.get(library.family, "that library's own mpiexec"))
    return "\n".join(lines)


def _size_variables(env):
    """([(size, variable, launcher)] of the :data:`SIZE_VARIABLES` set in
    ``env`` to a positive int, in their order; [the text of each one set to
    anything else])."""
    valid, invalid = [], []
    for name, launcher in SIZE_VARIABLES:
        value = env.get(name, "").strip()
        if not value:
            continue
        if value.isdigit() and int(value) >= 1:
            valid.append((int(value), name, launcher))
        else:
            invalid.append("%s=%r: expected a positive int (the number of ranks %s started)"
                           % (name, env[name], launcher))
    return valid, invalid


def launched_size(env=None):
    """(size, variable, launcher) from the first of :data:`SIZE_VARIABLES`
    set in ``env`` (default ``os.environ``), or None when none is set.

    Raises:
        ArgumentError: one of them is set to something other than a
            positive int (naming each such variable).
    """
    valid, invalid = _size_variables(os.environ if env is None else env)
    if invalid:
        raise ArgumentError("invalid launcher variable: %s" % "; ".join(invalid))
    return valid[0] if valid else None


def check_world_size(world_size, env=None, library=None):
    """Raise when this process's launcher announced another number of ranks
    than its MPI world has, or a launcher's size variable is invalid.

    Every variable of :data:`SIZE_VARIABLES` that is set is checked; the
    first one set to a valid value is the size announced.

    Args:
        world_size: ``MPI.COMM_WORLD.Get_size()``.
        env: the environment to read (default ``os.environ``).
        library: a :class:`Library` for the message (default: this
            process's, asked only when the sizes differ).

    Raises:
        ArgumentError: a size variable is not a positive int (naming each
            one, and the size another variable announced when it differs
            from the world's).
        LaunchError: naming both sizes, the variable and its launcher, the
            MPI library mpi4py loads, and the fix.
    """
    valid, invalid = _size_variables(os.environ if env is None else env)
    found = valid[0] if valid else None
    differs = found is not None and found[0] != world_size
    if invalid:
        raise ArgumentError("invalid launcher variable: %s%s" % ("; ".join(invalid), (
            "; and %s=%d (set by %s) says %d ranks, but this process's MPI world has %d"
            % (found[1], found[0], found[2], found[0], world_size)) if differs else ""))
    if not differs:
        return
    size, name, launcher = found
    if library is None:
        try:
            library = this_library()
        except Exception:      # the message without it is still right
            library = Library("(unknown)", None, None)
    raise LaunchError(
        "%s=%d (set by %s) but this process's MPI world has %d rank(s): mpi4py loads %s "
        "(%s), so the job does not run as one job of %d ranks. The usual cause is an "
        "mpiexec of another MPI than mpi4py's. Fix: start it with %s, or with "
        "python -m commlib.launch -n %d (it picks a matching mpiexec), or point mpi4py at "
        "your mpiexec's MPI (MPI4PY_LIBMPI=/path/to/its/libmpi.so)."
        % (name, size, launcher, world_size, library.version, library.path or "path unknown",
           size, _LIBRARY_FIXES.get(library.family, "that library's own mpiexec"), size))


_WORLD_PROBE = """
import json, os, socket
from mpi4py import MPI
world = MPI.COMM_WORLD
node = world.Split_type(MPI.COMM_TYPE_SHARED)
print("WORLD " + json.dumps({"rank": world.Get_rank(), "size": world.Get_size(),
                             "host": socket.gethostname(), "local_rank": node.Get_rank(),
                             "local_size": node.Get_size(),
                             "launcher_rank": next((os.environ[v] for v in (
                                 "PMI_RANK", "OMPI_COMM_WORLD_RANK") if v in os.environ), None)}),
      flush=True)
node.Free()
"""


def run_world(n, mpiexec=None, timeout=60, args=()):
    """Start ``n`` ranks of this interpreter and check they form one world.

    Args:
        n: the number of ranks.
        mpiexec: the :class:`Mpiexec` to start them with (default
            :func:`choose_mpiexec`'s).
        timeout: seconds the job may take.
        args: more arguments for mpiexec (hosts, see
            :func:`commlib.startup.hosts.mpiexec_args`).

    Returns:
        What each rank reported, in rank order: dicts with ``rank``,
        ``size`` (``n``), ``host`` (its host name), ``local_rank`` and
        ``local_size`` (among the ranks of its node: those sharing memory).

    Raises:
        LaunchError: the ranks did not form one world of size ``n``.
    """
    chosen = mpiexec or choose_mpiexec()
    cmd = [chosen.path, *extra_args(chosen), *args, "-n", str(n), sys.executable, "-c",
           _WORLD_PROBE]
    try:
        out = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             timeout=timeout).stdout
    except subprocess.TimeoutExpired:
        raise LaunchError("%s did not finish in %g s" % (" ".join(cmd), timeout)) from None
    got = sorted((json.loads(m) for m in re.findall(r"WORLD (\{[^}]*\})", out)),
                 key=lambda r: r["rank"])
    if [(r["rank"], r["size"]) for r in got] != [(r, n) for r in range(n)]:
        raise LaunchError("%s: expected ranks 0..%d of a world of %d, got (rank, size) %s\n%s"
                          % (" ".join(cmd), n - 1, n, [(r["rank"], r["size"]) for r in got],
                             out[-2000:]))
    return got


def abort_at_exit(status=1, why=""):
    """End this process's MPI with ``MPI_Abort(MPI_COMM_WORLD, status)`` at
    exit instead of ``MPI_Finalize`` (mpi4py's exit hook): called when a
    rank of the job died (``why`` says which), after which MPI_Finalize
    would wait for it forever (MPICH's finalisation waits for every rank of
    the world, on a socket, with no deadline), so a process that caught the
    error and exits normally would hang. The job then ends with ``status``
    (its launcher ends the ranks still running, as at any abort). Says so
    on stderr once. Does nothing where mpi4py.MPI is not imported."""
    if "mpi4py.MPI" not in sys.modules or _ABORTING:
        return
    from mpi4py.run import set_abort_status
    _ABORTING.append(status)
    set_abort_status(status)
    print("commlib: %s; MPI cannot be finalised without it, so this process will end with "
          "MPI_Abort (status %d) at exit" % (why or "a rank of the job died", status),
          file=sys.stderr, flush=True)


_ABORTING = []
