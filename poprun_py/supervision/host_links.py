"""poprun's end of a remote host's supervisor's connection (``poprun_py/host/supervisor.py``): one
sealed TCP connection per host, however many instances the host runs."""

from __future__ import annotations

import time

from poprun_py.wire import protocol

TYPE_CHECKING = False  # typing.TYPE_CHECKING, without importing typing on the launch path
if TYPE_CHECKING:
    import _socket


class HostLink:
    """One host's supervisor: its connection and the reader of its frames (sealed with this run's
    secret), its host name and PID, its clock's offset from poprun's, when it was last heard, and
    the instances it serves."""

    def __init__(self, conn: _socket.socket, reader: protocol.FrameReader, host: str, pid: int,
                 nonce_sent: int) -> None:
        self.conn = conn
        self.reader = reader
        self.host = host
        self.pid = pid
        self.nonce_sent = nonce_sent
        self.clock_offset = 0
        self.last_heard = time.monotonic()
        self.instances: set[int] = set()
        #: A message to it is half sent: nothing may be put in its middle (see ``InstanceState.sending``).
        self.sending = False

    def send(self, message: bytes, within: float = 0.0) -> bool:
        """``message`` sealed, whole, within ``within`` seconds (a command always fits at once);
        whether it went."""
        if self.conn.fileno() < 0:  # lost: poprun closed its end
            return False
        self.sending = True
        try:
            self.conn.settimeout(within)
            self.conn.sendall(self.reader.seal.seal(message))
        except OSError:
            return False
        finally:
            self.sending = False
            self.conn.setblocking(False)
        return True

    def command(self, index: int, message: bytes) -> bool:
        """One of poprun's commands (``protocol.TERMINATE``, STOP, CONT, RELEASE) for instance ``index``."""
        return self.send(protocol.host_command(index, message))
