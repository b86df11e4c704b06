"""The shim's side of the control connection on its own: what it does with poprun's commands, with
signals, and after its exit report, against a real listener standing in for poprun (no mpiexec,
so nothing but the shim can stop the program)."""

from __future__ import annotations

import errno
import os
import re
import select
import signal
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from popcontract import environment
from poprun_py.host.link import read_nonce
from poprun_py.instance import SCRIPT
from poprun_py.instance.shim import divide_cores
from poprun_py.instance.shim_pump import RELEASE_WAIT_SECONDS
from poprun_py.shared import sweep
from poprun_py.shared.cores import threads_per_instance
from poprun_py.stub.program import NOT_STARTED, spawn
from poprun_py.wire import protocol
from poprun_py.wire.seal import TO_SHIM, Seal, new_nonce, new_secret
from tests.helpers import PYTHON, SUBPROCESS_TIMEOUT, run, wait_until
from tests.launcher.job_shell import held_back, states
from tests.launcher.shim import SECRET, Poprun, run_shim, shim_session

SHIM_ENTRY = Path(SCRIPT)

#: A program that reports SIGTERM and carries on, so that only a SIGKILL ends it.
STUBBORN = ("import os, signal, time\n"
            "signal.signal(signal.SIGTERM, lambda *_: os.write(1, b'got TERM\\n'))\n"
            "os.write(1, b'ready\\n')\n"
            "while True: time.sleep(1)\n")
GRACE = {environment.KILL_GRACE: "0.2"}


@pytest.mark.slow  # starts a shim
def test_terminate_stops_the_program_and_the_shim_kills_it_after_the_grace() -> None:
    with shim_session(PYTHON, "-c", STUBBORN, env=GRACE) as (_, poprun):
        poprun.output(b"ready")
        poprun.send(protocol.TERMINATE)
        poprun.output(b"got TERM")
        # Killed at the 0.2 s grace, or never; told by poprun, not signalled: no flag.
        assert poprun.exit_report(within=10) == (128 + signal.SIGKILL, signal.SIGKILL, None, 0)


@pytest.mark.slow  # starts a shim
def test_terminate_continues_a_stopped_program_so_that_it_acts_on_sigterm_and_says_it_was_stopped() -> None:
    program = ("import os, signal, sys\n"
               "signal.signal(signal.SIGTERM, lambda *_: (os.write(1, b'got TERM\\n'), sys.exit(5)))\n"
               "os.write(1, b'stopping\\n')\nos.kill(os.getpid(), signal.SIGSTOP)\n"
               "while True: signal.pause()\n")
    with shim_session(PYTHON, "-c", program, env={environment.KILL_GRACE: "15"}) as (shim, poprun):
        poprun.output(b"stopping")
        (program_pid,) = sweep.descendants(shim.pid)
        deadline = time.monotonic() + 10
        while not sweep.is_stopped(program_pid):  # it said so just before its SIGSTOP
            assert time.monotonic() < deadline, "the program never stopped"
            time.sleep(0.01)
        poprun.send(protocol.TERMINATE)
        poprun.output(b"got TERM")  # continued: its handler ran long before the 15 s grace
        assert poprun.exit_report(within=10) == (5, None, None, protocol.EXIT_WAS_STOPPED)


@pytest.mark.slow  # starts a shim
def test_a_signal_after_terminate_does_not_count_as_the_shim_being_signalled() -> None:
    with shim_session(PYTHON, "-c", STUBBORN, env=GRACE) as (shim, poprun):
        poprun.output(b"ready")
        poprun.send(protocol.TERMINATE)
        poprun.output(b"got TERM")
        shim.send_signal(signal.SIGTERM)  # mpiexec ending the job poprun had already stopped
        assert poprun.exit_report()[3] == 0
        # The program was told once (and killed at the first grace, not one moved by the signal).
        said = b"".join(payload for kind, _, payload in poprun.frames if kind == protocol.OUTPUT)
        assert said.count(b"got TERM") == 1, said


