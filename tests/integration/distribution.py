"""``make dist``'s sdist and wheel, built once per session, and fresh venvs that install them with no
C compiler reachable (tests/integration/test_dist.py, test_package.py; docs/packaging.md).

``make dist`` itself runs ``python -m tests.integration.distribution WHEEL``: every compiled part
is optional at build time, so a part the toolchain failed to build would leave a wheel without it
and setuptools would go on; this fails the target instead, naming the part.

Offline where it can be: the dependencies are fetched into a wheelhouse kept in the venv
(``.venv/wheelhouse``), at the versions this venv has (a job there and in a fresh venv then
computes with the same numpy), and every install takes them from there with ``--no-index``. The
package index is asked only when the wheelhouse lacks one of them (a first run, a new version).
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from pathlib import Path
from typing import Any, NamedTuple

from tests.helpers import BIN, ROOT

#: Bounds: `make dist` (a first one installs its tools, zig among them, and fills zig's cache),
#: filling the wheelhouse, one install (the sdist's builds first), one command of a fresh venv.
MAKE_TIMEOUT, DOWNLOAD_TIMEOUT, INSTALL_TIMEOUT, RUN_TIMEOUT = 420, 300, 300, 90
WHEELHOUSE = BIN.parent / "wheelhouse"
#: `make dist`'s tools (the Makefile's DIST_VENV): auditwheel among them.
DIST_TOOLS = BIN.parent / "dist" / "bin"
#: A C or C++ compiler or a driver of one, by its name on PATH: cc, c++, gcc-12, x86_64-linux-gnu-gcc,
#: clang++, c99, cpp, zig, MPICH's mpicc and mpicxx. None of them is reachable in a fresh venv here.
COMPILER = re.compile(r"(?:[\w.+-]+-)?"  # a target's triplet: x86_64-linux-gnu-
                      r"(?:cc|c\+\+|gcc|g\+\+|cpp|clang(?:\+\+)?|c89|c99|tcc|icx|zig|mpic(?:c|xx|\+\+)\w*)"
                      r"(?:-[\d.]+)?(?:-gcc)?")
#: What the program that stands in for CC and CXX says: the build fails where it would compile.
NO_COMPILER = "no C compiler on this machine"


def pyproject() -> dict[str, Any]:
    with (ROOT / "pyproject.toml").open("rb") as f:
        return tomllib.load(f)


#: The compiled parts, as pyproject.toml builds them: (module, its sources and headers).
EXTENSIONS = tuple((module["name"], (*module["sources"], *module.get("depends", ())))
                   for module in pyproject()["tool"]["setuptools"]["ext-modules"])
#: The compiled programs (setup.py builds them): (name, its sources), e.g. "poprun_py.stub.poprun-stub".
PROGRAMS = tuple((program["name"], tuple(program["sources"]))
                 for program in pyproject()["tool"]["poprun-py"]["programs"])


def program_path(name: str) -> str:
    """Where program ``name`` lies in a wheel or an install ("poprun_py/stub/poprun-stub")."""
    package, _, file = name.rpartition(".")
    return f"{package.replace('.', '/')}/{file}"


def outside_env(venv: Path | None = None) -> dict[str, str]:
    """This environment without Python's, PopDist's or make's variables (no PYTHONPATH into the
    checkout, no jobserver of an outer make), ``venv``'s bin first on PATH."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PYTHON", "POPDIST_", "POPRUN_", "MAKE")) and k not in ("VIRTUAL_ENV", "MFLAGS")}
    if venv is not None:
        env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    return env


