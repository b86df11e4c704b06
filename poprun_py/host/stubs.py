"""The host supervisor's end of its stubs' channel (``wire.local``): where they connect, who may,
and the frames each one sends.

The socket lies in a directory of its own, made with mode 0700 under a new random name, so only
the job's user can reach it; and each connection's peer credentials (``SO_PEERCRED``, set by
the kernel) must name that user, so a socket passed on by some other means is refused too.
"""

from __future__ import annotations

import _socket
import os

from poprun_py.shared.paths import temporary_folder
from poprun_py.wire import local

# The C socket module alone: ``socket`` (and ``tempfile``) would bring ``selectors``, ``shutil`` and
# more to every launch, where poprun is its own host's supervisor.

#: The socket's name in its directory.
SOCKET_NAME = "stubs"
#: The most stubs waiting to be accepted (the kernel caps it at net.core.somaxconn).
BACKLOG = 4096
#: The most descriptors one frame carries (STARTED: the program's stdout and stderr).
MAX_FDS = 2
#: The most one read of a stub's connection takes (its frames are tens of bytes).
READ_SIZE = 4096
#: A C int's size, as descriptors and credentials travel (read through ``memoryview.cast``: the
#: ``array`` module would bring ``collections`` to every remote host's supervisor).
INT_SIZE = memoryview(bytes(8)).cast("i").itemsize
_ROOM = _socket.CMSG_SPACE(MAX_FDS * INT_SIZE)


class Frame:
    """One frame from a stub: its kind, its payload, and the descriptors received with it
    (SCM_RIGHTS; the receiver's to close). (Plain classes, not NamedTuple: ``typing`` would cost
    each remote host's supervisor, started under ``python -S``, several milliseconds.)"""

    __slots__ = ("fds", "kind", "payload")

    def __init__(self, kind: int, payload: bytes, fds: list[int]) -> None:
        self.kind = kind
        self.payload = payload
        self.fds = fds

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Frame) and (self.kind, self.payload, self.fds) == (other.kind, other.payload,
                                                                                   other.fds)

    def __repr__(self) -> str:
        return f"Frame({self.kind!r}, {self.payload!r}, {self.fds!r})"


class Peer:
    """A connection's peer credentials: its process and user."""

    __slots__ = ("pid", "uid")

    def __init__(self, pid: int, uid: int) -> None:
        self.pid = pid
        self.uid = uid

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Peer) and (self.pid, self.uid) == (other.pid, other.uid)

    def __hash__(self) -> int:
        return hash((self.pid, self.uid))

    def __repr__(self) -> str:
        return f"Peer(pid={self.pid}, uid={self.uid})"


def listen(parent: str | None = None) -> tuple[_socket.socket, str]:
    """A listening socket in a new private directory under ``parent`` (the temporary folder by
    default), and the socket's path: what a stub is given as ``POPRUN_STUB_SOCKET``."""
    directory = os.path.join(parent or temporary_folder(), f"poprun-stubs-{os.urandom(6).hex()}")
    os.mkdir(directory, 0o700)  # a new name: nobody else can have made it first
    path = os.path.join(directory, SOCKET_NAME)
    try:
        return bind(path), path
    except OSError:
        remove(path)
        raise


def bind(path: str) -> _socket.socket:
    """A socket listening at ``path``, in a private folder already made."""
    server = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    try:
        server.bind(path)
        server.listen(BACKLOG)
    except OSError:
        server.close()
        raise
    return server


def remove(path: str) -> None:
    """The socket at ``path`` and its private directory, once the job is over."""
    for step in (os.unlink, lambda p: os.rmdir(os.path.dirname(p))):
        try:
            step(path)
        except OSError:
            pass


def peer(conn: _socket.socket) -> Peer:
    """Who is at the other end of ``conn``, as the kernel recorded when it connected."""
    pid, uid, _gid = memoryview(conn.getsockopt(_socket.SOL_SOCKET, _socket.SO_PEERCRED, 3 * INT_SIZE)).cast("i")
    return Peer(pid, uid)


def accept(server: _socket.socket) -> tuple[_socket.socket, Peer] | None:
    """The next stub's connection and its peer; None (the connection closed) when its user is not
    this process's."""
    fd, _ = server._accept()  # type: ignore[attr-defined]  # (the C socket's: see the imports)
    conn = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM, fileno=fd)
    who = peer(conn)
    if who.uid != os.geteuid():
        conn.close()
        return None
    return conn, who


class Reader:
    """The frames of one stub's connection, as its bytes arrive: a read takes what is there (at most
    READ_SIZE), so frames that came together cost one system call, and a frame cut between reads
    waits for its rest here. The descriptors that come with a STARTED frame are given to it."""

    def __init__(self) -> None:
        self.buffer = bytearray()
        self.fds: list[int] = []  # received, for the STARTED frame they came with
        self.queued: list[Frame] = []

    def frames(self, conn: _socket.socket) -> list[Frame] | None:
        """The frames one read of ``conn`` completes (none: it had nothing, or only part of one);
        None once the stub has closed the connection. LocalProtocolError when a header claims
        more than ``local.MAX_PAYLOAD``."""
        try:
            data, ancillary, _flags, _ = conn.recvmsg(READ_SIZE, _ROOM)
        except BlockingIOError:
            return self._take()
        for level, kind, body in ancillary:
            if level == _socket.SOL_SOCKET and kind == _socket.SCM_RIGHTS:
                self.fds.extend(memoryview(body[:len(body) - len(body) % INT_SIZE]).cast("i"))
        if not data:
            self.close()
            return None
        self.buffer += data
        while len(self.buffer) >= local.HEADER.size:
            kind, size = local.HEADER.unpack_from(self.buffer)
            if size > local.MAX_PAYLOAD:
                self.close()
                raise local.LocalProtocolError(f"a frame of {size} bytes, more than {local.MAX_PAYLOAD}")
            end = local.HEADER.size + size
            if len(self.buffer) < end:
                break
            fds, self.fds = (self.fds, []) if kind == local.STARTED else ([], self.fds)
            self.queued.append(Frame(kind, bytes(self.buffer[local.HEADER.size:end]), fds))
            del self.buffer[:end]
        return self._take()

    def next(self, conn: _socket.socket) -> Frame | None:
        """The next frame, waiting for it where ``conn`` blocks; None at the connection's end."""
        while not self.queued:
            got = self.frames(conn)
            if got is None:
                return None
            self.queued = got
        return self.queued.pop(0)

    def _take(self) -> list[Frame]:
        taken, self.queued = self.queued, []
        return taken

    def close(self) -> None:
        """Descriptors received that no frame took (the stub went mid-frame)."""
        _close(self.fds)
        self.fds = []


def hello_index(frames: list[Frame]) -> int:
    """The instance a stub's first frames (its HELLO alone) name; LocalProtocolError when they are
    not a HELLO of this install's version of the frames."""
    if frames[0].kind != local.HELLO or len(frames) > 1:
        raise local.LocalProtocolError(f"its first frame is of kind {frames[0].kind}, not HELLO")
    version, index = local.unpack(local.HELLO_FIELDS, frames[0].payload, "HELLO")
    if version != local.VERSION:
        raise local.LocalProtocolError(f"it speaks version {version} of the stubs' frames, this supervisor "
                                       f"{local.VERSION} (a stub of another install)")
    return index


def _close(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)
