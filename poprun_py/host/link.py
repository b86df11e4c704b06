"""A host's end of its link to poprun, over TCP across hosts: reach poprun at ``POPRUN_CONTROL``,
read its nonce, seal every frame with the job's secret (``wire.seal``), say HELLO and the host's
clock, and receive the program: what a remote host's supervisor (``host.supervisor``) does to
hold its host's one link to poprun. Also the settings such a process reads from what poprun gave
it, with a warning rather than a refusal (poprun refuses bad values before anything starts: only
a process started by hand can see one).

Built on the interpreter's own C modules (``_socket``), as it runs under ``python -S``.
"""

from __future__ import annotations

import _socket
import os
import time

from popcontract import environment, settings

TYPE_CHECKING = False  # typing.TYPE_CHECKING, without importing typing under python -S
if TYPE_CHECKING:
    from poprun_py.wire.seal import Seal


def silence_limit() -> float:
    """``POPRUN_SILENCE_LIMIT``, or the default with a warning when it is no number of seconds
    (poprun refuses such a value: a process started by hand)."""
    from poprun_py.wire import protocol

    try:
        return protocol.silence_limit()
    except settings.PopdistEnvError as exc:
        os.write(2, f"poprun: warning: {exc}; using {protocol.DEFAULT_SILENCE_LIMIT:g}\n".encode())
        return protocol.DEFAULT_SILENCE_LIMIT


def connect_to_poprun(secret: str | None, limit: float, who: str) -> tuple[_socket.socket, Seal, int] | None:
    """The control connection, its seal, and when poprun's nonce arrived (this host's wall clock,
    ns: half of the measure of the clocks' offset, see ``protocol.CLOCK``); None, said on stderr,
    when poprun cannot be reached within the silence limit (``limit``), or its address or the
    secret is missing (``who``: who says so)."""
    from poprun_py.wire.control import connect

    address = settings.text(environment.CONTROL)
    missing = " or ".join(name for name, value in ((environment.CONTROL, address), (environment.SECRET, secret))
                          if not value)
    problem = f"no {missing} in its environment (was it dropped by mpiexec's options?)"
    if address and secret:
        try:
            control = connect(address, give_up_after=limit)
            try:
                nonce = read_nonce(control, limit)
                arrived = time.time_ns()
            except OSError:
                control.close()
                raise
            from poprun_py.wire.seal import TO_POPRUN, Seal

            return control, Seal(secret, nonce, TO_POPRUN), arrived
        except OSError as exc:
            problem = str(exc)
    # Only poprun has the program: nothing is started. The stubs say so too, and mpiexec passes
    # their lines and statuses on.
    where = f" at {address}" if address else ""
    os.write(2, f"{who}: cannot reach poprun{where} ({problem}); the program was not started\n".encode())
    return None


def receive_program(control: _socket.socket, seal: Seal, nonce_arrived: int, hello: bytes,
                    who: str) -> list[bytes] | None:
    """Say ``hello`` (a HOST_HELLO) and this host's clock (``protocol.CLOCK``: when poprun's nonce
    arrived, and now),
    then read poprun's answer: the program and its arguments (``protocol.PROGRAM``),
    no longer than this host could pass to a program. None, said on stderr, when poprun's
    connection ends, its host stops acknowledging, or the program fails its check.

    A poprun that is alive may be slow to answer (its output waits for a reader that paused, or it
    is stopped): as long as its kernel acknowledges (keep-alive probes, bounded by the
    connection's TCP_USER_TIMEOUT: ``control.connect``), this waits."""
    from poprun_py.wire import protocol

    try:
        control.sendall(seal.seal(hello) + seal.seal(protocol.clock(nonce_arrived, time.time_ns())))
        control.setsockopt(_socket.SOL_SOCKET, _socket.SO_KEEPALIVE, 1)
        for option, seconds in (("TCP_KEEPIDLE", 2), ("TCP_KEEPINTVL", 2)):
            if hasattr(_socket, option):
                control.setsockopt(_socket.IPPROTO_TCP, getattr(_socket, option), seconds)
        head = _read_exactly(control, len(protocol.PROGRAM) + protocol.PROGRAM_LENGTH.size)
        (length,) = protocol.PROGRAM_LENGTH.unpack_from(head, len(protocol.PROGRAM))
        limit = os.sysconf("SC_ARG_MAX")
        if not head.startswith(protocol.PROGRAM) or length > limit:
            raise protocol.ProtocolError(f"its first message is not a program of at most {limit} bytes")
        body = _read_exactly(control, length + protocol.TAG_SIZE)
        if not seal.check(head + body[:length], body[length:]):
            raise protocol.ProtocolError("the program failed its authentication check")
        control.setsockopt(_socket.SOL_SOCKET, _socket.SO_KEEPALIVE, 0)
        return protocol.decode_program(body[:length])
    except (OSError, protocol.ProtocolError) as exc:
        why = str(exc) if not isinstance(exc, TimeoutError) else "poprun's host stopped acknowledging"
    os.write(2, f"{who}: did not receive the program from poprun ({why}); the program was not started\n".encode())
    return None


#: The most one read of poprun's messages takes.
READ_SIZE = 1 << 20


def _read_exactly(control: _socket.socket, size: int, closed: str = "poprun closed the connection") -> bytes:
    """``size`` bytes from ``control``, never more; OSError(``closed``) if the connection ends first."""
    chunks, left = [], size
    while left:
        chunk = control.recv(min(left, READ_SIZE))
        if not chunk:
            raise OSError(closed)
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def read_nonce(control: _socket.socket, timeout: float) -> bytes:
    """The nonce poprun sends first on a connection (OSError if it does not come whole)."""
    from poprun_py.wire.protocol import NONCE_SIZE

    control.settimeout(timeout)
    nonce = _read_exactly(control, NONCE_SIZE, "it closed the connection before it said anything")
    control.settimeout(None)
    return nonce


def kill_grace() -> float:
    """The program's grace between SIGTERM and SIGKILL: POPRUN_KILL_GRACE, or the default with a
    warning when it is no number of seconds (poprun refuses such a value: a process started by hand)."""
    from poprun_py.wire import protocol

    grace = protocol.kill_grace()
    if grace is None:
        text = settings.text(environment.KILL_GRACE)
        os.write(2, f"poprun: warning: {protocol.bad_grace(text)}; using {protocol.DEFAULT_GRACE:g}\n".encode())
        grace = protocol.DEFAULT_GRACE
    return grace
