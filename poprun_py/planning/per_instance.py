"""What mpiexec starts for each instance: the compiled stub (where it was built), its Python
fallback, or the Python shim (``POPRUN_STUB``), and how ``poprun --version`` names it."""

from __future__ import annotations

import sys

from popcontract import compiled, environment, settings
from poprun_py.shared.errors import PlanError

COMPILED, PYTHON, SHIM = "compiled", "python", "shim"
MODES = (COMPILED, PYTHON, SHIM)


def mode() -> str:
    """``POPRUN_STUB``: the compiled stub where it was built (else its Python fallback) by default."""
    default = COMPILED if compiled.present(compiled.STUB) else PYTHON
    try:
        chosen = settings.choice(environment.STUB, MODES, default)
    except settings.PopdistEnvError as exc:
        raise PlanError(str(exc)) from None
    if chosen == COMPILED and default != COMPILED:
        raise PlanError(f"{environment.STUB}=compiled, but this install has no compiled stub "
                        f"({compiled.why_missing(compiled.STUB)}); use python or shim")
    return chosen


def describe(chosen: str) -> str:
    """What ``chosen`` runs each instance under, for ``poprun --version``."""
    return {COMPILED: "the compiled stub (one supervisor per host)",
            PYTHON: "the stub's Python fallback (one supervisor per host)",
            SHIM: "the Python shim (a connection to poprun each)"}[chosen] + f" ({environment.STUB}={chosen})"


def stub_command(chosen: str) -> tuple[str, ...]:
    """What mpiexec runs for each instance, before its index: the stub, or the shim."""
    if chosen == COMPILED:
        path = compiled.library(compiled.STUB)
        assert path is not None  # (``mode`` refuses compiled without it)
        return (path,)
    if chosen == PYTHON:
        from poprun_py.stub import SCRIPT
    else:
        from poprun_py.instance import SCRIPT
    return (sys.executable, "-S", SCRIPT)
