"""The compiled parts of poprun-py and what each one's absence means: the one place that knows them.

Every part is optional at build time (``optional = true`` in pyproject.toml's ext-modules, and its
programs, which setup.py builds, always): on a machine without a C compiler the package installs
without it. Its users ask here, never import it
themselves: :func:`load` gives the module or None (the user then takes its fallback, which gives
the same results), :func:`require` the module or :class:`MissingPart`, one line, where no fallback
can keep the part's promise; :func:`report` says which are present (``poprun --version``,
``python -m popdist_py``).

The parts belong to poprun_py and popdist_py; this module names them by string and imports one only
when its own package asks for it. Standard library only, and nothing imported on the way: the Python
stub asks for the subreaper on every launch.
"""

from __future__ import annotations

import os
import sys

TYPE_CHECKING = False  # typing.TYPE_CHECKING, without importing typing on the stubs' launch path
if TYPE_CHECKING:
    from types import ModuleType

BATCH_INVARIANT = "popdist_py.engine._batch_invariant"
TREE = "popdist_py.engine._collectives._tree"
SWAPS = "popdist_py._swaps"
SUBREAPER = "poprun_py.shared._subreaper"
LOOPBACK = "poprun_py.shared._loopback"
STUB = "poprun_py.stub.poprun-stub"

#: Where the three packages sit side by side (a source tree, site-packages): a part's file is found
#: from here when the package that holds it is not imported.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class MissingPart(RuntimeError):
    """A feature needs a compiled part this install lacks, and nothing else keeps its promise; the
    message, one line, names the feature, the part and what to do."""


class Part:
    """One compiled part: its module, what it does, what happens without it, and whether Python
    imports it (the loopback library is preloaded into another program instead; the stub is a
    program of its own, ``program``)."""

    __slots__ = ("imported", "module", "program", "role", "without")

    def __init__(self, module: str, role: str, without: str, imported: bool = True, program: bool = False) -> None:
        self.module, self.role, self.without = module, role, without
        self.imported, self.program = imported and not program, program


#: The ext-modules in pyproject.toml's order, then its programs (a test holds the lists equal).
PARTS = (
    Part(BATCH_INVARIANT, "batch-invariant products, the same bits on every CPU",
         "batch_invariant.matmul and outer_sum refuse (numpy cannot promise their bits on every CPU)"),
    Part(SUBREAPER, "the Python stub as subreaper of its program's daemons",
         "the same prctl call through ctypes (about 2 ms more at each instance's start)"),
    Part(TREE, "a reduction tree's additions over gradient pieces in one call",
         "numpy makes the same additions in the same order (same bits; slower over many small pieces)"),
    Part(SWAPS, "torch's randperm swap pass for the shuffled samplers",
         "a Python loop makes the same swaps (same orders; about 50 times slower, 7 s for 10**7 samples)"),
    Part(LOOPBACK, "Hydra's and Open MPI's launchers kept on loopback in a one-host job",
         "a one-host job that Hydra's mpiexec or Open MPI would start refuses to (MPICH's gforker needs "
         "no library)", imported=False),
    Part(STUB, "the compiled per-instance stub (fork, exec, wait; each host's one supervisor does the rest)",
         "its Python fallback (poprun_py/stub/fallback.py: the same frames, an interpreter per instance)",
         program=True),
)
_BY_MODULE = {part.module: part for part in PARTS}
#: What :func:`load` found: the module, or None with the reason in ``_WHY``.
_LOADED: dict[str, ModuleType | None] = {}
_WHY: dict[str, str] = {}


def part(module: str) -> Part:
    """The part named ``module``; ValueError naming the valid ones otherwise."""
    try:
        return _BY_MODULE[module]
    except KeyError:
        raise ValueError(f"{module!r} is no compiled part of poprun-py; valid: {', '.join(_BY_MODULE)}") from None


def load(module: str) -> ModuleType | None:
    """Compiled part ``module`` imported, or None where this install lacks it (not built, or a build
    that does not load here: :func:`why_missing` says which). Asked once; later calls are free."""
    if module in _LOADED:
        return _LOADED[module]
    if not part(module).imported:
        what = "a program" if part(module).program else "a library to preload"
        raise ValueError(f"{module} is {what}, not a module: ask library() for its path")
    found: ModuleType | None
    try:
        __import__(module)
        found = sys.modules[module]
    except ImportError as exc:  # not there (ModuleNotFoundError naming it), or a build that does not load
        found = None
        built = not isinstance(exc, ModuleNotFoundError) or exc.name != module
        _WHY[module] = (" ".join(str(exc).split()) or type(exc).__name__) if built else "not built"
    _LOADED[module] = found
    return found


def library(module: str) -> str | None:
    """The built file of compiled part ``module`` (the library to preload, the program to run), or
    None where it was not built."""
    from importlib.machinery import EXTENSION_SUFFIXES

    base = os.path.join(_folder(part(module).module), module.rpartition(".")[2])
    if part(module).program:
        if os.path.isfile(base) and os.access(base, os.X_OK):
            return base
    else:
        for suffix in EXTENSION_SUFFIXES:
            if os.path.isfile(base + suffix):
                return base + suffix
    _WHY[module] = "not built"
    return None


def _folder(module: str) -> str:
    """The folder that holds part ``module``'s file: its package's, where that is imported (the one
    asking has), else the package's folder beside this one."""
    package = module.rpartition(".")[0]
    paths = getattr(sys.modules.get(package), "__path__", None)
    return os.path.abspath(next(iter(paths))) if paths else os.path.join(_ROOT, *package.split("."))


def present(module: str) -> bool:
    """Whether this install has compiled part ``module``, in working order."""
    return (load(module) if part(module).imported else library(module)) is not None


def why_missing(module: str) -> str:
    """Why compiled part ``module`` is missing: "not built", or the error that loading it gave."""
    if present(module):
        return ""
    return _WHY.get(module) or "not built"


def require(module: str, feature: str) -> ModuleType:
    """Compiled part ``module``, which ``feature`` cannot do without; :class:`MissingPart` otherwise."""
    found = load(module)
    if found is None:
        raise MissingPart(missing_line(module, feature))
    return found


def missing_line(module: str, feature: str) -> str:
    """The one line that says ``feature`` cannot run without compiled part ``module``, and what to do."""
    what = why_missing(module)
    reason = "not built: no C compiler at install" if what == "not built" else what
    folder = _folder(part(module).module)
    return (f"{feature} needs {module}, a compiled part of poprun-py missing from {folder} ({reason}); "
            "reinstall poprun-py from its wheel, or from source where a C compiler works "
            "(python -m popdist_py lists the parts)")


def report() -> list[str]:
    """One line per part: present, or missing and what that means."""
    return [f"{p.module}: present - {p.role}" if present(p.module)
            else f"{p.module}: missing ({why_missing(p.module)}) - {p.without}" for p in PARTS]
