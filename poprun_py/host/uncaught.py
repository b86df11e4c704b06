"""Whether a program's stderr, as its host's supervisor has read it so far, ends
with the traceback of an uncaught Python exception, as Python's default excepthook prints it.

An instance that fails at the moment another does may have printed its traceback and still be
on its way out (atexit hooks, threads, the interpreter's shutdown) when poprun's stop reaches it:
SIGTERM then ends it, and its status alone reads as "stopped". Its supervisor reads what the
program wrote before the stop (the pipe, to its last byte then) and looks at how it ends. Only the
end is kept (``Tail``), not a copy of the output; the check runs only when the program is stopped.
No imports.
"""

from __future__ import annotations

#: The most of the stream's end kept: a traceback of ~100 frames, source lines and carets included.
TAIL_SIZE = 1 << 15
HEADER = b"Traceback (most recent call last):"
#: What an exception's name may hold besides ASCII letters, digits and dots (``module.Class``):
#: any non-ASCII byte, for a non-ASCII identifier.
_NAME = frozenset(b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.")


class Tail:
    """The last TAIL_SIZE bytes of a stream, and when (its reader's wall clock, ns) the last of
    them was read."""

    __slots__ = ("data", "read_ns")

    def __init__(self) -> None:
        self.data = bytearray()
        self.read_ns = 0

    def add(self, data: bytes, read_ns: int) -> None:
        self.data += data
        del self.data[:-TAIL_SIZE]
        self.read_ns = read_ns

    def exception(self) -> bytes | None:
        """The exception's line when the stream ends with an uncaught exception's traceback."""
        return exception_line(bytes(self.data))

    def printing(self) -> bool:
        """Whether the stream ends inside a traceback still being printed (``printing``)."""
        return printing(bytes(self.data))


def exception_line(text: bytes) -> bytes | None:
    """The last line of ``text`` when ``text`` ends with a traceback as the default excepthook
    prints it: ``Traceback (most recent call last):`` (at a line's end: a progress bar may have
    left its line unfinished), its frames (indented lines, ``File`` lines among them), then the
    exception's line (``Name: message``, or ``Name`` alone), ended by a newline. What came before
    (chained exceptions' tracebacks, other output) does not matter. None otherwise: a message of
    several lines, or notes, look like output that went on after a traceback that was printed
    (``logging.exception``) and are not taken for one."""
    if not text.endswith(b"\n"):
        return None
    lines = text[:-1].split(b"\n")
    last = lines.pop()
    if not _is_exception(last):
        return None
    frames = False
    while lines:
        line = lines.pop()
        if line.endswith(HEADER):
            return last if frames else None
        if not line.startswith(b" "):
            return None
        frames = frames or line.lstrip().startswith(b'File "')
    return None  # its header is not in the tail


def printing(text: bytes) -> bool:
    """Whether ``text`` ends inside a traceback that is still being printed: its header at a line's
    end, then only its frames (indented lines), and no exception's line yet, but perhaps the start
    of one. Python writes a traceback a line or a few at a time: a stop that comes between its
    header and its last line finds such an end."""
    start = text.rfind(HEADER)
    if start < 0:
        return False
    rest = text[start + len(HEADER):]
    if not rest:
        return True
    if not rest.startswith(b"\n"):
        return False
    *complete, _ = rest[1:].split(b"\n")  # the last piece: unfinished (a frame's, the exception's) or empty
    return all(line.startswith(b" ") for line in complete)


def _is_exception(line: bytes) -> bool:
    """Whether ``line`` reads as an exception's line: a dotted name, alone or before ``: ``."""
    name = line.split(b": ", 1)[0]
    return bool(name) and not name[:1].isdigit() and name[:1] != b"." and \
        all(byte in _NAME or byte >= 0x80 for byte in name)
