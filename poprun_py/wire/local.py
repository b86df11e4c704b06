"""Frames between an instance's stub and its host's supervisor, over a Unix stream socket.

The stub is what mpiexec starts per instance (``poprun_py/stub/_stub.c``, or ``fallback.py``
where no compiler built it): it forks and execs the program, hands the read ends of its pipes
to the supervisor (``SCM_RIGHTS`` on the STARTED frame), waits for it and reports its status.
The socket lies in a directory only this user can enter, and the supervisor checks the peer's
credentials (``SO_PEERCRED``) on every connection: no secret crosses this channel, and nobody
else on the host can use it.

Every frame is a header (``HEADER``: kind, payload length) and its payload; integers are in
network order. The C stub keeps its own copy of these numbers; ``tests/launcher/test_stub.py``
runs both stubs against this module.
"""

from __future__ import annotations

import struct

HEADER = struct.Struct("!BI")  # kind, payload length
#: No frame is longer: a PROGRAM holds at most the arguments and environment a program may be
#: given (ARG_MAX is 2 MiB on Linux unless the stack limit is raised), and a header that claims
#: more is refused before anything is read for it.
MAX_PAYLOAD = 8 << 20
#: Bumped when a frame changes: a stub and a supervisor of different installs refuse each other.
VERSION = 1

# stub -> supervisor
HELLO = ord("H")  # HELLO_FIELDS
STARTED = ord("F")  # STARTED_FIELDS; SCM_RIGHTS: the program's stdout and (unless one stream) stderr
NOT_STARTED = ord("N")  # NOT_STARTED_FIELDS: the errno of the failed exec (or fork)
SIGNALLED = ord("G")  # SIGNALLED_FIELDS: the stub itself was signalled (by its launcher) and stops the program
#: LAUNCHER_LOST_FIELDS: the process that started the stub (its host's MPI daemon, or mpiexec) died,
#: so the MPI job on this host is broken: the stub stops its program at once.
LAUNCHER_LOST = ord("L")
EXITED = ord("X")  # EXITED_FIELDS

# supervisor -> stub
PROGRAM = ord("P")  # PROGRAM_FIELDS, then argv, then the environment's changes (see encode_program)
TERMINATE = ord("T")  # TERMINATE_FIELDS: SIGTERM to the program's group, SIGKILL after the grace
STOP = ord("S")  # SIGSTOP to the program's group (poprun was stopped: Ctrl-Z)
CONT = ord("C")  # SIGCONT to it
RELEASE = ord("R")  # every instance is done: exit with the program's status

HELLO_FIELDS = struct.Struct("!II")  # VERSION, instance index
STARTED_FIELDS = struct.Struct("!I")  # program PID
NOT_STARTED_FIELDS = struct.Struct("!i")  # errno
SIGNALLED_FIELDS = struct.Struct("!i")  # signal number
LAUNCHER_LOST_FIELDS = struct.Struct("!I")  # the launcher's PID
#: status (the exit status, or 128 + the signal), signal number (0: it exited), flags (EXITED_*),
#: when the program ended and when the stub began to stop it (CLOCK_REALTIME ns; 0: never).
EXITED_FIELDS = struct.Struct("!iIIQQ")
EXITED_WAS_STOPPED = 1  # the program was stopped (state T) when the stub came to end it
#: the program called MPI_Abort (on its PMI line, which the stub relays): the status is the abort's
EXITED_MPI_ABORT = 2
#: PROGRAM_* flags, the grace between SIGTERM and SIGKILL when the stub itself is signalled or
#: loses its supervisor (ms), the argument count, the count of the environment's changes.
PROGRAM_FIELDS = struct.Struct("!BIII")
PROGRAM_NO_STDIN = 1  # stdin from /dev/null
PROGRAM_ONE_STREAM = 2  # stdout and stderr on one pipe, as 2>&1 makes them
TERMINATE_FIELDS = struct.Struct("!I")  # the grace, in milliseconds


class LocalProtocolError(ValueError):
    """A frame that does not have the layout its kind promises."""


def frame(kind: int, payload: bytes = b"") -> bytes:
    return HEADER.pack(kind, len(payload)) + payload


def encode_program(argv: list[bytes], env: dict[bytes, bytes | None], grace: float, flags: int = 0) -> bytes:
    """The PROGRAM frame: ``argv`` byte for byte, then the environment's changes (a value sets the
    variable, None unsets it), each NUL-ended: ``NAME=VALUE\\0`` or ``NAME\\0``."""
    if not argv or any(b"\0" in arg for arg in argv):
        raise LocalProtocolError("a program is one or more arguments without NUL")
    if any(b"\0" in name or b"=" in name or not name for name in env):
        raise LocalProtocolError("an environment variable's name is empty or holds '=' or NUL")
    changes = [name + b"=" + value if value is not None else name for name, value in env.items()]
    body = b"".join(item + b"\0" for item in [*argv, *changes])
    return frame(PROGRAM, PROGRAM_FIELDS.pack(flags, _ms(grace), len(argv), len(changes)) + body)


def decode_program(payload: bytes) -> tuple[int, float, list[bytes], dict[bytes, bytes | None]]:
    """``(flags, grace, argv, environment changes)`` of a PROGRAM payload."""
    flags, grace_ms, count, changes = unpack(PROGRAM_FIELDS, payload, "PROGRAM")
    items = payload[PROGRAM_FIELDS.size:].split(b"\0")
    if items[-1] != b"" or len(items) - 1 != count + changes or count == 0:
        raise LocalProtocolError("PROGRAM's arguments and environment do not match its counts")
    env: dict[bytes, bytes | None] = {}
    for item in items[count:-1]:
        name, equals, value = item.partition(b"=")
        env[name] = value if equals else None
    return flags, grace_ms / 1000, items[:count], env


def exited(status: int, signum: int, flags: int, ended_ns: int, stop_begun_ns: int) -> bytes:
    return frame(EXITED, EXITED_FIELDS.pack(status, signum, flags, ended_ns, stop_begun_ns))


def terminate(grace: float) -> bytes:
    return frame(TERMINATE, TERMINATE_FIELDS.pack(_ms(grace)))


def _ms(seconds: float) -> int:
    """``seconds`` as whole milliseconds in 32 bits (an infinite grace: the longest)."""
    return 0xFFFFFFFF if seconds == float("inf") else max(0, min(int(seconds * 1000), 0xFFFFFFFF))


def unpack(fields: struct.Struct, payload: bytes, name: str) -> tuple[int, ...]:
    """``fields`` from the start of ``payload``; LocalProtocolError when it is too short."""
    if len(payload) < fields.size:
        raise LocalProtocolError(f"{name} holds {len(payload)} bytes, fewer than its {fields.size}")
    return fields.unpack_from(payload)
