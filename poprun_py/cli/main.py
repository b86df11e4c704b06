"""The ``poprun`` command: read the command line (the click command in ``command``), launch,
exit with the job's status.

Errors are one line and never a traceback: usage errors exit 2, a missing program 127, a
non-executable one 126, mpiexec that cannot be started 1. poprun's own stdout and stderr failing
(a closed pipe, a full disk, a terminal gone) never ends a job: see ``own_output``.
"""

from __future__ import annotations

import errno
import os
import sys

from poprun_py.cli import command
from poprun_py.shared.errors import PlanError
from poprun_py.supervision import interrupts, own_output


def run(argv: list[str]) -> int:
    """``poprun ARGV``'s exit status."""
    options = command.parse(argv)
    if isinstance(options, int):
        return options
    from poprun_py.supervision.launch import ProgramError, launch
    from poprun_py.supervision.process import CannotStart

    try:
        return launch(options)
    except PlanError as exc:
        _error(str(exc))
        return 2
    except ProgramError as exc:
        _error(str(exc))
        return exc.status
    except CannotStart as exc:  # posix_spawn of mpiexec failed (E2BIG, EACCES, ...)
        _error(f"cannot start mpiexec: {exc}")
        return 1
    except OSError as exc:  # anything else poprun could not do (a full /tmp for its command files)
        _error(exc.strerror + (f": {exc.filename}" if exc.filename else "") if exc.strerror else str(exc))
        return 1


def _error(message: str) -> None:
    sys.stderr.write(f"poprun: error: {message}\n")
    sys.stderr.flush()


def _output_lost(status: int) -> int:
    """The status of a run without a job (--dry-run, --help) whose output could not be written:
    141 for a reader that went away (``poprun --dry-run | head``), quietly, as SIGPIPE would end
    a process; else the failure in one line, and 1 unless the run had failed already."""
    lost = own_output.lost()
    if lost is None:
        return status
    name, exc = lost
    if exc.errno == errno.EPIPE:
        return 128 + 13
    own_output.say(2 if name == "stdout" else 1, f"poprun: error: cannot write to {name}: {exc.strerror or exc}")
    return status or 1


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``poprun`` script."""
    own_output.install()  # first: before anything is opened or written
    interrupts.install()
    try:
        status = run(sys.argv[1:] if argv is None else list(argv))
        interrupts.ignore_for_good()  # os._exit below drops whatever comes from now
    except interrupts.Interrupted as exc:  # before or after the job, even while an error was said
        status = 128 + exc.signum
        interrupts.ignore_for_good()
    # Skip the interpreter's teardown (modules, GC): nothing is left to clean up, and every
    # launch would pay for it.
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except ValueError:  # closed by an in-process caller
            pass
    os._exit(_output_lost(status))
