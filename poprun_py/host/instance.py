"""One instance as its host's supervisor sees it: its stub's connection (``wire.local``), its
program's pipes (handed over by the stub), and what poprun learns of it, as the instance's frames
sends (``wire.protocol``: OUTPUT, LAUNCHER_LOST, UNCAUGHT, ROOT_CAUSE, TIMES, EXIT).

The stub does only what must be done in the instance's own process (fork, exec, wait, signals);
the rest is here, once per host: the output read from the pipes, the end of its stderr kept to
tell an uncaught exception's traceback when the job is stopped, the error file read once the
program has failed, the out-of-memory killer told from the cgroup's count. Driven by its owner's
event loop: ``frame`` for each of the stub's frames, ``read`` for each pipe that is ready, ``tick``
for its deadlines; ``emit`` receives each frame for poprun, header and payload.
"""

from __future__ import annotations

import _signal
import _socket
import errno
import os
import time

from poprun_py.host import oom
from poprun_py.host.stubs import Frame, Reader
from poprun_py.host.uncaught import Tail
from poprun_py.shared import root_cause
from poprun_py.wire import local, protocol

TYPE_CHECKING = False  # typing.TYPE_CHECKING, without importing typing under python -S
if TYPE_CHECKING:
    from collections.abc import Callable

#: The most read of a pipe at once.
READ_SIZE = 1 << 16
#: The most read of the program's stderr when the job is stopped (``terminate``): no pipe holds
#: more (``/proc/sys/fs/pipe-max-size``), and a program that writes on is not waited for.
STOP_READ_LIMIT = 1 << 20
#: After the program has exited, how long what it started may keep its pipes open before the
#: report is made without the rest (the stub then ends them as its subreaper).
DRAIN_SECONDS = 1.0
#: How long a write of a command to a stub may wait (a stub reads them at once; a stub that
#: stopped reading is lost, as its connection shows).
SEND_WAIT = 1.0


