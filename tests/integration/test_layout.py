"""The layout the code promises: which way imports run, what the engine exports, what is private."""

from __future__ import annotations

import ast
from pathlib import Path

import popdist_py.engine
from tests.helpers import ROOT

#: popdist_py.engine's public API (what users import from it); a change here is a change of API.
ENGINE_API = [
    "RETRIEVAL_MODES", "CheckpointError", "CollectiveError", "CollectiveMismatchError", "CollectiveTimeoutError",
    "CommGroup", "CommGroupType", "InstancesDisagreeError", "PeerAborted", "PeerClosed", "Pipeline",
    "PipelineStageError", "RemoteBuffer", "ReplicaGrouping", "ReplicatedTensorSharding", "Runtime", "Shard",
    "ShardArray", "ShardLayout", "ShardMeta", "Stage", "StepAborted", "StepContext", "TensorLocation",
    "TensorLocationSettings", "TensorStorage", "TileSet", "Trainer", "TrainingOptions", "Variable", "canonical_sum",
    "ops",
]
#: The engine's public modules: the rest lives in its private sub-packages (_execution, _collectives,
#: _state, _training), whose names may change without notice.
ENGINE_PUBLIC_MODULES = {"__init__", "batch_invariant", "errors", "fused", "ops", "optimizers", "pipeline", "runtime"}


def _modules(package: str) -> dict[str, Path]:
    found = {}
    for path in (ROOT / package).rglob("*.py"):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        found[name] = path
    return found


def _imports(path: Path, known: dict[str, Path]) -> set[str]:
    """The modules of ``known`` that ``path`` imports, at its top or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                child = f"{node.module}.{alias.name}"
                found.add(child if child in known else node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found & set(known)


def test_engine_exports_its_api_and_nothing_else() -> None:
    assert popdist_py.engine.__all__ == ENGINE_API
    assert all(hasattr(popdist_py.engine, name) for name in ENGINE_API)


def test_engine_internals_are_in_private_sub_packages() -> None:
    engine = ROOT / "popdist_py" / "engine"
    public = {path.stem if path.is_file() else path.name for path in engine.iterdir()
              if not path.name.startswith(("_", ".")) or path.name == "__init__.py"}
    assert public - {"__pycache__"} == ENGINE_PUBLIC_MODULES
    private = sorted(path.name for path in engine.iterdir() if path.is_dir() and path.name.startswith("_")
                     and path.name != "__pycache__")
    assert private == ["_collectives", "_execution", "_state", "_training"]


def test_imports_within_popdist_py_run_one_way() -> None:
    # No two modules import each other, directly or around a loop (a package's __init__ may
    # import its own modules).
    modules = _modules("popdist_py")
    graph = {name: {m for m in _imports(path, modules) if m != name and not name.startswith(m + ".")}
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


def test_popdist_py_takes_only_the_environment_contract_from_the_launcher() -> None:
    # popdist_py runs without poprun (bare mpiexec, srun, one process): of poprun_py it may import
    # only the contract (poprun_py.environment, which imports nothing) and the distribution's version.
    for path in sorted((ROOT / "popdist_py").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("poprun_py"):
                names = {alias.name for alias in node.names}
                assert node.module == "poprun_py.environment" or (
                    node.module == "poprun_py" and names <= {"environment", "__version__"}), (path, node.module, names)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    ok = not alias.name.startswith("poprun_py") or alias.name == "poprun_py.environment"
                    assert ok, (path, alias.name)


#: poprun_py's sub-packages by the process they run in, each with the sub-packages it may import
#: besides its own modules; a sub-package a row does not name is out of bounds for it. Every
#: sub-package may read the environment contract.
LAUNCHER_IMPORTS = {
    "shared": set(),                                    # both processes
    "wire": {"shared"},                                 # both processes: the channel between them
    "instance": {"wire", "shared"},                     # the shim, once per instance
    "planning": {"shared"},                             # poprun, before anything starts
    "supervision": {"planning", "wire", "shared"},      # poprun, while the job runs
    "cli": {"supervision", "planning", "shared"},       # poprun's command line
}
#: What every sub-package may import although its row does not name it: the contract between
#: poprun and popdist_py, and the path of the script mpiexec starts for each instance.
LAUNCHER_ANYWHERE = {"poprun_py", "poprun_py.environment", "poprun_py.instance"}
#: Sub-packages that run in the shim, whose start-up counts against every launch: the standard
#: library only.
STANDARD_LIBRARY_ONLY = {"instance", "wire", "shared"}


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
    found = []
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
    assert loose == ["__init__.py", "__main__.py", "environment.py"]
    folders = sorted(path.name for path in package.iterdir() if path.is_dir() and path.name != "__pycache__")
    assert folders == sorted(LAUNCHER_IMPORTS)
    assert all((package / folder / "__init__.py").is_file() for folder in folders)


def test_launcher_sub_packages_import_only_what_their_process_may() -> None:
    import sys

    wrong = []
    for name in LAUNCHER_IMPORTS:
        for path in sorted((ROOT / "poprun_py" / name).rglob("*.py")):
            for imported in _launcher_imports(path):
                if imported.startswith("poprun_py"):
                    parts = [*imported.split("."), ""]
                    if parts[1] in LAUNCHER_IMPORTS and parts[1] != name and parts[1] not in LAUNCHER_IMPORTS[name] \
                            and imported not in LAUNCHER_ANYWHERE:
                        wrong.append(f"{path.relative_to(ROOT)} imports {imported}")
                elif name in STANDARD_LIBRARY_ONLY and imported.split(".")[0] not in sys.stdlib_module_names | {
                        "__future__"}:
                    wrong.append(f"{path.relative_to(ROOT)} (runs in the shim) imports {imported}")
    assert not wrong, "\n".join(wrong)
