"""The host supervisor's end of its stubs' channel (``wire.local``): where they connect, who may,
and the frames each one sends.

The socket lies in a directory of its own, made with mode 0700 (``tempfile.mkdtemp``), so only
the job's user can reach it; and each connection's peer credentials (``SO_PEERCRED``, set by
the kernel) must name that user, so a socket passed on by some other means is refused too.
"""

from __future__ import annotations

import array
import os
import socket
import tempfile
from typing import NamedTuple

from poprun_py.wire import local

#: The socket's name in its directory.
SOCKET_NAME = "stubs"
#: The most stubs waiting to be accepted (the kernel caps it at net.core.somaxconn).
BACKLOG = 4096
#: The most descriptors one frame carries (STARTED: the program's stdout and stderr).
MAX_FDS = 2


class Frame(NamedTuple):
    kind: int
    payload: bytes
    fds: list[int]  # received with it (SCM_RIGHTS); the receiver's to close


class Peer(NamedTuple):
    pid: int
    uid: int


def listen(parent: str | None = None) -> tuple[socket.socket, str]:
    """A listening socket in a new private directory under ``parent`` (the temporary directory by
    default), and the socket's path: what a stub is given as ``POPRUN_STUB_SOCKET``."""
    directory = tempfile.mkdtemp(prefix="poprun-stubs-", dir=parent)
    path = os.path.join(directory, SOCKET_NAME)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        server.bind(path)
        server.listen(BACKLOG)
    except OSError:
        server.close()
        remove(path)
        raise
    return server, path


def remove(path: str) -> None:
    """The socket at ``path`` and its private directory, once the job is over."""
    for step in (os.unlink, lambda p: os.rmdir(os.path.dirname(p))):
        try:
            step(path)
        except OSError:
            pass


def peer(conn: socket.socket) -> Peer:
    """Who is at the other end of ``conn``, as the kernel recorded when it connected."""
    pid, uid, _gid = array.array("i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    return Peer(pid, uid)


def accept(server: socket.socket) -> tuple[socket.socket, Peer] | None:
    """The next stub's connection and its peer; None (the connection closed) when its user is not
    this process's."""
    conn, _ = server.accept()
    who = peer(conn)
    if who.uid != os.geteuid():
        conn.close()
        return None
    return conn, who


def receive(conn: socket.socket) -> Frame | None:
    """The next frame on ``conn`` (waiting for it), None when the stub closed the connection;
    LocalProtocolError when its header claims more than ``local.MAX_PAYLOAD``."""
    fds: list[int] = []
    header = _read(conn, local.HEADER.size, fds)
    if header is None:
        return None
    kind, size = local.HEADER.unpack(header)
    if size > local.MAX_PAYLOAD:
        _close(fds)
        raise local.LocalProtocolError(f"a frame of {size} bytes, more than {local.MAX_PAYLOAD}")
    payload = _read(conn, size, fds) if size else b""
    if payload is None:
        _close(fds)
        return None
    return Frame(kind, payload, fds)


def _read(conn: socket.socket, size: int, fds: list[int]) -> bytes | None:
    """``size`` bytes, and the descriptors that came with them added to ``fds``; None at the end."""
    chunks, left = [], size
    room = socket.CMSG_SPACE(MAX_FDS * array.array("i").itemsize)
    while left:
        data, ancillary, _flags, _ = conn.recvmsg(left, room)
        for level, kind, body in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                received = array.array("i")
                received.frombytes(body[:len(body) - len(body) % received.itemsize])
                fds.extend(received)
        if not data:
            return None
        chunks.append(data)
        left -= len(data)
    return b"".join(chunks)


def _close(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)
