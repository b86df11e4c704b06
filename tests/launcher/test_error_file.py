"""--error-file writes the failure where it is told and nothing else: a regular file is replaced
whole, a link is followed, anything else is written to and never replaced. A place that could not
take the record is refused before anything starts, in one line; what fails only when the record is
written (a disk that filled meanwhile) is one warning that leaves no file behind."""

from __future__ import annotations

import json
import os
import resource
import stat
import subprocess
from pathlib import Path

import pytest

from tests.helpers import OMP_SET, POPRUN, ROOT, SUBPROCESS_TIMEOUT, poprun, resolved_as_unknown

FAIL = ("/bin/sh", "-c", "echo the real cause >&2; exit 3")


def _failed_job(error_file: Path, *, file_size_limit: int | None = None) -> subprocess.CompletedProcess[str]:
    def limit() -> None:
        if file_size_limit is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (file_size_limit, file_size_limit))

    result = subprocess.run([*POPRUN, "--error-file", str(error_file), *FAIL], capture_output=True, text=True,
                            timeout=SUBPROCESS_TIMEOUT, cwd=ROOT, preexec_fn=limit)
    assert result.returncode == 3, result.stderr
    return result


def _warning(result: subprocess.CompletedProcess[str]) -> list[str]:
    return [line.split(" POPRUN [W] ", 1)[1] for line in result.stderr.splitlines() if " POPRUN [W] " in line]


@pytest.mark.slow  # starts poprun
def test_a_regular_file_is_replaced_whole_and_keeps_its_permissions(tmp_path: Path) -> None:
    target = tmp_path / "error.json"
    target.write_text("old")
    target.chmod(0o600)
    result = _failed_job(target)
    [report] = json.loads(target.read_text())  # one start, one record
    assert (report["instance"], report["status"], report["stderr_tail"]) == (0, 3, ["the real cause"])
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["error.json"]  # no temporary file left
    assert _warning(result) == []


@pytest.mark.slow  # starts poprun
def test_a_link_is_followed_not_replaced(tmp_path: Path) -> None:
    real, link = tmp_path / "real.json", tmp_path / "link.json"
    real.write_text("old")
    link.symlink_to(real)
    _failed_job(link)
    assert link.is_symlink() and os.readlink(link) == str(real)
    assert json.loads(real.read_text())[-1]["status"] == 3


