"""The stub's frames (``wire.local``) and the host supervisor's reading of them (``host.stubs``),
on their own: what each frame holds, what is refused, and a stub's connection read through a
real socket pair (descriptors passed with SCM_RIGHTS included)."""

from __future__ import annotations

import os
import socket
import struct

import pytest

from poprun_py.host import stubs
from poprun_py.wire import local


def test_a_program_goes_byte_for_byte_with_its_environment_grace_and_flags() -> None:
    argv = [b"/bin/prog", b"", b"a b", b"x\ny", b"\xff$(z)"]
    env: dict[bytes, bytes | None] = {b"SET": b"v=1", b"EMPTY": b"", b"GONE": None}
    frame = local.encode_program(argv, env, 2.5, local.PROGRAM_NO_STDIN | local.PROGRAM_ONE_STREAM)
    kind, size = local.HEADER.unpack_from(frame)
    assert (kind, size) == (local.PROGRAM, len(frame) - local.HEADER.size)
    flags, grace, decoded, changes = local.decode_program(frame[local.HEADER.size:])
    assert (flags, grace, decoded, changes) == (local.PROGRAM_NO_STDIN | local.PROGRAM_ONE_STREAM, 2.5, argv, env)


@pytest.mark.parametrize(("argv", "env", "message"), [
    ([], {}, "one or more arguments without NUL"),
    ([b"a\0b"], {}, "one or more arguments without NUL"),
    ([b"a"], {b"": b"v"}, "empty or holds '=' or NUL"),
    ([b"a"], {b"A=B": b"v"}, "empty or holds '=' or NUL"),
    ([b"a"], {b"A\0": None}, "empty or holds '=' or NUL"),
])
def test_a_program_that_cannot_be_framed_is_refused(argv: list[bytes], env: dict[bytes, bytes | None],
                                                    message: str) -> None:
    with pytest.raises(local.LocalProtocolError, match=message):
        local.encode_program(argv, env, 1.0)


@pytest.mark.parametrize("payload", [
    b"",                                                      # shorter than its fields
    local.PROGRAM_FIELDS.pack(0, 0, 0, 0),                    # no argument
    local.PROGRAM_FIELDS.pack(0, 0, 2, 0) + b"a\0",           # fewer items than counted
    local.PROGRAM_FIELDS.pack(0, 0, 1, 0) + b"a\0b\0",        # more
    local.PROGRAM_FIELDS.pack(0, 0, 1, 0) + b"a",             # not NUL-ended
])
def test_a_program_payload_that_does_not_match_its_counts_is_refused(payload: bytes) -> None:
    with pytest.raises(local.LocalProtocolError):
        local.decode_program(payload)


def test_a_field_too_short_names_the_frame_and_the_sizes() -> None:
    with pytest.raises(local.LocalProtocolError, match=r"^HELLO holds 3 bytes, fewer than its 8$"):
        local.unpack(local.HELLO_FIELDS, b"abc", "HELLO")


@pytest.mark.parametrize(("grace", "ms"), [(0.3, 300), (0.0, 0), (-1.0, 0), (1e9, 0xFFFFFFFF),
                                           (float("inf"), 0xFFFFFFFF), (4294967.295, 4294967295)])
def test_a_grace_goes_as_whole_milliseconds_in_32_bits(grace: float, ms: int) -> None:
    assert local.terminate(grace) == local.HEADER.pack(local.TERMINATE, 4) + struct.pack("!I", ms)
    assert local.PROGRAM_FIELDS.unpack_from(local.encode_program([b"a"], {}, grace)[local.HEADER.size:])[1] == ms


def test_an_exit_report_holds_status_signal_flags_and_times() -> None:
    frame = local.exited(137, 9, local.EXITED_WAS_STOPPED, 2**62, 5)
    assert frame[:local.HEADER.size] == local.HEADER.pack(local.EXITED, local.EXITED_FIELDS.size)
    assert local.EXITED_FIELDS.unpack(frame[local.HEADER.size:]) == (137, 9, local.EXITED_WAS_STOPPED, 2**62, 5)
    assert local.frame(local.RELEASE) == local.HEADER.pack(local.RELEASE, 0)


