"""The layout the code promises: which way imports run, what the engine exports, what is private."""

from __future__ import annotations

import ast
import importlib
import pickle
from pathlib import Path
from types import FunctionType

import pytest

import popdist_py.engine
from tests.helpers import ROOT

#: The engine's levels, lowest first: each is a public module (package) or a private sub-package
#: (or module) of popdist_py.engine, and its modules import from their own level and the levels
#: below it only, never from one above, at the top of a file or inside a function. The non-private
#: names are the public modules; the private ones may change without notice.
ENGINE_LEVELS = [
    "_public",          # publish(): exported names carry their public module
    "errors",           # the exception types
    "_placement",       # plain values: replicas on instances, groupings, shard layouts
    "_execution",       # executors (threads, greenlets), BLAS threads, local work in slices
    "_collectives",     # one collective: dispatch, rendezvous, exchange plan, reduction order, transport
    "_state",           # variables, remote buffers, checkpoints, pages of mapped state
    "_step",            # the replica a step runs as (StepContext)
    "ops",              # what a step calls
    "fused",            # gradients reduced in buckets
    "optimizers",
    "_batch_invariant", # compiled kernels of batch_invariant
    "batch_invariant",
    "pipeline",         # stages on devices, schedules
    "_training",        # the Trainer, tensor locations, off-chip storage
    "runtime",          # Runtime, the facade
    "__init__",         # popdist_py.engine: re-exports the API
]
#: popdist_py.engine's API as it is now: the derived tests below say the exports match the
#: definitions; this one says that a change of API is deliberate.
ENGINE_API = {
    "RETRIEVAL_MODES", "CheckpointError", "CollectiveError", "CollectiveMismatchError", "CollectiveTimeoutError",
    "CommGroup", "CommGroupType", "InstancesDisagreeError", "PeerAborted", "PeerClosed", "Pipeline",
    "PipelineStageError", "RemoteBuffer", "ReplicaGrouping", "ReplicatedTensorSharding", "Runtime", "Shard",
    "ShardArray", "ShardLayout", "ShardMeta", "Stage", "StepAborted", "StepContext", "TensorLocation",
    "TensorLocationSettings", "TensorStorage", "TileSet", "Trainer", "TrainingOptions", "Variable", "canonical_sum",
    "ops",
}


def _modules(package: str) -> dict[str, Path]:
    found = {}
    for path in (ROOT / package).rglob("*.py"):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        found[name] = path
    return found


