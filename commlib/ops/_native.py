"""The compiled host loops: ``commlib/native/*.c`` built on first use into
one CPython extension module, ``commlib_native``, and imported from there.

The sources are compiled with the system C compiler (``$CC``, else ``cc``,
else ``gcc``) and the Python headers into a per-user cache
(``$COMMLIB_CACHE_DIR``, else ``$XDG_CACHE_HOME/commlib``, else
``~/.cache/commlib``, else a folder under the temporary directory), named by
a digest of the sources, compiler and Python, so an edit recompiles. Without
a compiler or headers :func:`module` returns None and callers keep their
numpy path; ``COMMLIB_NATIVE=0`` turns it off too.
"""
import hashlib
import importlib.machinery
import importlib.util
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

from .. import settings
from ..errors import ArrayTypeError, BackendUnavailableError

SOURCES = Path(__file__).resolve().parent.parent / "native"
#: no -ffast-math and no contraction into FMA: results match numpy's bit for bit
CFLAGS = ["-O3", "-ffp-contract=off", "-shared", "-fPIC"]
MODULE = "commlib_native"

_lock = threading.Lock()
_lib = None           # the loaded module, False once loading failed
_reason = None        # why it is unavailable


def _cache_dirs():
    override = os.environ.get(settings.CACHE_DIR)
    if override:
        return [Path(override)]
    xdg = os.environ.get("XDG_CACHE_HOME")
    home = (Path(xdg) if xdg else Path.home() / ".cache") / "commlib"
    return [home, Path(tempfile.gettempdir()) / ("commlib-%d" % os.getuid())]


def _compiler():
    for name in (os.environ.get("CC"), "cc", "gcc"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _build(compiler):
    """Path of the shared library, compiled if not cached."""
    include = sysconfig.get_paths()["include"]
    sources = sorted(SOURCES.glob("*.c"))
    digest = hashlib.sha1()
    for path in sorted(SOURCES.glob("*.[ch]")):
        digest.update(path.name.encode() + path.read_bytes())
    digest.update((compiler + include + sys.version + " ".join(CFLAGS)).encode())
    name = "native-%s-%s%s" % (platform.machine(), digest.hexdigest()[:16],
                               importlib.machinery.EXTENSION_SUFFIXES[0])
    for folder in _cache_dirs():
        target = folder / name
        if target.is_file():
            return target
        try:
            folder.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=".tmp", dir=folder)
            os.close(fd)
        except OSError:
            continue
        try:
            proc = subprocess.run([compiler, *CFLAGS, "-I", include, "-I", str(SOURCES),
                                   "-o", tmp, *map(str, sources)],
                                  capture_output=True, text=True, timeout=120)
            if proc.returncode != 0:
                raise BackendUnavailableError("commlib: compiling %s failed:\n%s"
                                              % (SOURCES, proc.stderr))
            os.replace(tmp, target)   # atomic: concurrent ranks may build at once
            return target
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    raise BackendUnavailableError("commlib: no writable cache directory for %s" % name)


def _import(path):
    spec = importlib.util.spec_from_file_location(MODULE, str(path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.init(np.ndarray, ArrayTypeError)
    return module


def module():
    """The extension module (compiled on first call), or None."""
    global _lib, _reason
    if _lib is None:
        with _lock:
            if _lib is None:
                try:
                    if not settings.flag(settings.NATIVE, True):
                        raise BackendUnavailableError("commlib: %s=0" % settings.NATIVE)
                    compiler = _compiler()
                    if compiler is None:
                        raise BackendUnavailableError("commlib: no C compiler (cc, gcc)")
                    _lib = _import(_build(compiler))
                except (OSError, ImportError, subprocess.SubprocessError,
                        BackendUnavailableError) as exc:
                    _reason = str(exc)
                    _lib = False
    return _lib or None


def available():
    """Whether the compiled loops can be used (compiles them on first call)."""
    return module() is not None


def unavailable_reason():
    """Why :func:`available` is False, or None."""
    module()
    return _reason
