"""Tagging of instances' output, without processes: whatever pieces the data arrives in, what
poprun writes is the reference rendering, and two instances never share a line."""

from __future__ import annotations

import fcntl
import io
import os
import pty
import random
import signal
import struct
import termios
import threading
import time
import types
from pathlib import Path
from typing import BinaryIO

import pytest

from poprun_py.supervision.output import InstanceOutput, Sink, sinks_for
from tests.helpers import wait_until
from tests.launcher.rendering import rendered


def two_instances() -> tuple[io.BytesIO, InstanceOutput, InstanceOutput]:
    """poprun's stdout as a buffer, and instances 0 and 1 writing to it."""
    sink = io.BytesIO()
    sinks = {1: Sink(sink), 2: Sink(io.BytesIO())}
    return sink, InstanceOutput(0, True, sinks), InstanceOutput(1, True, sinks)


def feed_in_pieces(data: bytes, seed: int) -> bytes:
    sink = io.BytesIO()
    output = InstanceOutput(0, True, {1: Sink(sink), 2: Sink(io.BytesIO())})
    generator = random.Random(seed)
    position = 0
    while position < len(data):
        size = generator.choice((1, 2, 3, 17, 500, 4096))
        output.feed(1, data[position:position + size])
        position += size
    output.flush()
    return sink.getvalue()


@pytest.mark.parametrize("seed", range(20))
def test_any_split_renders_as_the_reference(seed: int) -> None:
    generator = random.Random(seed)
    alphabet = b"ab\n" if seed % 2 else b"ab\r\n"  # half without carriage returns (the fast path)
    data = bytes(generator.choice(alphabet) for _ in range(generator.randrange(1, 3000)))
    assert feed_in_pieces(data, seed) == rendered(data)


def test_two_instances_take_turns_at_line_ends() -> None:
    sink, first, second = two_instances()
    first.feed(1, b"partial")
    second.feed(1, b"whole\nand more")  # waits: instance 0's line is open
    assert sink.getvalue() == b"[0] partial"
    first.feed(1, b" end\nnext\n")  # at instance 0's newline, the waiting instance goes first
    assert sink.getvalue() == b"[0] partial end\n[1] whole\n[1] and more"
    second.flush()
    first.flush()
    assert sink.getvalue() == b"[0] partial end\n[1] whole\n[1] and more\n[0] next\n"


def test_a_progress_bar_yields_at_its_redraw_and_a_long_line_is_never_cut() -> None:
    sink, bar, other = two_instances()
    bar.feed(1, b"bar 1%\rbar 2%")
    other.feed(1, b"line\n")
    bar.feed(1, b" still the same line" * 1000)  # streaming on: the line is not cut
    assert sink.getvalue() == b"[0] bar 1%\r[0] bar 2%" + b" still the same line" * 1000
    bar.feed(1, b"\rbar 3%")  # the redraw is a break: the waiting line goes first
    assert sink.getvalue().endswith(b" still the same line\r\n[1] line\n[0] bar 3%")
    bar.feed(1, b"\r\n")
    assert sink.getvalue().endswith(b"\n[0] bar 3%\r\n")


def test_an_instance_that_ends_does_not_cut_anothers_line() -> None:
    sink, first, second = two_instances()
    first.feed(1, b"long line, still streaming")
    second.feed(1, b"last words, no newline")
    second.flush()  # instance 1 ended: its output waits for instance 0's line all the same
    assert sink.getvalue() == b"[0] long line, still streaming"
    first.feed(1, b" and ended\nmore")
    assert sink.getvalue() == b"[0] long line, still streaming and ended\n[1] last words, no newline\n[0] more"
    first.flush()
    assert sink.getvalue().endswith(b"[0] more\n")


