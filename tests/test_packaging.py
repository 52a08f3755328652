"""An installed commlib (not only a source checkout) carries the kernel sources
and its compiled host loops."""
import subprocess
import sys

from mpirun import ROOT


def test_build_ships_kernel_sources_inside_the_package(tmp_path):
    proc = subprocess.run([sys.executable, "setup.py", "-q", "build", "--build-base",
                           str(tmp_path / "build"), "--build-lib", str(tmp_path / "lib")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    shipped = sorted(p.name for p in (tmp_path / "lib" / "commlib" / "_kernels").glob("*.cu*"))
    sources = sorted(p.name for p in (ROOT / "kernels").glob("*.cu*"))
    assert sources and shipped == sources
    # the host loops are compiled into the package, not shipped as sources
    assert list((tmp_path / "lib" / "commlib").glob("_hostloops*.so"))
    assert not (tmp_path / "lib" / "commlib" / "native").exists()
    code = ("import sys; sys.path.insert(0, %r); from commlib.ops import _loader; "
            "print(_loader.kernel_dir())" % str(tmp_path / "lib"))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=tmp_path, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(tmp_path / "lib" / "commlib" / "_kernels")


def test_import_does_not_initialise_mpi_or_cuda():
    code = ("import commlib, sys; "
            "assert 'mpi4py.MPI' not in sys.modules, 'MPI initialised at import'; "
            "assert 'cupy' not in sys.modules, 'cupy imported at import'; "
            "print(commlib.__version__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, timeout=60)
    assert out.returncode == 0 and out.stdout.strip(), out.stderr