class StubbedInstance:
    """``conn``: the stub's connection, non-blocking, and ``reader`` its frames; ``emit``: takes
    each frame for poprun; ``grace``: the program's, between SIGTERM and SIGKILL; ``error_file``:
    its TORCHELASTIC_ERROR_FILE (None: it has none); ``program``: its argv[0], for the line that
    says it could not be started; ``tidy``: see the attribute."""

    def __init__(self, index: int, conn: _socket.socket, reader: Reader, emit: Callable[[bytes], None], *,
                 grace: float, error_file: str | None, program: bytes, tidy: bool = True) -> None:
        self.index = index
        self.conn = conn
        self.reader = reader
        self.emit = emit
        self.grace = grace
        self.error_file = error_file
        #: Whether its error file goes once read (not on poprun's own host: see ``take``).
        self.tidy = tidy
        self.program = os.fsdecode(program)
        self.pid: int | None = None
        #: The program's pipes still open: descriptor -> stream (1, 2; one stream: 1 alone).
        self.pipes: dict[int, int] = {}
        self.tail = Tail()
        self.tail_fd: int | None = None
        #: The job's stop was asked (``terminate``), and, while a traceback the program was printing
        #: then is waited for, until when (monotonic).
        self.terminated = False
        self.finishing_until: float | None = None
        self.uncaught: tuple[int, bytes] | None = None
        #: The stub was signalled by its launcher, or saw it die (why, for the exit report).
        self.signalled = False
        self.reason: str | None = None
        self.oom_kills: int | None = None
        #: The stub's EXITED fields, and until when the pipes may still be drained after it.
        self.exit: tuple[int, ...] | None = None
        self.drain_until: float | None = None
        self.reported = False

    # ------------------------------------------------------------------ to the stub
    def send(self, data: bytes) -> bool:
        """One frame to the stub, whole; whether it went (a stub gone shows as its connection's end)."""
        try:
            self.conn.settimeout(SEND_WAIT)
            self.conn.sendall(data)
        except OSError:
            return False
        finally:
            self.conn.setblocking(False)
        return True

    def start(self, argv: list[bytes], env: dict[bytes, bytes | None], flags: int) -> bool:
        return self.send(local.encode_program(argv, env, self.grace, flags))

    def command(self, message: bytes) -> bool:
        """One of poprun's commands (``protocol.TERMINATE``, STOP, CONT, RELEASE), to this stub."""
        if message == protocol.TERMINATE:
            self.terminate()
            return True
        kind = {protocol.STOP: local.STOP, protocol.CONT: local.CONT, protocol.RELEASE: local.RELEASE}[message]
        return self.send(local.frame(kind))

    def terminate(self) -> None:
        """The job is stopped: what the program wrote to its stderr before, still in the pipe, is
        read first, so that how that stderr ended is known. An uncaught exception's traceback there
        says it had failed by itself and was on its way out: its exit report says so (UNCAUGHT).
        One being printed is waited for until it is whole (at most the grace)."""
        if self.terminated or self.exit is not None:
            return
        self.terminated = True
        self._read_to_the_end()
        if self.tail.printing():
            self.finishing_until = time.monotonic() + self.grace
            return
        self._stop_now()

    def _stop_now(self) -> None:
        self.finishing_until = None
        line = self.tail.exception()
        if line is not None:
            self.uncaught = (self.tail.read_ns, line)
        self.send(local.terminate(self.grace))

    # ------------------------------------------------------------------ from the stub
    def frame(self, frame: Frame) -> list[int]:
        """One of the stub's frames; the pipes it handed over, for the owner to watch."""
        kind, payload = frame.kind, frame.payload
        if kind == local.STARTED:
            (self.pid,) = local.unpack(local.STARTED_FIELDS, payload, "STARTED")
            self.oom_kills = oom.kills()
            for stream, fd in enumerate(frame.fds[:2], start=1):
                os.set_blocking(fd, False)
                self.pipes[fd] = stream
            self.tail_fd = frame.fds[-1] if frame.fds else None
            return list(self.pipes)
        for fd in frame.fds:  # (no other frame carries any)
            os.close(fd)
        if kind == local.NOT_STARTED:
            (code,) = local.unpack(local.NOT_STARTED_FIELDS, payload, "NOT_STARTED")
            status = 127 if code == errno.ENOENT else 126
            how = "not found" if status == 127 else f"cannot be executed ({os.strerror(code)})"
            self.reported = True
            self.emit(protocol.exit_report(status, None, f"program {self.program!r} {how} on host "
                                                         f"{_socket.gethostname()}"))
        elif kind == local.SIGNALLED:
            self.signalled = True
        elif kind == local.LAUNCHER_LOST:
            (launcher,) = local.unpack(local.LAUNCHER_LOST_FIELDS, payload, "LAUNCHER_LOST")
            self.reason = (f"the MPI launcher's process that started instance {self.index} on "
                           f"{_socket.gethostname()} (PID {launcher}) died; the instance was stopped")
            self.emit(protocol.frame(protocol.LAUNCHER_LOST, self.reason.encode()))
        elif kind == local.EXITED:
            self.exit = local.unpack(local.EXITED_FIELDS, payload, "EXITED")
            self.drain_until = time.monotonic() + DRAIN_SECONDS
            self.tick(time.monotonic())
        else:
            raise local.LocalProtocolError(f"a frame of kind {kind} from a stub")
        return []

    def read(self, fd: int) -> bool:
        """Read one of the program's pipes that is ready; False at its end (then ``pipe_ended``,
        once the owner no longer watches it)."""
        try:
            data = os.read(fd, READ_SIZE)
        except BlockingIOError:  # emptied since it was found ready (``terminate``)
            return True
        if data:
            self._received(self.pipes[fd], fd, data)
            return True
        return False

    def pipe_ended(self, fd: int) -> None:
        self._close_pipe(fd)
        self.tick(time.monotonic())

    @property
    def waiting(self) -> bool:
        """Whether a deadline is ahead for ``tick``."""
        return self.finishing_until is not None or (self.exit is not None and not self.reported)

    def tick(self, now: float) -> None:
        """Deadlines: a traceback waited for, the drain after the program's exit."""
        if self.finishing_until is not None and (now >= self.finishing_until or self.exit is not None):
            self._stop_now()
        drained = not self.pipes or (self.drain_until is not None and now >= self.drain_until)
        if self.exit is not None and not self.reported and drained:
            self._report()

    def lost(self) -> None:
        """The stub's connection ended: what its pipes hold now is passed on, then they are closed;
        an error file no report will read goes."""
        for fd in list(self.pipes):
            self._read_to_the_end(fd)
        self.close_pipes()
        self.reader.close()
        if self.tidy and self.error_file and not self.reported and self.exit is None:
            root_cause.remove(self.error_file)

    def close_pipes(self) -> None:
        for fd in list(self.pipes):
            self._close_pipe(fd)

    # ------------------------------------------------------------------ internals
    def _received(self, stream: int, fd: int, data: bytes) -> None:
        if fd == self.tail_fd:
            self.tail.add(data, time.time_ns())
            if self.finishing_until is not None and not self.tail.printing():
                self._stop_now()
        self.emit(protocol.frame(protocol.OUTPUT, data, stream))

    def _read_to_the_end(self, fd: int | None = None) -> None:
        """Pass on what a pipe (stderr's by default) holds now, at most STOP_READ_LIMIT bytes."""
        fd = self.tail_fd if fd is None else fd
        read = 0
        while fd is not None and fd in self.pipes and read < STOP_READ_LIMIT:
            try:
                data = os.read(fd, READ_SIZE)
            except (BlockingIOError, OSError):
                return
            if not data:
                return
            read += len(data)
            self._received(self.pipes[fd], fd, data)

    def _close_pipe(self, fd: int) -> None:
        del self.pipes[fd]
        os.close(fd)
        if fd == self.tail_fd:
            self.tail_fd = None

    def _report(self) -> None:
        """How the program ended, as poprun reads it: its error file, the traceback it ended with
        when stopped, its times, then its exit status."""
        assert self.exit is not None
        self.reported = True
        status, signum, flags, ended_ns, stop_begun_ns = self.exit
        cause, recorded = root_cause.take(self.error_file, status != 0, keep=not self.tidy)
        for frame in protocol.before_exit(cause, self.uncaught, ended_ns, stop_begun_ns, recorded):
            self.emit(frame)
        oom_killed = signum == _signal.SIGKILL and not stop_begun_ns and self.oom_kills is not None \
            and (oom.kills() or 0) > self.oom_kills
        report_flags = (protocol.EXIT_STUB_SIGNALLED if self.signalled else 0) | \
            (protocol.EXIT_WAS_STOPPED if flags & local.EXITED_WAS_STOPPED else 0) | \
            (protocol.EXIT_OOM_KILLED if oom_killed else 0) | \
            (protocol.EXIT_MPI_ABORT if flags & local.EXITED_MPI_ABORT else 0)
        self.emit(protocol.exit_report(status, signum or None, self.reason, report_flags))
