"""Per-instance output: tagged ``[i] ``, streamed as it arrives, never two instances on one line.

Every line an instance writes reaches poprun's stdout or stderr with its tag (``[i] ``; with
``--prefix-timestamp``, ``[i] 2026-11-23 01:02:03.456 ``: local time, to the millisecond, at
which poprun received the line's first byte; ``--prefix-timestamp offset`` adds its UTC offset,
``01:02:03.456+01:00``, so that the hour repeated at a daylight saving change reads apart).
Output is passed on as it arrives: a partial line, or a progress bar redrawn with carriage
returns, shows at once rather than at its newline.

**Interleaving rule.** Each line (``Line``: poprun's stdout's, its stderr's, or one for both when
they are the same file or terminal, as with ``2>&1``; see ``sinks_for``) has at most one owner: the
instance stream whose unfinished line it is (on one line for both, an instance's stderr waits for
its own unfinished stdout line too). An instance's output is written at once when the current
line is empty or its own; otherwise it is held, in order, until the owner reaches a break: a
newline, or a carriage return (a progress bar's redraw, after which poprun adds a newline so the
bar's last state stays on its own line). At each break of the owner the waiting instances go
first, in the order they began waiting, so one instance cannot keep the line to itself, while a
long line that is still streaming is never cut. Bounded fallback: when the owner has written
nothing for ``HOLD_SECONDS`` while others wait, or has kept one waiting for ``MAX_WAIT_SECONDS``
however busy it is (a line of dots that never ends; both checked by ``Line.tick``, which the
supervisor calls every 0.1 s), or a waiting instance holds more than ``HOLD_BYTES``, poprun ends
the owner's line with a newline of its own; the owner's next bytes then start a new tagged line.
poprun's own messages (``Sink.write``) end an open line the same way first.

**Carriage returns.** A ``\\r`` inside a line is passed on and the tag is written again lazily,
before the next printable byte (``\\r[i] 50%``), so a redrawn bar keeps its tag. A ``\\r`` that
would not move the cursor (at the start of a line, or after another ``\\r``) is dropped, and
one followed by a newline adds no tag, so binary output full of ``\\r`` costs no extra tags.

**One stream.** Only the kernel knows the order of writes to two pipes, so an instance whose
stdout and stderr were read from two pipes could show them out of the order it wrote them. When
poprun's stdout and stderr are one file or terminal and instances' output is shown there
(``one_stream``), each stub gives its program one pipe for both (``POPRUN_ONE_STREAM``), as ``2>&1``
would without poprun, and the instance's output is one stream, shown on poprun's stdout.

``--log-dir DIR`` writes each instance's streams, raw (no tags), unbuffered, to
``DIR/instance-<i>/stdout.log`` and ``stderr.log``, or, as one stream, to ``output.log`` (a
restarted job appends); ``--tee no`` keeps them off the terminal. A log that cannot be written is
said once for the job, however many instances and starts it fails.
"""

from __future__ import annotations

import os
import sys
import time
from typing import TYPE_CHECKING, NamedTuple  # (typing comes with click on every launch)

if TYPE_CHECKING:
    from typing import BinaryIO

    #: Bytes to write, in order, each run with its file.
    Parts = list[tuple[BinaryIO, bytearray]]

TAIL_LINES = 20
#: The tail (of stderr, or of the one stream) keeps at most this much of one line (its end).
TAIL_LINE_BYTES = 1 << 16
#: How long the owner of an unfinished line may write nothing while others wait, before poprun
#: ends its line.
HOLD_SECONDS = 1.0
#: The longest an instance waits for another's unfinished line, even one still being written.
MAX_WAIT_SECONDS = 5.0
#: How much an instance may have held back before poprun ends the line it waits for.
HOLD_BYTES = 64 << 20
#: ``--prefix-timestamp offset``: the stamps carry the local time's UTC offset.
OFFSET = "offset"

# Where one instance's stream stands on its sink.
START = 0  # at the start of a line: nothing of it written, its tag not yet
OPEN = 1  # the tag and some of the line written
REDRAW = 2  # a carriage return written: the tag is due again before the next printable byte


class OutputOptions(NamedTuple):
    """How one start's instances' output is shown and kept: ``--log-dir``, ``--tee``,
    ``--prefix-timestamp``; ``append``: log files are added to (a restarted job) rather than started
    afresh; ``one_stream``: each instance's stdout and stderr come as one stream (see
    :func:`one_stream`). Built for each start, read-only."""

    log_dir: str | None = None
    tee: bool = True
    timestamps: bool | str = False
    append: bool = False
    one_stream: bool = False


