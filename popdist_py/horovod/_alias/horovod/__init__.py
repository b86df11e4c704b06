"""``import horovod`` under ``poprun --horovod``: Horovod's module paths, answered by popdist_py.

poprun puts this package's folder first on the program's PYTHONPATH. Imported as ``horovod``, it
looks for a Horovod installed anywhere else on ``sys.path`` and, when there is one, imports that
one in its place: a real Horovod is never hidden. Otherwise every ``horovod.X`` import (``horovod.torch``,
``horovod.torch.mpi_ops``, ``horovod.common.exceptions``, ...) is the module ``popdist_py.horovod.X``
itself, the same object, so the program and popdist_py share one state. Imported under any other
name (as a part of popdist_py) it does nothing.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from types import ModuleType

#: The version of Horovod whose API popdist_py.horovod follows.
__version__ = "0.28.1"

_PREFIX = "horovod."
_FOLDER = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class _Alias(importlib.abc.Loader):
    """Loads ``horovod.X`` as the module ``popdist_py.horovod.X``, keeping that module's own spec."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.module: ModuleType | None = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        self.module = importlib.import_module(self.target)
        return self.module

    def exec_module(self, module: ModuleType) -> None:
        target = sys.modules[self.target]
        module.__spec__ = getattr(target, "__spec__", None)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: object = None,
                  target: object = None) -> importlib.machinery.ModuleSpec | None:
        if not fullname.startswith(_PREFIX):
            return None
        name = "popdist_py.horovod." + fullname[len(_PREFIX):]
        try:
            found = importlib.util.find_spec(name)
        except ModuleNotFoundError:
            return None
        if found is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _Alias(name), is_package=found.submodule_search_locations
                                              is not None)


def _installed_horovod() -> importlib.machinery.ModuleSpec | None:
    """A Horovod on ``sys.path`` other than this one."""
    others = [p for p in sys.path if os.path.abspath(p or os.getcwd()) != _FOLDER]
    return importlib.machinery.PathFinder.find_spec("horovod", others)


def _become_installed(spec: importlib.machinery.ModuleSpec) -> None:
    module = importlib.util.module_from_spec(spec)
    sys.modules["horovod"] = module
    assert spec.loader is not None
    spec.loader.exec_module(module)


if __name__ == "horovod":
    _real = _installed_horovod()
    if _real is not None:
        _become_installed(_real)
    else:
        globals()["__path__"] = []  # a package, whose submodules come from the finder only
        sys.meta_path.insert(0, _Finder())
