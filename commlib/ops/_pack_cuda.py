"""CUDA path of :func:`commlib.ops.pack.pack` / :func:`~commlib.ops.pack.unpack`.

One launch of ``kernels/pack.cu`` per distinct array dtype moves every array
of the list. The kernel reads a segment table (array addresses, bucket
offsets, sizes, chunk prefix sums; see the header of ``pack.cu``) that is
built on the host and uploaded once per distinct list: it is cached, keyed
on the device and on the exact (address, offset, size) of every array, so a
training loop that packs the same gradient buffers each step reuses it. The
checked launch data of a list is cached too, recognised by the identity of
its arrays (held by weak references), so a repeated call costs a few
microseconds of Python, not a pass over every array's attributes.
"""
import collections
import functools

import numpy as np

from ..errors import ArgumentError, ArrayTypeError
from ..core.caches import IdentityCache
from .cast import FORMAT_CODES, check_counter, check_scale, copy_mode, format_of

THREADS = 256
CAST_CHUNK = 8192            # elements per block-sized chunk for casting kernels
RAW_CHUNK_BYTES = 32768      # bytes per chunk for bit copies
TABLE_CACHE_SIZE = 256       # distinct array lists kept on each device

_CODES = ("f32", "f16", "bf16")
KERNEL_NAMES = tuple(
    ["pack_%s_%s" % (a, b) for a in _CODES for b in _CODES]
    + ["unpack_%s_%s%s" % (b, a, acc) for a in _CODES for b in _CODES for acc in ("", "_acc")]
    + ["%s_raw%d" % (d, w) for d in ("pack", "unpack") for w in (1, 2, 4, 8)])

Launch = collections.namedtuple("Launch", "kernel segments chunk")
Launch.__doc__ = """One kernel launch: ``kernel`` (name in kernels/pack.cu),
``segments`` (tuple of (address, bucket offset, count), offsets and counts in
the kernel's units) and ``chunk`` (units per chunk)."""


