"""Half-precision all-reduce (SINGA's fused half-precision synchronisation,
Horovod's ``Compression.fp16``, PyTorch DDP's ``fp16_compress_hook`` and
``bf16_compress_hook``).

A bucket of float32 arrays is cast to float16 or bfloat16 into one flat
wire buffer (the batched pack kernel on GPUs, its numpy twin on CPUs),
all-reduced in that format, and cast back into the arrays: half the bytes on
the wire. When averaging, values are divided by the number of ranks
*before* the cast, so the half-precision sum cannot overflow where the
average does not. The reduction itself runs in the half format (as NCCL's
does), so results carry its rounding (relative error about 2**-11 per
addition for float16, 2**-8 for bfloat16); a float16 value beyond 65504
becomes inf (bfloat16 has float32's range). bfloat16 travels as uint16 bit
patterns, reduced by NCCL's bfloat16 type or an MPI operator that widens to
float32 and rounds back to nearest even. Other dtypes are not compressed.
"""
import numpy as np

from ..errors import ArgumentError
from ..ops import pack as _pack
from ..ops._arrays import array_module
from ..ops.cast import numpy_cast_into, storage_dtype
from . import _flat
from .base import Compression


class HalfPrecision(Compression):
    """float32 buckets travel as ``fmt``: ``"float16"`` or ``"bfloat16"``."""

    def __init__(self, fmt):
        if fmt not in ("float16", "bfloat16"):
            raise ArgumentError("HalfPrecision: fmt must be 'float16' or 'bfloat16', got %r"
                                % (fmt,))
        self.fmt = fmt
        self.name = {"float16": "fp16", "bfloat16": "bf16"}[fmt]
        # the wire buffer's dtype, and the format the transport must be told
        self._storage = storage_dtype(fmt)
        self._wire_fmt = fmt if fmt == "bfloat16" else None

    def applies_to(self, dtype):
        return dtype == np.float32

    def reduce(self, transport, arrays, op, scale, deadline, workspace):
        # a scale comes only with "sum" (averaging): dividing before the cast
        # keeps the half-precision sum from overflowing
        xp = array_module(arrays[0])
        size = sum(a.size for a in arrays)
        wire = _flat.buffer(workspace, "wire", xp, size, self._storage)
        if xp is not np:             # one pack / unpack launch, casting on the way
            _pack.pack(arrays, wire, scale=scale)
            transport.all_reduce(wire, op, deadline, fmt=self._wire_fmt)
            _pack.unpack(wire, arrays)
            return
        # numpy: gather into float32, then cast whole buffers (the kernels' twin)
        flat = _flat.gather(arrays, workspace)
        numpy_cast_into(flat, wire, np.float32(1) if scale is None else np.float32(scale))
        transport.all_reduce(wire, op, deadline, fmt=self._wire_fmt)
        numpy_cast_into(wire, flat)
        _flat.scatter(flat, arrays)


class FP16(HalfPrecision):
    """float32 buckets travel as float16."""

    def __init__(self):
        super().__init__("float16")


class BF16(HalfPrecision):
    """float32 buckets travel as bfloat16."""

    def __init__(self):
        super().__init__("bfloat16")
