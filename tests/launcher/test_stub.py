"""The per-instance stub on its own, compiled (``_stub.c``) and its Python fallback, each against
the host supervisor's real end of their channel (``poprun_py.host.stubs``): the program byte for
byte, its pipes handed over, how it ended, the commands, signals, a supervisor gone, a stub with
nowhere to go, and nothing left behind. Real processes, real signals; no mpiexec (nothing but
the stub can stop the program here). Each stub starts in a session of its own:
a stub that signalled its own process group (a mutant of ``make mutants-stub``) hits only itself."""

from __future__ import annotations

import _socket
import errno
import os
import select
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from popcontract import compiled, environment
from poprun_py.host import stubs
from poprun_py.shared import sweep
from poprun_py.stub import SCRIPT
from poprun_py.wire import local
from tests.helpers import PYTHON, SUBPROCESS_TIMEOUT, job_marker, stat_fields, wait_no_processes, wait_until

pytestmark = pytest.mark.slow  # each starts a stub and a program

FALLBACK = Path(SCRIPT)
#: How long a test waits for one frame; nothing here takes more than a fraction of it.
FRAME_WAIT = 20.0


def _stub_command(kind: str) -> list[str]:
    if kind == "compiled":
        built = compiled.library(compiled.STUB)
        if built is None:
            why = compiled.why_missing(compiled.STUB)
            pytest.fail(f"{compiled.STUB} was not built ({why}); make install builds it")
        return [built]
    return [PYTHON, "-S", str(FALLBACK)]


KINDS = ["compiled", "fallback"]


class Supervisor:
    """The supervisor's end of one stub's connection, driven step by step by a test."""

    def __init__(self, conn: _socket.socket, peer: stubs.Peer) -> None:
        self.conn, self.peer = conn, peer
        conn.settimeout(FRAME_WAIT)
        self.reader = stubs.Reader()
        self.fds: list[int] = []

    def next(self, kind: int) -> stubs.Frame:
        frame = self.reader.next(self.conn)
        assert frame is not None, f"the stub closed its connection; {chr(kind)} was expected"
        self.fds += frame.fds
        assert chr(frame.kind) == chr(kind), frame
        return frame

    def hello(self) -> int:
        version, index = local.unpack(local.HELLO_FIELDS, self.next(local.HELLO).payload, "HELLO")
        assert version == local.VERSION
        return index

    def start(self, argv: list[bytes], env: dict[bytes, bytes | None] | None = None, grace: float = 3.0,
              flags: int = 0) -> tuple[int, list[int]]:
        """HELLO in, PROGRAM out, STARTED in: the program's PID and its pipes' read ends."""
        self.hello()
        self.conn.sendall(local.encode_program(argv, env or {}, grace, flags))
        frame = self.next(local.STARTED)
        (pid,) = local.STARTED_FIELDS.unpack(frame.payload)
        return pid, frame.fds

    def exited(self) -> tuple[int, int, int, int, int]:
        status, signum, flags, ended, stop_begun = local.EXITED_FIELDS.unpack(self.next(local.EXITED).payload)
        return status, signum, flags, ended, stop_begun

    def send(self, data: bytes) -> None:
        self.conn.sendall(data)

    def close(self) -> None:
        for fd in self.fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self.conn.close()


@contextmanager
def stub_session(kind: str, env: dict[str, str] | None = None, index: int = 0,
                 launcher: tuple[str, ...] = ()) -> Iterator[tuple[subprocess.Popen[bytes], Supervisor]]:
    """A supervisor's socket, a stub started on it (``env`` added to its environment; through
    ``launcher``, a command that starts it as its child, where given), and the stub's accepted
    connection; what was started is killed and the socket removed at the end."""
    server, path = stubs.listen()
    server.settimeout(FRAME_WAIT)
    stub = subprocess.Popen([*launcher, *_stub_command(kind), str(index)], stderr=subprocess.PIPE,
                            start_new_session=True, env={**os.environ, environment.STUB_SOCKET: path, **(env or {})})
    supervisor = None
    try:
        accepted = stubs.accept(server)
        assert accepted is not None
        supervisor = Supervisor(*accepted)
        if launcher:
            assert int(stat_fields(f"/proc/{supervisor.peer.pid}")[1]) == stub.pid
        else:
            assert supervisor.peer.pid == stub.pid
        yield stub, supervisor
    finally:
        if supervisor is not None:
            supervisor.close()
        stub.kill()
        stub.communicate(timeout=SUBPROCESS_TIMEOUT)
        server.close()
        stubs.remove(path)


