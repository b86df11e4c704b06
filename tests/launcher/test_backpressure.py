"""A reader that does not keep up with poprun's output, and a poprun that is stopped, are
back-pressure, not lost hosts: the job is held back, every line arrives, and it ends with status 0.

Real pipes, real signals, and pauses longer than the jobs' silence limit (``POPRUN_SILENCE_LIMIT``,
set to ``helpers.SILENCE_LIMIT`` as a user could: the default 20 s would only make them longer).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path
from typing import BinaryIO

import pytest

from tests.helpers import (
    OMP_SET,
    POPRUN,
    PYTHON,
    ROOT,
    SHORT_SILENCE,
    SILENCE_LIMIT,
    SUBPROCESS_TIMEOUT,
    job_marker,
    processes_matching,
    wait_no_processes,
    wait_until,
)
from tests.launcher.job_shell import held_back, written

pytestmark = pytest.mark.slow  # every test starts poprun; two pause it past the silence limit
PRINTER = str(ROOT / "tests" / "scripts" / "printer.py")
#: Longer than poprun's and the stubs' silence limit: what used to count as a lost host.
PAUSE = SILENCE_LIMIT + 5


def start(folder: Path, instances: int = 2, stdout: int | BinaryIO = subprocess.PIPE) -> subprocess.Popen[bytes]:
    """poprun running the printer (its folder on its command line marks the job's processes)."""
    return subprocess.Popen([*POPRUN, "--num-instances", str(instances), PYTHON, PRINTER, str(folder)],
                            stdout=stdout, stderr=subprocess.PIPE, cwd=ROOT,
                            env={**os.environ, **OMP_SET, **SHORT_SILENCE})


def programs(folder: Path) -> list[int]:
    """The printers' PIDs (poprun's own command line names the printer too)."""
    return [int(line.split(":")[0]) for line in processes_matching(str(folder))
            if PRINTER in line and "poprun_py" not in line]


def read_until_each_has_printed(proc: subprocess.Popen[bytes], instances: int = 2) -> bytes:
    """Read poprun's output until a line of every instance has come (each program has its
    program and runs), then stop reading: the bytes read so far (unbuffered, as ``communicate``
    reads the rest)."""
    assert proc.stdout is not None
    read = b""
    while not all(f"[{i}] ".encode() in read for i in range(instances)):
        chunk = os.read(proc.stdout.fileno(), 1 << 16)
        assert chunk, read[-2000:]
        read += chunk
    return read


def check_every_line(stdout: bytes, folder: Path, instances: int = 2) -> None:
    """Every line each printer wrote arrived, tagged, in order, nothing else."""
    lines: dict[str, list[int]] = {str(i): [] for i in range(instances)}
    for line in stdout.splitlines():
        match = re.fullmatch(rb"\[(\d+)\] +(\d+) x{90}", line)
        assert match, line[:200]
        lines[match.group(1).decode()].append(int(match.group(2)))
    for index, numbers in lines.items():
        count = int((folder / f"done-{index}").read_text())
        assert numbers == list(range(count)), (index, count, len(numbers))


def test_a_reader_that_pauses_longer_than_the_silence_limit_holds_the_job_back(tmp_path: Path) -> None:
    """``poprun ... | (sleep 13; cat)``: while nothing reads poprun's output, the programs wait on
    their pipes (no progress), nothing is lost, and the job then ends with status 0."""
    proc = start(tmp_path)
    try:
        shown = read_until_each_has_printed(proc)  # (a reader that pauses from the start holds back
        paused_at = time.monotonic()               # the programs' start too: the program is poprun's to give)
        pids = programs(tmp_path)
        progress = held_back(pids)
        time.sleep(max(0.0, paused_at + PAUSE - time.monotonic()))  # the pause is what is tested
        assert proc.poll() is None and written(pids) == progress  # still held back, and still there
        (tmp_path / "stop").touch()
        stdout, stderr = proc.communicate(timeout=SUBPROCESS_TIMEOUT)
    finally:
        proc.kill()
    assert proc.returncode == 0 and stderr == b"", stderr.decode()
    check_every_line(shown + stdout, tmp_path)


def test_a_poprun_stopped_longer_than_the_silence_limit_goes_on_when_continued(tmp_path: Path) -> None:
    """``kill -STOP`` on poprun while its instances print, for longer than the silence limit, then
    ``kill -CONT``: the stubs took it for paused, not gone (poprun's kernel still acknowledges), the
    programs were held back, not stopped, and every line arrives: status 0."""
    with open(tmp_path / "out", "wb") as out:  # a file: always read at once
        proc = start(tmp_path, stdout=out)
    try:
        pids: list[int] = []

        def both_started() -> bool:  # the look that saw both is the one used: a later one may see one
            pids[:] = programs(tmp_path)
            return len(pids) == 2

        wait_until(both_started, "the printers started")
        proc.send_signal(signal.SIGSTOP)
        progress = held_back(pids)  # poprun's socket buffers are full: the programs wait
        time.sleep(PAUSE)  # from now on only the stubs' judgement could end them
        assert programs(tmp_path) == pids and written(pids) == progress
        proc.send_signal(signal.SIGCONT)
        (tmp_path / "stop").touch()
        stderr = proc.communicate(timeout=SUBPROCESS_TIMEOUT)[1]
    finally:
        proc.send_signal(signal.SIGCONT)
        proc.kill()
    assert proc.returncode == 0 and stderr == b"", stderr.decode()
    check_every_line((tmp_path / "out").read_bytes(), tmp_path)


def test_ctrl_c_while_the_reader_is_paused_stops_the_programs_at_once(tmp_path: Path) -> None:
    """``poprun ... | less``, Ctrl-C: the programs are stopped at once, though poprun's own write
    still waits for its reader; once the output is read, poprun ends with 130."""
    proc = start(tmp_path)
    try:
        read_until_each_has_printed(proc)
        held_back(programs(tmp_path))  # poprun's write waits for its reader
        proc.send_signal(signal.SIGINT)
        wait_until(lambda: programs(tmp_path) == [], "the programs stopped", within=10)
        assert proc.poll() is None  # its write still waits
        _, stderr = proc.communicate(timeout=SUBPROCESS_TIMEOUT)
    finally:
        proc.kill()
    assert proc.returncode == 130 and "poprun: interrupted by SIGINT" in stderr.decode(), stderr.decode()


def test_a_killed_poprun_is_noticed_at_once_by_stubs_that_wait_to_send(tmp_path: Path) -> None:
    """A dead poprun is not a paused one: its kernel resets the connections, and stubs held back
    by its unread output stop their programs at once."""
    marker = job_marker()  # in the environment of the job's every process: mpiexec and the stubs too
    proc = start(tmp_path)
    try:
        read_until_each_has_printed(proc)
        held_back(programs(tmp_path))
        proc.kill()
        proc.wait(timeout=SUBPROCESS_TIMEOUT)
        wait_until(lambda: programs(tmp_path) == [], "the programs stopped", within=5)
        # ... and the stubs and mpiexec end after them, the stubs having removed what they made
        assert wait_no_processes(marker, within=5) == []
    finally:
        proc.kill()
