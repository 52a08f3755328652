"""Clipping the averaged gradients by their global L2 norm (as
``torch.nn.utils.clip_grad_norm_``), the same on every rank."""
import math

import numpy as np

from ..ops.arrays import array_module
from .rules import check_number


def check_clip(clip_norm, rank):
    """None, or ``clip_norm`` as a float (ArgumentError unless a finite
    number >= 0)."""
    if clip_norm is None:
        return None
    return check_number(clip_norm, "clip_norm", rank=rank)


#: a float32 squared norm at least this large lost nothing to underflow
FLOAT32_SAFE = 1e-30


def multiply(arrays, factor):
    """Multiply each of ``arrays`` in place by the float ``factor``,
    computed in float32 for narrower dtypes (float16, bfloat16), whose own
    arithmetic would round a small factor (a loss scale's inverse, a
    clipping coefficient) to 0 or to a few bits."""
    for g in arrays:
        if g.dtype.itemsize < 4:
            wide = g.astype(array_module(g).float32)
            wide *= factor
            g[...] = wide
        else:
            g *= factor


def squared_norm(g):
    """The squared L2 norm of array ``g`` (a float): a BLAS dot product in
    ``g``'s dtype (float32 for narrower ones), again in float64 when that
    one overflowed to inf or came out below :data:`FLOAT32_SAFE` (where
    float32 squares underflow: tiny gradients would count as 0)."""
    xp = array_module(g)
    flat = g.reshape(-1)
    if flat.dtype.itemsize < 4:
        flat = flat.astype(xp.float32)
    with np.errstate(over="ignore", under="ignore"):      # handled below
        part = float(xp.dot(flat, flat))
    if flat.dtype != xp.float64 and not FLOAT32_SAFE <= part < math.inf:
        wide = flat.astype(xp.float64)
        part = float(xp.dot(wide, wide))
    return part


def clip_by_global_norm(grads, clip, comm, meter, agree=None):
    """Scale ``grads`` in place by ``clip / (norm + 1e-6)`` when their
    global norm exceeds ``clip``. The squared norm is summed here
    (:func:`squared_norm`: float32 gradients whose squares overflow or
    underflow are summed in float64), then its maximum over the ranks is
    taken (one 8-byte all-reduce on ``comm``, timed by ``meter``, carrying
    ``agree``), so that every rank scales alike even where ranks' BLAS
    libraries round differently.

    Returns:
        The norm before clipping (a float).
    """
    total = np.array([sum(squared_norm(g) for g in grads)], np.float64)
    meter.timed(lambda: comm.all_reduce(total, "max", agree=agree))
    norm = math.sqrt(float(total[0]))
    coef = clip / (norm + 1e-6)
    if coef < 1:
        multiply(grads, coef)
    return norm
