"""Frames between a remote host's supervisor and ``poprun`` over one TCP connection per host, and
the frames of each instance inside them (the same that poprun's own host's supervisor, poprun,
makes of its stubs' events: ``host.instance``).

Output travels as raw chunks per stream; ``poprun`` assembles lines per instance, so lines of
different instances can never interleave mid-line, however long they are. Payloads are packed
with ``struct`` rather than JSON: a host's supervisor imports this under ``python -S`` while the
programs compete for the same cores, so it imports nothing that it can do without.

On the wire, poprun first sends the connection's nonce (``NONCE_SIZE`` bytes); after that every
frame and every command ends with its tag (``TAG_SIZE`` bytes), checked before it is believed
(see ``seal``).
"""

from __future__ import annotations

import struct

from popcontract import environment, settings

TYPE_CHECKING = False  # typing.TYPE_CHECKING, without importing typing on the launch path
if TYPE_CHECKING:
    from poprun_py.wire.seal import Seal

HEADER = struct.Struct("!BBI")  # kind, stream, payload length
#: What poprun sends first on each connection, and what ends each frame (see ``seal``).
NONCE_SIZE = 16
TAG_SIZE = 16
#: No frame is longer: a supervisor sends at most 64 KiB of output per frame, and a header that
#: claims more is refused before anything is held for it.
MAX_PAYLOAD = 1 << 20

# (1 was the HELLO of a Python shim per instance, which the stubs replaced.)
OUTPUT = 2  # stream 1 = stdout, 2 = stderr; payload: raw bytes
EXIT = 3  # payload: EXIT_FIELDS, then an error message (UTF-8; empty when there is none)
HEARTBEAT = 4  # no payload: the host's supervisor is alive and reachable (see heartbeat_seconds)
ROOT_CAUSE = 5  # before EXIT, from a failed program: its TORCHELASTIC_ERROR_FILE (see root_cause.py)
#: The MPI launcher's process that started the stub (its host's daemon) died; payload: why (UTF-8).
#: Sent the moment the stub sees it, before it stops its program: the launcher then ends the job's
#: other hosts, and what poprun hears first names the host that failed.
LAUNCHER_LOST = 6
#: Right after HOST_HELLO: CLOCK_FIELDS, the host's wall clock (ns) when poprun's nonce arrived and
#: when this frame was sent. With when poprun sent the nonce and received this, they measure how far
#: the host's clock is from poprun's (``clocks``), so that times from every host can be compared.
CLOCK = 7
#: Just before EXIT: TIMES_FIELDS, on its host's wall clock (ns; 0: never): when the program ended,
#: when its stub began to stop it, and when its error file was last written (sent with ROOT_CAUSE).
TIMES = 8
#: Before TIMES, when the program's stderr (its one stream), as written before its stub began to
#: stop it on poprun's TERMINATE, ended with an uncaught Python exception's traceback
#: (``host.uncaught``): the program had failed by itself and was on its way out. Payload:
#: UNCAUGHT_FIELDS, then the exception's line (UTF-8, as the program wrote it).
UNCAUGHT = 9
#: A host's supervisor (``poprun_py/host/supervisor.py``): the first frame of its connection
#: (HOST_HELLO_FIELDS, then the host name), then CLOCK; after it, every instance's frame comes
#: wrapped in an INSTANCE frame (INSTANCE_FIELDS, then the frame, header and payload, unsealed:
#: the INSTANCE frame is sealed whole), and HEARTBEAT for the host.
HOST_HELLO = 10
INSTANCE = 11
#: Inside INSTANCE only: the instance's stub called in (STUB_HELLO_FIELDS: its PID), and its stub
#: left without an exit report (no payload): it was killed, or its connection failed.
STUB_HELLO = 12
STUB_LOST = 13

