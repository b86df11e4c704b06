"""Per-instance shim: ``mpiexec`` starts this, it starts the user's program.

It streams the program's stdout/stderr to ``poprun`` as frames (so ``poprun`` can tag whole
lines and never interleave them), reports the exact exit status or signal, and stops the
program's whole process group when ``poprun`` says so or when it is signalled itself. The
program dies with the shim (PR_SET_PDEATHSIG), so a SIGKILLed shim leaves nothing behind.

Run as ``python -S instance.py INDEX PROGRAM [ARGS...]``: stdlib only. The program is forked
before anything else is imported (subprocess, sockets and selectors cost more than the fork),
so every launch waits for Python's start-up and little else.
"""

from __future__ import annotations

import os
import signal
import sys



def _pdeathsig() -> object | None:
    """libc's prctl, to ask for SIGKILL when the shim dies (Linux); None elsewhere."""
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError, ImportError):
        return None


def spawn(argv: list[str]) -> tuple[int, int, int] | OSError:
    """fork/exec ``argv`` in its own process group with stdout/stderr on pipes.

    Returns ``(pid, stdout_fd, stderr_fd)``, or the OSError that made exec fail. What mpiexec
    gave us (e.g. MPICH's PMI_FD) stays inherited; our own descriptors are close-on-exec.
    """
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    report_r, report_w = os.pipe()  # close-on-exec: EOF means exec succeeded
    prctl = _pdeathsig()
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:
        try:
            os.setpgid(0, 0)
            if prctl is not None:
                prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
                if os.getppid() != parent:
                    os._exit(1)  # the shim died before prctl took effect
            for sig in (signal.SIGPIPE, signal.SIGXFSZ):  # Python ignores these; programs expect defaults
                signal.signal(sig, signal.SIG_DFL)
            os.dup2(out_w, 1)
            os.dup2(err_w, 2)
            os.execvp(argv[0], argv)
        except OSError as exc:
            os.write(report_w, str(exc.errno).encode())
        finally:
            os._exit(127)
    for fd in (out_w, err_w, report_w):
        os.close(fd)
    report = b""
    while chunk := os.read(report_r, 64):
        report += chunk
    os.close(report_r)
    if report:
        os.waitpid(pid, 0)
        os.close(out_r)
        os.close(err_r)
        errno = int(report)
        return OSError(errno, os.strerror(errno))
    return pid, out_r, err_r


def main() -> int:
    index, argv = int(sys.argv[1]), sys.argv[2:]
    spawned = spawn(argv)  # first: the program starts while we import and connect

    import socket

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from poprun_py import protocol
    from poprun_py.shim_pump import Pump

    host, _, port = os.environ[protocol.ENV_CONTROL].rpartition(":")
    try:
        control: socket.socket | None = socket.create_connection((host, int(port)), timeout=30)
        control.settimeout(None)
        control.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except OSError as exc:
        # Cannot reach poprun: pass the output through untagged, so nothing is lost; poprun
        # still sees the exit status through mpiexec.
        print(f"poprun instance {index}: cannot reach poprun at {host}:{port} ({exc}); "
              "output will not be tagged", file=sys.stderr, flush=True)
        control = None
    pump = Pump(index, control)
    pump.hello()
    if isinstance(spawned, OSError):
        return pump.spawn_failed(argv[0], spawned)
    return pump.run(*spawned)


if __name__ == "__main__":
    sys.exit(main())
