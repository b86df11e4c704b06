"""Tagging of instances' output, without processes: whatever pieces the data arrives in, what
poprun writes is the reference rendering, and two instances never share a line."""

from __future__ import annotations

import io
import random

import pytest

from poprun_py.output import InstanceOutput, Sink


def rendered(data: bytes, tag: bytes = b"[0] ") -> bytes:
    """What poprun writes for one instance's ``data``: a tag before the first printable byte of each
    line and again after each carriage return that the line continues after; a carriage return
    that moves nothing (at a line's start, after another) is dropped; a last line gets a newline."""
    out = []
    lines = data.split(b"\n")
    for number, line in enumerate(lines):
        parts = [part for part in line.split(b"\r") if part]
        last = number == len(lines) - 1
        if last and not parts:
            break
        text = b"\r".join(tag + part for part in parts) if parts else tag
        if parts and line.endswith(b"\r"):
            text += b"\r"
        out.append(text + b"\n")
    return b"".join(out)



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
