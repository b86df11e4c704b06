"""poprun's own output failing never ends supervision (issue 43, item 3): a reader that stops
reading, a full file system, a terminal that goes away under a background job, a stream closed
at start. The stream is dropped, said once on the other while that one works, and the job, its
restarts, --error-file and its exit status go on as they would have; "cannot start mpiexec" is
said only when mpiexec could not start.

Real pipes, a real pseudo-terminal, a real full tmpfs (mounted in a mount namespace of its own).
Each event is ordered by a message: the test cuts poprun's output off once it has read the job's
``waiting`` line, and only then lets the job go on (the file ``go``).
"""

from __future__ import annotations

import json
import os
import pty
import select
import subprocess
import time
from pathlib import Path

import pytest

from tests.helpers import OMP_SET, POPRUN, PYTHON, ROOT, SUBPROCESS_TIMEOUT, stop_poprun

pytestmark = pytest.mark.slow  # every test launches through poprun and mpiexec

JOB = str(ROOT / "tests" / "scripts" / "own_output_job.py")
BACKGROUND = str(ROOT / "tests" / "scripts" / "background_job.py")


def env() -> dict[str, str]:
    """poprun's environment, taken when it starts: under `make mutants` each mutant's run sets its
    name in the environment after this module was imported (a copy made at import would give every
    poprun the statistics run's, which runs no mutant)."""
    return {**os.environ, **OMP_SET}


def dropped(stream: str, why: str) -> bytes:
    return f"poprun: cannot write to {stream}: {why}; its output is dropped from now on (the job goes on)\n".encode()


def starts(tmp_path: Path) -> list[str]:
    return (tmp_path / "starts").read_text().split()


def records(error_file: Path) -> list[dict[str, object]]:
    found: list[dict[str, object]] = json.loads(error_file.read_text())
    return found


def job(tmp_path: Path, stream: str, lines: int, status: int, *wait: str) -> list[str]:
    return [PYTHON, JOB, str(tmp_path), stream, str(lines), str(status), *wait]


def test_a_reader_that_stops_reading_ends_neither_the_job_nor_its_restarts(tmp_path: Path) -> None:
    """``poprun --max-restarts 3 ... 2>&1 | head -1`` with an instance that fails: every start
    still runs (4), --error-file has each, and poprun exits with the instance's status, not 141."""
    error_file = tmp_path / "errors.json"
    proc = subprocess.Popen([*POPRUN, "--max-restarts", "3", "--restart-backoff", "0", "--error-file", str(error_file),
                             *job(tmp_path, "stdout", 200, 5, "wait")],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=ROOT, env=env(),
                            start_new_session=True)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline() == b"[0] waiting\n"
        proc.stdout.close()  # `head -1` has its line and goes away
        (tmp_path / "go").touch()
        proc.wait(timeout=SUBPROCESS_TIMEOUT)
    finally:
        stop_poprun(proc)
    assert proc.returncode == 5
    assert starts(tmp_path) == ["0", "1", "2", "3"]
    assert [(r["restart"], r["instance"], r["status"]) for r in records(error_file)] == [(n, 0, 5) for n in range(4)]


