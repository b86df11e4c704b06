"""poprun's stdout and stderr on one file or terminal (``2>&1``, a terminal, a CI log): one line for
both, so an instance's unfinished line on one stream is not cut by another instance's output on
the other (issue 27: ``[1] partial-from-1[0] whole-line-from-0``); on two files, as before.

Issue 40: there, an instance's stdout and stderr are one pipe, so its lines come out in the order
its program wrote them, exactly as ``2>&1`` gives them without poprun.

Concurrent events are ordered by files: the test creates the file an instance waits for only
once it has seen what must come first (poprun's output, or its raw ``--log-dir`` copy of a line
it holds back).
"""

from __future__ import annotations

import os
import pty
import re
import select
import subprocess
import time
import tty
from collections.abc import Callable
from pathlib import Path
from typing import IO

import pytest

from tests.helpers import OMP_SET, POPRUN, PYTHON, ROOT, SUBPROCESS_TIMEOUT, stop_poprun
from tests.launcher.rendering import TWO_STREAMS, flat, instances_text, rendered, without_poprun

pytestmark = pytest.mark.slow  # every test launches through poprun and mpiexec

#: Instance 1 writes a partial line to stdout and keeps it busy (a dot every 0.1 s, so poprun does
#: not end it for silence) until DIR/go1 exists, then ends it; instance 0 waits for DIR/go0, then
#: writes a whole line to stderr.
INTERLEAVE = """
import os, sys, time
directory = sys.argv[1]
def wait(name, tick=lambda: None):
    deadline = time.monotonic() + 60
    while not os.path.exists(os.path.join(directory, name)):
        if time.monotonic() > deadline:
            sys.exit(9)
        tick()
        time.sleep(0.1)
if os.environ['RANK'] == '1':
    sys.stdout.write('partial-from-1'); sys.stdout.flush()
    wait('go1', lambda: (sys.stdout.write('.'), sys.stdout.flush()))
    sys.stdout.write(' end-of-1\\n'); sys.stdout.flush()
else:
    wait('go0')
    sys.stderr.write('whole-line-from-0\\n'); sys.stderr.flush()
"""

#: Each instance N times: a bar redrawn on stdout (its letter), a line on stderr in two pieces (its
#: letter twice, upper case) between the redraw and the bar's last state, then the bar's newline.
MIXED = """
import os, sys, time
letter = 'abc'[int(os.environ['RANK'])]
def out(text): sys.stdout.write(text); sys.stdout.flush()
def err(text): sys.stderr.write(text); sys.stderr.flush()
for n in range(int(sys.argv[1])):
    out(letter * (n % 7 + 1)); time.sleep(0.001)
    out('\\r'); err(letter.upper() * 2); time.sleep(0.001)
    err('\\n'); out(letter * 3); time.sleep(0.001)
    out('\\n')
"""


class Terminal:
    """A pseudo-terminal in raw mode (no ``\\n`` -> ``\\r\\n``) for poprun's stdout and stderr; what
    poprun writes to it is read from the master side as it comes."""

    def __init__(self) -> None:
        self.master, self.slave = pty.openpty()
        tty.setraw(self.slave)
        self.seen = bytearray()

    def read(self, timeout: float = 0.0) -> bool:
        """Add what is there (waiting up to ``timeout``); False once every writer has closed it."""
        ready, _, _ = select.select([self.master], [], [], timeout)
        if not ready:
            return True
        try:
            data = os.read(self.master, 1 << 16)
        except OSError:  # EIO: the slave side is closed everywhere
            return False
        self.seen += data
        return bool(data)

    def close(self) -> None:
        for fd in (self.master, self.slave):
            try:
                os.close(fd)
            except OSError:
                pass


def start(args: list[str], stdout: int | IO[bytes], stderr: int | IO[bytes]) -> subprocess.Popen[bytes]:
    return subprocess.Popen([*POPRUN, *args], stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr, cwd=ROOT,
                            start_new_session=True, env={**os.environ, **OMP_SET})


def wait_until(condition: Callable[[], bool], proc: subprocess.Popen[bytes], what: str) -> None:
    deadline = time.monotonic() + SUBPROCESS_TIMEOUT
    while not condition():
        assert proc.poll() is None, f"poprun ended (status {proc.returncode}) before {what}"
        assert time.monotonic() < deadline, f"{what} never came"
        time.sleep(0.01)


