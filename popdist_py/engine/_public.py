"""Public names carry their public module: what ``popdist_py.engine`` (or a public package of it)
exports from its modules reports the package as ``__module__``, so ``repr``, tracebacks,
``help`` and pickles name ``popdist_py.engine.Trainer``, the path users import, never the
private module it is defined in (``popdist_py.engine._training.training``), which may move.
"""

from __future__ import annotations

from types import FunctionType
from typing import Any


def publish(namespace: dict[str, Any]) -> None:
    """Make the module of ``namespace`` (a package's globals) the ``__module__`` of every class
    and function in its ``__all__`` that is defined below it, and of those classes' nested
    classes. Pickles stay loadable: each name is exported under its own name (checked in
    ``tests/integration/test_layout.py``), which is where pickle looks for it."""
    package = namespace["__name__"]
    for name in namespace["__all__"]:
        obj = namespace[name]
        if isinstance(obj, (type, FunctionType)):
            _move(obj, package)


def _move(obj: Any, package: str) -> None:
    defined_in = obj.__module__
    if not defined_in.startswith(package + "."):
        return
    obj.__module__ = package
    if isinstance(obj, type):
        for inner in vars(obj).values():
            if isinstance(inner, type) and inner.__module__ == defined_in:
                _move(inner, package)
