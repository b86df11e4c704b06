"""A Supervisor that starts nothing, and hosts' supervisors that call in to it over real
connections, one instance each: for tests of its decisions one step at a time."""

from __future__ import annotations

import io
import logging
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager

from poprun_py.supervision import log
from poprun_py.supervision.host_links import HostLink
from poprun_py.supervision.supervisor import Supervisor
from poprun_py.wire import protocol
from poprun_py.wire.seal import TO_POPRUN, Seal, new_secret

#: poprun's --start-timeout when not given (the supervisor itself has no default).
START_TIMEOUT = 120.0
#: The program these supervisors hand the hosts' supervisors that call in.
PROGRAM = [b"prog", b"--flag", b""]
#: What a host's supervisor sends as it is, not inside an INSTANCE frame.
HOST_FRAMES = (protocol.CLOCK, protocol.HEARTBEAT, protocol.HOST_HELLO)


def supervisor(stdout: io.BytesIO, stderr: io.BytesIO, hosts: tuple[str, ...] = ("a",),
               remote: tuple[str, ...] | None = None) -> Supervisor:
    """A supervisor of one instance per host in ``hosts`` that writes to these buffers; ``remote``:
    the hosts that are not this machine (all of them unless said)."""
    return Supervisor(len(hosts), list(hosts), lambda address: ([], {}), new_secret(), PROGRAM,
                      listen_address="127.0.0.1", start_timeout=START_TIMEOUT, stdout=stdout, stderr=stderr,
                      remote_hosts=frozenset(hosts if remote is None else remote))


class InstanceSeal:
    """The seal of the connection of the host's supervisor that serves one instance, as that
    supervisor sends its frames: the instance's inside INSTANCE frames, the host's own as they are."""

    def __init__(self, seal: Seal, index: int) -> None:
        self.host_seal = seal
        self.index = index

    def seal(self, frame: bytes) -> bytes:
        if frame[0] in HOST_FRAMES:
            return self.host_seal.seal(frame)
        return self.host_seal.seal(protocol.instance(self.index, frame))

    def check(self, data: bytes, tag: bytes) -> bool:
        return self.host_seal.check(data, tag)


def call_in(s: Supervisor, server: socket.socket, index: int, then: tuple[bytes, ...] = ()) -> socket.socket:
    """Instance ``index`` calls in over a real connection, through a host's supervisor of its
    own (HOST_HELLO, then its stub's STUB_HELLO), with the frames ``then`` in the same write;
    that supervisor's end."""
    return call_in_sealed(s, server, index, then)[0]


def call_in_sealed(s: Supervisor, server: socket.socket, index: int,
                   then: tuple[bytes, ...] = ()) -> tuple[socket.socket, InstanceSeal]:
    """As ``call_in``, with the seal of the connection (for its further frames, and to check
    poprun's commands), once poprun's answer to the HELLO, the program, has been read."""
    end = socket.create_connection(server.getsockname(), timeout=10)
    s._accept(server)
    nonce = end.recv(protocol.NONCE_SIZE, socket.MSG_WAITALL)
    seal = InstanceSeal(Seal(s.secret, nonce, TO_POPRUN), index)
    pid = 1000 + index
    stub_hello = protocol.frame(protocol.STUB_HELLO, protocol.STUB_HELLO_FIELDS.pack(pid))
    hello = protocol.host_hello(pid, s.instances[index].host)
    end.sendall(b"".join(seal.seal(frame) for frame in (hello, stub_hello, *then)))
    address = "{}:{}".format(*end.getsockname())
    [(conn, reader)] = [data for kind, data in s.watch.labels()
                        if kind == "pending" and s.pending[data[0]][1] == address]
    deadline = time.monotonic() + 10  # until the bytes are through loopback
    while conn in s.pending and time.monotonic() < deadline:
        s._read_hello(conn, reader)
    link = s.host_links.get(conn)
    if link is None:
        return end, seal
    assert read_program(end, seal) == PROGRAM
    while s.instances[index].via is not link and conn in s.host_links and time.monotonic() < deadline:
        s._read_host(link)
    return end, seal


def link_of(s: Supervisor, index: int) -> HostLink | None:
    """The connection of the host's supervisor that serves instance ``index`` (None: lost)."""
    return s.instances[index].via or next((link for link in s.host_links.values() if index in link.instances), None)


def read(s: Supervisor, index: int) -> None:
    """What has come on the connection that serves instance ``index``, read as the loop would."""
    if (link := link_of(s, index)) is not None:
        s._read_host(link)


def read_program(end: socket.socket, seal: InstanceSeal) -> list[bytes]:
    """The PROGRAM message poprun sent to ``end``, checked with its seal."""
    head = end.recv(len(protocol.PROGRAM) + protocol.PROGRAM_LENGTH.size, socket.MSG_WAITALL)
    assert head[:1] == protocol.PROGRAM, head
    (length,) = protocol.PROGRAM_LENGTH.unpack_from(head, 1)
    body = end.recv(length + protocol.TAG_SIZE, socket.MSG_WAITALL)
    assert seal.check(head + body[:length], body[length:])
    return protocol.decode_program(body[:length])


@contextmanager
def poprun_log(verbosity: int = 0) -> Iterator[io.StringIO]:
    """poprun's diagnostics (``poprun_py.supervision.log``) written to a buffer while the block runs."""
    log.configure(verbosity)
    logger = log.logger()
    previous = logger.handlers[:]
    buffer = io.StringIO()
    handler = logging.StreamHandler(buffer)  # its own: the one poprun made may hold a closed stream
    handler.setFormatter(previous[0].formatter)
    logger.handlers[:] = [handler]
    try:
        yield buffer
    finally:
        logger.handlers[:] = previous
        log.configure(0)