def interleave(tmp_path: Path, proc_stdout: int | IO[bytes], proc_stderr: int | IO[bytes],
               shown: Callable[[], bytes], reached: Callable[[], bool] | None = None) -> subprocess.Popen[bytes]:
    """Issue 27's order of events: instance 1's partial line shows, then instance 0's whole line
    reaches poprun, then instance 1 ends its line. ``shown``: what poprun has written so far where
    instance 1's line goes; ``reached``: whether instance 0's line has reached poprun (by default:
    its raw ``--log-dir`` copy has it, which poprun writes as it takes the line in, held or not)."""
    logs = tmp_path / "logs"
    log0 = logs / "instance-0" / "output.log"  # one stream, as poprun's are
    proc = start(["--num-instances", "2", "--log-dir", str(logs), PYTHON, "-c", INTERLEAVE, str(tmp_path)],
                 proc_stdout, proc_stderr)
    try:
        wait_until(lambda: b"[1] partial-from-1" in shown(), proc, "instance 1's partial line")
        (tmp_path / "go0").touch()
        wait_until(reached or (lambda: log0.exists() and log0.read_bytes() == b"whole-line-from-0\n"), proc,
                   "instance 0's line")
        (tmp_path / "go1").touch()
        proc.wait(timeout=SUBPROCESS_TIMEOUT)
    finally:
        stop_poprun(proc)
    return proc


ISSUE_27_FIXED = rb"\[1\] partial-from-1\.* end-of-1\n\[0\] whole-line-from-0\n"


def test_one_file_for_both_streams_keeps_each_line_whole(tmp_path: Path) -> None:
    path = tmp_path / "out.txt"
    with open(path, "wb") as both:  # 2>&1 into a file
        proc = interleave(tmp_path, both, both, path.read_bytes)
    assert proc.returncode == 0, path.read_bytes()
    assert re.fullmatch(ISSUE_27_FIXED, path.read_bytes()), path.read_bytes()


def test_a_terminal_for_both_streams_keeps_each_line_whole(tmp_path: Path) -> None:
    terminal = Terminal()
    try:
        def shown() -> bytes:
            terminal.read()
            return bytes(terminal.seen)

        proc = interleave(tmp_path, terminal.slave, terminal.slave, shown)
        os.close(terminal.slave)
        deadline = time.monotonic() + SUBPROCESS_TIMEOUT
        while terminal.read(timeout=max(0.0, deadline - time.monotonic())) and time.monotonic() < deadline:
            pass
    finally:
        terminal.close()
    assert proc.returncode == 0, bytes(terminal.seen)
    assert re.fullmatch(ISSUE_27_FIXED, bytes(terminal.seen)), bytes(terminal.seen)


def test_two_files_are_framed_apart_as_before(tmp_path: Path) -> None:
    # stdout and stderr are different files (2>err.log): instance 0's line is not held for
    # instance 1's unfinished one; it is on stderr while instance 1's line is still open.
    out_path, err_path = tmp_path / "out.txt", tmp_path / "err.txt"
    with open(out_path, "wb") as out, open(err_path, "wb") as err:
        proc = interleave(tmp_path, out, err, out_path.read_bytes,
                          reached=lambda: err_path.read_bytes() == b"[0] whole-line-from-0\n")
    assert proc.returncode == 0, err_path.read_bytes()
    assert err_path.read_bytes() == b"[0] whole-line-from-0\n"
    assert re.fullmatch(rb"\[1\] partial-from-1\.* end-of-1\n", out_path.read_bytes()), out_path.read_bytes()


def run_shared(args: list[str], where: str, tmp_path: Path) -> tuple[int, bytes]:
    """Run poprun to its end with its stdout and stderr on one ``file`` or ``terminal``: its status
    and what it wrote there."""
    if where == "file":
        path = tmp_path / "out.txt"
        with open(path, "wb") as both:
            proc = start(args, both, both)
            try:
                proc.wait(timeout=SUBPROCESS_TIMEOUT)
            finally:
                stop_poprun(proc)
        return proc.returncode, path.read_bytes()
    terminal = Terminal()
    try:
        proc = start(args, terminal.slave, terminal.slave)
        os.close(terminal.slave)
        deadline = time.monotonic() + SUBPROCESS_TIMEOUT
        while terminal.read(timeout=max(0.0, deadline - time.monotonic())) and time.monotonic() < deadline:
            pass
        proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        stop_poprun(proc)
        terminal.close()
    return proc.returncode, bytes(terminal.seen)