def test_the_supervisor_reads_frames_and_the_descriptors_sent_with_them() -> None:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    read_end, write_end = os.pipe()
    try:
        data = local.frame(local.STARTED, local.STARTED_FIELDS.pack(1234))
        theirs.sendmsg([data[:2]], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack("i", write_end))])
        theirs.sendall(data[2:] + local.frame(local.RELEASE))
        reader = stubs.Reader()
        frame = reader.next(ours)
        assert frame is not None and (frame.kind, frame.payload) == (local.STARTED, local.STARTED_FIELDS.pack(1234))
        (passed,) = frame.fds
        os.write(passed, b"through")  # the same pipe, under another number
        os.close(passed)
        assert os.read(read_end, 16) == b"through"
        assert reader.next(ours) == stubs.Frame(local.RELEASE, b"", [])
        theirs.sendall(local.frame(local.EXITED, b"part")[:-2])
        theirs.close()  # mid-frame: the stub is gone
        assert reader.next(ours) is None
    finally:
        for fd in (read_end, write_end):
            os.close(fd)
        ours.close()
        theirs.close()


def test_a_frame_longer_than_any_is_refused_before_anything_is_held_for_it() -> None:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with ours, theirs:
        theirs.sendall(local.HEADER.pack(local.PROGRAM, local.MAX_PAYLOAD + 1))
        with pytest.raises(local.LocalProtocolError, match=rf"^a frame of {local.MAX_PAYLOAD + 1} bytes, more than "):
            stubs.Reader().next(ours)
        theirs.sendall(local.HEADER.pack(local.PROGRAM, local.MAX_PAYLOAD) + b"x")
        theirs.close()
        assert stubs.Reader().next(ours) is None  # a frame cut short by the end: the end


def test_frames_that_arrive_together_are_read_at_once_and_a_cut_one_waits_for_its_rest() -> None:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with ours, theirs:
        reader = stubs.Reader()
        exited = local.exited(0, 0, 0, 1, 2)
        theirs.sendall(local.frame(local.SIGNALLED, local.SIGNALLED_FIELDS.pack(15)) + exited[:3])
        assert reader.frames(ours) == [stubs.Frame(local.SIGNALLED, local.SIGNALLED_FIELDS.pack(15), [])]
        ours.setblocking(False)
        assert reader.frames(ours) == []  # nothing more yet: no wait
        theirs.sendall(exited[3:])
        assert reader.frames(ours) == [stubs.Frame(local.EXITED, exited[local.HEADER.size:], [])]


def test_the_socket_lies_alone_in_a_directory_only_its_user_enters_and_goes_with_it(tmp_path: os.PathLike[str]) -> None:
    server, path = stubs.listen(str(tmp_path))
    try:
        folder = os.path.dirname(path)
        assert os.path.dirname(folder) == str(tmp_path) and os.listdir(folder) == [stubs.SOCKET_NAME]
        assert os.stat(folder).st_mode & 0o777 == 0o700
        client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        with client:
            client.connect(path)
            accepted = stubs.accept(server)
            assert accepted is not None
            conn, peer = accepted
            try:
                assert peer == stubs.Peer(os.getpid(), os.geteuid())
            finally:
                conn.close()
    finally:
        server.close()
        stubs.remove(path)
    assert not os.path.exists(os.path.dirname(path))
    stubs.remove(path)  # again: nothing left, no error


def test_a_stubs_hello_names_its_instance_and_one_of_another_version_is_refused() -> None:
    def hello(version: int, index: int) -> stubs.Frame:
        return stubs.Frame(local.HELLO, local.HELLO_FIELDS.pack(version, index), [])

    assert stubs.hello_index([hello(local.VERSION, 7)]) == 7
    with pytest.raises(local.LocalProtocolError, match=rf"^it speaks version {local.VERSION + 1} of the stubs' "):
        stubs.hello_index([hello(local.VERSION + 1, 7)])
    with pytest.raises(local.LocalProtocolError, match=rf"^its first frame is of kind {local.EXITED}, not HELLO$"):
        stubs.hello_index([stubs.Frame(local.EXITED, b"", [])])
    with pytest.raises(local.LocalProtocolError, match=r"^its first frame is of kind"):
        stubs.hello_index([hello(local.VERSION, 1), hello(local.VERSION, 2)])  # nothing may come before the program
    with pytest.raises(local.LocalProtocolError, match=r"^HELLO holds 4 bytes, fewer than its 8$"):
        stubs.hello_index([stubs.Frame(local.HELLO, b"abcd", [])])
