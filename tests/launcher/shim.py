"""Running the instance shim as mpiexec would, against a real listener standing in for poprun."""

from __future__ import annotations

import os
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from popcontract import environment
from poprun_py.instance import SCRIPT
from poprun_py.wire import protocol
from poprun_py.wire.seal import TO_SHIM, Seal, new_nonce, new_secret
from tests.helpers import PYTHON, SUBPROCESS_TIMEOUT, run

SECRET = new_secret()


def program_message(seal: Seal, argv: tuple[str, ...]) -> bytes:
    """What poprun answers a HELLO with: the program, sealed."""
    return seal.seal(protocol.encode_program([os.fsencode(arg) for arg in argv]))


def run_shim(*argv: str, python_flags: tuple[str, ...] = (), env: dict[str, str] | None = None,
             ) -> tuple[subprocess.CompletedProcess[str], list[tuple[int, int, bytes]]]:
    """Run the shim as mpiexec would, against a real listener standing in for poprun that sends it
    ``argv`` in answer to its HELLO; return the shim's result and every frame it sent (RELEASE goes
    back once its EXIT arrives)."""
    frames: list[tuple[int, int, bytes]] = []
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]

        def serve() -> None:
            connection, _ = server.accept()
            with connection:
                nonce = new_nonce()
                connection.sendall(nonce)
                seal = Seal(SECRET, nonce, TO_SHIM)
                reader = protocol.FrameReader(seal)
                while data := connection.recv(65536):
                    received = reader.feed(data)
                    if received and not frames and received[0][0] == protocol.HELLO:
                        connection.sendall(program_message(seal, argv))
                    frames.extend(received)
                    if any(kind == protocol.EXIT for kind, _, _ in received):
                        connection.sendall(seal.seal(protocol.RELEASE))
                        break

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        result = run([PYTHON, *python_flags, "-S", SCRIPT, "0"],
                     env={environment.CONTROL: f"127.0.0.1:{port}", environment.SECRET: SECRET, **(env or {})})
        thread.join(timeout=SUBPROCESS_TIMEOUT)
    return result, frames


class Poprun:
    """poprun's end of one shim's control connection, driven step by step by a test: it sends
    ``argv`` in answer to the shim's HELLO, as poprun does (None: the test answers itself)."""

    def __init__(self, connection: socket.socket, argv: tuple[str, ...] | None) -> None:
        self.connection = connection
        nonce = new_nonce()
        connection.sendall(nonce)
        self.seal = Seal(SECRET, nonce, TO_SHIM)
        self.reader = protocol.FrameReader(self.seal)
        self.frames: list[tuple[int, int, bytes]] = []
        if argv is not None:
            self.until(lambda frame: frame[0] == protocol.HELLO)
            connection.sendall(program_message(self.seal, argv))

    def until(self, wanted: Callable[[tuple[int, int, bytes]], bool],
              within: float = SUBPROCESS_TIMEOUT) -> tuple[int, int, bytes]:
        """The first frame (from those received so far, then new ones) that ``wanted`` accepts,
        within ``within`` seconds (heartbeats keep coming meanwhile)."""
        deadline = time.monotonic() + within
        seen = 0
        while True:
            for frame in self.frames[seen:]:
                if wanted(frame):
                    return frame
            seen = len(self.frames)
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no such frame within {within} s; the shim sent {self.frames}")
            self.connection.settimeout(left)
            data = self.connection.recv(65536)
            assert data, f"the shim closed its connection; it sent {self.frames}"
            self.frames.extend(self.reader.feed(data))

    def output(self, text: bytes) -> None:
        """Wait for the program to have written ``text`` (on either stream)."""
        self.until(lambda _: text in b"".join(p for kind, _, p in self.frames if kind == protocol.OUTPUT))

    def exit_report(self, within: float = SUBPROCESS_TIMEOUT) -> tuple[int, int | None, str | None, int]:
        _, _, payload = self.until(lambda frame: frame[0] == protocol.EXIT, within)
        return protocol.read_exit(payload)

    def send(self, command: bytes) -> None:
        self.connection.sendall(self.seal.seal(command))


@contextmanager
def shim_session(*argv: str, env: dict[str, str] | None = None,
                 pass_fds: tuple[int, ...] = ()) -> Iterator[tuple[subprocess.Popen[str], Poprun]]:
    """The shim of instance 0 running ``argv`` as mpiexec would start it (``pass_fds``: descriptors
    mpiexec gives it), and the poprun end of its connection (every receive bounded by
    SUBPROCESS_TIMEOUT); the shim is killed if still running."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        server.settimeout(SUBPROCESS_TIMEOUT)
        port = server.getsockname()[1]
        shim = subprocess.Popen([PYTHON, "-S", SCRIPT, "0"],
                                env={**os.environ, environment.CONTROL: f"127.0.0.1:{port}",
                                     environment.SECRET: SECRET, **(env or {})},
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                pass_fds=pass_fds)
        try:
            connection, _ = server.accept()
            with connection:
                connection.settimeout(SUBPROCESS_TIMEOUT)
                yield shim, Poprun(connection, argv)
        finally:
            if shim.poll() is None:
                shim.kill()
            shim.communicate(timeout=SUBPROCESS_TIMEOUT)
