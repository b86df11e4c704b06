"""The Makefile's mutation targets (tests/mutation/selection.py) cover every function of the
modules [tool.mutmut] mutates exactly once, so splitting a module between targets to keep each
within 30 minutes loses no mutant and runs none twice."""

from __future__ import annotations

import ast
import subprocess
import tomllib

import pytest

from tests.helpers import PYTHON, ROOT
from tests.mutation.selection import TARGETS, target_of


def _functions(path: str) -> list[str]:
    """mutmut's names of the functions and methods in ``path`` (``module.x_f``, ``module.xǁCǁm``)."""
    module = path.removesuffix(".py").replace("/", ".")
    tree = ast.parse((ROOT / path).read_text())
    names = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            names.append(f"{module}.x_{node.name}")
        elif isinstance(node, ast.ClassDef):
            names += [f"{module}.xǁ{node.name}ǁ{item.name}" for item in node.body if isinstance(item, ast.FunctionDef)]
    return names


def test_every_mutated_function_is_in_exactly_one_target() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mutmut"]
    functions = [name for path in config["only_mutate"] for name in _functions(path)]
    assert len(functions) > 100
    wrong = {name: target_of(f"{name}__mutmut_1") for name in functions if len(target_of(f"{name}__mutmut_1")) != 1}
    assert wrong == {}


@pytest.mark.slow  # starts a shell and Python
def test_the_makefile_reads_a_target_s_patterns_one_per_line() -> None:
    for name, patterns in TARGETS.items():
        printed = subprocess.run([PYTHON, "-m", "tests.mutation.selection", name], capture_output=True, text=True,
                                 cwd=ROOT, timeout=30, check=True).stdout
        assert printed.splitlines() == list(patterns)


def test_the_selection_and_mutmuts_config_name_the_same_modules_and_test_files() -> None:
    """Checked in the copy at every run too; here it fails in `make test`, before a run is started."""
    from tests.conftest import _check_selection

    _check_selection()  # a pytest.UsageError naming what differs


def test_every_test_the_config_runs_or_deselects_is_there() -> None:
    """A test file or test named in [tool.mutmut] that no longer exists (renamed, removed) would
    stop every run at its first step; here it fails in `make test` instead."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mutmut"]
    args = config["pytest_add_cli_args_test_selection"]
    named = [arg for arg in args if arg.startswith("tests/")]
    missing = [arg for arg in named if not (ROOT / arg.split("::", 1)[0]).is_file()]
    assert named and missing == []
    for arg in named:
        if "::" in arg:
            path, test = arg.split("::", 1)
            tree = ast.parse((ROOT / path).read_text())
            assert test in {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}, arg
