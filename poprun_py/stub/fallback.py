"""The stub in Python, where ``_stub.c`` was not compiled: ``python -S script.py INDEX`` does
what ``poprun-stub INDEX`` does, frame for frame (``wire.local``), and ends the same way.

It gets its program from its host's supervisor, starts it (``program.spawn``: its
own process group, killed if the stub dies), hands over its pipes, waits for it, reports how it
ended, obeys TERMINATE, STOP, CONT and RELEASE, and exits with the program's status. Built-in
modules only: it shares the cores with the program it starts.
"""

from __future__ import annotations

import _signal
import _socket
import errno
import os
import select
import struct
import sys
import time

from popcontract import environment, settings
from poprun_py.shared import sweep
from poprun_py.stub.pmi_relay import abort_status, hang_up, open_relay
from poprun_py.stub.program import NOT_STARTED, leave, spawn
from poprun_py.wire import local

#: After its report, the most a stub waits for RELEASE (as ``_stub.c``).
RELEASE_WAIT_SECONDS = 10.0
#: How long the stub keeps killing what the program left before it exits.
LEFTOVER_SECONDS = 2.0
#: The signals that stop the program when the stub receives them (mpiexec ending the job).
STOPPING = (_signal.SIGTERM, _signal.SIGINT, _signal.SIGHUP, _signal.SIGQUIT, _signal.SIGUSR1, _signal.SIGUSR2)
_NEVER = float("inf")
#: Without RELEASE, how long the stub waits, its PMI line closed, for its launcher to end the job
#: (as ``_stub.c``; ``pmi_relay.hang_up`` tells why).
LAUNCHER_NOTICE_SECONDS = 1.0


def _say(index: int, text: str) -> None:
    """One line on stderr; none where stderr's reader has gone (the stub goes on as the compiled one)."""
    try:
        os.write(2, f"poprun instance {index}: {text}\n".encode(errors="replace"))
    except OSError:
        pass


def _read(sock: _socket.socket, size: int) -> bytes | None:
    chunks, left = [], size
    while left:
        chunk = sock.recv(left)
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def read_frame(sock: _socket.socket) -> tuple[int, bytes] | None:
    """The supervisor's next frame; None when the connection ended (or the frame is too long)."""
    try:
        header = _read(sock, local.HEADER.size)
        if header is None:
            return None
        kind, size = local.HEADER.unpack(header)
        payload = _read(sock, size) if 0 < size <= local.MAX_PAYLOAD else b"" if size == 0 else None
    except OSError:
        return None
    return None if payload is None else (kind, payload)


