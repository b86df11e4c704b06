"""What the stub takes for a program's stderr ending with an uncaught exception's traceback: the
end of what Python's excepthook prints, and nothing that only looks like it (``instance.uncaught``)."""

from __future__ import annotations

import traceback

import pytest

from poprun_py.host.uncaught import TAIL_SIZE, Tail, exception_line, printing


class Custom(Exception):
    """An exception outside builtins: its line names its module."""


def printed(error: BaseException) -> bytes:
    """What the default excepthook prints for ``error``, once raised."""
    try:
        raise error
    except BaseException as raised:
        return "".join(traceback.format_exception(raised)).encode()


def chained(cause: bool) -> bytes:
    """A traceback of two, the second raised from (``cause``) or while handling the first."""
    try:
        try:
            raise ValueError("first")
        except ValueError as first:
            if cause:
                raise RuntimeError("second") from first
            raise RuntimeError("second")  # noqa: B904 (the implicit chain is the one printed here)
    except RuntimeError as raised:
        return "".join(traceback.format_exception(raised)).encode()


def deep(depth: int) -> None:
    if depth:
        deep(depth - 1)
    raise ValueError("deep")


@pytest.mark.parametrize(("text", "line"), [
    (printed(ModuleNotFoundError("No module named 'nonexistent_module'")),
     b"ModuleNotFoundError: No module named 'nonexistent_module'"),
    (b"epoch 1\n" + printed(ValueError()), b"ValueError"),
    (printed(Custom("mine")), f"{__name__}.Custom: mine".encode()),
    (printed(KeyError("é")), "KeyError: 'é'".encode()),
    (chained(cause=True), b"RuntimeError: second"),
    (chained(cause=False), b"RuntimeError: second"),
    # Its own lines, indented, between its frames and its line.
    (printed(SyntaxError("invalid syntax", ("m.py", 1, 5, "def (\n"))), b"SyntaxError: invalid syntax"),
])
def test_a_traceback_that_ends_the_stream_gives_its_exception_line(text: bytes, line: bytes) -> None:
    assert exception_line(text) == line


@pytest.mark.parametrize("text", [
    b"",
    b"all done\n",
    printed(ValueError("logged, and it went on")) + b"retrying\n",
    printed(ValueError("a message\nof two lines")),
    printed(ValueError("not yet ended")).rstrip(b"\n"),
    b"Traceback (most recent call last):\nValueError: no frames\n",
    b"  File \"x.py\", line 1, in <module>\nValueError: its header was never seen\n",
    printed(ValueError("x")).replace(b"ValueError: x", b"3 errors: x"),
])
def test_anything_else_is_no_traceback(text: bytes) -> None:
    assert exception_line(text) is None


def test_the_tail_keeps_the_streams_end_and_when_it_was_read() -> None:
    try:
        deep(100)
    except ValueError as raised:
        text = "".join(traceback.format_exception(raised)).encode()
    assert len(text) < TAIL_SIZE
    tail = Tail()
    tail.add(b"x" * TAIL_SIZE, 1)  # a line left unfinished (a progress bar's) before it
    for start in range(0, len(text), 1000):  # as it comes, in pieces
        tail.add(text[start:start + 1000], 2 + start)
    assert len(tail.data) == TAIL_SIZE and tail.data.endswith(text)
    assert tail.exception() == b"ValueError: deep" and tail.read_ns == 2 + start
    tail.add(b"x" * (TAIL_SIZE - 10), 3)  # the header has left the tail
    assert tail.exception() is None


def test_a_traceback_cut_anywhere_before_its_last_line_is_being_printed() -> None:
    """Python writes a traceback a line or a few at a time: cut at every byte between its header's
    end and its exception line's newline, it is still being printed; whole, it is not."""
    text = b"output before\n" + printed(Custom("cut anywhere"))
    header_end = text.index(b"Traceback (most recent call last):") + len(b"Traceback (most recent call last):")
    for cut in range(header_end, len(text)):
        assert printing(text[:cut]), text[:cut]
    assert not printing(text) and exception_line(text) is not None
    assert not printing(text[:header_end - 1])  # not even its header yet


@pytest.mark.parametrize("text", [
    b"plain output\n",
    b"Traceback (most recent call last):\n  File \"x\", line 1\nthen the program went on\n",
    b"Traceback (most recent call last):\n  File \"x\", line 1\nValueError: whole\n",
    b"Traceback (most recent call last):\n  File \"x\", line 1\nValueError: whole\nmore output",
])
def test_output_that_went_on_or_ended_is_no_traceback_being_printed(text: bytes) -> None:
    assert not printing(text)