@pytest.mark.slow  # starts a shim
def test_a_signal_to_the_shim_alone_stops_the_program_and_says_so() -> None:
    with shim_session(PYTHON, "-c", STUBBORN, env=GRACE) as (shim, poprun):
        poprun.output(b"ready")
        shim.send_signal(signal.SIGTERM)
        poprun.output(b"got TERM")
        assert poprun.exit_report() == (128 + signal.SIGKILL, signal.SIGKILL, None, protocol.EXIT_SHIM_SIGNALLED)


@pytest.mark.slow  # starts a shim
def test_after_its_exit_report_the_shim_waits_for_release() -> None:
    with shim_session(PYTHON, "-c", "print('done')") as (shim, poprun):
        assert poprun.exit_report() == (0, None, None, 0)
        # Still connected, idle: its wait lasts RELEASE_WAIT_SECONDS (10 s), this check one.
        poprun.connection.settimeout(1.0)
        try:
            left = poprun.connection.recv(1) == b""
        except TimeoutError:
            left = False
        assert not left and shim.poll() is None, "the shim left before RELEASE"
        poprun.connection.settimeout(30)
        poprun.send(protocol.RELEASE)
        assert poprun.connection.recv(1) == b""  # released: it exits
        assert shim.wait(timeout=30) == 0


@pytest.mark.slow  # starts a shim
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP], ids=["TERM", "INT", "HUP"])
def test_a_signal_after_the_exit_report_ends_the_wait_for_release(sig: int) -> None:
    """mpiexec ending the job's processes: the shim leaves at once, its status its program's. The
    signal comes after the exit report has reached poprun, which the shim sends once a signal
    can end its wait, so the wait may or may not have begun."""
    with shim_session(PYTHON, "-c", "import sys; sys.exit(4)") as (shim, poprun):
        assert poprun.exit_report() == (4, None, None, 0)
        shim.send_signal(sig)
        _, err = shim.communicate(timeout=RELEASE_WAIT_SECONDS / 2)  # not the wait's whole 10 s
    assert (shim.returncode, err) == (4, "")


@pytest.mark.slow  # starts a shim
def test_poprun_gone_during_the_wait_for_release_ends_it() -> None:
    with shim_session(PYTHON, "-c", "import sys; sys.exit(4)") as (shim, poprun):
        assert poprun.exit_report() == (4, None, None, 0)
        poprun.connection.close()  # poprun's end of the connection: the shim reads its end
        _, err = shim.communicate(timeout=RELEASE_WAIT_SECONDS / 2)  # not the wait's whole 10 s
    assert (shim.returncode, err) == (4, "")


@pytest.mark.slow  # starts a shim
def test_signals_after_release_do_not_change_the_shim_s_status() -> None:
    """mpiexec ends the processes of a job whose instances left without MPI_Finalize, so a shim
    may be signalled while it leaves: its status stays its program's, with nothing said."""
    with shim_session(PYTHON, "-c", "print('done')") as (shim, poprun):
        assert poprun.exit_report() == (0, None, None, 0)
        poprun.send(protocol.RELEASE)
        sent = 0
        while shim.poll() is None:  # SIGTERM after SIGTERM, from the RELEASE until the shim is gone
            try:
                os.kill(shim.pid, signal.SIGTERM)
            except ProcessLookupError:
                break
            sent += 1
        _, err = shim.communicate(timeout=30)
    assert (shim.returncode, err) == (0, ""), sent


@pytest.mark.slow  # starts a shim
def test_a_command_that_fails_its_check_stops_the_program_and_is_named() -> None:
    with shim_session(PYTHON, "-c", STUBBORN, env=GRACE) as (shim, poprun):
        poprun.output(b"ready")
        poprun.connection.sendall(protocol.RELEASE + bytes(protocol.TAG_SIZE))  # not sealed
        poprun.output(b"got TERM")
        assert poprun.exit_report()[:2] == (128 + signal.SIGKILL, signal.SIGKILL)
        poprun.send(protocol.RELEASE)  # the next sealed command is heard again
        _, err = shim.communicate(timeout=30)
    assert err == "poprun instance 0: a command failed its authentication check on poprun's connection; stopping\n"