def plan(direction, dtypes, sizes, addresses, bucket_dtype, bucket_address, mode,
         accumulate=False):
    """Launches that move arrays of ``dtypes``/``sizes`` at ``addresses`` to
    (``direction="pack"``) or from (``"unpack"``) a bucket; ``mode`` is
    ``"raw"`` or ``"cast"`` (see :func:`commlib.ops.cast.copy_mode`).
    Empty arrays are skipped. Pure host code: no cupy needed."""
    bucket_dtype = np.dtype(bucket_dtype)
    offsets = np.concatenate(([0], np.cumsum(sizes, dtype=np.int64)))
    live = [(a, int(off), int(n), np.dtype(d))
            for a, off, n, d in zip(addresses, offsets[:-1], sizes, dtypes) if n]
    if not live:
        return []
    if mode == "raw":
        itemsize = bucket_dtype.itemsize
        unit = 8
        while unit > 1 and (itemsize % unit or bucket_address % unit
                            or any(a % unit for a, _, _, _ in live)):
            unit //= 2
        k = itemsize // unit
        segments = tuple((a, off * k, n * k) for a, off, n, _ in live)
        return [Launch("%s_raw%d" % (direction, unit), segments, RAW_CHUNK_BYTES // unit)]
    if mode != "cast":
        raise ArgumentError("mode: expected 'raw' or 'cast', got %r" % (mode,))
    bucket_code = FORMAT_CODES[format_of(bucket_dtype)]
    groups = collections.OrderedDict()
    for a, off, n, d in live:
        groups.setdefault(d, []).append((a, off, n))
    launches = []
    for d, segments in groups.items():
        code = FORMAT_CODES[format_of(d)]
        if direction == "pack":
            name = "pack_%s_%s" % (code, bucket_code)
        else:
            name = "unpack_%s_%s%s" % (bucket_code, code, "_acc" if accumulate else "")
        launches.append(Launch(name, tuple(segments), CAST_CHUNK))
    return launches


def build_table(segments, chunk):
    """int64 segment table of ``pack.cu`` and its total chunk count."""
    seg = np.array(segments, dtype=np.int64).reshape(-1, 3)
    counts = seg[:, 2]
    first = np.concatenate(([0], np.cumsum(-(-counts // chunk))))
    table = np.concatenate((seg[:, 0], seg[:, 1], counts, first)).astype(np.int64)
    return table, int(first[-1])


# ---------------------------------------------------------------- cupy glue

_tables = collections.OrderedDict()     # (device, chunk, segments) -> (table, nchunks)
_prepared = IdentityCache(TABLE_CACHE_SIZE)   # one entry per recently seen list, see _prepare
_dummies = {}                           # (device, role) -> 0-d int64, see _dummy


class _Prepared:
    """What a repeated pack/unpack of one list needs: its total size, device
    and copy mode, and the ready-made launches."""
    __slots__ = ("total", "device", "mode", "launches")


def _device_table(device_id, segments, chunk):
    key = (device_id, chunk, segments)
    hit = _tables.get(key)
    if hit is not None:
        _tables.move_to_end(key)
        return hit
    import cupy
    host, nchunks = build_table(segments, chunk)
    table = cupy.asarray(host)
    # the upload may still be in flight on this stream; a later launch on
    # another stream must not see a partial table
    cupy.cuda.get_current_stream().synchronize()
    _tables[key] = (table, nchunks)
    while len(_tables) > TABLE_CACHE_SIZE:
        _tables.popitem(last=False)
    return table, nchunks


def cached():
    """Every device table held now (see :func:`commlib.ops._launch.cached`)."""
    return tuple(_tables.values())


def _dummy(device_id, role):
    """A 0-d int64 device array standing in for an argument not given:
    ``role`` "counter" (kernels add to it; never read) or "never" (a skip
    flag that stays 0: kernels only read it)."""
    c = _dummies.get((device_id, role))
    if c is None:
        import cupy
        c = _dummies[device_id, role] = cupy.zeros((), dtype=np.int64)
    return c


def _check_bucket(bucket, what):
    if not (bucket.ndim == 1 and (bucket.size <= 1 or bucket.strides[0] == bucket.itemsize)):
        raise ArrayTypeError("%s: expected a contiguous 1-D cupy array, got shape %s strides %s"
                             % (what, bucket.shape, bucket.strides))


def _check_arrays(arrays, device):
    """Total element count after checking the arrays against ``device``."""
    for i, a in enumerate(arrays):
        if type(a).__module__.split(".")[0] != "cupy":
            raise ArrayTypeError("arrays[%d]: expected a cupy array (the bucket is cupy), got %s"
                                 % (i, type(a).__name__))
        if a.size and a.device.id != device:
            raise ArrayTypeError("arrays[%d]: expected an array on device %d (the bucket's), "
                                 "got device %d" % (i, device, a.device.id))
        if not a.flags.c_contiguous:
            raise ArrayTypeError("arrays[%d]: expected a C-contiguous array" % i)
        if a.size and a.data.ptr % a.itemsize:
            raise ArrayTypeError("arrays[%d]: address is not a multiple of the itemsize" % i)
    return sum(a.size for a in arrays)


def _prepare(direction, arrays, bucket, scale, accumulate, counting, what):
    """Checked launch data for this list and bucket; cached per list, so a
    training loop that passes the same arrays each step pays for the checks,
    the plan and the table upload once."""
    import cupy
    _check_bucket(bucket, what)
    device = bucket.device.id
    key = IdentityCache.key(arrays, (direction, bucket.dtype, bucket.data.ptr & 15,
                                     scale is None, accumulate, counting, device))
    p = _prepared.get(key)
    if p is None:
        p = _Prepared()
        p.device = device
        p.total = _check_arrays(arrays, device)
        p.mode = copy_mode([a.dtype for a in arrays], bucket.dtype, scale, accumulate, counting)
        p.launches = []
        if p.mode != "generic":
            from ._loader import get_function, launch_config
            with cupy.cuda.Device(device):
                for launch in plan(direction, [a.dtype for a in arrays],
                                   [a.size for a in arrays],
                                   [a.data.ptr if a.size else 0 for a in arrays],
                                   bucket.dtype, bucket.data.ptr, p.mode, accumulate):
                    table, nchunks = _device_table(device, launch.segments, launch.chunk)
                    kernel = get_function("pack.cu", launch.kernel)
                    grid, block = launch_config(nchunks * THREADS, kernel, THREADS)
                    p.launches.append((kernel, grid, block,
                                       table, np.int64(len(launch.segments)),
                                       np.int64(launch.chunk)))
        _prepared.put(key, arrays, p)
    if bucket.size < p.total:
        raise ArgumentError("%s: expected at least %d elements (the arrays' total), got %d"
                            % (what, p.total, bucket.size))
    return p


def _calls(p, bucket, scale, counter, unless):
    """The (kernel, grid, block, arguments) of each launch of ``p`` on
    ``bucket``."""
    scale32 = np.float32(1) if scale is None else check_scale(scale)
    if counter is None:
        counter = _dummy(p.device, "counter")
    skip = _dummy(p.device, "never") if unless is None else unless
    return tuple((kernel, grid, block, (table, nseg, chunk, bucket, scale32, counter, skip))
                 for kernel, grid, block, table, nseg, chunk in p.launches)


def _run(device, calls):
    """Issue ``calls`` (see :func:`_calls`) on ``device``, the current one
    made so for the time of the launches if it is not."""
    import cupy
    if cupy.cuda.runtime.getDevice() != device:
        with cupy.cuda.Device(device):
            return _run(device, calls)
    for kernel, grid, block, args in calls:
        kernel(grid, block, args)


def _launch(p, bucket, scale, counter, unless):
    _run(p.device, _calls(p, bucket, scale, counter, unless))


def bind(direction, arrays, bucket, scale=None):
    """``pack_cuda(arrays, bucket, scale)`` (``direction="pack"``) or
    ``unpack_cuda(bucket, arrays, scale)`` (``"unpack"``) as a callable of
    no arguments that repeats it: the checks, the plan and the launch
    arguments are worked out once, here, so a call is the launches alone.
    The arrays and the bucket must stay as they are (the same memory) for
    as long as the callable is used: the owner of both keeps it (see
    :class:`commlib.collective.bucketing.PreparedList`). Its attribute
    ``launches_only`` says whether a call issues kernel launches alone (so
    may be captured into a CUDA graph, see :mod:`commlib.ops.graphs`): not
    so for the copies numpy's casting rules govern (float64, integers with
    a scale), which run as cupy operations."""
    arrays = list(arrays)
    if direction == "pack":
        p = _prepare("pack", arrays, bucket, scale, False, False, "out")
        generic = functools.partial(pack_cuda, arrays, bucket, scale)
    else:
        p = _prepare("unpack", arrays, bucket, scale, False, False, "buf")
        generic = functools.partial(unpack_cuda, bucket, arrays, scale)
    copy = generic if p.mode == "generic" else functools.partial(
        _run, p.device, _calls(p, bucket, scale, None, None))
    copy.launches_only = p.mode != "generic"
    return copy


def pack_cuda(arrays, out, scale=None, nonfinite=None, unless=None):
    """CUDA pack (see :func:`commlib.ops.pack.pack`); returns ``out``."""
    import cupy
    counter = check_counter(nonfinite, True)
    unless = check_counter(unless, True, "unless")
    p = _prepare("pack", arrays, out, scale, False, counter is not None, "out")
    if p.mode != "generic":
        _launch(p, out, scale, counter, unless)
        return out
    if unless is not None and unless:      # a host read: only the rare generic mode
        return out
    dst = out[:p.total]
    lo = 0
    for a in arrays:
        seg = dst[lo:lo + a.size]
        lo += a.size
        src = a.reshape(-1)
        if scale is not None:
            src = src * scale
        cupy.copyto(seg, src, casting="same_kind" if scale is None else "unsafe")
    if counter is not None and dst.dtype.kind in "fc" and p.total:
        counter += dst.size - cupy.count_nonzero(cupy.isfinite(dst))
    return out


def unpack_cuda(buf, arrays, scale=None, accumulate=False, nonfinite=None, unless=None):
    """CUDA unpack (see :func:`commlib.ops.pack.unpack`); returns ``arrays``."""
    import cupy
    arrays_list = list(arrays)
    counter = check_counter(nonfinite, True)
    unless = check_counter(unless, True, "unless")
    p = _prepare("unpack", arrays_list, buf, scale, accumulate, counter is not None, "buf")
    if p.mode != "generic":
        _launch(p, buf, scale, counter, unless)
        return arrays
    if unless is not None and unless:      # a host read: only the rare generic mode
        return arrays
    lo = 0
    for a in arrays_list:
        src = buf[lo:lo + a.size].reshape(a.shape)
        lo += a.size
        if scale is not None:
            src = src * scale
        if accumulate:
            src = a + src
        cupy.copyto(a, src, casting="unsafe")
        if counter is not None and a.dtype.kind in "fc" and a.size:
            counter += a.size - cupy.count_nonzero(cupy.isfinite(a))
    return arrays
