"""The program's start and the stub's own end, for the stub's Python fallback (``stub.fallback``;
``_stub.c`` does the same in C): start the program in its own process group on pipes, and leave
under MPICH's gforker behind a holder of gforker's descriptors until gforker has reaped the stub.

Built on the interpreter's own modules, as it runs under ``python -S``.
"""

from __future__ import annotations

import _signal
import errno
import os
import time

from poprun_py.shared import sweep
from poprun_py.shared.paths import which

TYPE_CHECKING = False  # typing.TYPE_CHECKING, without importing typing under python -S
if TYPE_CHECKING:
    from typing import NoReturn

    from poprun_py.stub.pmi_relay import PmiRelay


def spawn(argv: list[bytes], *, no_stdin: bool, one_stream: bool = False,
          pmi: PmiRelay | None = None) -> tuple[int, int, int | None] | OSError:
    """Start ``argv`` in its own process group with stdout/stderr on pipes (with ``one_stream``, one
    pipe for both, as ``2>&1`` makes them: only then does the order of its writes survive), and
    stdin from /dev/null when ``no_stdin``.

    Returns ``(pid, stdout_fd, stderr_fd)`` (``stderr_fd`` None for one stream), or the OSError
    saying why it cannot start. What mpiexec gave us stays inherited, but MPICH's PMI_FD, which
    ``pmi`` takes the place of (``pmi_relay``); our own descriptors are close-on-exec.
    """
    program = os.fsdecode(argv[0])
    if which(program) is None:
        missing = os.sep not in program or not os.path.exists(program)
        code = errno.ENOENT if missing else errno.EACCES
        return OSError(code, os.strerror(code))
    setpriv = which("setpriv")
    command: list[str | bytes] = [setpriv, "--pdeathsig", "KILL", "--", *argv] if setpriv else [*argv]
    out_r, out_w = os.pipe()
    err_r, err_w = (None, out_w) if one_stream else os.pipe()
    try:
        actions: list[tuple[int | str, ...]] = [(os.POSIX_SPAWN_DUP2, out_w, 1), (os.POSIX_SPAWN_DUP2, err_w, 2)]
        if no_stdin:
            actions.append((os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0))
        if pmi is not None:
            actions.append(pmi.spawn_action())
        pid = os.posix_spawnp(command[0], command, os.environ, setpgroup=0, file_actions=actions,
                              # Python ignores these; programs expect the defaults.
                              setsigdef=(_signal.SIGPIPE, _signal.SIGXFSZ))
    except OSError as exc:
        os.close(out_r)
        if err_r is not None:
            os.close(err_r)
        return exc
    finally:
        os.close(out_w)
        if err_w != out_w:
            os.close(err_w)
        if pmi is not None:
            pmi.spawned()
    return pid, out_r, err_r


#: A stub's status when it starts no program: it could not reach its supervisor, or get the
#: program from it.
NOT_STARTED = 1
#: The most a holder (:func:`hold_until_reaped`) waits for its process to be reaped.
HOLD_LIMIT = 1.0
#: How often a holder looks where Linux does not wake it when its process is reaped.
HOLD_POLL = 0.002


def leave(status: int) -> NoReturn:
    """End this process (a stub) with ``status``; under MPICH's gforker, behind a holder
    (:func:`hold_until_reaped`).

    gforker reads its children's stdout, stderr and PMI descriptors until all are closed, then
    waits for the children it has not reaped yet; that wait counts them once and, if any was
    left, spins a core until its 2 s limit runs out. A process's descriptors close before its
    parent learns that it exited, so a per-instance process's own exit (then a shim's) left
    gforker one unreaped child in about one one-host job in five (measured on 2026-11-27: 4 of 20
    jobs ended 1.5-2 s late). With the holder, the last descriptor closes once gforker has reaped
    this process."""
    if _parent_is_gforker():
        hold_until_reaped()
    os._exit(status)


def _parent_is_gforker() -> bool:
    try:
        return os.path.basename(os.readlink(f"/proc/{os.getppid()}/exe")) == "mpiexec.gforker"
    except OSError:
        return False


def hold_until_reaped() -> None:
    """Fork a holder that keeps this process's stdin, stdout, stderr and MPICH's ``PMI_FD`` open
    until this process has exited and been reaped (or :data:`HOLD_LIMIT` has passed), and closes
    every other descriptor at once; the caller goes on (to exit). The holder sleeps on a pidfd of
    this process, which Linux wakes with EPOLLHUP once it is reaped (6.9 on); where it is not woken,
    it looks every :data:`HOLD_POLL`."""
    me = os.getpid()
    born = sweep.start_time(me)
    try:
        if os.fork():
            return
    except OSError:  # no holder: gforker may wait its 2 s, nothing worse
        return
    try:
        from poprun_py.stub.pmi_relay import pmi_line

        keep = max(2, pmi_line() or 2)
        os.closerange(3, keep)
        os.closerange(keep + 1, os.sysconf("SC_OPEN_MAX"))
        _wait_reaped(me, born, time.monotonic() + HOLD_LIMIT)
    finally:
        os._exit(0)


def _wait_reaped(pid: int, born: bytes | None, deadline: float) -> None:
    """Until process ``pid`` (started at ``born``) has been reaped, or ``deadline``."""
    import select

    try:
        watch = select.epoll()
        watch.register(os.pidfd_open(pid), select.EPOLLIN | select.EPOLLHUP | select.EPOLLET)
    except OSError:  # gone already, or no pidfd: the look alone
        watch = None
    while (left := deadline - time.monotonic()) > 0:
        if watch is None:
            time.sleep(min(left, HOLD_POLL))
        else:
            woken = watch.poll(min(left, HOLD_POLL))
            if any(events & select.EPOLLHUP for _, events in woken):
                return  # reaped
            if woken:
                continue  # it exited; its reaping wakes this again
        if sweep.start_time(pid) != born:
            return
