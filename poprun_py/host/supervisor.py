"""A remote host's supervisor: one process per host of a job, started by the first of the host's
stubs (``python -S poprun_py/host/script.py``), which holds the host's one connection to poprun
and supervises every instance of the host, as poprun does its own host's (``host.instance``).

It listens on the stubs' socket (``POPRUN_STUB_SOCKET``, in the job's private folder on this
host), connects to poprun (``POPRUN_CONTROL``; every frame sealed with the run's secret,
``POPRUN_SECRET``), says HOST_HELLO and its clock, and takes the program. Then each
stub that says HELLO gets the program and this host's changes of its environment; what its
instance does reaches poprun as INSTANCE frames, and poprun's commands, each for one instance,
reach its stub. It ends once every stub it served was released and has gone, or when poprun goes
(its stubs then stop their programs, their supervisor gone); it removes its socket and folder.

A send waits while poprun does not read (back-pressure: the programs then wait on their pipes),
reading poprun's commands meanwhile; poprun gone is its connection's end, or its host leaving what
was sent unacknowledged for the silence limit (``POPRUN_SILENCE_LIMIT``, through TCP_USER_TIMEOUT).
"""

from __future__ import annotations

import _socket
import os
import select
import sys
import time

from popcontract import environment, settings
from poprun_py.host import stubs
from poprun_py.host.instance import StubbedInstance
from poprun_py.host.programs import HostPrograms
from poprun_py.shared.watch import Watch
from poprun_py.wire import local, protocol

TYPE_CHECKING = False  # typing.TYPE_CHECKING, without importing typing under python -S
if TYPE_CHECKING:
    from poprun_py.wire.seal import Seal

#: The most read of poprun's commands at once.
COMMANDS_READ_SIZE = 4096
#: The loop's longest wait: how soon it looks again at the stubs' deadlines and the heartbeat.
TICK_SECONDS = 0.1
#: The status of a supervisor that could not serve its host (its stubs say why they start nothing).
FAILED = 1


def say(text: str) -> None:
    try:
        os.write(2, f"poprun: host supervisor on {os.uname().nodename}: {text}\n".encode(errors="replace"))
    except OSError:
        pass


