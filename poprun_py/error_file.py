"""``--error-file``: what went wrong in each start of the job, as JSON, written so that no reader
sees half of it and nothing but the named file is touched. Imported only when a start fails."""

from __future__ import annotations

import errno
import os

from poprun_py import interrupts, log


def write(path: str, records: list[dict[str, object]]) -> None:
    """--error-file: every start of the job so far, as one JSON list.

    A regular file (or none yet) is replaced whole: the JSON goes to a new temporary file beside it,
    which is renamed over it, so no reader sees half of it; a symbolic link is followed, not
    replaced. Whatever else the path names (a terminal, ``/dev/stderr``, a FIFO that someone
    reads) is written to, never replaced. What cannot be written is a warning, and leaves nothing."""
    import json
    import stat

    text = (json.dumps(records, indent=2) + "\n").encode()
    target = os.path.realpath(path)
    try:
        mode = os.stat(target).st_mode
    except FileNotFoundError:
        mode = None
    except OSError as exc:
        log.warning("cannot write the error file %s: %s", path, exc.strerror or exc)
        return
    try:
        if mode is not None and not stat.S_ISREG(mode) and not stat.S_ISDIR(mode):
            _write_in_place(target, text)
        else:
            with interrupts.Held():  # else its temporary file could stay
                _replace_file(target, text, None if mode is None else stat.S_IMODE(mode))
    except OSError as exc:
        why = "no one reads that FIFO" if exc.errno == errno.ENXIO else exc.strerror or exc
        log.warning("cannot write the error file %s: %s", path, why)


def _write_in_place(target: str, text: bytes) -> None:
    """Write ``text`` into a file that is not a regular one; a FIFO that no one reads fails (ENXIO)
    instead of waiting for a reader."""
    from poprun_py.output import write_all

    fd = os.open(target, os.O_WRONLY | os.O_NONBLOCK | os.O_NOCTTY)
    try:
        write_all(fd, text)
    finally:
        os.close(fd)


def _replace_file(target: str, text: bytes, mode: int | None) -> None:
    """Replace the regular file ``target`` (or create it) with ``text``, through a new file beside it;
    the old file's permissions are kept (a new one's follow the umask). Nothing is left on failure."""
    import tempfile

    from poprun_py.output import write_all

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