def _imported(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """What module ``name`` (at ``path``) imports, at its top or inside a function, relative imports
    resolved: ``from package import module`` names the module when ``known`` has it."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0]
                base = f"{parent}.{base}" if base else parent
            for alias in node.names:
                child = f"{base}.{alias.name}"
                found.add(child if child in known else base)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


def _in_engine(module: str) -> bool:
    return module == "popdist_py.engine" or module.startswith("popdist_py.engine.")


def _level(module: str) -> str:
    """The level of an engine module: its first name below popdist_py.engine (the package itself: ``__init__``)."""
    below = module.removeprefix("popdist_py.engine").lstrip(".")
    return below.split(".")[0] if below else "__init__"


def _public_modules() -> dict[str, Path]:
    """The engine's public modules: those with no private name on their path (as trio's export test
    finds its public modules)."""
    return {name: path for name, path in _modules("popdist_py/engine").items()
            if not any(part.startswith("_") for part in name.split("."))}


def test_engine_levels_are_its_sub_packages_and_public_modules() -> None:
    # Every module of the engine sits on a declared level, and every level exists; the private code
    # is in the named sub-packages (besides the export helper and the compiled kernels).
    engine = ROOT / "popdist_py" / "engine"
    found = {path.name.split(".")[0] for path in engine.iterdir()
             if path.name != "__pycache__" and (path.is_dir() or path.suffix in {".py", ".pyi", ".c", ".so"})}
    assert found == set(ENGINE_LEVELS)
    private = sorted(path.name for path in engine.iterdir() if path.is_dir() and path.name.startswith("_")
                     and path.name != "__pycache__")
    assert private == ["_collectives", "_execution", "_placement", "_state", "_step", "_training"]


def test_engine_imports_go_down_its_levels_only() -> None:
    # The sub-package direction, not only file cycles: an import of a level above, even inside a
    # function or under TYPE_CHECKING, fails here; the rest of popdist_py imports public modules only.
    rank = {level: index for index, level in enumerate(ENGINE_LEVELS)}
    modules = _modules("popdist_py")
    wrong = []
    for name, path in sorted(modules.items()):
        for imported in sorted(filter(_in_engine, _imported(name, path, modules))):
            if not _in_engine(name):
                if imported not in _public_modules() or "._" in imported:
                    wrong.append(f"{name} imports the engine's private {imported}")
            elif rank[_level(imported)] > rank[_level(name)]:
                wrong.append(f"{name} ({_level(name)}) imports {imported} ({_level(imported)}), a level above")
    assert not wrong, "\n".join(wrong)


def test_imports_within_popdist_py_run_one_way() -> None:
    # No two modules import each other, directly or around a loop (a package's __init__ may
    # import its own modules).
    modules = _modules("popdist_py")
    graph = {name: {m for m in _imported(name, path, modules) & set(modules)
                    if m != name and not name.startswith(m + ".")}
             for name, path in modules.items()}
    done: set[str] = set()

    def visit(name: str, path: list[str]) -> None:
        if name in path:
            raise AssertionError("import cycle: " + " -> ".join([*path[path.index(name):], name]))
        if name in done:
            return
        for imported in sorted(graph[name]):
            visit(imported, [*path, name])
        done.add(name)

    for name in sorted(graph):
        visit(name, [])


def _defined(path: Path) -> set[str]:
    """The public names a module's source defines at its top: classes, functions and UPPER_CASE
    constants, and for a package's ``__init__`` also what it imports (its re-exports)."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):  # constants; a TypeVar is not one
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            typevar = isinstance(node.value, ast.Call) and getattr(node.value.func, "id", "") == "TypeVar"
            names.update(t.id for t in targets if isinstance(t, ast.Name) and t.id.isupper() and not typevar)
        elif isinstance(node, (ast.Import, ast.ImportFrom)) and path.name == "__init__.py":
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
    return {name for name in names if not name.startswith("_")}


@pytest.mark.parametrize("name", sorted(_public_modules()))
def test_public_module_exports_what_it_defines(name: str) -> None:
    # Derived from the definitions: __all__ holds every public class, function and constant the
    # module defines (a package: every name it re-exports), and names only what exists.
    module = importlib.import_module(name)
    exported = list(module.__all__)
    assert len(set(exported)) == len(exported), exported
    assert [export for export in exported if export.startswith("_") or not hasattr(module, export)] == []
    assert sorted(_defined(_public_modules()[name]) - set(exported)) == []


def test_every_error_of_the_engine_is_exported_by_it() -> None:
    # Whatever exception a module of the engine (private ones too) defines or raises as its own
    # reaches users as popdist_py.engine.<name>.
    exported = {getattr(popdist_py.engine, name) for name in popdist_py.engine.__all__}
    missing = []
    for name in sorted(_modules("popdist_py/engine")):
        for attr, value in vars(importlib.import_module(name)).items():
            if (isinstance(value, type) and issubclass(value, BaseException) and not attr.startswith("_")
                    and value.__module__.startswith("popdist_py") and value not in exported):
                missing.append(f"{name}.{attr}")
    assert missing == []


def _exported_definitions() -> list[tuple[str, str, type | FunctionType]]:
    """(public module, name, object) for every class and function a public module exports."""
    found = []
    for name in sorted(_public_modules()):
        module = importlib.import_module(name)
        found += [(name, export, getattr(module, export)) for export in module.__all__
                  if isinstance(getattr(module, export), (type, FunctionType))]
    return found