#: A program that writes as fast as it is read, and exits with status 3 on SIGTERM, even mid-write.
FLOOD = ("import os, signal\n"
         "signal.signal(signal.SIGTERM, lambda *_: os._exit(3))\n"
         "while True: os.write(1, b'x' * 65536)\n")


@pytest.mark.slow  # starts a shim
def test_a_shim_held_back_by_a_poprun_that_does_not_read_still_obeys_stop_cont_and_terminate() -> None:
    """poprun not reading (its own output stalled, or poprun stopped) is back-pressure: the shim's
    sends wait, its program waits on its pipe (no progress), poprun is not taken for gone, and its
    commands are obeyed meanwhile: STOP stops the program (state T), CONT continues it, TERMINATE ends it."""
    with shim_session(PYTHON, "-c", FLOOD) as (shim, poprun):
        wait_until(lambda: len(sweep.descendants(shim.pid)) == 1, "the program started")
        (program,) = sweep.descendants(shim.pid)
        held_back([program])  # nothing is read from the shim from here on
        poprun.send(protocol.STOP)
        wait_until(lambda: states([program]) == ["T"], "the program stopped")
        poprun.send(protocol.CONT)
        wait_until(lambda: states([program]) != ["T"], "the program continued")
        assert shim.poll() is None
        poprun.send(protocol.TERMINATE)
        assert poprun.exit_report() == (3, None, None, 0)


#: Floods stdout from a thread; once the file argv[1] exists, raises an uncaught exception (its
#: traceback goes to stderr) and lingers in an atexit hook, which first makes the file argv[2].
TRACEBACK_HELD_BACK = ("import atexit, os, sys, threading, time\n"
                       "def flood():\n"
                       "    while True: os.write(1, b'x' * 65536)\n"
                       "threading.Thread(target=flood, daemon=True).start()\n"
                       "while not os.path.exists(sys.argv[1]): time.sleep(0.01)\n"
                       "atexit.register(lambda: (open(sys.argv[2], 'w').close(), time.sleep(60)))\n"
                       "raise ValueError('held in the pipe')\n")


@pytest.mark.slow  # starts a shim
def test_terminate_reads_the_traceback_left_in_the_pipe_and_says_the_program_had_failed(tmp_path: Path) -> None:
    """The shim waits to send (poprun reads nothing) while its program prints an uncaught exception
    and lingers on its way out: the traceback is still in the pipe when TERMINATE comes. The shim
    reads it before it stops the program, passes it on (after the frame it was sending, whole),
    and says the program had printed an uncaught exception (protocol.UNCAUGHT) before the stop."""
    go, lingering = tmp_path / "go", tmp_path / "lingering"
    with shim_session(PYTHON, "-c", TRACEBACK_HELD_BACK, str(go), str(lingering)) as (shim, poprun):
        wait_until(lambda: len(sweep.descendants(shim.pid)) == 1, "the program started")
        held_back(sweep.descendants(shim.pid))  # nothing is read from the shim from here on
        go.touch()
        wait_until(lingering.exists, "the program's traceback printed")
        poprun.send(protocol.TERMINATE)
        assert poprun.exit_report() == (128 + signal.SIGTERM, signal.SIGTERM, None, 0)
    kinds = [kind for kind, _, _ in poprun.frames]
    (at,) = [i for i, kind in enumerate(kinds) if kind == protocol.UNCAUGHT]
    read_ns, line = protocol.read_uncaught(poprun.frames[at][2])
    assert line == "ValueError: held in the pipe"
    stderr = b"".join(payload for kind, stream, payload in poprun.frames[:at] if (kind, stream) == (protocol.OUTPUT, 2))
    assert stderr.startswith(b"Traceback (most recent call last):\n") and stderr.endswith(b"\n" + line.encode() + b"\n")
    (times,) = [payload for kind, _, payload in poprun.frames if kind == protocol.TIMES]
    _, stopped_ns, _ = protocol.read_times(times)
    assert 0 < read_ns < stopped_ns


