"""Cast between float32, float16 and bfloat16, with a scale, optionally
accumulating into the destination.

bfloat16 has no numpy/cupy dtype: bfloat16 arrays are ``uint16`` arrays of
bit patterns, and the format is named ``"bfloat16"``.

Semantics (identical for the numpy twin and the CUDA kernel ``kernels/cast.cu``,
bit for bit):

* every element is computed in IEEE float32: ``v = scale * float32(x)``, plus
  ``float32(out)`` when accumulating (two roundings, never a fused multiply-add);
* ``v`` is rounded to the output format with round-to-nearest-even; values
  beyond the format's range become +-inf;
* every NaN written is the format's canonical quiet NaN (float32 ``0x7FC00000``,
  float16 ``0x7E00``, bfloat16 ``0x7FC0``); NaN sign and payload are not kept,
  as CPU and GPU arithmetic propagate them differently;
* ``nonfinite`` counts the non-finite values written: finite inputs that
  overflowed to inf as well as inf and NaN carried over from the inputs.
"""
import numbers

import numpy as np

from ..errors import ArgumentError, ArrayTypeError
from .arrays import is_cupy

FORMATS = ("float32", "float16", "bfloat16")

# short names used in kernel names (kernels/cast.cu, kernels/pack.cu)
FORMAT_CODES = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}

_STORAGE = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16),
            "bfloat16": np.dtype(np.uint16)}
_FORMAT_OF = {v: k for k, v in _STORAGE.items()}

_CHUNK = 1 << 16            # elements per numpy step (temporaries stay in cache)
_BF16_OVERFLOW = 0x7F7F8000  # |bits| at or above this round to bfloat16 inf (or are NaN)


def format_of(dtype):
    """Format name stored in arrays of ``dtype``: ``"float32"``, ``"float16"``,
    ``"bfloat16"`` (for ``uint16``), or None for any other dtype."""
    return _FORMAT_OF.get(np.dtype(dtype))


def storage_dtype(fmt):
    """numpy dtype that stores format ``fmt`` (``uint16`` for ``"bfloat16"``)."""
    name = _format_name(fmt, "dtype")
    return _STORAGE[name]


def _format_name(fmt, what):
    if isinstance(fmt, str):
        if fmt in _STORAGE:
            return fmt
        raise ArgumentError("%s: expected one of %s, got %r" % (what, ", ".join(FORMATS), fmt))
    try:
        name = format_of(fmt)
    except TypeError:
        name = None
    if name is None or name == "bfloat16":
        # a bare uint16 dtype is ambiguous here; bfloat16 must be named
        raise ArgumentError("%s: expected one of %s (or np.float32 / np.float16), got %r"
                            % (what, ", ".join(FORMATS), fmt))
    return name


def cast(x, dtype, *, scale=1.0, out=None, accumulate=False, nonfinite=None):
    """Cast ``x`` to format ``dtype``, multiplying by ``scale``.

    x: C-contiguous numpy or cupy array of float32, float16 or uint16
        (bfloat16 bits), any shape.
    dtype: ``"float32"``, ``"float16"`` or ``"bfloat16"`` (or np.float32 /
        np.float16).
    scale: real number, rounded to float32 (must be finite).
    out: optional C-contiguous array of the same kind (numpy/cupy), shape and
        device as ``x`` with the storage dtype of ``dtype``; required when
        ``accumulate``. It may be ``x`` itself, no other overlap is allowed.
    accumulate: compute ``out = out + scale * x`` instead of ``out = scale * x``.
    nonfinite: optional 0-d int64 array of the same kind as ``x``; the count
        is added to it and it is returned (lets callers sum counts across
        calls without a device sync).

    Returns ``(out, nonfinite)``: ``nonfinite`` is a 0-d int64 array (on the
    device for cupy inputs, no host synchronisation) holding the number of
    non-finite values written. See the module docstring for exact semantics.
    """
    dst_fmt = _format_name(dtype, "dtype")
    src_fmt = _check_float_array(x, "x")
    gpu = is_cupy(x)
    scale32 = check_scale(scale)
    out = _output(x, out, dst_fmt, gpu, accumulate)
    nonfinite = check_counter(nonfinite, gpu)
    if gpu:
        return _cast_on_device(x, out, src_fmt, dst_fmt, scale32, accumulate, nonfinite)
    count = numpy_cast_into(x, out, scale32, accumulate)
    if nonfinite is None:
        return out, np.array(count, dtype=np.int64)
    nonfinite += count
    return out, nonfinite


