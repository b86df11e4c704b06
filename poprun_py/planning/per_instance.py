"""What mpiexec starts for each instance: the compiled stub (where it was built) or its Python
fallback (``POPRUN_STUB``), and how ``poprun --version`` names it."""

from __future__ import annotations

import sys

from popcontract import compiled, environment, settings
from poprun_py.shared.errors import PlanError

COMPILED, PYTHON = "compiled", "python"
MODES = (COMPILED, PYTHON)


def mode() -> str:
    """``POPRUN_STUB``: the compiled stub where it was built (else its Python fallback) by default."""
    default = COMPILED if compiled.present(compiled.STUB) else PYTHON
    try:
        chosen = settings.choice(environment.STUB, MODES, default)
    except settings.PopdistEnvError as exc:
        raise PlanError(str(exc)) from None
    if chosen == COMPILED and default != COMPILED:
        raise PlanError(f"{environment.STUB}=compiled, but this install has no compiled stub "
                        f"({compiled.why_missing(compiled.STUB)}); use python")
    return chosen


def describe(chosen: str) -> str:
    """What ``chosen`` runs each instance under, for ``poprun --version``."""
    return {COMPILED: "the compiled stub (one supervisor per host)",
            PYTHON: "the stub's Python fallback (one supervisor per host)"}[chosen] + f" ({environment.STUB}={chosen})"


def stub_command(chosen: str) -> tuple[str, ...]:
    """What mpiexec runs for each instance, before its index: the compiled stub, or the Python one."""
    if chosen == COMPILED:
        path = compiled.library(compiled.STUB)
        assert path is not None  # (``mode`` refuses compiled without it)
        return (path,)
    from poprun_py.stub import SCRIPT

    return (sys.executable, "-S", SCRIPT)
