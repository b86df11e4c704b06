"""The frames between a shim and poprun, byte for byte: what one side packs, the other reads back."""

from __future__ import annotations

import pytest

from poprun_py import protocol


def test_a_frame_is_its_header_then_its_payload_on_stream_0_unless_told() -> None:
    assert protocol.frame(protocol.OUTPUT, b"abc") == bytes([protocol.OUTPUT, 0, 0, 0, 0, 3]) + b"abc"
    assert protocol.frame(protocol.OUTPUT, b"abc", stream=2) == bytes([protocol.OUTPUT, 2, 0, 0, 0, 3]) + b"abc"
    heartbeat = bytes([protocol.HEARTBEAT, 0, 0, 0, 0, 0])
    assert protocol.frame(protocol.HEARTBEAT, b"") == protocol.HEARTBEAT_FRAME == heartbeat


@pytest.mark.parametrize(("status", "signum", "error"), [(0, None, None), (1, None, "no such file"),
                                                         (-9, 9, None), (143, 15, "stopped")])
def test_an_exit_report_reads_back_as_it_was_sent(status: int, signum: int | None, error: str | None) -> None:
    [(kind, stream, payload)] = protocol.FrameReader().feed(protocol.exit_report(status, signum, error))
    assert (kind, stream) == (protocol.EXIT, 0)
    assert protocol.read_exit(payload) == (status, signum, error)
    # No error: nothing follows the fixed fields.
    assert len(payload) == protocol.EXIT_FIELDS.size + len((error or "").encode())


def test_a_hello_reads_back_and_bytes_that_are_not_utf8_are_replaced() -> None:
    [(kind, _, payload)] = protocol.FrameReader().feed(protocol.hello(3, 4242, "node-ü"))
    assert kind == protocol.HELLO and protocol.read_hello(payload) == (3, 4242, "node-ü")
    assert protocol.read_hello(protocol.HELLO_FIELDS.pack(1, 7) + b"h\xffst") == (1, 7, "h\ufffdst")
    assert protocol.read_exit(protocol.EXIT_FIELDS.pack(2, 0) + b"bad \xfe") == (2, None, "bad \ufffd")


def test_a_payload_shorter_than_its_fields_is_named_exactly() -> None:
    with pytest.raises(protocol.ProtocolError) as hello:
        protocol.read_hello(b"\0" * 5)
    assert str(hello.value) == "HELLO payload of 5 bytes is shorter than its 12-byte header"
    with pytest.raises(protocol.ProtocolError) as exit_:
        protocol.read_exit(b"\0" * 7)
    assert str(exit_.value) == "EXIT payload of 7 bytes is shorter than its 8-byte header"


def test_frames_come_out_only_when_whole_however_the_bytes_are_cut() -> None:
    sent = protocol.HEARTBEAT_FRAME + protocol.frame(protocol.OUTPUT, b"line\n", 1) + protocol.HEARTBEAT_FRAME
    expected = [(protocol.HEARTBEAT, 0, b""), (protocol.OUTPUT, 1, b"line\n"), (protocol.HEARTBEAT, 0, b"")]
    assert protocol.FrameReader().feed(sent) == expected
    reader = protocol.FrameReader()
    got = [reader.feed(sent[i:i + 1]) for i in range(len(sent))]
    # A payload-less frame is whole at its sixth byte; the output frame at its last.
    ends = [i for i, frames in enumerate(got) if frames]
    assert ends == [5, 5 + 6 + 5, len(sent) - 1]
    assert [f for frames in got for f in frames] == expected