HOST_HELLO_FIELDS = struct.Struct("!Q")  # the host supervisor's PID
#: No HELLO is longer: its fields and a host name (at most 255 bytes in DNS, 64 in a Linux uname).
MAX_HELLO = HOST_HELLO_FIELDS.size + 255
CLOCK_FIELDS = struct.Struct("!QQ")  # nonce arrived, CLOCK sent
TIMES_FIELDS = struct.Struct("!QQQ")  # program ended, stop begun, error file written
INSTANCE_FIELDS = struct.Struct("!I")  # the instance's index
STUB_HELLO_FIELDS = struct.Struct("!Q")  # the stub's PID
UNCAUGHT_FIELDS = struct.Struct("!Q")  # when its supervisor read the traceback's last line (its wall clock, ns)
EXIT_FIELDS = struct.Struct("!iIB")  # exit status, signal number (0: not killed by a signal), EXIT_* flags
#: EXIT flag: the stub itself was signalled (by its MPI launcher, or by hand), not told by poprun,
#: and stopped its program.
EXIT_STUB_SIGNALLED = 1
#: EXIT flag: when the stub came to stop its program, the program was stopped (SIGSTOP, SIGTSTP
#: or a debugger): the job's other instances may have failed waiting for it.
EXIT_WAS_STOPPED = 2
#: EXIT flag: the program died of a SIGKILL its stub did not send while the kernel's out-of-memory
#: killer ran in its memory cgroup (``oom``).
EXIT_OOM_KILLED = 4
#: EXIT flag: the program called MPI_Abort (MPICH's PMI line, ``pmi_relay``) and its stub ended it;
#: the status is the abort's (its code's low byte, 1 for 0).
EXIT_MPI_ABORT = 8

#: poprun -> stub (a host's supervisor passes it on, with the instance's index), one byte each:
#: stop the program (SIGTERM to its process group,
#: SIGKILL after the grace period).
TERMINATE = b"T"
#: poprun -> stub: every instance has finished; exit now. Until then a stub whose program is done
#: stays (idle): MPICH's hydra proxy busy-waits, burning a core, from its first child's exit to
#: its last, so instances that end at different times would slow the ones still running.
RELEASE = b"R"
#: poprun -> stub: poprun was stopped from its terminal (Ctrl-Z, SIGTSTP): stop the program's
#: process group (SIGSTOP), as a shell stops every process of a job; CONT continues it (``fg``).
STOP = b"S"
CONT = b"C"

#: A host's supervisor says something at least this often; after the silence limit without a word
#: from an instance that has not exited, poprun counts it lost: its host died or the network to it
#: is cut, and neither sends a FIN. Only time poprun listened counts: while it is stopped or blocked
#: writing its own output (a slow reader), it reads nothing, and that is no one's silence. A host's
#: supervisor whose frames poprun's host has not acknowledged for the silence limit (its kernel still
#: acknowledges while poprun is stopped or reads slowly) stops its programs: cut off, they stop too.
#: The limit is a setting (``environment.SILENCE_LIMIT``): a slow network or a busy cluster wants
#: more, a test of what happens at the limit less.
HEARTBEAT_SECONDS = 5.0
DEFAULT_SILENCE_LIMIT = 20.0
#: The shortest limit: silence is judged once a second, and Open MPI's daemons need 4 s to give up
#: on an unreachable launcher (``planning.mpi.daemon_keepalive``) before the stubs stop their programs.
MIN_SILENCE_LIMIT = 5.0
HEARTBEAT_FRAME = HEADER.pack(HEARTBEAT, 0, 0)

#: Seconds between SIGTERM and SIGKILL when a stub stops its program (``environment.KILL_GRACE``).
DEFAULT_GRACE = 3.0
_INFINITY = float("inf")


#: poprun -> a host's supervisor, once, in answer to HOST_HELLO and before any command: the program and its arguments,
#: which never pass through mpiexec (whose own syntax, ``:``, ``--``, ``-n`` ..., a word among them
#: could be read as). ``PROGRAM`` and the payload's length (``PROGRAM_LENGTH``), the payload
#: (:func:`encode_program`), then the tag over all of it.
PROGRAM = b"P"
PROGRAM_LENGTH = struct.Struct("!I")


