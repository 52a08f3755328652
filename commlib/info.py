"""``python -m commlib.info``: what commlib would use on this machine.

Prints the versions of Python, numpy, mpi4py, cupy and torch; the MPI
library mpi4py loads and the mpiexec commlib would start ranks with (and
whether they belong to the same MPI: a mismatch is said in one line); GPUs
and NCCL; whether the compiled host loops are built; the commlib settings
in effect. ``--run N`` also starts N ranks with that mpiexec, checks
that they form one MPI world of N and shows each rank's host, local rank
and local size (the ranks sharing its node's memory); with ``--hosts
a:2,b:2`` or ``--hostfile FILE`` (and ``--launcher-exec PROGRAM`` instead
of ssh) on those hosts, as ``python -m commlib.launch`` places them.

Exit status: 0, or 1 when the mpiexec on PATH or the one commlib would use
belongs to another MPI than mpi4py's library, or the ranks of ``--run N``
did not form one world of N.
"""
import argparse
import os
import platform
import shutil
import sys

from .startup import hosts, mpi_library
from . import settings
from .errors import ArgumentError, BackendUnavailableError, LaunchError


def _version(module):
    try:
        return __import__(module).__version__
    except Exception as exc:    # not installed, or broken
        return "not importable (%s: %s)" % (type(exc).__name__, exc)


def _gpus():
    from .core import gpu
    reason = gpu.unavailable_reason()
    if reason is not None:
        return ["GPUs: none (%s)" % reason]
    import cupy
    lines = []
    for d in range(cupy.cuda.runtime.getDeviceCount()):
        props = cupy.cuda.runtime.getDeviceProperties(d)
        name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
        lines.append("GPU %d: %s, %.0f GiB, compute capability %d.%d"
                     % (d, name, props["totalGlobalMem"] / 2 ** 30, props["major"],
                        props["minor"]))
    nccl = gpu.nccl_unavailable_reason()
    if nccl is None:
        from cupy.cuda import nccl as nccl_module
        lines.append("NCCL: usable (version %s)" % nccl_module.get_version())
    else:
        lines.append("NCCL: not usable (%s)" % nccl)
    return lines


def _settings():
    names = [v for k, v in sorted(vars(settings).items())
             if k.isupper() and isinstance(v, str) and v.startswith(("COMMLIB_", "NNABLA_"))]
    found = ["%s=%s" % (n, os.environ[n]) for n in names if os.environ.get(n, "").strip()]
    return "settings: %s (watch dog: %s)" % (", ".join(found) or "defaults",
                                             "off" if settings.timeout() is None
                                             else "%g s" % settings.timeout())


def _mpi(run, say, where=None):
    """Say which MPI library mpi4py loads, the mpiexec on PATH and the one
    commlib uses, whether they match, and (``run`` > 0) whether ``run``
    ranks form one world, and each rank's host, local rank and local size;
    ``where``: (hosts, launcher-exec) to place them; returns the exit
    status (see :func:`report`)."""
    status = 0
    try:
        library = mpi_library.loaded_library()
        say("MPI library (mpi4py loads): %s [%s] %s" % (library.version, library.family,
                                                        library.path))
        on_path = shutil.which("mpiexec")
        if on_path:
            seen = mpi_library.describe_mpiexec(on_path)
            if None not in (seen.family, library.family) and seen.family != library.family:
                say("MISMATCH: the mpiexec on PATH, %s (%s), belongs to another MPI than "
                    "mpi4py's: 'mpiexec -n N python ...' would run N separate jobs of size 1 "
                    "(use python -m commlib.launch, or that MPI's mpiexec)"
                    % (on_path, seen.version))
                status = 1
            else:
                say("mpiexec on PATH: %s (%s)" % (on_path, seen.version))
        try:
            chosen = mpi_library.choose_mpiexec(os.environ.get(settings.MPIEXEC) or None,
                                                library=library)
            say("mpiexec commlib uses: %s (%s) %s" % (chosen.path, chosen.version,
                                                      " ".join(mpi_library.extra_args(chosen))))
            say("MPI library and mpiexec match: %s" % (
                "yes" if chosen.family == library.family
                else "unknown (%s / %s)" % (library.family, chosen.family)))
            if run:
                args = hosts.mpiexec_args(chosen.family, *where) if where else []
                got = mpi_library.run_world(run, chosen, args=args)
                names = list(dict.fromkeys(r["host"] for r in got))
                say("%d ranks form one MPI world of %d: yes, on %d host%s (%s)"
                    % (run, run, len(names), "" if len(names) == 1 else "s", ", ".join(names)))
                for r in got:
                    say("rank %d: host %s, local rank %d of %d"
                        % (r["rank"], r["host"], r["local_rank"], r["local_size"]))
        except LaunchError as exc:
            say("MISMATCH: %s" % " ".join(str(exc).split()))
            return 1
    except BackendUnavailableError as exc:
        say("MPI: %s" % exc)
        return 1 if run else 0
    return status


