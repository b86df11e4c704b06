"""MPICH's PMI line (``PMI_FD``) passed through the instance's stub (the Python one here;
``_stub.c`` has the same relay in C), so that the stub is the first to know that its
program called ``MPI_Abort``.

MPICH's ``MPI_Abort`` (also what ``python -m mpi4py`` calls on an uncaught exception, and MPICH's
fatal-error handler) prints ``Abort(N) on node R ...``, sends ``cmd=abort exitcode=N`` to its
launcher over this line and waits there to be killed. The launchers then end every process at
once: gforker signals every instance's process (SIGINT, then SIGQUIT a second later), Hydra's
proxy SIGKILLs them. Which instance asked was then lost in a race: the aborting program died of
its own stub's SIGTERM like any bystander, or every stub died without a report. Here the program
gets one end of a socket pair in place of the line (the same descriptor number, so ``PMI_FD``
still holds), and the stub copies the bytes both ways; an abort request is kept from the
launcher: the stub ends the program and reports the abort as its exit, and poprun stops the
others, as for any failure.

The relay reads MPICH's PMI-1 wire (one ``cmd=... key=value ...`` line per request), which both
gforker and Hydra speak with MPICH's own client. Built-in modules only (``python -S``).
"""

from __future__ import annotations

import _socket
import os
import select

from popcontract import environment, settings

#: The most read from either side at once.
READ_SIZE = 65536
#: The longest line held back as a possible abort request: beyond it, it is passed on as it comes.
HOLD_LIMIT = 65536
#: The start of an abort request on PMI-1's wire, and the key of its code.
ABORT = b"cmd=abort"
EXIT_CODE = b"exitcode="


def pmi_line() -> int | None:
    """The descriptor of this process's line to MPICH's launcher (``PMI_FD``), if it has one."""
    pmi = settings.text(environment.PMI_FD)
    return int(pmi) if pmi.isdigit() else None


def hang_up() -> bool:
    """Close this process's PMI line (``PMI_FD``), before it exits without RELEASE; whether there
    was one to close. No RELEASE came: other instances still run. The stub closes its copy of
    MPICH's PMI line and gives the launcher up to LAUNCHER_NOTICE_SECONDS (``fallback``) to act on
    it before it exits. Hydra's proxy, seeing the line end and the process exit at the same moment,
    at times took a program that left without MPI_Finalize (``os._exit``) for one that finished,
    and the job's other instances then waited for ever; seeing the line end first, it ends the job
    (which signals the stub). After MPI_Finalize the line's end is no news to it."""
    pmi = pmi_line()
    if pmi is None:
        return False
    try:
        os.close(pmi)
    except OSError:
        return False
    return True


def abort_status(code: int) -> int:
    """The exit status an abort with ``code`` gives: its low byte, as mpiexec exits with it; 1 when
    that is 0 (``MPI_Abort(comm, 0)`` still ends the job: it did not finish)."""
    return code & 0xFF or 1


class PmiRelay:
    """The socket pair between the program and the launcher's line, and what has been read of the
    program's current request."""

    def __init__(self, launcher: int) -> None:
        self.launcher = launcher
        self.shim_end, program_end = _socket.socketpair(_socket.AF_UNIX, _socket.SOCK_STREAM)
        #: The program's end until it has been started with it (``spawn_action``), then None.
        self.program_end: _socket.socket | None = program_end
        self.pending = b""  # the start of a line from the program that may be an abort request
        self.at_line_start = True  # ``pending`` (or the next byte) begins a line
        self.program_open = True

    def spawn_action(self) -> tuple[int, int, int]:
        """The ``posix_spawn`` file action that gives the program its end as ``PMI_FD``."""
        assert self.program_end is not None
        return (os.POSIX_SPAWN_DUP2, self.program_end.fileno(), self.launcher)

    def spawned(self) -> None:
        """The program has its end (or was not started): the stub's copy goes."""
        if self.program_end is not None:
            self.program_end.close()
            self.program_end = None

    def from_program(self) -> int | None:
        """Pass what the program sent on to the launcher, but an abort request, whose exit code is
        returned instead. A line is held back only while it may still be one (its start so far is
        ``cmd=abort``'s); every other byte goes on at once, whatever the wire. Once the program's
        end has closed, ``program_open`` is False (the launcher's line stays open: its end is the
        stub's, as when the program shared it)."""
        try:
            data = self.shim_end.recv(READ_SIZE)
        except OSError:
            data = b""
        if not data:
            self.program_open = False
            return None
        self.pending += data
        passed = 0  # how much of ``pending`` goes on
        while passed < len(self.pending):
            end = self.pending.find(b"\n", passed)
            line = self.pending[passed:] if end < 0 else self.pending[passed:end]
            if self.at_line_start and end >= 0 and _is_abort(line):
                _write_all(self.launcher, self.pending[:passed])
                self.pending = b""
                return _exit_code(line)
            if self.at_line_start and end < 0 and len(line) < HOLD_LIMIT and \
                    (ABORT.startswith(line) or _is_abort(line)):
                break  # the rest of the line decides
            passed = len(self.pending) if end < 0 else end + 1
            self.at_line_start = end >= 0
        _write_all(self.launcher, self.pending[:passed])
        self.pending = self.pending[passed:]
        return None

    def from_launcher(self) -> bool:
        """Pass what the launcher sent on to the program (dropped once the program has gone); False
        once the launcher's line has closed, and then the program's end is shut, as it would have
        seen the line end."""
        try:
            data = os.read(self.launcher, READ_SIZE)
        except OSError:
            data = b""
        if not data:
            try:
                self.shim_end.shutdown(_socket.SHUT_RDWR)
            except OSError:
                pass  # the program's end has gone already
            return False
        try:
            self.shim_end.sendall(data)
        except OSError:
            pass  # the program has gone: no one waits for the answer
        return True

    def close(self) -> None:
        self.spawned()
        self.shim_end.close()


def open_relay() -> PmiRelay | None:
    """A relay for this process's PMI line, when it has one that is open; else None."""
    launcher = pmi_line()
    if launcher is None:
        return None
    try:
        os.fstat(launcher)
    except OSError:
        return None
    return PmiRelay(launcher)


def _is_abort(line: bytes) -> bool:
    """Whether a line (or its start so far) is an abort request."""
    return line == ABORT or line.startswith(ABORT + b" ")


def _exit_code(line: bytes) -> int:
    """The code of an abort request (``cmd=abort exitcode=N message=...``); 1 when it gives none."""
    for field in line.split(b" ")[1:]:
        if field.startswith(EXIT_CODE):
            try:
                return int(field[len(EXIT_CODE):])
            except ValueError:
                break
    return 1


def _write_all(fd: int, data: bytes) -> None:
    """All of ``data`` to the launcher's line, waiting for room when it is full; dropped once the
    line has closed (the launcher has gone: the job is ending)."""
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view):]
        except BlockingIOError:
            select.select([], [fd], [])
        except OSError:
            return