class Stub:
    """One instance's program, as the stub knows it."""

    def __init__(self, sock: _socket.socket, grace: float) -> None:
        self.sock: _socket.socket | None = sock
        self.grace = grace
        self.pid = 0
        self.running = False
        self.status = 0
        self.signum = 0
        self.was_stopped = False
        self.ended_ns = 0
        self.stop_begun_ns = 0
        self.kill_at = _NEVER
        self.reported = False
        self.release_at = _NEVER
        #: MPICH's PMI line through the stub (``pmi_relay``), and the code of the MPI_Abort the
        #: program asked for there (None: it did not).
        self.pmi = open_relay()
        self.aborted: int | None = None
        self.hung_up = False
        self.supervisor_lost = False

    def send(self, data: bytes, fds: tuple[int, ...] = ()) -> None:
        """One frame to the supervisor; a supervisor gone is no error here (see ``lost``)."""
        if self.sock is None:
            return
        try:
            if fds:
                rights = struct.pack(f"{len(fds)}i", *fds)
                sent = self.sock.sendmsg([data], [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS, rights)])
                data = data[sent:]
            if data:
                self.sock.sendall(data)
        except OSError:
            self.lost()

    def lost(self) -> None:
        """The supervisor is gone: nobody will read the program's output; it is stopped."""
        self.supervisor_lost = True
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        self.begin_stop(self.grace)

    def begin_stop(self, grace: float) -> None:
        """SIGTERM to the program's group (and SIGCONT), SIGKILL after ``grace``."""
        if not self.running or self.stop_begun_ns:
            return
        self.stop_begun_ns = time.time_ns()
        self.was_stopped = sweep.is_stopped(self.pid)
        for sig in (_signal.SIGTERM, _signal.SIGCONT):
            _killpg(self.pid, sig)
        self.kill_at = time.monotonic() + grace

    def reap(self) -> None:
        """Collect every child that ended: the program, and the descendants the stub adopted."""
        while True:
            try:
                pid, wait_status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if pid == self.pid and self.running:
                self.running = False
                self.kill_at = _NEVER
                if self.aborted is not None:  # (its time is when it asked)
                    self.status = abort_status(self.aborted)
                    continue
                self.ended_ns = time.time_ns()
                if os.WIFSIGNALED(wait_status):
                    self.signum = os.WTERMSIG(wait_status)
                    self.status = 128 + self.signum
                else:
                    self.status = os.WEXITSTATUS(wait_status)

    def report(self) -> None:
        """EXITED: how the program ended; then the wait for RELEASE begins."""
        flags = (local.EXITED_WAS_STOPPED if self.was_stopped else 0) | \
            (local.EXITED_MPI_ABORT if self.aborted is not None else 0)
        self.send(local.exited(self.status, self.signum, flags, self.ended_ns, self.stop_begun_ns))
        self.reported, self.release_at = True, time.monotonic() + RELEASE_WAIT_SECONDS

    def obey(self, kind: int, payload: bytes) -> bool:
        """Act on a command; whether it was RELEASE of an ended program."""
        if kind == local.TERMINATE and len(payload) >= local.TERMINATE_FIELDS.size:
            (ms,) = local.TERMINATE_FIELDS.unpack_from(payload)
            self.begin_stop(_NEVER if ms == 0xFFFFFFFF else ms / 1000)
        elif kind == local.STOP and self.running:
            _killpg(self.pid, _signal.SIGSTOP)
        elif kind == local.CONT and self.running:
            _killpg(self.pid, _signal.SIGCONT)
        return kind == local.RELEASE and not self.running


    def start(self, argv: list[bytes], flags: int) -> None:
        """Start the program (``program.spawn``) and hand its pipes over (STARTED), or say why it
        could not start (NOT_STARTED: its status then 127 for a program not found, else 126)."""
        spawned = spawn(argv, no_stdin=bool(flags & local.PROGRAM_NO_STDIN),
                        one_stream=bool(flags & local.PROGRAM_ONE_STREAM), pmi=self.pmi)
        if isinstance(spawned, OSError):
            if self.pmi is not None:
                self.pmi.close()
                self.pmi = None
            code = spawned.errno or errno.EIO
            self.send(local.frame(local.NOT_STARTED, local.NOT_STARTED_FIELDS.pack(code)))
            self.status = 127 if code == errno.ENOENT else 126
            self.reported, self.release_at = True, time.monotonic() + RELEASE_WAIT_SECONDS
            return
        self.pid, out, err = spawned
        self.running = True
        pipes = (out,) if err is None else (out, err)
        self.send(local.frame(local.STARTED, local.STARTED_FIELDS.pack(self.pid)), pipes)
        for fd in (out, err):
            if fd is not None:
                os.close(fd)

    def loop(self, wake: int, noted: list[int]) -> None:
        """Until the program has ended, been reported, and RELEASE came (or the wait for it ended,
        or the supervisor went): its end collected, the kill after the grace sent, signals (noted
        by their handlers, ``wake`` readable) and commands obeyed."""
        poll = select.poll()
        poll.register(wake, select.POLLIN)
        if self.sock is not None:
            poll.register(self.sock.fileno(), select.POLLIN)
        # The process that started the stub (its host's MPI daemon, or mpiexec): when it dies, the
        # MPI job on this host is broken, and the program is stopped at once.
        launcher = os.getppid()
        try:
            launcher_fd: int | None = os.pidfd_open(launcher) if launcher > 1 else None
        except OSError:
            launcher_fd = None
        if launcher_fd is not None:
            poll.register(launcher_fd, select.POLLIN)
        if self.pmi is not None:
            poll.register(self.pmi.shim_end, select.POLLIN)
            poll.register(self.pmi.launcher, select.POLLIN)
        while True:
            self.reap()
            if not self.running and not self.reported:
                self.report()
                self._close_relay(poll)
            now = time.monotonic()
            # (a release_at of 0: RELEASE came, or a signal asked it to leave)
            if self.reported and self.sock is not None and now >= self.release_at > 0 and not self.hung_up:
                self._hang_up_on_the_launcher()
                now = time.monotonic()
            if self.reported and (self.sock is None or now >= self.release_at):
                return
            if now >= self.kill_at:
                _killpg(self.pid, _signal.SIGKILL)
                self.kill_at = _NEVER
            until = min(self.kill_at, self.release_at)
            for fd, _ in poll.poll(None if until == _NEVER else max(0, int((until - now) * 1000) + 1)):
                if fd == launcher_fd:
                    poll.unregister(fd)
                    if self.running and not self.stop_begun_ns:
                        self.send(local.frame(local.LAUNCHER_LOST, local.LAUNCHER_LOST_FIELDS.pack(launcher)))
                        self.begin_stop(self.grace)
                elif self._relay(fd, poll):
                    pass
                elif fd == wake:
                    _drain(wake)
                    self.signalled([signum for signum in noted if signum != _signal.SIGCHLD])
                    noted.clear()
                elif self.sock is not None:
                    command = read_frame(self.sock)
                    if command is None:
                        poll.unregister(fd)
                        self.lost()
                    elif self.obey(*command):
                        self.release_at = 0.0

    def _relay(self, fd: int, poll: select.poll) -> bool:
        """Whether ``fd`` is an end of the PMI relay (and what came on it has been passed on)."""
        if self.pmi is None:
            return False
        if fd == self.pmi.shim_end.fileno():
            self._hear_program_on_pmi(poll)
        elif fd == self.pmi.launcher:
            if not self.pmi.from_launcher():
                poll.unregister(fd)
        else:
            return False
        return True

    def _hear_program_on_pmi(self, poll: select.poll) -> None:
        """What the program sent on its PMI line, passed on but an MPI_Abort: the program is
        killed (as the launchers end an aborted job), and its exit is the abort's."""
        assert self.pmi is not None
        code = self.pmi.from_program()
        if not self.pmi.program_open:
            poll.unregister(self.pmi.shim_end)
        if code is None or self.aborted is not None or not self.running or self.stop_begun_ns:
            return  # (an abort asked once the stop had begun is the stop's)
        self.aborted = code
        self.ended_ns = time.time_ns()
        _killpg(self.pid, _signal.SIGKILL)

    def _close_relay(self, poll: select.poll) -> None:
        """The program has ended: its end of the PMI line is gone (the launcher's stays the stub's)."""
        if self.pmi is None:
            return
        for fd in (self.pmi.shim_end.fileno(), self.pmi.launcher):
            try:
                poll.unregister(fd)
            except KeyError:
                pass
        self.pmi.close()
        self.pmi = None

    def _hang_up_on_the_launcher(self) -> None:
        """No RELEASE came: other instances still run. The PMI line is closed first, and the
        launcher given LAUNCHER_NOTICE_SECONDS to end the job (``pmi_relay.hang_up`` tells why)."""
        self.hung_up = True
        if not hang_up():
            return
        self.release_at = time.monotonic() + LAUNCHER_NOTICE_SECONDS

    def signalled(self, signals: list[int]) -> None:
        """The stub was signalled (its launcher ending the job, or by hand): the program is stopped,
        and the supervisor told; once it has been reported, the stub leaves."""
        for signum in signals:
            if self.running and not self.stop_begun_ns:
                self.send(local.frame(local.SIGNALLED, local.SIGNALLED_FIELDS.pack(signum)))
                self.begin_stop(self.grace)
            elif not self.running:
                self.release_at = 0.0


