"""A Supervisor that starts nothing, and shims that call in to it over real connections: for
tests of its decisions one step at a time."""

from __future__ import annotations

import io
import logging
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager

from poprun_py.supervision import log
from poprun_py.supervision.supervisor import Supervisor
from poprun_py.wire import protocol
from poprun_py.wire.seal import TO_POPRUN, Seal, new_secret

#: poprun's --start-timeout when not given (the supervisor itself has no default).
START_TIMEOUT = 120.0
#: The program these supervisors hand the shims that call in.
PROGRAM = [b"prog", b"--flag", b""]


def supervisor(stdout: io.BytesIO, stderr: io.BytesIO, hosts: tuple[str, ...] = ("localhost",),
               remote: tuple[str, ...] = ()) -> Supervisor:
    """A supervisor of one instance per host in ``hosts`` (those in ``remote`` are not this
    machine) that writes to these buffers."""
    return Supervisor(len(hosts), list(hosts), lambda address: ([], {}), new_secret(), PROGRAM,
                      listen_address="127.0.0.1", start_timeout=START_TIMEOUT, stdout=stdout, stderr=stderr,
                      remote_hosts=frozenset(remote))


def call_in(s: Supervisor, server: socket.socket, index: int, then: tuple[bytes, ...] = ()) -> socket.socket:
    """Instance ``index`` calls in over a real connection, as its shim would, with the frames
    ``then`` in the same write; the shim's end."""
    return call_in_sealed(s, server, index, then)[0]


def call_in_sealed(s: Supervisor, server: socket.socket, index: int,
                   then: tuple[bytes, ...] = ()) -> tuple[socket.socket, Seal]:
    """As ``call_in``, with the shim's seal of the connection (for its further frames, and to
    check poprun's commands), once poprun's answer to the HELLO, the program, has been read."""
    shim = socket.create_connection(server.getsockname(), timeout=10)
    s._accept(server)
    nonce = shim.recv(protocol.NONCE_SIZE, socket.MSG_WAITALL)
    seal = Seal(s.secret, nonce, TO_POPRUN)
    shim.sendall(b"".join(seal.seal(frame) for frame in (protocol.hello(index, 1000 + index, "node"), *then)))
    address = "{}:{}".format(*shim.getsockname())
    [(conn, reader)] = [data for kind, data in s.watch.labels()
                        if kind == "pending" and s.pending[data[0]][1] == address]
    deadline = time.monotonic() + 10  # until the bytes are through loopback
    while s.instances[index].connection is None and time.monotonic() < deadline:
        s._read_hello(conn, reader)
    assert conn not in s.pending
    if s.instances[index].connection is conn:
        assert read_program(shim, seal) == PROGRAM
    return shim, seal


def read_program(shim: socket.socket, seal: Seal) -> list[bytes]:
    """The PROGRAM message poprun sent to ``shim``, checked with its seal."""
    head = shim.recv(len(protocol.PROGRAM) + protocol.PROGRAM_LENGTH.size, socket.MSG_WAITALL)
    assert head[:1] == protocol.PROGRAM, head
    (length,) = protocol.PROGRAM_LENGTH.unpack_from(head, 1)
    body = shim.recv(length + protocol.TAG_SIZE, socket.MSG_WAITALL)
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
