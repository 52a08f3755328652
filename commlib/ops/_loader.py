"""Load the CUDA sources under ``kernels/`` as ``cupy.RawModule`` objects.

Modules are compiled once per (source, device compute capability, options)
and cached for the life of the process; CuPy additionally caches the
compiled binary on disk. Grids are sized to the blocks that can be resident
at once: from each compiled kernel's registers and static shared memory and
the device's per-SM limits (:func:`resident_blocks`).
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


DEFAULT_OPTIONS = ("--std=c++17",)
# what cupy.RawModule appends to every module's options (before the
# architecture, -arch=sm_XX or compute_XX, which it picks for the device)
CUPY_ADDED_OPTIONS = ("-ftz=true",)


def module_options(options=DEFAULT_OPTIONS):
    """The options commlib passes to ``cupy.RawModule`` for its kernels."""
    return tuple(options) + ("-I" + str(kernel_dir()),
                             "-DCOMMLIB_HEADERS_DIGEST=0x" + _headers_digest())


@functools.lru_cache(maxsize=None)
def _module(name, device_id, options):
    cupy = _cupy()
    src = read_source(name)
    return cupy.RawModule(code=src, options=module_options(options), name_expressions=None)


def get_function(source, kernel_name, options=DEFAULT_OPTIONS):
    """The ``cupy.RawKernel`` ``kernel_name`` from ``kernels/<source>``,
    compiled for the current device (the same object on every call)."""
    cupy = _cupy()
    return _function(source, kernel_name, cupy.cuda.Device().id, tuple(options))


@functools.lru_cache(maxsize=None)
def _function(source, kernel_name, device_id, options):
    return _module(source, device_id, options).get_function(kernel_name)


@functools.lru_cache(maxsize=None)
def _device_props(device_id):
    cupy = _cupy()
    return cupy.cuda.runtime.getDeviceProperties(device_id)


SM_LIMITS = {
    # regs, threads, blocks, shared memory bytes (the largest carveout), per SM
    "sm_75": dict(regs=65536, threads=1024, blocks=16, shared=65536),
    "sm_80": dict(regs=65536, threads=2048, blocks=32, shared=167936),
    "sm_86": dict(regs=65536, threads=1536, blocks=16, shared=102400),
    "sm_89": dict(regs=65536, threads=1536, blocks=24, shared=102400),
    "sm_90": dict(regs=65536, threads=2048, blocks=32, shared=233472),
}
_REG_UNIT = 256          # registers are allocated per warp in units of 256
_SUB_PARTITIONS = 4      # an SM's register file is split over 4 schedulers
_SHARED_UNIT = 128       # shared memory allocation granularity, bytes
_SHARED_RESERVED = 1024  # shared memory the system reserves per block (sm_80+)


def occupancy(regs, threads, shared, limits, reserved=_SHARED_RESERVED):
    """Blocks of ``threads`` threads that fit on one SM at once (the CUDA
    occupancy calculator's rule) for a kernel using ``regs`` registers per
    thread and ``shared`` bytes of static shared memory per block, on an SM
    with ``limits`` (dict: regs, threads, blocks, shared, as SM_LIMITS).
    0 when one block does not fit."""
    warps = -(-threads // 32)
    by_threads = limits["threads"] // (warps * 32)
    per_warp = -(-max(regs, 1) * 32 // _REG_UNIT) * _REG_UNIT
    if per_warp * warps > limits["regs"]:
        return 0
    by_regs = (limits["regs"] // _SUB_PARTITIONS // per_warp) * _SUB_PARTITIONS // warps
    per_block = -(-(shared + reserved) // _SHARED_UNIT) * _SHARED_UNIT
    by_shared = limits["shared"] // per_block
    return max(0, min(limits["blocks"], by_threads, by_regs, by_shared))


def device_limits(props):
    """SM limits (as in SM_LIMITS) from ``cupy.cuda.runtime.getDeviceProperties``;
    None when the properties do not say (no real device)."""
    try:
        return dict(regs=props["regsPerMultiprocessor"],
                    threads=props["maxThreadsPerMultiProcessor"],
                    blocks=props["maxBlocksPerMultiProcessor"],
                    shared=props["sharedMemPerMultiprocessor"])
    except KeyError:
        return None


def resident_blocks(kernel, threads):
    """Blocks of ``threads`` threads of ``kernel`` (a ``cupy.RawKernel``) that
    are resident on one SM of the current device, from the kernel's compiled
    attributes (registers, static shared memory) and the device's limits; at
    least 1. Where neither is reported: the device's threads per SM over
    ``threads``. Memoized per device, kernel object and ``threads``."""
    cupy = _cupy()
    device_id = cupy.cuda.Device().id
    key = (device_id, id(kernel), threads)
    hit = _resident.get(key)
    if hit is not None and hit[0] is kernel:
        return hit[1]
    props = _device_props(device_id)
    limits = device_limits(props)
    attrs = getattr(kernel, "attributes", None)
    if limits is None or not attrs:
        blocks = max(1, props["maxThreadsPerMultiProcessor"] // threads)
    else:
        reserved = props.get("reservedSharedMemPerBlock", _SHARED_RESERVED)
        blocks = max(1, occupancy(attrs["num_regs"], threads, attrs["shared_size_bytes"],
                                  limits, reserved))
    _resident[key] = (kernel, blocks)
    return blocks


_resident = {}  # (device, id(kernel), threads) -> (kernel, blocks); kernels come from a cache


def launch_config(n_items, kernel, threads=256, items_per_thread=1, waves=4):
    """(grid, block) for a grid-stride launch of ``kernel`` over ``n_items``
    work items.

    The grid is capped at ``waves`` full waves of the device (SM count times
    the kernel's resident blocks per SM) so grid-stride loops keep every SM
    busy without launching more blocks than can run.
    """
    needed = -(-max(int(n_items), 1) // (threads * items_per_thread))
    grid = max(1, min(needed, sm_count() * resident_blocks(kernel, threads) * waves))
    return (grid,), (threads,)


def persistent_grid(n_tiles, kernel, threads):
    """Grid of a persistent kernel that pulls ``n_tiles`` tiles: one block per
    tile, at most one wave of resident blocks."""
    return (max(1, min(int(n_tiles), sm_count() * resident_blocks(kernel, threads))),)


def sm_count():
    """Number of streaming multiprocessors of the current device."""
    cupy = _cupy()
    return _device_props(cupy.cuda.Device().id)["multiProcessorCount"]
