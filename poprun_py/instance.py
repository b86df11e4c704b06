"""Per-instance shim: ``mpiexec`` starts this, it starts the user's program.

It streams the program's stdout/stderr to ``poprun`` as frames (so ``poprun`` can tag whole
lines and never interleave them), reports the exact exit status or signal, and stops the
program's whole process group when ``poprun`` says so or when it is signalled itself. The
program dies with the shim (PR_SET_PDEATHSIG), so a SIGKILLed shim leaves nothing behind.

Run as ``python -S instance.py INDEX PROGRAM [ARGS...]``: stdlib only, for a fast start.
"""

from __future__ import annotations

import os
import selectors
import signal
import socket
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from poprun_py import protocol  # noqa: E402

READ_SIZE = 65536
#: After the program exits, how long descendants may keep its pipes open before they are killed.
DRAIN_SECONDS = 1.0


def _die_with_parent() -> None:
    """In the child: get SIGKILL if the shim dies, whatever kills it."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class Shim:
    def __init__(self, index: int, argv: list[str], control: socket.socket) -> None:
        self.index = index
        self.argv = argv
        self.control = control
        self.grace = float(os.environ.get(protocol.ENV_GRACE, protocol.DEFAULT_GRACE))
        self.child: subprocess.Popen[bytes] | None = None
        self.kill_at: float | None = None

    def send(self, data: bytes) -> None:
        try:
            self.control.sendall(data)
        except OSError:
            pass  # poprun is gone; keep going so the program is still stopped cleanly

    def stop_program(self, *_: object) -> None:
        """SIGTERM the program's process group now, SIGKILL it after the grace period."""
        if self.child is None or self.kill_at is not None:
            return
        self.kill_at = time.monotonic() + self.grace
        self._signal_group(signal.SIGTERM)

    def _signal_group(self, sig: int) -> None:
        assert self.child is not None
        try:
            os.killpg(self.child.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, self.stop_program)
        self.send(protocol.json_frame(protocol.HELLO, {
            "instance": self.index, "host": socket.gethostname(), "pid": os.getpid(),
        }))
        try:
            # close_fds=False: the program must inherit what mpiexec gave us (e.g. MPICH's PMI_FD);
            # our own descriptors are non-inheritable (PEP 446).
            self.child = subprocess.Popen(
                self.argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, close_fds=False,
                process_group=0, preexec_fn=_die_with_parent,
            )
        except OSError as exc:
            status = 127 if isinstance(exc, FileNotFoundError) else 126
            reason = "not found" if status == 127 else f"cannot be executed ({exc.strerror})"
            message = f"program {self.argv[0]!r} {reason} on host {socket.gethostname()}"
            self.send(protocol.json_frame(protocol.EXIT, {"status": status, "signal": None, "error": message}))
            return status
        status, signum = self._pump()
        self.send(protocol.json_frame(protocol.EXIT, {"status": status, "signal": signum, "error": None}))
        return status

    def _pump(self) -> tuple[int, int | None]:
        assert self.child is not None and self.child.stdout and self.child.stderr
        selector = selectors.DefaultSelector()
        selector.register(self.child.stdout, selectors.EVENT_READ, 1)
        selector.register(self.child.stderr, selectors.EVENT_READ, 2)
        selector.register(self.control, selectors.EVENT_READ, 0)
        try:  # wake the moment the program exits instead of polling (Linux >= 5.3)
            exit_fd: int | None = os.pidfd_open(self.child.pid)
            selector.register(exit_fd, selectors.EVENT_READ, 3)
        except (AttributeError, OSError):
            exit_fd = None
        open_streams = 2
        drain_until: float | None = None
        while True:
            now = time.monotonic()
            if self.kill_at is not None and now >= self.kill_at:
                self._signal_group(signal.SIGKILL)
                self.kill_at = float("inf")
            if drain_until is None and self.child.poll() is not None:
                drain_until = now + DRAIN_SECONDS
            if drain_until is not None and (open_streams == 0 or now >= drain_until):
                break
            if self.kill_at is not None:
                timeout = max(0.0, self.kill_at - now) if self.kill_at != float("inf") else 0.05
            elif drain_until is not None:
                timeout = max(0.0, drain_until - now)
            else:
                timeout = 1.0 if exit_fd is not None or open_streams else 0.05
            for key, _ in selector.select(timeout):
                stream = key.data
                if stream == 3:
                    selector.unregister(exit_fd)
                    continue
                if stream == 0:
                    try:
                        message = self.control.recv(64)
                    except OSError:
                        message = b""
                    if not message or protocol.TERMINATE in message:
                        # poprun asked us to stop, or poprun itself is gone: stop the program.
                        selector.unregister(self.control)
                        self.stop_program()
                    continue
                data = os.read(key.fileobj.fileno(), READ_SIZE)
                if data:
                    self.send(protocol.frame(protocol.OUTPUT, data, stream))
                else:
                    selector.unregister(key.fileobj)
                    open_streams -= 1
        returncode = self.child.wait()
        if exit_fd is not None:
            os.close(exit_fd)
        # Descendants that outlived the program (or held its pipes) must not outlive the job.
        self._signal_group(signal.SIGKILL)
        if returncode < 0:
            return 128 - returncode, -returncode
        return returncode, None


def main() -> int:
    index, argv = int(sys.argv[1]), sys.argv[2:]
    host, _, port = os.environ[protocol.ENV_CONTROL].rpartition(":")
    try:
        control = socket.create_connection((host, int(port)), timeout=30)
    except OSError as exc:
        # Cannot reach poprun: run the program in place so nothing is lost; poprun still sees
        # the exit status through mpiexec.
        print(f"poprun instance {index}: cannot reach poprun at {host}:{port} ({exc}); "
              "output will not be tagged", file=sys.stderr, flush=True)
        os.execvp(argv[0], argv)
    control.settimeout(None)
    control.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return Shim(index, argv, control).run()


if __name__ == "__main__":
    sys.exit(main())
