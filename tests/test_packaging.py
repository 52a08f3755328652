"""An installed commlib (not only a source checkout) carries the kernel sources
and its compiled host loops; the README's quick start installs what running
needs, in place, so that the example it runs uses the compiled loops."""
import re
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


def test_the_quick_start_installs_only_what_running_needs_in_place():
    """The README's first command: an editable install (the checkout's host
    loops compiled in place, which the launcher's workers started from the
    checkout import) of the ``mpi`` extra alone (no torch, JAX or NVRTC
    wheels), then the example under the launcher. (tests/test_examples.py
    runs the example and checks it says nothing of loops not built.)"""
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Quick start"):]
    block = re.search(r"```sh\n(.*?)```", section, re.DOTALL).group(1).strip()
    assert block == ('pip install -e ".[mpi]" && '
                     'python -m commlib.launch -n 2 examples/mnist_train.py'), block
    extras = re.search(r"\[(.*?)\]", block).group(1).split(",")
    assert extras == ["mpi"]
    setup = (ROOT / "setup.py").read_text()
    mpi_extra = re.search(r'"mpi": \[(.*?)\]', setup).group(1)
    assert not re.search(r"torch|jax|nvrtc|cuobjdump|nvdisasm|cupy", mpi_extra), mpi_extra