#: Prints the start of a traceback (its header and a frame), makes the file argv[1], waits for the
#: file argv[2] (bounded), then prints the traceback's last line and lingers on its way out.
TRACEBACK_BEING_PRINTED = ("import os, sys, time\n"
                           "os.write(2, b'Traceback (most recent call last):\\n  File \"<job>\", line 1\\n')\n"
                           "open(sys.argv[1], 'w').close()\n"
                           "give_up = time.monotonic() + 60\n"
                           "while not os.path.exists(sys.argv[2]) and time.monotonic() < give_up: time.sleep(0.01)\n"
                           "os.write(2, b'KeyError: late\\n')\n"
                           "time.sleep(60)\n")


@pytest.mark.slow  # starts a shim
def test_terminate_waits_for_a_traceback_being_printed_to_end(tmp_path: Path) -> None:
    """TERMINATE comes while the program is printing a traceback (its header and a frame, not yet
    its exception's line): the shim does not stop it yet (a STOP sent after the TERMINATE finds it
    alive, stopped and not killed: a SIGTERM before would have killed it first), and once the
    traceback is whole it says the program had failed (protocol.UNCAUGHT) and stops it."""
    half, rest = tmp_path / "half", tmp_path / "rest"
    waits = {environment.KILL_GRACE: "60"}  # the most the shim waits for the traceback: the test's bound
    with shim_session(PYTHON, "-c", TRACEBACK_BEING_PRINTED, str(half), str(rest), env=waits) as (shim, poprun):
        wait_until(half.exists, "the traceback's start printed")
        [program] = sweep.descendants(shim.pid)
        # One write, read in order: the STOP is obeyed after the TERMINATE.
        poprun.connection.sendall(poprun.seal.seal(protocol.TERMINATE) + poprun.seal.seal(protocol.STOP))
        wait_until(lambda: states([program]) == ["T"], "the program stopped (SIGSTOP)")
        poprun.send(protocol.CONT)
        rest.touch()
        assert poprun.exit_report() == (128 + signal.SIGTERM, signal.SIGTERM, None, 0)
    kinds = [kind for kind, _, _ in poprun.frames]
    (at,) = [i for i, kind in enumerate(kinds) if kind == protocol.UNCAUGHT]
    assert protocol.read_uncaught(poprun.frames[at][2])[1] == "KeyError: late"


@pytest.mark.slow  # starts a shim
def test_terminate_stops_at_once_a_program_whose_traceback_went_on_to_other_output(tmp_path: Path) -> None:
    """A traceback followed by other lines (a logged exception, and the program went on) is no
    traceback being printed: TERMINATE stops the program at once, and no UNCAUGHT is said."""
    program = ("import os, time\n"
               "os.write(2, b'Traceback (most recent call last):\\n  File \"<job>\", line 1\\nthen more\\n')\n"
               "time.sleep(60)\n")
    with shim_session(PYTHON, "-c", program, env=GRACE) as (_, poprun):
        poprun.output(b"then more")
        poprun.send(protocol.TERMINATE)
        assert poprun.exit_report() == (128 + signal.SIGTERM, signal.SIGTERM, None, 0)
    assert protocol.UNCAUGHT not in [kind for kind, _, _ in poprun.frames]


@pytest.mark.slow  # starts a shim
def test_poprun_gone_stops_the_program() -> None:
    with shim_session(PYTHON, "-c", STUBBORN, env=GRACE) as (shim, poprun):
        poprun.output(b"ready")
        poprun.connection.shutdown(socket.SHUT_WR)
        assert shim.wait(timeout=30) == 128 + signal.SIGKILL


def _shim_without_poprun(env: dict[str, str]) -> tuple[int, str, str]:
    result = run([PYTHON, "-S", str(SHIM_ENTRY), "0"], env=env)
    return result.returncode, result.stdout, result.stderr