def _output(x, out, dst_fmt, gpu, accumulate):
    """``out`` checked against ``x`` and format ``dst_fmt``, or a new array
    (on ``x``'s device) when it is None."""
    if out is None:
        if accumulate:
            raise ArgumentError("accumulate=True needs out= (the array to add into)")
        if gpu:
            with x.device:
                return _xp(gpu).empty(x.shape, dtype=_STORAGE[dst_fmt])
        return np.empty(x.shape, dtype=_STORAGE[dst_fmt])
    _check_same_kind(out, "out", gpu)
    if out.dtype != _STORAGE[dst_fmt]:
        raise ArrayTypeError("out: expected dtype %s for %s, got %s"
                             % (_STORAGE[dst_fmt], dst_fmt, out.dtype))
    if out.shape != x.shape:
        raise ArgumentError("out: expected shape %s (the shape of x), got %s"
                            % (x.shape, out.shape))
    if not out.flags.c_contiguous:
        raise ArrayTypeError("out: expected a C-contiguous array")
    return out


def _cast_on_device(x, out, src_fmt, dst_fmt, scale32, accumulate, nonfinite):
    """The cupy path of :func:`cast`: ``(out, counter)``, the counter
    ``nonfinite`` itself or a new zeroed one on ``x``'s device."""
    _check_device(x, out)
    if nonfinite is not None and nonfinite.device.id != x.device.id:
        raise ArrayTypeError("nonfinite: expected an array on device %d (where x is), got "
                             "device %d" % (x.device.id, nonfinite.device.id))
    with x.device:
        if nonfinite is not None:
            counter = nonfinite
        else:
            from . import _launch
            counter = _xp(True).empty((), np.int64)
            _launch.memset0(counter)  # no fill kernel
        if x.size:
            _cast_cuda(x, out, src_fmt, dst_fmt, scale32, accumulate, counter)
    return out, counter


# ---------------------------------------------------------------- checks

def _xp(gpu):
    if gpu:
        import cupy
        return cupy
    return np


def _check_float_array(a, what):
    if not (isinstance(a, np.ndarray) or is_cupy(a)):
        raise ArrayTypeError("%s: expected a numpy or cupy array, got %s"
                             % (what, type(a).__name__))
    fmt = format_of(a.dtype)
    if fmt is None:
        raise ArrayTypeError("%s: expected dtype float32, float16 or uint16 (bfloat16 "
                             "bits), got %s" % (what, a.dtype))
    if not a.flags.c_contiguous:
        raise ArrayTypeError("%s: expected a C-contiguous array" % what)
    return fmt


def _check_same_kind(a, what, gpu):
    if not (isinstance(a, np.ndarray) or is_cupy(a)):
        raise ArrayTypeError("%s: expected a numpy or cupy array, got %s"
                             % (what, type(a).__name__))
    if is_cupy(a) != gpu:
        raise ArrayTypeError("%s: expected a %s array like x, got a %s array"
                             % (what, "cupy" if gpu else "numpy",
                                "cupy" if is_cupy(a) else "numpy"))


def _check_device(x, out):
    if x.device.id != out.device.id:
        raise ArrayTypeError("out: expected an array on device %d (where x is), got "
                             "device %d" % (x.device.id, out.device.id))


def check_scale(scale):
    """``scale`` as np.float32; ArgumentError unless a finite real number."""
    if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, numbers.Real):
        raise ArgumentError("scale: expected a real number, got %r" % (scale,))
    s = np.float32(scale)
    if not np.isfinite(s):
        raise ArgumentError("scale: expected a finite float32 value, got %r" % (scale,))
    return s


def check_counter(counter, gpu, what="nonfinite"):
    """Validate an optional counter or flag: None or a 0-d int64 array of
    the right kind (cupy when ``gpu``); ``what`` names the argument in the
    message."""
    if counter is None:
        return None
    if not (isinstance(counter, np.ndarray) or is_cupy(counter)) or is_cupy(counter) != gpu:
        raise ArrayTypeError("%s: expected a 0-d int64 %s array, got %s"
                             % (what, "cupy" if gpu else "numpy", type(counter).__name__))
    if counter.shape != () or counter.dtype != np.int64:
        raise ArrayTypeError("%s: expected a 0-d int64 array, got shape %s dtype %s"
                             % (what, counter.shape, counter.dtype))
    return counter


# ---------------------------------------------------------------- numpy twin

