"""``--horovod``: where the instances' ``import horovod`` finds popdist_py's Horovod API.

popdist_py ships a one-file ``horovod`` package (``popdist_py/horovod/_alias/horovod``) that
answers ``horovod.torch`` and every module path under it from ``popdist_py.horovod``. poprun
puts its folder first on the instances' PYTHONPATH. The package looks for a Horovod installed
anywhere else on the path first and imports that one when there is one, so the option never
hides a real Horovod; poprun says so when it sees one.
"""

from __future__ import annotations

import importlib.util
import os

from popcontract import settings
from popcontract.environment import PYTHONPATH
from poprun_py.shared.errors import PlanError


def alias_folder() -> str:
    """The folder holding popdist_py's ``horovod`` package (popdist_py is found, not imported)."""
    spec = importlib.util.find_spec("popdist_py")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        folder = os.path.join(location, "horovod", "_alias")
        if os.path.isfile(os.path.join(folder, "horovod", "__init__.py")):
            return folder
    raise PlanError("--horovod: popdist_py's Horovod API is not installed with this poprun "
                    "(no popdist_py/horovod/_alias/horovod); reinstall poprun-py")


def installed_horovod(folder: str) -> str | None:
    """Where a Horovod other than the alias in ``folder`` is installed for this Python, or None."""
    installed = importlib.util.find_spec("horovod")
    if installed is None or not installed.origin or installed.origin.startswith(folder):
        return None
    return os.path.dirname(installed.origin)


def horovod_python_path(folder: str) -> str:
    """The instances' PYTHONPATH under --horovod: the alias ``folder``, then PYTHONPATH as it is."""
    existing = settings.text(PYTHONPATH)
    return folder + (os.pathsep + existing if existing else "")
