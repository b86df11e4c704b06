"""The distribution as users get it: ``make dist``'s sdist and wheel (the wheel built from the sdist;
tests/integration/distribution.py), each listed file by file, and the wheel installed into a fresh
venv outside the checkout, its modules imported and its ``poprun`` launching a pipelined engine job
from a directory elsewhere (test_dist.py runs the installs without a compiler).

``make dist`` and the install run once per session (tests/integration/conftest.py), in a temporary
directory removed afterwards.
"""

from __future__ import annotations

import importlib
import json
import re
import sysconfig
import tarfile
import zipfile
from pathlib import Path
from typing import NamedTuple

import pytest

import popcontract
import popdist_py
import poprun_py
from popcontract import __version__
from poprun_py.cli import main as cli
from poprun_py.shared import loopback
from tests.helpers import ROOT
from tests.integration import distribution
from tests.integration.distribution import Dist, Installed, check, pyproject

PACKAGES = ("poprun_py", "popdist_py", "popcontract")
SMOKE = ROOT / "tests" / "scripts"
#: Bounds on each command of the installed wheel, and on a test with make dist and the installs it
#: may wait for (the first test of the session).
RUN_TIMEOUT, TEST_TIMEOUT = 60, 900
#: What `poprun --version` prints (click's version_option in poprun_py/cli/command.py).
VERSION_LINE = f"poprun {__version__}\n"

#: The compiled extensions, as pyproject.toml builds them ("popdist_py.engine._batch_invariant").
EXTENSIONS = tuple(name for name, _ in distribution.EXTENSIONS)
#: Those that Python imports, each with its stub; the other is the library poprun preloads into
#: Open MPI's launcher, which is no Python module.
IMPORTED = tuple(name for name in EXTENSIONS if name != f"poprun_py.shared.{loopback.NAME}")
#: The files setuptools writes next to the sources in an sdist, and into a wheel's .dist-info.
SDIST_METADATA = ("PKG-INFO", "setup.cfg", *(f"poprun_py.egg-info/{name}" for name in (
    "PKG-INFO", "SOURCES.txt", "dependency_links.txt", "entry_points.txt", "requires.txt", "top_level.txt")))
WHEEL_METADATA = ("METADATA", "WHEEL", "RECORD", "entry_points.txt", "top_level.txt")


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


def package_files() -> set[str]:
    """Every file of the packages in the checkout but what git ignores there (bytecode, in-place builds)."""
    built = {distribution.program_path(name) for name, _ in distribution.PROGRAMS}
    return {str(p.relative_to(ROOT)) for package in PACKAGES for p in (ROOT / package).rglob("*")
            if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".so"} - built


class Built(NamedTuple):
    sdist: Path
    wheel: Path
    venv: Path  # the wheel installed, with its dependencies
    away: Path  # a working directory outside the checkout


@pytest.fixture(scope="module")
def built(dist: Dist, wheel_install: Installed, dist_top: Path) -> Built:
    return Built(dist.sdist, dist.wheel, wheel_install.venv, dist_top / "away")


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
def test_the_sdist_holds_the_sources_and_nothing_else(built: Built) -> None:
    """Every file of the packages (the C sources and their headers, the stubs, py.typed), the
    project's files and setuptools' metadata: no bytecode, no in-place build, no build folder."""
    with tarfile.open(built.sdist) as tar:
        members = tar.getmembers()
    top = members[0].name.split("/")[0]
    names = {m.name.removeprefix(top + "/") for m in members if m.isfile()}
    assert all(m.name == top or m.name.startswith(top + "/") for m in members)
    expected = package_files() | {"pyproject.toml", "setup.py", "MANIFEST.in", "README.md", *SDIST_METADATA}
    assert names == expected, sorted(names ^ expected)
    assert {source for _, sources in (*distribution.EXTENSIONS, *distribution.PROGRAMS) for source in sources} <= names


@pytest.mark.slow
@pytest.mark.timeout(TEST_TIMEOUT)
def test_the_wheel_holds_the_modules_the_compiled_parts_and_stubs_and_nothing_else(built: Built) -> None:
    with zipfile.ZipFile(built.wheel) as whl:
        names = {n for n in whl.namelist() if not n.endswith("/")}  # auditwheel adds the folders
        entry_points = "".join(whl.read(n).decode() for n in names if n.endswith(".dist-info/entry_points.txt"))
    suffix = sysconfig.get_config_var("EXT_SUFFIX")  # .cpython-311-x86_64-linux-gnu.so
    compiled = {name.replace(".", "/") + suffix for name in EXTENSIONS}
    programs = {distribution.program_path(name) for name, _ in distribution.PROGRAMS}
    sources = {name for name in package_files() if name.endswith((".c", ".h"))}
    metadata = {f"poprun_py-{__version__}.dist-info/{name}" for name in WHEEL_METADATA}
    expected = (package_files() - sources) | compiled | programs | metadata
    assert names == expected, sorted(names ^ expected)
    with zipfile.ZipFile(built.wheel) as whl:  # each program is installed executable
        assert all((whl.getinfo(name).external_attr >> 16) & 0o111 == 0o111 for name in programs)
    assert {f"{name.replace('.', '/')}.pyi" for name in IMPORTED} | {f"{p}/py.typed" for p in PACKAGES} <= names
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
                      r"order-sha256 [0-9a-f]{64} trained=True popdist_py=(\S+)")
    found = [m.groups() for m in map(line.fullmatch, result.stdout.splitlines()) if m]
    assert sorted((tag, index) for tag, index, _, _ in found) == [("0", "0"), ("1", "1")], result.stdout
    hashes = {digest for _, _, digest, _ in found}
    assert len(hashes) == 1, result.stdout
    assert all(Path(where).resolve().is_relative_to(built.venv.resolve()) for _, _, _, where in found)
    # the same weights as the two stages one after the other, 4 replicas in one process
    alone = check([*job, "--replicas", "4", "--sequential"], built.away, RUN_TIMEOUT, built.venv).stdout
    assert f"weights-sha256 {hashes.pop()} " in alone
