"""Import every module of the installed poprun_py, popdist_py and popcontract (tests/integration/test_package.py).

    python -P tests/scripts/smoke_imports.py CHECKOUT

Walks both packages with pkgutil from where they are installed, fails if that is under CHECKOUT,
imports each module (the scripts, ``poprun_py.__main__``, ``popdist_py.__main__``,
``poprun_py.stub.script`` and ``poprun_py.host.script``, are only
found: importing runs them; so is the library poprun preloads into Open MPI's launcher, which is
no Python module, and so is popdist_py.horovod.torch where torch is not installed) and prints one
JSON object: the packages' files, the modules, the compiled extension's file and whether each
package has ``py.typed``.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import pkgutil
import sys
from pathlib import Path

#: Modules that run when imported: `python -m poprun_py`, `python -m popdist_py` (the compiled parts'
#: report, where the package has one), the Python stub's script and a host supervisor's.
SCRIPTS = ("poprun_py.__main__", "popdist_py.__main__", "poprun_py.stub.script", "poprun_py.host.script")
#: The modules that import torch (found only where it is not installed).
NEEDS_TORCH = "popdist_py.horovod.torch"


def main(checkout: str) -> int:
    import popcontract
    import popdist_py
    import poprun_py
    from poprun_py.shared import loopback

    found_only = (*SCRIPTS, f"poprun_py.shared.{loopback.NAME}")
    # Horovod's torch API needs torch, which the package does not require: without it, found only.
    needs_torch = () if importlib.util.find_spec("torch") else (NEEDS_TORCH,)

    root = Path(checkout).resolve()
    modules: list[str] = []
    files: dict[str, str] = {}
    typed: dict[str, bool] = {}
    for package in (poprun_py, popdist_py, popcontract):
        where = Path(package.__file__ or "").resolve().parent
        if where.is_relative_to(root):
            raise SystemExit(f"{package.__name__} comes from the checkout ({where}), not the installed wheel")
        files[package.__name__] = str(where)
        typed[package.__name__] = (where / "py.typed").is_file()
        walk = pkgutil.walk_packages(package.__path__, package.__name__ + ".",
                                     onerror=lambda name: None if name.startswith(needs_torch) else _raise(name))
        for info in walk:
            if info.name in found_only or info.name.startswith(needs_torch):
                if importlib.util.find_spec(info.name) is None:
                    raise SystemExit(f"{info.name} is missing")
                if info.name in needs_torch:
                    modules += _submodules(info.name)  # the walk cannot import it to go further
            else:
                module = importlib.import_module(info.name)
                if Path(module.__file__ or "").resolve().is_relative_to(root):
                    raise SystemExit(f"{info.name} comes from the checkout ({module.__file__})")
            modules.append(info.name)
    from popdist_py.engine import _batch_invariant

    print(json.dumps({"modules": modules, "files": files, "typed": typed, "extension": _batch_invariant.__file__,
                      "version": [poprun_py.__version__, popdist_py.__version__,
                                  popcontract.__version__]}))
    return 0


def _submodules(package: str) -> list[str]:
    """Every module under ``package`` (a package that cannot be imported here), found, not imported."""
    spec = importlib.util.find_spec(package)
    found: list[str] = []

    def walk(paths: list[str], prefix: str) -> None:
        for info in pkgutil.iter_modules(paths, prefix):
            found.append(info.name)
            if info.ispkg:
                walk([str(Path(p) / info.name.rpartition(".")[2]) for p in paths], info.name + ".")

    walk(list(spec.submodule_search_locations or []) if spec else [], package + ".")
    return found


def _raise(name: str) -> None:
    raise SystemExit(f"cannot import {name} while walking the packages")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