def read_all(fd: int) -> bytes:
    """What a pipe gives until its end (bounded by FRAME_WAIT)."""
    chunks: list[bytes] = []
    deadline = time.monotonic() + FRAME_WAIT
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], deadline - time.monotonic())
        if not ready:
            break
        chunk = os.read(fd, 65536)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)
    raise AssertionError(f"the pipe did not end within {FRAME_WAIT} s: {b''.join(chunks)!r}")


def read_line(fd: int) -> bytes:
    """One line from a pipe, byte by byte (nothing after it is taken)."""
    line = b""
    while not line.endswith(b"\n"):
        ready, _, _ = select.select([fd], [], [], FRAME_WAIT)
        assert ready, f"no line within {FRAME_WAIT} s: {line!r}"
        byte = os.read(fd, 1)
        assert byte, f"the pipe ended inside a line: {line!r}"
        line += byte
    return line


@pytest.mark.parametrize("kind", KINDS)
def test_the_program_gets_its_arguments_and_environment_byte_for_byte_and_its_status_passes_on(kind: str) -> None:
    program = (b"import os, sys\nprint(sys.argv[1:])\n"
               b"print(os.environ.get('SET'), os.environ.get('UNSET'), os.environ.get('KEPT'))\nsys.exit(7)")
    argv = [PYTHON.encode(), b"-c", program, b"a b", b"", b"x\ny", b"\xff;$(z)"]
    with stub_session(kind, env={"UNSET": "was here", "KEPT": "kept"}) as (stub, supervisor):
        pid, (out, err) = supervisor.start(argv, {b"SET": b"v=1", b"UNSET": None})
        assert read_all(out) == b"['a b', '', 'x\\ny', '\\udcff;$(z)']\nv=1 None kept\n"
        assert read_all(err) == b""
        status, signum, flags, ended, stop_begun = supervisor.exited()
        assert (status, signum, flags, stop_begun) == (7, 0, 0, 0) and ended > 0
        supervisor.send(local.frame(local.RELEASE))
        assert stub.wait(timeout=SUBPROCESS_TIMEOUT) == 7
        assert stub.stderr is not None and stub.stderr.read() == b""
    assert pid > 0


@pytest.mark.parametrize("kind", KINDS)
def test_one_stream_keeps_the_order_of_writes_to_stdout_and_stderr(kind: str) -> None:
    program = b"import os\nfor i in range(50): os.write(1 + i % 2, b'%d ' % i)"
    with stub_session(kind) as (_, supervisor):
        _, fds = supervisor.start([PYTHON.encode(), b"-c", program], flags=local.PROGRAM_ONE_STREAM)
        assert len(fds) == 1
        assert read_all(fds[0]) == b"".join(b"%d " % i for i in range(50))
        assert supervisor.exited()[:2] == (0, 0)


@pytest.mark.parametrize("kind", KINDS)
def test_a_program_killed_by_a_signal_is_reported_with_it(kind: str) -> None:
    with stub_session(kind) as (stub, supervisor):
        supervisor.start([b"sh", b"-c", b"kill -KILL $$"])
        assert supervisor.exited()[:3] == (128 + signal.SIGKILL, signal.SIGKILL, 0)
        supervisor.send(local.frame(local.RELEASE))
        assert stub.wait(timeout=SUBPROCESS_TIMEOUT) == 128 + signal.SIGKILL


#: Says it is ready, then ignores SIGTERM (saying so): only a SIGKILL ends it.
STUBBORN = (b"import os, signal, time\n"
            b"signal.signal(signal.SIGTERM, lambda *_: os.write(1, b'got TERM\\n'))\n"
            b"os.write(1, b'ready\\n')\n"
            b"while True: time.sleep(1)\n")


