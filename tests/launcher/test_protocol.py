"""The frames between a host's supervisor and poprun, byte for byte: what one side packs and seals,
the other reads back, and what it refuses to believe."""

from __future__ import annotations

import hmac
import os

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from poprun_py.wire import protocol, seal
from poprun_py.wire.seal import TO_HOST, TO_POPRUN, Seal, new_nonce, new_secret


def ends(secret: str | None = None) -> tuple[Seal, Seal]:
    """A host supervisor's and poprun's seals of one connection."""
    secret, nonce = secret or new_secret(), new_nonce()
    return Seal(secret, nonce, TO_POPRUN), Seal(secret, nonce, TO_HOST)


def host_sends(*frames: bytes) -> tuple[bytes, protocol.FrameReader]:
    """``frames`` as a host's supervisor puts them on the wire, and poprun's reader for them."""
    host, poprun = ends()
    return b"".join(host.seal(f) for f in frames), protocol.FrameReader(poprun)


def test_a_frame_is_its_header_then_its_payload_on_stream_0_unless_told() -> None:
    assert protocol.frame(protocol.OUTPUT, b"abc") == bytes([protocol.OUTPUT, 0, 0, 0, 0, 3]) + b"abc"
    assert protocol.frame(protocol.OUTPUT, b"abc", stream=2) == bytes([protocol.OUTPUT, 2, 0, 0, 0, 3]) + b"abc"
    heartbeat = bytes([protocol.HEARTBEAT, 0, 0, 0, 0, 0])
    assert protocol.frame(protocol.HEARTBEAT, b"") == protocol.HEARTBEAT_FRAME == heartbeat


@pytest.mark.parametrize(("status", "signum", "error", "flags"), [
    (0, None, None, 0), (1, None, "no such file", 0), (-9, 9, None, 0), (143, 15, "stopped", 0),
    (143, None, None, protocol.EXIT_STUB_SIGNALLED)])
def test_an_exit_report_reads_back_as_it_was_sent(status: int, signum: int | None, error: str | None,
                                                  flags: int) -> None:
    # No flags: none is the default.
    report = protocol.exit_report(status, signum, error, flags) if flags else protocol.exit_report(status, signum,
                                                                                                     error)
    wire, reader = host_sends(report)
    [(kind, stream, payload)] = reader.feed(wire)
    assert (kind, stream) == (protocol.EXIT, 0)
    assert protocol.read_exit(payload) == (status, signum, error, flags)
    # No error: nothing follows the fixed fields.
    assert len(payload) == protocol.EXIT_FIELDS.size + len((error or "").encode())


def test_a_hello_reads_back_and_bytes_that_are_not_utf8_are_replaced() -> None:
    wire, reader = host_sends(protocol.host_hello(4242, "node-ü"))
    [(kind, _, payload)] = reader.feed(wire)
    assert kind == protocol.HOST_HELLO and protocol.read_host_hello(payload) == (4242, "node-ü")
    assert protocol.read_host_hello(protocol.HOST_HELLO_FIELDS.pack(7) + b"h\xffst") == (7, "h\ufffdst")
    assert protocol.read_exit(protocol.EXIT_FIELDS.pack(2, 0, 0) + b"bad \xfe") == (2, None, "bad \ufffd", 0)


def test_the_hosts_clock_and_times_read_back_to_the_nanosecond() -> None:
    now = 1_795_852_183_611_421_337  # a wall clock in ns, past 2**60
    wire, reader = host_sends(protocol.clock(now, now + 5))
    [(kind, _, payload)] = reader.feed(wire)
    assert kind == protocol.CLOCK and protocol.read_clock(payload) == (now, now + 5)
    wire, reader = host_sends(protocol.times(now + 9, 0, now))
    [(kind, _, payload)] = reader.feed(wire)
    assert kind == protocol.TIMES and protocol.read_times(payload) == (now + 9, 0, now)  # 0: never
    for read, name, size in ((protocol.read_clock, "CLOCK", 16), (protocol.read_times, "TIMES", 24)):
        with pytest.raises(protocol.ProtocolError) as short:
            read(b"\0" * 8)
        assert str(short.value) == f"{name} payload of 8 bytes is shorter than its {size}-byte header"


def test_an_uncaught_exception_reads_back_and_a_short_one_is_named_by_its_kind() -> None:
    now = 1_795_852_183_611_421_337
    wire, reader = host_sends(protocol.uncaught(now, "KeyError: 'é'".encode() + b" \xfe"))
    [(kind, _, payload)] = reader.feed(wire)
    assert kind == protocol.UNCAUGHT and protocol.read_uncaught(payload) == (now, "KeyError: 'é' \ufffd")
    for kind, name, size in ((protocol.UNCAUGHT, "UNCAUGHT", 8), (protocol.TIMES, "TIMES", 24),
                             (protocol.EXIT, "EXIT", 9)):
        expected = f"{name} payload of 7 bytes is shorter than its {size}-byte header"
        assert protocol.unreadable(kind, 0, b"\0" * 7) == expected


