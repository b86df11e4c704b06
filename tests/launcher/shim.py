"""Running the instance shim as mpiexec would, against a real listener standing in for poprun."""

from __future__ import annotations

import socket
import subprocess
import threading

from poprun_py import environment, protocol
from poprun_py.seal import TO_SHIM, Seal, new_nonce, new_secret
from tests.helpers import PYTHON, ROOT, SUBPROCESS_TIMEOUT, run

SECRET = new_secret()


def run_shim(*argv: str, python_flags: tuple[str, ...] = ()) -> tuple[subprocess.CompletedProcess[str],
                                                                     list[tuple[int, int, bytes]]]:
    """Run the shim as mpiexec would, against a real listener standing in for poprun; return the
    shim's result and every frame it sent (RELEASE goes back once its EXIT arrives)."""
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
                    frames.extend(received)
                    if any(kind == protocol.EXIT for kind, _, _ in received):
                        connection.sendall(seal.seal(protocol.RELEASE))
                        break

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        result = run([PYTHON, *python_flags, "-S", str(ROOT / "poprun_py" / "instance.py"), "0", *argv],
                     env={environment.CONTROL: f"127.0.0.1:{port}", environment.SECRET: SECRET})
        thread.join(timeout=SUBPROCESS_TIMEOUT)
    return result, frames
