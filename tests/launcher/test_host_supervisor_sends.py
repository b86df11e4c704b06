"""A remote host's supervisor held back by a poprun that does not read (its output paused, Ctrl-S,
stopped): its send waits for room, and meanwhile still takes poprun's commands, as a stub did.
The supervisor runs in this process over a real socket pair, poprun's end played by the test."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

from poprun_py.host import stubs
from poprun_py.host.programs import HostPrograms
from poprun_py.host.supervisor import HostSupervisor
from poprun_py.wire import protocol
from poprun_py.wire.seal import TO_HOST, TO_POPRUN, Seal

SECRET, NONCE = "a secret of this test", b"n" * protocol.NONCE_SIZE
#: More than the socket pair's buffers take: the send cannot end until poprun's end reads.
FRAME = b"x" * (4 << 20)
#: The most the test waits for what it expects (it comes at once when it comes at all).
WAIT_SECONDS = 10.0


def _wait_for(condition: object, what: str) -> None:
    deadline = time.monotonic() + WAIT_SECONDS
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"no {what} within {WAIT_SECONDS} s"
        time.sleep(0.005)


def _supervisor(tmp_path: Path) -> tuple[HostSupervisor, socket.socket, socket.socket]:
    """A host's supervisor on one end of a socket pair with small buffers, and poprun's end."""
    (tmp_path / "job").mkdir(mode=0o700)
    server = stubs.bind(str(tmp_path / "job" / "stubs"))
    mine, poprun_end = socket.socketpair()
    for end in (mine, poprun_end):
        end.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        end.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    supervisor = HostSupervisor(server, mine, Seal(SECRET, NONCE, TO_POPRUN), [b"/bin/true"],
                                HostPrograms(1, None, one_stream=False), grace=1.0, heartbeat=60.0)
    return supervisor, mine, poprun_end


def test_a_send_held_back_by_a_poprun_that_does_not_read_still_takes_its_commands(tmp_path: Path) -> None:
    supervisor, mine, poprun_end = _supervisor(tmp_path)
    sending = threading.Thread(target=supervisor.send, args=(FRAME,), daemon=True)
    try:
        sending.start()
        poprun = Seal(SECRET, NONCE, TO_HOST)
        poprun_end.sendall(poprun.seal(protocol.host_command(3, protocol.RELEASE)))
        _wait_for(lambda: 3 in supervisor.released, "RELEASE taken while the send waited")
        assert sending.is_alive() and not supervisor.gone  # the frame is still on its way
        received = bytearray()
        poprun_end.settimeout(WAIT_SECONDS)
        while len(received) < len(FRAME) + protocol.TAG_SIZE:  # poprun reads again: the send ends
            chunk = poprun_end.recv(1 << 20)
            assert chunk, "the supervisor closed its end"
            received += chunk
        sending.join(WAIT_SECONDS)
        assert not sending.is_alive() and not supervisor.gone
        assert len(received) == len(FRAME) + protocol.TAG_SIZE
        assert poprun.check(bytes(received[:len(FRAME)]), bytes(received[len(FRAME):]))  # whole, in order
    finally:
        poprun_end.close()
        sending.join(WAIT_SECONDS)
        mine.close()
        supervisor.server.close()


def test_a_poprun_that_goes_while_a_send_waits_ends_the_wait(tmp_path: Path) -> None:
    supervisor, mine, poprun_end = _supervisor(tmp_path)
    sending = threading.Thread(target=supervisor.send, args=(FRAME,), daemon=True)
    try:
        sending.start()
        poprun_end.settimeout(WAIT_SECONDS)
        assert poprun_end.recv(1, socket.MSG_PEEK)  # the frame is on its way, and cannot all go
        poprun_end.close()
        sending.join(WAIT_SECONDS)
        assert not sending.is_alive() and supervisor.gone
    finally:
        sending.join(WAIT_SECONDS)
        mine.close()
        supervisor.server.close()