def test_stdout_and_stderr_share_a_line_only_when_they_are_one_file(tmp_path: Path) -> None:
    def shared(first: int, second: int) -> bool:
        with open(first, "wb", closefd=False) as stdout, open(second, "wb", closefd=False) as stderr:
            return one_line(stdout, stderr)

    def one_line(stdout: BinaryIO, stderr: BinaryIO) -> bool:
        chosen = sinks_for(stdout, stderr)
        assert (chosen[1].file, chosen[2].file) == (stdout, stderr)
        return chosen[1].line is chosen[2].line

    flags = os.O_WRONLY | os.O_CREAT
    one, again, other = (os.open(tmp_path / name, flags) for name in ("one", "one", "other"))
    reader, pipe = os.pipe()
    pipe_again = os.dup(pipe)
    other_reader, other_pipe = os.pipe()
    master, terminal = pty.openpty()
    terminal_again = os.open(os.ttyname(terminal), os.O_WRONLY | os.O_NOCTTY)
    other_master, other_terminal = pty.openpty()
    buffer = io.BytesIO()
    try:
        assert shared(one, one) and shared(one, again)  # 2>&1 into a file; the file opened twice
        assert shared(pipe, pipe_again)  # 2>&1 | tee
        assert shared(terminal, terminal) and shared(terminal, terminal_again)
        assert one_line(buffer, buffer)
        assert not shared(one, other)  # 2>err.log
        assert not shared(pipe, other_pipe) and not shared(terminal, other_terminal)
        assert not shared(terminal, one) and not one_line(buffer, io.BytesIO())
    finally:
        for fd in (one, again, other, reader, pipe, pipe_again, other_reader, other_pipe, master, terminal,
                   terminal_again, other_master, other_terminal):
            os.close(fd)


def test_one_line_for_both_streams_keeps_each_instances_line_whole(tmp_path: Path) -> None:
    # Two buffered file objects onto one file, as poprun's stdout and stderr after 2>&1: what is
    # written to one is flushed before the other is written to, so the file has it in order.
    fd = os.open(tmp_path / "both", os.O_WRONLY | os.O_CREAT)
    with open(fd, "wb") as stdout, open(os.dup(fd), "wb") as stderr:
        sinks = sinks_for(stdout, stderr)
        first, second = InstanceOutput(0, True, sinks), InstanceOutput(1, True, sinks)
        second.feed(1, b"partial-from-1")
        first.feed(2, b"whole-line-from-0\n")  # waits for instance 1's line, though on stderr
        second.feed(2, b"own stderr\n")  # so does instance 1's own stderr
        second.feed(1, b" end-of-1\nnext")
        sinks[2].write(b"poprun: a message\n")  # ends instance 1's open line (on stdout) first
        first.flush()
        second.flush()
        assert (tmp_path / "both").read_bytes() == (b"[1] partial-from-1 end-of-1\n[0] whole-line-from-0\n"
                                                     b"[1] own stderr\n[1] next\npoprun: a message\n")


@pytest.fixture
def poprun_log(monkeypatch: pytest.MonkeyPatch) -> None:
    """poprun's warnings to this test's stderr (its handler is made on first use, with the stderr of then)."""
    from poprun_py.supervision import log

    monkeypatch.setattr(log, "_logger", None)


