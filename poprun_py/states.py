"""What poprun knows of each instance of a running job, and of the failure that ends it."""

from __future__ import annotations

import _signal
import time

from poprun_py import protocol

TYPE_CHECKING = False  # typing.TYPE_CHECKING, without importing typing on the launch path
if TYPE_CHECKING:
    import _socket

    from poprun_py.output import InstanceOutput


class InstanceState:
    """What poprun knows of one instance: its connection, output, and exit report."""

    def __init__(self, index: int, host: str, output: InstanceOutput) -> None:
        self.index = index
        self.host = host
        self.output = output
        self.connection: _socket.socket | None = None
        self.reader: protocol.FrameReader | None = None  # its frames, checked with its connection's seal
        self.pid: int | None = None
        self.status: int | None = None
        self.signal: int | None = None
        self.error: str | None = None
        self.stopped_by_poprun = False
        self.lost = False  # disconnected without an exit report
        self.shim_signalled = False  # its shim was signalled (not told by poprun) and stopped the program
        self.was_stopped = False  # its program was stopped (SIGSTOP, a debugger) when its shim came to end it
        self.launcher_lost: str | None = None  # its shim saw its host's MPI daemon die: why (protocol.LAUNCHER_LOST)
        self.last_heard = 0.0  # time.monotonic() of its last frame
        self.silent = False  # lost because nothing came from it for protocol.SILENCE_LIMIT seconds
        self.ended_at: float | None = None  # time.monotonic() of its exit report or its loss
        self.root_cause: bytes | None = None  # what its program wrote to TORCHELASTIC_ERROR_FILE, if it failed
        self.sending = False  # a message to its shim is half sent: nothing may be put in its middle

    def send(self, message: bytes, within: float = 0.0) -> bool:
        """One of poprun's messages to the shim (protocol.PROGRAM, TERMINATE, RELEASE, STOP, CONT), sealed;
        whether it went. ``within``: seconds a message larger than the socket's buffer (the
        program) may take to go, the shim reading it; a command always fits at once."""
        if self.connection is None or self.reader is None:
            return False
        self.sending = True
        try:
            self.connection.settimeout(within)
            self.connection.sendall(self.reader.seal.seal(message))
        except OSError:
            return False  # that shim is gone already, or took no more of it for ``within`` seconds
        finally:
            self.sending = False
            self.connection.setblocking(False)
        return True

    @property
    def finished(self) -> bool:
        return self.status is not None

    @property
    def done(self) -> bool:
        return self.finished or self.lost

    @property
    def failed_by_itself(self) -> bool:
        """It reported a failure of its own: a non-zero status that is not what stopping it gives
        (SIGTERM, then SIGKILL, or the shell's 128+N for them)."""
        if not self.status:
            return False
        stopped = {_signal.SIGTERM, _signal.SIGKILL}
        return self.signal not in stopped and self.status not in {128 + s for s in stopped}


class Failure:
    """The root cause of a failed job: the first instance to fail (None: poprun itself)."""

    def __init__(self, index: int | None, status: int, description: str) -> None:
        self.index = index
        self.status = status
        self.description = description
        self.at = time.time()


def signal_name(signum: int) -> str:
    """``SIGTERM`` for 15; the ``signal`` module (enums) is imported only when a name is needed."""
    import signal

    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def describe_status(status: int, signum: int | None) -> str:
    if signum:
        return f"killed by {signal_name(signum)} (status {status})"
    return f"exit status {status}"
