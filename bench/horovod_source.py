"""The files of Horovod's that the suite runs, taken from a checkout or a git directory into a folder.

Only these files leave Horovod's tree, into a folder outside this repository (the project runs
Horovod's tests and examples, never copies them in), and never Horovod's own ``horovod`` package:
had the folder one, the ``horovod`` that ``poprun --horovod`` gives would import it instead, since
an installed Horovod wins.
"""

from __future__ import annotations

import io
import shutil
import subprocess
import tarfile
from pathlib import Path

#: test_torch.py with its helpers where Horovod keeps them: its ../utils/common.py, and the
#: conftest.py and setup.cfg ([tool:pytest]) that make Horovod's tree pytest's root, not ours.
SUITE = "test/parallel/test_torch.py"
SUITE_FILES = (SUITE, "test/utils/common.py", "test/conftest.py", "setup.cfg")
SYNTHETIC = "examples/pytorch/pytorch_synthetic_benchmark.py"
MNIST = "examples/pytorch/pytorch_mnist.py"
FILES = (*SUITE_FILES, SYNTHETIC, MNIST)


class SourceError(Exception):
    pass


def _git(git_dir: Path, *args: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(["git", f"--git-dir={git_dir}", *args], capture_output=True, timeout=120)


def _git_dir(source: Path) -> Path | None:
    """``source``'s git directory: itself (a bare repository or mirror), its .git, or None."""
    for candidate in (source, source / ".git"):
        if candidate.exists() and _git(candidate, "rev-parse", "--verify", "-q", "HEAD").returncode == 0:
            return candidate
    return None


def extract(source: Path, into: Path) -> str:
    """Put FILES from ``source`` (a checkout's folder or a git directory) under ``into``, laid out as
    in Horovod's tree; Horovod's commit (HEAD's, "" for a folder outside git)."""
    git_dir = _git_dir(source)
    commit = _git(git_dir, "rev-parse", "HEAD").stdout.decode().strip() if git_dir else ""
    if (source / SUITE).is_file():
        # a checkout: its files as they are on disk, edits included
        for name in FILES:
            if not (source / name).is_file():
                raise SourceError(f"{source} has no {name}: not a Horovod checkout")
            (into / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source / name, into / name)
        return commit
    if git_dir is None:
        raise SourceError(f"{source} is neither a Horovod checkout (no {SUITE}) nor a git directory")
    archive = _git(git_dir, "archive", "--format=tar", "HEAD", *FILES)
    if archive.returncode != 0:
        raise SourceError(f"git archive in {git_dir}: {archive.stderr.decode().strip()}")
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(into, filter="data")
    return commit