class Stream:
    """One instance's stdout or stderr on its line: its line state and what is held back."""

    def __init__(self, tag: bytes, timestamps: bool | str, file: BinaryIO) -> None:
        self.tag = tag
        self.file = file  # where its tagged bytes go: poprun's stdout or stderr
        self.timestamps = timestamps
        self.state = START
        self.held: list[tuple[float, bytes]] = []  # (time received, bytes) not yet written
        self.held_bytes = 0
        self.queued = False
        self.finished = False  # the instance has ended: its last line is ended once written
        self.waiting_since = 0.0  # time.monotonic() when it began waiting
        self._second = -1
        self._stamp = ""
        self._offset = ""

    def prefix(self, received: float) -> bytes:
        if not self.timestamps:
            return self.tag
        second = int(received)
        if second != self._second:
            self._second = second
            local = time.localtime(second)
            self._stamp = time.strftime("%Y-%m-%d %H:%M:%S", local)
            self._offset = _utc_offset(local) if self.timestamps == OFFSET else ""
        return self.tag + f"{self._stamp}.{int((received - second) * 1000):03d}{self._offset} ".encode()

    def render(self, out: bytearray, until_break: bool) -> None:
        """Move held bytes to ``out``, tagged; with ``until_break``, stop after the first newline or
        carriage return (``\\r\\n`` counts as one)."""
        while self.held:
            received, data = self.held[0]
            end = _first_break(data) if until_break else -1
            if 0 <= end < len(data) - 1:
                self.held[0] = (received, data[end + 1:])
                data = data[:end + 1]
            else:
                del self.held[0]
            self.held_bytes -= len(data)
            self._render(received, data, out)
            if end >= 0:
                return

    def _render(self, received: float, data: bytes, out: bytearray) -> None:
        if b"\r" not in data:
            self._render_lines(self.prefix(received), data, out)
            return
        pieces = data.split(b"\n")
        last = len(pieces) - 1
        for k, piece in enumerate(pieces):
            if piece:
                for j, segment in enumerate(piece.split(b"\r")):
                    if j and self.state == OPEN:
                        out += b"\r"
                        self.state = REDRAW
                    if segment:
                        if self.state != OPEN:
                            out += self.prefix(received)
                            self.state = OPEN
                        out += segment
            if k < last:
                if self.state == START:
                    out += self.prefix(received)  # an empty line is tagged too
                out += b"\n"
                self.state = START


    def _render_lines(self, prefix: bytes, data: bytes, out: bytearray) -> None:
        """``_render`` for data without carriage returns: whole lines tagged in one pass."""
        first, newline, rest = data.partition(b"\n")
        if first:
            if self.state != OPEN:
                out += prefix
                self.state = OPEN
            out += first
        if not newline:
            return
        if self.state == START:
            out += prefix  # an empty line is tagged too
        out += b"\n"
        self.state = START
        if not rest:
            return
        ends = rest.endswith(b"\n")
        out += prefix
        out += (rest[:-1] if ends else rest).replace(b"\n", b"\n" + prefix)
        if ends:
            out += b"\n"
        else:
            self.state = OPEN