def test_a_payload_shorter_than_its_fields_is_named_exactly() -> None:
    with pytest.raises(protocol.ProtocolError) as hello:
        protocol.read_host_hello(b"\0" * 5)
    assert str(hello.value) == "HOST_HELLO payload of 5 bytes is shorter than its 8-byte header"
    with pytest.raises(protocol.ProtocolError) as exit_:
        protocol.read_exit(b"\0" * 7)
    assert str(exit_.value) == "EXIT payload of 7 bytes is shorter than its 9-byte header"


def test_frames_come_out_only_when_whole_with_their_tags_however_the_bytes_are_cut() -> None:
    frames = (protocol.HEARTBEAT_FRAME, protocol.frame(protocol.OUTPUT, b"line\n", 1), protocol.HEARTBEAT_FRAME)
    expected = [(protocol.HEARTBEAT, 0, b""), (protocol.OUTPUT, 1, b"line\n"), (protocol.HEARTBEAT, 0, b"")]
    wire, reader = host_sends(*frames)
    assert reader.feed(wire) == expected
    host, poprun = ends()
    wire, reader = b"".join(host.seal(f) for f in frames), protocol.FrameReader(poprun)
    got = [reader.feed(wire[i:i + 1]) for i in range(len(wire))]
    # A frame is whole at the last byte of its tag: 6 + 16 bytes for a heartbeat.
    tag = protocol.TAG_SIZE
    assert [i for i, out in enumerate(got) if out] == [6 + tag - 1, 2 * (6 + tag) + 5 - 1, len(wire) - 1]
    assert [f for out in got for f in out] == expected


def _refused(reader: protocol.FrameReader, wire: bytes) -> str:
    with pytest.raises(protocol.ProtocolError) as refused:
        reader.feed(wire)
    return str(refused.value)


@pytest.mark.parametrize("tamper", ["another secret", "another nonce", "a byte changed", "replayed", "reordered",
                                    "sent the other way", "tag cut short"])
def test_a_frame_not_sealed_by_this_connections_host_is_refused(tamper: str) -> None:
    hello, heartbeat = protocol.host_hello(1, "node"), protocol.HEARTBEAT_FRAME
    host, poprun = ends()
    reader = protocol.FrameReader(poprun)
    if tamper == "another secret":
        wire = Seal(new_secret(), new_nonce(), TO_POPRUN).seal(hello)
    elif tamper == "another nonce":  # recorded on another connection of the same run
        wire = Seal("0" * 64, new_nonce(), TO_POPRUN).seal(hello)
        host, poprun = ends("0" * 64)
        reader = protocol.FrameReader(poprun)
    elif tamper == "a byte changed":
        sealed = host.seal(hello)
        wire = sealed[:7] + bytes([sealed[7] ^ 1]) + sealed[8:]
    elif tamper == "replayed":
        first = host.seal(hello)
        assert reader.feed(first) == [(protocol.HOST_HELLO, 0, hello[6:])]
        wire = first
    elif tamper == "reordered":
        first, second = host.seal(hello), host.seal(heartbeat)
        wire = second + first
    elif tamper == "sent the other way":  # poprun's own sealing of the same bytes
        wire = poprun.seal(hello)
    else:  # the next frame's first byte completes the tag: one that happens to equal the byte cut
        # off (1 in 256) would make a valid frame, so that pair is sealed again on fresh ends
        first, second = host.seal(heartbeat), host.seal(heartbeat)
        while first[-1] == second[0]:
            host, poprun = ends()
            reader = protocol.FrameReader(poprun)
            first, second = host.seal(heartbeat), host.seal(heartbeat)
        wire = first[:-1] + second
    assert _refused(reader, wire) == "a frame failed its authentication check"


@pytest.mark.parametrize("key_bytes", [0, 1, 32, 64, 65, 200])
def test_the_seals_hmac_is_the_standard_librarys(key_bytes: int) -> None:
    key, message = os.urandom(key_bytes), os.urandom(100)
    assert seal.hmac_sha256(key, message) == hmac.digest(key, message, "sha256")