@pytest.mark.usefixtures("poprun_log")
def test_a_log_file_that_can_no_longer_be_written_is_said_once_and_output_goes_on(
        tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    # A full disk, as /dev/full is: the first failed write is reported, the logs are closed, and
    # what the instance writes is still shown.
    from poprun_py.supervision.output import OutputOptions

    (tmp_path / "instance-0").mkdir()
    os.symlink("/dev/full", tmp_path / "instance-0" / "stdout.log")
    sink = io.BytesIO()
    output = InstanceOutput(0, True, {1: Sink(sink), 2: Sink(io.BytesIO())}, OutputOptions(str(tmp_path)))
    output.feed(1, b"first\n")
    output.feed(1, b"second\n")
    output.flush()
    assert sink.getvalue() == b"[0] first\n[0] second\n"
    assert output.logs == {}
    said = [line for line in capfd.readouterr().err.splitlines() if "no longer written" in line]
    assert len(said) == 1 and said[0].endswith(
        f"instance 0's output is no longer written to {tmp_path}/instance-0: No space left on device"), said


def test_poprun_s_own_line_ends_an_open_line_and_lets_the_waiting_instance_go_next() -> None:
    sink, first, second = two_instances()
    first.feed(1, b"partial")  # instance 0 owns the line, unfinished
    second.feed(1, b"waiting\n")  # instance 1 waits for it
    assert sink.getvalue() == b"[0] partial"
    first.sinks[1].write(b"poprun: note\n")
    assert sink.getvalue() == b"[0] partial\npoprun: note\n[1] waiting\n"
    first.feed(1, b" rest\n")  # instance 0's line goes on, tagged again
    assert sink.getvalue() == b"[0] partial\npoprun: note\n[1] waiting\n[0]  rest\n"


@pytest.mark.parametrize("data, shown", [
    (b"abc", b"[0] xabc"),  # no break: instance 0 keeps the line
    (b"a\nb", b"[0] xa\n[1] waiting\n[0] b"),
    (b"\n\r", b"[0] x\n[1] waiting\n"),  # the newline comes first; the carriage return then moves nothing
    (b"a\rb\n", b"[0] xa\r\n[1] waiting\n[0] b\n"),  # a carriage return is a break: poprun ends the line
    (b"a\r\nb", b"[0] xa\r\n[1] waiting\n[0] b"),  # CR LF is one break, ended at the LF: no empty line after
    (b"a\rb\rc", b"[0] xa\r\n[1] waiting\n[0] b\r[0] c"),  # only the first break lets the other in
    (b"\r", b"[0] x\r\n[1] waiting\n"),
    (b"a\r", b"[0] xa\r\n[1] waiting\n"),
    (b"\r\n", b"[0] x\r\n[1] waiting\n"),
])
def test_a_waiting_instance_is_let_in_after_the_first_line_break(data: bytes, shown: bytes) -> None:
    # Where an owner with others waiting stops: the end of its first newline or carriage return,
    # a CR LF counting as one break that ends at the LF.
    sink, first, second = two_instances()
    first.feed(1, b"x")  # instance 0 owns the line, unfinished
    second.feed(1, b"waiting\n")  # instance 1 waits for it
    first.feed(1, data)
    assert sink.getvalue() == shown


def test_log_files_are_appended_to_after_a_restart_and_are_not_executable(tmp_path: Path) -> None:
    from poprun_py.supervision.output import OutputOptions

    for append, text in ((False, b"first run\n"), (True, b"restarted\n")):
        output = InstanceOutput(0, False, {1: Sink(io.BytesIO()), 2: Sink(io.BytesIO())},
                                OutputOptions(str(tmp_path), append=append))
        output.feed(1, text)
        output.flush()
    log = tmp_path / "instance-0" / "stdout.log"
    assert log.read_bytes() == b"first run\nrestarted\n"
    umask = os.umask(0)
    os.umask(umask)
    assert log.stat().st_mode & 0o777 == 0o666 & ~umask


@pytest.mark.usefixtures("poprun_log")
def test_a_log_directory_that_cannot_be_made_is_said_once_and_output_goes_on(
        tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    from poprun_py.supervision.output import OutputOptions

    (tmp_path / "taken").write_text("a file where the directory would be")
    sink = io.BytesIO()
    output = InstanceOutput(0, True, {1: Sink(sink), 2: Sink(io.BytesIO())}, OutputOptions(str(tmp_path / "taken")))
    output.feed(1, b"shown\n")
    output.flush()
    assert sink.getvalue() == b"[0] shown\n" and output.logs == {}
    said = [line for line in capfd.readouterr().err.splitlines() if "no longer written" in line]
    assert len(said) == 1 and said[0].endswith(
        f"instance 0's output is no longer written to {tmp_path}/taken/instance-0: Not a directory"), said


@pytest.mark.parametrize("then, shown", [(b"", b""), (b"\n", b"[0] \n")])
def test_an_instance_whose_line_poprun_ended_starts_a_new_one(then: bytes, shown: bytes) -> None:
    # Its line was ended already: flushing adds no empty line, and an empty line of its own is tagged.
    sink, first, _ = two_instances()
    first.feed(1, b"partial")
    first.sinks[1].write(b"poprun: note\n")
    first.feed(1, then)
    first.flush()
    assert sink.getvalue() == b"[0] partial\npoprun: note\n" + shown


def test_the_stderr_tail_keeps_the_last_lines_whole_across_pieces_and_bounded() -> None:
    from poprun_py.supervision.output import TAIL_LINE_BYTES, TAIL_LINES

    _, first, _ = two_instances()
    first.feed(2, b"a line in")
    assert first.stderr_tail == []  # not ended yet
    first.feed(2, b" two pieces\nnext")
    assert first.stderr_tail == [b"a line in two pieces"]
    first.feed(2, b" one\n" + b"".join(b"line %d\n" % k for k in range(TAIL_LINES + 5)))
    assert first.stderr_tail == [b"line %d" % k for k in range(5, TAIL_LINES + 5)]
    long = bytes(range(256)).replace(b"\n", b"").replace(b"\r", b"") * (TAIL_LINE_BYTES // 200)
    assert len(long) > TAIL_LINE_BYTES
    first.feed(2, long)  # held unfinished: only its last TAIL_LINE_BYTES bytes are kept
    first.feed(2, b" end\n")
    assert first.stderr_tail[-1] == (long + b" end")[-TAIL_LINE_BYTES:] and len(first.stderr_tail) == TAIL_LINES
    first.feed(2, b"progress 10%\rprogress 90%\r\n")  # what a terminal shows of a redrawn line
    assert first.stderr_tail[-1] == b"progress 90%"


@pytest.mark.parametrize("log_dir, message", [
    ("/proc/1", "--log-dir '/proc/1' is not writable"),
    ("/proc/1/logs", "--log-dir '/proc/1/logs' cannot be created: No such file or directory"),
    ("/dev/null", "--log-dir '/dev/null' exists and is not a directory"),
    ("/nonexistent-parent/logs", ("--log-dir '/nonexistent-parent/logs': its parent directory '/nonexistent-parent' "
                                  "does not exist (poprun creates only the last directory of the path)")),
])
def test_a_log_directory_that_cannot_work_is_one_line_before_anything_starts(log_dir: str, message: str) -> None:
    from poprun_py.shared.errors import PlanError
    from poprun_py.supervision.output import check_log_options

    with pytest.raises(PlanError) as info:
        check_log_options(log_dir, True, create=True)
    assert str(info.value) == message


def test_the_stderr_tail_of_redraws_and_of_a_long_unfinished_line() -> None:
    from poprun_py.supervision.output import TAIL_LINE_BYTES

    _, first, _ = two_instances()
    first.feed(2, b"a\rb\rc\n\r\r\n")  # what a terminal shows: the last part; nothing of a line of CRs
    assert first.stderr_tail == [b"c", b""]
    long = b"0123456789abcdef" * (TAIL_LINE_BYTES // 16 * 3 // 2)  # one and a half times the bound
    first.feed(2, b"one\n" + long)  # the unfinished rest of a piece is kept to its last bytes
    first.feed(2, b"\n")
    assert first.stderr_tail[-1] == long[-TAIL_LINE_BYTES:]


@pytest.mark.parametrize("second", [0, 1, 2])
def test_a_timestamp_in_any_second_names_that_second(second: int) -> None:
    """The first stamp is computed afresh whatever second it falls in (the epoch's first ones too)."""
    from poprun_py.supervision.output import Stream

    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(second))
    assert Stream(b"", True, io.BytesIO()).prefix(second + 0.5) == f"{stamp}.500 ".encode()


def test_timestamps_are_the_local_time_of_receipt_to_the_millisecond() -> None:
    from poprun_py.supervision.output import Stream

    received = 1700000000.25  # a moment of the past, not of the run
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(1700000000))
    stream = Stream(b"[3] ", True, io.BytesIO())
    assert stream.prefix(received) == f"[3] {stamp}.250 ".encode()
    assert stream.prefix(received + 0.5) == f"[3] {stamp}.750 ".encode()  # the same second
    assert stream.prefix(1700000000.9996) == f"[3] {stamp}.999 ".encode()  # cut, never rounded up to .1000
    out = bytearray()
    stream.held.append((received, b"x\n\n"))
    stream.render(out, until_break=False)
    assert out == f"[3] {stamp}.250 x\n[3] {stamp}.250 \n".encode()  # an empty line is stamped too
    out.clear()
    stream.held.append((received, b"a\rb\n\n"))  # redrawn, then an empty line
    stream.render(out, until_break=False)
    assert out == f"[3] {stamp}.250 a\r[3] {stamp}.250 b\n[3] {stamp}.250 \n".encode()


def test_a_waiting_instance_that_holds_too_much_ends_the_owners_line(monkeypatch: pytest.MonkeyPatch) -> None:
    from poprun_py.supervision import output

    monkeypatch.setattr(output, "HOLD_BYTES", 10)
    sink, first, second = two_instances()
    first.feed(1, b"partial")
    second.feed(1, b"01234")
    second.feed(1, b"56789")  # 10 bytes held: not more than the bound yet
    assert sink.getvalue() == b"[0] partial"
    second.feed(1, b"a")  # 11: instance 0's line is ended for it
    assert sink.getvalue() == b"[0] partial\n[1] 0123456789a"
    first.feed(1, b"0123456789")  # instance 0 now waits, its count started afresh
    assert sink.getvalue() == b"[0] partial\n[1] 0123456789a"
    first.feed(1, b"b")
    assert sink.getvalue() == b"[0] partial\n[1] 0123456789a\n[0] 0123456789b"


def test_an_instance_that_holds_too_much_with_the_line_free_just_takes_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from poprun_py.supervision import output

    monkeypatch.setattr(output, "HOLD_BYTES", 10)
    sink, first, _ = two_instances()
    first.feed(1, b"0123456789abcdef")
    assert sink.getvalue() == b"[0] 0123456789abcdef"


def test_an_unfinished_last_stderr_line_reaches_the_tail_when_the_instance_ends() -> None:
    _, first, _ = two_instances()
    first.feed(2, b"no newline at the end")
    first.flush()
    assert first.stderr_tail == [b"no newline at the end"]


def fake_clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The output module's monotonic clock made the test's: set ``now[0]`` to move it."""
    from poprun_py.supervision import output

    now = [100.0]
    monkeypatch.setattr(output, "time", types.SimpleNamespace(
        monotonic=lambda: now[0], time=time.time, strftime=time.strftime, localtime=time.localtime))
    return now


@pytest.mark.parametrize("owner_writes_at, tick_at, ended", [
    (None, 0.999, False), (None, 1.0, True),  # the owner quiet for HOLD_SECONDS while one waits
    (0.9, 1.0, False), (0.9, 1.899, False), (0.9, 1.9, True),  # quiet counted from its last write
    (4.5, 4.999, False), (4.5, 5.0, True),  # however busy, nobody waits more than MAX_WAIT_SECONDS
])
def test_the_owners_line_is_ended_when_it_is_quiet_or_has_kept_one_waiting_too_long(
        monkeypatch: pytest.MonkeyPatch, owner_writes_at: float | None, tick_at: float, ended: bool) -> None:
    now = fake_clock(monkeypatch)
    sink, first, second = two_instances()
    first.feed(1, b"partial")
    second.feed(1, b"waiting\n")
    if owner_writes_at is not None:
        now[0] = 100.0 + owner_writes_at
        first.feed(1, b" more")
    before = sink.getvalue()
    now[0] = 100.0 + tick_at
    first.sinks[1].tick()
    assert sink.getvalue() == (before + b"\n[1] waiting\n" if ended else before)


def test_a_waiting_instance_that_writes_more_keeps_its_place_and_its_waiting_time(
        monkeypatch: pytest.MonkeyPatch) -> None:
    now = fake_clock(monkeypatch)
    sink, first, second = two_instances()
    first.feed(1, b"partial")
    second.feed(1, b"waiting")  # waits from 100.0
    now[0] = 104.0
    second.feed(1, b" more\n")  # still the same wait, not a new one
    now[0] = 104.5
    first.feed(1, b" busy")
    now[0] = 105.0  # MAX_WAIT_SECONDS after it began waiting, though the owner is busy
    first.sinks[1].tick()
    assert sink.getvalue() == b"[0] partial busy\n[1] waiting more\n"
    first.flush()
    second.flush()
    assert sink.getvalue() == b"[0] partial busy\n[1] waiting more\n"


def test_an_owner_sent_back_to_wait_keeps_its_waiting_time_when_it_writes_more(
        monkeypatch: pytest.MonkeyPatch) -> None:
    now = fake_clock(monkeypatch)
    sink, first, second = two_instances()
    first.feed(1, b"partial")
    second.feed(1, b"waiting")
    first.feed(1, b" end\nrest")  # at its newline instance 0 waits again, from 100.0, behind instance 1
    assert sink.getvalue() == b"[0] partial end\n[1] waiting"
    now[0] = 104.0
    first.feed(1, b" and more")  # still the same wait
    now[0] = 104.5
    second.feed(1, b" busy")
    now[0] = 105.0
    first.sinks[1].tick()
    assert sink.getvalue() == b"[0] partial end\n[1] waiting busy\n[0] rest and more"


def test_one_line_over_two_files_sends_each_stream_to_its_own() -> None:
    """A line shared by stdout and stderr (``sinks_for`` when they are one file) still writes each
    stream's bytes through its own file object: here two separate buffers show where each went."""
    out, err = io.BytesIO(), io.BytesIO()
    stdout = Sink(out)
    instance = InstanceOutput(0, True, {1: stdout, 2: Sink(err, stdout.line)})
    instance.feed(1, b"to stdout")
    instance.feed(2, b"to stderr\n")  # waits for stdout's open line
    instance.flush()
    assert (out.getvalue(), err.getvalue()) == (b"[0] to stdout\n", b"[0] to stderr\n")


def test_an_owner_that_ends_mid_line_gets_its_line_ended_and_the_waiting_one_goes() -> None:
    sink, first, second = two_instances()
    first.feed(1, b"partial")
    second.feed(1, b"waiting\n")
    first.flush()
    assert sink.getvalue() == b"[0] partial\n[1] waiting\n"
    second.flush()
    assert sink.getvalue() == b"[0] partial\n[1] waiting\n"


def test_output_to_a_reader_that_has_gone_is_dropped_without_an_error() -> None:
    # poprun's stdout after its reader has gone (``poprun ... | head``): its OwnStream drops every
    # write from the first failure on, so the instances' lines are framed on as if shown.
    from poprun_py.supervision.own_output import OwnStream

    read_end, write_end = os.pipe()
    os.close(read_end)
    stdout = OwnStream(write_end)
    try:
        sinks = {1: Sink(io.BufferedWriter(stdout)), 2: Sink(io.BytesIO())}
        first, second = InstanceOutput(0, True, sinks), InstanceOutput(1, True, sinks)
        first.feed(1, b"partial")
        assert isinstance(stdout.failure, BrokenPipeError)
        second.feed(1, b"waiting\n")
        first.feed(1, b" more\nand more\n")
        second.flush()
        first.flush()
        assert sinks[1].line.owner is None and sinks[1].line.queue == []
        assert not any(stream.held for stream in (*first.streams.values(), *second.streams.values()))
    finally:
        os.close(write_end)


def test_poprun_s_own_stream_is_a_terminal_where_its_descriptor_is_one() -> None:
    # click asks (its colours, its prompts): poprun's stdout on a terminal is one, on a pipe is not.
    import pty

    from poprun_py.supervision.own_output import OwnStream

    descriptors = [*pty.openpty(), *os.pipe()]
    try:
        assert [OwnStream(fd).isatty() for fd in descriptors[1:3]] == [True, False]
    finally:
        for fd in descriptors:
            os.close(fd)


def test_poprun_s_own_stream_knows_whether_what_it_wrote_ended_a_line() -> None:
    # poprun's own lines (own_output.say) start on a line of their own: after an instance's unended
    # line a newline comes first, after an ended one none.
    from poprun_py.supervision.own_output import OwnStream

    read_end, write_end = os.pipe()
    stream = OwnStream(write_end)
    try:
        seen = []
        for data in (b"ab\n", b"a\nb", b"\n", b"x", b"\n\x0b"):
            assert stream.write(data) == len(data)
            seen.append(stream.ends_line)
        assert seen == [True, False, True, False, False]
        assert os.read(read_end, 100) == b"ab\na\nb\nx\n\x0b"
    finally:
        os.close(read_end)
        os.close(write_end)


def test_a_fresh_run_starts_its_log_files_afresh(tmp_path: Path) -> None:
    from poprun_py.supervision.output import OutputOptions

    (tmp_path / "instance-0").mkdir()
    (tmp_path / "instance-0" / "stdout.log").write_bytes(b"an earlier job's output\n")
    output = InstanceOutput(0, False, {1: Sink(io.BytesIO()), 2: Sink(io.BytesIO())}, OutputOptions(str(tmp_path)))
    output.feed(1, b"this job\n")
    output.flush()
    assert (tmp_path / "instance-0" / "stdout.log").read_bytes() == b"this job\n"


def test_an_owner_yields_right_after_its_first_break_even_one_byte_before_the_end() -> None:
    sink, first, second = two_instances()
    first.feed(1, b"x")
    second.feed(1, b"waiting\n")
    first.feed(1, b"y\nz")  # a break, then one byte: the waiting instance goes between them
    assert sink.getvalue() == b"[0] xy\n[1] waiting\n[0] z"


def test_a_signal_while_a_write_waits_for_its_reader_loses_nothing() -> None:
    """Ctrl-Z or Ctrl-C (signals poprun handles) while its output waits for a slow reader: the
    interrupted write returns having written part of it, and the rest still goes, in order. (The
    file is unbuffered, as poprun's stdout is under PYTHONUNBUFFERED or ``python -u``.)"""
    read_end, write_end = os.pipe()
    sink = Sink(os.fdopen(write_end, "wb", buffering=0))
    data = bytes(range(256)) * 4096  # 1 MiB: far more than the pipe holds
    handled: list[int] = []
    received = bytearray()
    main = threading.get_ident()

    def reader() -> None:
        capacity = fcntl.fcntl(read_end, fcntl.F_GETPIPE_SZ)

        def waiting() -> int:  # bytes in the pipe: once it is full, the write waits
            return int(struct.unpack("i", fcntl.ioctl(read_end, termios.FIONREAD, b"\0" * 4))[0])

        wait_until(lambda: waiting() == capacity, "the write waits for its reader")
        signal.pthread_kill(main, signal.SIGUSR1)
        wait_until(lambda: bool(handled), "the signal was handled")
        while chunk := os.read(read_end, 1 << 16):
            received.extend(chunk)

    previous = signal.signal(signal.SIGUSR1, lambda signum, _: handled.append(signum))
    thread = threading.Thread(target=reader, daemon=True)
    thread.start()
    try:
        sink.write(data)
        sink.file.close()
        thread.join(timeout=30)
    finally:
        signal.signal(signal.SIGUSR1, previous)
        os.close(read_end)
    assert handled == [signal.SIGUSR1] and bytes(received) == data, len(received)