def test_exported_names_carry_a_public_module_and_pickle() -> None:
    # What a public module exports prints, and pickles, under a public path (no private module
    # named; a package's exports name the package, not the module below it that defines them),
    # and pickle finds it again under that path; nested classes likewise.
    wrong = []
    for module, export, obj in _exported_definitions():
        package = _public_modules()[module].name == "__init__.py"
        inner = [value for value in vars(obj).values() if isinstance(value, type)] if isinstance(obj, type) else []
        for item in [obj, *inner]:
            home = item.__module__
            if any(part.startswith("_") for part in home.split(".")) or (package and home.startswith(module + ".")):
                wrong.append(f"{module}.{export}: {home}.{item.__qualname__}")
            elif home.startswith("popdist_py") and pickle.loads(pickle.dumps(item)) is not item:
                wrong.append(f"{module}.{export}: pickled {item!r} comes back as another object")
    assert wrong == []
    assert repr(popdist_py.engine.Trainer) == "<class 'popdist_py.engine.Trainer'>"
    assert popdist_py.engine.pipeline.bubble.__module__ == "popdist_py.engine.pipeline"


def test_exported_values_and_errors_pickle_and_print_their_public_path() -> None:
    # The engine sends none of its objects between processes as pickles (signatures travel as
    # strings), but users do (multiprocessing, mpi4py's lower-case calls): errors, groupings,
    # layouts and settings come back equal, and their pickles name no private module.
    engine = popdist_py.engine
    for name in engine.__all__:
        value = getattr(engine, name)
        if isinstance(value, type) and issubclass(value, BaseException):
            error = value("replica 1 failed")
            back = pickle.loads(pickle.dumps(error))
            assert type(back) is value and back.args == error.args
            assert repr(back) == f"{name}('replica 1 failed')"
    values = [engine.ReplicaGrouping.create(8, 2, 4), engine.ReplicaGrouping.from_assignments([0, 1, 1, 0]),
              engine.CommGroup(engine.CommGroupType.Consecutive, 2), engine.ShardLayout(30, 4),
              engine.TileSet.IO, engine.TensorStorage.OFF_CHIP, engine.TrainingOptions(accumulation_factor=4)]
    for value in values:
        assert pickle.loads(pickle.dumps(value)) == value
        assert b"popdist_py.engine._" not in pickle.dumps(value), value
    assert engine.Runtime.__module__ == "popdist_py.engine"


def test_engine_api_is_the_one_users_know() -> None:
    # The derived tests above keep __all__ true to the definitions; this says a change of API is deliberate.
    assert set(popdist_py.engine.__all__) == ENGINE_API


def _imports_of(path: Path) -> list[str]:
    """Every module ``path`` names in an import (top level or inside a function, for the type
    checker too) or in ``importlib.import_module``/``__import__`` with a literal name (lazy loads)."""
    found: list[str] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.extend([node.module, *(f"{node.module}.{alias.name}" for alias in node.names)])
        elif isinstance(node, ast.Import):
            found.extend(alias.name for alias in node.names)
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and ((isinstance(node.func, ast.Name) and node.func.id == "__import__")
                   or (isinstance(node.func, ast.Attribute) and node.func.attr == "import_module"))):
            found.append(node.args[0].value)
    return found


def _top(module: str) -> str:
    return module.split(".")[0]


def test_popdist_py_imports_nothing_of_the_launcher() -> None:
    # popdist_py runs without poprun (bare mpiexec, srun, one process) and sits beneath it: what the
    # two share, the environment contract and the version, is popcontract's.
    wrong = [f"{path.relative_to(ROOT)} imports {module}" for path in sorted((ROOT / "popdist_py").rglob("*.py"))
             for module in _imports_of(path) if _top(module) == "poprun_py"]
    assert not wrong, "\n".join(wrong)


def test_the_contract_stands_alone_on_the_standard_library() -> None:
    # popcontract is beneath both packages: it imports neither, nor anything outside the standard
    # library (the Python stub and hosts' supervisors import it under python -S; the library imports
    # it without the launcher).
    import sys

    wrong = [f"{path.relative_to(ROOT)} imports {module}" for path in sorted((ROOT / "popcontract").rglob("*.py"))
             for module in _imports_of(path)
             if _top(module) not in sys.stdlib_module_names | {"__future__", "popcontract"}]
    assert not wrong, "\n".join(wrong)