@pytest.mark.parametrize("kind", KINDS)
def test_terminate_sends_sigterm_then_sigkill_after_the_grace(kind: str) -> None:
    with stub_session(kind) as (_, supervisor):
        _, (out, _) = supervisor.start([PYTHON.encode(), b"-c", STUBBORN])
        assert read_line(out) == b"ready\n"
        supervisor.send(local.terminate(0.3))
        assert read_line(out) == b"got TERM\n"
        status, signum, _, ended, stop_begun = supervisor.exited()
        assert (status, signum) == (128 + signal.SIGKILL, signal.SIGKILL)
        assert 0.3e9 <= ended - stop_begun < 15e9  # killed at the grace, not before


@pytest.mark.parametrize("kind", KINDS)
def test_stop_and_cont_stop_and_continue_the_program_and_a_stopped_one_is_reported_so(kind: str) -> None:
    program = (b"import os, sys, signal\nsignal.signal(signal.SIGTERM, lambda *_: sys.exit(5))\n"
               b"os.write(1, b'up\\n')\nwhile True: signal.pause()\n")
    with stub_session(kind) as (_, supervisor):
        pid, (out, _) = supervisor.start([PYTHON.encode(), b"-c", program])
        assert read_line(out) == b"up\n"
        supervisor.send(local.frame(local.STOP))
        wait_until(lambda: sweep.is_stopped(pid), "the program stopped")
        supervisor.send(local.frame(local.CONT))
        wait_until(lambda: not sweep.is_stopped(pid), "the program continued")
        supervisor.send(local.frame(local.STOP))
        wait_until(lambda: sweep.is_stopped(pid), "the program stopped again")
        supervisor.send(local.terminate(15))  # continued to act on SIGTERM, long before the grace
        assert supervisor.exited()[:3] == (5, 0, local.EXITED_WAS_STOPPED)


@pytest.mark.parametrize("kind", KINDS)
def test_a_signalled_stub_says_so_and_stops_its_program(kind: str) -> None:
    with stub_session(kind) as (stub, supervisor):
        _, (out, _) = supervisor.start([PYTHON.encode(), b"-c", STUBBORN], grace=0.2)
        assert read_line(out) == b"ready\n"
        stub.send_signal(signal.SIGTERM)  # mpiexec ending the job
        assert local.SIGNALLED_FIELDS.unpack(supervisor.next(local.SIGNALLED).payload) == (signal.SIGTERM,)
        assert supervisor.exited()[:2] == (128 + signal.SIGKILL, signal.SIGKILL)  # at the PROGRAM's grace
        supervisor.send(local.frame(local.RELEASE))
        assert stub.wait(timeout=SUBPROCESS_TIMEOUT) == 128 + signal.SIGKILL


@pytest.mark.parametrize("kind", KINDS)
def test_a_stub_whose_launcher_dies_says_so_and_stops_its_program(kind: str) -> None:
    # its launcher: a shell that starts it and waits (as an MPI daemon would), then is killed
    with stub_session(kind, launcher=("sh", "-c", '"$@" & wait', "sh")) as (launcher, supervisor):
        _, (out, _) = supervisor.start([PYTHON.encode(), b"-c", STUBBORN], grace=0.2)
        assert read_line(out) == b"ready\n"
        launcher.kill()
        launcher.wait(timeout=SUBPROCESS_TIMEOUT)
        lost = supervisor.next(local.LAUNCHER_LOST)
        assert local.LAUNCHER_LOST_FIELDS.unpack(lost.payload) == (launcher.pid,)
        assert supervisor.exited()[:2] == (128 + signal.SIGKILL, signal.SIGKILL)  # at its grace