def encode_program(argv: list[bytes]) -> bytes:
    """The PROGRAM message (without its tag): each argument's bytes, exactly as given, ended by NUL
    (an argument cannot hold one): empty arguments, newlines, any bytes."""
    payload = b"".join(arg + b"\0" for arg in argv)
    return PROGRAM + PROGRAM_LENGTH.pack(len(payload)) + payload


def decode_program(payload: bytes) -> list[bytes]:
    """The arguments of a PROGRAM payload; ProtocolError when it is not NUL-ended arguments."""
    if not payload.endswith(b"\0"):
        raise ProtocolError("the program's arguments do not end with NUL")
    return payload[:-1].split(b"\0")


class ProtocolError(ValueError):
    """A frame whose payload does not have the layout its kind promises."""


def frame(kind: int, payload: bytes, stream: int = 0) -> bytes:
    return HEADER.pack(kind, stream, len(payload)) + payload


def clock(nonce_arrived_ns: int, sent_ns: int) -> bytes:
    return frame(CLOCK, CLOCK_FIELDS.pack(nonce_arrived_ns, sent_ns))


def times(ended_ns: int, stopped_ns: int, recorded_ns: int) -> bytes:
    return frame(TIMES, TIMES_FIELDS.pack(ended_ns, stopped_ns, recorded_ns))


def uncaught(read_ns: int, line: bytes) -> bytes:
    return frame(UNCAUGHT, UNCAUGHT_FIELDS.pack(read_ns) + line)


def exit_report(status: int, signum: int | None, error: str | None, flags: int = 0) -> bytes:
    return frame(EXIT, EXIT_FIELDS.pack(status, signum or 0, flags) + (error or "").encode())


def before_exit(cause: bytes | None, uncaught_line: tuple[int, bytes] | None, ended_ns: int, stopped_ns: int,
                recorded_ns: int) -> list[bytes]:
    """The frames that come before an instance's EXIT: its error file's record (ROOT_CAUSE), the
    traceback its stderr ended with when it was stopped (UNCAUGHT), and its TIMES."""
    frames = [frame(ROOT_CAUSE, cause)] if cause is not None else []
    if uncaught_line is not None:
        frames.append(uncaught(*uncaught_line))
    return [*frames, times(ended_ns, stopped_ns, recorded_ns)]


def host_hello(pid: int, host: str) -> bytes:
    return frame(HOST_HELLO, HOST_HELLO_FIELDS.pack(pid) + host.encode()[:255])


def instance(index: int, inner: bytes) -> bytes:
    """An instance's frame (``inner``: header and payload), as its host's supervisor sends it."""
    return frame(INSTANCE, INSTANCE_FIELDS.pack(index) + inner)


def read_host_hello(payload: bytes) -> tuple[int, str]:
    (pid,) = _unpack(HOST_HELLO_FIELDS, payload, "HOST_HELLO")
    return pid, payload[HOST_HELLO_FIELDS.size:].decode(errors="replace")


def read_stub_hello(payload: bytes) -> int:
    """The PID in a STUB_HELLO's payload."""
    return _unpack(STUB_HELLO_FIELDS, payload, "STUB_HELLO")[0]


def read_instance(payload: bytes) -> tuple[int, int, int, bytes]:
    """``(index, kind, stream, payload)`` of the frame an INSTANCE frame wraps."""
    (index,) = _unpack(INSTANCE_FIELDS, payload, "INSTANCE")
    inner = payload[INSTANCE_FIELDS.size:]
    kind, stream, length = _unpack(HEADER, inner, "INSTANCE's frame")
    if length != len(inner) - HEADER.size:
        raise ProtocolError(f"INSTANCE's frame says {length} bytes and holds {len(inner) - HEADER.size}")
    return index, kind, stream, inner[HEADER.size:]