def test_a_reader_that_stops_reading_is_said_once_on_stderr_and_the_job_goes_on(tmp_path: Path) -> None:
    """``poprun ... | head -1`` with a healthy job: poprun says once, on stderr, that its stdout is
    dropped, and the job runs to its end (exit 0)."""
    proc = subprocess.Popen([*POPRUN, *job(tmp_path, "stdout", 200, 0, "wait")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT, env=env(), start_new_session=True)
    try:
        assert proc.stdout is not None and proc.stderr is not None
        assert proc.stdout.readline() == b"[0] waiting\n"
        proc.stdout.close()
        (tmp_path / "go").touch()
        _, stderr = proc.communicate(timeout=SUBPROCESS_TIMEOUT)
    finally:
        stop_poprun(proc)
    assert proc.returncode == 0, stderr
    assert stderr == dropped("stdout", "Broken pipe")
    assert (tmp_path / "done-0").exists()


def test_a_terminal_gone_under_a_background_job_ends_neither_the_job_nor_its_status(tmp_path: Path) -> None:
    """``poprun ... &`` on a terminal that then goes away (its window closed: the pseudo-terminal's
    master side is closed, so every write to it fails with EIO): the job runs to its end, and
    poprun's status is the instance's, with its record in --error-file."""
    error_file = tmp_path / "errors.json"
    master, slave = pty.openpty()
    try:
        shell = subprocess.Popen([PYTHON, BACKGROUND, *POPRUN, "--error-file", str(error_file),
                                  *job(tmp_path, "stdout", 200, 5, "wait")],
                                 stdin=slave, stdout=slave, stderr=slave, cwd=ROOT, env=env(), start_new_session=True)
    finally:
        os.close(slave)
    try:
        seen = bytearray()
        deadline = time.monotonic() + SUBPROCESS_TIMEOUT
        while b"[0] waiting" not in seen:
            assert time.monotonic() < deadline and shell.poll() is None, bytes(seen)
            if select.select([master], [], [], 1.0)[0]:
                seen += os.read(master, 1 << 16)
        os.close(master)  # the terminal goes away: its hangup, and EIO for every write to it
        master = -1
        (tmp_path / "go").touch()
        shell.wait(timeout=SUBPROCESS_TIMEOUT)
    finally:
        if master >= 0:
            os.close(master)
        stop_poprun(shell)
    assert shell.returncode == 5
    assert (tmp_path / "done-0").exists()
    [record] = records(error_file)
    assert (record["instance"], record["status"]) == (0, 5), record


def _full_file_system() -> list[str]:
    """A command prefix that runs its command with a 64 KiB tmpfs mounted on $1 in a mount namespace
    of its own (nothing leaks, it goes when the command ends); the command comes after $1."""
    for users in ([], ["--user", "--map-root-user"]):
        prefix = ["unshare", *users, "--mount", "--propagation", "private"]
        probe = subprocess.run([*prefix, "sh", "-c", 'mount -t tmpfs -o size=64k tmpfs "$1"', "sh", "/mnt"],
                               capture_output=True, timeout=SUBPROCESS_TIMEOUT)
        if probe.returncode == 0:
            return prefix
    pytest.skip("no mount namespace can be made here (unshare) for a small tmpfs")


@pytest.mark.parametrize("stream", ["stdout", "stderr"])
def test_a_full_file_system_ends_neither_the_job_nor_its_restarts(tmp_path: Path, stream: str) -> None:
    """poprun's stdout (stderr) is a file on a 64 KiB tmpfs and the instance writes 128 KiB there:
    the job goes on, its 3 restarts happen, --error-file has each start, poprun exits with the
    instance's status, and the other stream says once that the full one is dropped."""
    error_file = tmp_path / "errors.json"
    number = {"stdout": 1, "stderr": 2}[stream]
    full = tmp_path / "full"
    full.mkdir()
    script = f'mount -t tmpfs -o size=64k tmpfs "$1" && shift && exec "$@" {number}>"{full}/output"'
    result = subprocess.run([*_full_file_system(), "sh", "-c", script, "sh", str(full), *POPRUN,
                             "--max-restarts", "3", "--restart-backoff", "0", "--error-file", str(error_file),
                             *job(tmp_path, stream, 256, 5, "partial")],
                            capture_output=True, cwd=ROOT, env=env(), timeout=SUBPROCESS_TIMEOUT)
    assert result.returncode == 5, result
    assert starts(tmp_path) == ["0", "1", "2", "3"]
    assert [(r["restart"], r["instance"], r["status"]) for r in records(error_file)] == [(n, 0, 5) for n in range(4)]
    other = result.stderr if stream == "stdout" else result.stdout
    if stream == "stderr":  # the line an instance left unended on stdout is ended before poprun's own
        assert other.startswith(b"[0] partial\n" + dropped("stderr", "No space left on device")), other
    else:
        assert other.count(dropped("stdout", "No space left on device")) == 1, other
        assert other.count(b"poprun: restarting the job") == 3, other
        assert b"cannot start mpiexec" not in other


READS_STDIN = ("import sys; print('ran'); print('err', file=sys.stderr); "
               "open(sys.argv[1], 'w').write(repr(sys.stdin.read()) if sys.stdin else 'closed')")


@pytest.mark.parametrize("closed", [0, 1, 2])
def test_a_stream_closed_at_start_is_replaced_by_dev_null(tmp_path: Path, closed: int) -> None:
    """``poprun ... >&-`` (``2>&-``, ``<&-``): poprun runs the job as if that stream were /dev/null,
    with no traceback, and nothing poprun opens takes the stream's number; the program's stdin
    reads end-of-file at once."""
    seen = tmp_path / "stdin"
    result = subprocess.run(["sh", "-c", f'exec "$@" {closed}>&-', "sh", *POPRUN, PYTHON, "-c", READS_STDIN, str(seen)],
                            capture_output=True, cwd=ROOT, env=env(), timeout=SUBPROCESS_TIMEOUT)
    assert result.returncode == 0, result
    assert result.stdout == (b"" if closed == 1 else b"[0] ran\n")
    assert result.stderr == (b"" if closed == 2 else b"[0] err\n")
    assert seen.read_text() == "''"


def test_a_dry_run_whose_output_cannot_be_written_says_so_not_that_mpiexec_cannot_start() -> None:
    """``poprun --dry-run > /dev/full``: one line naming stdout and why, exit 1."""
    with open("/dev/full", "wb") as full:
        result = subprocess.run([*POPRUN, "--dry-run", "/bin/true"], stdout=full, stderr=subprocess.PIPE,
                                cwd=ROOT, env=env(), timeout=SUBPROCESS_TIMEOUT)
    assert result.returncode == 1
    assert result.stderr == b"poprun: error: cannot write to stdout: No space left on device\n"


def test_an_mpiexec_that_cannot_be_started_is_said_so(tmp_path: Path) -> None:
    """The one failure that is "cannot start mpiexec": its exec fails (here its interpreter is missing)."""
    mpiexec = tmp_path / "mpiexec"
    mpiexec.write_text("#!/nonexistent/interpreter\n")
    mpiexec.chmod(0o755)
    (tmp_path / "hydra_pmi_proxy").touch()  # MPICH's, by the files beside it
    result = subprocess.run([*POPRUN, "--mpi", str(mpiexec), "/bin/true"], capture_output=True, text=True,
                            cwd=ROOT, env=env(), timeout=SUBPROCESS_TIMEOUT)
    assert (result.returncode, result.stderr) == (1, "poprun: error: cannot start mpiexec: No such file or directory\n")
