"""A remote host's end of its link to poprun (``poprun_py/host/link.py``), on real sockets with
poprun's end played by the test: the nonce read whole, HOST_HELLO and CLOCK sealed, the program
taken only when it passes its check and fits the host, and one line when it cannot be had."""

from __future__ import annotations

import os
import socket
import time

import pytest

from popcontract import environment
from poprun_py.host.link import connect_to_poprun, read_nonce, receive_program
from poprun_py.wire import protocol
from poprun_py.wire.seal import TO_HOST, TO_POPRUN, Seal, new_nonce, new_secret

WHO = "poprun: host supervisor on node7"
PROGRAM = [b"prog", b"--flag", b"", b"caf\xe9"]


def _link() -> tuple[socket.socket, socket.socket, Seal, Seal]:
    """A TCP connection on loopback, the host's end first, and the host's and poprun's seals of it."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        host = socket.create_connection(server.getsockname(), timeout=10)
        poprun, _ = server.accept()
    secret, nonce = new_secret(), new_nonce()
    return host, poprun, Seal(secret, nonce, TO_POPRUN), Seal(secret, nonce, TO_HOST)


def test_the_nonce_is_read_whole_from_its_pieces_and_nothing_after_it() -> None:
    host, poprun, _, _ = _link()
    with host, poprun:
        nonce = new_nonce()
        for piece in (nonce[:3], nonce[3:9], nonce[9:], b"after"):
            poprun.sendall(piece)
        assert read_nonce(host, 10.0) == nonce
        assert host.recv(16) == b"after"


def test_a_nonce_that_never_comes_is_given_up_on() -> None:
    host, poprun, _, _ = _link()
    with host, poprun:
        started = time.monotonic()
        with pytest.raises(OSError):
            read_nonce(host, 0.2)
        assert time.monotonic() - started < 5


def test_a_host_says_hello_and_its_clock_then_takes_its_program_byte_for_byte() -> None:
    host, poprun, host_seal, poprun_seal = _link()
    with host, poprun:
        poprun.sendall(poprun_seal.seal(protocol.encode_program(PROGRAM)))  # (waits in the buffer)
        before = time.time_ns()
        argv = receive_program(host, host_seal, before, protocol.host_hello(4321, "node7"), WHO)
        assert argv == PROGRAM
        poprun.settimeout(10)
        reader = protocol.FrameReader(poprun_seal, hello_first=True)
        frames: list[tuple[int, int, bytes]] = []
        while len(frames) < 2:
            frames += reader.feed(poprun.recv(4096))
    (hello_kind, _, hello), (clock_kind, _, clock) = frames
    assert (hello_kind, protocol.read_host_hello(hello)) == (protocol.HOST_HELLO, (4321, "node7"))
    arrived, replied = protocol.read_clock(clock)
    assert clock_kind == protocol.CLOCK and arrived == before <= replied <= time.time_ns()


@pytest.mark.parametrize("case", ["another secret", "too long", "poprun gone"])
def test_a_program_that_cannot_be_had_is_one_line_and_nothing(case: str, capfd: pytest.CaptureFixture[str]) -> None:
    host, poprun, host_seal, _ = _link()
    with host, poprun:
        message = protocol.encode_program(PROGRAM)
        if case == "another secret":
            poprun.sendall(Seal(new_secret(), new_nonce(), TO_HOST).seal(message))
        elif case == "too long":  # a header that claims more than the host lets a program have
            poprun.sendall(protocol.PROGRAM + protocol.PROGRAM_LENGTH.pack(os.sysconf("SC_ARG_MAX") + 1))
        else:
            poprun.shutdown(socket.SHUT_WR)
        assert receive_program(host, host_seal, time.time_ns(), protocol.host_hello(1, "node7"), WHO) is None
    why = {"another secret": "the program failed its authentication check",
           "too long": f"its first message is not a program of at most {os.sysconf('SC_ARG_MAX')} bytes",
           "poprun gone": "poprun closed the connection"}[case]
    assert capfd.readouterr().err == (f"{WHO}: did not receive the program from poprun ({why}); the program was "
                                      "not started\n")


def test_without_poprun_s_address_or_the_secret_nothing_is_reached(monkeypatch: pytest.MonkeyPatch,
                                                                    capfd: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv(environment.CONTROL, raising=False)
    assert connect_to_poprun(None, 1.0, WHO) is None
    assert capfd.readouterr().err == (f"{WHO}: cannot reach poprun (no {environment.CONTROL} or {environment.SECRET} "
                                      "in its environment (was it dropped by mpiexec's options?)); the program was "
                                      "not started\n")
    with socket.create_server(("127.0.0.1", 0)) as server:
        address = "{}:{}".format(*server.getsockname())
    monkeypatch.setenv(environment.CONTROL, address)  # nobody listens there now
    assert connect_to_poprun("a secret", 1.0, WHO) is None
    said = capfd.readouterr().err
    assert said.startswith(f"{WHO}: cannot reach poprun at {address} (") and said.endswith(
        "); the program was not started\n") and said.count("\n") == 1, said
