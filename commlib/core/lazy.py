"""A package's public names imported on first use (PEP 562).

``import commlib`` and ``import commlib.launch`` stay cheap: a rank's
supervisor needs neither numpy nor the collectives, and a rank does not load
the launcher.
"""
import importlib
import importlib.util
import sys


def public_names(package, where, submodules=False):
    """``(__getattr__, __dir__)`` for the package named ``package``, whose
    public names are those of ``where`` (name -> the module that defines it,
    relative to the package: ``".errors"``, ``"..settings"``). A name is
    imported from its module on first use and kept in the package's
    namespace. With ``submodules``, any other name that is a module of the
    package (``commlib.overlap``) is imported as one; every other name
    raises AttributeError."""

    def __getattr__(name):
        module = where.get(name)
        if module is None:
            if not submodules or name.startswith("__") or \
                    importlib.util.find_spec("%s.%s" % (package, name)) is None:
                raise AttributeError("module %r has no attribute %r" % (package, name))
            module = "." + name
        found = importlib.import_module(module, package)
        value = found if module == "." + name else getattr(found, name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__():
        return sorted(set(vars(sys.modules[package])) | set(where))

    return __getattr__, __dir__
