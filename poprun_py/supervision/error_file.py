"""``--error-file``: what went wrong in each start of the job, as JSON, written so that no reader
sees half of it and nothing but the named file is touched.

The place is checked before anything starts (``ErrorFile``): a record that could not be written
would be found out only after the job had failed, when it is needed."""

from __future__ import annotations

import errno
import os
import stat

from poprun_py.shared.errors import PlanError
from poprun_py.supervision import interrupts, log

#: How long poprun waits at most for the reader of an --error-file that is not a regular file.
IN_PLACE_LIMIT = 10.0


class ErrorFile:
    """--error-file ``path``, found able to take the record, or PlanError (one line) saying why not.

    A regular file (or none yet) will be replaced whole: its folder must exist and take a new file
    (one is made and removed, as ``write`` will). Whatever else the path names (a terminal,
    ``/dev/stderr``, a FIFO) is opened now and held until the end, so that a FIFO's reader is not
    sent an end of file before the record comes: one that no one reads, or a device that refuses
    writes (``/dev/full``), is refused."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd: int | None = None
        try:
            mode: int | None = os.stat(path).st_mode
        except FileNotFoundError:
            mode = None
        except OSError as exc:
            raise self._refused(f"cannot be reached: {exc.strerror or exc}") from None
        if mode is not None and stat.S_ISDIR(mode):
            raise self._refused("is a directory: give a file name")
        if mode is None or stat.S_ISREG(mode):
            self._check_folder()
        else:
            self.fd = self._open_in_place()

    def _refused(self, why: str) -> PlanError:
        return PlanError(f"--error-file {self.path!r} {why}")

    def _check_folder(self) -> None:
        import tempfile

        target = os.path.realpath(self.path)
        folder = os.path.dirname(target)
        if not os.path.isdir(folder):
            raise self._refused(f"is in a folder that does not exist ({folder})")
        try:
            fd, probe = tempfile.mkstemp(prefix=f".{os.path.basename(target)}.", dir=folder)
        except OSError as exc:
            raise self._refused(f"cannot be written: no file can be made in {folder}: {exc.strerror or exc}") from None
        os.close(fd)
        os.unlink(probe)

    def _open_in_place(self) -> int:
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_NONBLOCK | os.O_NOCTTY)
        except OSError as exc:
            why = ("is a FIFO that no one reads (start its reader first)" if exc.errno == errno.ENXIO
                   else f"cannot be opened for writing: {exc.strerror or exc}")
            raise self._refused(why) from None
        try:
            os.write(fd, b"")  # a device that refuses every write says so now (/dev/full: ENOSPC)
        except OSError as exc:
            os.close(fd)
            raise self._refused(f"cannot be written: {exc.strerror or exc}") from None
        return fd

    def write(self, records: list[dict[str, object]]) -> None:
        """Every start of the job so far, as one JSON list.

        A regular file (or none yet) is replaced whole: the JSON goes to a new temporary file beside
        it, which is renamed over it, so no reader sees half of it; a symbolic link is followed, not
        replaced. Anything else is written to (each list after the last), never replaced. What
        cannot be written now (a disk that filled during the job) is a warning, and leaves nothing."""
        import json

        text = (json.dumps(records, indent=2) + "\n").encode()
        try:
            if self.fd is not None:
                write_within(self.fd, text, IN_PLACE_LIMIT)
                return
            target = os.path.realpath(self.path)
            try:
                mode: int | None = stat.S_IMODE(os.stat(target).st_mode)
            except FileNotFoundError:
                mode = None
            with interrupts.Held():  # else its temporary file could stay
                _replace_file(target, text, mode)
        except OSError as exc:
            log.warning("cannot write the error file %s: %s", self.path, exc.strerror or exc)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def write_within(fd: int, text: bytes, limit: float) -> None:
    """All of ``text`` to the non-blocking ``fd``, waiting for a slow reader at most ``limit``
    seconds in all: a reader that holds a FIFO open but never reads cannot keep poprun from ending
    (TimeoutError, which the caller's warning names)."""
    import select
    import time

    deadline = time.monotonic() + limit
    view = memoryview(text)
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    while view:
        try:
            view = view[os.write(fd, view):]
            continue
        except BlockingIOError:
            pass
        left = deadline - time.monotonic()
        if left <= 0 or not poller.poll(left * 1000):
            raise TimeoutError(errno.ETIMEDOUT, f"its reader took none of it for {limit:g} s")


def _replace_file(target: str, text: bytes, mode: int | None) -> None:
    """Replace the regular file ``target`` (or create it) with ``text``, through a new file beside it;
    the old file's permissions are kept (a new one's follow the umask). Nothing is left on failure."""
    import tempfile

    from poprun_py.supervision.output import write_all

    if mode is None:
        umask = os.umask(0)
        os.umask(umask)
        mode = 0o666 & ~umask
    fd, temporary = tempfile.mkstemp(prefix=f".{os.path.basename(target)}.", dir=os.path.dirname(target))
    try:
        try:
            os.fchmod(fd, mode)
            write_all(fd, text)
        finally:
            os.close(fd)
        os.replace(temporary, target)
    except BaseException:
        try:
            os.unlink(temporary)
        except OSError:
            pass
        raise