#: poprun -> a host's supervisor: a command (TERMINATE, STOP, CONT, RELEASE) for one instance,
#: then its index (INSTANCE_FIELDS), and the tag over both.
HOST_COMMAND_SIZE = 1 + INSTANCE_FIELDS.size


def host_command(index: int, command: bytes) -> bytes:
    return command + INSTANCE_FIELDS.pack(index)


def read_clock(payload: bytes) -> tuple[int, int]:
    """``(nonce arrived, sent)`` on the host's clock (ns) from a CLOCK payload."""
    arrived, sent = _unpack(CLOCK_FIELDS, payload, "CLOCK")
    return arrived, sent


def read_times(payload: bytes) -> tuple[int, int, int]:
    """``(ended, stopped, recorded)`` on the host's clock (ns; 0: never) from a TIMES payload."""
    ended, stopped, recorded = _unpack(TIMES_FIELDS, payload, "TIMES")
    return ended, stopped, recorded


def read_uncaught(payload: bytes) -> tuple[int, str]:
    """``(when its last line was read, the exception's line)`` from an UNCAUGHT payload."""
    (read_ns,) = _unpack(UNCAUGHT_FIELDS, payload, "UNCAUGHT")
    return read_ns, payload[UNCAUGHT_FIELDS.size:].decode(errors="replace")


def read_exit(payload: bytes) -> tuple[int, int | None, str | None, int]:
    """``(status, signal or None, error or None, EXIT_* flags)`` from an EXIT payload."""
    status, signum, flags = _unpack(EXIT_FIELDS, payload, "EXIT")
    error = payload[EXIT_FIELDS.size:].decode(errors="replace")
    return status, signum or None, error or None, flags


#: What an instance's frames may be (inside INSTANCE, after its STUB_HELLO): each kind's name and
#: shortest payload.
_OF_AN_INSTANCE = {OUTPUT: ("OUTPUT", 0), EXIT: ("EXIT", EXIT_FIELDS.size), ROOT_CAUSE: ("ROOT_CAUSE", 0),
                   LAUNCHER_LOST: ("LAUNCHER_LOST", 0), TIMES: ("TIMES", TIMES_FIELDS.size),
                   UNCAUGHT: ("UNCAUGHT", UNCAUGHT_FIELDS.size)}


def unreadable(kind: int, stream: int, payload: bytes) -> str | None:
    """Why an instance's frame cannot be read; None when it can."""
    if kind not in _OF_AN_INSTANCE:
        return f"a frame of kind {kind}, which is no instance's"
    if kind == OUTPUT and stream not in (1, 2):
        return f"output on stream {stream}, not 1 (stdout) or 2 (stderr)"
    name, shortest = _OF_AN_INSTANCE[kind]
    if len(payload) < shortest:
        return f"{name} payload of {len(payload)} bytes is shorter than its {shortest}-byte header"
    return None


def _unpack(fields: struct.Struct, payload: bytes, kind: str) -> tuple[int, ...]:
    if len(payload) < fields.size:
        raise ProtocolError(f"{kind} payload of {len(payload)} bytes is shorter than its {fields.size}-byte header")
    return fields.unpack_from(payload)


