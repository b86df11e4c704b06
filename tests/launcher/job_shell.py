"""A real interactive shell on a pseudo-terminal, for job control as users do it (Ctrl-Z, ``fg``),
and what the tests read of the processes of a job from /proc."""

from __future__ import annotations

import os
import pty
import re
import subprocess
import termios
import threading
import time
from pathlib import Path
from types import TracebackType

from tests.helpers import MARKER_VARIABLE, OMP_SET, ROOT, SUBPROCESS_TIMEOUT, processes_matching, task_state

#: The program of the job-control tests: numbered lines at a steady pace (COUNT, INTERVAL, marker).
TICKER = str(ROOT / "tests" / "scripts" / "ticker.py")
#: What the terminal sends for Ctrl-Z (its VSUSP character).
CTRL_Z = "\x1a"


class Shell:
    """``bash -i`` in a session of its own whose controlling terminal is a new pty, as a terminal
    emulator starts it: bash puts each job in its own process group and in the terminal's
    foreground, so Ctrl-Z typed on the terminal sends SIGTSTP to that job, and ``fg`` continues it.
    Everything the terminal shows is collected as it comes."""

    def __init__(self, env: dict[str, str] | None = None) -> None:
        self.master, slave = pty.openpty()
        # Ctrl-Z makes the terminal discard what the job wrote that the terminal emulator has not
        # read yet, unless NOFLSH is set (termios(3)): a line or two the job wrote would then never be
        # shown, as on a user's terminal. The tests check that poprun passes on every line.
        attributes = termios.tcgetattr(slave)
        attributes[3] |= termios.NOFLSH
        termios.tcsetattr(slave, termios.TCSANOW, attributes)
        # Not the test's job marker: the shell outlives the job it runs (helpers.job_marker).
        inherited = {name: value for name, value in os.environ.items() if name != MARKER_VARIABLE}
        environment = {**inherited, **OMP_SET, "TERM": "dumb", "PS1": "$ ", "HISTFILE": "/dev/null", **(env or {})}
        # util-linux's setsid --ctty makes the pty the new session's controlling terminal.
        self.bash = subprocess.Popen(["setsid", "--ctty", "bash", "--norc", "--noprofile", "-i"],
                                     stdin=slave, stdout=slave, stderr=slave, cwd=ROOT, env=environment)
        os.close(slave)
        self.shown = bytearray()
        self.lock = threading.Lock()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        while True:
            try:
                data = os.read(self.master, 65536)
            except OSError:  # the shell and everything on the terminal have closed it
                return
            if not data:
                return
            with self.lock:
                self.shown += data

    def keys(self, text: str) -> None:
        os.write(self.master, text.encode())

    def wait_for(self, pattern: bytes, after: int = 0, within: float = SUBPROCESS_TIMEOUT) -> re.Match[bytes]:
        """The first match of ``pattern`` in what the terminal has shown from ``after`` on."""
        deadline = time.monotonic() + within
        while True:
            with self.lock:
                match = re.compile(pattern, re.MULTILINE).search(bytes(self.shown), after)
            if match:
                return match
            tail = bytes(self.shown[-3000:]).decode(errors="replace")
            assert time.monotonic() < deadline, f"{pattern!r} never shown; the terminal shows:\n{tail}"
            time.sleep(0.01)

    def __enter__(self) -> Shell:
        return self

    def __exit__(self, *_: type[BaseException] | BaseException | TracebackType | None) -> None:
        self.keys("exit\n")
        try:
            self.bash.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.bash.kill()
            self.bash.wait(timeout=10)
        os.close(self.master)
        self.reader.join(timeout=10)


def job_pids(marker: str) -> tuple[int, list[int]]:
    """poprun's PID and its programs' (each carries ``marker`` on its command line; so does poprun's)."""
    lines = processes_matching(marker)
    poprun = [int(line.split(":")[0]) for line in lines if "poprun_py" in line]
    programs = [int(line.split(":")[0]) for line in lines if "poprun_py" not in line]
    assert len(poprun) == 1, lines
    return poprun[0], programs


def states(pids: list[int]) -> list[str]:
    """Each process's state letter (T: stopped), ``gone`` for one that has ended."""
    found = []
    for pid in pids:
        try:
            found.append(task_state(f"/proc/{pid}"))
        except OSError:
            found.append("gone")
    return found


def written(pids: list[int]) -> list[int]:
    """How many bytes each process has written so far (``wchar``): its progress; -1 once it has ended."""
    counts = []
    for pid in pids:
        try:
            text = Path(f"/proc/{pid}/io").read_text()
        except OSError:
            counts.append(-1)
            continue
        match = re.search(r"^wchar: (\d+)$", text, re.MULTILINE)
        assert match, text
        counts.append(int(match.group(1)))
    return counts


def held_back(pids: list[int]) -> list[int]:
    """Wait until the programs no longer progress (every buffer between them and the reader is full)
    and return how far they got; fails if they keep going (nothing holds them back)."""
    last, still = written(pids), 0
    deadline = time.monotonic() + SUBPROCESS_TIMEOUT
    while True:
        time.sleep(1.0)  # sampling a rate: a second at a time
        now = written(pids)
        assert -1 not in now, "a program ended"
        # Two still seconds in a row: on a loaded machine a program may get no CPU for a second
        # (a program still starting has written nothing yet).
        still = still + 1 if now == last and all(now) else 0
        if still == 2:
            return now
        assert time.monotonic() < deadline, f"the programs never stopped making progress: {now}"
        last = now


def numbers_shown(shown: bytes, instances: int) -> dict[int, list[int]]:
    """The ticker's numbers each instance's tagged lines show on the terminal, in order. The
    terminal echoes Ctrl-Z as ``^Z`` the moment it is typed, inside whatever line is being shown
    then (as it does for a user): that echo is not the job's."""
    found: dict[int, list[int]] = {index: [] for index in range(instances)}
    for index, number in re.findall(rb"\[(\d+)\] (\d+)\r$", shown.replace(b"^Z", b""), re.MULTILINE):
        found[int(index)].append(int(number))
    return found
