"""A bucket of arrays as one flat vector, for the compression strategies,
and the buffers they keep between calls."""
import numpy as np

from ..ops import hostcopy
from ..ops._arrays import array_module


def buffer(workspace, name, xp, size, dtype, zero=False):
    """``workspace[name]``: a 1-D array of ``size`` ``dtype`` elements
    (zero-filled when first made, if ``zero``), kept between calls."""
    found = workspace.get(name)
    if found is None or found.size != size or array_module(found) is not xp:
        found = workspace[name] = (xp.zeros if zero else xp.empty)(size, dtype=dtype)
    return found


def gather(arrays, workspace):
    """The bucket as one float32 vector: the single array's flat view, or
    its arrays copied back to back into ``workspace["flat"]``."""
    if len(arrays) == 1:
        return arrays[0].reshape(-1)
    xp = array_module(arrays[0])
    flat = buffer(workspace, "flat", xp, sum(a.size for a in arrays), np.float32)
    hostcopy.gather_any(arrays, flat)
    return flat


def scatter(flat, arrays):
    """Copy ``flat`` back into the arrays (nothing to do for a single array,
    whose flat view it is)."""
    if len(arrays) > 1:
        hostcopy.scatter_any(flat, arrays)


def describe(size, count):
    """``"a bucket of <size> float32 values (<count> arrays)"``, for messages."""
    return "a bucket of %d float32 values (%d array%s)" % (size, count,
                                                            "" if count == 1 else "s")