@pytest.mark.slow  # starts a shim
def test_a_shim_without_the_secret_does_not_connect_and_starts_nothing() -> None:
    # Nothing listens at port 1: a shim that tried to connect would name the refusal instead.
    status, out, err = _shim_without_poprun({environment.CONTROL: "127.0.0.1:1"})
    assert (status, out) == (NOT_STARTED, "")
    assert err == (f"poprun instance 0: cannot reach poprun at 127.0.0.1:1 (no {environment.SECRET} in its "
                   "environment (was it dropped by mpiexec's options?)); the program was not started\n")


@pytest.mark.slow  # starts a shim
def test_a_shim_started_without_poprun_s_address_or_secret_says_so_and_starts_nothing() -> None:
    status, out, err = _shim_without_poprun({})  # as if mpiexec's options dropped them
    assert (status, out) == (NOT_STARTED, "")
    assert err == (f"poprun instance 0: cannot reach poprun (no {environment.CONTROL} or {environment.SECRET} in "
                   "its environment (was it dropped by mpiexec's options?)); the program was not started\n")


@pytest.mark.slow  # starts a shim
def test_a_shim_without_a_job_address_ends_no_process_by_its_marks() -> None:
    """Without poprun's address there are no marks of a job to know its processes by: a process
    whose environment holds the instance index and a control address of "None" is left alone."""
    outsider = subprocess.Popen(["sleep", "60"], env={environment.CONTROL: "None", environment.INSTANCE_INDEX: "0"})
    try:
        deadline = time.monotonic() + 10
        while not Path(f"/proc/{outsider.pid}/environ").read_bytes():  # Popen returns mid-exec
            assert time.monotonic() < deadline
            time.sleep(0.001)
        status, out, _ = _shim_without_poprun({})
        assert (status, out) == (NOT_STARTED, "")
        assert outsider.poll() is None
    finally:
        outsider.kill()
        outsider.wait(timeout=10)


@pytest.mark.slow  # starts a shim
def test_the_program_starts_with_sigpipe_and_sigxfsz_at_their_defaults() -> None:
    """The shim's interpreter ignores SIGPIPE (and SIGXFSZ); the program must not inherit that: a
    shell pipeline's writer would then carry on after its reader left. Read from the program's own
    /proc status (a Python program would set SIGPIPE aside itself)."""
    result, frames = run_shim("grep", "^SigIgn:", "/proc/self/status")
    assert result.returncode == 0, result.stderr
    said = b"".join(payload for kind, _, payload in frames if kind == protocol.OUTPUT)
    ignored = int(said.split()[1], 16)
    assert ignored & (1 << (signal.SIGPIPE - 1)) == 0 and ignored & (1 << (signal.SIGXFSZ - 1)) == 0, said


