"""Half-precision all-reduce (SINGA's fused half-precision synchronisation,
Horovod's ``Compression.fp16``, PyTorch DDP's ``fp16_compress_hook``).

A bucket of float32 arrays is cast to float16 into one flat wire buffer
(the batched pack kernel on GPUs, its numpy twin on CPUs), all-reduced in
float16, and cast back into the arrays: half the bytes on the wire. When
averaging, values are divided by the number of ranks *before* the cast, so
the float16 sum cannot overflow where the average does not. The reduction
itself runs in float16 (as NCCL's does), so results carry float16 rounding
(relative error about 2**-11 per addition); a value beyond float16's range
(65504) becomes inf. Other dtypes are not compressed.
"""
import numpy as np

from ..ops import pack as _pack
from ..ops._arrays import array_module
from . import _flat
from .base import Compression


class FP16(Compression):
    """float32 buckets travel as float16."""

    name = "fp16"

    def applies_to(self, dtype):
        return dtype == np.float32

    def reduce(self, transport, arrays, op, scale, deadline, workspace):
        # a scale comes only with "sum" (averaging): dividing before the cast
        # keeps the float16 sum from overflowing
        xp = array_module(arrays[0])
        size = sum(a.size for a in arrays)
        wire = _flat.buffer(workspace, "wire", xp, size, np.float16)
        if xp is not np:             # one pack / unpack launch, casting on the way
            _pack.pack(arrays, wire, scale=scale)
            transport.all_reduce(wire, op, deadline)
            _pack.unpack(wire, arrays)
            return
        # numpy: gather into float32, scale and cast with whole-buffer numpy calls
        flat = _flat.gather(arrays, workspace)
        if scale is not None:
            np.multiply(flat, np.float32(scale), out=wire)
        else:
            wire[...] = flat
        transport.all_reduce(wire, op, deadline)
        flat[...] = wire
        _flat.scatter(flat, arrays)