class Line:
    """The current line of one file or terminal, shared by every instance: who owns it, who waits
    (see the module's interleaving rule). Each instance's bytes go to their stream's own file object
    (``Stream.file``), so one line can frame poprun's stdout and stderr together (``sinks_for``)."""

    def __init__(self) -> None:
        self.owner: Stream | None = None
        self.queue: list[Stream] = []
        self.active = 0.0  # time.monotonic() when the owner last wrote

    def write(self, file: BinaryIO, data: bytes) -> None:
        """poprun's own ``data`` to ``file``, on a line of its own."""
        out: Parts = []
        if self.owner is not None:
            self._end_line(out)
        _part(out, file).extend(data)
        self._pump(out)
        _write(out)

    def offer(self, stream: Stream, received: float, data: bytes) -> None:
        """``stream`` has ``data``: write what the rule allows now, hold the rest."""
        stream.held.append((received, data))
        stream.held_bytes += len(data)
        out: Parts = []
        if self.owner is not stream and not stream.queued:
            stream.queued = True
            stream.waiting_since = time.monotonic()
            self.queue.append(stream)
        if self.owner is not None and self.owner is not stream and stream.held_bytes > HOLD_BYTES:
            self._end_line(out)
        self._pump(out)
        self._emit(out)

    def tick(self) -> None:
        """End the owner's line if it has written nothing for HOLD_SECONDS while others wait, or
        has kept one waiting MAX_WAIT_SECONDS."""
        if self.owner is None or not self.queue:
            return
        now = time.monotonic()
        waited = now - self.queue[0].waiting_since
        if waited >= MAX_WAIT_SECONDS or min(waited, now - self.active) >= HOLD_SECONDS:
            out: Parts = []
            self._end_line(out)
            self._pump(out)
            self._emit(out)

    def discount(self, seconds: float) -> None:
        """``seconds`` in which poprun did not run (stopped, or a write waited for the reader) are
        no one's: the owner was not quiet, and no one was kept waiting, for them."""
        self.active += seconds
        for stream in self.queue:
            stream.waiting_since += seconds

    def finish(self, stream: Stream) -> None:
        """The instance is done: what it holds is written in its turn (at once if the line is free),
        and its last line is ended. Another instance's line is not cut for it."""
        stream.finished = True
        out: Parts = []
        if self.owner is stream:  # between calls an owner holds nothing: its open line just ends
            self._end_line(out)
        self._pump(out)
        self._emit(out)

    def _end_line(self, out: Parts) -> None:
        assert self.owner is not None
        _part(out, self.owner.file).extend(b"\n")
        self.owner.state = START
        self.owner = None

    def _pump(self, out: Parts) -> None:
        while True:
            owner = self.owner
            if owner is not None:
                if not owner.held:
                    return
                part = _part(out, owner.file)
                owner.render(part, until_break=bool(self.queue))  # waiting instances go first
                self.active = time.monotonic()
                if owner.state == OPEN or (owner.state == REDRAW and not self.queue):
                    return  # its line is still open (and all it had is written)
                if owner.state == REDRAW:  # a redraw while others wait: the bar keeps its line
                    part += b"\n"
                    owner.state = START
                self.owner = None
                if owner.held:
                    owner.queued = True
                    owner.waiting_since = time.monotonic()
                    self.queue.append(owner)
            elif self.queue:
                stream = self.queue.pop(0)
                stream.queued = False
                part = _part(out, stream.file)
                stream.render(part, until_break=False)
                if stream.finished and stream.state != START:
                    part += b"\n"
                    stream.state = START
                elif stream.state != START:
                    self.owner = stream
                    self.active = time.monotonic()
            else:
                return

    def _emit(self, out: Parts) -> None:
        # poprun's streams never fail a write (own_output.OwnStream drops what a gone reader or a
        # full disk cannot take), so the line goes on framing as if all were shown.
        _write(out)


def _part(out: Parts, file: BinaryIO) -> bytearray:
    """Where the next bytes for ``file`` go: the last run of ``out``, or a new one if that is another file's."""
    if not out or out[-1][0] is not file:
        out.append((file, bytearray()))
    return out[-1][1]


def _write(out: Parts) -> None:
    """Each run is flushed before the next, so two file objects onto one file keep the order.
    Each is written whole: a write that waits for a slow reader and is interrupted by a signal
    poprun handles (Ctrl-Z, Ctrl-C) returns having written only part of it."""
    for file, data in out:
        view = memoryview(data)
        while view:
            written = file.write(view)
            view = view[len(view) if written is None else written:]
        file.flush()


class Sink:
    """poprun's stdout or stderr: its file, for poprun's own output (``write``/``flush``), and the
    ``line`` instances' output is framed on: its own, or one shared with the other stream."""

    def __init__(self, file: BinaryIO, line: Line | None = None) -> None:
        self.file = file
        self.line = line or Line()

    def write(self, data: bytes) -> None:
        """poprun's own output, after ending an instance's open line (on either stream of the line)."""
        self.line.write(self.file, data)

    def flush(self) -> None:
        self.file.flush()

    def tick(self) -> None:
        """See ``Line.tick`` (on a line shared by both sinks, the second call finds nothing to do)."""
        self.line.tick()


def sinks_for(stdout: BinaryIO, stderr: BinaryIO) -> dict[int, Sink]:
    """poprun's two sinks. When stdout and stderr are one file (a terminal, ``2>&1``, a CI log) they
    share one line, so no instance's line is cut by another's output on the other stream."""
    out = Sink(stdout)
    return {1: out, 2: Sink(stderr, out.line if same_file(stdout, stderr) else None)}