def _answer_hello_with(answer: Callable[[socket.socket, Seal], None]) -> tuple[int, str, str]:
    """A shim against a listener that reads its HELLO and then does ``answer`` (with the seal of
    poprun's end) instead of sending the program."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        address = f"127.0.0.1:{server.getsockname()[1]}"

        def serve() -> None:
            connection, _ = server.accept()
            with connection:
                connection.settimeout(30)
                poprun = Poprun(connection, None)
                poprun.until(lambda frame: frame[0] == protocol.HELLO)
                answer(connection, poprun.seal)

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        result = _shim_without_poprun({environment.CONTROL: address, environment.SECRET: SECRET})
        thread.join(timeout=30)
    return result


@pytest.mark.slow  # starts a shim
def test_a_poprun_that_closes_after_hello_starts_nothing() -> None:
    status, out, err = _answer_hello_with(lambda connection, _: connection.shutdown(socket.SHUT_WR))
    assert (status, out) == (NOT_STARTED, "")
    assert err == ("poprun instance 0: did not receive the program from poprun (poprun closed the connection); "
                   "the program was not started\n")


@pytest.mark.slow  # starts a shim
def test_a_program_that_fails_its_check_is_not_started(tmp_path: Path) -> None:
    made = tmp_path / "made"
    forged = Seal(new_secret(), new_nonce(), TO_SHIM)  # sealed by someone without this run's secret

    def forge(connection: socket.socket, _: Seal) -> None:
        connection.sendall(forged.seal(protocol.encode_program([b"touch", bytes(made)])))
        connection.recv(1)  # until the shim has read it and closed

    status, out, err = _answer_hello_with(forge)
    assert (status, out) == (NOT_STARTED, "") and not made.exists()
    assert err == ("poprun instance 0: did not receive the program from poprun (the program failed its "
                   "authentication check); the program was not started\n")


@pytest.mark.slow  # starts a shim
def test_a_program_longer_than_the_host_takes_is_refused_before_it_is_read() -> None:
    limit = os.sysconf("SC_ARG_MAX")

    def claim(connection: socket.socket, _: Seal) -> None:
        connection.sendall(protocol.PROGRAM + protocol.PROGRAM_LENGTH.pack(limit + 1))
        connection.recv(1)

    status, out, err = _answer_hello_with(claim)
    assert (status, out) == (NOT_STARTED, "")
    assert err == ("poprun instance 0: did not receive the program from poprun (its first message is not a "
                   f"program of at most {limit} bytes); the program was not started\n")


@pytest.mark.slow  # starts a shim
def test_a_poprun_that_closes_before_its_nonce_is_not_reached() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        address = f"127.0.0.1:{server.getsockname()[1]}"

        def close_at_once() -> None:
            connection, _ = server.accept()
            connection.close()

        thread = threading.Thread(target=close_at_once, daemon=True)
        thread.start()
        status, out, err = _shim_without_poprun({environment.CONTROL: address, environment.SECRET: SECRET})
        thread.join(timeout=30)
    assert (status, out) == (NOT_STARTED, "")
    assert err == (f"poprun instance 0: cannot reach poprun at {address} (it closed the connection before it "
                   "said anything); the program was not started\n")


class _Pieces:
    """A connection that delivers what poprun sent in the pieces TCP may cut it into."""

    def __init__(self, *pieces: bytes) -> None:
        self.pieces = list(pieces)
        self.timeouts: list[float | None] = []
        self.asked: list[int] = []

    def settimeout(self, timeout: float | None) -> None:
        self.timeouts.append(timeout)

    def recv(self, size: int) -> bytes:
        self.asked.append(size)
        return self.pieces.pop(0)


def test_the_nonce_is_read_whole_from_its_pieces_and_nothing_after_it() -> None:
    nonce = bytes(range(protocol.NONCE_SIZE))
    connection = _Pieces(nonce[:5], nonce[5:11], nonce[11:])
    assert read_nonce(connection, 7.0) == nonce  # type: ignore[arg-type]
    assert connection.timeouts == [7.0, None]  # bounded while it waits, not after
    assert connection.asked == [16, 11, 5]  # never more than the rest of the nonce
    poprun_end, shim_end = socket.socketpair()
    with poprun_end, shim_end:
        poprun_end.sendall(nonce + protocol.TERMINATE)  # a command right behind it
        assert read_nonce(shim_end, 10) == nonce
        assert shim_end.recv(64) == protocol.TERMINATE


def test_a_nonce_that_never_comes_is_given_up_on() -> None:
    poprun_end, shim_end = socket.socketpair()
    with poprun_end, shim_end, pytest.raises(TimeoutError):
        read_nonce(shim_end, 0.1)


def test_a_program_that_cannot_start_is_named_not_found_or_not_executable(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "here").write_text("#!/bin/sh\n")  # in the working directory, not on PATH; not executable
    monkeypatch.chdir(tmp_path)
    for argv, code in [([b"here"], errno.ENOENT), ([bytes(tmp_path / "here")], errno.EACCES),
                       ([bytes(tmp_path / "absent")], errno.ENOENT), ([b"no-such-program-xyz"], errno.ENOENT)]:
        failed = spawn(argv, no_stdin=True)
        assert isinstance(failed, OSError) and failed.errno == code, (argv, failed)


LOCAL, OMP = environment.LOCAL_WORLD_SIZE, environment.OMP_NUM_THREADS


@pytest.mark.parametrize("environ, threads", [
    ({LOCAL: "2"}, lambda: threads_per_instance(2)),
    ({LOCAL: "3"}, lambda: threads_per_instance(3)),
    ({LOCAL: "2", OMP: "7"}, lambda: "7"),  # the user's value stays
    ({LOCAL: "1"}, lambda: None),  # alone on its host: all its cores
    ({}, lambda: None),
    ({LOCAL: "two"}, lambda: None)])
def test_the_cores_of_a_host_are_divided_among_its_instances(environ: dict[str, str], threads: Callable[[], object],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (LOCAL, OMP):  # set, then unset: either way each is restored after the test
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    divide_cores()
    expected = threads()
    assert os.environ.get(OMP) == (None if expected is None else str(expected))


def test_a_count_of_instances_that_is_no_count_is_one_warning_and_divides_nothing(
        monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv(OMP, "")
    monkeypatch.delenv(OMP)
    monkeypatch.setenv(LOCAL, "two")
    divide_cores()
    assert OMP not in os.environ
    assert capfd.readouterr().err == (f"poprun: warning: on host {os.uname().nodename}: {LOCAL}='two' is not an "
                                      f"integer (use a whole number >= 0); {OMP} is left unset\n")


@pytest.mark.slow  # starts a shim
def test_a_reset_connection_to_poprun_stops_the_program() -> None:
    with shim_session(PYTHON, "-c", STUBBORN, env=GRACE) as (shim, poprun):
        poprun.output(b"ready")
        # SO_LINGER on, with a zero timeout: close sends a reset, which the shim reads as an error.
        poprun.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        poprun.connection.close()
        assert shim.wait(timeout=30) == 128 + signal.SIGKILL


@pytest.mark.slow  # starts a shim
def test_an_error_file_that_cannot_be_made_is_dropped_with_a_warning(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")  # a file where the error file's directory would have to be
    result, frames = run_shim(PYTHON, "-c", "print('hi'); raise SystemExit(5)",
                              env={environment.TORCHELASTIC_ERROR_FILE: str(blocker / "dir" / "error.json")})
    err = result.stderr
    assert result.returncode == 5 and b"".join(p for kind, _, p in frames if kind == protocol.OUTPUT) == b"hi\n"
    assert re.fullmatch(rf"poprun: warning: on host {re.escape(os.uname().nodename)}: no "
                        rf"{environment.TORCHELASTIC_ERROR_FILE} for the program: .+\n", err.splitlines(True)[0]), err


@pytest.mark.slow  # starts a shim
def test_a_shim_not_released_hangs_up_its_pmi_line_before_it_exits() -> None:
    # Hydra takes an instance's PMI line ending before its process does for one that left without
    # MPI_Finalize, and ends the job; seeing both at the same moment it at times took it for one that
    # finished, and the job's other instances waited for ever.
    line_read, line_write = os.pipe()
    try:
        with shim_session("/bin/true", env={environment.PMI_FD: str(line_write)},
                          pass_fds=(line_write,)) as (shim, poprun):
            os.close(line_write)
            line_write = -1
            assert poprun.exit_report()[0] == 0
            # No RELEASE: once its wait is over the shim hangs up, then waits for mpiexec to act.
            ready, _, _ = select.select([line_read], [], [], SUBPROCESS_TIMEOUT)
            assert ready and os.read(line_read, 1) == b""
            assert shim.poll() is None  # the line ended while the shim still ran
            shim.send_signal(signal.SIGTERM)  # mpiexec ending the job ends that wait
            assert shim.wait(timeout=SUBPROCESS_TIMEOUT) == 0
    finally:
        os.close(line_read)
        if line_write >= 0:
            os.close(line_write)