def _drain(fd: int) -> None:
    while True:
        try:
            if not os.read(fd, 64):
                return
        except BlockingIOError:
            return


def _killpg(pgid: int, sig: int) -> None:
    """``sig`` to the program's group; never to 0 or 1 (the stub's own group, init's: no program)."""
    if pgid <= 1:
        return
    try:
        os.killpg(pgid, sig)
    except OSError:
        pass


def end_leftovers(pid: int, spare: int = 0) -> None:
    """SIGKILL what is left of the program's group and every descendant of the stub (it is their
    subreaper) but ``spare`` (the host's supervisor it started), until none is left or
    LEFTOVER_SECONDS have passed."""
    if pid > 0:
        _killpg(pid, _signal.SIGKILL)
    deadline = time.monotonic() + LEFTOVER_SECONDS
    me = os.getpid()
    while True:
        sweep.reap_adopted()
        children = [child for child in sweep.descendants(me) if child != spare]  # (no /proc read without children)
        for child in children:
            try:
                os.kill(child, _signal.SIGKILL)
            except OSError:
                pass
        if not children or time.monotonic() >= deadline:
            return
        time.sleep(0.001)


def remove_what_the_supervisor_left(socket_path: str) -> None:
    """The supervisor died (one that ends removes these itself): what it made on this host for the
    job goes with its stubs, so that nothing is left behind: the socket and its private folder,
    this instance's error file and, once empty, the job's folder it is in."""
    from poprun_py.shared import root_cause

    root_cause.remove(socket_path, folders=1)
    if error_file := settings.text(environment.TORCHELASTIC_ERROR_FILE):
        root_cause.remove(error_file, folders=1)


#: How long a stub waits for its host's supervisor, started by it or another stub, to listen.
SUPERVISOR_START_SECONDS = 30.0
#: The host's supervisor this stub started (``end_leftovers`` spares it); 0: none.
supervisor = 0


def _connect(path: str) -> _socket.socket:
    sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    try:
        sock.connect(path)
    except OSError:
        sock.close()
        raise
    return sock


