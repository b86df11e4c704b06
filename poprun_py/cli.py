"""The ``poprun`` command: read the command line (the click command in ``command``), launch,
exit with the job's status.

Errors are one line and never a traceback: usage errors exit 2, a missing program 127, a
non-executable one 126.
"""

from __future__ import annotations

import os
import sys

from poprun_py import command, interrupts
from poprun_py.errors import PlanError


def run(argv: list[str]) -> int:
    """``poprun ARGV``'s exit status."""
    options = command.parse(argv)
    if isinstance(options, int):
        return options
    from poprun_py.launch import ProgramError, launch

    try:
        return launch(options)
    except PlanError as exc:
        _error(str(exc))
        return 2
    except ProgramError as exc:
        _error(str(exc))
        return exc.status
    except BrokenPipeError:
        # Whoever read our output stopped reading (``poprun --dry-run | head``): nothing to report,
        # and the interpreter must not complain when it flushes stdout at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + 13  # as a process killed by SIGPIPE
    except OSError as exc:  # mpiexec itself cannot be started (E2BIG, EACCES, ...)
        _error(f"cannot start mpiexec: {exc.strerror or exc}")
        return 1


def _error(message: str) -> None:
    sys.stderr.write(f"poprun: error: {message}\n")


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``poprun`` script."""
    interrupts.install()
    try:
        status = run(sys.argv[1:] if argv is None else list(argv))
    except interrupts.Interrupted as exc:  # before or after the job, even while an error was said
        status = 128 + exc.signum
    interrupts.Held().__enter__()  # for good: os._exit below drops whatever comes now
    # Skip the interpreter's teardown (modules, GC): nothing is left to clean up, and every
    # launch would pay for it.
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (BrokenPipeError, ValueError):
            pass  # the reader went away (e.g. `| head`): nothing more can be said
    os._exit(status)
