"""Frames between an instance shim and ``poprun`` over one TCP connection.

Output travels as raw chunks per stream; ``poprun`` assembles lines per instance, so lines of
different instances can never interleave mid-line, however long they are. Stdlib only: the shim
imports this with ``python -S``.
"""

from __future__ import annotations

import struct

HEADER = struct.Struct("!BBI")  # kind, stream, payload length

HELLO = 1  # payload: JSON {"instance", "host", "pid"}
OUTPUT = 2  # stream 1 = stdout, 2 = stderr; payload: raw bytes
EXIT = 3  # payload: JSON {"status", "signal", "error"}

#: poprun -> shim: stop the program (SIGTERM to its process group, SIGKILL after the grace period).
TERMINATE = b"T"

ENV_CONTROL = "POPRUN_CONTROL"  # host:port of poprun's listener
ENV_GRACE = "POPRUN_KILL_GRACE"  # seconds between SIGTERM and SIGKILL
DEFAULT_GRACE = 3.0


def frame(kind: int, payload: bytes, stream: int = 0) -> bytes:
    return HEADER.pack(kind, stream, len(payload)) + payload


class FrameReader:
    """Incremental decoder: feed bytes, get back complete ``(kind, stream, payload)`` frames."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[tuple[int, int, bytes]]:
        self._buffer += data
        frames = []
        while len(self._buffer) >= HEADER.size:
            kind, stream, length = HEADER.unpack_from(self._buffer)
            end = HEADER.size + length
            if len(self._buffer) < end:
                break
            frames.append((kind, stream, bytes(self._buffer[HEADER.size:end])))
            del self._buffer[:end]
        return frames