def test_tags_are_hmac_sha256_of_direction_number_and_frame_before_and_after_the_move_to_openssl() -> None:
    # The connection's first frames are hashed with the small SHA-256, those after FAST_AFTER_BYTES
    # with OpenSSL's: each tag is still the standard HMAC, and the other end checks each.
    secret, nonce = new_secret(), new_nonce()
    host, poprun = Seal(secret, nonce, TO_POPRUN), Seal(secret, nonce, TO_HOST)
    key = hmac.digest(secret.encode(), b"poprun control channel" + nonce, "sha256")
    frames = [b"hello", os.urandom(seal.FAST_AFTER_BYTES // 2), os.urandom(seal.FAST_AFTER_BYTES), b"exit", b""]
    for number, frame in enumerate(frames):
        tag = host.seal(frame)[len(frame):]
        position = bytes([TO_POPRUN]) + number.to_bytes(8, "big")
        assert tag == hmac.new(key, position + frame, "sha256").digest()[:protocol.TAG_SIZE], number
        assert poprun.check(frame, tag), number
    assert not poprun.check(b"exit", tag)  # checked once: the next number is expected now


def test_a_header_that_claims_too_much_is_refused_before_anything_is_held() -> None:
    _, poprun = ends()
    header = protocol.HEADER.pack(protocol.OUTPUT, 1, protocol.MAX_PAYLOAD + 1)
    assert _refused(protocol.FrameReader(poprun), header) == (
        f"a frame of {protocol.MAX_PAYLOAD + 1} bytes is longer than the {protocol.MAX_PAYLOAD} a frame may have")
    wire, reader = host_sends(protocol.frame(protocol.OUTPUT, b"x" * protocol.MAX_PAYLOAD, 1))
    assert reader.feed(wire) == [(protocol.OUTPUT, 1, b"x" * protocol.MAX_PAYLOAD)]


def test_commands_are_read_in_order_and_one_not_sealed_by_poprun_is_refused() -> None:
    host, poprun = ends()
    commands = protocol.CommandReader(host)
    terminate, release = protocol.host_command(0, protocol.TERMINATE), protocol.host_command(1, protocol.RELEASE)
    wire = poprun.seal(terminate) + poprun.seal(release)
    assert [commands.feed(wire[i:i + 1]) for i in range(len(wire))][20::21] == [[terminate], [release]]
    with pytest.raises(protocol.ProtocolError, match=r"^a command failed its authentication check$"):
        commands.feed(host.seal(terminate))  # the host's own sealing: the wrong direction


def test_a_host_supervisors_commands_name_their_instance() -> None:
    supervisor, poprun = ends()
    commands = protocol.CommandReader(supervisor, protocol.HOST_COMMAND_SIZE)
    wire = poprun.seal(protocol.host_command(7, protocol.TERMINATE)) + poprun.seal(protocol.host_command(2**32 - 1,
                                                                                                       protocol.STOP))
    assert commands.feed(wire[:20]) == [] and commands.feed(wire[20:]) == [
        protocol.TERMINATE + (7).to_bytes(4, "big"), protocol.STOP + (2**32 - 1).to_bytes(4, "big")]


def test_a_host_supervisors_frames_carry_each_instances_frame_whole() -> None:
    supervisor, poprun = ends()
    reader = protocol.FrameReader(poprun, hello_first=True)
    inner = protocol.exit_report(3, None, "why")
    wire = b"".join(supervisor.seal(frame) for frame in (
        protocol.host_hello(1234, "h\u00e9"), protocol.instance(5, inner),
        protocol.instance(6, protocol.frame(protocol.STUB_HELLO, protocol.STUB_HELLO_FIELDS.pack(99)))))
    hello, first, second = reader.feed(wire)
    assert hello[0] == protocol.HOST_HELLO and protocol.read_host_hello(hello[2]) == (1234, "h\u00e9")
    assert protocol.read_instance(first[2]) == (5, protocol.EXIT, 0, inner[protocol.HEADER.size:])
    assert protocol.read_instance(second[2]) == (6, protocol.STUB_HELLO, 0, protocol.STUB_HELLO_FIELDS.pack(99))
    with pytest.raises(protocol.ProtocolError, match=r"^INSTANCE's frame says 9 bytes and holds 8$"):
        protocol.read_instance(protocol.instance(1, protocol.frame(protocol.OUTPUT, b"x" * 9, 1))[
            protocol.HEADER.size:-1])
    with pytest.raises(protocol.ProtocolError, match=r"^INSTANCE payload of 3 bytes is shorter than its 4-byte "):
        protocol.read_instance(b"abc")


_ARGUMENT = st.binary().filter(lambda raw: b"\0" not in raw)  # any bytes an argument can hold


@given(st.lists(_ARGUMENT, min_size=1, max_size=8))
@example([b"python", b"caf\xe9.py", b"", b"a\nb", b":", b"--", b"'\"\\ $x"])
def test_the_program_message_carries_any_arguments_byte_for_byte(argv: list[bytes]) -> None:
    message = protocol.encode_program(argv)
    assert message[:1] == protocol.PROGRAM
    (length,) = protocol.PROGRAM_LENGTH.unpack_from(message, 1)
    assert length == len(message) - 1 - protocol.PROGRAM_LENGTH.size
    assert protocol.decode_program(message[1 + protocol.PROGRAM_LENGTH.size:]) == argv


def test_a_program_payload_not_ended_by_nul_is_refused() -> None:
    with pytest.raises(protocol.ProtocolError, match="do not end with NUL"):
        protocol.decode_program(b"python")


def test_a_stub_hello_too_short_for_its_pid_is_refused() -> None:
    assert protocol.read_stub_hello(protocol.STUB_HELLO_FIELDS.pack(4321)) == 4321
    with pytest.raises(protocol.ProtocolError, match=r"^STUB_HELLO payload of 4 bytes is shorter than its 8-byte "):
        protocol.read_stub_hello(b"\0\0\0\1")
