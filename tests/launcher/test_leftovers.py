"""What poprun removes after a teardown: files MPICH's killed processes left, and nothing in use."""

from __future__ import annotations

import mmap
import os
import re
import time
import uuid
from pathlib import Path

from poprun_py import leftovers
from tests.helpers import PYTHON, ROOT, run


def _made(place: tuple[str, str], tag: str) -> Path:
    directory, prefix = place
    path = Path(directory) / f"{prefix}test_{tag}"
    path.write_bytes(b"\0" * 4096)
    return path


def test_files_left_by_killed_processes_are_removed_and_named_and_files_in_use_or_older_are_kept() -> None:
    tag = uuid.uuid4().hex
    since = time.time() - 1  # the job's start: a second ago
    left = [_made(leftovers.SHARED_MEMORY, f"{tag}_left"), _made(leftovers.HYDRA_TOPOLOGY, f"{tag}_left")]
    opened, mapped, older = (_made(leftovers.SHARED_MEMORY, f"{tag}_{name}") for name in ("open", "mapped", "older"))
    os.utime(older, (since - 60, since - 60))
    with opened.open("rb"), mapped.open("r+b") as handle, mmap.mmap(handle.fileno(), 4096) as _:
        handle.close()  # mapped only: no descriptor left open
        code = ("import sys; from poprun_py import log, teardown; log.configure(2); "
                "teardown.remove_files_left(float(sys.argv[1]))")
        result = run([PYTHON, "-c", code, repr(since)], cwd=ROOT)
        assert result.returncode == 0, result.stderr
        assert opened.exists() and mapped.exists()
    try:
        assert older.exists() and not any(path.exists() for path in left)
        named = re.findall(r"^\S+ \d+ POPRUN \[D\] removed (\S+), left by the job's killed processes$",
                           result.stderr, re.MULTILINE)
        assert {path for path in named if tag in path} == {str(path) for path in left}, result.stderr
    finally:
        for path in (opened, mapped, older, *left):
            path.unlink(missing_ok=True)