def reach_supervisor(path: str) -> _socket.socket:
    """The connection to this host's supervisor at ``path`` (as ``_stub.c``'s reach_supervisor: on
    poprun's own host poprun listens there; on another host the first stub of the job to make the
    socket's folder starts the supervisor, and every stub waits for it to listen); OSError."""
    global supervisor
    try:
        return _connect(path)
    except (FileNotFoundError, ConnectionRefusedError):
        python = settings.text(environment.PYTHON)
        if not python:
            raise
    from poprun_py.shared.paths import private_folder

    folder = os.path.dirname(path)
    job = os.path.dirname(folder)
    try:
        os.mkdir(job, 0o700)
    except FileExistsError:
        pass
    if not private_folder(job):
        raise PermissionError(f"{job} is not a private folder of this user")
    try:
        os.mkdir(folder, 0o700)
    except FileExistsError:
        if not private_folder(folder):
            raise PermissionError(f"{folder} is not a private folder of this user") from None
    else:
        from poprun_py.host import SCRIPT

        try:
            supervisor = os.posix_spawn(python, [python, "-S", SCRIPT], os.environ,
                                        file_actions=[(os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0)])
        except OSError as exc:  # as _stub.c's child says it
            _say(int(sys.argv[1]), f"cannot start its host's supervisor with {python} ({exc.strerror or exc})")
            _remove_folders(folder, job)
            raise ChildProcessError(path) from None
    deadline = time.monotonic() + SUPERVISOR_START_SECONDS
    while True:
        try:
            return _connect(path)
        except (FileNotFoundError, ConnectionRefusedError):
            pass
        if supervisor and os.waitpid(supervisor, os.WNOHANG)[0]:
            supervisor = 0  # it said why; what it did not remove goes, if empty
            _remove_folders(folder, job)
            raise ChildProcessError(path)
        if time.monotonic() >= deadline:
            raise TimeoutError(f"its host's supervisor did not listen within {SUPERVISOR_START_SECONDS:g} s")
        time.sleep(0.002)


def _remove_folders(*folders: str) -> None:
    for folder in folders:
        try:
            os.rmdir(folder)
        except OSError:
            pass


def receive_program(index: int) -> tuple[_socket.socket, int, float, list[bytes]] | None:
    """Connect to this host's supervisor, say HELLO, take the PROGRAM (its changes of the
    environment made here): the connection, the PROGRAM's flags, grace and arguments. None, said
    in one line, when any of it fails: nothing is started."""
    path = settings.text(environment.STUB_SOCKET)
    if not path:
        _say(index, f"no {environment.STUB_SOCKET} in its environment (was it dropped by mpiexec's options?); "
                    "the program was not started")
        return None
    try:
        sock = reach_supervisor(path)
    except ChildProcessError:
        _say(index, "its host's supervisor, which it started, exited before it listened (it said why); "
                    "the program was not started")
        return None
    except OSError as exc:
        _say(index, f"cannot reach its host's supervisor at {path} ({exc.strerror or exc}); "
                    "the program was not started")
        return None
    try:
        sock.sendall(local.frame(local.HELLO, local.HELLO_FIELDS.pack(local.VERSION, index)))
        received = read_frame(sock)
        if received is None or received[0] != local.PROGRAM:
            raise local.LocalProtocolError("no PROGRAM")
        flags, grace, argv, changes = local.decode_program(received[1])
    except (OSError, local.LocalProtocolError):
        sock.close()
        _say(index, "did not receive the program from its host's supervisor; the program was not started")
        return None
    for name, value in changes.items():
        if value is None:
            os.environb.pop(name, None)
        else:
            os.environb[name] = value
    return sock, flags, grace, argv


def main() -> int:
    try:
        index = int(sys.argv[1]) if len(sys.argv) == 2 else -1
    except ValueError:
        index = -1
    if index < 0:
        _say(-1, "usage: poprun-stub INDEX (mpiexec starts it for poprun)")
        return 2
    socket_path = settings.text(environment.STUB_SOCKET)  # (PROGRAM takes it out of the environment)
    received = receive_program(index)
    if received is None:
        return NOT_STARTED
    sock, flags, grace, argv = received
    wake_read, wake_write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    _signal.set_wakeup_fd(wake_write)
    noted: list[int] = []
    for sig in (*STOPPING, _signal.SIGCHLD):
        _signal.signal(sig, lambda signum, _frame: noted.append(signum))
    sweep.adopt_orphans()
    stub = Stub(sock, grace)
    stub.start(argv, flags)
    stub.loop(wake_read, noted)
    end_leftovers(stub.pid, supervisor)
    if stub.supervisor_lost:
        remove_what_the_supervisor_left(socket_path)
    return leave(stub.status)
