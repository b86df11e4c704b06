"""The distribution as users get it: the sdist and the wheel built from this checkout (the wheel
from the sdist), the wheel installed into a fresh venv outside the checkout, its modules imported
and its ``poprun`` launching a pipelined engine job from a directory elsewhere.

The build runs in a venv of its own holding only pyproject's [build-system] requirements and
``build``; the fresh venv gets the wheel and its dependencies from the package index. Both live in
a temporary directory, removed afterwards (about 15 s in all; the first run fetches from the index).
"""

from __future__ import annotations

import importlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import tomllib
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest

import popcontract
import popdist_py
import poprun_py
from popcontract import __version__
from poprun_py.cli import main as cli
from poprun_py.shared import loopback
from tests.helpers import ROOT

PACKAGES = ("poprun_py", "popdist_py", "popcontract")
SMOKE = ROOT / "tests" / "scripts"
#: Bounds on each step (building and installing may fetch from the package index), and on a test
#: with the build and the installs it waits for (about 15 s here).
BUILD_TIMEOUT, INSTALL_TIMEOUT, RUN_TIMEOUT, TEST_TIMEOUT = 120, 150, 60, 240
#: What `poprun --version` prints (click's version_option in poprun_py/cli/command.py).
VERSION_LINE = f"poprun {__version__}\n"


def pyproject() -> dict[str, Any]:
    with (ROOT / "pyproject.toml").open("rb") as f:
        return tomllib.load(f)


#: The compiled extensions, as pyproject.toml builds them ("popdist_py.engine._batch_invariant").
EXTENSIONS = tuple(module["name"] for module in pyproject()["tool"]["setuptools"]["ext-modules"])
#: Those that Python imports, each with its stub; the other is the library poprun preloads into
#: Open MPI's launcher, which is no Python module.
IMPORTED = tuple(name for name in EXTENSIONS if name != f"poprun_py.shared.{loopback.NAME}")


def checkout_modules() -> set[str]:
    """Every module of both packages in the checkout, by its sources (and the C extensions)."""
    found = set(EXTENSIONS)
    for source in checkout_files():
        parts = Path(source).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if len(parts) > 1:  # walk_packages does not name the top package itself
            found.add(".".join(parts))
    return found


def checkout_files() -> set[str]:
    """The packages' source files, as paths relative to the checkout ('popdist_py/engine/ops.py')."""
    return {str(p.relative_to(ROOT)) for package in PACKAGES for p in (ROOT / package).rglob("*.py")
            if "__pycache__" not in p.parts}


