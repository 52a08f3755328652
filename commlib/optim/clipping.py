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


def clip_by_global_norm(grads, clip, comm, meter):
    """Scale ``grads`` in place by ``clip / (norm + 1e-6)`` when their
    global norm exceeds ``clip``. The squared norm is summed here (BLAS dot
    products, float64 only where float32 overflows), then its maximum over
    the ranks is taken (one 8-byte all-reduce on ``comm``, timed by
    ``meter``), so that every rank scales alike even where ranks' BLAS
    libraries round differently.

    Returns:
        The norm before clipping (a float).
    """
    total = 0.0
    for g in grads:
        xp = array_module(g)
        flat = g.reshape(-1)
        if flat.dtype.itemsize < 4:
            flat = flat.astype(xp.float32)
        part = float(xp.dot(flat, flat))
        if math.isinf(part) and flat.dtype != xp.float64:
            wide = flat.astype(xp.float64)
            part = float(xp.dot(wide, wide))
        total += part
    total = np.array([total], np.float64)
    meter.timed(comm.all_reduce, total, "max")
    norm = math.sqrt(float(total[0]))
    coef = clip / (norm + 1e-6)
    if coef < 1:
        for g in grads:
            g *= coef
    return norm