@pytest.mark.slow  # starts poprun
def test_a_fifo_with_a_reader_gets_the_report_and_stays_a_fifo(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # the reader is there before poprun starts
    try:
        _failed_job(fifo)
        got = os.read(reader, 1 << 20)  # poprun has exited: all it wrote is in the pipe
    finally:
        os.close(reader)
    assert json.loads(got)[-1]["status"] == 3
    assert stat.S_ISFIFO(fifo.lstat().st_mode)


@pytest.mark.slow  # starts poprun
def test_stderr_that_is_a_pipe_gets_the_report_in_place() -> None:
    # /dev/stderr names a pipe here (the captured stderr): written to, as a terminal would be.
    result = subprocess.run([*POPRUN, "--error-file", "/dev/stderr", *FAIL], capture_output=True, text=True,
                            timeout=SUBPROCESS_TIMEOUT, cwd=ROOT)
    assert result.returncode == 3 and " POPRUN [W] " not in result.stderr, result.stderr
    report = json.JSONDecoder().raw_decode(result.stderr[result.stderr.index("[\n"):])[0]
    assert (report[-1]["status"], report[-1]["stderr_tail"]) == (3, ["the real cause"])


def _refused(error_file: str | Path, tmp_path: Path) -> str:
    """poprun's one line for an --error-file it refuses: exit 2, and the program never ran."""
    ran = tmp_path / "ran"
    result = poprun("--error-file", str(error_file), "/bin/sh", "-c", f"touch {ran}; exit 3")
    assert result.returncode == 2 and result.stdout == "", result
    assert not ran.exists()
    [line] = result.stderr.splitlines()
    return line


@pytest.mark.slow  # starts poprun
def test_a_fifo_no_one_reads_is_refused_before_anything_starts(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    assert _refused(fifo, tmp_path) == (f"poprun: error: --error-file '{fifo}' is a FIFO that no one reads "
                                        "(start its reader first)")
    assert stat.S_ISFIFO(fifo.lstat().st_mode)


@pytest.mark.slow  # starts poprun
def test_dev_full_is_refused_before_anything_starts(tmp_path: Path) -> None:
    assert _refused("/dev/full", tmp_path) == ("poprun: error: --error-file '/dev/full' cannot be written: "
                                               "No space left on device")


@pytest.mark.slow  # starts poprun
@pytest.mark.skipif(os.geteuid() != 0, reason="making a device node needs root")
def test_a_device_that_refuses_writes_is_refused_and_never_replaced(tmp_path: Path) -> None:
    # A private node with /dev/full's numbers (1, 7): every write fails with ENOSPC.
    full = tmp_path / "full"
    os.mknod(full, stat.S_IFCHR | 0o666, os.makedev(1, 7))
    said = _refused(full, tmp_path)
    assert said == f"poprun: error: --error-file '{full}' cannot be written: No space left on device"
    assert stat.S_ISCHR(full.lstat().st_mode) and sorted(p.name for p in tmp_path.iterdir()) == ["full"]


@pytest.mark.slow  # starts poprun
@pytest.mark.parametrize("name, why", [
    ("{tmp}/missing/error.json", "is in a folder that does not exist ({tmp}/missing)"),
    # /proc takes no new file, whoever asks (root too).
    ("/proc/error.json", "cannot be written: no file can be made in /proc: No such file or directory"),
    ("{tmp}/a-file/error.json", "cannot be reached: Not a directory"),
])
def test_a_place_that_cannot_take_the_record_is_refused_before_anything_starts(
        tmp_path: Path, name: str, why: str) -> None:
    (tmp_path / "a-file").write_text("")
    name, why = name.format(tmp=tmp_path), why.format(tmp=tmp_path)
    assert _refused(name, tmp_path) == f"poprun: error: --error-file '{name}' {why}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]  # the check left nothing


@pytest.mark.slow  # starts poprun
def test_a_failed_write_leaves_the_old_file_and_no_temporary_one(tmp_path: Path) -> None:
    target = tmp_path / "error.json"
    target.write_text("old")
    result = _failed_job(target, file_size_limit=16)  # the JSON is longer: the write fails (EFBIG)
    assert _warning(result) == [f"cannot write the error file {target}: File too large"]
    assert target.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["error.json"]


@pytest.mark.slow  # starts poprun
def test_a_directory_is_refused_before_anything_starts(tmp_path: Path) -> None:
    result = poprun("--error-file", str(tmp_path), *FAIL)
    assert result.returncode == 2
    assert result.stderr == f"poprun: error: Invalid value for '--error-file': File '{tmp_path}' is a directory.\n"


@pytest.mark.slow  # starts poprun
def test_a_launch_that_fails_is_recorded_with_the_host_that_could_not_start(tmp_path: Path) -> None:
    """A host that cannot be started on is poprun's reason, not an instance's: the record has no
    instance, says why, and lists the host lost; the restart then has no host left and says so.
    (RFC 6761's .invalid never resolves; the machine's resolver is asked once.)"""
    report = tmp_path / "attempts.json"
    result = poprun("--error-file", str(report), "--max-restarts", "1", "--restart-backoff", "0", "--num-instances",
                    "2", "-H", "ghost.invalid", "/bin/true", env=OMP_SET)
    why = "ssh: Could not resolve hostname ghost.invalid: Name or service not known"
    said = f"instance(s) 0-1 could not be started: host ghost.invalid: {why}"
    assert (result.returncode, resolved_as_unknown(result.stderr)) == (255, (
        f"poprun: error: {said}\npoprun: not restarting: 0 host(s) left (none), fewer than --min-hosts 1; left out "
        "after failing: ghost.invalid for 60 s\n"))
    [record] = json.loads(resolved_as_unknown(report.read_text()))
    assert {key: record[key] for key in ("restart", "hosts", "instances", "instance", "host", "status", "reason",
                                          "lost_hosts")} == {
        "restart": 0, "hosts": ["ghost.invalid"], "instances": 2, "instance": None, "host": None, "status": 255,
        "reason": said, "lost_hosts": {"ghost.invalid": why}}


def test_a_fifo_reader_that_never_reads_cannot_hold_poprun(tmp_path: Path) -> None:
    # A reader holds the FIFO open and reads nothing: once its one-page pipe is full, the record's
    # writer waits at most its limit, then gives up with TimeoutError (the caller's warning).
    from poprun_py.supervision.error_file import write_within

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    writer = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
    try:
        import fcntl

        fcntl.fcntl(writer, fcntl.F_SETPIPE_SZ, 4096)
        with pytest.raises(TimeoutError, match=r"took none of it for 0\.2 s"):
            write_within(writer, b"x" * 3 * 4096, 0.2)
        assert len(os.read(reader, 1 << 16)) == 4096  # what fitted, and no more
    finally:
        os.close(writer)
        os.close(reader)


def test_a_slow_fifo_reader_gets_the_whole_record(tmp_path: Path) -> None:
    import fcntl
    import threading

    from poprun_py.supervision.error_file import write_within

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    writer = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
    fcntl.fcntl(writer, fcntl.F_SETPIPE_SZ, 4096)
    os.set_blocking(reader, True)
    text = bytes(range(256)) * 200  # 51,200 bytes: a dozen pipes' worth
    got = bytearray()

    def read_all() -> None:
        while chunk := os.read(reader, 1000):
            got.extend(chunk)

    thread = threading.Thread(target=read_all)
    thread.start()
    try:
        write_within(writer, text, 30.0)
    finally:
        os.close(writer)
        thread.join(timeout=30)
        os.close(reader)
    assert bytes(got) == text
