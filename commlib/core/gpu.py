"""Whether cupy and a CUDA device are usable, without failing on import."""
import functools


@functools.lru_cache(maxsize=None)
def unavailable_reason():
    """None when cupy imports and sees at least one GPU, else why not."""
    try:
        import cupy
    except Exception as exc:  # ImportError, or a broken CUDA install
        return "cupy is not importable (%s)" % exc
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:
        return "CUDA runtime error (%s)" % exc
    if count < 1:
        return "no CUDA device visible"
    return None


def nccl_module():
    """``cupy.cuda.nccl``, or BackendUnavailableError saying why it is not usable."""
    reason = nccl_unavailable_reason()
    if reason is not None:
        from ..errors import BackendUnavailableError
        raise BackendUnavailableError("commlib: NCCL is not usable here: " + reason)
    from cupy.cuda import nccl
    return nccl


def available():
    """True when cupy and a CUDA GPU can be used."""
    return unavailable_reason() is None


@functools.lru_cache(maxsize=None)
def nccl_unavailable_reason():
    """None when cupy's NCCL bindings are usable, else why not."""
    reason = unavailable_reason()
    if reason is not None:
        return reason
    try:
        from cupy.cuda import nccl
    except Exception as exc:
        return "cupy.cuda.nccl is not importable (%s)" % exc
    if not getattr(nccl, "available", True):
        return "cupy was built without NCCL"
    return None