#: poprun_py's sub-packages by the process they run in, each with the sub-packages it may import
#: besides its own modules; a sub-package a row does not name is out of bounds for it. Every
#: sub-package may read the environment contract.
LAUNCHER_IMPORTS = {
    "shared": set(),                                    # both processes
    "wire": {"shared"},                                 # both processes: the channel between them
    "stub": {"wire", "shared"},                         # the stub's Python fallback, once per instance
    "host": {"wire", "shared"},                         # a host's supervisor of its stubs, once per host
    "planning": {"shared"},                             # poprun, before anything starts
    "supervision": {"planning", "host", "wire", "shared"},  # poprun, while the job runs (its host's supervisor)
    "cli": {"supervision", "planning", "shared"},       # poprun's command line
}
#: What every sub-package may import although its row does not name it: the package's version and
#: the paths of the scripts mpiexec starts for each instance. (The contract, popcontract, is a package
#: of its own: every sub-package may read it.)
LAUNCHER_ANYWHERE = {"poprun_py", "poprun_py.stub", "poprun_py.host"}
#: Sub-packages that run per instance or per host under ``python -S``, whose start-up counts
#: against every launch: the standard library only.
STANDARD_LIBRARY_ONLY = {"stub", "host", "wire", "shared"}


def _module_of(module: str, name: str) -> str:
    """What ``from module import name`` imports: the module ``module.name`` when there is one."""
    where = ROOT.joinpath(*f"{module}.{name}".split("."))
    return f"{module}.{name}" if where.is_dir() or where.with_suffix(".py").is_file() else module


def _launcher_imports(path: Path) -> list[str]:
    """Every module ``path`` imports, at its top or inside a function, by full name; what it
    imports for the type checker only is left out."""
    tree = ast.parse(path.read_text())
    checking_only = {id(node) for block in ast.walk(tree) if isinstance(block, ast.If)
                     and isinstance(block.test, ast.Name) and block.test.id == "TYPE_CHECKING"
                     for node in ast.walk(block)}
    found: list[str] = []
    for node in ast.walk(tree):
        if id(node) in checking_only:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.extend(_module_of(node.module, alias.name) for alias in node.names)
        elif isinstance(node, ast.Import):
            found.extend(alias.name for alias in node.names)
    return found


def test_every_launcher_module_belongs_to_a_sub_package_of_its_process() -> None:
    package = ROOT / "poprun_py"
    loose = sorted(path.name for path in package.glob("*.py"))
    assert loose == ["__init__.py", "__main__.py"]
    folders = sorted(path.name for path in package.iterdir() if path.is_dir() and path.name != "__pycache__")
    assert folders == sorted(LAUNCHER_IMPORTS)
    assert all((package / folder / "__init__.py").is_file() for folder in folders)


def test_launcher_sub_packages_import_only_what_their_process_may() -> None:
    import sys

    may_import_under_s = sys.stdlib_module_names | {"__future__", "popcontract"}
    wrong = []
    for name in LAUNCHER_IMPORTS:
        for path in sorted((ROOT / "poprun_py" / name).rglob("*.py")):
            for imported in _launcher_imports(path):
                if imported.startswith("poprun_py"):
                    parts = [*imported.split("."), ""]
                    if parts[1] in LAUNCHER_IMPORTS and parts[1] != name and parts[1] not in LAUNCHER_IMPORTS[name] \
                            and imported not in LAUNCHER_ANYWHERE:
                        wrong.append(f"{path.relative_to(ROOT)} imports {imported}")
                elif name in STANDARD_LIBRARY_ONLY and imported.split(".")[0] not in may_import_under_s:
                    wrong.append(f"{path.relative_to(ROOT)} (runs under python -S) imports {imported}")
    assert not wrong, "\n".join(wrong)