def check(cmd: list[str | Path], cwd: Path, timeout: float, venv: Path | None = None,
          env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``cmd``, which must succeed within ``timeout``, in ``env`` (default: :func:`outside_env`)."""
    result = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env or outside_env(venv), capture_output=True,
                            text=True, timeout=timeout)
    assert result.returncode == 0, f"{cmd} exited {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


class Dist(NamedTuple):
    sdist: Path
    wheel: Path
    folder: Path  # make dist's DIST_DIR


class Installed(NamedTuple):
    venv: Path
    env: dict[str, str]  # the venv's bin first on PATH, no compiler reachable (compiler_free_env)
    log: str  # what pip said while it installed


def make_dist(folder: Path) -> Dist:
    """``make dist`` into ``folder``: exactly one sdist and one wheel."""
    check(["make", "--no-print-directory", "dist", f"DIST_DIR={folder}"], ROOT, MAKE_TIMEOUT)
    (sdist,), (wheel,) = folder.glob("*.tar.gz"), folder.glob("*.whl")
    return Dist(sdist, wheel, folder)


def requirements() -> list[str]:
    """What installing the package with its examples needs: its dependencies, the examples extra's,
    and what its build from the sdist needs (pyproject's [build-system])."""
    project = pyproject()
    return [*project["project"]["dependencies"], *project["project"]["optional-dependencies"]["examples"],
            *project["build-system"]["requires"]]


def fill_wheelhouse(top: Path) -> Path:
    """:data:`WHEELHOUSE` with :func:`requirements` at this venv's versions: from itself when it
    has them all, from the package index (through pip's cache) otherwise."""
    build = {_name(requirement) for requirement in pyproject()["build-system"]["requires"]}
    versions: dict[str, str] = {}
    for installed in importlib.metadata.distributions():
        name = _name(installed.metadata["Name"] or "")
        if name and name not in build and name != "poprun-py":
            versions.setdefault(name, installed.version)
    constraints = top / "constraints.txt"
    constraints.write_text("".join(f"{name}=={version}\n" for name, version in sorted(versions.items())))
    download: list[str | Path] = [sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check",
                                  "--dest", WHEELHOUSE, "--constraint", constraints, *requirements()]
    offline = subprocess.run([str(c) for c in [*download, "--no-index", "--find-links", WHEELHOUSE]],
                             cwd=top, env=outside_env(), capture_output=True, timeout=DOWNLOAD_TIMEOUT)
    if offline.returncode != 0:
        check(download, top, DOWNLOAD_TIMEOUT)
    return WHEELHOUSE


def _name(requirement: str) -> str:
    """A requirement's project name, normalized ("setuptools>=77" -> "setuptools")."""
    m = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", requirement)
    return re.sub(r"[-_.]+", "-", m.group(0)).lower() if m else ""


def compiler_free_env(top: Path, venv: Path) -> dict[str, str]:
    """:func:`outside_env` as on a machine without a C compiler: on PATH, ``venv``'s bin and links to
    every program of this PATH but :data:`COMPILER`'s (none from the checkout's venv), and CC and
    CXX a program that fails, saying :data:`NO_COMPILER`, and writes what it was given to
    ``top/cc.log``."""
    links = top / "path"
    if not links.exists():
        links.mkdir()
        for folder in os.environ.get("PATH", "").split(os.pathsep):
            where = Path(folder)
            if not where.is_dir() or where.resolve().is_relative_to(ROOT):
                continue
            for program in where.iterdir():
                if (not COMPILER.fullmatch(program.name) and not (links / program.name).exists()
                        and program.is_file() and os.access(program, os.X_OK)):
                    (links / program.name).symlink_to(program)
        cc = top / "no-cc"
        cc.write_text(f'#!/bin/sh\necho "$*" >> "{top / "cc.log"}"\necho "{NO_COMPILER}" >&2\nexit 1\n')
        cc.chmod(0o755)
    env = outside_env()
    env.update(PATH=f"{venv / 'bin'}{os.pathsep}{links}", CC=str(top / "no-cc"), CXX=str(top / "no-cc"))
    return env


def install_command(venv: Path, archive: Path, wheelhouse: Path, extras: str = "") -> list[str | Path]:
    """pip (this venv's, for the fresh ``venv``) installing ``archive`` (with ``extras``, e.g.
    "[examples]"), everything else from ``wheelhouse`` alone, no wheel of an earlier build reused."""
    return [sys.executable, "-m", "pip", "--python", venv / "bin" / "python", "install", "--quiet",
            "--disable-pip-version-check", "--no-cache-dir", "--no-index", "--find-links", wheelhouse,
            f"poprun-py{extras} @ {archive.as_uri()}"]


#: How ``poprun --version``'s last line begins: what runs each instance on poprun's host.
RUNS_UNDER = "each instance on this host runs under: "


def reported_parts(version_output: str) -> dict[str, str]:
    """``{module: "present" | "missing"}`` from ``poprun --version``'s lines between the first and
    the last (RUNS_UNDER)."""
    found = {}
    lines = version_output.splitlines()
    assert lines[-1].startswith(RUNS_UNDER), version_output
    for line in lines[1:-1]:
        m = re.match(r"(\S+): (present|missing)\b", line)
        assert m, f"not a line of the compiled parts' report: {line!r}"
        found[m.group(1)] = m.group(2)
    return found


def missing_parts(wheel: Path) -> list[str]:
    """The compiled parts (pyproject's ext-modules and programs) that ``wheel`` lacks."""
    with zipfile.ZipFile(wheel) as whl:
        names = set(whl.namelist())
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    return ([name for name, _ in EXTENSIONS if name.replace(".", "/") + suffix not in names]
            + [name for name, _ in PROGRAMS if program_path(name) not in names])


if __name__ == "__main__":
    for path in sys.argv[1:]:
        if missing := missing_parts(Path(path)):
            sys.exit(f"make dist: {path} lacks the compiled part(s) {', '.join(missing)}: their build failed "
                     f"({Path(path).parent / 'build.log'} says why)")