@pytest.mark.parametrize("where", ["file", "terminal"])
def test_bars_partial_lines_and_both_streams_from_three_instances(tmp_path: Path, where: str) -> None:
    count = 100
    status, shown = run_shared(["--num-instances", "3", PYTHON, "-c", MIXED, str(count)], where, tmp_path)
    assert status == 0, shown
    bars: dict[int, list[bytes]] = {0: [], 1: [], 2: []}
    errors: dict[int, list[bytes]] = {0: [], 1: [], 2: []}
    assert shown.endswith(b"\n")
    for line in shown.split(b"\n")[:-1]:
        owner = None
        for segment in (segment for segment in line.split(b"\r") if segment):
            match = re.fullmatch(rb"\[(\d)\] ([a-cA-C]+)", segment)
            assert match, f"a mixed or untagged line: {line!r}"
            index = int(match.group(1))
            assert owner in (None, index), f"two instances on one line: {line!r}"
            owner = index
            text = match.group(2)
            assert set(text.lower()) == {b"abc"[index]}, f"another instance's text: {line!r}"
            (errors if text.isupper() else bars)[index].append(text)
    for index, letter in enumerate("abc"):
        assert bars[index] == [text.encode() for n in range(count) for text in (letter * (n % 7 + 1), letter * 3)]
        assert errors[index] == [letter.upper().encode() * 2] * count  # whole, in order, nothing lost


# ------------------------------------------------- issue 40: an instance's streams keep their order
ROUNDS = 150


@pytest.mark.parametrize("where", ["file", "terminal"])
def test_an_instances_two_streams_keep_the_order_it_wrote_them_in(tmp_path: Path, where: str) -> None:
    alone, _ = without_poprun(tmp_path, ROUNDS)
    status, shown = run_shared(["--num-instances", "1", PYTHON, TWO_STREAMS, str(ROUNDS)], where, tmp_path)
    assert status == 0, shown
    assert shown == rendered(alone)  # what `2>&1` gives without poprun, tagged, nothing moved


def test_several_instances_each_keep_their_order_and_log_it_as_one_stream(tmp_path: Path) -> None:
    alone, _ = without_poprun(tmp_path, ROUNDS)
    logs = tmp_path / "logs"
    status, shown = run_shared(["--num-instances", "3", "--log-dir", str(logs), PYTHON, TWO_STREAMS, str(ROUNDS)],
                               "file", tmp_path)
    assert status == 0, shown
    # Never two instances on one line; each instance's text in the order it wrote it.
    assert instances_text(shown) == {i: flat(alone) for i in range(3)}
    for i in range(3):  # --log-dir follows what is shown: one stream, raw, as `2>&1` writes it
        assert sorted(path.name for path in (logs / f"instance-{i}").iterdir()) == ["output.log"]
        assert (logs / f"instance-{i}" / "output.log").read_bytes() == alone


def test_two_files_get_each_its_own_stream(tmp_path: Path) -> None:
    alone_out, alone_err = without_poprun(tmp_path, ROUNDS, one_file=False)
    out_path, err_path = tmp_path / "out.txt", tmp_path / "err.txt"
    logs = tmp_path / "logs"
    with open(out_path, "wb") as out, open(err_path, "wb") as err:
        proc = start(["--num-instances", "1", "--log-dir", str(logs), PYTHON, TWO_STREAMS, str(ROUNDS)], out, err)
        try:
            proc.wait(timeout=SUBPROCESS_TIMEOUT)
        finally:
            stop_poprun(proc)
    assert proc.returncode == 0, err_path.read_bytes()
    assert out_path.read_bytes() == rendered(alone_out)
    assert err_path.read_bytes() == rendered(alone_err)
    assert (logs / "instance-0" / "stdout.log").read_bytes() == alone_out
    assert (logs / "instance-0" / "stderr.log").read_bytes() == alone_err


def test_the_failure_summary_shows_the_last_lines_of_the_one_stream(tmp_path: Path) -> None:
    program = "import sys; print('on stdout', flush=True); sys.stderr.write('on stderr\\n'); sys.exit(3)"
    status, shown = run_shared(["--num-instances", "1", PYTHON, "-c", program], "file", tmp_path)
    assert status == 3, shown
    assert b"poprun: last lines of instance 0's output:\n    on stdout\n    on stderr\n" in shown, shown


def test_with_tee_no_the_logs_keep_the_two_streams_apart(tmp_path: Path) -> None:
    # Nothing is shown on the one file, so nothing asks for one stream: the logs are as ever.
    alone_out, alone_err = without_poprun(tmp_path, ROUNDS, one_file=False)
    logs = tmp_path / "logs"
    status, shown = run_shared(["--num-instances", "1", "--log-dir", str(logs), "--tee", "no", PYTHON, TWO_STREAMS,
                                str(ROUNDS)], "file", tmp_path)
    assert (status, shown) == (0, b"")
    assert (logs / "instance-0" / "stdout.log").read_bytes() == alone_out
    assert (logs / "instance-0" / "stderr.log").read_bytes() == alone_err
    assert not (logs / "instance-0" / "output.log").exists()
