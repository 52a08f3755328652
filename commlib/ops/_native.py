"""The compiled host loops: ``commlib/native/*.c``, built by the package
build into the extension module ``commlib._hostloops`` (``pip install .``;
in a source checkout ``pip install -e .`` builds it in place).

:func:`module` returns the extension, or None when it is turned off
(``COMMLIB_NATIVE=0``) or was not built (no C compiler when commlib was
installed): callers then take their numpy path, which gives the same
results more slowly. A missing build is said once, as a RuntimeWarning.
"""
import threading
import warnings

from .. import settings
from ..errors import ArrayTypeError

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
                if _lib is False and _reason.startswith("commlib: the compiled"):
                    warnings.warn(_reason, RuntimeWarning, stacklevel=3)
    return _lib or None


def _load():
    """(module or False, reason or None)."""
    if not settings.flag(settings.NATIVE, True):
        return False, "commlib: %s=0" % settings.NATIVE
    try:
        from .. import _hostloops
    except ImportError as exc:
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
