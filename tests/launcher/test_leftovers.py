"""What poprun removes after a teardown: files MPICH's killed processes left, and nothing in use."""

from __future__ import annotations

import mmap
import os
import re
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from poprun_py.shared import leftovers
from tests.helpers import PYTHON, ROOT, SUBPROCESS_TIMEOUT, live_command_line, run, task_state

pytestmark = pytest.mark.slow  # every test starts Python


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
        code = ("import sys; from poprun_py.supervision import log, teardown; log.configure(2); "
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


#: A process whose main thread ends while another thread goes on holding a mapping of the file named
#: on its command line, until its standard input is closed.
_MAIN_THREAD_ENDS = """
import ctypes, mmap, os, sys, threading
fd = os.open(sys.argv[1], os.O_RDWR)
held = mmap.mmap(fd, 4096)
os.close(fd)
def hold():
    sys.stdin.read()
    os._exit(0)
threading.Thread(target=hold).start()
ctypes.CDLL(None).pthread_exit(None)
"""


def test_a_file_mapped_by_a_thread_that_outlives_its_main_thread_is_in_use_until_that_thread_ends() -> None:
    since = time.time()
    path = _made(leftovers.SHARED_MEMORY, f"{uuid.uuid4().hex}_thread")
    child = subprocess.Popen([PYTHON, "-c", _MAIN_THREAD_ENDS, str(path)], stdin=subprocess.PIPE)
    try:
        deadline = time.monotonic() + SUBPROCESS_TIMEOUT
        while task_state(f"/proc/{child.pid}") != "Z":  # its main thread has ended: its own maps read empty
            assert time.monotonic() < deadline and child.poll() is None, "the main thread did not end"
            time.sleep(0.01)
        assert leftovers.users({str(path)}) == {str(path): [child.pid]}
        assert str(path) in (live_command_line(child.pid) or "")  # live for the suite's process checks too
        assert leftovers.remove_unused(leftovers.SHARED_MEMORY, since) == [] and path.exists()
        assert child.stdin is not None
        child.stdin.close()
        assert child.wait(timeout=SUBPROCESS_TIMEOUT) == 0
        assert leftovers.users({str(path)}) == {}
    finally:
        child.kill()
        child.wait()
        path.unlink(missing_ok=True)