def report(run=0, out=sys.stdout, where=None):
    """Print what commlib would use on this machine (see the module docstring).

    A LaunchError or BackendUnavailableError met on the way is printed and
    turned into the exit status, not raised.

    Args:
        run: N > 0 also starts N ranks with the chosen mpiexec and checks
            that they form one MPI world of N; 0 (default) starts none.
        out: the text stream printed to (default ``sys.stdout``).
        where: (hosts, launcher-exec path) for ``run``'s ranks (see
            :mod:`commlib.startup.hosts`; None: this machine).

    Returns:
        The exit status: 0, or 1 when the mpiexec on PATH or the one
        commlib would use belongs to another MPI than mpi4py's library,
        or the ranks of ``run`` did not form one world of N, or ``run`` was
        asked for and mpi4py's MPI library could not be found.
    """
    from .ops import native
    say = lambda text: print(text, file=out, flush=True)   # noqa: E731
    say("python %s on %s" % (sys.version.split()[0], platform.platform()))
    for module in ("numpy", "mpi4py", "cupy", "torch"):
        say("%s: %s" % (module, _version(module)))
    status = _mpi(run, say, where)
    for line in _gpus():
        say(line)
    say("compiled host loops: %s" % ("built" if native.available()
                                      else "not available (%s)" % native.unavailable_reason()))
    say(_settings())
    return status


def _ranks(text):
    """``--run``'s value: a number of ranks, 0 (do not start a job) or more."""
    try:
        n = int(text)
    except ValueError:
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError("expected a number of ranks >= 0, got %r" % text)
    return n


def main(argv=None):
    """``python -m commlib.info [--run N]``: :func:`report` to ``sys.stdout``.

    Args:
        argv: the command line's arguments without the program name
            (default ``sys.argv[1:]``).

    Returns:
        :func:`report`'s exit status.

    Raises:
        SystemExit: (from argparse) ``--help``, or bad arguments (status 2).
    """
    ap = argparse.ArgumentParser(prog="python -m commlib.info",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", type=_ranks, default=0, metavar="N",
                    help="start N ranks with the chosen mpiexec and check they form one world")
    place = ap.add_mutually_exclusive_group()
    place.add_argument("-H", "--hosts", default=None, metavar="HOST:N,...",
                       help="--run's ranks on these hosts, as python -m commlib.launch "
                            "--hosts places them")
    place.add_argument("--hostfile", default=None, metavar="FILE",
                       help="--run's hosts from a file of HOST or HOST:N lines")
    ap.add_argument("--launcher-exec", default=None, metavar="PROGRAM",
                    help="the program mpiexec reaches the hosts with (default ssh)")
    ns = ap.parse_args(argv)
    where = None
    if ns.hosts or ns.hostfile or ns.launcher_exec:
        try:
            if not ns.run:
                raise ArgumentError("--hosts, --hostfile and --launcher-exec are for --run N")
            found = (hosts.parse_hosts(ns.hosts) if ns.hosts is not None
                     else hosts.read_hostfile(ns.hostfile) if ns.hostfile is not None else None)
            if found:
                hosts.check_slots(found, ns.run, "--hosts" if ns.hosts else
                                  "--hostfile %s" % ns.hostfile, "--run")
            where = (found, ns.launcher_exec and hosts.check_launcher_exec(ns.launcher_exec))
        except ArgumentError as exc:
            ap.error(str(exc))
    return report(ns.run, where=where)


if __name__ == "__main__":
    sys.exit(main())
