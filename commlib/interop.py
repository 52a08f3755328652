"""Arrays of other frameworks (torch, JAX, anything that speaks DLPack).

Every collective and the :class:`~commlib.optim.DistributedOptimizer` work
on numpy and cupy arrays. Other arrays are turned into numpy or cupy *views*
of their memory where the arguments are normalised
(:func:`commlib.collective.validation.as_list`), so every collective runs its numpy or
cupy path unchanged on the caller's own memory.

The contract:

* **Accepted**: numpy and cupy arrays (passed through untouched), and any
  object with ``__dlpack__`` and ``__dlpack_device__`` (the array API's
  interchange protocol): torch tensors on the CPU and on CUDA, JAX arrays,
  and others. Objects without them are left to the usual check, which
  rejects them with :class:`~commlib.errors.ArrayTypeError`.
* **Views, never copies**: an array in host memory becomes a numpy view
  (``numpy.from_dlpack``), one on a CUDA GPU a cupy view
  (``cupy.from_dlpack``; cupy must be installed). In-place collectives
  (``all_reduce``, ``broadcast``, ``reduce``) therefore leave their result
  in the caller's tensors; nothing is copied back. For torch, with a numpy
  older than 2.1 (whose ``from_dlpack`` gives read-only arrays) the view is
  ``tensor.numpy()``, which shares the tensor's memory the same way. The
  view of a torch tensor is kept (weakly: it never keeps the tensor alive)
  and given again while the tensor's storage, shape, strides and dtype are
  the same, so a training loop that passes the same tensors at every step
  gets the fusion plans cached for them, as with numpy arrays.
* **Immutable arrays (JAX)**: an in-place collective cannot write into a
  JAX array, and raises :class:`~commlib.errors.ArrayTypeError` on the rank
  that passed it (on every rank with the consistency check on), naming the
  argument and the fix; copying would silently leave the caller's array
  unchanged. Where nothing is written into the array (``all_gather``,
  ``reduce_scatter``, ``all_gatherv``, the ``root`` of ``broadcast``, the
  other ranks of ``reduce``) it is read through a read-only view. An array
  whose producer marks its DLPack export read-only is treated alike, by the
  usual writeability check.
* **Results that are new arrays** (``all_gather``, ``reduce_scatter``,
  ``all_gatherv``'s values) come back as the input's framework's type
  (:func:`like`): a torch tensor (``torch.from_dlpack``, no copy, on the
  input's device), a JAX array (through the array's
  ``__array_namespace__``), numpy/cupy otherwise. ``all_gatherv``'s counts
  stay an int64 numpy array.
* **Layout**: a non-contiguous tensor (``t.T``, ``t[:, ::2]``) is viewed
  as it is; in-place collectives then reject it like a non-contiguous numpy
  array (call ``.contiguous()`` and use that tensor), the out-of-place ones
  read it.
* **torch specifics**: a tensor that ``requires_grad`` is used through
  ``tensor.detach()`` (the same memory), as ``torch.no_grad()`` in-place
  updates are; the collective writes behind autograd's back (the version
  counter does not change), so do not reduce a tensor a pending backward
  pass still needs. An inference tensor (made under
  ``torch.inference_mode()``) is rejected by in-place collectives outside
  inference mode, as torch itself rejects in-place updates of it. bfloat16
  tensors on the CPU are viewed as ``ml_dtypes.bfloat16`` numpy arrays
  (through their int16 bit patterns; ``ml_dtypes`` must be installed);
  cupy has no bfloat16, so CUDA bfloat16 tensors are rejected. Tensors
  with the conjugate or negative bit set, sparse tensors and other exports
  DLPack refuses raise ArrayTypeError with the producer's reason.
* **Streams (CUDA)**: ``cupy.from_dlpack`` makes cupy's current stream wait
  for the producer's (torch's current stream); the collective then runs as
  for cupy arrays. torch's and cupy's default streams are both the legacy
  default stream, so work torch queues after the call follows it; with
  streams of one's own, synchronise as with cupy arrays.
"""
import sys
import weakref

