"""Instances' output through a real ``poprun``: partial lines and progress bars stream through
tagged, two instances never share a line, per-instance log files, timestamps.

Concurrent events are ordered by messages: a test reads poprun's output as it comes and creates
the file an instance waits for only once it has seen what must come first.
"""

from __future__ import annotations

import datetime
import os
import random
import re
import select
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.helpers import (
    OMP_SET,
    POPRUN,
    PYTHON,
    ROOT,
    SUBPROCESS_TIMEOUT,
    job_marker,
    poprun,
    stop_poprun,
    wait_no_processes,
)
from tests.launcher.rendering import rendered

pytestmark = pytest.mark.slow  # every test launches through poprun and mpiexec

SCRIPT = str(ROOT / "tests" / "scripts" / "partial_output.py")


class Running:
    """A poprun started in the background whose stdout and stderr are read as they come."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen([*POPRUN, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     cwd=ROOT, start_new_session=True)
        assert self.proc.stdout is not None and self.proc.stderr is not None
        self.pipes = {self.proc.stdout.fileno(): 1, self.proc.stderr.fileno(): 2}
        self.out = {1: bytearray(), 2: bytearray()}
        self.deadline = time.monotonic() + SUBPROCESS_TIMEOUT

    def _read(self) -> bool:
        """Read what is there (waiting until something is); False at EOF of both or the deadline."""
        if not self.pipes:
            return False
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            return False
        ready, _, _ = select.select(list(self.pipes), [], [], remaining)
        for fd in ready:
            data = os.read(fd, 1 << 16)
            if data:
                self.out[self.pipes[fd]] += data
            else:
                del self.pipes[fd]
        return True

    def wait_for(self, stream: int, pattern: bytes) -> bytes:
        """Everything on ``stream`` so far, once ``pattern`` (a regex) is in it."""
        while not re.search(pattern, self.out[stream]):
            if not self._read():
                self.kill()
                raise AssertionError(f"{pattern!r} never came; stdout {bytes(self.out[1])!r}, "
                                     f"stderr {bytes(self.out[2])!r}")
        return bytes(self.out[stream])

    def finish(self) -> int:
        while self._read():
            pass
        try:
            return self.proc.wait(timeout=max(1.0, self.deadline - time.monotonic()))
        finally:
            self.kill()

    def kill(self) -> None:
        stop_poprun(self.proc)
        for pipe in (self.proc.stdout, self.proc.stderr):
            assert pipe is not None
            pipe.close()


# ------------------------------------------------------------------ streaming partial lines
@pytest.mark.parametrize("options,index", [((), 0), (("--num-instances", "2", "--only-output-from-instance", "1"), 1)])
def test_a_progress_line_shows_before_its_newline(tmp_path: Path, options: tuple[str, ...], index: int) -> None:
    go = tmp_path / "go"
    job = Running(*options, PYTHON, SCRIPT, "progress", str(go))
    try:
        seen = job.wait_for(1, rb"progress")  # the program waits for `go` before its newline
        assert seen == f"[{index}] progress {index}\r".encode()
    finally:
        go.touch()
    assert job.finish() == 0, job.out[2]
    assert bytes(job.out[1]) == f"[{index}] progress {index}\r[{index}] done {index}\n".encode()


def test_a_line_left_unfinished_is_ended_for_another_instance(tmp_path: Path) -> None:
    go0, go1 = tmp_path / "go0", tmp_path / "go1"
    job = Running("--num-instances", "2", PYTHON, SCRIPT, "hold", str(go0), str(go1))
    try:
        assert job.wait_for(1, rb"partial") == b"[0] partial 0"
        go1.touch()  # instance 1's whole line waits for instance 0's, then poprun ends that one
        assert job.wait_for(1, rb"line 1\n") == b"[0] partial 0\n[1] line 1\n"
    finally:
        go0.touch()
    assert job.finish() == 0, job.out[2]
    assert bytes(job.out[1]) == b"[0] partial 0\n[1] line 1\n[0]  end\n"


def test_partial_lines_of_instances_never_share_a_line() -> None:
    count = 150
    result = subprocess.run([*POPRUN, "--num-instances", "3", PYTHON, SCRIPT, "pieces", str(count)],
                            capture_output=True, timeout=SUBPROCESS_TIMEOUT, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    seen: dict[int, list[bytes]] = {0: [], 1: [], 2: []}
    for line in result.stdout.split(b"\n")[:-1]:
        segments = [segment for segment in line.split(b"\r") if segment]
        owner = None
        for segment in segments:
            match = re.fullmatch(rb"\[(\d)\] ([a-c]+)", segment)
            assert match, f"a mixed or untagged line: {line!r}"
            index = int(match.group(1))
            assert owner in (None, index), f"two instances on one line: {line!r}"
            owner = index
            assert set(match.group(2)) == {b"abc"[index]}, f"another instance's text: {line!r}"
            seen[index].append(match.group(2))
    for index, letter in enumerate("abc"):
        expected = [text.encode() for n in range(count) for text in (letter * (n % 7 + 1), letter * 3)]
        assert seen[index] == expected  # in order, nothing lost


def test_binary_output_with_many_carriage_returns(tmp_path: Path) -> None:
    generator = random.Random(16)
    alphabet = b"\r" * 12 + b"\n" * 2 + bytes(range(256))
    data = (b"\r\r\rabc\r\r\rdef\r\r\n\r\r\rxyz\r\n\n\r" + bytes(generator.choice(alphabet) for _ in range(20_000))
            + b"\r" * 10_000 + b"bar" + b"\r" * 10_000)
    assert rendered(b"\r\r\rabc\r\r\rdef\r\r\n\r\r\rxyz\r\n\n\r") == b"[0] abc\r[0] def\r\n[0] xyz\r\n[0] \n"
    source = tmp_path / "data.bin"
    source.write_bytes(data)
    result = subprocess.run([*POPRUN, PYTHON, SCRIPT, "copy", str(source)], capture_output=True,
                            timeout=SUBPROCESS_TIMEOUT, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert result.stdout == rendered(data)
    assert result.stdout.endswith(b"\r[0] bar\r\n")  # runs of \r add no tag
    texts = len(re.findall(rb"[^\r\n]+", data))
    assert result.stdout.count(b"[0] ") <= texts + data.count(b"\n") < data.count(b"\r")


# ------------------------------------------------------------------ --log-dir, --tee
def test_log_dir_keeps_each_instances_raw_output(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    program = ("import os, sys; i = os.environ['RANK']; sys.stdout.write(f'out {i}\\rbar\\nlast {i}'); "
               "sys.stdout.flush(); sys.stderr.write(f'err {i}\\n')")
    result = subprocess.run([*POPRUN, "--num-instances", "2", "--log-dir", str(logs), PYTHON, "-c", program],
                            capture_output=True, timeout=SUBPROCESS_TIMEOUT, cwd=ROOT, env={**os.environ, **OMP_SET})
    assert result.returncode == 0, result.stderr
    for i in (0, 1):
        assert (logs / f"instance-{i}" / "stdout.log").read_bytes() == f"out {i}\rbar\nlast {i}".encode()
        assert (logs / f"instance-{i}" / "stderr.log").read_bytes() == f"err {i}\n".encode()
    assert sorted(result.stdout.split(b"\n")) == [b"", b"[0] last 0", b"[0] out 0\r[0] bar",
                                                  b"[1] last 1", b"[1] out 1\r[1] bar"]
    assert sorted(result.stderr.splitlines()) == [b"[0] err 0", b"[1] err 1"]

    quiet = poprun("--num-instances", "2", "--log-dir", str(logs), "--tee", "no", PYTHON, "-c",
                   "import os; print('again', os.environ['RANK'])", env=OMP_SET)
    assert (quiet.returncode, quiet.stdout, quiet.stderr) == (0, "", "")
    assert (logs / "instance-1" / "stdout.log").read_text() == "again 1\n"  # a new run starts afresh
    assert (logs / "instance-1" / "stderr.log").read_text() == ""


def test_with_tee_no_output_whose_log_cannot_be_written_is_shown_instead_said_once(tmp_path: Path) -> None:
    # Instance 0's stdout.log is /dev/full, as a full disk is: its first write fails during the
    # job. Its output is then shown here, said in one line; instance 1's logs still work (and its
    # output stays in them).
    logs = tmp_path / "logs"
    (logs / "instance-0").mkdir(parents=True)
    os.symlink("/dev/full", logs / "instance-0" / "stdout.log")
    result = poprun("--num-instances", "2", "--log-dir", str(logs), "--tee", "no", "/bin/sh", "-c",
                    "echo one from $RANK; echo two from $RANK", env=OMP_SET)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "[0] one from 0\n[0] two from 0\n"
    [said] = result.stderr.splitlines()
    assert said.endswith(f" POPRUN [W] instance 0's output is no longer written to {logs}/instance-0: "
                         "No space left on device; it is shown here instead (--tee no)"), said
    assert (logs / "instance-1" / "stdout.log").read_text() == "one from 1\ntwo from 1\n"


def test_a_log_dir_that_cannot_take_the_instances_folders_is_refused_before_anything_starts(tmp_path: Path) -> None:
    # /proc passes a permission check but takes no new folder, whoever asks (root too).
    ran = tmp_path / "ran"
    result = poprun("--log-dir", "/proc", "/bin/sh", "-c", f"touch {ran}")
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == ("poprun: error: --log-dir '/proc' cannot take the instances' folders: "
                             "No such file or directory\n")
    assert not ran.exists()


def test_log_files_are_complete_after_a_failure_and_after_sigint(tmp_path: Path) -> None:
    # Each instance fails only once both have written (a file each says so), so neither is
    # stopped before its output exists.
    program = ("import os, sys, time; i = os.environ['RANK']; sys.stdout.write('partial ' + i); sys.stdout.flush(); "
               f"open({str(tmp_path)!r} + '/written-' + i, 'w').close(); deadline = time.monotonic() + 60\n"
               f"while not all(os.path.exists({str(tmp_path)!r} + f'/written-{{j}}') for j in '01') "
               "and time.monotonic() < deadline: time.sleep(0.01)\n"
               "sys.exit(3)")
    failed = poprun("--num-instances", "2", "--log-dir", str(tmp_path / "failed"), "--tee", "no", PYTHON, "-c",
                    program)
    assert failed.returncode == 3, failed.stderr
    assert "instance " in failed.stderr and failed.stdout == ""  # the summary still shows
    for i in (0, 1):
        assert (tmp_path / "failed" / f"instance-{i}" / "stdout.log").read_text() == f"partial {i}"

    marker = job_marker()
    logs = tmp_path / "interrupted"
    job = Running("--log-dir", str(logs), PYTHON, SCRIPT, "streams", marker)
    job.wait_for(2, rb"\[0\] ready\n")
    job.proc.send_signal(signal.SIGINT)
    assert job.finish() == 130, job.out[2]
    assert (logs / "instance-0" / "stdout.log").read_bytes() == b"out 1\nout 2"
    assert (logs / "instance-0" / "stderr.log").read_bytes() == b"x" * 199_999 + b"\nready\n"
    assert bytes(job.out[1]) == b"[0] out 1\n[0] out 2\n"
    assert wait_no_processes(marker) == []


def test_log_dir_and_tee_usage_errors(tmp_path: Path) -> None:
    missing = tmp_path / "no" / "logs"
    result = poprun("--log-dir", str(missing), "/bin/true")
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == (f"poprun: error: --log-dir {str(missing)!r}: its parent directory "
                             f"{str(missing.parent)!r} does not exist (poprun creates only the last "
                             "directory of the path)\n")
    result = poprun("--tee", "no", "/bin/true")
    assert (result.returncode, result.stderr) == (
        2, "poprun: error: --tee no hides every instance's output: give --log-dir DIR too, to keep it in files\n")
    (tmp_path / "file").write_text("")
    result = poprun("--log-dir", str(tmp_path / "file"), "/bin/true")
    assert result.returncode == 2 and len(result.stderr.splitlines()) == 1 and "is a file" in result.stderr
    dry = poprun("--dry-run", "--log-dir", str(tmp_path / "dry"), "/bin/true")
    assert dry.returncode == 0 and not (tmp_path / "dry").exists()  # a dry run creates nothing


# ------------------------------------------------------------------ --prefix-timestamp
def test_prefix_timestamp_is_when_the_line_began(tmp_path: Path) -> None:
    go = tmp_path / "go"
    before = datetime.datetime.now()
    job = Running("--prefix-timestamp", "yes", PYTHON, SCRIPT, "progress", str(go))
    try:
        job.wait_for(1, rb"progress")
    finally:
        released = datetime.datetime.now()
        go.touch()
    assert job.finish() == 0, job.out[2]
    stamp = rb"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3}) "
    match = re.fullmatch(rb"\[0\] " + stamp + rb"progress 0\r\[0\] " + stamp + rb"done 0\n", bytes(job.out[1]))
    assert match, bytes(job.out[1])
    first, second = (datetime.datetime.strptime(m.decode(), "%Y-%m-%d %H:%M:%S.%f") for m in match.groups())
    slack = datetime.timedelta(milliseconds=1)
    assert before - slack <= first <= released  # its first byte came before the newline was allowed
    assert first <= second


def test_a_full_log_dir_is_said_once_per_job_and_dropped_output_is_said(tmp_path: Path) -> None:
    """--log-dir on a real full file system (a 64 KiB tmpfs, mounted in a mount namespace of the
    job's own), three starts of a job of two instances that each write 96 KiB and fail: that the
    logs cannot be written is said once for the job, not at every start; with --tee no, instance 0's
    output is shown instead, and instance 1's, which --only-output-from-instance 0 leaves out, is
    said to be dropped (once too)."""
    if os.geteuid() != 0 or subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode != 0:
        pytest.skip("needs root and a mount namespace (unshare -m) to mount a small tmpfs")
    logs = tmp_path / "logs"
    logs.mkdir()
    program = "import os, sys; sys.stdout.write(('x' * 1023 + '\\n') * 96); sys.stdout.flush(); sys.exit(3)"
    result = subprocess.run(
        ["unshare", "-m", "sh", "-c", 'mount -t tmpfs -o size=64k tmpfs "$0" && exec "$@"', str(logs), *POPRUN,
         "--max-restarts", "2", "--restart-backoff", "0", "--log-dir", str(logs), "--tee", "no",
         "--only-output-from-instance", "0", "--num-instances", "2", PYTHON, "-c", program],
        capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT, env={**os.environ, **OMP_SET})
    assert result.returncode == 3, result.stderr
    assert result.stderr.count("poprun: restarting the job") == 2, result.stderr
    warned = [line for line in result.stderr.splitlines() if " POPRUN [W] " in line]
    assert len(warned) == 2, result.stderr
    assert any(line.endswith(f"instance 0's output is no longer written to {logs}/instance-0: No space left on "
                             "device; it is shown here instead (--tee no)") for line in warned), warned
    assert any(line.endswith(f"instance 1's output is no longer written to {logs}/instance-1: No space left on "
                             "device; it is dropped from now on (--tee no, and --only-output-from-instance leaves "
                             "it out)") for line in warned), warned
    assert "[0] xxx" in result.stdout and "[1] " not in result.stdout


@pytest.mark.parametrize(("tz", "offset"), [("XYZ-5:30", "+05:30"), ("ABC+3", "-03:00"), ("UTC0", "+00:00")])
def test_prefix_timestamp_offset_carries_the_utc_offset(tz: str, offset: str) -> None:
    """--prefix-timestamp offset: every stamp carries its local time's UTC offset (a POSIX TZ
    gives poprun a known one), so that a stamp read with it is the moment the line came, on any
    side of a daylight saving change; given alone before the program, 'offset' is its value."""
    before = datetime.datetime.now(datetime.UTC)
    result = poprun("--prefix-timestamp", "offset", "/bin/echo", "hello", env={"TZ": tz})
    after = datetime.datetime.now(datetime.UTC)
    assert result.returncode == 0, result.stderr
    match = re.fullmatch(r"\[0\] (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3}([+-]\d\d:\d\d)) hello\n", result.stdout)
    assert match and match.group(2) == offset, result.stdout
    stamp = datetime.datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S.%f%z")
    assert before - datetime.timedelta(milliseconds=1) <= stamp <= after


def test_prefix_timestamp_takes_yes_no_or_offset() -> None:
    plain = poprun("--prefix-timestamp", "/bin/echo", "hi")  # alone: yes, without the offset
    assert plain.returncode == 0 and re.fullmatch(r"\[0\] \d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} hi\n", plain.stdout)
    bad = poprun("--prefix-timestamp=sometimes", "/bin/echo", "hi")
    assert bad.returncode == 2
    assert "Invalid value for '--prefix-timestamp': 'sometimes' is not yes, no or offset" in bad.stderr, bad.stderr
