"""The compiled host loops: ``commlib/native/*.c``, built by the package
build into the extension module ``commlib._hostloops`` (``pip install .``;
in a source checkout ``pip install -e .`` builds it in place).

:func:`module` returns the extension, or None when it is turned off
(``COMMLIB_NATIVE=0``) or was not built (no C compiler when commlib was
installed): callers then take their numpy path, which gives the same
results more slowly. A missing build is said once, as a RuntimeWarning.
"""
import glob
import os
import sys
import threading
import warnings

from .. import settings
from ..errors import ArrayTypeError
from ..settings import launcher_rank

_lock = threading.Lock()
_lib = None           # the loaded module, False once loading failed
_reason = None        # why it is unavailable


def module():
    """The extension module, or None."""
    global _lib, _reason
    if _lib is None:
        with _lock:
            if _lib is None:
                _lib, _reason = _load()
                if (_lib is False and _reason.startswith("commlib: the compiled")
                        and launcher_rank() in (None, "0")):   # once per job
                    warnings.warn_explicit(_reason, RuntimeWarning, "commlib", 0,
                                           module="commlib")
    return _lib or None


def shadowed_build(package_dir=None, path=None):
    """The folder of another commlib on ``path`` (default ``sys.path``)
    that has the compiled host loops, when this one (``package_dir``) has
    none: a source checkout run from its own folder shadows the copy
    ``pip install .`` built. None when there is no such folder."""
    here = os.path.realpath(package_dir or os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))))
    for entry in sys.path if path is None else path:
        other = os.path.realpath(os.path.join(entry or os.getcwd(), "commlib"))
        if other != here and glob.glob(os.path.join(other, "_hostloops*")):
            return other
    return None


def _load():
    """(module or False, reason or None)."""
    if not settings.flag(settings.NATIVE, True):
        return False, "commlib: %s=0" % settings.NATIVE
    try:
        from .. import _hostloops
    except ImportError as exc:
        here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        other = shadowed_build(here)
        if other is not None:
            return False, (
                "commlib: the compiled host loops are not built in %s, the commlib this "
                "process imports (a source checkout, found first because the script runs "
                "from it); the installed commlib in %s has them, but is shadowed. numpy "
                "does their work, more slowly. Fix: pip install -e . in the checkout, or "
                "run from another folder" % (here, other))
        return False, ("commlib: the compiled host loops are not built (%s); numpy does their "
                       "work, more slowly. Reinstall commlib where a C compiler is available "
                       "(pip install ., or pip install -e . in a source checkout)" % exc)
    _hostloops.init(ArrayTypeError)
    return _hostloops, None


def available():
    """Whether the compiled loops can be used."""
    return module() is not None


def unavailable_reason():
    """Why :func:`available` is False, or None."""
    module()
    return _reason