def same_file(first: BinaryIO, second: BinaryIO) -> bool:
    """Whether two file objects write to one file, pipe or terminal."""
    if first is second:
        return True
    try:
        a, b = first.fileno(), second.fileno()
        stat_a, stat_b = os.fstat(a), os.fstat(b)
        if (stat_a.st_dev, stat_a.st_ino) == (stat_b.st_dev, stat_b.st_ino):
            return True
        # One terminal through two device nodes (a second devpts mount, say): one device, one name.
        return (os.isatty(a) and os.isatty(b)
                and (stat_a.st_rdev == stat_b.st_rdev or os.ttyname(a) == os.ttyname(b)))
    except (AttributeError, OSError, ValueError):  # no file behind it (io.BytesIO), or closed
        return False


def one_stream(tee: bool, stdout: BinaryIO | None = None, stderr: BinaryIO | None = None) -> bool:
    """Whether each instance's stdout and stderr are to be one stream, in the order its program
    wrote them: when poprun's own (by default ``sys``'s) are one file or terminal and the output is
    shown there (``tee``). The log files then follow what is shown: one ``output.log``, as the
    user's ``2>&1`` asked; with ``--tee no`` nothing is shown and they stay apart."""
    return tee and same_file(stdout or sys.stdout.buffer, stderr or sys.stderr.buffer)


class InstanceOutput:
    """One instance's two streams (or one, ``OutputOptions.one_stream``): to the sinks (tagged), to its
    log files (raw), and the tail of its stderr (of its one stream) for the failure summary."""

    def __init__(self, index: int, show: bool, sinks: dict[int, Sink],
                 options: OutputOptions | None = None, log_failures_said: set[str] | None = None) -> None:
        options = options or OutputOptions()
        self.index = index
        self.options = options
        #: What has been said of logs that could not be written, once for the whole job (a full disk
        #: fails every instance at every start): what became of their output ("shown", "dropped", ""
        #: for shown already); the same again is said with -v. One set serves every start of a job.
        self.log_failures_said = set() if log_failures_said is None else log_failures_said
        self.selected = show  # not left out by --only-output-from-instance
        self.show = show and options.tee
        self.sinks = sinks
        tag = f"[{index}] ".encode()
        self.streams = {number: Stream(tag, options.timestamps, sink.file) for number, sink in sinks.items()}
        self.timestamps = options.timestamps
        self.one_stream = options.one_stream
        self.stderr_tail: list[bytes] = []  # the last TAIL_LINES lines (of the one stream)
        self._tail_line = bytearray()
        self.logs: dict[int, int] = {}  # stream -> file descriptor
        self.log_directory = ""
        if options.log_dir is not None:
            self.log_directory = os.path.join(options.log_dir, f"instance-{index}")
            self._open_logs(options.append)

    def feed(self, stream: int, data: bytes) -> None:
        if self.one_stream:
            stream = 1  # both of the program's descriptors are one pipe, forwarded as stdout
        if stream in self.logs:
            self._log(stream, data)
        if stream == 2 or self.one_stream:
            self._tail(data)
        if self.show:
            self.sinks[stream].line.offer(self.streams[stream], time.time() if self.timestamps else 0.0, data)

    def flush(self) -> None:
        """End of the instance: everything held is written, a last line without a newline still
        gets one, and the log files are closed."""
        if self._tail_line:
            self._tail(b"\n")
        if self.show:
            for number, stream in self.streams.items():
                self.sinks[number].line.finish(stream)
        for fd in self.logs.values():
            os.close(fd)
        self.logs.clear()

    def _tail(self, data: bytes) -> None:
        line = self._tail_line
        line += data
        if b"\n" not in data:
            del line[:-TAIL_LINE_BYTES]
            return
        *complete, rest = bytes(line).split(b"\n")
        self.stderr_tail.extend(_as_shown(text[-TAIL_LINE_BYTES:]) for text in complete[-TAIL_LINES:])
        del self.stderr_tail[:-TAIL_LINES]
        line[:] = rest[-TAIL_LINE_BYTES:]

    def _open_logs(self, append: bool) -> None:
        directory = self.log_directory
        flags = os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | (os.O_APPEND if append else os.O_TRUNC)
        try:
            os.makedirs(directory, exist_ok=True)
            for number, name in ((1, "output.log"),) if self.one_stream else ((1, "stdout.log"), (2, "stderr.log")):
                self.logs[number] = os.open(os.path.join(directory, name), flags, 0o666)
        except OSError as exc:
            self._log_failed(exc)

    def _log(self, stream: int, data: bytes) -> None:
        try:
            write_all(self.logs[stream], data)
        except OSError as exc:
            self._log_failed(exc)

    def _log_failed(self, exc: OSError) -> None:
        """The logs are closed; with --tee no, the output is shown from now on (the data whose
        write failed too), so that nothing is lost. Said once for the job (``log_failures_said``)."""
        from poprun_py.supervision import log

        for fd in self.logs.values():
            os.close(fd)
        self.logs.clear()
        hidden = not self.options.tee
        self.show = self.selected
        said = f"instance {self.index}'s output is no longer written to {self.log_directory}: {exc.strerror or exc}"
        outcome = "" if not hidden else "shown" if self.selected else "dropped"
        if outcome == "shown":
            said += "; it is shown here instead (--tee no)"
        elif outcome == "dropped":
            said += "; it is dropped from now on (--tee no, and --only-output-from-instance leaves it out)"
        (log.info if outcome in self.log_failures_said else log.warning)("%s", said)
        self.log_failures_said.add(outcome)


