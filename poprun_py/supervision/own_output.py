"""poprun's own stdout and stderr, whatever becomes of them while it runs.

Where poprun's output goes is the user's: a terminal that may close, a pipe whose reader may stop
(``| head``), a file on a disk that may fill. During a launch the job is what poprun is for, so a
write that fails there (EPIPE, ENOSPC, EIO, EBADF, ...) never ends it: the stream is dropped from
then on (written to nothing), this is said once on the other stream while that one still works,
and the job, its restarts, ``--error-file`` and its exit status go on exactly as they would have.
Outside a job (``--dry-run``, ``--help``) the output is all poprun does: the failure is kept
(``lost``) and ``cli`` ends with it, quietly with 141 for a reader that went away (as SIGPIPE
would), else in one line.

Everything poprun writes goes through ``sys.stdout`` and ``sys.stderr`` (print, click, logging,
the supervisor's sinks on their ``.buffer``): ``install`` rebuilds both over :class:`OwnStream`,
the one place where their writes can fail. It first opens /dev/null on any of descriptors 0-2
that poprun was started without (``>&-``): the next file poprun opened would take that number,
and its control socket or a log file would become its stderr.
"""

from __future__ import annotations

import io
import os
import sys

TYPE_CHECKING = False  # typing.TYPE_CHECKING, without importing typing on the launch path
if TYPE_CHECKING:
    from _typeshed import ReadableBuffer

NAMES = {1: "stdout", 2: "stderr"}


class OwnStream(io.RawIOBase):
    """poprun's descriptor 1 or 2, whose writes never fail: the first failure is kept in
    ``failure``, and that write and every later one are dropped."""

    def __init__(self, fd: int) -> None:
        super().__init__()
        self.fd = fd
        self.name = NAMES.get(fd, f"descriptor {fd}")
        self.failure: OSError | None = None
        self.ends_line = True  # the last byte written was a newline (or nothing was written yet)

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self.fd

    def isatty(self) -> bool:
        return os.isatty(self.fd)

    def write(self, data: ReadableBuffer) -> int | None:
        view = memoryview(data).cast("B")
        if self.failure is not None:
            return len(view)
        try:
            written = os.write(self.fd, view)
        except BlockingIOError:
            return None  # a descriptor left non-blocking: the writer above decides (not a failure)
        except OSError as exc:
            self.failure = exc
            if _job_runs:
                _say_dropped(self, exc)
            return len(view)
        if written:
            self.ends_line = view[written - 1] == 0x0A
        return written


#: The streams ``install`` made, by descriptor.
_streams: dict[int, tuple[OwnStream, io.TextIOWrapper]] = {}
#: A job runs (see ``job_runs``): failures are said and dropped, not left for the end.
_job_runs = False


def install() -> None:
    """At the very start of poprun, before it opens anything: /dev/null on a closed descriptor
    0-2, and ``sys.stdout``/``sys.stderr`` rebuilt over :class:`OwnStream`, as they were set up
    (encoding, buffering; a closed one as Python's defaults would have it)."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:  # not open: the lowest free number is this one (those below are open)
            null = os.open(os.devnull, os.O_RDWR)
            if null != fd:
                os.dup2(null, fd)
                os.close(null)
            os.set_inheritable(fd, True)  # as a standard stream is: mpiexec and the job get it too
    for fd, old in ((1, sys.stdout), (2, sys.stderr)):
        raw = OwnStream(fd)
        if isinstance(old, io.TextIOWrapper):
            old.flush()
            text = io.TextIOWrapper(io.BufferedWriter(raw), old.encoding, old.errors, "\n",
                                    old.line_buffering, old.write_through)
        else:  # it was closed (None): as Python would have set it up
            text = io.TextIOWrapper(io.BufferedWriter(raw), "utf-8", "backslashreplace", "\n", fd == 2)
        _streams[fd] = (raw, text)
    sys.stdout, sys.stderr = _streams[1][1], _streams[2][1]


def job_runs() -> None:
    """A job is about to run: from now on a stream whose write fails is dropped, said once."""
    global _job_runs
    _job_runs = True
    for raw, _ in _streams.values():
        if raw.failure is not None:  # before, while the options were read: said now
            _say_dropped(raw, raw.failure)


def lost() -> tuple[str, OSError] | None:
    """The stream that failed outside a job, and how (nothing was said); None if none did."""
    if _job_runs:
        return None
    for raw, _ in _streams.values():
        if raw.failure is not None:
            return raw.name, raw.failure
    return None


def say(fd: int, line: str) -> None:
    """``line`` on stream ``fd``, on a line of its own, if that stream still works."""
    raw, text = _streams[fd]
    if raw.failure is not None:  # (checked first: this stream's own write may be what is failing)
        return
    text.flush()  # what it holds first, so that ``ends_line`` is that of all that was written
    if raw.failure is None:
        text.write(("" if raw.ends_line else "\n") + line + "\n")
        text.flush()


def _say_dropped(stream: OwnStream, exc: OSError) -> None:
    other = 3 - stream.fd
    if other in _streams:
        say(other, f"poprun: cannot write to {stream.name}: {exc.strerror or exc}; its output is dropped "
                   "from now on (the job goes on)")
