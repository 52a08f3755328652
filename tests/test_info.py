"""``python -m commlib.info``: what it reports, and that an mpiexec of
another MPI than mpi4py's (on PATH, or chosen with COMMLIB_MPIEXEC) is said
in one line and turns the exit status to 1."""
import os
import sys
from pathlib import Path

from mpirun import ROOT, python_path, run_bounded

#: what Open MPI's mpiexec prints for --version (the family mpi4py's MPICH
#: wheel does not belong to)
OPEN_MPI = """#!/bin/sh
echo "mpiexec (OpenRTE) 4.1.4"
echo ""
echo "Report bugs to http://www.open-mpi.org/community/help/"
"""


def info(*args, path=None, env=None, timeout=90):
    """Run ``python -m commlib.info ARGS``; ``path`` goes ahead of PATH."""
    full = dict(os.environ, PYTHONPATH=python_path())
    full.pop("COMMLIB_MPIEXEC", None)
    if path is not None:
        full["PATH"] = os.pathsep.join([str(path), full.get("PATH", "")])
    full.update(env or {})
    return run_bounded([sys.executable, "-m", "commlib.info", *args], timeout, env=full,
                       cwd=ROOT)


def fake_open_mpi(tmp_path):
    folder = tmp_path / "bin"
    folder.mkdir()
    exe = folder / "mpiexec"
    exe.write_text(OPEN_MPI)
    exe.chmod(0o755)
    return folder


def lines_starting(text, prefix):
    return [line for line in text.splitlines() if line.startswith(prefix)]


def test_reports_versions_library_host_loops_and_settings():
    proc = info(env={"COMMLIB_CHECK": "0"})
    out = proc.stdout
    for prefix in ("python ", "numpy: ", "mpi4py: ", "cupy: ", "torch: ",
                   "MPI library (mpi4py loads): ", "mpiexec commlib uses: ",
                   "MPI library and mpiexec match: ", "compiled host loops: ", "settings: "):
        assert len(lines_starting(out, prefix)) == 1, (prefix, out, proc.stderr)
    assert "COMMLIB_CHECK=0" in lines_starting(out, "settings: ")[0]
    assert lines_starting(out, "MPI library and mpiexec match: ")[0].endswith("yes"), out


def test_mpiexec_of_another_mpi_on_path_is_one_mismatch_line(tmp_path):
    folder = fake_open_mpi(tmp_path)
    proc = info(path=folder)
    found = lines_starting(proc.stdout, "MISMATCH")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert len(found) == 1, proc.stdout
    assert str(folder / "mpiexec") in found[0] and "OpenRTE 4.1.4" in found[0].replace(
        "(OpenRTE) ", "OpenRTE "), found[0]
    assert "separate jobs of size 1" in found[0] and "commlib.launch" in found[0]
    # the mpiexec commlib itself would use still matches mpi4py's library
    assert lines_starting(proc.stdout, "MPI library and mpiexec match: ")[0].endswith("yes")


def test_mpiexec_of_mpi4pys_library_on_path_is_reported_as_it_is():
    # the interpreter's folder holds the mpiexec of mpi4py's MPI (the mpich wheel)
    beside = Path(sys.executable).parent
    proc = info(path=beside)
    assert proc.returncode == 0 and not lines_starting(proc.stdout, "MISMATCH"), proc.stdout
    found = lines_starting(proc.stdout, "mpiexec on PATH: ")
    assert len(found) == 1 and str(beside / "mpiexec") in found[0], proc.stdout


def test_chosen_mpiexec_of_another_mpi_is_refused_in_one_line(tmp_path):
    folder = fake_open_mpi(tmp_path)
    # PATH's first mpiexec is the matching one beside the interpreter
    proc = info("--run", "2", path=Path(sys.executable).parent,
                env={"COMMLIB_MPIEXEC": str(folder / "mpiexec")})
    found = lines_starting(proc.stdout, "MISMATCH")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert len(found) == 1 and str(folder / "mpiexec") in found[0], proc.stdout
    assert "COMMLIB_MPIEXEC" in found[0] or "named" in found[0] or "OpenRTE" in found[0], found
    assert not lines_starting(proc.stdout, "2 ranks form one MPI world"), proc.stdout


def test_run_starts_ranks_that_form_one_world():
    """--run 2: one world of 2 on this host; each rank's host, local rank
    and local size (both ranks share this machine's memory)."""
    import socket
    proc = info("--run", "2")
    found = lines_starting(proc.stdout, "2 ranks form one MPI world of 2: ")
    assert found == ["2 ranks form one MPI world of 2: yes, on 1 host (%s)"
                     % socket.gethostname()], proc.stdout + proc.stderr
    assert lines_starting(proc.stdout, "rank ") == [
        "rank %d: host %s, local rank %d of 2" % (r, socket.gethostname(), r)
        for r in range(2)], proc.stdout
    assert not lines_starting(proc.stdout, "MISMATCH: the mpiexec commlib"), proc.stdout


def test_negative_number_of_ranks_is_an_argument_error():
    proc = info("--run", "-2")
    assert proc.returncode == 2 and "expected a number of ranks >= 0, got '-2'" in proc.stderr


def test_hosts_are_checked_and_need_run():
    """--hosts without --run, or with more ranks than slots: status 2 and the
    reason (the runs on several nodes are tests/transport/test_nodes.py's)."""
    proc = info("--hosts", "a:2")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "error: --hosts, --hostfile and --launcher-exec are for --run N" in proc.stderr
    proc = info("--run", "3", "-H", "a:2")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "error: --run 3 is more than the 2 slots of --hosts (a:2)" in proc.stderr
