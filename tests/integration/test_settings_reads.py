"""Every setting is read through the one reader, ``popcontract.settings``: no module of the launcher,
the library or the contract reads ``os.environ`` for a value itself.

A read is ``os.environ.get(...)``, ``os.environ[...]`` as a value, ``os.getenv(...)``, and
``X in os.environ`` of a variable of the contract. Copying the environment for a child, setting or
removing a variable, and choosing which variables to forward are not reads, and are not looked for.
"""

from __future__ import annotations

import ast
from pathlib import Path

from popcontract import environment
from tests.helpers import ROOT

PACKAGES = ("poprun_py", "popdist_py", "popcontract")
#: The reader itself.
READER = "popcontract/settings.py"
#: Reads that are no setting, each with why: (file, the variable as the code names it).
ALLOWED = {
    ("poprun_py/shared/paths.py", "'PATH'"): "which() searches PATH as the OS does, $PATH or os.defpath",
    ("poprun_py/shared/leftovers.py", "'TMPDIR'"): "Open MPI's own rule for where its session directory is",
}

#: The variables' own names, and those popcontract.environment gives them (NUM_INSTANCES, ...).
VARIABLE_NAMES = {v.name for v in environment.VARIABLES}
CONTRACT_NAMES = {name for name, value in vars(environment).items()
                  if isinstance(value, str) and value in VARIABLE_NAMES}


def _is_environ(node: ast.AST) -> bool:
    """``os.environ`` (or ``environ`` imported from os)."""
    return (isinstance(node, ast.Attribute) and node.attr == "environ" and isinstance(node.value, ast.Name)
            and node.value.id == "os") or (isinstance(node, ast.Name) and node.id == "environ")


def _is_contract_variable(node: ast.AST) -> bool:
    """``environment.NAME``, ``NAME`` imported from the contract, or the variable's name as a literal."""
    if isinstance(node, ast.Attribute):
        return node.attr in CONTRACT_NAMES
    if isinstance(node, ast.Name):
        return node.id in CONTRACT_NAMES
    return isinstance(node, ast.Constant) and node.value in VARIABLE_NAMES


def direct_reads(source: str) -> list[tuple[int, str]]:
    """(line, the variable as written) of every direct read of a setting in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.expr):
            continue
        key: ast.expr | None = None
        if isinstance(node, ast.Call) and node.args:
            func = node.func
            if isinstance(func, ast.Attribute) and func.attr == "get" and _is_environ(func.value):
                key = node.args[0]  # os.environ.get(X)
            elif (isinstance(func, ast.Attribute) and func.attr == "getenv" and isinstance(func.value, ast.Name)
                  and func.value.id == "os") or (isinstance(func, ast.Name) and func.id == "getenv"):
                key = node.args[0]  # os.getenv(X)
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and _is_environ(node.value):
            key = node.slice  # os.environ[X]
        elif (isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], (ast.In, ast.NotIn))
              and _is_environ(node.comparators[0]) and _is_contract_variable(node.left)):
            key = node.left  # X in os.environ
        if key is not None:
            found.append((node.lineno, ast.unparse(key)))
    return sorted(found)


def _package_files() -> list[Path]:
    return sorted(path for package in PACKAGES for path in (ROOT / package).rglob("*.py"))


def test_every_setting_is_read_through_the_one_reader() -> None:
    wrong = []
    for path in _package_files():
        where = path.relative_to(ROOT).as_posix()
        if where == READER:
            continue
        wrong += [f"{where}:{line} reads {key} from os.environ (use popcontract.settings)"
                  for line, key in direct_reads(path.read_text()) if (where, key) not in ALLOWED]
    assert not wrong, "\n".join(wrong)


def test_every_allowance_is_still_needed() -> None:
    # An allowance for a read that is gone would let a new one in unnoticed.
    reads = {(path.relative_to(ROOT).as_posix(), key) for path in _package_files()
             for _, key in direct_reads(path.read_text())}
    assert set(ALLOWED) <= reads, set(ALLOWED) - reads


def test_each_form_of_a_direct_read_is_found() -> None:
    source = ("import os\nfrom os import environ, getenv\nfrom popcontract import environment\n"
              "from popcontract.environment import CONTROL\n"
              "a = os.environ.get(environment.KILL_GRACE)\n"
              "b = os.environ['POPDIST_NUM_INSTANCES']\n"
              "c = os.getenv('HOME')\n"
              "d = environment.OMP_NUM_THREADS in os.environ\n"
              "e = CONTROL not in environ\n"
              "f = getenv('X', '')\n")
    assert direct_reads(source) == [(5, "environment.KILL_GRACE"), (6, "'POPDIST_NUM_INSTANCES'"), (7, "'HOME'"),
                                    (8, "environment.OMP_NUM_THREADS"), (9, "CONTROL"), (10, "'X'")]


def test_what_is_not_a_read_is_not_found() -> None:
    source = ("import os\nfrom popcontract import environment\n"
              "child = {**os.environ, 'X': '1'}\n"
              "copy = dict(os.environ)\n"
              "os.environ[environment.OMP_NUM_THREADS] = '2'\n"
              "del os.environ[environment.LD_PRELOAD]\n"
              "os.environ.setdefault(environment.UCX_NET_DEVICES, 'lo')\n"
              "forwarded = [name for name in ('PATH', 'HOME') if name in os.environ]\n")
    assert direct_reads(source) == []
