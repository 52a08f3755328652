"""Batched host copies: many numpy arrays <-> one flat numpy buffer, in one
call from Python (a small C loop of ``memcpy``), instead of one numpy copy per
array.

The C code reads each array's data pointer, shape, dtype and flags at the
time of the call and checks them all (exact ``numpy.ndarray``, the expected
dtype, C-contiguous, writeable when written, total size within the flat
buffer) before copying anything; any mismatch copies nothing and returns
False, and the caller takes its numpy path.

The C source ``commlib/_hostcopy.c`` is compiled on first use with the
system C compiler (``$CC``, else ``cc``, else ``gcc``) and the Python headers
into a per-user cache (``$COMMLIB_CACHE_DIR``, else ``$XDG_CACHE_HOME/commlib``,
else ``~/.cache/commlib``) and loaded with ctypes. Without a compiler or
headers :func:`available` is False and callers keep their numpy path
(``COMMLIB_HOSTCOPY=0`` also turns it off).
"""
import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
from pathlib import Path

import numpy as np

from ..errors import ArrayTypeError, BackendUnavailableError
from ._arrays import address

_SOURCE = Path(__file__).resolve().parent.parent / "_hostcopy.c"
_lock = threading.Lock()
_lib = None           # the loaded library, False once loading failed
_reason = None        # why it is unavailable


def _cache_dir():
    override = os.environ.get("COMMLIB_CACHE_DIR")
    if override:
        return Path(override)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "commlib"


def _compiler():
    for name in (os.environ.get("CC"), "cc", "gcc"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _build(source, compiler):
    """Path of the shared library for ``source`` (bytes), compiled if not cached."""
    include = sysconfig.get_paths()["include"]
    digest = hashlib.sha1(source + compiler.encode() + include.encode()
                          + sys.version.encode()).hexdigest()[:16]
    name = "hostcopy-%s-%s.so" % (platform.machine(), digest)
    for folder in (_cache_dir(), Path(tempfile.gettempdir()) / ("commlib-%d" % os.getuid())):
        target = folder / name
        if target.is_file():
            return target
        try:
            folder.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=folder)
            os.close(fd)
        except OSError:
            continue
        try:
            src = Path(tmp).with_suffix(".c")
            src.write_bytes(source)
            proc = subprocess.run([compiler, "-O2", "-shared", "-fPIC", "-I", include,
                                   "-o", tmp, str(src)],
                                  capture_output=True, text=True, timeout=120)
            src.unlink()
            if proc.returncode != 0:
                raise BackendUnavailableError("commlib: compiling %s failed:\n%s"
                                              % (_SOURCE.name, proc.stderr))
            os.replace(tmp, target)   # atomic: concurrent ranks may build at once
            return target
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    raise BackendUnavailableError("commlib: no writable cache directory for %s" % name)


def _load():
    """The ctypes library, loaded (and compiled) once; None if unavailable."""
    global _lib, _reason
    if _lib is None:
        with _lock:
            if _lib is None:
                try:
                    if os.environ.get("COMMLIB_HOSTCOPY", "1") == "0":
                        raise BackendUnavailableError("commlib: COMMLIB_HOSTCOPY=0")
                    compiler = _compiler()
                    if compiler is None:
                        raise BackendUnavailableError("commlib: no C compiler (cc, gcc)")
                    lib = ctypes.PyDLL(str(_build(_SOURCE.read_bytes(), compiler)))
                    lib.commlib_copy.argtypes = [
                        ctypes.py_object, ctypes.py_object, ctypes.py_object,
                        ctypes.c_ssize_t, ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int]
                    lib.commlib_copy.restype = ctypes.c_ssize_t
                    _lib = lib
                except (OSError, subprocess.SubprocessError, BackendUnavailableError) as exc:
                    _reason = str(exc)
                    _lib = False
    return _lib or None


def available():
    """Whether the compiled copy loop can be used (compiles it on first call)."""
    return _load() is not None


def unavailable_reason():
    """Why :func:`available` is False, or None."""
    _load()
    return _reason


def _copy(lib, arrays, buf, to_arrays):
    if not arrays:
        return True
    if not isinstance(arrays[0], np.ndarray):
        return False
    dtype = arrays[0].dtype
    return lib.commlib_copy(arrays, np.ndarray, dtype, dtype.itemsize, address(buf),
                            buf.nbytes, to_arrays) >= 0


def _flat_buffer(buf, writeable):
    if not isinstance(buf, np.ndarray) or not buf.flags.c_contiguous:
        raise ArrayTypeError("commlib: the flat buffer must be a C-contiguous numpy array")
    if writeable and not buf.flags.writeable:
        raise ArrayTypeError("commlib: the flat buffer is read-only")
    lib = _load()
    if lib is None:
        raise BackendUnavailableError(_reason)
    return lib


def gather(arrays, out):
    """Copy ``arrays`` (a tuple or list of C-contiguous numpy arrays of one
    dtype) into ``out`` back to back, as ``np.concatenate(arrays, axis=None)``
    would. ``out``: writeable C-contiguous numpy array of at least their total
    bytes. Returns True, or False with nothing copied when an array does not
    qualify or they do not fit."""
    return _copy(_flat_buffer(out, True), arrays, out, 0)


def scatter(src, arrays):
    """The reverse of :func:`gather`: consecutive pieces of ``src`` go into
    the (writeable) arrays. Returns True, or False with nothing copied."""
    return _copy(_flat_buffer(src, False), arrays, src, 1)
