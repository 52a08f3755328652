"""Packaging for commlib.

The CUDA sources live in the top-level ``kernels/`` folder; ``build_py``
copies them into the package as ``commlib/_kernels`` so an installed commlib
(``pip install .``, not only ``-e``) finds them.

The host loops (``commlib/native/*.c``) are built into the extension module
``commlib._hostloops`` (``pip install -e .`` builds it in place in a source
checkout). The extension is optional: without a C compiler the build goes
on, and commlib warns once at run time and uses numpy instead. No
``-ffast-math`` and no contraction into FMA: results match numpy's bit for bit.
"""
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent
HOST_LOOPS_FLAGS = ["-O3", "-ffp-contract=off"]


def host_loops():
    """The extension of the host loops, against this build's numpy headers."""
    import numpy
    native = HERE / "commlib" / "native"
    return Extension("commlib._hostloops",
                     sources=sorted(str(p.relative_to(HERE)) for p in native.glob("*.c")),
                     depends=sorted(str(p.relative_to(HERE)) for p in native.glob("*.h")),
                     include_dirs=[numpy.get_include(), str(native.relative_to(HERE))],
                     extra_compile_args=HOST_LOOPS_FLAGS, optional=True)


class build_py_with_kernels(build_py):
    """build_py that also ships kernels/*.cu and *.cuh inside the package."""

    def run(self):
        super().run()
        target = Path(self.build_lib) / "commlib" / "_kernels"
        target.mkdir(parents=True, exist_ok=True)
        for src in sorted((HERE / "kernels").glob("*.cu*")):
            self.copy_file(str(src), str(target / src.name))


setup(
    name="commlib",
    version="0.1.0",
    description="Data-parallel gradient all-reduce for custom numpy/cupy training loops "
                "over NCCL and MPI, with CUDA compression kernels",
    long_description=(HERE / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.9",
    packages=["commlib", "commlib.collective", "commlib.compression", "commlib.faults",
              "commlib.launch", "commlib.ops", "commlib.optim", "commlib.progress", "commlib.startup",
              "commlib.transport"],
    ext_modules=[host_loops()],
    install_requires=["numpy>=1.22"],
    extras_require={
        "mpi": ["mpi4py>=4.0", "mpich"],
        "test": [
                 # the README's test command runs pytest-xdist with --dist
                 # loadgroup, whose groups pytest 9.2 drops silently
                 # (pytest-dev/pytest-xdist#1386)
                 "pytest>=7,<9.2", "pytest-xdist>=3",
                 "hypothesis>=6", "mpi4py>=4.0", "mpich", "ml_dtypes", "matplotlib",
                 # arrays of other frameworks (tests/test_interop.py); the CPU build
                 # of torch is the one the CI machines install
                 "torch==2.13.0", "jax",
                 # NVRTC of both CUDA majors and the machine-code readers, for the
                 # kernel checks that need no GPU (tests/test_kernel_*.py)
                 "nvidia-cuda-nvrtc-cu12>=12.0,<13", "nvidia-cuda-nvrtc>=13,<14",
                 "nvidia-cuda-cuobjdump>=13.2,<14", "nvidia-cuda-nvdisasm>=13.2,<14"],
        "cuda12": ["cupy-cuda12x>=13", "nvidia-nccl-cu12"],
        "cuda13": ["cupy-cuda13x>=14", "nvidia-nccl-cu13"],
    },
    entry_points={"console_scripts": ["commlib-run = commlib.launch:main"]},
    cmdclass={"build_py": build_py_with_kernels},
)
