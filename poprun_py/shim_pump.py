"""The shim's loop once the program runs: frames out, TERMINATE in, exit status last."""

from __future__ import annotations

import os
import selectors
import signal
import socket
import time

from poprun_py import protocol

READ_SIZE = 65536
#: After the program exits, how long descendants may keep its pipes open before they are killed.
DRAIN_SECONDS = 1.0


class Pump:
    def __init__(self, index: int, control: socket.socket | None) -> None:
        self.index = index
        self.control = control
        self.grace = float(os.environ.get(protocol.ENV_GRACE, protocol.DEFAULT_GRACE))
        self.pid: int | None = None
        self.kill_at: float | None = None

    def send(self, kind: int, payload: bytes, stream: int = 0) -> None:
        if self.control is None:
            if kind == protocol.OUTPUT:
                os.write(stream, payload)  # no poprun: pass output through as it is
            return
        try:
            self.control.sendall(protocol.frame(kind, payload, stream))
        except OSError:
            pass  # poprun is gone; keep going so the program is still stopped cleanly

    def send_json(self, kind: int, obj: dict) -> None:
        import json

        self.send(kind, json.dumps(obj).encode())

    def hello(self) -> None:
        self.send_json(protocol.HELLO, {"instance": self.index, "host": socket.gethostname(), "pid": os.getpid()})

    def spawn_failed(self, program: str, error: OSError) -> int:
        status = 127 if isinstance(error, FileNotFoundError) or error.errno == 2 else 126
        reason = "not found" if status == 127 else f"cannot be executed ({error.strerror})"
        message = f"program {program!r} {reason} on host {socket.gethostname()}"
        self.send_json(protocol.EXIT, {"status": status, "signal": None, "error": message})
        return status

    def stop_program(self, *_: object) -> None:
        """SIGTERM the program's process group now, SIGKILL it after the grace period."""
        if self.pid is None or self.kill_at is not None:
            return
        self.kill_at = time.monotonic() + self.grace
        self._signal_group(signal.SIGTERM)

    def _signal_group(self, sig: int) -> None:
        assert self.pid is not None
        try:
            os.killpg(self.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def run(self, pid: int, stdout_fd: int, stderr_fd: int) -> int:
        self.pid = pid
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, self.stop_program)
        status, signum = self._pump(stdout_fd, stderr_fd)
        self.send_json(protocol.EXIT, {"status": status, "signal": signum, "error": None})
        return status

    def _pump(self, stdout_fd: int, stderr_fd: int) -> tuple[int, int | None]:
        assert self.pid is not None
        selector = selectors.DefaultSelector()
        selector.register(stdout_fd, selectors.EVENT_READ, 1)
        selector.register(stderr_fd, selectors.EVENT_READ, 2)
        if self.control is not None:
            selector.register(self.control, selectors.EVENT_READ, 0)
        try:  # wake the moment the program exits instead of polling (Linux >= 5.3)
            exit_fd: int | None = os.pidfd_open(self.pid)
            selector.register(exit_fd, selectors.EVENT_READ, 3)
        except (AttributeError, OSError):
            exit_fd = None
        open_streams = 2
        drain_until: float | None = None
        returncode: int | None = None
        while True:
            now = time.monotonic()
            if self.kill_at is not None and now >= self.kill_at:
                self._signal_group(signal.SIGKILL)
                self.kill_at = float("inf")
            if returncode is None:
                waited, wait_status = os.waitpid(self.pid, os.WNOHANG)
                if waited:
                    returncode = os.waitstatus_to_exitcode(wait_status)
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
                    selector.unregister(key.fileobj)
                elif stream == 0:
                    try:
                        message = self.control.recv(64)  # type: ignore[union-attr]
                    except OSError:
                        message = b""
                    if not message or protocol.TERMINATE in message:
                        # poprun asked us to stop, or poprun itself is gone: stop the program.
                        selector.unregister(key.fileobj)
                        self.stop_program()
                else:
                    data = os.read(key.fd, READ_SIZE)
                    if data:
                        self.send(protocol.OUTPUT, data, stream)
                    else:
                        selector.unregister(key.fileobj)
                        os.close(key.fd)
                        open_streams -= 1
        if exit_fd is not None:
            os.close(exit_fd)
        # Descendants that outlived the program (or held its pipes) must not outlive the job.
        self._signal_group(signal.SIGKILL)
        assert returncode is not None
        if returncode < 0:
            return 128 - returncode, -returncode
        return returncode, None