@pytest.mark.parametrize("kind", KINDS)
def test_a_stub_whose_supervisor_goes_stops_its_program_and_exits(kind: str) -> None:
    with stub_session(kind) as (stub, supervisor):
        pid, (out, _) = supervisor.start([PYTHON.encode(), b"-c", STUBBORN], grace=0.2)
        assert read_line(out) == b"ready\n"
        supervisor.conn.close()  # the supervisor died: nobody reads the program's output now
        assert stub.wait(timeout=SUBPROCESS_TIMEOUT) == 128 + signal.SIGKILL
        assert sweep.has_ended(pid) or not os.path.exists(f"/proc/{pid}")


@pytest.mark.parametrize("kind", KINDS)
def test_a_program_that_cannot_start_is_reported_with_its_errno(kind: str, tmp_path: Path) -> None:
    text = tmp_path / "not-executable"
    text.write_text("#!/bin/sh\n")
    for program, code, status in ((b"/no/such/program", errno.ENOENT, 127), (bytes(text), errno.EACCES, 126)):
        with stub_session(kind) as (stub, supervisor):
            supervisor.hello()
            supervisor.send(local.encode_program([program], {}, 3.0))
            assert local.NOT_STARTED_FIELDS.unpack(supervisor.next(local.NOT_STARTED).payload) == (code,)
            supervisor.send(local.frame(local.RELEASE))
            assert stub.wait(timeout=SUBPROCESS_TIMEOUT) == status


@pytest.mark.parametrize("kind", KINDS)
def test_a_stub_with_nowhere_to_go_starts_nothing_and_says_why_in_one_line(kind: str, tmp_path: Path) -> None:
    marker = job_marker()
    command = [*_stub_command(kind), "3"]
    env = {k: v for k, v in os.environ.items() if k != environment.STUB_SOCKET}
    missing = subprocess.run(command, env=env, capture_output=True, timeout=SUBPROCESS_TIMEOUT, start_new_session=True)
    assert (missing.returncode, missing.stderr.decode()) == (1, (
        f"poprun instance 3: no {environment.STUB_SOCKET} in its environment (was it dropped by mpiexec's "
        "options?); the program was not started\n"))
    gone = tmp_path / "stubs"
    absent = subprocess.run(command, env={**env, environment.STUB_SOCKET: str(gone)}, capture_output=True,
                            start_new_session=True,
                            timeout=SUBPROCESS_TIMEOUT)
    assert (absent.returncode, absent.stderr.decode()) == (1, (
        f"poprun instance 3: cannot reach its host's supervisor at {gone} (No such file or directory); "
        "the program was not started\n"))
    assert wait_no_processes(marker) == []


@pytest.mark.parametrize("kind", KINDS)
def test_a_stub_whose_stderr_reader_has_gone_still_ends_with_its_own_status(kind: str) -> None:
    # Its one line cannot be written; SIGPIPE must not end it (nor, were one started, its program).
    read_end, write_end = os.pipe()
    os.close(read_end)
    env = {k: v for k, v in os.environ.items() if k != environment.STUB_SOCKET}
    try:
        done = subprocess.run([*_stub_command(kind), "0"], env=env, stderr=write_end, timeout=SUBPROCESS_TIMEOUT,
                              start_new_session=True)
    finally:
        os.close(write_end)
    assert done.returncode == 1


@pytest.mark.parametrize("kind", KINDS)
def test_what_the_program_left_running_is_ended_when_the_stub_exits(kind: str) -> None:
    marker = job_marker()
    # A daemon: forked twice, in a session of its own, its pipes closed; its parent exits at once.
    program = (b"import os, sys, time\n"
               b"if os.fork() == 0:\n"
               b"    os.setsid()\n"
               b"    if os.fork() == 0:\n"
               b"        os.closerange(0, 3)\n"
               b"        time.sleep(120)\n"
               b"    os._exit(0)\n"
               b"os.wait()\nprint('left one', flush=True)\n")
    with stub_session(kind, env={"POPRUN_TEST_MARKER": marker}) as (stub, supervisor):
        _, (out, _) = supervisor.start([PYTHON.encode(), b"-c", program])
        assert read_all(out) == b"left one\n"
        assert supervisor.exited()[:2] == (0, 0)
        supervisor.send(local.frame(local.RELEASE))
        assert stub.wait(timeout=SUBPROCESS_TIMEOUT) == 0
    assert wait_no_processes(marker) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root, to run a stub as another user")