import numpy as np

from .errors import ArrayTypeError, BackendUnavailableError
from .ops.arrays import is_cupy

#: DLPack device types (``__dlpack_device__()[0]``) read by numpy and by cupy
HOST_DEVICES = (1, 3)           # kDLCPU, kDLCUDAHost
CUDA_DEVICES = (2, 13)          # kDLCUDA, kDLCUDAManaged

_NUMPY_VERSIONED = tuple(int(p) for p in np.__version__.split(".")[:2]) >= (2, 1)

# id(tensor) -> (weak reference to it, its signature, its view)
_views = {}


def is_native(a):
    """True for a numpy or cupy array, which needs no conversion."""
    return isinstance(a, np.ndarray) or (is_cupy(a) and hasattr(a, "data"))


def is_foreign(a):
    """True for an array of another framework that speaks DLPack."""
    return (not is_native(a) and callable(getattr(a, "__dlpack__", None))
            and callable(getattr(a, "__dlpack_device__", None)))


def on_gpu(a):
    """True for a cupy array or another framework's array on a CUDA GPU."""
    if is_cupy(a):
        return True
    return is_foreign(a) and _device_type(a) in CUDA_DEVICES


def native_list(items, *, rank=None, what="arrays", writeable=False):
    """``items`` (a list) with every foreign array replaced by its numpy or
    cupy view; the list itself when there is none (the common case costs
    one pass over the types). ``writeable``: the collective writes into
    the arrays (immutable ones raise)."""
    if all(map(_native_type, set(map(type, items)))):
        return items
    return [a if is_native(a) else native(a, rank=rank, what="%s[%d]" % (what, i),
                                          writeable=writeable)
            for i, a in enumerate(items)]


def native(a, *, rank=None, what="array", writeable=False):
    """The numpy or cupy view of ``a`` (``a`` itself when it is numpy or
    cupy, or speaks no DLPack: the usual checks then name it); see the
    module's docstring. Raises ArrayTypeError, naming ``what`` and
    ``rank``, for an array that cannot be viewed, or written when
    ``writeable``."""
    if not is_foreign(a):
        return a
    where = "%s%s (%s)" % ("" if rank is None else "rank %d: " % rank, what, _type_name(a))
    if _immutable(a):
        if writeable:
            raise ArrayTypeError(
                "%s is immutable, and this collective writes its result into its arrays in "
                "place; pass a writeable copy (numpy.array(x)) and convert the result back "
                "(jax.numpy.asarray), or use all_gather / reduce_scatter, which return new "
                "arrays" % where)
    elif writeable and _inference_tensor(a):
        raise ArrayTypeError(
            "%s is a torch inference tensor, which torch lets nothing update in place "
            "outside torch.inference_mode(); the collective writes its result into it. "
            "Make it outside inference mode (or clone() it) and pass that tensor" % where)
    signature = _signature(a)
    if signature is not None:
        found = _views.get(id(a))
        if found is not None and found[0]() is a and found[1] == signature:
            return found[2]
    source = a
    if getattr(a, "requires_grad", False) is True and callable(getattr(a, "detach", None)):
        source = a.detach()
    view = _view(source, where)
    if _immutable(a) and isinstance(view, np.ndarray):
        view.flags.writeable = False
    if signature is not None:
        key = id(a)
        _views[key] = (weakref.ref(a, lambda _, key=key: _views.pop(key, None)), signature, view)
    return view


