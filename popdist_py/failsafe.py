"""Failure propagation: an instance that fails must never leave its peers waiting in a collective.

With plain mpi4py an instance that raises, or calls ``sys.exit(3)``, while its peers wait in a
collective hangs the whole job: it enters ``MPI_Finalize``, which waits for the peers, which wait
for it. Once MPI is initialised by popdist_py (``init()`` or the first collective) in a job of
more than one instance, these hooks are installed:

* ``sys.excepthook``: an uncaught exception prints its traceback (through the previous hook),
  flushes, and ends the instance with status 1 (130 for KeyboardInterrupt) without
  ``MPI_Finalize``; the launcher then stops every other instance (see :func:`terminate`).
* ``threading.excepthook``: same for an uncaught exception in any thread. Chosen because a
  thread that died may never reach a collective its peers are waiting in; to keep a thread's
  failure local, catch it in the thread or set your own ``threading.excepthook`` after ``init()``.
  (``SystemExit`` in a thread only ends that thread, as in plain Python.)
* ``sys.exit``, the ``exit``/``quit`` builtins and ``raise SystemExit(N)``: the main thread's
  exit status is recorded. Python (3.11) hands no hook the status of a ``SystemExit`` that ends
  the program, so the builtin name ``SystemExit`` becomes :class:`InstanceExit`, a subclass that
  records its status when created; ``except SystemExit`` still catches it. An ``atexit``
  handler, registered when popdist_py is imported so that it runs after the handlers registered
  later, then ends a process exiting with a non-zero status N the same way (status N, no
  ``MPI_Finalize``, which could block for ever waiting for the peers). A ``SystemExit`` that is
  caught and dropped is forgotten again. Only a ``SystemExit`` raised by C code (a ``sys.exit``
  bound before ``init()``, as ``from sys import exit`` does, or ``_thread.exit``) is a plain
  one: it is not recorded, and ``except SystemExit`` written after ``init()`` does not catch it
  (``except BaseException`` does).
* A normal exit (status 0) finalises MPI as usual (mpi4py does it at the very end).

In an interactive session (``python -i``) exceptions do not end the process.
"""

from __future__ import annotations

import atexit
import builtins
import os
import sys
import threading
import time
from types import TracebackType
from typing import Any, NoReturn

from popdist_py import topology

#: Seconds between flushing and MPI_Abort, so that mpiexec forwards all of this instance's output.
ABORT_GRACE = 0.25

_installed = False
_lock = threading.Lock()
#: (token, status) of the last SystemExit created by the main thread, until it is dropped.
_pending: tuple[int, int] | None = None
_counter = 0
_previous_excepthook = sys.excepthook
_previous_threading_excepthook = threading.excepthook


def exit_status(code: Any) -> int:
    """The process exit status Python derives from ``SystemExit(code)``."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    return 1


_BUILTIN_SYSTEM_EXIT = SystemExit


class InstanceExit(_BUILTIN_SYSTEM_EXIT):
    """``SystemExit`` that records its status for :func:`_at_exit` when the main thread creates it
    (by ``sys.exit``, ``exit`` or ``raise SystemExit``), and forgets it when caught and dropped."""

    _token = 0

    def __init__(self, *args: Any) -> None:
        global _counter, _pending
        super().__init__(*args)
        if threading.current_thread() is threading.main_thread():
            _counter += 1
            self._token = _counter
            _pending = (_counter, exit_status(self.code))

    # Not mutated by `make mutants`: mutmut's call wrapper would always be frame 1.
    def __del__(self) -> None:  # pragma: no mutate block
        global _pending
        try:
            sys._getframe(1)
        except ValueError:  # freed by the interpreter's top level: the process is exiting with it
            return
        pending = _pending
        if pending is not None and pending[0] == self._token:
            _pending = None


def _exit(status: Any = None, /) -> NoReturn:
    """``sys.exit`` that records the main thread's exit status for :func:`_at_exit`."""
    raise InstanceExit(status)


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass


def _mpi_active() -> bool:
    MPI = sys.modules.get("mpi4py.MPI")
    return MPI is not None and MPI.Is_initialized() and not MPI.Is_finalized()


def terminate(status: int, reason: str) -> None:
    """Say why, flush, and end this instance now with ``status``, without MPI_Finalize.

    How depends on who watches the process (both measured with MPICH's ``mpiexec``):

    * under ``poprun`` (the ``POPDIST_*`` environment is set) a per-instance shim is the MPI
      launcher's process and this program its child: ``os._exit(status)``, so the shim reports
      the exact status and poprun stops the other instances (``MPI_Abort`` would make the
      launcher kill the shim first: status lost);
    * directly under ``mpiexec``: ``MPI_Abort(status)`` after a short grace period, so that
      ``mpiexec`` exits with exactly ``status`` (after a plain non-zero exit it sometimes
      returned 9, the SIGKILL of a peer it stopped) and forwards this instance's last output
      (without the grace period the end of a traceback was lost in about 1 run in 30).

    After ``popdist_py.finalize()`` no peer can be waiting for this instance: nothing is done.
    """
    if not _mpi_active():
        return
    import logging

    comm = sys.modules["mpi4py.MPI"].COMM_WORLD
    logging.getLogger(__name__).critical(
        "instance %d of %d: %s; ending the job with status %d", comm.Get_rank(), comm.Get_size(), reason, status)
    logging.shutdown()
    _flush()
    if topology.is_set():
        os._exit(status)
    time.sleep(ABORT_GRACE)
    comm.Abort(status)


def _excepthook(exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
    try:
        _previous_excepthook(exc_type, exc, tb)
    finally:
        if not (hasattr(sys, "ps1") or sys.flags.interactive):
            status = 130 if issubclass(exc_type, KeyboardInterrupt) else 1
            terminate(status, f"uncaught {exc_type.__name__}")


def _threading_excepthook(args: threading.ExceptHookArgs) -> None:
    try:
        _previous_threading_excepthook(args)
    finally:
        if not (hasattr(sys, "ps1") or sys.flags.interactive):
            name = args.thread.name if args.thread is not None else "?"
            terminate(1, f"uncaught {args.exc_type.__name__} in thread {name!r}")


def _at_exit() -> None:
    """End a process exiting with a recorded non-zero status before MPI_Finalize is entered."""
    pending = _pending
    if _installed and pending is not None and pending[1] != 0:
        terminate(pending[1], f"exit status {pending[1]}")


def install() -> None:
    """Install the hooks (once); a no-op in a one-process job, where no peer can hang."""
    global _installed, _previous_excepthook, _previous_threading_excepthook
    with _lock:
        if _installed or sys.modules["mpi4py.MPI"].COMM_WORLD.Get_size() == 1:
            return
        _installed = True
        _previous_excepthook = sys.excepthook
        _previous_threading_excepthook = threading.excepthook
        sys.excepthook = _excepthook
        threading.excepthook = _threading_excepthook
        sys.exit = _exit
        # The ``exit``/``quit`` builtins raise whatever the builtin name means when called: these too.
        builtins.SystemExit = InstanceExit  # type: ignore[misc]


# Registered at import (popdist_py imports this module), early, so that it runs late at exit.
atexit.register(_at_exit)