@pytest.mark.parametrize("kind", KINDS)
def test_another_user_can_neither_reach_the_socket_nor_be_accepted_through_it(kind: str) -> None:
    server, path = stubs.listen()
    try:
        nobody = ["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups"]
        as_nobody = [*nobody, *_stub_command(kind), "0"]
        env = {**os.environ, environment.STUB_SOCKET: path}
        check = [*nobody, PYTHON, "-S", "-c", f"open({str(FALLBACK)!r}).close()"] if kind == "fallback" else \
            [*nobody, "test", "-x", as_nobody[len(nobody)]]
        if subprocess.run(check, capture_output=True, timeout=SUBPROCESS_TIMEOUT).returncode != 0:
            pytest.skip("user 65534 cannot run the stub from where this checkout lies")
        refused = subprocess.run(as_nobody, env=env, capture_output=True, timeout=SUBPROCESS_TIMEOUT,
                                 start_new_session=True)
        assert refused.returncode == 1 and b"(Permission denied)" in refused.stderr, refused
        os.chmod(os.path.dirname(path), 0o755)
        os.chmod(path, 0o777)  # reachable now: the credentials still keep it out
        server.settimeout(FRAME_WAIT)
        stub = subprocess.Popen(as_nobody, env=env, stderr=subprocess.PIPE, start_new_session=True)
        try:
            assert stubs.accept(server) is None
            assert stub.wait(timeout=SUBPROCESS_TIMEOUT) == 1
        finally:
            stub.kill()
            stub.communicate()
    finally:
        server.close()
        stubs.remove(path)


@pytest.mark.parametrize("kind", KINDS)
def test_the_first_stub_where_no_supervisor_listens_starts_one_and_says_why_that_one_could_not_serve(
        kind: str, tmp_path: Path) -> None:
    """A remote host's stubs look for their supervisor in the job's folder there: the first makes
    the folder and starts the supervisor (POPRUN_PYTHON). One that cannot reach poprun says so in
    one line, the stub says why it starts nothing, and nothing is left: no process, no folder."""
    job = tmp_path / "poprun-job"
    marker = job_marker()  # (in the environment the stub and its supervisor inherit)
    env = {name: value for name, value in os.environ.items() if name not in (environment.CONTROL, environment.SECRET)}
    env.update({environment.STUB_SOCKET: str(job / "start-0" / "stubs"), environment.PYTHON: PYTHON})
    result = subprocess.run([*_stub_command(kind), "2"], env=env, capture_output=True, timeout=SUBPROCESS_TIMEOUT,
                            start_new_session=True)
    assert result.returncode == 1, result.stderr
    said = result.stderr.decode().splitlines()
    assert said[0] == (f"poprun: host supervisor on {os.uname().nodename}: cannot reach poprun (no "
                       f"{environment.CONTROL} or {environment.SECRET} in its environment (was it dropped by "
                       "mpiexec's options?)); the program was not started")
    # (as the stub had connected before the supervisor gave up, or not yet)
    assert said[1:] in ([("poprun instance 2: did not receive the program from its host's supervisor; the program was "
                         "not started")],
                        [("poprun instance 2: its host's supervisor, which it started, exited before it listened (it "
                         "said why); the program was not started")]), said
    assert not job.exists()
    missing = tmp_path / "no-python"
    result = subprocess.run([*_stub_command(kind), "2"], env={**env, environment.PYTHON: str(missing)},
                            capture_output=True, timeout=SUBPROCESS_TIMEOUT, start_new_session=True)
    assert result.returncode == 1, result.stderr
    assert result.stderr.decode().splitlines() == [
        f"poprun instance 2: cannot start its host's supervisor with {missing} (No such file or directory)",
        ("poprun instance 2: its host's supervisor, which it started, exited before it listened (it said why); the "
        "program was not started")]
    assert not job.exists()
    assert wait_no_processes(marker) == []
