"""The control channel's TCP sockets: poprun listens and accepts, each host's supervisor connects.

Built on the interpreter's C module ``_socket``, as ``socket.py`` itself is. Importing
``socket`` costs ~6 ms (it turns hundreds of constants into enums), paid by poprun before
mpiexec can start and by every host's supervisor while the programs start; these three calls are all the
channel needs.
"""

from __future__ import annotations

import _socket
import sys

#: linux/tcp.h's struct tcp_info: what is read of it, and where its fields are.
TCP_INFO_SIZE = 104
TCPI_RETRANSMITS, TCPI_PROBES = 2, 3
TCPI_LAST_ACK_RECV = slice(56, 60)


def tcp_info(sock: _socket.socket) -> bytes | None:
    """``sock``'s TCP_INFO (the first TCP_INFO_SIZE bytes); None where the system gives none."""
    try:
        return sock.getsockopt(_socket.IPPROTO_TCP, _socket.TCP_INFO, TCP_INFO_SIZE)
    except (AttributeError, OSError):
        return None


def since_last_ack(info: bytes) -> float:
    """Seconds since the peer's last segment that acknowledged anything (every segment of an
    established connection does, its FIN included), from ``tcp_info``'s answer."""
    return int.from_bytes(info[TCPI_LAST_ACK_RECV], sys.byteorder) / 1000


def listen(address: str, backlog: int) -> tuple[_socket.socket, str]:
    """A non-blocking listener on a free port of ``address`` (loopback for a one-host job, the
    address remote hosts reach this one on otherwise) and the ``address:port`` hosts' supervisors connect to."""
    server = _socket.socket(_socket.AF_INET, _socket.SOCK_STREAM)
    try:
        server.setsockopt(_socket.SOL_SOCKET, _socket.SO_REUSEADDR, 1)
        server.bind((address, 0))
        server.listen(backlog)
        server.setblocking(False)
    except OSError:
        server.close()
        raise
    return server, f"{address}:{server.getsockname()[1]}"


def free_port(address: str) -> int:
    """A TCP port free on ``address`` now: bound to port 0 there, read, closed again (torch's
    store binds it moments later; like torchrun's, the choice cannot be held until then)."""
    probe = _socket.socket(_socket.AF_INET, _socket.SOCK_STREAM)
    try:
        probe.bind((address, 0))
        return int(probe.getsockname()[1])
    finally:
        probe.close()


def accept(server: _socket.socket) -> tuple[_socket.socket, str] | None:
    """The next pending connection, non-blocking, and its peer's ``address:port``; None when there
    is none. The peer is taken now: once the other end is gone it can no longer be asked."""
    try:
        # The C socket's accept: the socket module's wrapper (and its imports) stays off the launch path.
        fd, peer = server._accept()  # type: ignore[attr-defined]
    except OSError:  # none pending, or none can be taken now (out of descriptors): not poprun's end
        return None
    connection = _socket.socket(server.family, server.type, server.proto, fileno=fd)
    connection.setblocking(False)
    return connection, f"{peer[0]}:{peer[1]}"


def connect(address: str, timeout: float = 30, give_up_after: float | None = None) -> _socket.socket:
    """A blocking TCP connection to ``host:port``, trying each address the name resolves to.

    ``give_up_after``: seconds that sent data may stay unacknowledged before the connection fails
    (TCP_USER_TIMEOUT), so a peer that vanished without a word is noticed."""
    host, _, port = address.rpartition(":")
    error: OSError = OSError(f"{host!r} resolves to no address")
    # An ASCII name goes as bytes: given a str, getaddrinfo imports the IDNA codec (and re).
    name: str | bytes = host.encode() if host.isascii() else host
    for family, kind, proto, _, sockaddr in _socket.getaddrinfo(name, int(port), 0, _socket.SOCK_STREAM):
        sock = _socket.socket(family, kind, proto)
        try:
            sock.settimeout(timeout)
            sock.connect(sockaddr)
            sock.settimeout(None)
            sock.setsockopt(_socket.IPPROTO_TCP, _socket.TCP_NODELAY, 1)
            if give_up_after is not None and hasattr(_socket, "TCP_USER_TIMEOUT"):
                sock.setsockopt(_socket.IPPROTO_TCP, _socket.TCP_USER_TIMEOUT, int(give_up_after * 1000))
            return sock
        except OSError as exc:
            error = exc
            sock.close()
    raise error