def numpy_cast_into(x, out, scale=np.float32(1), accumulate=False):
    """Numpy twin of the cast kernels: write ``x`` (scaled, cast, optionally
    added to ``out``) into ``out``; returns the non-finite count (int).

    ``x`` and ``out``: C-contiguous numpy arrays of the same size whose dtypes
    are float32, float16 or uint16 (bfloat16). ``scale``: np.float32.
    """
    src_fmt, dst_fmt = format_of(x.dtype), format_of(out.dtype)
    xf, of = x.reshape(-1), out.reshape(-1)
    scale = np.float32(scale)
    count = 0
    with np.errstate(over="ignore", invalid="ignore"):   # counted, not warned
        for lo in range(0, xf.size, _CHUNK):
            o = of[lo:lo + _CHUNK]
            v = _widen(xf[lo:lo + _CHUNK], src_fmt)
            if scale != 1:
                v = np.multiply(v, scale)
            if accumulate:
                v = np.add(_widen(o, dst_fmt), v)
            count += _narrow_into(v, o, dst_fmt)
    return count


def _widen(a, fmt):
    """float32 values of ``a`` (``a`` itself for float32)."""
    if fmt == "float32":
        return a
    if fmt == "float16":
        return a.astype(np.float32)
    return np.left_shift(a, 16, dtype=np.uint32).view(np.float32)


def _narrow_into(v, o, fmt):
    """Round float32 ``v`` into ``o`` (format ``fmt``); canonical NaNs;
    returns the number of non-finite values written."""
    if fmt == "float32":
        np.copyto(o, v)
        count = o.size - int(np.count_nonzero(np.isfinite(o)))
        if count:
            o.view(np.uint32)[np.isnan(o)] = 0x7FC00000
        return count
    if fmt == "float16":
        np.copyto(o, v, casting="unsafe")
        bits = o.view(np.uint16)
        count = int(np.count_nonzero((bits & 0x7C00) == 0x7C00))
        if count:
            bits[(bits & 0x7FFF) > 0x7C00] = 0x7E00
        return count
    u = v.view(np.uint32)
    r = np.right_shift(u, 16)
    r &= 1
    r += 0x7FFF
    r += u                      # NaN lanes may wrap; they are rewritten below
    r >>= 16
    np.copyto(o, r, casting="unsafe")
    mag = u & 0x7FFFFFFF
    count = int(np.count_nonzero(mag >= _BF16_OVERFLOW))
    if count:
        o[mag > 0x7F800000] = 0x7FC0
    return count


# ---------------------------------------------------------------- CUDA path

def cast_kernel_name(src_fmt, dst_fmt, accumulate):
    """Name of the kernel in kernels/cast.cu for this conversion."""
    return "cast_%s_%s%s" % (FORMAT_CODES[src_fmt], FORMAT_CODES[dst_fmt],
                             "_acc" if accumulate else "")


CAST_THREADS = 256

KERNEL_NAMES = tuple(cast_kernel_name(s, d, acc) for s in FORMATS for d in FORMATS
                     for acc in (False, True))


def cast_items_per_thread(src_fmt, dst_fmt):
    """Elements one thread handles per 16-byte vector step."""
    return 16 // min(_STORAGE[src_fmt].itemsize, _STORAGE[dst_fmt].itemsize)


def _cast_cuda(x, out, src_fmt, dst_fmt, scale32, accumulate, counter):
    from . import _launch, _loader
    kernel, grid, block, n64 = _launch.plan(
        ("cast", x.device.id, src_fmt, dst_fmt, accumulate, x.size, _loader.get_function),
        lambda: _cast_plan(x.size, src_fmt, dst_fmt, accumulate))
    kernel(grid, block, (x, out, n64, scale32, counter))


def _cast_plan(n, src_fmt, dst_fmt, accumulate):
    """(kernel, grid, block, n) of one cast shape (current device)."""
    from ._loader import get_function, launch_config
    kernel = get_function("cast.cu", cast_kernel_name(src_fmt, dst_fmt, accumulate))
    grid, block = launch_config(n, kernel, CAST_THREADS, cast_items_per_thread(src_fmt, dst_fmt))
    return kernel, grid, block, np.int64(n)


def copy_mode(dtypes, bucket_dtype, scale=None, accumulate=False, counting=False):
    """How arrays of ``dtypes`` are copied into (or out of) a bucket of
    ``bucket_dtype``: ``"raw"`` (same dtype, no scale, nothing counted),
    ``"cast"`` (every dtype a cast format) or ``"generic"`` (see
    :mod:`commlib.ops.pack`)."""
    bucket_dtype = np.dtype(bucket_dtype)
    dtypes = [np.dtype(d) for d in dtypes]
    if scale is None and not accumulate and not counting \
            and all(d == bucket_dtype for d in dtypes):
        return "raw"
    if format_of(bucket_dtype) is not None and all(format_of(d) is not None for d in dtypes):
        return "cast"
    return "generic"