def like(template, result):
    """``result`` (a new numpy or cupy array a collective made from
    ``template``) as ``template``'s framework's array: a torch tensor, or
    through ``template.__array_namespace__()`` (JAX); ``result`` itself
    for numpy and cupy templates and for other objects."""
    if not is_foreign(template):
        return result
    torch = _torch_of(template)
    if torch is not None:
        if result.dtype.name == "bfloat16":
            return torch.from_dlpack(result.view(np.int16)).view(torch.bfloat16)
        return torch.from_dlpack(result)
    space = getattr(template, "__array_namespace__", None)
    if space is None:
        return result
    xp = space()
    try:
        return xp.from_dlpack(result)
    except (AttributeError, BufferError, RuntimeError, TypeError, ValueError):
        return xp.asarray(result.get() if is_cupy(result) else result)


def dtype_name(a):
    """The name numpy gives ``a``'s dtype (``"float32"``) for any array
    (``torch.float32`` -> ``"float32"``); None without a dtype."""
    dtype = getattr(a, "dtype", None)
    return None if dtype is None else str(dtype).rpartition(".")[2]


# -- helpers ---------------------------------------------------------------------
def _native_type(t):
    return issubclass(t, np.ndarray) or t.__module__.split(".")[0] == "cupy"


def _type_name(a):
    t = type(a)
    module = t.__module__.split(".")[0]
    if module in ("jax", "jaxlib"):
        return "jax.Array"
    return "%s.%s" % (module, t.__name__)


def _torch_of(a):
    """The torch module when ``a`` is a torch tensor, else None."""
    torch = sys.modules.get("torch")
    return torch if torch is not None and isinstance(a, torch.Tensor) else None


def _immutable(a):
    """Arrays whose framework forbids writing into them (JAX)."""
    jax = sys.modules.get("jax")
    return jax is not None and isinstance(a, getattr(jax, "Array", ()))


def _inference_tensor(a):
    torch = _torch_of(a)
    return (torch is not None and a.is_inference()
            and not torch.is_inference_mode_enabled())


def _signature(a):
    """What identifies a torch tensor's memory and layout (None for other
    arrays, whose views are not kept)."""
    if _torch_of(a) is None:
        return None
    return (a.data_ptr(), tuple(a.shape), a.stride(), a.dtype, a.device)


def _device_type(a):
    try:
        return int(a.__dlpack_device__()[0])
    except Exception:           # a producer's own failure: no known device
        return None


def _view(a, where):
    """numpy.from_dlpack or cupy.from_dlpack of ``a``."""
    device = _device_type(a)
    bfloat16 = dtype_name(a) == "bfloat16"
    torch = _torch_of(a)
    try:
        if device in HOST_DEVICES:
            if bfloat16 and torch is not None:
                return np.from_dlpack(a.view(torch.int16)).view(_ml_bfloat16(where))
            if bfloat16:
                return np.asarray(a)
            view = np.from_dlpack(a)
            if torch is not None and not view.flags.writeable and not _NUMPY_VERSIONED:
                view = a.numpy()
            return view
        if device in CUDA_DEVICES:
            if bfloat16:
                raise ArrayTypeError("%s: bfloat16 arrays on a GPU are not supported (cupy "
                                     "has no bfloat16); use float32, or float16" % where)
            try:
                import cupy
            except ImportError:
                raise BackendUnavailableError(
                    "%s is on a CUDA GPU, and commlib works on GPU arrays through cupy, "
                    "which is not installed (pip install 'commlib[cuda12]' or "
                    "'commlib[cuda13]')" % where) from None
            return cupy.from_dlpack(a)
    except (ArrayTypeError, BackendUnavailableError):
        raise
    except (BufferError, RuntimeError, TypeError, ValueError) as exc:
        raise ArrayTypeError("%s cannot be viewed through DLPack: %s" % (where, exc)) from None
    raise ArrayTypeError("%s is on DLPack device type %r; commlib takes arrays in host memory "
                         "(numpy views) and on CUDA GPUs (cupy views)" % (where, device))


def _ml_bfloat16(where):
    try:
        import ml_dtypes
    except ImportError:
        raise ArrayTypeError("%s: bfloat16 tensors need the ml_dtypes package (pip install "
                             "ml_dtypes), numpy's bfloat16" % where) from None
    return ml_dtypes.bfloat16