class FrameReader:
    """Incremental decoder of a host supervisor's frames: feed bytes, get back complete ``(kind, stream,
    payload)`` frames, each checked against its tag (``seal``). A frame too long or whose check
    fails raises ProtocolError: nothing more from that connection can be believed. With
    ``hello_first`` (poprun's side) the first frame must be a HOST_HELLO of at most MAX_HELLO bytes,
    which its header shows before its tag has come: a stranger's bytes are refused at once rather
    than waited on."""

    def __init__(self, seal: Seal, hello_first: bool = False) -> None:
        self.seal = seal
        self._buffer = bytearray()
        self._first = hello_first

    def feed(self, data: bytes) -> list[tuple[int, int, bytes]]:
        self._buffer += data
        frames = []
        while len(self._buffer) >= HEADER.size:
            kind, stream, length = HEADER.unpack_from(self._buffer)
            if self._first and kind != HOST_HELLO:
                raise ProtocolError(f"its first frame is of kind {kind}, not HOST_HELLO ({HOST_HELLO})")
            if self._first and length > MAX_HELLO:
                raise ProtocolError(f"a HELLO of {length} bytes is longer than the {MAX_HELLO} a HELLO may have")
            if length > MAX_PAYLOAD:
                raise ProtocolError(f"a frame of {length} bytes is longer than the {MAX_PAYLOAD} a frame may have")
            end = HEADER.size + length
            if len(self._buffer) < end + TAG_SIZE:
                break
            body = bytes(self._buffer[:end])
            if not self.seal.check(body, bytes(self._buffer[end:end + TAG_SIZE])):
                raise ProtocolError("a frame failed its authentication check")
            frames.append((kind, stream, body[HEADER.size:]))
            del self._buffer[:end + TAG_SIZE]
            self._first = False
        return frames


class CommandReader:
    """A host supervisor's decoder of poprun's commands (TERMINATE, STOP, CONT, RELEASE), each
    followed by its instance's index (``size`` bytes in all) and checked against its tag."""

    def __init__(self, seal: Seal, size: int = HOST_COMMAND_SIZE) -> None:
        self.seal = seal
        self.size = size
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        self._buffer += data
        commands = []
        whole = self.size + TAG_SIZE
        while len(self._buffer) >= whole:
            command, tag = bytes(self._buffer[:self.size]), bytes(self._buffer[self.size:whole])
            del self._buffer[:whole]
            if not self.seal.check(command, tag):
                raise ProtocolError("a command failed its authentication check")
            commands.append(command)
        return commands


def silence_limit() -> float:
    """``POPRUN_SILENCE_LIMIT`` as seconds (the default when unset or empty; ``inf``: never);
    ``settings.PopdistEnvError``, one line naming it, when it is not a number of seconds from
    MIN_SILENCE_LIMIT. poprun refuses a bad value before starting anything; a host's supervisor
    started some other way warns."""
    limit = settings.seconds(environment.SILENCE_LIMIT, DEFAULT_SILENCE_LIMIT)
    if limit < MIN_SILENCE_LIMIT:
        shown = settings.text(environment.SILENCE_LIMIT)
        raise settings.PopdistEnvError(f"{environment.SILENCE_LIMIT}={shown!r} must be at least "
                                       f"{MIN_SILENCE_LIMIT:g} seconds (or inf)")
    return limit


def heartbeat_seconds(limit: float) -> float:
    """How often a host's supervisor says something under a silence limit of ``limit`` seconds: a
    quarter of it, at least every HEARTBEAT_SECONDS, so that a few frames late or lost on a busy
    host still leave the limit unreached."""
    return min(HEARTBEAT_SECONDS, limit / 4)


def grace_seconds(text: str) -> float | None:
    """``POPRUN_KILL_GRACE``'s value as seconds, or None when it is not a finite number >= 0.
    poprun refuses a bad value before starting anything; a host's supervisor started some other
    way warns and uses the default."""
    try:
        value = float(text)
    except ValueError:
        return None
    return value if 0 <= value < _INFINITY else None  # nan fails both comparisons


def kill_grace() -> float | None:
    """``POPRUN_KILL_GRACE`` as seconds: the default when it is unset, None when it is not valid
    (set to nothing included: unlike most settings, an empty grace is refused, not a default)."""
    if settings.given(environment.KILL_GRACE) is None:
        return DEFAULT_GRACE
    return grace_seconds(settings.text(environment.KILL_GRACE))


def bad_grace(text: str) -> str:
    """The one line that says ``POPRUN_KILL_GRACE=text`` is wrong."""
    shown = text if len(text) <= 40 else text[:40] + "..."
    return f"{environment.KILL_GRACE}={shown!r} is not a number of seconds (>= 0)"
