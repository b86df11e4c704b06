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
    and function in its ``__all__`` that is defined below it. Pickles stay loadable: each name
    is exported under its own name (checked in ``tests/integration/test_layout.py``), which is
    where pickle looks for it."""
    package = namespace["__name__"]
    for name in namespace["__all__"]:
        obj = namespace[name]
        if isinstance(obj, (type, FunctionType)) and obj.__module__.startswith(package + "."):
            obj.__module__ = package