class HostSupervisor:
    """``server``: the stubs' listening socket; ``conn`` and ``seal``: poprun's connection;
    ``argv``: the program; ``programs``: what each stub is told besides it."""

    def __init__(self, server: _socket.socket, conn: _socket.socket, seal: Seal, argv: list[bytes],
                 programs: HostPrograms, grace: float, heartbeat: float) -> None:
        self.server = server
        self.conn = conn
        self.seal = seal
        self.commands = protocol.CommandReader(seal, protocol.HOST_COMMAND_SIZE)
        self.argv = argv
        self.programs = programs
        self.grace = grace
        self.heartbeat = heartbeat
        self.watch = Watch()
        self.pending: dict[_socket.socket, stubs.Reader] = {}
        self.stubs: dict[int, StubbedInstance] = {}
        self.released: set[int] = set()
        self.gone = False  # poprun
        self.served = 0
        self.last_sent = time.monotonic()

    def send(self, data: bytes) -> None:
        """One frame to poprun, sealed, whole, however long poprun takes to read it; dropped once
        poprun is gone. While poprun does not read (back-pressure: its output paused, Ctrl-S, a
        debugger), the wait for room still reads its commands, so that STOP, CONT and TERMINATE
        reach the stubs as they come (Ctrl-Z stops the programs of every host even then)."""
        left = memoryview(self.seal.seal(data))
        room: select.poll | None = None
        while left and not self.gone:
            try:
                left = left[self.conn.send(left, _socket.MSG_DONTWAIT):]
                continue
            except BlockingIOError:
                pass
            except OSError:
                self._lose_poprun()
                break
            if room is None:
                room = select.poll()
                room.register(self.conn, select.POLLOUT | select.POLLIN)
            for _, events in room.poll(int(TICK_SECONDS * 1000)):
                if events & select.POLLIN:
                    self._from_poprun()
        self.last_sent = time.monotonic()

    def run(self) -> int:
        self.watch.add(self.server, ("listen", None))
        self.watch.add(self.conn, ("poprun", None))
        next_tick = 0.0
        while not self._over():
            now = time.monotonic()
            if now >= next_tick:  # (deadlines, looked at every tick, not at every turn)
                next_tick = now + TICK_SECONDS
                for stub in self.stubs.values():
                    if stub.waiting:
                        stub.tick(now)
            if not self.gone and now - self.last_sent >= self.heartbeat:
                self.send(protocol.HEARTBEAT_FRAME)
            for fd, (kind, data) in self.watch.ready(TICK_SECONDS):
                self._ready(fd, kind, data)
        for conn, reader in self.pending.items():
            reader.close()
            conn.close()
        for stub in self.stubs.values():
            stub.close_pipes()
            stub.conn.close()
        return 0

    def _over(self) -> bool:
        """poprun is gone (every stub has been told, by its connection's end), or every stub served
        was released and has gone."""
        if self.gone:
            return not self.stubs
        return self.served > 0 and not self.stubs and not self.pending and bool(self.released)

    def _ready(self, fd: int, kind: str, data: object) -> None:
        if kind == "listen":
            self._accept()
        elif kind == "hello":
            assert isinstance(data, _socket.socket)
            self._hello(data)
        elif kind == "stub":
            assert isinstance(data, int)
            self._from_stub(data)
        elif kind == "pipe":
            assert isinstance(data, tuple)
            index, pipe = data
            stub = self.stubs.get(index)
            if stub is not None and pipe in stub.pipes and not stub.read(pipe):
                self.watch.remove(pipe)
                stub.pipe_ended(pipe)
        elif kind == "poprun":
            self._from_poprun()

    def _accept(self) -> None:
        try:
            accepted = stubs.accept(self.server)
        except OSError:
            return
        if accepted is None:
            return
        conn = accepted[0]
        conn.setblocking(False)
        self.pending[conn] = stubs.Reader()
        self.watch.add(conn, ("hello", conn))

    def _hello(self, conn: _socket.socket) -> None:
        reader = self.pending[conn]
        try:
            frames = reader.frames(conn)
            if frames == []:
                return
            del self.pending[conn]
            self.watch.remove(conn)
            if frames is None:
                conn.close()
                return
            index = stubs.hello_index(frames)
            if index in self.stubs or self.gone:
                raise local.LocalProtocolError(f"instance {index} is not expected or already connected")
        except (OSError, local.LocalProtocolError) as exc:
            say(f"refused a stub: {exc}")
            self.pending.pop(conn, None)
            self.watch.remove(conn)
            reader.close()
            conn.close()
            return
        env, error_file = self.programs.environment(index, os.environ)
        stub = StubbedInstance(index, conn, reader, lambda frame: self.send(protocol.instance(index, frame)),
                               grace=self.grace, error_file=error_file, program=self.argv[0])
        self.stubs[index] = stub
        self.served += 1
        self.send(protocol.instance(index, protocol.frame(protocol.STUB_HELLO,
                                                          protocol.STUB_HELLO_FIELDS.pack(stubs.peer(conn).pid))))
        self.watch.add(conn, ("stub", index))
        if not stub.start(self.argv, env, self.programs.flags(index)):
            self._stub_gone(index)

    def _from_stub(self, index: int) -> None:
        stub = self.stubs[index]
        try:
            frames = stub.reader.frames(stub.conn)
            for frame in frames or []:
                for fd in stub.frame(frame):
                    self.watch.add(fd, ("pipe", (index, fd)))
        except (OSError, local.LocalProtocolError) as exc:
            say(f"instance {index}: dropped its stub's connection: {exc}")
            frames = None
        if frames is None:
            self._stub_gone(index)

    def _stub_gone(self, index: int) -> None:
        """A stub's connection ended: what its pipes held is passed on; an instance without an exit
        report was lost (STUB_LOST), which poprun then says."""
        stub = self.stubs.pop(index)
        for fd in stub.pipes:
            self.watch.remove(fd)
        self.watch.remove(stub.conn)
        stub.lost()
        if stub.exit is not None and not stub.reported:
            stub.tick(float("inf"))  # its report, with what its pipes held
        if not stub.reported:
            self.send(protocol.instance(index, protocol.frame(protocol.STUB_LOST, b"")))
        stub.conn.close()

    def _from_poprun(self) -> None:
        try:
            data = self.conn.recv(COMMANDS_READ_SIZE)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._lose_poprun()
            return
        try:
            commands = self.commands.feed(data)
        except protocol.ProtocolError as exc:
            say(f"{exc} on poprun's connection; stopping every instance")
            self._lose_poprun()
            return
        for command in commands:
            index = protocol.INSTANCE_FIELDS.unpack_from(command, 1)[0]
            stub = self.stubs.get(index)
            if command[:1] == protocol.RELEASE:
                self.released.add(index)
            if stub is not None:
                stub.command(command[:1])

    def _lose_poprun(self) -> None:
        """poprun is gone: each stub is told by its connection's end, and stops its program."""
        if self.gone:
            return
        self.gone = True
        self.watch.remove(self.conn)
        for index in list(self.stubs):
            self._stub_gone(index)


