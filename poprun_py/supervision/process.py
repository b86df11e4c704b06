"""The mpiexec child: spawned in a session of its own, its output on pipes, its exit seen at once.

A small stand-in for ``subprocess.Popen`` on the launch path: ``os.posix_spawn`` needs no import
beyond ``os``, where ``subprocess`` would add ~5 ms to every launch before mpiexec starts.
"""

from __future__ import annotations

import _signal
import os
import select

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Mapping


class CannotStart(Exception):
    """``posix_spawn`` itself failed (E2BIG, EACCES, ENOENT, ...): the command never ran. Its own
    type, so that only this failure is reported as one of starting mpiexec."""

    def __init__(self, exc: OSError) -> None:
        super().__init__(exc.strerror or str(exc))


class Process:
    """``argv`` started with ``posix_spawn``: new session (so its whole tree can be found and
    signalled), stdout/stderr on pipes, stdin from /dev/null when asked, ignored signals reset;
    ``env``: its environment (default: poprun's); CannotStart when it cannot be."""

    def __init__(self, argv: list[str], stdin_devnull: bool = False, env: Mapping[str, str] | None = None) -> None:
        out_read, out_write = os.pipe()  # both ends close-on-exec; dup2 makes 1 and 2 inheritable
        err_read, err_write = os.pipe()
        actions: list[tuple[int | str, ...]] = [
            (os.POSIX_SPAWN_DUP2, out_write, 1), (os.POSIX_SPAWN_DUP2, err_write, 2)
        ]
        if stdin_devnull:
            actions.append((os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0))
        try:
            self.pid = os.posix_spawn(argv[0], argv, os.environ if env is None else env, file_actions=actions,
                                      setsid=True, setsigdef=(_signal.SIGPIPE, _signal.SIGXFSZ))
        except OSError as exc:
            os.close(out_read)
            os.close(err_read)
            raise CannotStart(exc) from exc
        finally:
            os.close(out_write)
            os.close(err_write)
        self.stdout, self.stderr = out_read, err_read
        self.returncode: int | None = None
        self.exit_fd: int | None = _pidfd(self.pid)

    def poll(self) -> int | None:
        """The exit status (negative: killed by that signal) once the process has exited, else None."""
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def reap(self) -> int:
        """Collect the status once the pidfd has said the process exited (waitpid(WNOHANG) may
        still find nothing for a moment, e.g. under a tracer; this blocks until it can)."""
        if self.returncode is None:
            _, status = os.waitpid(self.pid, 0)
            self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float) -> int | None:
        """Wait up to ``timeout`` seconds for the exit; the status, or None if still running."""
        if self.poll() is not None:
            return self.returncode
        if self.exit_fd is not None:
            select.select([self.exit_fd], [], [], timeout)
        else:  # no pidfd (old kernel): poll coarsely
            import time

            deadline = time.monotonic() + timeout
            while self.poll() is None and time.monotonic() < deadline:
                time.sleep(0.01)
        return self.poll()

    def close(self) -> None:
        """Release the pipes and the pidfd; the owner removes them from its watch first and
        never closes them itself (a number closed twice may by then be someone else's)."""
        for fd in (self.stdout, self.stderr, self.exit_fd):
            if fd is not None and fd >= 0:
                os.close(fd)
        self.stdout = self.stderr = -1
        self.exit_fd = None


def _pidfd(pid: int) -> int | None:
    """A descriptor that becomes readable when ``pid`` exits (Linux >= 5.3), else None."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None
