"""``pip install .`` without the mpi extra: one process works with no MPI at
all, and the hints say how to install MPI from this source tree."""
import os
import subprocess
import sys
import textwrap

from mpirun import ROOT



def run(code, env=None):
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT,
                          capture_output=True, text=True, timeout=60, env=env)


def test_one_process_without_mpi4py():
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "collective" / "single_process_program.py")],
                          cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.returncode == 0 and "single process ok" in proc.stdout, proc.stderr


def test_mpi_launcher_without_mpi4py_says_how_to_install():
    env = dict(os.environ, PMI_RANK="0", PMI_SIZE="2")
    proc = run("import sys\nsys.modules['mpi4py'] = None\nimport commlib\ncommlib.init()\n",
               env=env)
    assert proc.returncode != 0
    assert "pip install '.[mpi]'" in proc.stderr and "BackendUnavailableError" in proc.stderr