def outside_env(venv: Path | None = None) -> dict[str, str]:
    """This environment without Python's or PopDist's variables (no PYTHONPATH into the checkout),
    ``venv``'s bin first on PATH."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PYTHON", "POPDIST_", "POPRUN_")) and k != "VIRTUAL_ENV"}
    if venv is not None:
        env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    return env


def check(cmd: list[str | Path], cwd: Path, timeout: float,
          venv: Path | None = None) -> subprocess.CompletedProcess[str]:
    result = subprocess.run([str(c) for c in cmd], cwd=cwd, env=outside_env(venv), capture_output=True, text=True,
                            timeout=timeout)
    assert result.returncode == 0, f"{cmd} exited {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


class Built(NamedTuple):
    sdist: Path
    wheel: Path
    venv: Path  # the wheel installed, with its dependencies
    away: Path  # a working directory outside the checkout


@pytest.fixture(scope="module")
def built() -> Iterator[Built]:
    with tempfile.TemporaryDirectory(prefix="poprun-package-") as tmp:
        top = Path(tmp)
        assert not top.is_relative_to(ROOT)
        # The sources only: no build/, egg-info, bytecode or in-place extension from the checkout.
        src = top / "src"
        src.mkdir()
        for path in ROOT.iterdir():
            if path.is_file():
                shutil.copy2(path, src)
        for package in PACKAGES:
            shutil.copytree(ROOT / package, src / package,
                            ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.egg-info", "build"))
        tools, venv, dist, away = top / "tools", top / "venv", top / "dist", top / "away"
        away.mkdir()
        pip = [sys.executable, "-m", "pip", "--python"]
        check([sys.executable, "-m", "venv", "--without-pip", tools], top, BUILD_TIMEOUT)
        check([*pip, tools / "bin" / "python", "install", "--quiet", *pyproject()["build-system"]["requires"], "build"],
            top, INSTALL_TIMEOUT)
        # The sdist, then the wheel from the sdist: a source the sdist lacks fails the build.
        check([tools / "bin" / "python", "-m", "build", "--no-isolation", "--outdir", dist, src], top, BUILD_TIMEOUT)
        (sdist,), (wheel,) = dist.glob("*.tar.gz"), dist.glob("*.whl")
        check([sys.executable, "-m", "venv", "--without-pip", venv], top, BUILD_TIMEOUT)
        check([*pip, venv / "bin" / "python", "install", "--quiet", wheel], top, INSTALL_TIMEOUT)
        yield Built(sdist, wheel, venv, away)


# ------------------------------------------------------------------------------------------ metadata
def test_one_version_and_the_entry_point() -> None:
    project = pyproject()["project"]
    assert "version" not in project and "version" in project["dynamic"]
    # The version lives in the contract, which both packages import: neither needs the other for it.
    assert pyproject()["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "popcontract.__version__"}
    assert popdist_py.__version__ == poprun_py.__version__ == popcontract.__version__
    module, _, function = project["scripts"]["poprun"].partition(":")
    assert getattr(importlib.import_module(module), function) is cli.main


# ------------------------------------------------------------------------------------------ artifacts
@pytest.mark.slow
@pytest.mark.timeout(TEST_TIMEOUT)
def test_sdist_has_every_source(built: Built) -> None:
    with tarfile.open(built.sdist) as tar:
        top = tar.getnames()[0].split("/")[0]
        names = {name.removeprefix(top + "/") for name in tar.getnames()}
    extensions = {f"{name.replace('.', '/')}.c" for name in EXTENSIONS} | {f"{name.replace('.', '/')}.pyi"
                                                                         for name in IMPORTED}
    wanted = checkout_files() | extensions | {"poprun_py/py.typed", "popdist_py/py.typed", "pyproject.toml",
                                              "README.md"}
    assert wanted <= names, sorted(wanted - names)


@pytest.mark.slow
@pytest.mark.timeout(TEST_TIMEOUT)
def test_wheel_has_every_module_the_extension_and_py_typed(built: Built) -> None:
    with zipfile.ZipFile(built.wheel) as whl:
        names = set(whl.namelist())
        entry_points = "".join(whl.read(n).decode() for n in names if n.endswith(".dist-info/entry_points.txt"))
    stubs = {f"{name.replace('.', '/')}.pyi" for name in IMPORTED}
    assert {"popdist_py/engine/__init__.py", "popdist_py/engine/pipeline/__init__.py", "poprun_py/py.typed",
            "popdist_py/py.typed", *stubs} <= names
    assert checkout_files() <= names, sorted(checkout_files() - names)
    for name in EXTENSIONS:
        assert [n for n in names if re.fullmatch(rf"{re.escape(name.replace('.', '/'))}\.[^/]+\.so", n)], name
    assert not [n for n in names if n.endswith(".c")], "the C source belongs in the sdist only"
    assert not [n for n in names if n.startswith(("tests/", "bin/"))]
    assert re.search(r"^poprun = poprun_py\.cli\.main:main$", entry_points, re.M), entry_points


# ------------------------------------------------------------------------------------------ installed
@pytest.mark.slow
@pytest.mark.timeout(TEST_TIMEOUT)
def test_every_installed_module_imports_outside_the_checkout(built: Built) -> None:
    python = built.venv / "bin" / "python"
    imports = check([python, "-P", SMOKE / "smoke_imports.py", ROOT], built.away, RUN_TIMEOUT, built.venv)
    found = json.loads(imports.stdout)
    site = built.venv.resolve()
    assert all(Path(where).is_relative_to(site) for where in found["files"].values()), found["files"]
    assert Path(found["extension"]).is_relative_to(site)
    assert found["typed"] == dict.fromkeys(PACKAGES, True)
    assert set(found["modules"]) == checkout_modules()
    assert found["version"] == [__version__, __version__, __version__]


@pytest.mark.slow
@pytest.mark.timeout(TEST_TIMEOUT)
def test_installed_poprun_version(built: Built) -> None:
    python, poprun = built.venv / "bin" / "python", built.venv / "bin" / "poprun"
    assert check([poprun, "--version"], built.away, RUN_TIMEOUT, built.venv).stdout.startswith(VERSION_LINE)
    assert check([python, "-m", "poprun_py", "--version"], built.away, RUN_TIMEOUT, built.venv).stdout.startswith(
        VERSION_LINE)
    metadata = check([python, "-c", "import importlib.metadata as m; print(m.version('poprun-py'))"], built.away,
                   RUN_TIMEOUT, built.venv)
    assert metadata.stdout == f"{__version__}\n"


@pytest.mark.slow
@pytest.mark.timeout(TEST_TIMEOUT)
def test_installed_poprun_runs_a_pipelined_engine_job(built: Built) -> None:
    python, poprun = built.venv / "bin" / "python", built.venv / "bin" / "poprun"
    job: list[str | Path] = [python, "-P", SMOKE / "smoke_job.py"]
    result = check([poprun, "--num-instances", "2", "--num-replicas", "4", "--ipus-per-replica", "2", *job],
                 built.away, RUN_TIMEOUT, built.venv)
    line = re.compile(r"\[(\d)\] smoke-job instance=(\d) of=2 replicas=4 devices=2 weights-sha256 ([0-9a-f]{64}) "
                      r"trained=True popdist_py=(\S+)")
    found = [m.groups() for m in map(line.fullmatch, result.stdout.splitlines()) if m]
    assert sorted((tag, index) for tag, index, _, _ in found) == [("0", "0"), ("1", "1")], result.stdout
    hashes = {digest for _, _, digest, _ in found}
    assert len(hashes) == 1, result.stdout
    assert all(Path(where).resolve().is_relative_to(built.venv.resolve()) for _, _, _, where in found)
    # the same weights as the two stages one after the other, 4 replicas in one process
    alone = check([*job, "--replicas", "4", "--sequential"], built.away, RUN_TIMEOUT, built.venv).stdout
    assert f"weights-sha256 {hashes.pop()} " in alone
