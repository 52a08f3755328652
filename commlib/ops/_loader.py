"""Load the CUDA sources under ``kernels/`` as ``cupy.RawModule`` objects.

Modules are compiled once per (source, device compute capability, options)
and cached for the life of the process; CuPy additionally caches the
compiled binary on disk. Launch sizes come from the device's properties.
"""
import functools
import hashlib
import os
from pathlib import Path

from .. import settings
from ..errors import BackendUnavailableError

_PACKAGE_DIR = Path(__file__).resolve().parent.parent


def kernel_dir():
    """Directory holding the ``.cu`` sources.

    An installed package carries them in ``commlib/_kernels``; a source
    checkout keeps them in the top-level ``kernels/`` folder.
    """
    override = os.environ.get(settings.KERNEL_DIR)
    candidates = [Path(override)] if override else []
    candidates += [_PACKAGE_DIR / "_kernels", _PACKAGE_DIR.parent / "kernels"]
    for path in candidates:
        if path.is_dir() and any(path.glob("*.cu")):
            return path
    raise BackendUnavailableError(
        "commlib: CUDA kernel sources not found; looked in "
        + ", ".join(str(p) for p in candidates))


def read_source(name):
    """Text of ``kernels/<name>`` (e.g. ``"cast.cu"``)."""
    return (kernel_dir() / name).read_text()


def _cupy():
    try:
        import cupy
    except ImportError as exc:  # pragma: no cover - depends on the machine
        raise BackendUnavailableError(
            "commlib: cupy is not installed; CUDA kernels need it") from exc
    return cupy


@functools.lru_cache(maxsize=None)
def _headers_digest():
    """Digest of every ``kernels/*.cuh``: CuPy's on-disk cache keys on the
    source text and options only, so the options carry this to recompile a
    kernel when a header it includes changes."""
    h = hashlib.sha1()
    for path in sorted(kernel_dir().glob("*.cuh")):
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:16]


@functools.lru_cache(maxsize=None)
def _module(name, device_id, options):
    cupy = _cupy()
    src = read_source(name)
    extra = ("-I" + str(kernel_dir()), "-DCOMMLIB_HEADERS_DIGEST=0x" + _headers_digest())
    return cupy.RawModule(code=src, options=options + extra, name_expressions=None)


def get_function(source, kernel_name, options=("--std=c++17",)):
    """The ``cupy.RawKernel`` ``kernel_name`` from ``kernels/<source>``,
    compiled for the current device."""
    cupy = _cupy()
    return _module(source, cupy.cuda.Device().id, tuple(options)).get_function(kernel_name)


@functools.lru_cache(maxsize=None)
def _device_props(device_id):
    cupy = _cupy()
    return cupy.cuda.runtime.getDeviceProperties(device_id)


def launch_config(n_items, threads=256, items_per_thread=1, waves=4):
    """(grid, block) for a grid-stride kernel over ``n_items`` work items.

    The grid is capped at ``waves`` full waves of the device (SM count times
    resident blocks per SM) so grid-stride loops keep every SM busy without
    launching more blocks than can run.
    """
    cupy = _cupy()
    props = _device_props(cupy.cuda.Device().id)
    sms = props["multiProcessorCount"]
    per_sm = max(1, props["maxThreadsPerMultiProcessor"] // threads)
    needed = -(-max(int(n_items), 1) // (threads * items_per_thread))
    grid = max(1, min(needed, sms * per_sm * waves))
    return (grid,), (threads,)


def sm_count():
    """Number of streaming multiprocessors of the current device."""
    cupy = _cupy()
    return _device_props(cupy.cuda.Device().id)["multiProcessorCount"]