def connect(limit: float) -> tuple[_socket.socket, Seal, list[bytes]] | None:
    """poprun's connection, its seal, and the program, after HOST_HELLO and CLOCK; None, said on
    stderr, when poprun cannot be reached or does not send the program."""
    from poprun_py.host.link import connect_to_poprun, receive_program

    secret = settings.text(environment.SECRET)
    who = f"poprun: host supervisor on {os.uname().nodename}"
    connection = connect_to_poprun(secret, limit, who)
    if connection is None:
        return None
    control, seal, arrived = connection
    argv = receive_program(control, seal, arrived, protocol.host_hello(os.getpid(), _socket.gethostname()), who)
    if argv is None:
        control.close()
        return None
    return control, seal, argv


def main() -> int:
    """Serve this host's stubs: ``POPRUN_STUB_SOCKET`` names the socket, in a folder the starting
    stub made; removed at the end."""
    path = settings.text(environment.STUB_SOCKET)
    # A process group of its own: the launcher's end of one instance (a signal to the process group
    # of the stub that started it) is not the end of the host's supervision.
    os.setpgid(0, 0)
    from poprun_py.host.link import kill_grace, silence_limit

    limit = silence_limit()
    server = None
    try:
        try:
            server = stubs.bind(path)
        except OSError as exc:
            say(f"cannot listen at {path}: {exc.strerror or exc}")
            return FAILED
        connected = connect(limit)
        if connected is None:
            return FAILED
        conn, seal, argv = connected
        if hasattr(_socket, "TCP_USER_TIMEOUT") and limit != float("inf"):  # poprun's host gone: sends fail
            conn.setsockopt(_socket.IPPROTO_TCP, _socket.TCP_USER_TIMEOUT, int(limit * 1000))
        conn.setblocking(True)  # (sends wait for room: back-pressure)
        server.setblocking(False)
        supervisor = HostSupervisor(server, conn, seal, argv, HostPrograms.from_environment(os.environ),
                                    kill_grace(), protocol.heartbeat_seconds(limit))
        return supervisor.run()
    finally:
        if server is not None:
            server.close()
        stubs.remove(path)
        job = os.path.dirname(os.path.dirname(path))
        try:
            os.rmdir(job)  # the job's folder on this host, once nothing else of it is left there
        except OSError:
            pass


if __name__ == "__main__":
    sys.exit(main())