def _utc_offset(local: time.struct_time) -> str:
    """A local time's offset from UTC as ISO 8601 writes it: ``+01:00``, ``-05:30``."""
    minutes = (local.tm_gmtoff or 0) // 60
    sign = "-" if minutes < 0 else "+"
    return f"{sign}{abs(minutes) // 60:02d}:{abs(minutes) % 60:02d}"


def _first_break(data: bytes) -> int:
    """Index of the end of the first newline or carriage return (of ``\\r\\n``: the newline); -1: none."""
    newline, carriage = data.find(b"\n"), data.find(b"\r")
    if carriage < 0 or 0 <= newline < carriage:
        return newline
    return carriage + 1 if data[carriage + 1:carriage + 2] == b"\n" else carriage


def _as_shown(line: bytes) -> bytes:
    """What a terminal shows of a line redrawn with carriage returns: its last non-empty part."""
    if b"\r" not in line:
        return line
    parts = [part for part in line.split(b"\r") if part]
    return parts[-1] if parts else b""


def check_log_options(log_dir: str | None, tee: bool, create: bool) -> None:
    """``--log-dir``/``--tee``, before anything starts: one line (PlanError) when they cannot work.
    DIR is created when its parent exists (unless ``create`` is false: a dry run), and must take
    the instances' folders: one is made and removed (a read-only file system, /proc, a folder of
    another user's fail here rather than during the job). The open files the logs need are
    checked with the others (``launch._check_open_files``)."""
    from poprun_py.shared.errors import PlanError

    if log_dir is None:
        if not tee:
            raise PlanError("--tee no hides every instance's output: give --log-dir DIR too, to keep it in files")
        return
    path = os.path.abspath(log_dir)
    if os.path.isdir(path):
        if not os.access(path, os.W_OK | os.X_OK):
            raise PlanError(f"--log-dir {log_dir!r} is not writable")
    elif os.path.lexists(path):
        raise PlanError(f"--log-dir {log_dir!r} exists and is not a directory")
    else:
        parent = os.path.dirname(path)
        if not os.path.isdir(parent):
            raise PlanError(f"--log-dir {log_dir!r}: its parent directory {parent!r} does not exist "
                            "(poprun creates only the last directory of the path)")
        if not create:  # a dry run makes nothing: the parent must take DIR
            _check_folders(parent, f"--log-dir {log_dir!r} cannot be created")
            return
        try:
            os.mkdir(path)
        except OSError as exc:
            raise PlanError(f"--log-dir {log_dir!r} cannot be created: {exc.strerror or exc}") from None
    _check_folders(path, f"--log-dir {log_dir!r} cannot take the instances' folders")


def _check_folders(path: str, refusal: str) -> None:
    """A folder can be made in ``path`` (one is, and removed again), or PlanError: ``refusal``, why."""
    import tempfile

    from poprun_py.shared.errors import PlanError

    try:
        os.rmdir(tempfile.mkdtemp(prefix=".poprun-", dir=path))
    except OSError as exc:
        raise PlanError(f"{refusal}: {exc.strerror or exc}") from None


def write_all(fd: int, data: bytes) -> None:
    """All of ``data`` to ``fd``, however many writes that takes (OSError if one fails)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
